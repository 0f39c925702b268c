"""Metrics between a baseline run and a candidate run, and the verdict.

The loss criterion is the seed's backend comparison: ``sum |c - b| / sum |b|`` over the steps both
runs logged, at most 2 % by default. Step time is compared after a warm-up (the seed skipped the
first 100 of 2000 steps); the candidate passes when its mean is at most ``max_step_time_ratio``
times the baseline's (the seed's requirement "no slower" is a ratio of 1.0).

Values that are NaN, infinite or missing are never averaged: the steps that carry them are left
out of the statistic, listed in the report and named in its ``warnings``. A non-finite candidate
loss on a compared step fails the loss check.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from magistral_cli.errors import UserError

from .logs import RunLog

DEFAULT_LOSS_THRESHOLD = 0.02
DEFAULT_SKIP_STEPS = 1


def normalized_mean_abs_diff(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """``sum |candidate - baseline| / sum |baseline|`` over paired values (the seed's criterion)."""
    if len(baseline) != len(candidate):
        raise ValueError("baseline and candidate must pair up step by step")
    denominator = sum(abs(b) for b in baseline)
    if denominator == 0:
        raise ValueError("the baseline losses sum to zero; the normalized difference is undefined")
    return sum(abs(c - b) for b, c in zip(baseline, candidate, strict=True)) / denominator


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def step_time_summary(values: Sequence[float]) -> dict:
    """Mean, median and p95 of step times (ms), and how many steps they cover."""
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p95": percentile(values, 95),
        "steps": len(values),
    }


@dataclass
class Comparison:
    """The result of ``compare_runs``: the JSON report and the per-step series behind it.

    Series are aligned with ``steps`` (the common steps) and hold NaN where a value is missing.
    """

    report: dict
    steps: list[int]
    baseline_loss: list[float]
    candidate_loss: list[float]
    relative_error: list[float]
    baseline_step_time_ms: list[float]
    candidate_step_time_ms: list[float]

    @property
    def passed(self) -> bool:
        return bool(self.report["pass"])


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _span(steps: Sequence[int]) -> str:
    return f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"


def _listed(steps: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def compare_runs(
    baseline: RunLog,
    candidate: RunLog,
    *,
    skip_steps: int = DEFAULT_SKIP_STEPS,
    loss_threshold: float = DEFAULT_LOSS_THRESHOLD,
    max_step_time_ratio: float | None = None,
) -> Comparison:
    """Compare two runs on the steps both logged and decide pass / fail.

    Raises ``UserError`` for input that cannot be compared: no common steps, no step with a loss
    in both runs, no common step after ``skip_steps``, or ``max_step_time_ratio`` without step times.
    """
    if skip_steps < 0:
        raise UserError("--skip-steps must be 0 or more")
    if loss_threshold < 0:
        raise UserError("--loss-threshold must be 0 or more")
    if max_step_time_ratio is not None and max_step_time_ratio <= 0:
        raise UserError("--max-step-time-ratio must be greater than 0")

    steps = sorted(baseline.steps.keys() & candidate.steps.keys())
    if not steps:
        raise UserError(
            f"no common steps: the baseline logs {_span(sorted(baseline.steps))}, "
            f"the candidate {_span(sorted(candidate.steps))}"
        )
    warnings: list[str] = list(baseline.notes) + list(candidate.notes)
    for name, run in (("baseline", baseline), ("candidate", candidate)):
        only = len(run.steps) - len(steps)
        if only:
            warnings.append(f"{only} step(s) logged by the {name} only are not compared")
        if run.duplicate_steps:
            warnings.append(
                f"the {name} logs {len(run.duplicate_steps)} step(s) more than once (a resumed run?): "
                f"kept the last value of step {_listed(run.duplicate_steps)}"
            )
    b_rec = [baseline.steps[s] for s in steps]
    c_rec = [candidate.steps[s] for s in steps]
    failures: list[str] = []

    loss = _loss_report(steps, b_rec, c_rec, loss_threshold, warnings, failures)
    step_time = _step_time_report(steps, b_rec, c_rec, skip_steps, max_step_time_ratio, warnings, failures)

    report = {
        "baseline": baseline.describe(),
        "candidate": candidate.describe(),
        "steps_compared": len(steps),
        "loss": loss,
        "step_time_ms": step_time,
        "memory_mib": {
            "baseline": {
                "peak_allocated": baseline.peak_allocated_mib,
                "peak_reserved": baseline.peak_reserved_mib,
            },
            "candidate": {
                "peak_allocated": candidate.peak_allocated_mib,
                "peak_reserved": candidate.peak_reserved_mib,
            },
        },
        "alloc_retries": {"baseline": baseline.alloc_retries, "candidate": candidate.alloc_retries},
        "wall_s": {
            "baseline": baseline.wall_s,
            "candidate": candidate.wall_s,
            "ratio": candidate.wall_s / baseline.wall_s if baseline.wall_s and candidate.wall_s else None,
        },
        "warnings": warnings,
        "failures": failures,
        "pass": not failures,
    }
    b_loss = [_nan_if_none(r.loss) for r in b_rec]
    c_loss = [_nan_if_none(r.loss) for r in c_rec]
    relative = [
        abs(c - b) / abs(b) if math.isfinite(b) and math.isfinite(c) and b != 0 else math.nan
        for b, c in zip(b_loss, c_loss, strict=True)
    ]
    return Comparison(
        report=report,
        steps=steps,
        baseline_loss=b_loss,
        candidate_loss=c_loss,
        relative_error=relative,
        baseline_step_time_ms=[_nan_if_none(r.step_time_ms) for r in b_rec],
        candidate_step_time_ms=[_nan_if_none(r.step_time_ms) for r in c_rec],
    )


def _loss_report(steps, b_rec, c_rec, threshold, warnings, failures) -> dict:
    missing = {"baseline": [], "candidate": []}
    nonfinite = {"baseline": [], "candidate": []}
    for step, b, c in zip(steps, b_rec, c_rec, strict=True):
        for name, record in (("baseline", b), ("candidate", c)):
            if record.loss is None:
                missing[name].append(step)
            elif not math.isfinite(record.loss):
                nonfinite[name].append(step)
    for name in ("baseline", "candidate"):
        if missing[name]:
            warnings.append(f"the {name} has no loss at step {_listed(missing[name])}: left out")
        if nonfinite[name]:
            warnings.append(
                f"the {name} loss is NaN or infinite at step {_listed(nonfinite[name])}: left out"
            )
    if nonfinite["candidate"]:
        failures.append(f"the candidate loss is NaN or infinite at step {_listed(nonfinite['candidate'])}")

    used = [
        (s, b.loss, c.loss)
        for s, b, c in zip(steps, b_rec, c_rec, strict=True)
        if _finite(b.loss) and _finite(c.loss)
    ]
    report = {
        "normalized_mean_abs_diff": None,
        "relative_error_mean": None,
        "relative_error_max": None,
        "relative_error_max_step": None,
        "threshold": threshold,
        "pass": False,
        "steps_used": len(used),
        "missing_steps": missing,
        "nonfinite_steps": nonfinite,
    }
    if not used:
        if nonfinite["candidate"]:
            return report  # a failure, already recorded
        raise UserError("no compared step has a finite loss in both runs; nothing to compare")
    b_values = [b for _, b, _ in used]
    c_values = [c for _, _, c in used]
    try:
        diff = normalized_mean_abs_diff(b_values, c_values)
    except ValueError as exc:
        raise UserError(f"{exc} on the compared steps") from None
    relative = [(abs(c - b) / abs(b), s) for s, b, c in used if b != 0]
    if len(relative) < len(used):
        warnings.append(
            f"the baseline loss is 0 at {len(used) - len(relative)} step(s): no relative error there"
        )
    if relative:
        worst, worst_step = max(relative, key=lambda pair: pair[0])  # first step on ties
        report["relative_error_mean"] = statistics.fmean(e for e, _ in relative)
        report["relative_error_max"] = worst
        report["relative_error_max_step"] = worst_step
    report["normalized_mean_abs_diff"] = diff
    report["pass"] = diff <= threshold and not nonfinite["candidate"]
    if diff > threshold:
        failures.append(
            f"normalized mean abs loss difference {diff:.4%} exceeds the threshold {threshold:.4%}"
        )
    return report


def _step_time_report(steps, b_rec, c_rec, skip_steps, max_ratio, warnings, failures) -> dict:
    after = [i for i, s in enumerate(steps) if s > skip_steps]
    if not after:
        raise UserError(
            f"nothing left after skipping {skip_steps} warm-up step(s): the common steps are "
            f"{_span(steps)}; lower --skip-steps"
        )
    timed = [i for i in after if _finite(b_rec[i].step_time_ms) and _finite(c_rec[i].step_time_ms)]
    report = {
        "skip_steps": skip_steps,
        "baseline": None,
        "candidate": None,
        "mean_ratio": None,
        "max_ratio": max_ratio,
        "pass": None,
    }
    if len(timed) < len(after):
        timed_set = set(timed)
        untimed = [steps[i] for i in after if i not in timed_set]
        warnings.append(f"step time missing or not finite at step {_listed(untimed)}: left out")
    if not timed:
        if max_ratio is not None:
            raise UserError(
                "--max-step-time-ratio needs step times, and no compared step has one in both runs"
            )
        return report
    report["baseline"] = step_time_summary([b_rec[i].step_time_ms for i in timed])
    report["candidate"] = step_time_summary([c_rec[i].step_time_ms for i in timed])
    ratio = report["candidate"]["mean"] / report["baseline"]["mean"] if report["baseline"]["mean"] else None
    report["mean_ratio"] = ratio
    if max_ratio is not None:
        report["pass"] = ratio is not None and ratio <= max_ratio
        if ratio is None:
            failures.append("the baseline's mean step time is 0 ms; the step time ratio is undefined")
        elif not report["pass"]:
            failures.append(f"mean step time ratio {ratio:.4f} exceeds --max-step-time-ratio {max_ratio}")
    return report
