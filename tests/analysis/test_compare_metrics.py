"""The compare metrics, checked against values computed here with numpy from the raw inputs."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from magistral_cli.analysis.logs import RunLog, StepRecord, read_run
from magistral_cli.analysis.metrics import compare_runs, normalized_mean_abs_diff, percentile
from magistral_cli.errors import UserError
from magistral_cli.testing.run_logs import fsdp2_trainer_line, megatron_line, write_run_dir


def make_run(
    losses: dict[int, float | None], times: dict[int, float | None] | None = None, **extra
) -> RunLog:
    times = times or {}
    steps = {s: StepRecord(loss=loss, step_time_ms=times.get(s, 100.0)) for s, loss in losses.items()}
    return RunLog(path="mem", format="metrics-jsonl", steps=steps, **extra)


def test_normalized_mean_abs_diff_against_numpy():
    rng = np.random.default_rng(0)
    b = rng.uniform(0.5, 3.0, 200)
    c = b * (1 + rng.normal(0, 0.01, 200))
    expected = np.abs(c - b).sum() / np.abs(b).sum()
    assert normalized_mean_abs_diff(b.tolist(), c.tolist()) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError):
        normalized_mean_abs_diff([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        normalized_mean_abs_diff([0.0, 0.0], [1.0, 1.0])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 20, 101, 1900])
def test_percentile_matches_numpy_linear(n):
    values = np.random.default_rng(n).uniform(1000, 3000, n).tolist()
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_full_comparison_of_logs_of_different_lengths(tmp_path):
    """A Megatron log of 50 steps against a run directory with steps 3..40: 38 common steps."""
    rng = random.Random(1)
    b_loss = {s: round(3.0 * math.exp(-s / 30) + 0.5, 4) for s in range(1, 51)}
    b_time = {s: round(rng.uniform(1900, 2100), 1) for s in range(1, 51)}
    c_loss = {s: b_loss[s] * (1 + rng.uniform(-0.02, 0.02)) for s in range(3, 41)}
    c_time = {s: rng.uniform(1800, 2000) for s in range(3, 41)}
    log = tmp_path / "megatron.log"
    log.write_text("\n".join(megatron_line(s, 50, b_loss[s], b_time[s]) for s in b_loss) + "\n")
    records = [{"step": s, "loss": c_loss[s], "step_time_ms": c_time[s], "peak_allocated_mib": 10.0 * s,
                "peak_reserved_mib": 20.0 * s, "alloc_retries": s // 10} for s in c_loss]  # fmt: skip
    run_dir = write_run_dir(tmp_path / "run", records, wall_s=99.0)

    result = compare_runs(read_run(log), read_run(run_dir), skip_steps=10, loss_threshold=0.02)
    r = result.report

    common = list(range(3, 41))
    b = np.array([b_loss[s] for s in common])
    c = np.array([c_loss[s] for s in common])
    rel = np.abs(c - b) / np.abs(b)
    assert r["steps_compared"] == 38 and result.steps == common
    assert r["loss"]["steps_used"] == 38
    assert r["loss"]["normalized_mean_abs_diff"] == pytest.approx(np.abs(c - b).sum() / np.abs(b).sum())
    assert r["loss"]["relative_error_mean"] == pytest.approx(rel.mean())
    assert r["loss"]["relative_error_max"] == pytest.approx(rel.max())
    assert r["loss"]["relative_error_max_step"] == common[int(rel.argmax())]

    timed = [s for s in common if s > 10]
    bt = np.array([b_time[s] for s in timed])
    ct = np.array([c_time[s] for s in timed])
    for name, values in (("baseline", bt), ("candidate", ct)):
        stats = r["step_time_ms"][name]
        assert stats["steps"] == len(timed) == 30
        assert stats["mean"] == pytest.approx(values.mean())
        assert stats["median"] == pytest.approx(np.median(values))
        assert stats["p95"] == pytest.approx(np.percentile(values, 95))
    assert r["step_time_ms"]["mean_ratio"] == pytest.approx(ct.mean() / bt.mean())
    assert r["step_time_ms"]["pass"] is None  # not asked for
    # Megatron's "throughput per GPU" beside the step time; the candidate logged none (an older run).
    assert r["throughput"] == {
        "skip_steps": 10,
        "baseline": {"tflops_per_gpu": pytest.approx(123.4), "mfu": None, "steps": 30, "mfu_steps": 0},
        "candidate": None,
        "tflops_ratio": None,
    }

    assert r["memory_mib"]["candidate"] == {"peak_allocated": 400.0, "peak_reserved": 800.0}
    assert r["memory_mib"]["baseline"] == {"peak_allocated": None, "peak_reserved": None}
    assert r["alloc_retries"] == {"baseline": None, "candidate": 4}
    assert r["wall_s"] == {"baseline": None, "candidate": 99.0, "ratio": None}
    assert any("12 step(s) logged by the baseline only" in w for w in r["warnings"])
    assert r["pass"] == (r["loss"]["normalized_mean_abs_diff"] <= 0.02)
    json.dumps(r, allow_nan=False)  # strict JSON: no NaN leaks into the report


@pytest.mark.parametrize(("offset", "passes"), [(0.0199, True), (0.0201, False)])
def test_loss_threshold_boundary(offset, passes):
    # candidate = baseline * (1 + offset) at every step: the normalized difference is exactly `offset`
    b = {s: 2.0 + 0.01 * s for s in range(1, 21)}
    c = {s: v * (1 + offset) for s, v in b.items()}
    result = compare_runs(make_run(b), make_run(c), loss_threshold=0.02)
    assert result.report["loss"]["normalized_mean_abs_diff"] == pytest.approx(offset)
    assert result.report["loss"]["pass"] is passes
    assert result.passed is passes
    assert bool(result.report["failures"]) is not passes


@pytest.mark.parametrize(("ratio", "passes"), [(0.999, True), (1.0, True), (1.001, False)])
def test_step_time_ratio_boundary(ratio, passes):
    losses = {s: 1.0 for s in range(1, 11)}
    b_time = {s: 1000.0 for s in range(1, 11)}
    c_time = {s: 1000.0 * ratio for s in range(1, 11)}
    c_time[1] = 99999.0  # warm-up step, skipped
    result = compare_runs(
        make_run(losses, b_time), make_run(losses, c_time), skip_steps=1, max_step_time_ratio=1.0
    )
    assert result.report["step_time_ms"]["mean_ratio"] == pytest.approx(ratio)
    assert result.report["step_time_ms"]["pass"] is passes
    assert result.passed is passes


def test_nan_in_the_candidate_fails_and_is_never_averaged():
    b = {s: 2.0 for s in range(1, 11)}
    c = {s: 2.02 for s in range(1, 11)}
    c[7] = math.nan
    result = compare_runs(make_run(b), make_run(c))
    loss = result.report["loss"]
    assert loss["nonfinite_steps"] == {"baseline": [], "candidate": [7]}
    assert loss["steps_used"] == 9
    assert loss["normalized_mean_abs_diff"] == pytest.approx(0.01)  # the 9 finite steps only
    assert loss["pass"] is False and result.passed is False
    assert any("NaN or infinite at step 7" in f for f in result.report["failures"])
    json.dumps(result.report, allow_nan=False)


def test_nan_or_missing_in_the_baseline_is_left_out_and_reported():
    b = {s: 2.0 for s in range(1, 11)}
    b[3] = math.inf
    b[4] = None
    c = {s: 2.0 + 0.002 * s for s in range(1, 11)}
    result = compare_runs(make_run(b), make_run(c))
    loss = result.report["loss"]
    used = [s for s in range(1, 11) if s not in (3, 4)]
    expected = sum(abs(c[s] - 2.0) for s in used) / (2.0 * len(used))
    assert loss["normalized_mean_abs_diff"] == pytest.approx(expected)
    assert loss["nonfinite_steps"]["baseline"] == [3]
    assert loss["missing_steps"]["baseline"] == [4]
    assert loss["relative_error_max_step"] == 10
    assert result.passed
    warnings = " ".join(result.report["warnings"])
    assert "NaN or infinite at step 3" in warnings and "no loss at step 4" in warnings
    assert math.isnan(result.relative_error[2]) and math.isnan(result.baseline_loss[3])


def test_missing_step_times_are_left_out_and_reported():
    losses = {s: 1.0 for s in range(1, 7)}
    b_time = {s: 100.0 * s for s in range(1, 7)}
    c_time = {**b_time, 4: None}
    result = compare_runs(make_run(losses, b_time), make_run(losses, c_time), skip_steps=1)
    times = result.report["step_time_ms"]
    assert times["baseline"]["steps"] == 4
    assert times["baseline"]["mean"] == pytest.approx(np.mean([200, 300, 500, 600]))
    assert any("step time missing or not finite at step 4" in w for w in result.report["warnings"])


def test_restarted_candidate_is_compared_on_its_last_values(tmp_path):
    base = tmp_path / "base.log"
    base.write_text("\n".join(fsdp2_trainer_line(s, 6, 2.0, 500.0) for s in range(1, 7)) + "\n")
    cand = tmp_path / "cand.log"
    lines = [fsdp2_trainer_line(s, 6, 9.0, 500.0) for s in range(1, 5)]  # diverged, then resumed from 2
    lines += [fsdp2_trainer_line(s, 6, 2.0, 500.0) for s in range(3, 7)]
    lines[:2] = [fsdp2_trainer_line(s, 6, 2.0, 500.0) for s in (1, 2)]
    cand.write_text("\n".join(lines) + "\n")
    result = compare_runs(read_run(base), read_run(cand))
    assert result.report["candidate"]["duplicate_steps"] == [3, 4]
    assert result.report["loss"]["normalized_mean_abs_diff"] == 0.0
    assert any("more than once" in w and "step 3, 4" in w for w in result.report["warnings"])


def test_inputs_that_cannot_be_compared():
    with pytest.raises(
        UserError, match=r"no common steps: the baseline logs steps 1..5, the candidate steps 6..9"
    ):
        compare_runs(make_run({s: 1.0 for s in range(1, 6)}), make_run({s: 1.0 for s in range(6, 10)}))
    run = make_run({s: 1.0 for s in range(1, 6)})
    with pytest.raises(UserError, match=r"nothing left after skipping 5 warm-up step\(s\).*steps 1..5"):
        compare_runs(run, run, skip_steps=5)
    untimed = make_run({s: 1.0 for s in range(1, 6)}, {s: None for s in range(1, 6)})
    with pytest.raises(UserError, match="--max-step-time-ratio needs step times"):
        compare_runs(untimed, untimed, max_step_time_ratio=1.0)
    assert compare_runs(untimed, untimed).report["step_time_ms"]["baseline"] is None  # fine without the ratio
    with pytest.raises(UserError, match="sum to zero"):
        compare_runs(make_run({1: 0.0, 2: 0.0}), make_run({1: 0.1, 2: 0.1}))
    with pytest.raises(UserError, match="no compared step has a finite loss"):
        compare_runs(make_run({1: None, 2: 1.0}), make_run({1: 1.0, 2: None}))
    with pytest.raises(UserError, match="--max-step-time-ratio must be greater than 0"):
        compare_runs(run, run, max_step_time_ratio=0.0)


def test_all_nan_candidate_is_a_failure_not_bad_input():
    result = compare_runs(make_run({1: 1.0, 2: 1.0}), make_run({1: math.nan, 2: math.nan}))
    assert result.passed is False
    assert result.report["loss"]["normalized_mean_abs_diff"] is None
    json.dumps(result.report, allow_nan=False)


def test_zero_baseline_loss_has_no_relative_error_but_counts_in_the_normalized_sum():
    b = {1: 0.0, 2: 2.0, 3: 4.0}
    c = {1: 0.1, 2: 2.2, 3: 4.0}
    result = compare_runs(make_run(b), make_run(c), loss_threshold=0.1)
    loss = result.report["loss"]
    assert loss["normalized_mean_abs_diff"] == pytest.approx((0.1 + 0.2) / 6.0)
    assert loss["relative_error_mean"] == pytest.approx((0.1 + 0.0) / 2)
    assert loss["relative_error_max_step"] == 2
    assert any("baseline loss is 0 at 1 step" in w for w in result.report["warnings"])


@pytest.mark.parametrize(("last", "preset"), [(100, "short-run"), (101, "seed")])
def test_the_seeds_criteria_start_past_its_warm_up(last, preset):
    """Step times 10 % slower from step 2 on: judged (and failed) only once a step past 100 exists."""
    losses = {s: 1.0 for s in range(1, last + 1)}
    b_time = {s: 1000.0 for s in losses}
    c_time = {s: 1100.0 for s in losses}
    result = compare_runs(make_run(losses, b_time), make_run(losses, c_time))
    criteria = result.report["criteria"]
    assert criteria["preset"] == preset
    if preset == "seed":
        assert (criteria["skip_steps"], criteria["max_step_time_ratio"]) == (100, 1.0)
        assert result.report["step_time_ms"]["baseline"]["steps"] == 1  # step 101 only
        assert result.passed is False
        assert any("exceeds the seed's limit 1" in f for f in result.report["failures"])
    else:
        assert (criteria["skip_steps"], criteria["max_step_time_ratio"]) == (1, None)
        assert result.report["step_time_ms"]["mean_ratio"] == pytest.approx(1.1)
        assert result.passed is True
        assert "step times of steps 2.. reported, not judged" in criteria["description"]


def test_the_seeds_step_time_check_on_logs_without_step_times_is_reported_not_applied():
    losses = {s: 1.0 for s in range(1, 201)}
    untimed = make_run(losses, {s: None for s in losses})
    result = compare_runs(untimed, untimed)
    assert result.passed is True
    assert result.report["criteria"]["step_time_judged"] is False
    assert "not applied" in result.report["criteria"]["description"]
    assert any("seed's step-time check was not applied" in w for w in result.report["warnings"])
    with pytest.raises(UserError, match="--max-step-time-ratio needs step times"):
        compare_runs(untimed, untimed, max_step_time_ratio=1.0)  # asked for explicitly: bad input


def test_throughput_means_over_the_step_time_window(tmp_path):
    """Mean TFLOP/s per device and MFU after --skip-steps, null and NaN left out, never judged."""
    rng = np.random.default_rng(3)
    tflops = {s: float(rng.uniform(300, 400)) for s in range(1, 13)}
    b_records = [{"step": s, "loss": 2.0, "step_time_ms": 100.0, "tflops_per_gpu": tflops[s],
                  "mfu": tflops[s] / 989} for s in range(1, 13)]  # fmt: skip
    b_records[4]["tflops_per_gpu"] = None  # step 5: not logged (its mfu still counts for the mfu mean)
    b_records[5]["mfu"] = None  # step 6: no peak known
    c_records = [{"step": s, "loss": 2.0, "step_time_ms": 90.0, "tflops_per_gpu": 1.1 * tflops[s],
                  "mfu": float("nan") if s == 7 else 1.1 * tflops[s] / 989} for s in range(1, 13)]  # fmt: skip
    baseline = read_run(write_run_dir(tmp_path / "b", b_records))
    candidate = read_run(write_run_dir(tmp_path / "c", c_records))
    r = compare_runs(baseline, candidate, skip_steps=2).report["throughput"]
    window = range(3, 13)
    b_tflops = [tflops[s] for s in window if s != 5]
    b_mfu = [tflops[s] / 989 for s in window if s != 6]
    c_tflops = [1.1 * tflops[s] for s in window]
    c_mfu = [1.1 * tflops[s] / 989 for s in window if s != 7]
    assert r["skip_steps"] == 2
    assert r["baseline"] == {"tflops_per_gpu": pytest.approx(np.mean(b_tflops)), "mfu": pytest.approx(np.mean(b_mfu)),
                             "steps": 9, "mfu_steps": 9}  # fmt: skip
    assert r["candidate"] == {"tflops_per_gpu": pytest.approx(np.mean(c_tflops)), "mfu": pytest.approx(np.mean(c_mfu)),
                              "steps": 10, "mfu_steps": 9}  # fmt: skip
    assert r["tflops_ratio"] == pytest.approx(np.mean(c_tflops) / np.mean(b_tflops))


def test_runs_without_throughput_still_compare():
    b = {s: 2.0 + 0.01 * s for s in range(1, 6)}
    report = compare_runs(make_run(b), make_run(b)).report
    assert report["pass"] is True
    assert report["throughput"] == {
        "skip_steps": 1,
        "baseline": None,
        "candidate": None,
        "tflops_ratio": None,
    }
