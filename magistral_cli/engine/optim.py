"""AdamW (on the device, or with its state held in host memory), the learning-rate schedule, and clipping."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_functional

from magistral_cli.config.schema import Training


def fused_available(device_type: str) -> bool:
    """Whether torch has a fused AdamW kernel for ``device_type`` (npu registers as privateuse1)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device_type in _get_fused_kernels_supported_devices()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AdamWSwap(torch.optim.AdamW):
    """AdamW whose moments live in host memory and visit the device only for the update.

    The seed's 4-card recipe: the two fp32 moments are 2x the size of the fp32 parameter shard,
    so keeping them on the host frees most of the optimizer's device memory. ``step`` streams the
    state in chunks of about ``chunk_bytes`` (copy in, the same functional AdamW update that
    ``torch.optim.AdamW`` runs with the same ``foreach`` / ``fused`` flags, copy back), so the
    numbers equal ``adamw``'s. The moments stay DTensors (with host-local shards) so that
    checkpoints reshard like any other FSDP2 state.
    """

    def __init__(self, params, *, chunk_bytes: int = 256 << 20, **kwargs):
        super().__init__(params, **kwargs)
        self.chunk_bytes = chunk_bytes

    def _host_zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        local = _local(param)
        pin = local.device.type in ("cuda", "npu")
        host = torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        if isinstance(param, DTensor):
            return DTensor.from_local(
                host,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        return host

    def _state_for(self, param: torch.Tensor, fused: bool) -> dict:
        state = self.state[param]
        if not state:
            device = _local(param).device if fused else "cpu"
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = self._host_zeros_like(param)
            state["exp_avg_sq"] = self._host_zeros_like(param)
        return state

    def _chunks(self, params: list[torch.Tensor]):
        chunk, size = [], 0
        for p in params:
            chunk.append(p)
            size += _local(p).numel() * _local(p).element_size()
            if size >= self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["differentiable"] or group["capturable"]:
                raise ValueError(
                    "adamw_swap supports plain AdamW (no amsgrad, maximize, capturable, differentiable)"
                )
            fused = bool(group["fused"])
            params = [p for p in group["params"] if p.grad is not None]
            for chunk in self._chunks(params):
                states = [self._state_for(p, fused) for p in chunk]
                local_params = [_local(p) for p in chunk]
                device = local_params[0].device
                exp_avgs = [_local(s["exp_avg"]).to(device, non_blocking=True) for s in states]
                exp_avg_sqs = [_local(s["exp_avg_sq"]).to(device, non_blocking=True) for s in states]
                adamw_functional(
                    local_params,
                    [_local(p.grad) for p in chunk],
                    exp_avgs,
                    exp_avg_sqs,
                    [],
                    [s["step"] for s in states],
                    foreach=group["foreach"],
                    fused=group["fused"],
                    capturable=False,
                    differentiable=False,
                    grad_scale=None,
                    found_inf=None,
                    has_complex=False,
                    amsgrad=False,
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                for s, ea, eas in zip(states, exp_avgs, exp_avg_sqs, strict=True):
                    host_ea, host_eas = _local(s["exp_avg"]), _local(s["exp_avg_sq"])
                    if host_ea.data_ptr() != ea.data_ptr():
                        host_ea.copy_(ea, non_blocking=True)
                        host_eas.copy_(eas, non_blocking=True)
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        # torch's loader moves state next to each parameter; put the moments back on the host.
        for param, state in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = state.get(key)
                if value is not None and _local(value).device.type != "cpu":
                    host = self._host_zeros_like(param)
                    _local(host).copy_(_local(value))
                    state[key] = host


def build_optimizer(model: nn.Module, training: Training, device_type: str) -> torch.optim.Optimizer:
    """AdamW or AdamWSwap over the trainable parameters, with the recipe's hyper-parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: model.freeze covers the whole model")
    fused = training.adam_fused and fused_available(device_type)
    kwargs = {
        "lr": training.lr,
        "betas": (training.adam_beta1, training.adam_beta2),
        "eps": training.adam_eps,
        "weight_decay": training.weight_decay,
        # Pinned explicitly (not torch's per-device default) so adamw and adamw_swap run the same kernel.
        "foreach": not fused,
        "fused": fused,
    }
    if training.optimizer == "adamw_swap":
        return AdamWSwap(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def lr_at(step: int, training: Training) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warm-up, then the decay style."""
    total = training.train_iters
    warmup = int(training.lr_warmup_ratio * total)
    peak, floor = training.lr, training.min_lr
    if warmup and step <= warmup:
        return peak * step / warmup
    if training.lr_decay_style == "constant" or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / (total - warmup))
    if training.lr_decay_style == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def grad_norm_and_sums(
    params: list[torch.Tensor], extra: torch.Tensor, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(global L2 norm of the gradients, ``extra`` summed over ``group``), in one all-reduce.

    FSDP2 shards every parameter (``Shard`` placements over the data-parallel group), so the sum
    over ranks of the squared local shards is the squared global norm. Working on the local
    shards avoids DTensor dispatch per parameter, and folding ``extra`` (the step's loss sum)
    into the same all-reduce saves a collective per step.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    grads = []
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and not all(isinstance(pl, Shard) for pl in p.grad.placements):
            raise ValueError(f"gradient with placements {p.grad.placements}: expected FSDP2 shards")
        grads.append(_local(p.grad))
    device = extra.device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        norms = torch._foreach_norm(grads, 2.0)
        squares = torch.stack([n.to(torch.float32) for n in norms]).square().sum().to(device)
    buffer = torch.stack([squares, extra.to(torch.float32)])
    if dist.is_initialized():
        dist.all_reduce(buffer, group=group)
    return buffer[0].sqrt(), buffer[1]


def clip_grads_(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients so that their global norm is at most ``max_norm`` (torch's coefficient)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
