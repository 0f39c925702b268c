"""The decoder's attention for unpacked micro-batches: causal per row, no mask, no host reads.

Every row of an unpacked micro-batch is one right-padded sample, so plain causal attention is
exact for every token that has a target (``ops.attention``: a real token only attends to earlier
real tokens). transformers does not know that: for a kernel in its mask registry it passes the
position ids to its mask builder, which reads them back from the device on every forward to look
for packed samples (a host synchronisation per micro-batch), and its FlashAttention path may infer
sample boundaries from them.

``causal_attention_name("sdpa")`` registers ``magistral_causal_sdpa``: the same kernel, called
with no mask and no position ids. The name is outside transformers' mask registry, so no mask is
built and nothing is read back; SDPA then runs its causal kernel (``is_causal``), FlashAttention
its causal kernel. ``eager`` needs an explicit causal mask and keeps transformers' own path; the
NPU fusion attention (``ops.attention``) is mask-free already.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

PREFIX = "magistral_causal_"
#: kernels that are causal without a mask
KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3")


def causal_attention_name(kernel: str) -> str:
    """The registered mask-free causal attention over ``kernel``, or ``kernel`` itself when it needs a mask."""
    if kernel not in KERNELS:
        return kernel
    name = PREFIX + kernel
    _register(name, kernel)
    return name


def kernel_of(name: str) -> str:
    """The kernel a (possibly mask-free) attention name runs: ``magistral_causal_sdpa`` -> ``sdpa``."""
    return name.removeprefix(PREFIX)


@functools.cache
def _register(name: str, kernel: str) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(name, functools.partial(causal_attention_forward, kernel=kernel))


def causal_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    kernel: str,
    **kwargs: Any,
):
    """``kernel``'s attention function with no mask and no position ids (causal per row)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if attention_mask is not None:
        raise ValueError(
            f"{PREFIX}{kernel} is the unpacked decoder attention and takes no mask; "
            "the trainer's model passes none (right padding is checked on the host)"
        )
    kwargs.pop("position_ids", None)
    return ALL_ATTENTION_FUNCTIONS[kernel](module, query, key, value, None, **kwargs)
