"""AdamW (on the device, or with its state held in host memory), the learning-rate schedule, and clipping."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_functional

from magistral_cli.config.schema import Training

log = logging.getLogger("magistral_cli.engine")

#: (device type, dtype) -> why the fused AdamW kernel cannot run there, or None when it ran.
_fused_probe_cache: dict[tuple[str, torch.dtype], str | None] = {}


def _probe_fused(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run one fused AdamW step on a 1-element parameter; the error, or None when it ran and was right.

    torch lists privateuse1 (npu) among the fused devices whatever the backend registered, and
    some torch_npu builds have no ``_fused_adamw_`` kernel (ms-swift #7327 on 910B3, torchtune
    #2646), so only running the kernel tells. The host read-back synchronises, so an error
    raised asynchronously by the device surfaces here too.
    """
    try:
        param = nn.Parameter(torch.ones(1, dtype=dtype, device=device))
        param.grad = torch.full_like(param, 0.5)
        torch.optim.AdamW([param], lr=0.1, weight_decay=0.0, foreach=False, fused=True).step()
        value = float(param.detach().float().cpu()[0])
    except Exception as exc:  # any failure means "not here": NotImplementedError, RuntimeError, driver errors
        message = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {message[0] if message else ''}"
    # One step from 1.0 with gradient 0.5: m_hat = 0.5, v_hat = 0.25, update lr * 0.5 / 0.5 = 0.1.
    if not math.isclose(value, 0.9, rel_tol=1e-2):
        return f"the fused step gave {value}, not 0.9"
    return None


def fused_unavailable_reason(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str | None:
    """Why the fused AdamW kernel cannot update ``dtype`` parameters on ``device`` (None: it can).

    A real check, cached per device type and dtype: one fused step on that device. On the CPU
    torch has a fused kernel too (for fp16, bf16, fp32, fp64), so ``adam_fused: true`` there
    gets it like on any device whose kernel runs.
    """
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _fused_probe_cache:
        _fused_probe_cache[key] = _probe_fused(device, dtype)
    return _fused_probe_cache[key]


def adamw_implementation(
    training: Training, device: torch.device | str, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> tuple[str, str]:
    """("fused" or "foreach", why) for ``training.adam_fused`` on ``device`` with ``dtypes`` parameters."""
    device = torch.device(device)
    if not training.adam_fused:
        return "foreach", "training.adam_fused is false"
    for dtype in dtypes:
        reason = fused_unavailable_reason(device, dtype)
        if reason is not None:
            return "foreach", (
                f"training.adam_fused is true but the fused AdamW kernel failed on {device.type} "
                f"for {str(dtype).removeprefix('torch.')}: {reason}"
            )
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return "fused", f"training.adam_fused is true and a fused AdamW step ran on {device.type} ({names})"


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
    """AdamW or AdamWSwap over the trainable parameters, with the recipe's hyper-parameters.

    The fused kernel is used only when ``training.adam_fused`` asks for it and one fused step
    really ran where the parameters are (``device_type`` once the model is materialized), for
    their dtypes; otherwise foreach. The choice is logged and kept on the optimizer as
    ``adamw_choice`` (a JSON-ready dict) for ``run_identity.json``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: model.freeze covers the whole model")
    local = [_local(p) for p in params]
    devices = sorted({t.device for t in local}, key=str)
    dtypes = tuple(sorted({t.dtype for t in local}, key=str))
    if len(devices) != 1:
        implementation, reason = "foreach", f"parameters on several devices ({', '.join(map(str, devices))})"
    else:
        implementation, reason = adamw_implementation(training, devices[0], dtypes)
    fused = implementation == "fused"
    kwargs = {
        "lr": training.lr,
        "betas": (training.adam_beta1, training.adam_beta2),
        "eps": training.adam_eps,
        "weight_decay": training.weight_decay,
        # Pinned explicitly (not torch's per-device default) so adamw and adamw_swap run the same kernel.
        "foreach": not fused,
        "fused": fused,
    }
    cls = AdamWSwap if training.optimizer == "adamw_swap" else torch.optim.AdamW
    optimizer = cls(params, **kwargs)
    optimizer.adamw_choice = {
        "optimizer": training.optimizer,
        "adam_fused_requested": training.adam_fused,
        "implementation": implementation,
        "reason": reason,
        "device_type": device_type,
    }
    # A recipe that asked for the fused kernel and did not get it deserves more than an info line.
    report = log.warning if training.adam_fused and not fused else log.info
    report("%s: %s AdamW (%s)", training.optimizer, implementation, reason)
    return optimizer


def lr_at(step: int, training: Training) -> float:
    """The schedule after ``step`` scheduler steps: linear warm-up from 0, then the decay style.

    Optimizer step k uses ``lr_at(k - 1)``: MindSpeed-MM reads the lr before ``scheduler.step()``.
    """
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
    """(global L2 norm of the gradients, ``extra`` (a scalar or a vector) summed over ``group``), in one all-reduce.

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
    buffer = torch.cat([squares.reshape(1), extra.to(torch.float32).reshape(-1)])
    if dist.is_initialized():
        dist.all_reduce(buffer, group=group)
    # A scalar ``extra`` comes back a scalar, a vector (preference training's sums) a vector.
    return buffer[0].sqrt(), buffer[1] if extra.ndim == 0 else buffer[1:]


def clip_grads_(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients so that their global norm is at most ``max_norm`` (torch's coefficient)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
