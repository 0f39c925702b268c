"""`magistral compare` end to end through the Typer app: exit codes, JSON shape, table, plot."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.testing.run_logs import (
    fsdp2_trainer_line,
    megatron_line,
    memory_report_line,
    write_run_dir,
)

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(losses, times):
    return [
        {"step": s, "loss": losses[s], "grad_norm": 1.0, "lr": 1e-5, "step_time_ms": times[s], "tokens": 512,
         "tokens_per_s": 512 / times[s] * 1000, "peak_allocated_mib": 1000.0 + s, "peak_reserved_mib": 2000.0,
         "alloc_retries": 0}
        for s in losses
    ]  # fmt: skip


@pytest.fixture
def runs(tmp_path):
    """A baseline run directory (20 steps), a close candidate (16 steps) and a diverged one."""
    steps = range(1, 21)
    base_loss = {s: 3.0 - 0.05 * s for s in steps}
    base_time = {s: 5000.0 if s == 1 else 1000.0 + s for s in steps}
    close = {s: base_loss[s] * (1.005 if s % 2 else 0.995) for s in range(1, 17)}
    close_time = {s: 5000.0 if s == 1 else 1100.0 + s for s in range(1, 17)}
    far = {s: base_loss[s] * 1.05 for s in steps}
    return {
        "baseline": write_run_dir(tmp_path / "baseline", _records(base_loss, base_time), wall_s=30.0),
        "close": write_run_dir(tmp_path / "close", _records(close, close_time), wall_s=33.0),
        "far": write_run_dir(tmp_path / "far", _records(far, base_time), wall_s=30.0),
        "base_loss": base_loss,
        "base_time": base_time,
        "close_loss": close,
        "close_time": close_time,
    }


def invoke(*args):
    return runner.invoke(app, ["compare", *map(str, args)])


def test_pass_with_json_shape(runs):
    result = invoke(runs["baseline"], runs["close"], "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout holds the JSON object and nothing else
    assert list(report) == [
        "baseline", "candidate", "steps_compared", "criteria", "loss", "step_time_ms", "throughput",
        "validation", "preference", "memory_mib", "alloc_retries", "wall_s", "warnings", "failures", "pass",
    ]  # fmt: skip
    # these runs' metrics.jsonl predate tflops_per_gpu / mfu: nothing to report, no table row
    assert report["throughput"]["baseline"] is None and report["throughput"]["candidate"] is None
    assert "TFLOP/s" not in result.stderr
    assert report["validation"] is None  # neither run logged validation losses
    assert set(report["loss"]) >= {
        "normalized_mean_abs_diff", "relative_error_mean", "relative_error_max",
        "relative_error_max_step", "threshold", "pass",
    }  # fmt: skip
    assert set(report["step_time_ms"]) >= {"skip_steps", "baseline", "candidate", "mean_ratio"}
    assert set(report["step_time_ms"]["baseline"]) >= {"mean", "median", "p95"}
    assert report["steps_compared"] == 16
    assert report["baseline"]["format"] == "run-dir" and report["candidate"]["steps_logged"] == 16
    assert report["loss"]["normalized_mean_abs_diff"] == pytest.approx(
        sum(abs(runs["close_loss"][s] - runs["base_loss"][s]) for s in range(1, 17))
        / sum(runs["base_loss"][s] for s in range(1, 17))
    )
    # a short run: the seed's step-time window (steps 101..) does not exist, so the loss alone decides
    # and the first step is left out of the step-time statistics, which are reported, not judged
    criteria = report["criteria"]
    assert criteria["preset"] == "short-run" and criteria["step_time_judged"] is False
    assert criteria["skip_steps"] == 1 and criteria["max_step_time_ratio"] is None
    assert criteria["loss_threshold"] == 0.02 and criteria["set_by_flag"] == []
    assert report["step_time_ms"]["skip_steps"] == 1 and report["step_time_ms"]["pass"] is None
    assert "criteria: short run (the common steps end at step 16" in result.stderr
    assert report["step_time_ms"]["baseline"]["mean"] == pytest.approx(
        np.mean([1000.0 + s for s in range(2, 17)])
    )
    assert report["memory_mib"]["baseline"] == {"peak_allocated": 1020.0, "peak_reserved": 2000.0}
    assert report["wall_s"] == {"baseline": 30.0, "candidate": 33.0, "ratio": pytest.approx(1.1)}
    assert report["pass"] is True
    assert "4 step(s) logged by the baseline only" in result.stderr
    assert "PASS" in result.stderr and "loss: norm. mean |diff|" in result.stderr  # the table


def test_loss_beyond_threshold_exits_1_and_still_prints_json(runs):
    result = invoke(runs["baseline"], runs["far"], "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["pass"] is False and report["loss"]["pass"] is False
    assert report["loss"]["normalized_mean_abs_diff"] == pytest.approx(0.05)
    assert "FAIL" in result.stderr
    # a looser threshold passes the same pair
    assert invoke(runs["baseline"], runs["far"], "--loss-threshold", "0.051").exit_code == 0


def test_step_time_ratio_flag(runs):
    # candidate step times are ~10 % above the baseline's
    slow = invoke(runs["baseline"], runs["close"], "--max-step-time-ratio", "1.05", "--json")
    assert slow.exit_code == 1
    report = json.loads(slow.stdout)
    assert report["loss"]["pass"] is True and report["step_time_ms"]["pass"] is False
    assert "exceeds --max-step-time-ratio 1.05" in slow.stderr
    assert invoke(runs["baseline"], runs["close"], "--max-step-time-ratio", "1.2").exit_code == 0


@pytest.fixture
def long_runs(tmp_path):
    """The seed's setting: 2000 steps, a candidate 0.5 % slower after a slower warm-up of its own."""
    steps = range(1, 2001)
    loss = {s: 3.0 - 0.001 * s for s in steps}
    base_time = {s: 900.0 if s <= 100 else 1000.0 for s in steps}
    slow_time = {s: 800.0 if s <= 100 else 1005.0 for s in steps}  # faster overall only thanks to warm-up
    fast_time = {s: 5000.0 if s <= 100 else 995.0 for s in steps}  # slower overall only in the warm-up
    return {
        "baseline": write_run_dir(tmp_path / "baseline", _records(loss, base_time)),
        "slow": write_run_dir(tmp_path / "slow", _records(loss, slow_time)),
        "fast": write_run_dir(tmp_path / "fast", _records(loss, fast_time)),
    }


def test_long_runs_get_the_seeds_criteria_by_default(long_runs):
    slow = invoke(long_runs["baseline"], long_runs["slow"], "--json")
    assert slow.exit_code == 1, slow.output
    report = json.loads(slow.stdout)
    criteria = report["criteria"]
    assert criteria["preset"] == "seed" and criteria["step_time_judged"] is True
    assert criteria["skip_steps"] == 100 and criteria["max_step_time_ratio"] == 1.0
    assert report["loss"]["pass"] is True and report["step_time_ms"]["pass"] is False
    assert report["step_time_ms"]["baseline"]["steps"] == 1900  # steps 101-2000
    assert report["step_time_ms"]["mean_ratio"] == pytest.approx(1.005)
    assert "exceeds the seed's limit 1" in slow.stderr
    assert "criteria: the seed's criteria: loss difference <= 2.00% and mean step time of steps 101.." in (
        slow.stderr.replace("\n", " ")
    )
    # the warm-up does not count: slower steps 1-100 with faster steps 101-2000 pass
    fast = invoke(long_runs["baseline"], long_runs["fast"], "--json")
    assert fast.exit_code == 0, fast.output
    assert json.loads(fast.stdout)["step_time_ms"]["mean_ratio"] == pytest.approx(0.995)


def test_flags_replace_the_seed_defaults_and_are_named(long_runs):
    off = invoke(long_runs["baseline"], long_runs["slow"], "--no-step-time-check", "--json")
    assert off.exit_code == 0, off.output
    criteria = json.loads(off.stdout)["criteria"]
    assert criteria["step_time_judged"] is False and criteria["set_by_flag"] == ["--no-step-time-check"]
    assert "with --no-step-time-check" in off.stderr and "reported, not judged" in off.stderr
    loose = json.loads(
        invoke(long_runs["baseline"], long_runs["slow"], "--max-step-time-ratio", "1.01", "--json").stdout
    )
    assert loose["pass"] is True and loose["criteria"]["max_step_time_ratio"] == 1.01
    # --skip-steps 0 puts the candidate's fast warm-up back in: it now passes on the mean
    whole = json.loads(invoke(long_runs["baseline"], long_runs["slow"], "--skip-steps", "0", "--json").stdout)
    assert whole["criteria"]["skip_steps"] == 0 and whole["criteria"]["max_step_time_ratio"] == 1.0
    assert whole["pass"] is True
    both = invoke(
        long_runs["baseline"], long_runs["slow"], "--no-step-time-check", "--max-step-time-ratio", "1"
    )
    assert both.exit_code == 2 and "contradict" in both.stderr


def test_skip_steps_changes_the_statistics(runs):
    result = invoke(runs["baseline"], runs["close"], "--skip-steps", "0", "--json")
    times = json.loads(result.stdout)["step_time_ms"]
    expected = [runs["base_time"][s] for s in range(1, 17)]
    assert times["baseline"]["mean"] == pytest.approx(np.mean(expected))
    assert times["baseline"]["p95"] == pytest.approx(np.percentile(expected, 95))
    assert times["candidate"]["median"] == pytest.approx(
        np.median([runs["close_time"][s] for s in range(1, 17)])
    )


def test_megatron_log_against_a_run_directory(runs, tmp_path):
    log = tmp_path / "megatron.log"
    lines = [megatron_line(s, 20, runs["base_loss"][s], runs["base_time"][s]) for s in range(1, 21)]
    lines.insert(3, memory_report_line(0, 3, 5000.0, 6000.0))
    lines.insert(4, memory_report_line(1, 3, 5100.0, 5900.0))
    log.write_text("\n".join(lines) + "\n")
    result = invoke(log, runs["close"], "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["baseline"]["format"] == "megatron-log"
    assert report["steps_compared"] == 16
    assert report["memory_mib"]["baseline"] == {"peak_allocated": 5100.0, "peak_reserved": 6000.0}
    # Megatron's throughput per GPU beside the step time; the candidate logged none
    assert report["throughput"]["baseline"]["tflops_per_gpu"] == pytest.approx(123.4)
    assert report["throughput"]["candidate"] is None
    assert "TFLOP/s per device (mean)" in result.stderr and "123.4" in result.stderr


def test_fsdp2_trainer_log_with_nan_fails(runs, tmp_path):
    log = tmp_path / "fsdp2.log"
    losses = dict(runs["base_loss"])
    losses[12] = math.nan
    log.write_text("\n".join(fsdp2_trainer_line(s, 20, losses[s], 1000.0) for s in range(1, 21)) + "\n")
    result = invoke(runs["baseline"], log, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["candidate"]["format"] == "mindspeed-fsdp2-log"
    assert report["loss"]["nonfinite_steps"]["candidate"] == [12]
    assert report["loss"]["normalized_mean_abs_diff"] == 0.0  # the other 19 steps agree exactly
    assert "NaN or infinite at step 12" in result.stderr


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda r, t: [t / "missing", r["baseline"]], "does not exist"),
        (lambda r, t: [r["baseline"], t / "junk.txt"], "no known format"),
        (lambda r, t: [r["baseline"], r["close"], "--skip-steps", "16"], "nothing left after skipping 16"),
        (lambda r, t: [r["baseline"], t / "late"], "no common steps"),
        (lambda r, t: [r["baseline"], r["close"], "--plot", t / "plot.jpg"], "ending in .png"),
        (lambda r, t: [r["baseline"], r["close"], "--plot", t / "no" / "dir" / "p.png"], "does not exist"),
        (
            lambda r, t: (t / "d.png").mkdir() or [r["baseline"], r["close"], "--plot", t / "d.png"],
            "is a directory",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(runs, tmp_path, make_args, message):
    (tmp_path / "junk.txt").write_text("nothing to see here\n")
    write_run_dir(tmp_path / "late", [{"step": s, "loss": 1.0, "step_time_ms": 1.0} for s in (30, 31)])
    result = invoke(*make_args(runs, tmp_path))
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert result.stdout == ""


def test_unknown_format_message_lists_the_formats(runs, tmp_path):
    (tmp_path / "junk.txt").write_text("nothing to see here\n")
    result = invoke(runs["baseline"], tmp_path / "junk.txt")
    for name in ("run-dir", "metrics-jsonl", "mindspeed-fsdp2-log", "megatron-log"):
        assert name in result.stderr


def test_negative_skip_steps_is_a_usage_error(runs):
    assert invoke(runs["baseline"], runs["close"], "--skip-steps", "-1").exit_code == 2


def test_plot_writes_a_png(runs, tmp_path):
    path = tmp_path / "compare.png"
    result = invoke(runs["baseline"], runs["far"], "--plot", path)
    assert result.exit_code == 1  # the verdict is still the exit code
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_plot_without_matplotlib_says_how_to_install_it(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    result = invoke(runs["baseline"], runs["close"], "--plot", tmp_path / "p.png")
    assert result.exit_code == 2
    assert "pip install 'magistral-cli[plot]'" in result.stderr
    assert not (tmp_path / "p.png").exists()


def test_real_process_keeps_json_on_stdout_and_the_table_on_stderr(runs):
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "magistral_cli", "compare", str(runs["baseline"]), str(runs["far"]), "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert json.loads(out.stdout)["pass"] is False
    assert "FAIL" in out.stderr and "{" not in out.stderr
