"""Device detection, the device -> process-group backend map, dtype names, device setting."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

#: The process-group backend of each device type.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
#: The recipe's dtype names (``parallel.fsdp_plan.param_dtype`` and friends).
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ALIASES = {"half": "fp16", "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype from a recipe name (``bf16``, ``fp16``, ``fp32`` and their long spellings)."""
    if isinstance(name, torch.dtype):
        return name
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def device_type_of_backend(backend: str) -> str:
    """The device type a process-group backend runs on (``gloo`` -> ``cpu``)."""
    for device_type, name in BACKENDS.items():
        if name == backend:
            return device_type
    raise ValueError(f"no device type for the process-group backend {backend!r}")


def detect_device() -> tuple[str, int]:
    """(device, device count): npu, then cuda, then cpu (count 1)."""
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available() and torch.npu.device_count() > 0:
                return "npu", torch.npu.device_count()
        except Exception:  # a broken torch_npu install must not stop a CPU/CUDA launch
            pass
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    return "cpu", 1


def resolve_device_type(requested: str) -> str:
    """``parallel.device`` as a torch device type (auto: npu, then cuda, then cpu)."""
    return detect_device()[0] if requested == "auto" else requested


def device_module(device_type: str) -> ModuleType | None:
    """``torch.cuda`` / ``torch.npu`` for an accelerator (importing torch_npu), None on the CPU."""
    if device_type == "cuda":
        return torch.cuda
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and hccl)

        return torch.npu
    if device_type == "cpu":
        return None
    raise ValueError(f"unknown device type {device_type!r}; use cpu, cuda or npu")


def set_device(device_type: str, local_rank: int) -> torch.device:
    """Make ``local_rank``'s device current for this process; the torch.device to put tensors on."""
    module = device_module(device_type)
    if module is None:
        return torch.device("cpu")
    module.set_device(local_rank)
    return torch.device(device_type, local_rank)


def device_count(device_type: str) -> int | None:
    """How many ``device_type`` devices this machine has (None on the CPU: ranks need no device)."""
    module = device_module(device_type)
    return None if module is None else module.device_count()
