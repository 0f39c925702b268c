"""The lowest layer: devices, dtypes, process groups and rank processes.

Everything that starts a device or a rank process goes through here (the engine, the probes,
the CP harness, the tests and benchmarks), so the device -> backend map, the dtype names and
the "spawn ranks, run jobs, collect per-rank JSON" routine are written once. It imports nothing
from the rest of the package except ``errors``.
"""

from magistral_cli.runtime.device import (
    BACKENDS,
    BF16_PEAK_TFLOPS,
    DTYPES,
    ResolvedDevice,
    detect_device,
    device_module,
    device_name,
    device_peak_tflops,
    device_type_of_backend,
    host_to_device,
    parse_dtype,
    peak_tflops_of,
    resolve_device,
    resolve_device_type,
    set_device,
)
from magistral_cli.runtime.distributed import (
    at_rank_exit,
    destroy_distributed,
    finish_rank_process,
    init_distributed,
    spawn_ranks,
)

__all__ = [
    "BACKENDS",
    "BF16_PEAK_TFLOPS",
    "DTYPES",
    "ResolvedDevice",
    "destroy_distributed",
    "detect_device",
    "device_module",
    "device_name",
    "device_peak_tflops",
    "device_type_of_backend",
    "host_to_device",
    "at_rank_exit",
    "finish_rank_process",
    "init_distributed",
    "parse_dtype",
    "peak_tflops_of",
    "resolve_device",
    "resolve_device_type",
    "set_device",
    "spawn_ranks",
]
