"""torch's own varlen kernel (``torch.nn.attention.varlen.varlen_attn``) behind the packed and vision
attention on CUDA: which varlen kernel is picked, how this torch's signature is read, and our call.

No GPU here (and ``varlen_attn`` has no CPU kernel: ``aten::_flash_attention_forward`` is CUDA
only), so the calls run against strict stand-ins of ``varlen_attn`` in each signature torch has
shipped: they check the layout its documentation gives (``(total, heads, dim)`` tensors, int32
cumulative offsets on the tensors' device, the longest segment as host ints, the causal flag,
the scale) and then compute the reference, causal or not, SDPA run separately on every segment.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

from magistral_cli.ops import attention_kernels as kernels
from magistral_cli.ops import packed_attention as pa
from magistral_cli.ops import vision_attention as va
from magistral_cli.ops.attention_kernels import (
    TORCH_VARLEN,
    VARLEN_KERNEL_NAMES,
    read_varlen_signature,
    record_varlen_kernels,
    varlen_attention,
    varlen_kernel,
)

BATCH, HEADS, KV_HEADS, LENGTH, DIM = 2, 4, 2, 12, 8
NEAT_ENDS = (5, 9, 12, 15, 22, 24)
ROW_ENDS = (9, 12, 22, 24)


def segment_reference(q, k, v, ends, *, causal, scale=None):
    """``[total, heads, dim]``: SDPA (fp32) run separately on every segment; k/v heads repeated."""
    repeat = q.shape[1] // k.shape[1]
    pieces, start = [], 0
    for end in ends:
        qs, ks, vs = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        pieces.append(
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).transpose(0, 1)
        )
        start = end
    return torch.cat(pieces)


# ----------------------------------------------------------------------------- stand-ins


class StandIn:
    """``varlen_attn`` in one of its signatures, strict about the documented layout; records calls."""

    def __init__(self, form: str, *, mixes_segments: bool = False):
        self.form, self.mixes_segments, self.calls = form, mixes_segments, []
        self.function = {"2.13": self._v213, "2.11": self._v211, "2.10": self._v210}[form]

    def _check(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, gqa):
        assert query.dim() == key.dim() == value.dim() == 3, "query / key / value are (total, heads, dim)"
        assert query.shape[0] == key.shape[0] == value.shape[0] and key.shape == value.shape
        assert query.shape[2] == key.shape[2], "one head dim"
        if gqa:
            assert query.shape[1] % key.shape[1] == 0
        else:
            assert query.shape[1] == key.shape[1], "equal heads unless enable_gqa"
        assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
        assert all(t.stride(-1) == 1 for t in (query, key, value)), "a contiguous last dimension"
        for cu in (cu_seq_q, cu_seq_k):
            assert isinstance(cu, torch.Tensor) and cu.dim() == 1
            assert cu.dtype == torch.int32 and cu.device == query.device, (
                "int32 offsets on the tensors' device"
            )
        values = cu_seq_q.tolist()
        assert cu_seq_k.tolist() == values and values[0] == 0 and values[-1] == query.shape[0]
        assert all(b > a for a, b in zip(values, values[1:], strict=False)), "no empty segment"
        longest = max(b - a for a, b in zip(values, values[1:], strict=False))
        for m in (max_q, max_k):
            assert type(m) is int and m == longest, f"max lengths are host ints of the longest segment ({m})"
        assert scale is None or type(scale) is float
        return tuple(values[1:])

    def _run(self, query, key, value, ends, causal, scale):
        self.calls.append({"causal": causal, "scale": scale, "ends": ends, "kv_heads": key.shape[1]})
        if self.mixes_segments:
            ends = (query.shape[0],)
        return segment_reference(query, key, value, ends, causal=causal, scale=scale).to(query.dtype)

    @staticmethod
    def _window(window_size):
        # torch 2.13 reads causal as ``window_size == (-1, 0)``: a list would be a sliding window.
        assert type(window_size) is tuple and window_size in ((-1, -1), (-1, 0)), window_size
        return window_size == (-1, 0)

    def _v213(
        self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
    ):  # fmt: skip
        assert return_aux is None and seqused_k is None and block_table is None and num_splits is None
        ends = self._check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, enable_gqa)
        return self._run(query, key, value, ends, self._window(window_size), scale)

    def _v211(
        self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1),
    ):  # fmt: skip
        assert return_aux is None
        ends = self._check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, False)
        return self._run(query, key, value, ends, self._window(window_size), scale)

    def _v210(
        self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None
    ):  # fmt: skip
        assert return_aux is None and type(is_causal) is bool
        ends = self._check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, False)
        return self._run(query, key, value, ends, is_causal, scale)


@pytest.fixture(params=["2.13", "2.11", "2.10"])
def stand_in(request, monkeypatch):
    """torch's varlen_attn replaced by a strict stand-in of one signature."""
    fake = StandIn(request.param)
    api = read_varlen_signature(fake.function)
    assert api is not None
    monkeypatch.setattr(kernels, "torch_varlen_api", lambda: api)
    return fake


def _pick_torch_varlen(monkeypatch):
    """The CUDA choice on this CPU machine: torch's varlen kernel for half precision."""

    def pick(device, dtype, head_dim, dropout=0.0, *, first="flash_attention_3"):
        return TORCH_VARLEN if dtype in (torch.float16, torch.bfloat16) and dropout == 0.0 else None

    monkeypatch.setattr(pa, "varlen_kernel", pick)
    monkeypatch.setattr(va, "varlen_kernel", pick)


# ----------------------------------------------------------------------------- the signature


def test_the_installed_torch_has_the_keyword_form():
    from torch.nn.attention.varlen import varlen_attn

    api = read_varlen_signature(varlen_attn)
    assert api is not None and api.causal == "window_size"
    assert api.gqa == ("enable_gqa" in inspect.signature(varlen_attn).parameters)
    kernels.torch_varlen_api.cache_clear()
    try:
        assert kernels.torch_varlen_api() == api
    finally:
        kernels.torch_varlen_api.cache_clear()


def test_each_shipped_signature_is_read_and_unknown_ones_are_not():
    forms = {form: read_varlen_signature(StandIn(form).function) for form in ("2.13", "2.11", "2.10")}
    assert {f: (a.causal, a.gqa) for f, a in forms.items()} == {
        "2.13": ("window_size", True),
        "2.11": ("window_size", False),
        "2.10": ("is_causal", False),
    }

    def no_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        pass

    def renamed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale=None, causal=False):
        pass

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        pass

    assert read_varlen_signature(no_scale) is None  # a scale we cannot pass: sdpa instead
    assert read_varlen_signature(renamed) is None
    assert read_varlen_signature(no_causal) is None


def test_a_torch_without_varlen_attn_has_none(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # ImportError on import
    kernels.torch_varlen_api.cache_clear()
    try:
        assert kernels.torch_varlen_api() is None
    finally:
        monkeypatch.undo()
        kernels.torch_varlen_api.cache_clear()


# ----------------------------------------------------------------------------- the choice


@pytest.fixture
def cuda_here(monkeypatch):
    """What varlen_kernel sees on a CUDA machine; tests set what is installed."""
    available = {2: False, 3: False, "torch": True, "sm80": True}
    monkeypatch.setattr(kernels, "flash_attention_available", lambda version: available[version])
    monkeypatch.setattr(kernels, "torch_varlen_api", lambda: object() if available["torch"] else None)
    monkeypatch.setattr(kernels, "_torch_varlen_runs_on", lambda index: available["sm80"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return available


def test_the_order_is_fa3_fa2_torch_none(cuda_here):
    bf16 = torch.bfloat16
    cuda_here.update({2: True, 3: True})
    assert varlen_kernel("cuda", bf16, 128) == "flash_attention_3"
    assert varlen_kernel("cuda", bf16, 128, dropout=0.1) == "flash_attention_2"  # FA3 has no dropout
    cuda_here[3] = False
    assert varlen_kernel("cuda:1", torch.float16, 128) == "flash_attention_2"
    cuda_here[2] = False
    assert varlen_kernel("cuda", bf16, 128) == TORCH_VARLEN
    assert varlen_kernel(torch.device("cuda", 0), bf16, 64) == TORCH_VARLEN
    assert varlen_kernel("cuda", bf16, None) == TORCH_VARLEN  # a report that does not know the head dim
    cuda_here["torch"] = False
    assert varlen_kernel("cuda", bf16, 128) is None


def test_torch_varlen_is_skipped_where_it_cannot_run(cuda_here):
    bf16 = torch.bfloat16
    assert varlen_kernel("cuda", bf16, 128) == TORCH_VARLEN
    assert varlen_kernel("cuda", torch.float32, 128) is None  # fp32: sdpa
    assert varlen_kernel("cpu", bf16, 128) is None
    assert varlen_kernel("npu", bf16, 128) is None
    assert varlen_kernel("cuda", bf16, 128, dropout=0.1) is None  # no dropout in torch's kernel
    assert varlen_kernel("cuda", bf16, 20) is None  # head dim not a multiple of 8
    assert varlen_kernel("cuda", bf16, 512) is None  # over 256
    cuda_here["sm80"] = False  # before Ampere, or ROCm
    assert varlen_kernel("cuda", bf16, 128) is None


def test_first_starts_later_in_the_order(cuda_here):
    cuda_here.update({2: True, 3: True})
    bf16 = torch.bfloat16
    assert varlen_kernel("cuda", bf16, 128, first="flash_attention_2") == "flash_attention_2"
    assert varlen_kernel("cuda", bf16, 128, first=TORCH_VARLEN) == TORCH_VARLEN


def test_the_packed_kernel_names_enter_the_order_at_their_place(cuda_here):
    path = pa.kernel_path
    bf16 = torch.bfloat16
    # flash-attn missing (resolve_attention then gives sdpa): torch's varlen kernel, not the dense mask
    assert path("sdpa", "cuda", bf16, head_dim=128) == TORCH_VARLEN
    assert path("flash_attention_2", "cuda", bf16, head_dim=128) == TORCH_VARLEN
    assert path("sdpa", "cuda", torch.float32, head_dim=128) == "sdpa"
    assert path("sdpa", "cuda", bf16, head_dim=128, dropout=0.1) == "sdpa"
    assert path("eager", "cuda", bf16, head_dim=128) == "eager"
    assert path("sdpa", "cpu", bf16, head_dim=128) == "sdpa"
    cuda_here.update({2: True, 3: True})
    assert path("flash_attention_3", "cuda", bf16, head_dim=128) == "flash_attention_3"
    assert path("flash_attention_2", "cuda", bf16, head_dim=128) == "flash_attention_2"
    assert path("sdpa", "cuda", bf16, head_dim=128) == TORCH_VARLEN  # sdpa keeps to torch's kernels
    assert path("flash_attention_3", "cuda", bf16, head_dim=128, dropout=0.1) == "flash_attention_2"
    assert pa.path_name(TORCH_VARLEN) == "torch.nn.attention.varlen.varlen_attn"


def test_the_vision_report_names_the_kernel_the_forward_picks(cuda_here):
    assert va.vision_attention_kernel("cuda", torch.bfloat16, 64) == TORCH_VARLEN
    assert va.vision_attention_backend("cuda") == "torch.nn.attention.varlen.varlen_attn"
    assert va.vision_attention_backend("cuda", torch.float32) == "torch sdpa per image"
    assert va.vision_attention_backend("cuda", head_dim=20) == "torch sdpa per image"
    assert va.vision_attention_kernel("npu", torch.bfloat16, 64) == "npu"
    assert va.vision_attention_kernel("npu", torch.float32, 64) == "sdpa"
    cuda_here[3] = True
    assert va.vision_attention_backend("cuda") == VARLEN_KERNEL_NAMES["flash_attention_3"]
    assert va.vision_attention_kernel("cuda", torch.bfloat16, 64, dropout=0.1) == "sdpa"


# ----------------------------------------------------------------------------- the call


def _qkv(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((BATCH, HEADS, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM))
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in shapes)


def _flat(t):
    return t.transpose(1, 2).reshape(BATCH * LENGTH, t.shape[1], DIM)


@pytest.mark.parametrize("ends", [NEAT_ENDS, ROW_ENDS], ids=["neat", "plain"])
def test_packed_call_gets_causal_segments_scale_and_gqa(stand_in, ends):
    q, k, v = _qkv()
    cu = torch.tensor([0, *ends], dtype=torch.int32)
    longest = max(b - a for a, b in zip([0, *ends], ends, strict=False))
    with record_varlen_kernels() as ran:
        out = pa._varlen(q, k, v, cu, longest, 0.0, DIM**-0.5, TORCH_VARLEN)
    assert ran == [TORCH_VARLEN]
    assert out.shape == (BATCH, LENGTH, HEADS, DIM) and out.dtype == torch.bfloat16
    (call,) = stand_in.calls
    assert call["causal"] is True and call["scale"] == DIM**-0.5 and call["ends"] == ends
    assert call["kv_heads"] == (KV_HEADS if stand_in.form == "2.13" else HEADS)  # enable_gqa, else repeated
    expected = segment_reference(_flat(q), _flat(k), _flat(v), ends, causal=True, scale=DIM**-0.5)
    torch.testing.assert_close(out.float(), expected.view(BATCH, LENGTH, HEADS, DIM), rtol=2e-2, atol=2e-2)


def test_packed_forward_and_backward_take_the_torch_path(stand_in, monkeypatch):
    _pick_torch_varlen(monkeypatch)
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    cu = torch.tensor([0, *NEAT_ENDS], dtype=torch.int32)
    with record_varlen_kernels() as ran:
        out, _ = pa.packed_attention_forward(
            None, q, k, v, None, scaling=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
            max_length_k=7, packed_seq_ends=NEAT_ENDS, kernel="sdpa",
        )  # fmt: skip
    assert ran == [TORCH_VARLEN]
    assert stand_in.calls[0]["scale"] is None  # the kernel's default, 1/sqrt(dim)
    leaves = [_flat(t.detach().float()).requires_grad_(True) for t in (q, k, v)]
    expected = segment_reference(*leaves, NEAT_ENDS, causal=True).view(BATCH, LENGTH, HEADS, DIM)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    grad = torch.randn(out.shape)
    out.backward(grad.to(out.dtype))
    expected.backward(grad)
    for mine, theirs in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(_flat(mine.grad).float(), theirs.grad, rtol=5e-2, atol=5e-2)
    # fp32 keeps the dense-mask SDPA (torch's kernel takes half precision only)
    with record_varlen_kernels() as ran:
        pa.packed_attention_forward(None, *(t.detach().float() for t in (q, k, v)), None, kernel="sdpa")
    assert ran == []


@pytest.mark.parametrize("segments", [None, (LENGTH, 2 * LENGTH)], ids=["no-cu_seqlens", "rows"])
def test_one_segment_a_row_takes_causal_sdpa_not_torch_varlen(stand_in, monkeypatch, segments):
    _pick_torch_varlen(monkeypatch)
    assert pa.kernel_path("sdpa", "cuda", torch.bfloat16, head_dim=DIM, whole_rows=True) == "sdpa_causal"
    q, k, v = _qkv()
    kwargs = {}
    if segments is not None:
        cu = torch.tensor([0, *segments], dtype=torch.int32)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=LENGTH, max_length_k=LENGTH)
    with record_varlen_kernels() as ran:
        out, _ = pa.packed_attention_forward(
            None, q, k, v, None, scaling=DIM**-0.5, packed_seq_ends=segments, kernel="sdpa", **kwargs
        )
    assert ran == [] and stand_in.calls == []
    expected = segment_reference(
        _flat(q), _flat(k), _flat(v), (LENGTH, 2 * LENGTH), causal=True, scale=DIM**-0.5
    )
    torch.testing.assert_close(out.float(), expected.view(BATCH, LENGTH, HEADS, DIM), rtol=2e-2, atol=2e-2)


def test_large_images_keep_sdpa_per_image(cuda_here):
    kernel = va.vision_attention_kernel
    limit = va.TORCH_VARLEN_MAX_MEAN_PATCHES
    assert kernel("cuda", torch.bfloat16, 64, ends=[64, 160]) == TORCH_VARLEN
    assert kernel("cuda", torch.bfloat16, 64, ends=[limit - 1]) == TORCH_VARLEN
    assert kernel("cuda", torch.bfloat16, 64, ends=[limit]) == "sdpa"  # SDPA per image is faster
    assert kernel("cuda", torch.bfloat16, 64, ends=[12100, 12100 + 64]) == "sdpa"  # on average
    assert kernel("cuda", torch.bfloat16, 64, ends=[784 * (i + 1) for i in range(16)]) == TORCH_VARLEN
    cuda_here[2] = True  # flash-attn keeps every size, as before
    assert kernel("cuda", torch.bfloat16, 64, ends=[12100]) == "flash_attention_2"


def test_dropout_is_never_sent_to_kernels_without_it():
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for kernel in (TORCH_VARLEN, "flash_attention_3"):
        with pytest.raises(ValueError, match="no dropout"):
            varlen_attention(q, q, q, cu, 4, None, 0.1, causal=True, kernel=kernel)
    with pytest.raises(ValueError, match="no varlen kernel"):
        varlen_attention(q, q, q, cu, 4, None, 0.0, causal=True, kernel="sdpa")


@pytest.fixture(scope="module")
def tower():
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(tiny_mistral3_config(vocab_size=512, patch_size=2))
    return model.model.vision_tower.to(torch.bfloat16).eval()


def test_vision_call_is_non_causal_per_image(stand_in, monkeypatch, tower):
    _pick_torch_varlen(monkeypatch)
    reference = copy.deepcopy(tower)
    va.apply_vision_attention(reference, "cpu")
    patched = copy.deepcopy(tower)
    va.apply_vision_attention(patched, "cpu")
    pixels = torch.randn(2, 3, 16, 24, dtype=torch.bfloat16)
    sizes = torch.tensor([[16, 16], [16, 24]])
    with record_varlen_kernels() as ran:
        actual = patched(pixels, image_sizes=sizes).last_hidden_state
    layers = tower.config.num_hidden_layers
    assert ran == [TORCH_VARLEN] * layers
    assert [c["ends"] for c in stand_in.calls] == [(64, 160)] * layers
    assert all(c["causal"] is False and c["scale"] == tower.config.head_dim**-0.5 for c in stand_in.calls)
    monkeypatch.setattr(va, "varlen_kernel", lambda *a, **k: None)  # sdpa per image
    expected = reference(pixels, image_sizes=sizes).last_hidden_state
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_stand_ins_are_strict(stand_in):
    q, k, v = (_flat(t) for t in _qkv())
    cu = torch.tensor([0, *NEAT_ENDS], dtype=torch.int32)
    call = stand_in.function
    kv = {"enable_gqa": True} if stand_in.form == "2.13" else {}
    causal = {"is_causal": True} if stand_in.form == "2.10" else {"window_size": (-1, 0)}
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    with pytest.raises(AssertionError):  # int64 offsets
        call(q, k4, v4, cu.long(), cu.long(), 7, 7, **causal)
    with pytest.raises(AssertionError):  # a wrong longest segment
        call(q, k4, v4, cu, cu, 8, 8, **causal)
    with pytest.raises(AssertionError):  # a tensor, not a host int
        call(q, k4, v4, cu, cu, torch.tensor(7), torch.tensor(7), **causal)
    with pytest.raises(AssertionError):  # fp32
        call(q.float(), k4.float(), v4.float(), cu, cu, 7, 7, **causal)
    with pytest.raises(AssertionError):  # fewer key heads without enable_gqa
        call(q, k, v, cu, cu, 7, 7, **causal)
    if stand_in.form != "2.10":
        with pytest.raises(AssertionError):  # a list window: 2.13 would not read it as causal
            call(q, k4, v4, cu, cu, 7, 7, window_size=[-1, 0])
        with pytest.raises(TypeError):  # is_causal is gone from the keyword form
            call(q, k4, v4, cu, cu, 7, 7, is_causal=True)
    call(q, k if kv else k4, v if kv else v4, cu, cu, 7, 7, **kv, **causal)  # the right call passes
