"""Read the per-step record of a training run from any of the formats `compare` knows.

Known formats (``detect_format`` names them):

``run-dir``
    A run directory written by ``magistral train``: ``metrics.jsonl`` plus ``summary.json``
    (``wall_s``) when the run finished (DESIGN.md, "Run directory").
``metrics-jsonl``
    A ``metrics.jsonl`` file on its own: one JSON object per logged step with at least ``step``;
    ``loss``, ``step_time_ms``, ``tflops_per_gpu``, ``mfu``, ``peak_allocated_mib``,
    ``peak_reserved_mib`` and ``alloc_retries`` are read where present (``null`` or absent = not
    logged). A ``summary.json`` next to it supplies ``wall_s``.
``mindspeed-fsdp2-log``
    Standard output of MindSpeed-MM's FSDP2 trainer (``mindspeed_mm/fsdp/train/trainer.py``, the
    seed's "pure FSDP2" backend). Its ``TrainEngine.training_log`` prints one line per logged step::

        [2025-09-20 10:00:00] iteration       10/    2000 | consumed samples:           80 | elapsed time per iteration (ms): 1987.7 | learning rate: 1.000000E-05 | global batch size:     8 | loss: 1.234000E+00 | grad norm: 1.234 |

    (a NaN loss prints as ``loss: NAN``), and after a fixed iteration ``report_memory`` prints::

        [Rank 0] (after 10 iterations) memory (MB) | allocated: 1024.0 | max allocated: 2048.0 | reserved: 3072.0 | max reserved: 4096.0

``megatron-log``
    Standard output of Megatron-LM / MindSpeed-MM's Megatron backend (``pretrain_transformers.py``,
    the seed's baseline): the same ``iteration N/ M | key: value | ...`` lines with ``lm loss:``
    instead of ``loss:``, and ``number of skipped iterations`` / ``number of nan iterations`` fields
    (an iteration counted as NaN prints no loss; it is read as a NaN loss), and the same memory lines.
    With ``--log-throughput`` a line also carries ``throughput per GPU (TFLOP/s/GPU): 123.4`` (newer
    Megatron: ``compute per GPU (TFLOP/s/GPU): 123.4 (avg 123.0)``), read as ``tflops_per_gpu``.

In both text formats the ``key: value`` fields may come in any order, any text (a timestamp, a
``[rank0]:`` prefix) may precede ``iteration``, and other lines are ignored. Memory is in MB of
2**20 bytes, i.e. MiB. Text logs carry no allocation retries and no whole-run wall time.

A step logged twice (a run resumed from a checkpoint that appends to the same log) keeps its last
value; the reader lists such steps in ``RunLog.duplicate_steps``.

Validation records of ``metrics.jsonl`` (``{"step": N, "split": "val", "loss": L, "samples": S,
"targets": T}``, written by ``magistral train`` with ``data.dataset_param.basic_parameters.val_size``)
are not training steps: they go to ``RunLog.val_steps`` (last value wins there too), and the
training curve holds only the lines without a ``split`` (or with ``"split": "train"``). Lines of
any other split are ignored. The text formats carry no validation losses.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from magistral_cli.errors import UserError
from magistral_cli.metric_names import FORMER_PREFERENCE_NAMES, PREFERENCE_METRICS

KNOWN_FORMATS = {
    "run-dir": "a run directory written by `magistral train` (metrics.jsonl, summary.json)",
    "metrics-jsonl": 'a metrics.jsonl file (one JSON object per step with "step" and "loss")',
    "mindspeed-fsdp2-log": "a MindSpeed-MM FSDP2 trainer log ('iteration 10/ 2000 | ... | loss: 1.234000E+00 | ...')",
    "megatron-log": "a Megatron / MindSpeed-MM Megatron log ('iteration 10/ 2000 | ... | lm loss: 1.234E+00 | ...')",
}

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)$")
#: Megatron's model TFLOP/s per GPU (``--log-throughput``): the older key, then the newer one.
_THROUGHPUT_KEYS = ("throughput per GPU (TFLOP/s/GPU)", "compute per GPU (TFLOP/s/GPU)")
_LEADING_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
_MEMORY = re.compile(r"memory \(MB\)\s*\|(.*)$")


@dataclass
class StepRecord:
    """What one run logged at one step; ``None`` where the value was not logged."""

    loss: float | None = None
    step_time_ms: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    alloc_retries: int | None = None
    #: Preference training's metrics (``metric_names.PREFERENCE_METRICS``) that the step logged.
    preference: dict[str, float] = field(default_factory=dict)


@dataclass
class ValRecord:
    """One validation of a run (a ``"split": "val"`` line); ``None`` where not logged or not finite."""

    loss: float | None = None
    samples: int | None = None
    targets: int | None = None


@dataclass
class RunLog:
    """A run as read from disk: per-step records plus whole-run figures.

    ``peak_allocated_mib`` / ``peak_reserved_mib`` / ``alloc_retries`` are the maxima over every
    step and rank that logged them (``None`` when nothing did); ``wall_s`` comes from ``summary.json``.
    ``val_steps`` holds the validation losses by step (empty when the run logged none).
    """

    path: Path
    format: str
    steps: dict[int, StepRecord]
    duplicate_steps: list[int] = field(default_factory=list)
    wall_s: float | None = None
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    alloc_retries: int | None = None
    notes: list[str] = field(default_factory=list)
    val_steps: dict[int, ValRecord] = field(default_factory=dict)
    duplicate_val_steps: list[int] = field(default_factory=list)

    def describe(self) -> dict:
        """The JSON description of this source (``baseline`` / ``candidate`` in the compare output)."""
        steps = sorted(self.steps)
        return {
            "path": str(self.path),
            "format": self.format,
            "steps_logged": len(steps),
            "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None,
            "duplicate_steps": list(self.duplicate_steps),
            "validation_steps_logged": len(self.val_steps),
        }


def known_formats_text() -> str:
    """One line per known format, for error messages."""
    return "; ".join(f"{name}: {text}" for name, text in KNOWN_FORMATS.items())


def detect_format(path: Path) -> str:
    """Name the format of ``path`` (a key of ``KNOWN_FORMATS``) or raise ``UserError``."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist: pass a run directory, a metrics.jsonl or a training log")
    if path.is_dir():
        if (path / "metrics.jsonl").is_file():
            return "run-dir"
        raise UserError(
            f"{path} is a directory without metrics.jsonl: pass a run directory written by "
            "`magistral train` (one that logged at least one step) or a log file"
        )
    text = _read_text(path)
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            record = json.loads(first)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "step" in record:
            return "metrics-jsonl"
    pairs = [_fields(m.group(2)) for m in map(_ITERATION.search, text.splitlines()) if m]
    if pairs:
        megatron_keys = {"lm loss", "number of skipped iterations", "number of nan iterations"}
        if any(megatron_keys & fields.keys() for fields in pairs):
            return "megatron-log"
        return "mindspeed-fsdp2-log"
    raise UserError(f"{path} is in no known format. Known formats: {known_formats_text()}")


def read_run(path: Path) -> RunLog:
    """Read a run directory, a ``metrics.jsonl`` or a training log (format detected)."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "run-dir":
        run = _read_metrics_jsonl(path / "metrics.jsonl")
        run.path, run.format = path, fmt
    elif fmt == "metrics-jsonl":
        run = _read_metrics_jsonl(path)
    else:
        run = _read_text_log(path, fmt)
    if not run.steps:
        raise UserError(f"{path} logs no training step ({fmt}); nothing to compare")
    return run


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def _number(value) -> float | None:
    """A logged number as float; ``None`` for null/absent; NaN/inf are kept (reported later)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _max(values) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return max(present) if present else None


def _store(steps: dict, duplicates: list[int], step: int, record) -> None:
    if step in steps and step not in duplicates:
        duplicates.append(step)
    steps[step] = record  # the last occurrence wins: after a resume it is the one that counts


def _read_metrics_jsonl(path: Path) -> RunLog:
    lines = _read_text(path).splitlines()
    steps: dict[int, StepRecord] = {}
    duplicates: list[int] = []
    val_steps: dict[int, ValRecord] = {}
    val_duplicates: list[int] = []
    notes: list[str] = []
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    for position, (lineno, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if position == len(numbered) - 1:
                # A run killed while writing leaves a partial last line; everything before it is good.
                notes.append(f"{path}: ignored the incomplete last line {lineno}")
                continue
            raise UserError(
                f"{path}:{lineno} is not valid JSON; metrics.jsonl holds one JSON object per line"
            ) from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise UserError(f'{path}:{lineno} has no integer "step"; every metrics.jsonl record needs one')
        split = record.get("split", "train")
        if split == "val":
            _store(val_steps, val_duplicates, step, _val_record(record))
            continue
        if split != "train":
            continue  # a split this reader does not know: not a training step
        retries = _number(record.get("alloc_retries"))
        _store(
            steps,
            duplicates,
            step,
            StepRecord(
                loss=_number(record.get("loss")),
                step_time_ms=_number(record.get("step_time_ms")),
                tflops_per_gpu=_number(record.get("tflops_per_gpu")),
                mfu=_number(record.get("mfu")),
                peak_allocated_mib=_number(record.get("peak_allocated_mib")),
                peak_reserved_mib=_number(record.get("peak_reserved_mib")),
                alloc_retries=None if retries is None or math.isnan(retries) else int(retries),
                preference=_preference(record),
            ),
        )
    run = RunLog(path=path, format="metrics-jsonl", steps=dict(sorted(steps.items())), notes=notes)
    run.duplicate_steps = sorted(duplicates)
    run.val_steps = dict(sorted(val_steps.items()))
    run.duplicate_val_steps = sorted(val_duplicates)
    run.peak_allocated_mib = _max(r.peak_allocated_mib for r in steps.values())
    run.peak_reserved_mib = _max(r.peak_reserved_mib for r in steps.values())
    retries = [r.alloc_retries for r in steps.values() if r.alloc_retries is not None]
    run.alloc_retries = max(retries) if retries else None
    run.wall_s = _read_wall_s(path.parent / "summary.json")
    return run


def _preference(record: dict) -> dict[str, float]:
    """The preference metrics a metrics.jsonl line holds (finite numbers only), under their current
    names (a line of an older run may hold ``FORMER_PREFERENCE_NAMES``)."""
    record = {FORMER_PREFERENCE_NAMES.get(k, k): v for k, v in record.items()}
    values = {name: _number(record.get(name)) for name in PREFERENCE_METRICS}
    return {name: v for name, v in values.items() if v is not None and math.isfinite(v)}


def _count(value) -> int | None:
    number = _number(value)
    return int(number) if number is not None and math.isfinite(number) else None


def _val_record(record: dict) -> ValRecord:
    return ValRecord(
        loss=_number(record.get("loss")),
        samples=_count(record.get("samples")),
        targets=_count(record.get("targets")),
    )


def _read_wall_s(summary: Path) -> float | None:
    if not summary.is_file():
        return None
    try:
        data = json.loads(summary.read_text())
    except (OSError, json.JSONDecodeError):
        raise UserError(f"{summary} is not valid JSON; remove it or fix it") from None
    wall_s = _number(data.get("wall_s")) if isinstance(data, dict) else None
    return wall_s if wall_s is not None and math.isfinite(wall_s) else None


def _fields(text: str) -> dict[str, str]:
    """``' a: 1 | b (ms): 2 |'`` -> ``{'a': '1', 'b (ms)': '2'}``."""
    out = {}
    for part in text.split("|"):
        key, sep, value = part.rpartition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _throughput(fields: dict[str, str]) -> float | None:
    """Megatron's TFLOP/s per GPU of one line (the leading number: ``496.3 (avg 496.1)`` -> 496.3)."""
    for key in _THROUGHPUT_KEYS:
        match = _LEADING_NUMBER.match(fields.get(key, ""))
        if match:
            return float(match.group(1))
    return None


def _read_text_log(path: Path, fmt: str) -> RunLog:
    loss_key = "lm loss" if fmt == "megatron-log" else "loss"
    steps: dict[int, StepRecord] = {}
    duplicates: list[int] = []
    allocated: list[float | None] = []
    reserved: list[float | None] = []
    for line in _read_text(path).splitlines():
        match = _ITERATION.search(line)
        if match:
            fields = _fields(match.group(2))
            loss = _number(fields.get(loss_key))
            if loss is None and (_number(fields.get("number of nan iterations")) or 0) > 0:
                loss = math.nan  # Megatron prints no loss for an iteration it counted as NaN
            record = StepRecord(
                loss=loss,
                step_time_ms=_number(fields.get("elapsed time per iteration (ms)")),
                tflops_per_gpu=_throughput(fields),
            )
            _store(steps, duplicates, int(match.group(1)), record)
            continue
        match = _MEMORY.search(line)
        if match:
            fields = _fields(match.group(1))
            allocated.append(_number(fields.get("max allocated")))
            reserved.append(_number(fields.get("max reserved")))
    run = RunLog(path=path, format=fmt, steps=dict(sorted(steps.items())), duplicate_steps=sorted(duplicates))
    run.peak_allocated_mib = _max(allocated)
    run.peak_reserved_mib = _max(reserved)
    return run
