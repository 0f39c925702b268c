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

- CPU (and CUDA without flash-attn, and ``eager``): ``torch`` SDPA with a block-diagonal causal mask;
- CUDA: ``flash_attn_varlen_func`` (flash-attn 2, or FlashAttention-3's ``flash_attn_interface``)
  with ``cu_seqlens_q = cu_seqlens_k`` and ``causal=True`` over ``[total, heads, dim]``;
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

from .attention import NPU_ATTENTION, flash_attention_available, flash_varlen

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
        "cu_seqlens": cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True),
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
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = (query @ key.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        weights = F.dropout(weights, p=dropout, training=dropout > 0)
        out = weights @ value
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
        )
    return out.transpose(1, 2)  # [batch, seq, heads, dim]


def _flash(query, key, value, cu_seqlens, max_seqlen, dropout, scaling, version: int):
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    out = flash_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, causal=True, version=version)
    return out.view(batch, length, heads, dim)


def _npu(query, key, value, ends, dropout, scaling):
    import torch_npu

    from .attention import _npu_causal_mask

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
        atten_mask=_npu_causal_mask(query.device),
        scale=scaling if scaling is not None else dim**-0.5,
        keep_prob=1.0 - dropout,
        sparse_mode=3,
        actual_seq_qlen=list(ends),
        actual_seq_kvlen=list(ends),
    )[0]
    return out.view(batch, length, heads, dim)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    packed_seq_ends: tuple[int, ...] | None = None,
    *,
    kernel: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[B, heads, L, D]``, ``key``/``value``
    ``[B, kv_heads, L, D]``; returns ``[B, L, heads, D]``. Segments from ``packed_seq_ends`` (host)
    and ``cu_seq_lens_q`` (device), or one per row without them."""
    if attention_mask is not None:
        raise ValueError("packed attention takes its segments from cu_seqlens, not from an attention mask")
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
    path = kernel_path(kernel, query.device.type, query.dtype)
    if path == "npu":
        return _npu(query, key, value, ends, dropout, scaling), None
    if path in ("flash_attention_2", "flash_attention_3"):
        if cu is None:
            cu = torch.tensor([0, *ends], dtype=torch.int32, device=query.device)
        version = 3 if path == "flash_attention_3" else 2
        return _flash(query, key, value, cu, longest, dropout, scaling, version), None
    return _masked(query, key, value, ends, dropout, scaling, eager=path == "eager"), None


def kernel_path(kernel: str, device_type: str, dtype: torch.dtype) -> str:
    """What runs for ``kernel`` on ``device_type`` in ``dtype``: ``npu`` (npu_fusion_attention, TND),
    ``flash_attention_2`` / ``flash_attention_3`` (varlen; half precision on CUDA with the package
    installed), ``eager`` or ``sdpa`` (block-diagonal causal mask; everything else)."""
    if kernel == NPU_ATTENTION and device_type == "npu":
        return "npu"
    half = dtype in (torch.float16, torch.bfloat16)
    if kernel in ("flash_attention_2", "flash_attention_3") and device_type == "cuda" and half:
        if kernel == "flash_attention_3" and flash_attention_available(3):
            return "flash_attention_3"
        if flash_attention_available(2):
            return "flash_attention_2"
    return "eager" if kernel == "eager" else "sdpa"
