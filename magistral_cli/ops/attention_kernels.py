"""The attention kernels the language-model, packed and vision attention share.

Attention over variable-length segments (``ops.packed_attention``'s packed samples,
``ops.vision_attention``'s images) picks its CUDA kernel with ``varlen_kernel``: FlashAttention-3,
then flash-attn 2, then torch's own FlashAttention kernel ``torch.nn.attention.varlen.varlen_attn``
(no package needed), else none (sdpa). ``varlen_attention`` is the one place that calls the kernel
picked. On the NPU every attention calls ``torch_npu.npu_fusion_attention`` (``NPU_ATTENTION``) with
its causal mask (``npu_causal_mask``).

The attention functions registered with transformers (the NPU, packed, vision and context-parallel
ones) take transformers' attention-function signature through ``attention_function``: each is
written as ``forward(call: AttentionCall, **kwargs) -> out``, and the signature transformers calls,
its default softmax scale (``softmax_scale``) and the ``(out, None)`` it gets back are written here.

The attention modules build on this one and it imports none of them (``ops.attention`` chooses a
backend, ``ops.packed_attention`` registers the packed one, each calling the kernels here).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, update_wrapper

import torch

log = logging.getLogger(__name__)

NPU_ATTENTION = "npu_fusion_attention"

#: FlashAttention version -> (module, distribution), as transformers' is_flash_attn_{2,3}_available
#: check them: FA3 is ``flash_attn_interface`` from ``flash-attn-3``; ``flash_attn`` is FA2 only
#: when ``flash-attn`` installed it (flash-attn-4 installs a ``flash_attn`` module too).
FLASH_ATTENTION_PACKAGES = {2: ("flash_attn", "flash-attn"), 3: ("flash_attn_interface", "flash-attn-3")}


@cache
def flash_attention_available(version: int) -> bool:
    """Whether FlashAttention ``version`` (2 or 3) is installed (cached: the vision tower asks per layer)."""
    module, distribution = FLASH_ATTENTION_PACKAGES[version]
    if importlib.util.find_spec(module) is None:
        return False
    owners = importlib.metadata.packages_distributions().get(module, [])
    return distribution in {name.replace("_", "-").lower() for name in owners}


def flash_varlen(
    q, k, v, cu_seqlens, max_seqlen: int, scaling, dropout: float, *, causal: bool, version: int
):
    """flash-attn's (version 2) or FlashAttention-3's ``flash_attn_varlen_func`` over
    ``[total, heads, dim]`` tensors with one ``cu_seqlens`` (int32) for queries and keys; the
    output only (early FA3 releases also return the LSE). FA3 has no dropout."""
    if version == 3:
        from flash_attn_interface import flash_attn_varlen_func
    else:
        from flash_attn import flash_attn_varlen_func

    kwargs = dict(
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scaling,
        causal=causal,
    )
    if version == 2:
        kwargs["dropout_p"] = dropout
    out = flash_attn_varlen_func(q, k, v, **kwargs)
    return out[0] if isinstance(out, tuple) else out


#: torch's own FlashAttention varlen kernel, ``torch.nn.attention.varlen.varlen_attn``
TORCH_VARLEN = "torch_varlen"
#: the CUDA varlen kernels, in the order ``varlen_kernel`` tries them
VARLEN_KERNELS = ("flash_attention_3", "flash_attention_2", TORCH_VARLEN)
#: what reports call each varlen kernel
VARLEN_KERNEL_NAMES = {
    "flash_attention_3": "flash_attn_interface.flash_attn_varlen_func (FlashAttention-3)",
    "flash_attention_2": "flash_attn.flash_attn_varlen_func",
    TORCH_VARLEN: "torch.nn.attention.varlen.varlen_attn",
}
_VARLEN_LEADING = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")


@dataclass(frozen=True)
class TorchVarlen:
    """This torch's ``varlen_attn`` and how its signature spells the options we pass.

    ``causal``: ``"window_size"`` (torch 2.11 on: keyword-only ``window_size=(-1, 0)`` is causal,
    ``(-1, -1)`` full) or ``"is_causal"`` (the first form, torch 2.10). ``gqa``: it takes
    ``enable_gqa`` (fewer key/value heads than query heads); without it the key/value heads are
    repeated before the call.
    """

    function: Callable[..., torch.Tensor]
    causal: str
    gqa: bool


def read_varlen_signature(function: Callable[..., torch.Tensor]) -> TorchVarlen | None:
    """A ``TorchVarlen`` for ``function`` when its signature is one we know how to call, else None:
    ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...)`` with ``scale`` and either
    ``window_size`` or ``is_causal``."""
    parameters = inspect.signature(function).parameters
    if tuple(parameters)[: len(_VARLEN_LEADING)] != _VARLEN_LEADING or "scale" not in parameters:
        return None
    if "window_size" in parameters:
        causal = "window_size"
    elif "is_causal" in parameters:
        causal = "is_causal"
    else:
        return None
    return TorchVarlen(function, causal, gqa="enable_gqa" in parameters)


@cache
def torch_varlen_api() -> TorchVarlen | None:
    """This torch's ``varlen_attn`` as ``read_varlen_signature`` reads it (once), or None: torch
    before 2.10 has none, and a signature we do not know is not guessed at (sdpa runs instead)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    api = read_varlen_signature(varlen_attn)
    if api is None:
        log.warning(
            "torch %s has torch.nn.attention.varlen.varlen_attn with a signature this version does not "
            "know; the packed and vision attention use sdpa on CUDA",
            torch.__version__,
        )
    return api


@cache
def _torch_varlen_runs_on(device_index: int) -> bool:
    """Whether ``varlen_attn`` (FlashAttention 2 inside torch) runs on this CUDA device: an NVIDIA
    GPU of compute capability 8.0 (Ampere) or newer; ROCm builds are not tried."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 0)


def device_type_and_index(device: torch.device | str) -> tuple[str, int | None]:
    """``("cuda", 1)`` for ``"cuda:1"``; a string is not made a ``torch.device`` (``"npu"`` is one
    only once torch_npu is imported)."""
    if isinstance(device, torch.device):
        return device.type, device.index
    kind, _, index = str(device).partition(":")
    return kind, int(index) if index else None


def varlen_kernel(
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int | None,
    dropout: float = 0.0,
    *,
    first: str = "flash_attention_3",
) -> str | None:
    """The CUDA varlen kernel for these inputs, from ``first`` on in ``VARLEN_KERNELS`` order:
    FlashAttention-3 (installed, no dropout), flash-attn 2 (installed), torch's ``varlen_attn``
    (a known signature, an sm80+ NVIDIA GPU, head dim a multiple of 8 up to 256, no dropout);
    None when none fits (not CUDA, fp32, or nothing available): the caller runs sdpa.
    ``head_dim`` None skips the head-dim rule (a report that does not know the model)."""
    device_type, device_index = device_type_and_index(device)
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    for kernel in VARLEN_KERNELS[VARLEN_KERNELS.index(first) :]:
        if kernel == "flash_attention_3" and dropout == 0.0 and flash_attention_available(3):
            return kernel
        if kernel == "flash_attention_2" and flash_attention_available(2):
            return kernel
        if kernel == TORCH_VARLEN and dropout == 0.0 and torch_varlen_api() is not None:
            head_ok = head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)
            if head_ok and torch.cuda.is_available():
                index = device_index if device_index is not None else torch.cuda.current_device()
                if _torch_varlen_runs_on(index):
                    return kernel
    return None


def torch_varlen(q, k, v, cu_seqlens, max_seqlen: int, scaling, *, causal: bool):
    """torch's ``varlen_attn`` over ``[total, heads, dim]`` tensors with one ``cu_seqlens`` (int32,
    on the tensors' device) for queries and keys, called as this torch's signature wants it (read
    once by ``torch_varlen_api``). No dropout (the kernel has none)."""
    api = torch_varlen_api()
    if api is None:
        raise RuntimeError(f"torch {torch.__version__} has no varlen_attn this version can call")
    kwargs: dict = {"scale": scaling}
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        if api.gqa:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if api.causal == "window_size":
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    q, k, v = (t.contiguous() for t in (q, k, v))
    return api.function(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


_varlen_record: list[str] | None = None


@contextlib.contextmanager
def record_varlen_kernels() -> Iterator[list[str]]:
    """Within the block, the kernel of every ``varlen_attention`` call, in order (the probes check
    that the kernel they report is the one that ran)."""
    global _varlen_record
    previous, _varlen_record = _varlen_record, []
    try:
        yield _varlen_record
    finally:
        _varlen_record = previous


def varlen_attention(
    q, k, v, cu_seqlens, max_seqlen: int, scaling, dropout: float, *, causal: bool, kernel: str
):
    """The one call of a CUDA varlen kernel (one of ``VARLEN_KERNELS``, as ``varlen_kernel`` picked
    it) over ``[total, heads, dim]`` tensors, ``key``/``value`` possibly with fewer heads, one
    int32 ``cu_seqlens`` for queries and keys and the longest segment ``max_seqlen`` (a host int)."""
    if _varlen_record is not None:
        _varlen_record.append(kernel)
    if kernel not in VARLEN_KERNELS:
        raise ValueError(f"no varlen kernel {kernel!r}; one of {', '.join(VARLEN_KERNELS)}")
    if dropout and kernel != "flash_attention_2":
        raise ValueError(f"{kernel} has no dropout (varlen_kernel picks it only without dropout)")
    if kernel == TORCH_VARLEN:
        return torch_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, causal=causal)
    version = 3 if kernel == "flash_attention_3" else 2
    return flash_varlen(q, k, v, cu_seqlens, max_seqlen, scaling, dropout, causal=causal, version=version)


_npu_mask_cache: dict[torch.device, torch.Tensor] = {}


def npu_causal_mask(device: torch.device) -> torch.Tensor:
    """The causal mask ``npu_fusion_attention`` takes with ``sparse_mode=3`` (left-up causal): a fixed
    2048 x 2048 upper-triangular mask whatever the length (one per device, made once)."""
    mask = _npu_mask_cache.get(device)
    if mask is None:
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
        _npu_mask_cache[device] = mask
    return mask


# --------------------------------------------------------------------------- transformers' signature


def softmax_scale(scaling: float | None, head_dim: int) -> float:
    """The softmax scale transformers' ``scaling`` stands for: itself, or ``1 / sqrt(head_dim)`` when
    None (what SDPA assumes), for the kernels that need a number."""
    return scaling if scaling is not None else head_dim**-0.5


@dataclass(frozen=True)
class AttentionCall:
    """What transformers passes an attention function: ``query`` ``[B, heads, L, D]``, ``key`` /
    ``value`` ``[B, kv_heads, L, D]``, the ``attention_mask`` it built (None for every attention
    registered here: they refuse one), the attention ``dropout`` and the softmax ``scaling``
    (None: the kernel's default); ``module`` is the calling attention layer (None in tests)."""

    module: torch.nn.Module | None
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    dropout: float
    scaling: float | None

    @property
    def scale(self) -> float:
        """``scaling`` as a number (:func:`softmax_scale`)."""
        return softmax_scale(self.scaling, self.query.shape[-1])


def attention_function(
    forward: Callable[..., torch.Tensor],
) -> Callable[..., tuple[torch.Tensor, None]]:
    """``forward(call: AttentionCall, **kwargs) -> [B, L, heads, D]`` as a transformers attention
    function (``AttentionInterface.register``): called as ``(module, query, key, value,
    attention_mask, dropout=, scaling=, **kwargs)``, it returns ``(out, None)`` (no attention
    weights). The remaining keyword arguments (``cu_seq_lens_q``, ``sliding_window``, a partial's
    ``kernel``...) reach ``forward`` unchanged."""

    def attention(
        module: torch.nn.Module | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        call = AttentionCall(module, query, key, value, attention_mask, dropout, scaling)
        return forward(call, **kwargs), None

    update_wrapper(
        attention, forward, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=()
    )
    # forward's name and docstring, not its signature: inspect.signature follows __wrapped__.
    del attention.__wrapped__
    return attention
