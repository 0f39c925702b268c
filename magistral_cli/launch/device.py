"""Device detection for the launcher and the per-device environment defaults.

The environment defaults come from the seed's NPU launch scripts and their CUDA / CPU
counterparts. A variable the user already set always wins.
"""

from __future__ import annotations

import os

from magistral_cli import runtime

#: The seed's launch scripts (finetune_magistral_2509_v1.sh) export these on Ascend.
NPU_ENV = {
    "HCCL_CONNECT_TIMEOUT": "1200",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "MULTI_STREAM_MEMORY_REUSE": "2",
    "TASK_QUEUE_ENABLE": "1",
    "CPU_AFFINITY_CONF": "1",
}
#: The CUDA counterparts: a fragmentation-resistant allocator and NCCL errors that fail fast.
CUDA_ENV = {
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


def cpu_env(nproc_per_node: int) -> dict[str, str]:
    """CPU ranks share the cores: without this torchrun sets 1 thread per rank, or each rank takes all."""
    threads = max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))
    return {"OMP_NUM_THREADS": str(threads)}


def device_defaults(device: str, nproc_per_node: int) -> dict[str, str]:
    """Environment variables the launcher adds for ``device`` (before the user's own win)."""
    common = {"PYTHONUNBUFFERED": "1"}
    if device == "npu":
        return {**common, **NPU_ENV}
    if device == "cuda":
        return {**common, **CUDA_ENV}
    return {**common, **cpu_env(nproc_per_node)}


def merge_env(defaults: dict[str, str], user_env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(added, kept): variables we add, and defaults the user already set (theirs is kept)."""
    added = {k: v for k, v in defaults.items() if k not in user_env}
    kept = {k: user_env[k] for k in defaults if k in user_env}
    return added, kept


def resolve_device(requested: str) -> tuple[str, int | None, str | None]:
    """(device, count or None, warning or None) for the recipe's ``parallel.device``
    (``runtime.resolve_device``, its problem said of ``parallel.device``)."""
    resolved = runtime.resolve_device(requested)
    warning = f"parallel.device is {requested!r} but {resolved.problem}" if resolved.problem else None
    return resolved.type, resolved.count, warning
