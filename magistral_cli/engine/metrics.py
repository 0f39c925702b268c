"""Run-directory metrics (``metrics.jsonl``, ``summary.json``), the step's model FLOPs and
throughput, and the rank-0 progress line."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from magistral_cli.data.collator import sequence_lengths
from magistral_cli.metric_names import PREFERENCE_METRICS
from magistral_cli.model_config import training_flops
from magistral_cli.run_record import write_json, write_text_atomic
from magistral_cli.runtime import device_module, device_peak_tflops

log = logging.getLogger(__name__)

FIELDS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "step_time_ms",
    "tokens",
    "tokens_per_s",
    "peak_allocated_mib",
    "peak_reserved_mib",
    "alloc_retries",
    "flops_per_token",
    "tflops_per_gpu",
    "mfu",
)
#: The unit a rank's model FLOPs travel in through the step's int64 count all-reduce (the
#: trainer's ``counts``): 6 FLOPs, the factor every term of ``training_flops`` has, so the count stays
#: exact whatever the micro-batch split, and a step's global sum may reach 5.5e19 FLOPs (3.9e8
#: tokens of Magistral-Small-2509 at 4096 a sequence).
FLOP_UNIT = 6


def micro_batch_flops(config, micro_batch: dict[str, Any]) -> int:
    """Model FLOPs of training one host micro-batch (``model_config.training_flops``): each
    non-padding row, or with ``cu_seqlens`` each attention segment (a neat pack's samples), is a
    sequence. Read from host tensors: no device synchronisation."""
    lengths = sequence_lengths(micro_batch["attention_mask"], micro_batch.get("cu_seqlens"))
    return training_flops(config, lengths)


def peak_tflops(device_type: str, override: float | None = None) -> float | None:
    """MFU's denominator: ``tools.peak_tflops``, else this device's dense bf16 peak, else None."""
    return override if override is not None else device_peak_tflops(device_type)


def throughput(flops: int, tokens: int, step_s: float, world_size: int, peak: float | None) -> dict[str, Any]:
    """The step's ``flops_per_token``, ``tflops_per_gpu`` (model TFLOP/s per device, as Megatron
    prints it: global model FLOPs / (step time x devices)) and ``mfu`` (/ ``peak``; None unknown)."""
    tflops = flops / (step_s * world_size) / 1e12 if step_s > 0 else None
    return {
        "flops_per_token": round(flops / tokens) if tokens else None,
        "tflops_per_gpu": None if tflops is None else float(f"{tflops:.6g}"),
        "mfu": None if tflops is None or not peak else float(f"{tflops / peak:.6g}"),
    }


def step_record(
    step: int, loss: float, host: dict[str, Any], lr: float, skipped: bool, device_type: str
) -> dict[str, Any]:
    """A training step's metrics.jsonl record from the values its one synchronisation read back
    (``host``: ``grad_norm``, ``counts`` = targets, tokens, model FLOPs in ``FLOP_UNIT``s) and its
    logged ``loss``; ``add_step_time`` fills in the timing when the step is logged."""
    tokens, flop_units = host["counts"][1:3]  # (preference training adds the pairs after them)
    record = {
        "step": step,
        "loss": loss,
        "grad_norm": host["grad_norm"],
        "lr": lr,
        "step_time_ms": None,
        "tokens": tokens,
        "tokens_per_s": None,
        "model_flops": flop_units * FLOP_UNIT,  # the step's, all dp ranks (not a metrics.jsonl field)
    }
    if skipped:
        record["skipped"] = True
    record.update(memory_stats(device_type))
    return record


def add_step_time(record: dict[str, Any], elapsed: float, world_size: int, peak: float | None) -> None:
    """A record's mean step time ``elapsed`` (seconds), tokens/s, and model TFLOP/s per device over
    every rank (dp x cp) with MFU against ``peak`` (``throughput``)."""
    record["step_time_ms"] = round(elapsed * 1000, 2)
    record["tokens_per_s"] = round(record["tokens"] / elapsed, 1) if elapsed > 0 else None
    record.update(throughput(record["model_flops"], record["tokens"], elapsed, world_size, peak))


def memory_stats(device_type: str) -> dict[str, Any]:
    """Peak allocated / reserved MiB since the last call, and allocation retries (None on the CPU)."""
    mod = device_module(device_type)
    if mod is None:
        return {"peak_allocated_mib": None, "peak_reserved_mib": None, "alloc_retries": None}
    stats = mod.memory_stats()
    out = {
        "peak_allocated_mib": round(mod.max_memory_allocated() / 2**20, 1),
        "peak_reserved_mib": round(mod.max_memory_reserved() / 2**20, 1),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }
    mod.reset_peak_memory_stats()
    return out


def _strict(value: Any) -> Any:
    """A non-finite float as null: metrics.jsonl is strict JSON (``NaN`` is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _resumed_step(line: str) -> int | None:
    """The step of a metrics.jsonl line, or None for a line that is not a record of one: cut by a
    crash, not a JSON object, nested too deeply to parse, or a ``step`` that is not an integer."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class MetricsFile:
    """Append-only ``metrics.jsonl`` (rank 0), and the ``tools.logger`` sinks that get each line.

    On resume from step N, the lines after step N (and any line that is no record of a step: cut
    by a crash, or with a ``step`` that is not an integer) are moved aside to
    ``metrics.after_step_<N>[.K].jsonl`` next to it, never deleted: they describe steps the
    resumed run will take again. Each line is appended whole or not at all: a write that fails
    (a full disk) is taken back and raises an ``OSError`` naming the file.
    """

    def __init__(self, path: Path, resume_step: int = 0, *, recipe: Any = None, sinks: list | None = None):
        self.path = path
        self.moved_aside: Path | None = None
        # tools.logger (TensorBoard / W&B) gets every line written here; built first, so that a
        # missing package stops the run before it trains (UserError naming the extra to install).
        if sinks is None:
            from .loggers import build_sinks

            sinks = build_sinks(recipe, path.parent, resume_step) if recipe is not None else []
        self.sinks = list(sinks)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            kept, aside = [], []
            for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
                if not line.strip():
                    continue
                step = _resumed_step(line)
                (kept if step is not None and step <= resume_step else aside).append(line)
            if aside:
                moved_aside = self._aside_path(resume_step)
                write_text_atomic(moved_aside, "".join(a + "\n" for a in aside))
                try:
                    write_text_atomic(path, "".join(k + "\n" for k in kept))
                except OSError:
                    moved_aside.unlink(missing_ok=True)  # metrics.jsonl is unchanged: no copy aside
                    raise
                self.moved_aside = moved_aside
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _aside_path(self, step: int) -> Path:
        base = f"{self.path.stem}.after_step_{step}"
        candidate, k = self.path.with_name(f"{base}.jsonl"), 1
        while candidate.exists():
            candidate, k = self.path.with_name(f"{base}.{k}.jsonl"), k + 1
        return candidate

    def _append(self, text: str) -> None:
        data = memoryview(text.encode("utf-8"))
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)  # no half line left behind
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def write(self, record: dict[str, Any]) -> None:
        """One line: a train step's FIELDS, or a record with a ``split`` (``"val"``) as given."""
        if record.get("split", "train") != "train":
            line = {"step": record["step"], "split": record["split"]}
            line.update({k: _strict(v) for k, v in record.items() if k not in line})
        else:
            line = {k: _strict(record.get(k)) for k in FIELDS}
            # Preference training's metrics (trl's names: rewards/..., logps/...) follow the fields.
            line.update({k: _strict(record[k]) for k in PREFERENCE_METRICS if k in record})
            if record.get("skipped"):
                line["skipped"] = True
        self._append(json.dumps(line, allow_nan=False) + "\n")
        for sink in list(self.sinks):
            try:
                sink.log(line)
            except Exception as exc:  # a dashboard failing mid-run does not stop the training
                log.warning(
                    "tools.logger %s failed and is off for the rest of the run: %s", type(sink).__name__, exc
                )
                self.sinks.remove(sink)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                log.warning("tools.logger %s did not close cleanly: %s", type(sink).__name__, exc)


def write_summary(path: Path, *, steps: int, wall_s: float, exit_status: int, **extra: Any) -> None:
    """``summary.json``, written whole or not at all (a failure names the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"steps": steps, "wall_s": round(wall_s, 3), "exit_status": exit_status, **extra}
    write_json(path, record, check_failed=False)


def _loss_text(loss: float | None) -> str:
    """A loss for the progress line: 4 decimals, ``nan`` for a missing or non-finite one."""
    return "nan" if loss is None else f"{loss:.4f}"


def _tflops_text(tflops: float) -> str:
    """TFLOP/s for the progress line: one decimal as Megatron prints it, 3 significant digits below 1."""
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"


def _eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Rank 0's progress: a rich live line on a terminal, plain lines otherwise (logs, pipes, torchrun)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.total = total_steps
        self.enabled = enabled
        self.started = time.monotonic()
        self.start_step = start_step
        self.val_loss: float | None = None  # the latest validation loss (Progress.validation)
        self._last: dict[str, Any] | None = None  # the latest training record (update)
        self._validated = False
        self._live = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._task = self._live.add_task("train", total=total_steps, completed=start_step, info="")
            self._live.start()

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._last = record
        step = record["step"]
        done = step - self.start_step
        eta = (time.monotonic() - self.started) / max(done, 1) * (self.total - step)
        info = self._info(record)
        if self._live is not None:
            self._live.update(self._task, completed=step, info=info)
        else:
            print(f"step {step}/{self.total}  {info}  eta {_eta(eta)}", file=sys.stderr, flush=True)

    def _info(self, record: dict[str, Any]) -> str:
        val = f"  val {_loss_text(self.val_loss)}" if self._validated else ""
        info = (
            f"loss {_loss_text(record['loss'])}{val}  lr {record['lr']:.2e}  {record['step_time_ms']:.0f} ms/step"
            f"  {record['tokens_per_s']:.0f} tok/s"
        )
        if record.get("tflops_per_gpu") is not None:
            info += f"  {_tflops_text(record['tflops_per_gpu'])} TFLOP/s/dev"
        if record.get("mfu") is not None:
            info += f"  MFU {record['mfu']:.1%}"
        return info

    def validation(self, record: dict[str, Any]) -> None:
        """After an evaluation: one line ``step N validation loss L (S samples)``; from then on the
        progress line shows ``val L`` after the training loss.

        ``record`` is the validation record written to metrics.jsonl (``step``, ``loss``, ``samples``).
        """
        if not self.enabled:
            return
        loss = record.get("loss")
        self.val_loss = None if loss is None else float(loss)
        self._validated = True
        text = f"step {record['step']} validation loss {_loss_text(self.val_loss)}"
        if record.get("samples") is not None:
            text += f" ({record['samples']} samples)"
        if self._live is not None:
            self._live.console.print(text)
            if self._last is not None:
                self._live.update(self._task, info=self._info(self._last))
        else:
            print(text, file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
