"""Ulysses, Ring and Hybrid attention, and their registration with transformers.

``ATTENTION_NAME`` is registered in transformers' ``AttentionInterface`` (so it appears in
``ALL_ATTENTION_FUNCTIONS``) and selected for the language model only
(:func:`enable_cp_attention` sets ``config.text_config._attn_implementation``); the vision
tower keeps its own implementation. The name has no entry in the attention-*mask* registry,
so transformers builds no mask for it (causality is built into the CP attention) and does not
reinterpret the non-contiguous zigzag position ids as packed sequences.

Shapes follow transformers' attention functions: ``query [B, H, S_local, D]``,
``key/value [B, H_kv, S_local, D]``; the result is ``[B, S_local, H, D]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from magistral_cli.ops.attention_kernels import AttentionCall, attention_function
from magistral_cli.ops.context_parallel.comm import head_to_seq, seq_to_head
from magistral_cli.ops.context_parallel.groups import ContextParallelError, active_cp_groups
from magistral_cli.ops.context_parallel.ring import BlockKernel, ring_attention

ATTENTION_NAME = "magistral_context_parallel"
#: Attribute on the language model's attention modules holding their CP groups. The groups
#: live on the modules (not only in the ``context_parallel`` block) because activation
#: checkpointing reruns the attention during backward, outside the forward call.
CP_GROUPS_ATTR = "_magistral_cp_groups"

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a whole (head-sharded) sequence, ``[B, H, S, D]`` (GQA allowed)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


_BACKENDS: dict[str, object] = {"local": sdpa_causal, "ring_kernel": None}


def set_attention_backends(
    local: LocalAttention | None = None, ring_kernel: BlockKernel | None = None
) -> None:
    """Replace the local attention that Ulysses wraps (e.g. ``npu_fusion_attention`` on NPU), or
    the ring's block kernel. ``local(q, k, v, scale)`` gets ``[B, H, S, D]`` and must be causal."""
    if local is not None:
        _BACKENDS["local"] = local
    if ring_kernel is not None:
        _BACKENDS["ring_kernel"] = ring_kernel


def _kv_for_ulysses(k, v, num_heads: int, size: int):
    """Key/value heads that divide over ``size`` ranks: as they are, or repeated up to the query heads."""
    kv_heads = k.shape[1]
    if kv_heads % size == 0:
        return k, v
    if num_heads % size:
        raise ContextParallelError(
            f"Ulysses needs the attention heads to divide over ulysses_parallel_size: {num_heads} query heads, "
            f"{kv_heads} key/value heads, ulysses_parallel_size {size}; lower ulysses_parallel_size "
            "(use ring_attention_size for the rest of the CP degree)"
        )
    # GQA with fewer key/value heads than Ulysses ranks: each rank needs the key/value head of
    # its own query heads, so send one copy per query head (more traffic, same result).
    groups = num_heads // kv_heads
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups, scale: float) -> torch.Tensor:
    """Causal attention of CP-sharded ``[B, H, S_local, D]`` tensors; returns ``[B, H, S_local, D]``.

    Ulysses: all-to-all to head shards over the whole (Ulysses group's) sequence, local attention,
    all-to-all back. Ring: :func:`ring.ring_attention`. Hybrid: the ring runs between the
    head shards that the Ulysses all-to-all produced.
    """
    u = groups.ulysses_size
    if u > 1:
        k, v = _kv_for_ulysses(k, v, q.shape[1], u)
        q = seq_to_head(q, groups.ulysses_group, u)
        k = seq_to_head(k, groups.ulysses_group, u)
        v = seq_to_head(v, groups.ulysses_group, u)
    if groups.ring_size > 1:
        out = ring_attention(q, k, v, groups, scale, _BACKENDS["ring_kernel"])
    else:
        out = _BACKENDS["local"](q, k, v, scale)
    if u > 1:
        out = head_to_seq(out, groups.ulysses_group, u)
    return out


@attention_function
def context_parallel_attention_forward(
    call: AttentionCall, *, sliding_window: int | None = None, **kwargs
) -> torch.Tensor:
    """The transformers attention function for the context-parallel language model."""
    if not getattr(call.module, "is_causal", True):
        raise ContextParallelError(
            f"{type(call.module).__name__} is not causal; only the language model may use the CP attention"
        )
    groups = getattr(call.module, CP_GROUPS_ATTR, None) or active_cp_groups()
    if call.attention_mask is not None:
        raise ContextParallelError(
            "context parallelism got an attention mask; CP attention is causal over the whole sequence "
            "and supports no custom masks (per-sample masks, left padding)"
        )
    if sliding_window is not None:
        raise ContextParallelError(
            f"context parallelism does not support sliding-window attention (sliding_window={sliding_window})"
        )
    if call.dropout:
        raise ContextParallelError(f"context parallelism does not support attention dropout ({call.dropout})")
    out = cp_attention(call.query, call.key, call.value, groups, call.scale)
    return out.transpose(1, 2).contiguous()


def register_cp_attention() -> str:
    """Register the CP attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention_forward)
    return ATTENTION_NAME


def enable_cp_attention(model) -> str | None:
    """Select the CP attention for ``model``'s language model only (a Mistral3 model).

    Returns the implementation it replaces (pass it to :func:`disable_cp_attention`).
    """
    register_cp_attention()
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None)
    if text_config is None:
        raise ContextParallelError(
            f"{type(model).__name__} has no config.text_config; expected a Mistral3 model"
        )
    previous = text_config._attn_implementation
    text_config._attn_implementation = ATTENTION_NAME
    return previous


def disable_cp_attention(model, implementation: str | None = "sdpa") -> None:
    """Give the language model back an ordinary attention implementation."""
    model.config.text_config._attn_implementation = implementation or "sdpa"


def _language_attention_modules(model):
    for module in model.model.language_model.modules():
        if getattr(module, "is_causal", False) and hasattr(module, "o_proj"):
            yield module


def bind_cp_groups(model, groups) -> None:
    """Attach ``groups`` to every attention module of ``model``'s language model (``None`` detaches)."""
    for module in _language_attention_modules(model):
        if groups is None:
            module.__dict__.pop(CP_GROUPS_ATTR, None)
        else:
            setattr(module, CP_GROUPS_ATTR, groups)


def cp_attention_enabled(model) -> bool:
    return getattr(model.config.text_config, "_attn_implementation", None) == ATTENTION_NAME
