"""Language-model attention over packed batches: each segment attends causally to itself only.

A packed micro-batch comes with ``cu_seqlens``, the cumulative segment boundaries over its
flattened ``[batch * seq]`` tokens (FlashAttention's varlen convention: ``[0, e1, e2, ..., B*L]``).
What a segment is decides the packing mode, and the collator decides it
(``data.collator.PixtralCollator``):

- ``neat_packing: true``: every sample of a pack is a segment, so no sample sees another;
- ``packing: true``: a row's real tokens are one segment (causal across its samples, the seed's
  meaning);

and in both a row's right padding is a segment of its own. Without ``cu_seqlens`` (validation
batches, synthetic batches) each row is one segment: plain causal attention, which right padding
cannot disturb.

One meaning on every device, because this module calls each device's kernel with the segments
explicitly and never lets transformers infer them (its FlashAttention-2 path isolates samples
whenever position ids restart in a one-row micro-batch without padding, its SDPA path never does):

- CPU (and ``eager``, fp32, and CUDA without a varlen kernel): ``torch`` SDPA with a block-diagonal
  causal mask;
- CUDA, bf16 / fp16: the varlen kernel ``ops.attention_kernels.varlen_kernel`` picks, called through
  ``ops.attention_kernels.varlen_attention`` with ``cu_seqlens_q = cu_seqlens_k`` and causal over
  ``[total, heads, dim]``: ``flash_attn_varlen_func`` (FlashAttention-3's ``flash_attn_interface``
  when the kernel is ``flash_attention_3``, flash-attn 2) when installed, else torch's own
  ``torch.nn.attention.varlen.varlen_attn`` (no package; sm80+, head dim a multiple of 8 up to 256,
  no dropout). The ``sdpa`` kernel takes torch's only: it is the FlashAttention kernel behind
  SDPA itself, without the dense mask that keeps SDPA off it. Where every row is one segment
  (no ``cu_seqlens``, or packs that fill their rows) torch's path runs SDPA causal without a mask
  instead (``sdpa_causal``): the same meaning, and SDPA's own kernel is faster there (cuDNN on
  Hopper; see ``kernel_path``);
- NPU: ``torch_npu.npu_fusion_attention`` with ``input_layout="TND"``, ``actual_seq_qlen`` and
  ``actual_seq_kvlen`` (the cumulative ends, host ints), ``sparse_mode=3`` and its 2048 x 2048
  causal mask, as the vision tower's varlen call.

The functions are registered in transformers' attention registry under
``magistral_packed_<kernel>``; names outside transformers' mask registry get no mask built (the
segments carry everything). ``packed_inputs`` turns a host ``cu_seqlens`` into the forward's
keyword arguments (device offsets, the host maximum and ends: no kernel reads them back).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from magistral_cli.runtime import host_to_device

from .attention_kernels import (
    NPU_ATTENTION,
    TORCH_VARLEN,
    VARLEN_KERNEL_NAMES,
    VARLEN_KERNELS,
    AttentionCall,
    attention_function,
    device_type_and_index,
    npu_causal_mask,
    softmax_scale,
    varlen_attention,
    varlen_kernel,
)

PREFIX = "magistral_packed_"
#: the kernels a packed attention name can stand for
KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", NPU_ATTENTION)


def packed_attention_name(kernel: str) -> str:
    """The registered name of the packed attention over ``kernel`` (registers it on first use)."""
    if kernel not in KERNELS:
        raise ValueError(f"no packed attention for {kernel!r}; one of {', '.join(KERNELS)}")
    name = PREFIX + kernel
    _register(name, kernel)
    return name


def is_packed_attention(name: str | None) -> bool:
    return bool(name) and name.startswith(PREFIX)


@functools.cache
def _register(name: str, kernel: str) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(name, functools.partial(packed_attention_forward, kernel=kernel))


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """The ends ``[e1, ..., total]`` of a host ``cu_seqlens``; ValueError unless it starts at 0,
    never decreases and ends at ``total`` (batch x sequence length)."""
    values = [int(v) for v in cu_seqlens.tolist()]
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise ValueError(f"cu_seqlens {values} must start at 0 and end at {total} (batch x sequence length)")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"cu_seqlens {values} must increase strictly (empty segments are not allowed)")
    return values[1:]


def packed_inputs(cu_seqlens: torch.Tensor, shape: tuple[int, int], device: torch.device) -> dict[str, Any]:
    """The model's packed keyword arguments from a host ``cu_seqlens`` for a ``[batch, seq]`` batch:
    ``cu_seqlens`` (int32 on ``device``), ``max_seqlen`` and ``seq_ends`` (host ints)."""
    ends = check_cu_seqlens(cu_seqlens, shape[0] * shape[1])
    lengths = [b - a for a, b in zip([0, *ends], ends, strict=False)]
    return {
        "cu_seqlens": host_to_device(cu_seqlens.to(torch.int32), device),
        "max_seqlen": max(lengths),
        "seq_ends": tuple(ends),
    }


@functools.lru_cache(maxsize=4)
def _segment_mask(ends: tuple[int, ...], batch: int, length: int, device: torch.device) -> torch.Tensor:
    """``[batch, 1, length, length]`` bool: query i may see key j when both are in one segment and j <= i."""
    starts = [0, *ends[:-1]]
    segment = torch.repeat_interleave(
        torch.arange(len(ends)), torch.tensor([e - s for s, e in zip(starts, ends, strict=True)])
    ).view(batch, length)
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (same & causal)[:, None].to(device)


def _masked(query, key, value, ends, dropout, scaling, eager: bool):
    batch, heads, length, _ = query.shape
    mask = _segment_mask(tuple(ends), batch, length, query.device)
    if key.shape[1] != heads:  # grouped-query attention: every query head reads its key/value head
        repeat = heads // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    if eager:
        scores = (query @ key.transpose(-1, -2)) * softmax_scale(scaling, query.shape[-1])
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        weights = F.dropout(weights, p=dropout, training=dropout > 0)
        out = weights @ value
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
        )
    return out.transpose(1, 2)  # [batch, seq, heads, dim]


def _varlen(query, key, value, cu_seqlens, max_seqlen, dropout, scaling, kernel: str):
    """The segments through the CUDA varlen ``kernel`` (one of ``VARLEN_KERNELS``), causal."""
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, causal=True, kernel=kernel)
    return out.view(batch, length, heads, dim)


def _flash(query, key, value, cu_seqlens, max_seqlen, dropout, scaling, version: int):
    """``_varlen`` through flash-attn 2 or FlashAttention-3 (``version``)."""
    return _varlen(query, key, value, cu_seqlens, max_seqlen, dropout, scaling, f"flash_attention_{version}")


def _npu(query, key, value, ends, dropout, scaling):
    import torch_npu

    batch, heads, length, dim = query.shape
    q, k, v = (
        t.transpose(1, 2).reshape(batch * length, t.shape[1], dim).contiguous() for t in (query, key, value)
    )
    out = torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        heads,
        input_layout="TND",
        atten_mask=npu_causal_mask(query.device),
        scale=softmax_scale(scaling, dim),
        keep_prob=1.0 - dropout,
        sparse_mode=3,
        actual_seq_qlen=list(ends),
        actual_seq_kvlen=list(ends),
    )[0]
    return out.view(batch, length, heads, dim)


@attention_function
def packed_attention_forward(
    call: AttentionCall,
    *,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    packed_seq_ends: tuple[int, ...] | None = None,
    kernel: str,
    **kwargs: Any,
) -> torch.Tensor:
    """The packed attention over ``kernel`` (a transformers attention function): ``query``
    ``[B, heads, L, D]``, ``key``/``value`` ``[B, kv_heads, L, D]``; returns ``[B, L, heads, D]``.
    Segments from ``packed_seq_ends`` (host) and ``cu_seq_lens_q`` (device), or one per row without them."""
    if call.attention_mask is not None:
        raise ValueError("packed attention takes its segments from cu_seqlens, not from an attention mask")
    query, key, value, dropout, scaling = call.query, call.key, call.value, call.dropout, call.scaling
    batch, _, length, _ = query.shape
    if packed_seq_ends is None:
        ends = tuple(length * (row + 1) for row in range(batch))
        cu, longest = None, length
    else:
        ends = tuple(packed_seq_ends)
        if ends[-1] != batch * length:
            raise ValueError(f"packed segments end at {ends[-1]}, the batch has {batch} x {length} tokens")
        cu, longest = cu_seq_lens_q, max_length_q
        if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
            raise ValueError("packed attention: query and key segments must be the same (self-attention)")
    whole_rows = ends == tuple(length * (row + 1) for row in range(batch))
    path = kernel_path(
        kernel, query.device, query.dtype, head_dim=query.shape[-1], dropout=dropout, whole_rows=whole_rows
    )
    if path == "npu":
        return _npu(query, key, value, ends, dropout, scaling)
    if path == "sdpa_causal":
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2)
    if path in VARLEN_KERNELS:
        if cu is None:
            cu = torch.tensor([0, *ends], dtype=torch.int32, device=query.device)
        return _varlen(query, key, value, cu, longest, dropout, scaling, path)
    return _masked(query, key, value, ends, dropout, scaling, eager=path == "eager")


#: where each packed kernel name enters ``VARLEN_KERNELS`` on CUDA (``eager`` never does)
_FIRST_VARLEN = {
    "flash_attention_3": "flash_attention_3",
    "flash_attention_2": "flash_attention_2",
    "sdpa": TORCH_VARLEN,
}


def kernel_path(
    kernel: str,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    head_dim: int | None,
    dropout: float = 0.0,
    whole_rows: bool = False,
) -> str:
    """What runs for ``kernel`` on ``device`` for ``dtype`` inputs of ``head_dim``: ``npu``
    (npu_fusion_attention, TND), a CUDA varlen kernel of ``VARLEN_KERNELS`` (``varlen_kernel``'s
    pick from the kernel's place on: ``flash_attention_3`` tries FA3 first, ``flash_attention_2``
    flash-attn 2, ``sdpa`` torch's ``varlen_attn`` only), ``sdpa_causal`` (torch's varlen kernel
    would run but every row is one segment, ``whole_rows``: SDPA causal without a mask, which on
    an H200 with torch 2.11 took 2.1 ms forward + backward for 2 rows x 4096 tokens, 32 / 8 heads
    of 128, against 4.1 ms for ``varlen_attn``), ``eager`` or ``sdpa`` (block-diagonal causal
    mask; everything else)."""
    if kernel == NPU_ATTENTION and device_type_and_index(device)[0] == "npu":
        return "npu"
    if kernel in _FIRST_VARLEN:
        varlen = varlen_kernel(device, dtype, head_dim, dropout, first=_FIRST_VARLEN[kernel])
        if varlen == TORCH_VARLEN and whole_rows:
            return "sdpa_causal"
        if varlen is not None:
            return varlen
    return "eager" if kernel == "eager" else "sdpa"


def path_name(path: str) -> str:
    """What reports call a ``kernel_path`` result."""
    if path in VARLEN_KERNEL_NAMES:
        return VARLEN_KERNEL_NAMES[path]
    return {
        "npu": "torch_npu.npu_fusion_attention (TND)",
        "eager": "eager attention with a block-diagonal causal mask",
        "sdpa": "torch sdpa with a block-diagonal causal mask",
        "sdpa_causal": "torch sdpa, causal, one segment a row (no mask)",
    }[path]
