"""The packed attention (``ops.packed_attention``): every kernel sees the segments it is given.

The reference is written here, independently of the module: ``torch`` SDPA called once per
segment with ``is_causal=True``. The CUDA and NPU calls run against stand-ins of
``flash_attn.flash_attn_varlen_func`` and ``torch_npu.npu_fusion_attention`` that check the
layout rules each API documents (shapes, dtypes, offsets) and then compute the reference.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from magistral_cli.ops import packed_attention as pa
from magistral_cli.ops.attention import resolve_attention
from magistral_cli.ops.attention_kernels import NPU_ATTENTION

pytestmark = pytest.mark.compat

BATCH, HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 12, 8
# Row 0: samples of 5 and 4 tokens, then 3 padding tokens; row 1: 3 + 7 tokens, 2 padding.
NEAT_ENDS = (5, 9, 12, 15, 22, 24)
# The same rows as plain packs: each row's real tokens are one segment.
ROW_ENDS = (9, 12, 22, 24)


def _qkv(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=g, dtype=torch.float32)
    k = torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=g, dtype=torch.float32)
    v = torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=g, dtype=torch.float32)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v, ends, scale=None):
    """[B, L, H, D]: causal SDPA run separately on every segment of the flattened tokens."""
    batch, heads, length, dim = q.shape
    repeat = heads // k.shape[1]
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim).float() for t in (q, k, v)]
    out = torch.empty(batch * length, heads, dim)
    start = 0
    for end in ends:
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in flat)
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(
            0, 1
        )
        start = end
    return out.view(batch, length, heads, dim)


def _call(kernel, q, k, v, ends):
    cu = torch.tensor([0, *ends], dtype=torch.int32)
    longest = max(b - a for a, b in zip([0, *ends], ends, strict=False))
    out, weights = pa.packed_attention_forward(
        None, q, k, v, None, scaling=DIM**-0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=longest, max_length_k=longest, packed_seq_ends=ends, kernel=kernel,
    )  # fmt: skip
    assert weights is None
    return out


@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flash_attention_2", NPU_ATTENTION])
@pytest.mark.parametrize("ends", [NEAT_ENDS, ROW_ENDS], ids=["neat", "plain"])
def test_cpu_path_attends_within_segments_only(kernel, ends):
    # On the CPU every kernel name falls back to the masked SDPA / eager math.
    q, k, v = _qkv()
    torch.testing.assert_close(_call(kernel, q, k, v, ends), reference(q, k, v, ends), rtol=1e-5, atol=1e-6)


def test_without_segments_each_row_is_one_causal_sequence():
    q, k, v = _qkv()
    out, _ = pa.packed_attention_forward(None, q, k, v, None, scaling=DIM**-0.5, kernel="sdpa")
    torch.testing.assert_close(out, reference(q, k, v, (LENGTH, 2 * LENGTH)), rtol=1e-5, atol=1e-6)


def test_a_sample_is_not_changed_by_its_neighbours():
    q, k, v = _qkv()
    base = _call("sdpa", q, k, v, NEAT_ENDS)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[0, :, :5] += 3.0  # change the first sample of row 0 only
    changed = _call("sdpa", q2, k2, v2, NEAT_ENDS)
    torch.testing.assert_close(changed[0, 5:], base[0, 5:])  # its pack-mates see nothing of it
    torch.testing.assert_close(changed[1], base[1])
    assert not torch.allclose(changed[0, :5], base[0, :5])
    plain = _call("sdpa", q2, k2, v2, ROW_ENDS)  # a plain pack is causal across samples
    assert not torch.allclose(plain[0, 5:9], _call("sdpa", q, k, v, ROW_ENDS)[0, 5:9])


def test_refusals_name_the_problem():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="not from an attention mask"):
        pa.packed_attention_forward(None, q, k, v, torch.ones(BATCH, LENGTH), kernel="sdpa")
    with pytest.raises(ValueError, match="end at 20"):
        _call("sdpa", q, k, v, (5, 20))
    with pytest.raises(ValueError, match="must start at 0 and end at 24"):
        pa.check_cu_seqlens(torch.tensor([0, 5, 23]), 24)
    with pytest.raises(ValueError, match="increase strictly"):
        pa.check_cu_seqlens(torch.tensor([0, 5, 5, 24]), 24)
    with pytest.raises(ValueError, match="no packed attention"):
        pa.packed_attention_name("flex")


def test_packed_inputs_move_offsets_and_keep_host_ints():
    cu = torch.tensor([0, *NEAT_ENDS], dtype=torch.int32)
    inputs = pa.packed_inputs(cu, (BATCH, LENGTH), torch.device("cpu"))
    assert inputs["seq_ends"] == NEAT_ENDS and inputs["max_seqlen"] == 7
    assert inputs["cu_seqlens"].dtype == torch.int32 and inputs["cu_seqlens"].tolist() == [0, *NEAT_ENDS]


def test_resolve_attention_packed_names_per_device():
    assert resolve_attention("flash_attention_2", "cpu", packed=True) == "magistral_packed_sdpa"
    assert resolve_attention("eager", "cpu", packed=True) == "magistral_packed_eager"
    assert resolve_attention("sdpa", "cpu") == "sdpa"  # no packing: transformers' own, unchanged
    from transformers import AttentionInterface

    assert "magistral_packed_sdpa" in AttentionInterface._global_mapping


# ----------------------------------------------------------------------------- stand-ins


def _check_offsets(cu, total, device):
    assert cu.dtype == torch.int32 and cu.device == device, "cu_seqlens must be int32 on the tensors' device"
    values = cu.tolist()
    assert values[0] == 0 and values[-1] == total and values == sorted(values)
    return values


def _fake_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, **kwargs,
):  # fmt: skip
    # flash-attn's documented layout: q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim),
    # nheads divisible by nheads_k, fp16/bf16, int32 cumulative offsets, max_seqlen the longest segment.
    assert q.dim() == k.dim() == v.dim() == 3 and q.shape[0] == k.shape[0] == v.shape[0]
    assert q.shape[1] % k.shape[1] == 0 and q.dtype in (torch.float16, torch.bfloat16)
    values = _check_offsets(cu_seqlens_q, q.shape[0], q.device)
    assert cu_seqlens_k.tolist() == values
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    assert max_seqlen_q == max_seqlen_k == max(lengths) and isinstance(max_seqlen_q, int)
    assert causal is True and dropout_p == 0.0
    ends = tuple(values[1:])
    heads, dim = q.shape[1], q.shape[2]
    as_batch = [t.view(1, t.shape[0], t.shape[1], dim).transpose(1, 2) for t in (q, k, v)]
    out = reference(*as_batch, ends, scale=softmax_scale)[0]
    return out.to(q.dtype).view(q.shape[0], heads, dim)


def _fake_npu_fusion_attention(
    query, key, value, head_num, input_layout, atten_mask=None, scale=1.0, keep_prob=1.0, sparse_mode=0,
    actual_seq_qlen=None, actual_seq_kvlen=None, **kwargs,
):  # fmt: skip
    # torch_npu's TND layout: (T, N, D) tensors, head_num = N of the query, actual_seq_qlen and
    # actual_seq_kvlen cumulative host ints ending at T; sparse_mode 3 takes the 2048 x 2048
    # upper-triangular (True = masked) causal mask.
    assert input_layout == "TND" and query.dim() == 3 and head_num == query.shape[1]
    assert isinstance(actual_seq_qlen, list) and all(isinstance(x, int) for x in actual_seq_qlen)
    assert actual_seq_qlen == actual_seq_kvlen and actual_seq_qlen[-1] == query.shape[0]
    assert actual_seq_qlen == sorted(actual_seq_qlen) and actual_seq_qlen[0] > 0
    assert sparse_mode == 3 and atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
    assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    assert keep_prob == 1.0 and query.is_contiguous() and key.is_contiguous()
    dim = query.shape[2]
    as_batch = [t.view(1, t.shape[0], t.shape[1], dim).transpose(1, 2) for t in (query, key, value)]
    out = reference(*as_batch, tuple(actual_seq_qlen), scale=scale)[0]
    return (out.to(query.dtype).reshape(query.shape), None, None)


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_fake_flash_attn_varlen_func)
    )
    monkeypatch.setitem(
        sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=_fake_npu_fusion_attention)
    )


@pytest.mark.parametrize("ends", [NEAT_ENDS, ROW_ENDS], ids=["neat", "plain"])
def test_flash_varlen_call_gets_the_segments(stand_ins, ends):
    q, k, v = _qkv(torch.bfloat16)
    cu = torch.tensor([0, *ends], dtype=torch.int32)
    longest = max(b - a for a, b in zip([0, *ends], ends, strict=False))
    out = pa._flash(q, k, v, cu, longest, 0.0, DIM**-0.5, version=2)
    assert out.shape == (BATCH, LENGTH, HEADS, DIM) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q, k, v, ends).float(), rtol=2e-2, atol=2e-2)
    # and the same result as the CPU path on the same inputs
    torch.testing.assert_close(
        out.float(), _call("sdpa", q.float(), k.float(), v.float(), ends), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("ends", [NEAT_ENDS, ROW_ENDS], ids=["neat", "plain"])
def test_npu_tnd_call_gets_the_segments(stand_ins, ends):
    q, k, v = _qkv(torch.bfloat16)
    out = pa._npu(q, k, v, ends, 0.0, DIM**-0.5)
    assert out.shape == (BATCH, LENGTH, HEADS, DIM)
    torch.testing.assert_close(out.float(), reference(q, k, v, ends).float(), rtol=2e-2, atol=2e-2)


def test_stand_ins_reject_wrong_lengths(stand_ins):
    # The stand-ins are strict: an off-by-one offset or a non-causal call fails.
    q, k, v = _qkv(torch.bfloat16)
    with pytest.raises(AssertionError):
        pa._npu(q, k, v, (5, 9, 12, 15, 22, 23), 0.0, None)
    with pytest.raises(AssertionError):
        pa._flash(q, k, v, torch.tensor([0, 9, 12, 22, 24], dtype=torch.int64), 10, 0.0, None, version=2)
