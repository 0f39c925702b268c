"""Writers of training logs in the formats `magistral compare` reads, for tests and examples.

The line shapes copy what the trainers print: MindSpeed-MM's FSDP2 ``TrainEngine.training_log``,
Megatron-LM's ``training_log`` and their ``report_memory`` lines (see ``magistral_cli.analysis.logs``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

_STAMP = "[2025-09-20 10:00:00]"


def fsdp2_trainer_line(step: int, total: int, loss: float, step_time_ms: float, lr: float = 1e-5) -> str:
    """One MindSpeed-MM FSDP2 trainer log line."""
    return (
        f" {_STAMP} iteration {step:8d}/{total:8d} | consumed samples: {8 * step:12d} |"
        f" elapsed time per iteration (ms): {step_time_ms:.1f} | learning rate: {lr:.6E} |"
        f" global batch size: {8:5d} | loss: {loss:.6E} | grad norm: {1.0:.3f} |"
    )


def megatron_line(
    step: int, total: int, loss: float | None, step_time_ms: float, nan_iterations: int = 0
) -> str:
    """One Megatron-LM training log line; ``loss=None`` prints none (as Megatron does for a NaN step)."""
    loss_part = "" if loss is None else f" lm loss: {loss:.6E} | loss scale: 1.0 |"
    return (
        f" {_STAMP} iteration {step:8d}/{total:8d} | consumed samples: {8 * step:12d} |"
        f" elapsed time per iteration (ms): {step_time_ms:.1f} | throughput per GPU (TFLOP/s/GPU): 123.4 |"
        f" learning rate: {1e-5:.6E} | global batch size: {8:5d} |{loss_part} grad norm: {1.0:.3f} |"
        f" number of skipped iterations: {0:3d} | number of nan iterations: {nan_iterations:3d} |"
    )


def memory_report_line(rank: int, iteration: int, max_allocated_mib: float, max_reserved_mib: float) -> str:
    """One ``report_memory`` line (both trainers print this shape)."""
    return (
        f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {max_allocated_mib / 2} |"
        f" max allocated: {max_allocated_mib} | reserved: {max_reserved_mib / 2} | max reserved: {max_reserved_mib}"
    )


def write_run_dir(path: Path, records: Iterable[dict], wall_s: float | None = None) -> Path:
    """A run directory with ``metrics.jsonl`` (one record per line) and, with ``wall_s``, ``summary.json``."""
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record) for record in records]
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    if wall_s is not None:
        summary = {"steps": len(lines), "wall_s": wall_s, "exit_status": 0}
        (path / "summary.json").write_text(json.dumps(summary))
    return path
