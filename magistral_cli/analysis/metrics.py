"""Metrics between a baseline run and a candidate run, and the verdict.

The default verdict is the seed's backend comparison (2000 steps): ``sum |c - b| / sum |b|`` over
the steps both runs logged at most 2 %, **and** a mean step time over steps 101.. no worse than the
baseline's (a ratio of at most 1.0). The step-time half needs steps past the seed's 100 warm-up
steps, so it is applied only when the common steps go beyond step 100; shorter runs (smoke tests,
the quickstart's 10-step runs) are judged on the loss alone, with step times after step 1 reported
and not judged. Either half can be set explicitly (``skip_steps``, ``max_step_time_ratio``,
``step_time_check=False``); the report's ``criteria`` says which were applied and why.

Validation losses (``"split": "val"`` records of metrics.jsonl) are compared when both runs logged
them, with the training loss's definition and threshold on the validation steps both runs logged;
that check joins the verdict (``validation`` in the report, ``None`` when a run has no validation).

Throughput (``tflops_per_gpu``, model TFLOP/s per device, and ``mfu``) is reported beside the step
time, over the same steps: each run's mean of the values it logged (metrics.jsonl from ``magistral
train``, Megatron's ``throughput per GPU``), never judged; a run that logged none reports null.

Values that are NaN, infinite or missing are never averaged: the steps that carry them are left
out of the statistic, listed in the report and named in its ``warnings``. A non-finite candidate
loss on a compared step fails the loss check.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from magistral_cli.errors import UserError
from magistral_cli.metric_names import PREFERENCE_METRICS

from .logs import RunLog, ValRecord

DEFAULT_LOSS_THRESHOLD = 0.02
#: The seed's warm-up: its step-time statistics cover steps 101-2000.
SEED_WARMUP_STEPS = 100
#: The seed's step-time requirement: the candidate no slower than the baseline.
SEED_MAX_STEP_TIME_RATIO = 1.0
#: Warm-up left out of runs too short for the seed's window: step 1 holds compilation and allocator
#: warm-up, which would dominate a mean over a few steps.
SHORT_RUN_SKIP_STEPS = 1


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
    ``baseline_val`` / ``candidate_val`` are each run's own validation losses by step (NaN where
    not finite or not logged; empty when the run logged no validation).
    """

    report: dict
    steps: list[int]
    baseline_loss: list[float]
    candidate_loss: list[float]
    relative_error: list[float]
    baseline_step_time_ms: list[float]
    candidate_step_time_ms: list[float]
    baseline_val: dict[int, float] = field(default_factory=dict)
    candidate_val: dict[int, float] = field(default_factory=dict)

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
    skip_steps: int | None = None,
    loss_threshold: float | None = None,
    max_step_time_ratio: float | None = None,
    step_time_check: bool = True,
) -> Comparison:
    """Compare two runs on the steps both logged and decide pass / fail.

    ``None`` means the default for the runs' length (:func:`resolve_criteria`): the seed's criteria
    when the common steps go past step 100, else the loss alone. ``step_time_check=False`` reports
    step times without judging them, whatever the length.

    Raises ``UserError`` for input that cannot be compared: no common steps, no step with a loss
    in both runs, no common step after ``skip_steps``, or ``max_step_time_ratio`` without step times.
    """
    if skip_steps is not None and skip_steps < 0:
        raise UserError("--skip-steps must be 0 or more")
    if loss_threshold is not None and loss_threshold < 0:
        raise UserError("--loss-threshold must be 0 or more")
    if max_step_time_ratio is not None and max_step_time_ratio <= 0:
        raise UserError("--max-step-time-ratio must be greater than 0")
    if max_step_time_ratio is not None and not step_time_check:
        raise UserError("--max-step-time-ratio and --no-step-time-check contradict each other; pass one")

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
    criteria = resolve_criteria(
        steps[-1],
        skip_steps=skip_steps,
        loss_threshold=loss_threshold,
        max_step_time_ratio=max_step_time_ratio,
        step_time_check=step_time_check,
    )

    loss = _loss_report(steps, b_rec, c_rec, criteria["loss_threshold"], warnings, failures)
    step_time = _step_time_report(steps, b_rec, c_rec, criteria, warnings, failures)
    throughput = _throughput_report(steps, b_rec, c_rec, criteria["skip_steps"])
    validation = _validation_report(baseline, candidate, criteria["loss_threshold"], warnings, failures)
    preference = _preference_report(steps, b_rec, c_rec, warnings)

    report = {
        "baseline": baseline.describe(),
        "candidate": candidate.describe(),
        "steps_compared": len(steps),
        "criteria": criteria,
        "loss": loss,
        "step_time_ms": step_time,
        "throughput": throughput,
        "validation": validation,
        "preference": preference,
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
        baseline_val={s: _nan_if_none(r.loss) for s, r in baseline.val_steps.items()},
        candidate_val={s: _nan_if_none(r.loss) for s, r in candidate.val_steps.items()},
    )


def _preference_report(steps, b_rec, c_rec, warnings) -> dict | None:
    """Preference training's metrics side by side (reported, not judged): each metric's mean over the
    compared steps and its value at the last one, per run. None when neither run logged them; a
    warning when only one did (an SFT run compared with a DPO run)."""
    logged = {
        side: [name for name in PREFERENCE_METRICS if any(name in r.preference for r in records)]
        for side, records in (("baseline", b_rec), ("candidate", c_rec))
    }
    if not logged["baseline"] and not logged["candidate"]:
        return None
    for side, other in (("baseline", "candidate"), ("candidate", "baseline")):
        if logged[side] and not logged[other]:
            warnings.append(
                f"the {side} logs preference metrics (training.stage: dpo) and the {other} does not: "
                "the losses of the two runs measure different things"
            )
    report: dict[str, dict] = {}
    for name in PREFERENCE_METRICS:
        row = {}
        for side, records in (("baseline", b_rec), ("candidate", c_rec)):
            values = [
                (s, r.preference[name]) for s, r in zip(steps, records, strict=True) if name in r.preference
            ]
            row[side] = statistics.fmean(v for _, v in values) if values else None
            row[f"{side}_last"] = values[-1][1] if values else None
        report[name] = row
    return report


def _loss_report(steps, b_rec, c_rec, threshold, warnings, failures, *, what: str = "loss") -> dict:
    """The loss check over ``steps`` (``what``: ``loss``, or ``validation loss`` in the messages).

    For the training loss, no step with a finite loss in both runs is a ``UserError``; for the
    validation loss it is a warning and the check is not applied (``pass`` None).
    """
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
            warnings.append(f"the {name} has no {what} at step {_listed(missing[name])}: left out")
        if nonfinite[name]:
            warnings.append(
                f"the {name} {what} is NaN or infinite at step {_listed(nonfinite[name])}: left out"
            )
    if nonfinite["candidate"]:
        failures.append(f"the candidate {what} is NaN or infinite at step {_listed(nonfinite['candidate'])}")

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
        if what != "loss":
            warnings.append(f"no common step has a finite {what} in both runs: not compared")
            report["pass"] = None
            return report
        raise UserError("no compared step has a finite loss in both runs; nothing to compare")
    b_values = [b for _, b, _ in used]
    c_values = [c for _, _, c in used]
    try:
        diff = normalized_mean_abs_diff(b_values, c_values)
    except ValueError as exc:
        if what != "loss":
            warnings.append(f"{what}: {exc} on the compared steps; not compared")
            report["pass"] = None
            return report
        raise UserError(f"{exc} on the compared steps") from None
    relative = [(abs(c - b) / abs(b), s) for s, b, c in used if b != 0]
    if len(relative) < len(used):
        warnings.append(
            f"the baseline {what} is 0 at {len(used) - len(relative)} step(s): no relative error there"
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
            f"normalized mean abs {what} difference {diff:.4%} exceeds the threshold {threshold:.4%}"
        )
    return report


def _validation_report(baseline: RunLog, candidate: RunLog, threshold, warnings, failures) -> dict | None:
    """The validation-loss check on the validation steps both runs logged; None if one logged none.

    Same definition and threshold as the training loss (``_loss_report``); a failure fails the
    comparison. Runs whose validation splits differ in size are compared, with a warning.
    """
    b_val, c_val = baseline.val_steps, candidate.val_steps
    if not b_val or not c_val:
        if b_val or c_val:
            only = "baseline" if b_val else "candidate"
            warnings.append(f"only the {only} logs validation losses: validation not compared")
        return None
    for name, run in (("baseline", baseline), ("candidate", candidate)):
        if run.duplicate_val_steps:
            warnings.append(
                f"the {name} logs {len(run.duplicate_val_steps)} validation step(s) more than once: "
                f"kept the last value of step {_listed(run.duplicate_val_steps)}"
            )
    steps = sorted(b_val.keys() & c_val.keys())
    samples = {"baseline": _samples(b_val.values()), "candidate": _samples(c_val.values())}
    if not steps:
        warnings.append(
            f"no common validation steps: the baseline validates at {_span(sorted(b_val))}, "
            f"the candidate at {_span(sorted(c_val))}; validation not compared"
        )
        return {
            "steps_compared": 0,
            "steps": [],
            "samples": samples,
            "baseline_last": None,
            "candidate_last": None,
            "loss": None,
            "pass": None,
        }
    for name, values in samples.items():
        if len(values) > 1:
            warnings.append(f"the {name}'s validation sample count changes between steps: {values}")
    if samples["baseline"] and samples["candidate"] and samples["baseline"] != samples["candidate"]:
        warnings.append(
            f"the validation splits differ (baseline {_listed(samples['baseline'])} samples, candidate "
            f"{_listed(samples['candidate'])}): their losses are compared, but they measure different data"
        )
    only = {name: len(run) - len(steps) for name, run in (("baseline", b_val), ("candidate", c_val))}
    for name, count in only.items():
        if count:
            warnings.append(f"{count} validation step(s) logged by the {name} only are not compared")
    loss = _loss_report(
        steps,
        [b_val[s] for s in steps],
        [c_val[s] for s in steps],
        threshold,
        warnings,
        failures,
        what="validation loss",
    )
    return {
        "steps_compared": len(steps),
        "steps": steps,
        "samples": samples,
        "baseline_last": b_val[steps[-1]].loss,
        "candidate_last": c_val[steps[-1]].loss,
        "loss": loss,
        "pass": loss["pass"],
    }


def _samples(records) -> list[int]:
    """The distinct validation sample counts a run logged, sorted."""
    return sorted({r.samples for r in records if isinstance(r, ValRecord) and r.samples is not None})


def resolve_criteria(
    last_common_step: int,
    *,
    skip_steps: int | None = None,
    loss_threshold: float | None = None,
    max_step_time_ratio: float | None = None,
    step_time_check: bool = True,
) -> dict:
    """The criteria a comparison applies, each with where it came from, and a sentence saying so.

    ``preset`` is ``seed`` when the common steps go past the seed's warm-up (step 100): the seed's
    verdict, loss difference <= 2 % and mean step time of steps 101.. at most 1.0 x the baseline's.
    Otherwise ``short-run``: there is no step 101 to time, so the step-time half of the seed's
    verdict cannot apply; the loss decides, and step times after step 1 are reported only. An
    explicit value replaces the preset's value for that criterion and is listed in ``set_by_flag``.
    """
    long_run = last_common_step > SEED_WARMUP_STEPS
    preset = "seed" if long_run else "short-run"
    flags = []
    if loss_threshold is None:
        loss_threshold = DEFAULT_LOSS_THRESHOLD
    else:
        flags.append("--loss-threshold")
    if skip_steps is None:
        skip_steps = SEED_WARMUP_STEPS if long_run else SHORT_RUN_SKIP_STEPS
    else:
        flags.append("--skip-steps")
    if not step_time_check:
        flags.append("--no-step-time-check")
    elif max_step_time_ratio is not None:
        flags.append("--max-step-time-ratio")
    elif long_run:
        max_step_time_ratio = SEED_MAX_STEP_TIME_RATIO
    judged = max_step_time_ratio is not None
    time_part = (
        f"mean step time of steps {skip_steps + 1}.. at most {max_step_time_ratio:g} x the baseline's"
        if judged
        else f"step times of steps {skip_steps + 1}.. reported, not judged"
    )
    text = f"loss difference <= {loss_threshold:.2%} and {time_part}"
    if long_run:
        head = "the seed's criteria" + (" with " + ", ".join(flags) if flags else "")
    else:
        head = (
            f"short run (the common steps end at step {last_common_step}; the seed's step-time check "
            f"times steps {SEED_WARMUP_STEPS + 1}..)" + ("; set by " + ", ".join(flags) if flags else "")
        )
    return {
        "preset": preset,
        "loss_threshold": loss_threshold,
        "skip_steps": skip_steps,
        "max_step_time_ratio": max_step_time_ratio,
        "step_time_judged": judged,
        "set_by_flag": flags,
        "description": f"{head}: {text}",
    }


def throughput_summary(records) -> dict | None:
    """Mean ``tflops_per_gpu`` and ``mfu`` of ``records`` over the finite values (each with its step
    count); None when no record has a ``tflops_per_gpu``."""
    tflops = [r.tflops_per_gpu for r in records if _finite(r.tflops_per_gpu)]
    if not tflops:
        return None
    mfu = [r.mfu for r in records if _finite(r.mfu)]
    return {
        "tflops_per_gpu": statistics.fmean(tflops),
        "mfu": statistics.fmean(mfu) if mfu else None,
        "steps": len(tflops),
        "mfu_steps": len(mfu),
    }


def _throughput_report(steps, b_rec, c_rec, skip_steps: int) -> dict:
    """Each run's mean model TFLOP/s per device and MFU over the common steps after ``skip_steps``
    (the step time's window), and the candidate / baseline ratio of the TFLOP/s means. Reported only."""
    after = [i for i, s in enumerate(steps) if s > skip_steps]
    baseline = throughput_summary([b_rec[i] for i in after])
    candidate = throughput_summary([c_rec[i] for i in after])
    ratio = None
    if baseline and candidate and baseline["tflops_per_gpu"]:
        ratio = candidate["tflops_per_gpu"] / baseline["tflops_per_gpu"]
    return {"skip_steps": skip_steps, "baseline": baseline, "candidate": candidate, "tflops_ratio": ratio}


def _step_time_report(steps, b_rec, c_rec, criteria, warnings, failures) -> dict:
    skip_steps, max_ratio = criteria["skip_steps"], criteria["max_step_time_ratio"]
    explicit_ratio = "--max-step-time-ratio" in criteria["set_by_flag"]
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
        if explicit_ratio:
            raise UserError(
                "--max-step-time-ratio needs step times, and no compared step has one in both runs"
            )
        if max_ratio is not None:
            # The seed's default on logs without step times: say that half was not applied.
            criteria["step_time_judged"] = False
            criteria["description"] += " (not applied: no compared step has a step time in both runs)"
            warnings.append(
                "no compared step has a step time in both runs: the seed's step-time check was not applied"
            )
            report["max_ratio"] = None
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
            where = "--max-step-time-ratio" if explicit_ratio else "the seed's limit"
            failures.append(
                f"mean step time ratio {ratio:.4f} (steps {skip_steps + 1}..) exceeds {where} {max_ratio:g}"
            )
    return report
