"""Device detection and resolution, the device -> backend map, dtype names, device setting."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ResolvedDevice:
    """What a requested device (``auto``, ``cpu``, ``cuda``, ``npu``) is on this machine."""

    type: str  # the device type: auto's pick, else the requested one
    count: int | None  # how many are visible (1 for the CPU); None when the requested type is not
    #: Why the requested type cannot be used here (it is not visible), or None. Callers put it in
    #: their own words (a warning, an error naming their flag).
    problem: str | None = None


def resolve_device(requested: str) -> ResolvedDevice:
    """The one resolution of a requested device (auto: npu, then cuda, then cpu; ``detect_device``).

    ``cpu`` needs no detection; ``cuda`` / ``npu`` that this machine does not have resolve to
    themselves, with no count and the problem said.
    """
    if requested == "cpu":
        return ResolvedDevice("cpu", 1)
    found, count = detect_device()
    if requested in ("auto", found):
        return ResolvedDevice(found, count)
    return ResolvedDevice(requested, None, f"no {requested} device is visible here (found {found})")


def resolve_device_type(requested: str) -> str:
    """``parallel.device`` as a torch device type (auto: npu, then cuda, then cpu)."""
    return resolve_device(requested).type


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


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (a host tensor) on ``device`` without making the host wait.

    A copy from pageable host memory is synchronous: the host waits for the device to finish
    everything queued before it (``torch.cuda.set_sync_debug_mode`` reports it). From pinned
    memory with ``non_blocking`` the copy is queued like a kernel; the pinned staging copy comes
    from torch's caching host allocator, which keeps it until the copy has run.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return tensor.to(device)  # itself (testing.host_sync sees the move and counts it as one)
    return tensor.pin_memory().to(device, non_blocking=True)


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


#: Dense bf16 peak TFLOP/s of one device (MFU's denominator), by a part of the name the device
#: reports (``torch.cuda.get_device_name()``, ``torch.npu.get_device_name()``), matched without
#: case in this order: the first match wins, so a variant comes before its family's name.
#: NVIDIA: the data sheets' bf16 Tensor Core figures without sparsity, half the printed "with
#: sparsity" ones, rounded down as Megatron and torchtitan use them: H100 SXM 1,979 -> 989, H100
#: PCIe 1,513 -> 756, H100 NVL 1,671 -> 835 (nvidia.com/en-us/data-center/h100); H200 SXM 1,979
#: -> 989, H200 NVL 1,671 -> 835 (nvidia.com/en-us/data-center/h200); A100 312 (a100).
#: Ascend: the Cube unit's dense fp16/bf16 peak, cube cores x clock x 4096 multiply-adds x 2
#: (910B3: 20 x 1.8 GHz -> 294.9; 910B4: 20 x 1.5 GHz -> 245.8; 910B2 and the A3 dies
#: Ascend910_9392 / _9362: 24 x 1.8 GHz -> 353.9; 910B1: 373.9), the figures Huawei's torchtitan
#: NPU integration takes for MFU (beside the "total" 400 / 376 / 313 / 280 it also lists).
#: An unlisted device (or the CPU) has no peak: ``tools.peak_tflops`` sets one.
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # also GH200 (an H100-class GPU)
    ("A100", 312.0),
    ("Ascend910B1", 373.88),
    ("Ascend910B2", 353.89),  # also 910B2C
    ("Ascend910B3", 294.91),
    ("Ascend910B4", 245.76),
    ("Ascend910_9392", 353.89),
    ("Ascend910_9362", 353.89),
)


def peak_tflops_of(name: str | None) -> float | None:
    """The dense bf16 peak TFLOP/s of a device called ``name`` (``BF16_PEAK_TFLOPS``), or None."""
    if not name:
        return None
    folded = name.casefold()
    for part, peak in BF16_PEAK_TFLOPS:
        if part.casefold() in folded:
            return peak
    return None


def device_name(device_type: str) -> str | None:
    """The name the current ``device_type`` device reports (None on the CPU)."""
    module = device_module(device_type)
    return None if module is None else str(module.get_device_name())


def device_peak_tflops(device_type: str) -> float | None:
    """The current device's dense bf16 peak TFLOP/s, or None (the CPU, an unlisted device)."""
    return peak_tflops_of(device_name(device_type))
