"""Bias-free Linear layers whose weight gradient comes out contiguous (``features.contiguous_linear_grad_modules``).

On Ascend, the native Linear backward can hand FSDP2 a weight gradient in a transposed
layout, which then costs a copy before the reduce-scatter. :class:`ContiguousLinear` computes
``dW = dY^T X`` as one matmul whose result is already ``(out_features, in_features)``
contiguous. Numerically it is the native Linear.

The module keeps its class, its parameter objects and its state-dict names: only the
instance's ``forward`` is replaced, and that forward takes the custom path only for NPU / CUDA
inputs in bf16 / fp16 with grad enabled and autocast off; everything else calls ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

from magistral_cli.errors import UserError
from magistral_cli.runtime import DTYPES as RECIPE_DTYPES
from magistral_cli.runtime import parse_dtype

WHAT = "features.contiguous_linear_grad_modules"
#: Where the custom path runs by default.
DEVICES = frozenset({"npu", "cuda"})
DTYPES = frozenset({torch.bfloat16, torch.float16})
#: ``force=True`` (tests on the CPU) takes the path on every device and float dtype.
FORCED_DEVICES = frozenset({"cpu", "cuda", "npu"})
FORCED_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64})

_ATTR = "_magistral_contiguous_linear"


class ContiguousLinear(torch.autograd.Function):
    """``y = x W^T`` whose backward returns a contiguous ``dW = dY^T X``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(inputs, weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        inputs, weight = ctx.saved_tensors
        dy = grad_output.reshape(-1, weight.shape[0])
        x = inputs.reshape(-1, weight.shape[1])
        dx = (dy @ weight).reshape(inputs.shape) if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x if ctx.needs_input_grad[1] else None
        return dx, dw


def _uses_custom_path(module: torch.nn.Linear, inputs: torch.Tensor) -> bool:
    devices, dtypes = getattr(module, _ATTR)
    device = inputs.device.type
    return (
        device in devices
        and inputs.dtype in dtypes
        and module.weight.dtype == inputs.dtype
        and inputs.ndim >= 2
        and torch.is_grad_enabled()
        and not torch.is_autocast_enabled(device)
    )


def _linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if _uses_custom_path(self, input):
        return ContiguousLinear.apply(input, self.weight)
    return F.linear(input, self.weight, self.bias)


def check_module(name: str, module: torch.nn.Module) -> None:
    """UserError unless ``module`` is a plain bias-free ``torch.nn.Linear``."""
    if type(module) is not torch.nn.Linear:
        raise UserError(
            f"{WHAT}: {name!r} is a {type(module).__name__}, not a torch.nn.Linear; "
            "match only the Linear layers (e.g. model.language_model.layers.{*}.mlp.down_proj)"
        )
    if module.bias is not None:
        raise UserError(
            f"{WHAT}: {name!r} is a Linear with a bias; only bias-free Linear layers are supported"
        )


def apply_contiguous_linear_grad(
    modules: Iterable[tuple[str, torch.nn.Module]],
    *,
    device: str,
    param_dtype: Any,
    force: bool = False,
) -> list[str]:
    """Give the (name, Linear layer) pairs ``modules`` a contiguous weight gradient.

    The caller resolves ``features.contiguous_linear_grad_modules`` to modules (the engine's
    ``parallelize_model`` does, with ``config.patterns.select_modules``: a pattern that matches
    nothing is its UserError). Every module is checked (a biased or non-Linear module is a
    UserError) on every device. The custom forward is installed only where it pays: ``device``
    npu / cuda with ``param_dtype`` bf16 / fp16 (the compute dtype FSDP2 casts to); otherwise
    nothing changes. ``force=True`` installs it for any device and float dtype (how the CPU tests
    exercise it). Returns the names of the modules changed.
    """
    modules = list(modules)
    if not modules:
        return []
    for name, module in modules:
        check_module(name, module)
    dtype = _as_dtype(param_dtype)
    if not force and (device not in DEVICES or dtype not in DTYPES):
        return []
    rule = (FORCED_DEVICES, FORCED_DTYPES) if force else (DEVICES, DTYPES)
    for _, module in modules:
        setattr(module, _ATTR, rule)
        module.forward = MethodType(_linear_forward, module)
    return [name for name, _ in modules]


def _as_dtype(value: Any) -> torch.dtype | None:
    """torch.dtype from a dtype or a recipe name (``runtime.parse_dtype``: "bf16", "bfloat16", ...)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return parse_dtype(str(value).removeprefix("torch."))
    except ValueError:
        raise UserError(
            f"{WHAT}: unknown param_dtype {value!r}; use one of {', '.join(RECIPE_DTYPES)}"
        ) from None
