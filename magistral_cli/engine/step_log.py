"""What a launch's steps log and where it goes.

- ``read_step_values``: the values the step's one host read brings back (the finiteness check's
  inputs and the metrics line's counts, so that logging reads nothing more);
- ``StepLog``: each logged step's mean step time, tokens/s and MFU, written to ``metrics.jsonl``
  and the ``tools.logger`` sinks (rank 0) and shown on the progress line, with the validation
  records beside them.

``Trainer.train`` decides when a step is logged, evaluated or checkpointed; ``StepLog`` times the
steps and writes what they log (``Trainer._record`` makes a step's record: ``metrics.step_record``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from magistral_cli.config.schema import Recipe

from .metrics import MetricsFile, Progress, add_step_time, peak_tflops
from .validate import log_validation

log = logging.getLogger("magistral_cli.engine")


def read_step_values(
    grad_norm: torch.Tensor, loss_sum: torch.Tensor, counts: torch.Tensor | None
) -> dict[str, Any]:
    """The step's gradient norm, loss sum and (exact, int64) counts in one device-to-host read.

    ``loss_sum`` is a scalar, or a vector whose first entry is the loss sum (preference training:
    then its metrics' sums, all under ``sums``). float64 holds integers exactly only up to 2**53,
    so each count travels as its high and low 32 bits (each exact in float64) and is put back
    together here.
    """
    sums = loss_sum.reshape(-1)
    parts = [torch.cat([grad_norm.reshape(1), sums]).to(torch.float64)]
    if counts is not None:
        parts += [(counts >> 32).to(torch.float64), (counts & 0xFFFFFFFF).to(torch.float64)]
    values = torch.cat(parts).tolist()
    k = 1 + sums.numel()
    host: dict[str, Any] = {
        "grad_norm": values[0],
        "loss_sum": values[1],
        "sums": values[1:k],
        "counts": None,
    }
    if counts is not None:
        n = counts.numel()
        high, low = values[k : k + n], values[k + n :]
        host["counts"] = [(int(h) << 32) + int(lo) for h, lo in zip(high, low, strict=True)]
    return host


class StepLog:
    """The records of one ``train`` call, timed between logged steps.

    A logged step's time is the mean over the steps since the last logged one (the steps between
    are not synchronised), without the time spent in ``paused`` (evaluations and checkpoint
    writes: they are no step's work).
    """

    def __init__(
        self, recipe: Recipe, run_dir: Path, *, step: int, rank: int, device_type: str, world_size: int
    ):
        self.rank, self.world_size = rank, world_size
        is_rank0 = rank == 0
        # tools.logger (TensorBoard / W&B) sinks get every line, from rank 0 only.
        self.metrics = (
            MetricsFile(run_dir / "metrics.jsonl", resume_step=step, recipe=recipe) if is_rank0 else None
        )
        if self.metrics is not None and self.metrics.moved_aside is not None:
            log.warning("metrics.jsonl lines after step %d moved to %s", step, self.metrics.moved_aside)
        self.progress = Progress(recipe.training.train_iters, step, enabled=is_rank0)
        # MFU's denominator (None: unknown).
        self.peak = peak_tflops(device_type, recipe.tools.peak_tflops)
        self.records: list[dict[str, Any]] = []
        self.restart_interval()

    def restart_interval(self) -> None:
        """Time the next logged step's interval from now."""
        self._interval_start, self._interval_steps, self._paused = time.perf_counter(), 0, 0.0

    def step_taken(self, record: dict[str, Any] | None) -> None:
        """Count a step; ``record`` (a logged step's) gets the interval's mean step time and is written."""
        self._interval_steps += 1
        if record is None:
            return
        elapsed = (time.perf_counter() - self._interval_start - self._paused) / self._interval_steps
        add_step_time(record, elapsed, self.world_size, self.peak)
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.write(record)
        self.progress.update(record)
        self.restart_interval()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work inside is left out of the step times."""
        start = time.perf_counter()
        yield
        self._paused += time.perf_counter() - start

    def validation(self, record: dict[str, Any] | None) -> None:
        """An evaluation's record (None: no validation split) into metrics.jsonl and the progress line."""
        if record is not None:
            log_validation(record, self.metrics, self.progress, rank=self.rank)

    def message(self, text: str) -> None:
        self.progress.message(text)

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
