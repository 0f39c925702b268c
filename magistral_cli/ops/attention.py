"""Attention backends for the language model, chosen per device.

- CPU: ``sdpa`` (``eager`` when asked for explicitly).
- CUDA: ``flash_attention_2`` when the ``flash-attn`` package is installed, ``flash_attention_3``
  when asked for and ``flash-attn-3`` (FlashAttention-3, module ``flash_attn_interface``) is
  installed, otherwise ``sdpa``. Both are found the way transformers finds them.
- NPU: ``torch_npu.npu_fusion_attention`` registered in transformers' attention-function
  registry under the name ``npu_fusion_attention``.

Attention over variable-length segments (``ops.packed_attention``'s packed samples,
``ops.vision_attention``'s images) picks its CUDA kernel in ``ops.attention_kernels``.

No path sees a padding mask (the trainer's model drops it before the decoder): with right padding and a causal mask, a real token
only ever attends to earlier real tokens, so padding is harmless and the mask can be dropped.
Any other mask (left padding, holes, packed-sample ids) would silently change the result, so
``validate_right_padding`` rejects it before the model runs (the seed's
``_validate_dense_attention_mask``). The trainer checks every host-side batch with it, which costs
no device synchronisation. ``right_padding_problem`` is the rule itself, which the
context-parallel batch check (``ops.context_parallel.model.validate_cp_batch``) applies too.
"""

from __future__ import annotations

import logging

import torch

from .attention_kernels import (
    NPU_ATTENTION,
    AttentionCall,
    attention_function,
    flash_attention_available,
    npu_causal_mask,
)

log = logging.getLogger(__name__)


def right_padding_problem(attention_mask: torch.Tensor | None, *, read_values: bool = True) -> str | None:
    """The one rule every attention-mask check applies; what is wrong with ``attention_mask``.

    None for no mask or a 2D ``[batch, seq]`` 0/1 mask with padding on the right only;
    otherwise ``"shape"`` (not 2D: a custom or 4D mask), ``"values"`` (values other than 0 and 1:
    packed-sample ids) or ``"left_padding"`` (padding before real tokens: left
    padding or holes). The values are read back (both checks together, one synchronisation
    when the mask lives on a device) unless ``read_values`` is False, which checks the shape only.
    """
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        return "shape"
    if not read_values:
        return None
    invalid_values, invalid_padding = (
        torch.stack(
            (
                ((attention_mask != 0) & (attention_mask != 1)).any(),
                ((attention_mask[:, 1:] != 0) & (attention_mask[:, :-1] == 0)).any(),
            )
        )
        .cpu()
        .tolist()
    )
    if invalid_values:
        return "values"
    if invalid_padding:
        return "left_padding"
    return None


def validate_right_padding(attention_mask: torch.Tensor | None) -> None:
    """Raise ValueError unless ``attention_mask`` is a 2D 0/1 mask with padding on the right only."""
    problem = right_padding_problem(attention_mask)
    if problem == "shape":
        raise ValueError(
            f"attention_mask must be 2D [batch, seq] with right padding, got shape {tuple(attention_mask.shape)}"
        )
    if problem == "values":
        raise ValueError(
            "attention_mask holds values other than 0 and 1 (packed-sample ids?); the collator's masks are 0/1 "
            "with right padding, and packed samples are told apart by cu_seqlens (ops.packed_attention)"
        )
    if problem == "left_padding":
        raise ValueError(
            "attention_mask has padding before real tokens (left padding or holes); "
            "this engine supports right padding only: pad on the right in the collator"
        )


def resolve_attention(requested: str, device_type: str, *, packed: bool = False) -> str:
    """The language-model attention implementation to use on ``device_type`` for ``requested``.

    Recipes ported from the NPU seed ask for ``flash_attention_2``; on NPU that means the fusion
    kernel, on CUDA the flash-attn package when installed, and on the CPU ``sdpa``.
    ``flash_attention_3`` on CUDA needs flash-attn-3; without it FA2 (or sdpa) is used, with a warning.
    ``packed`` (packing on): the same kernel behind ``ops.packed_attention``, which takes the
    segments of a packed batch explicitly, so a pack means the same on every device.
    """
    kernel = _resolve_kernel(requested, device_type)
    if not packed:
        return kernel
    from .packed_attention import packed_attention_name

    return packed_attention_name(kernel)


def _resolve_kernel(requested: str, device_type: str) -> str:
    if requested not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3", NPU_ATTENTION):
        raise ValueError(
            f"model.attn_implementation {requested!r} is not supported; "
            "use sdpa, eager, flash_attention_2 or flash_attention_3"
        )
    if requested in ("sdpa", "eager"):
        return requested
    if device_type == "npu":
        register_npu_attention()
        return NPU_ATTENTION
    if device_type == "cuda" and requested != NPU_ATTENTION:
        if requested == "flash_attention_3":
            if flash_attention_available(3):
                return requested
            fallback = "flash_attention_2" if flash_attention_available(2) else "sdpa"
            log.warning(
                "model.attn_implementation=flash_attention_3 but flash-attn-3 (module flash_attn_interface) "
                "is not installed; using %s",
                fallback,
            )
            return fallback
        if flash_attention_available(2):
            return requested
        log.warning("model.attn_implementation=%s but flash-attn is not installed; using sdpa", requested)
        return "sdpa"
    log.info("model.attn_implementation=%s is not available on %s; using sdpa", requested, device_type)
    return "sdpa"


@attention_function
def npu_fusion_attention_forward(call: AttentionCall, **kwargs) -> torch.Tensor:
    """transformers attention function over ``torch_npu.npu_fusion_attention`` (causal, BNSD layout).

    ``query`` is ``[B, heads, S, D]`` and ``key``/``value`` ``[B, kv_heads, S, D]`` (grouped-query
    attention is native to the kernel). Returns ``[B, S, heads, D]`` like transformers' sdpa path.
    """
    import torch_npu

    if call.attention_mask is not None:
        raise ValueError("npu_fusion_attention takes no padding mask; batches must be right-padded")
    output = torch_npu.npu_fusion_attention(
        call.query,
        call.key,
        call.value,
        call.query.shape[1],
        input_layout="BNSD",
        atten_mask=npu_causal_mask(call.query.device),
        scale=call.scale,
        keep_prob=1.0 - call.dropout,
        sparse_mode=3,
    )[0]
    return output.transpose(1, 2).contiguous()


def register_npu_attention() -> None:
    """Register ``npu_fusion_attention`` with transformers (no padding-mask creation for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NPU_ATTENTION, npu_fusion_attention_forward)
