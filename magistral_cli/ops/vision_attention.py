"""Per-image attention for the Pixtral vision tower, without forking the model.

Pixtral flattens the patches of every image of a batch into one sequence. Attention must
stay inside each image. transformers' eager / sdpa path does that with a dense block mask of
``(patches, patches)``; for Magistral's 1540-pixel images (12100 patches each) that mask alone
is hundreds of MiB. Here attention sees the per-image sequence lengths instead:

- CPU: ``scaled_dot_product_attention`` per image;
- CUDA: the varlen kernel ``ops.attention_kernels.varlen_kernel`` picks, non-causal, through
  ``ops.attention_kernels.varlen_attention``: FlashAttention-3's ``flash_attn_varlen_func``
  (``flash_attn_interface``, from flash-attn-3) when installed, else flash-attn's, else torch's own
  ``torch.nn.attention.varlen.varlen_attn`` (no package; sm80+, head dim a multiple of 8 up to 256)
  for images of fewer than ``TORCH_VARLEN_MAX_MEAN_PATCHES`` patches on average, else sdpa per
  image (FA3 and torch's kernel have no dropout: with dropout, flash-attn 2 or sdpa);
- NPU: ``torch_npu.npu_fusion_attention`` in the ``TND`` layout with the actual sequence lengths.

fp32 inputs use sdpa per image on every device (the fused kernels take bf16 / fp16).

It is wired in through transformers' attention-function registry (``AttentionInterface``)
and a forward pre-hook on the tower that passes the lengths (as the seed's
``_prepare_vision_attention`` did). The hook computes them once per forward, on the host, and
passes them as plain ints to every layer: reading them back from the device tensor
``cu_seq_lens_q`` in each layer would synchronise the device once per layer (twice: q and k).
Only the tower's config changes; the decoder keeps its own attention. The tower is replicated
across context-parallel ranks, so this function never communicates: a vision tower must not
join the decoder's sequence split.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from magistral_cli.errors import UserError
from magistral_cli.ops.attention_kernels import (
    TORCH_VARLEN,
    VARLEN_KERNEL_NAMES,
    AttentionCall,
    attention_function,
    device_type_and_index,
    varlen_attention,
    varlen_kernel,
)
from magistral_cli.runtime import host_to_device

#: The name in transformers' AttentionInterface. It contains "flash" on purpose: for such
#: implementations transformers passes ``cu_seq_lens_*`` and builds no dense block mask.
ATTENTION_NAME = "magistral_vision_flash_varlen"

_HOOK_FLAG = "_magistral_vision_attention_hook"
#: The keyword under which the pre-hook hands every layer the images' end offsets (host ints).
ENDS_KWARG = "magistral_image_ends"


def image_sequence_lengths(image_sizes: Any, patch_size: int, count: int | None = None) -> list[int]:
    """Patches per image: (height // patch) * (width // patch) for each (height, width)."""
    if isinstance(image_sizes, torch.Tensor):
        image_sizes = image_sizes.tolist()
    lengths = [(int(h) // patch_size) * (int(w) // patch_size) for h, w in image_sizes]
    if count is not None and len(lengths) != count:
        raise ValueError(f"{len(lengths)} image sizes for {count} images")
    return lengths


#: torch's varlen kernel runs only for images of fewer patches than this on average: SDPA per image
#: (cuDNN on Hopper) is faster for large ones. Forward + backward on an H200, torch 2.11, bf16,
#: 16 heads of 64: one image of 12100 patches 8.0 ms varlen_attn / 5.1 ms SDPA, 4 x 3025 2.4 / 2.1,
#: 16 x 784 1.2 / 4.1, 64 x 256 1.2 / 14.4, 200 x 64 1.2 / 46.
TORCH_VARLEN_MAX_MEAN_PATCHES = 2048


def vision_attention_kernel(
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int | None,
    dropout: float = 0.0,
    ends: list[int] | tuple[int, ...] | None = None,
) -> str:
    """What the tower's attention runs for these inputs: ``npu`` (npu_fusion_attention, bf16 /
    fp16 on NPU), a CUDA varlen kernel of ``ops.attention_kernels.VARLEN_KERNELS`` or ``sdpa`` (per image).
    ``ends`` (the images' end offsets) keeps torch's varlen kernel to images of fewer than
    ``TORCH_VARLEN_MAX_MEAN_PATCHES`` patches on average; None: not known (a report).
    ``vision_attention_forward`` decides with this very function."""
    if device_type_and_index(device)[0] == "npu" and dtype in (torch.float16, torch.bfloat16):
        return "npu"
    kernel = varlen_kernel(device, dtype, head_dim, dropout) or "sdpa"
    if kernel == TORCH_VARLEN and ends and ends[-1] >= TORCH_VARLEN_MAX_MEAN_PATCHES * len(ends):
        return "sdpa"
    return kernel


def vision_attention_backend(
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int | None = None,
    dropout: float = 0.0,
) -> str:
    """The name of the kernel the tower uses on ``device`` (for logs and the probe's report); bf16
    unless told, ``head_dim`` None: any the kernels take."""
    kernel = vision_attention_kernel(device, dtype, head_dim, dropout)
    if kernel == "npu":
        return "torch_npu.npu_fusion_attention(TND, actual_seq_qlen)"
    return VARLEN_KERNEL_NAMES.get(kernel, "torch sdpa per image")


def _ends(cu_seq_lens: Any, total: int) -> list[int]:
    """Cumulative end offsets (without the leading 0) from HF-style cu_seq_lens, or one sequence."""
    if cu_seq_lens is None:
        return [total]
    ends = [int(x) for x in (cu_seq_lens.tolist() if isinstance(cu_seq_lens, torch.Tensor) else cu_seq_lens)]
    if ends and ends[0] == 0:
        ends = ends[1:]
    if not ends or ends[-1] != total or any(b < a for a, b in zip([0, *ends], ends, strict=False)):
        raise ValueError(f"vision attention: sequence offsets {ends} do not cover {total} patches")
    return ends


def _sdpa_per_image(query, key, value, ends, dropout, scaling):
    outputs = []
    start = 0
    for end in ends:
        if end > start:
            outputs.append(
                F.scaled_dot_product_attention(
                    query[:, :, start:end],
                    key[:, :, start:end],
                    value[:, :, start:end],
                    dropout_p=dropout,
                    scale=scaling,
                )
            )
        start = end
    return torch.cat(outputs, dim=2).transpose(1, 2)  # (batch, seq, heads, dim)


def _varlen(query, key, value, ends, cu_seq_lens, dropout, scaling, kernel):
    """The CUDA varlen ``kernel`` (one of ``ops.attention_kernels.VARLEN_KERNELS``) over the packed images."""
    if not (isinstance(cu_seq_lens, torch.Tensor) and cu_seq_lens.device == query.device):
        cu_seq_lens = torch.tensor([0, *ends], dtype=torch.int32, device=query.device)
    cu = cu_seq_lens.to(torch.int32)
    max_len = max(b - a for a, b in zip([0, *ends], ends, strict=False))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (seq, heads, dim)
    out = varlen_attention(q, k, v, cu, max_len, scaling, dropout, causal=False, kernel=kernel)
    return out.unsqueeze(0)


def _npu_fusion(query, key, value, ends, dropout, scaling):
    import torch_npu

    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # TND
    out = torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        query.shape[1],
        input_layout="TND",
        scale=scaling,
        keep_prob=1.0 - dropout,
        actual_seq_qlen=ends,
        actual_seq_kvlen=ends,
    )[0]
    return out.unsqueeze(0)


@attention_function
def vision_attention_forward(
    call: AttentionCall, *, cu_seq_lens_q: Any = None, cu_seq_lens_k: Any = None, **kwargs: Any
) -> torch.Tensor:
    """Attention within each image (a transformers attention function), (batch, seq, heads, dim) out."""
    query, key, value, dropout, scaling = call.query, call.key, call.value, call.dropout, call.scaling
    if query.shape[0] != 1:
        raise ValueError(
            f"vision attention expects Pixtral's single packed sequence, got batch {query.shape[0]}"
        )
    total = query.shape[2]
    host_ends = kwargs.get(ENDS_KWARG)
    if host_ends is not None:
        # From the pre-hook: host ints, so no layer reads cu_seq_lens back from the device.
        ends = _ends(list(host_ends), total)
    else:
        ends = _ends(cu_seq_lens_q, total)
        if cu_seq_lens_k is not None and _ends(cu_seq_lens_k, total) != ends:
            raise ValueError("vision attention: query and key image boundaries differ")
    if cu_seq_lens_q is None and host_ends is None and call.attention_mask is not None:
        raise ValueError(
            "vision attention got a dense mask but no image lengths: call apply_vision_attention(model, device)"
        )
    kernel = vision_attention_kernel(query.device, query.dtype, query.shape[-1], dropout, ends)
    if kernel == "npu":
        out = _npu_fusion(query, key, value, ends, dropout, scaling)
    elif kernel == "sdpa":
        out = _sdpa_per_image(query, key, value, ends, dropout, scaling)
    else:
        out = _varlen(query, key, value, ends, cu_seq_lens_q, dropout, scaling, kernel)
    return out


def _prepare_vision_attention(module, args, kwargs):
    """Forward pre-hook on the tower: pass per-image lengths so attention keeps image boundaries.

    The lengths are read once per forward (from ``image_sizes``: one read-back when that is a
    device tensor) and reach every layer as host ints under ``ENDS_KWARG``; ``cu_seq_lens_*``
    go along for the flash kernels, which want them on the device.
    """
    pixel_values = args[0] if args else kwargs["pixel_values"]
    image_sizes = args[1] if len(args) > 1 else kwargs.get("image_sizes")
    if image_sizes is None:
        image_sizes = [tuple(pixel_values.shape[-2:])] * pixel_values.shape[0]
    lengths = image_sequence_lengths(image_sizes, module.patch_size)
    ends = tuple(accumulate(lengths))
    cu = host_to_device(torch.tensor([0, *ends], dtype=torch.int32), pixel_values.device)
    kwargs = dict(kwargs)
    kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    kwargs[ENDS_KWARG] = ends
    return args, kwargs


def find_vision_towers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Pixtral vision towers inside ``model`` (the model itself if it is one)."""
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

    return [m for m in model.modules() if isinstance(m, PixtralVisionModel)]


def set_attention_implementation(tower: torch.nn.Module, name: str) -> None:
    """Point the config of the tower and of every module inside it at attention ``name``.

    Normally they share one config object; a copied or re-configured tower may not.
    """
    for module in tower.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def apply_vision_attention(model: torch.nn.Module, device: str) -> None:
    """Make every Pixtral tower of ``model`` attend within each image, with the kernel of ``device``.

    Registers :func:`vision_attention_forward` in transformers' AttentionInterface, points the
    towers' config at it and adds the pre-hook that passes the image lengths. Idempotent.
    Raises UserError when ``model`` has no Pixtral tower or ``device`` cannot run it.
    """
    from transformers import AttentionInterface

    if device not in ("cpu", "cuda", "npu"):
        raise UserError(f"vision attention: unknown device {device!r}; use cpu, cuda or npu")
    if device == "npu":
        try:
            import torch_npu
        except ImportError:
            raise UserError(
                "vision attention on npu needs torch_npu; install it or train on cpu/cuda"
            ) from None
        if not hasattr(torch_npu, "npu_fusion_attention"):
            raise UserError("this torch_npu has no npu_fusion_attention; upgrade torch_npu (see the README)")
    towers = find_vision_towers(model)
    if not towers:
        raise UserError("vision attention: the model has no Pixtral vision tower (PixtralVisionModel)")
    AttentionInterface.register(ATTENTION_NAME, vision_attention_forward)
    for tower in towers:
        set_attention_implementation(tower, ATTENTION_NAME)
        if not getattr(tower, _HOOK_FLAG, False):
            tower.register_forward_pre_hook(_prepare_vision_attention, with_kwargs=True)
            setattr(tower, _HOOK_FLAG, True)
