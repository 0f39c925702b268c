"""``benchmarks/gpu_step.py`` keeps working: the device check runs it on a lent GPU, where a broken
script costs the lease. Here it runs at the tiny widths on the CPU, both sides, with the sync count,
the profiles and the device-time reports (none on the CPU: no device lane), and the engine a second
time without reshard_after_forward."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_step_benchmark_runs_both_sides_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_step.json"
    profile = tmp_path / "profile"
    args = ["--device", "cpu", "--layers", "1", "--micro-batch", "1", "--seq", "64", "--steps", "2"]
    args += ["--warmup", "1", "--profile", str(profile), "--json", str(out), "--also-no-reshard"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_step.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engine / bare speed:" in proc.stdout
    results = json.loads(out.read_text())
    engine, bare = results["engine"], results["bare"]
    assert engine["step_ms"] > 0 and bare["step_ms"] > 0
    assert results["ratio_speed"] == pytest.approx(bare["step_ms"] / engine["step_ms"])
    # The engine trained warm-up, timed and profiled steps, every loss finite.
    assert len(engine["losses"]) == 1 + 2 + 2 and all(math.isfinite(x) for x in engine["losses"])
    assert engine["tokens_per_step"] == bare["tokens_per_step"] == 64
    assert engine["planned_gib"] > 0
    assert results["inside"]["syncs_per_step"] == [1, 1, 1]
    # The engine again without reshard_after_forward (the device check's third row): the same
    # numbers (resharding changes what is held, not what is computed), timed steps only.
    again = results["engine_no_reshard"]
    assert "engine_no_reshard / bare speed:" in proc.stdout
    assert results["ratio_speed_no_reshard"] == pytest.approx(bare["step_ms"] / again["step_ms"])
    assert again["losses"] == engine["losses"][:3]
    assert again["device_time"] is None and again["planned_gib"] >= engine["planned_gib"]
    assert engine["device_time"] == bare["device_time"] == ["no device work in the trace"]
    for side in ("engine", "bare"):
        table = (profile / f"{side}_top_kernels.txt").read_text()
        assert (
            table.startswith(f"{side}, 2 steps:\nno device work in the trace")
            and "self_cpu_time_total" in table
        )


def test_the_two_reshard_options_together_are_refused_before_any_work():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_step.py"), "--device", "cpu", "--no-reshard"]
        + ["--also-no-reshard"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--also-no-reshard times the engine with and without resharding; drop --no-reshard" in proc.stderr
    assert "Traceback" not in proc.stderr and "engine:" not in proc.stdout
