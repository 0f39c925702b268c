"""`magistral compare` on runs that logged validation losses: the table rows, JSON, verdict, plot."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.testing.run_logs import write_run_dir

runner = CliRunner()


def _run(path, val: dict[int, float], *, train_scale: float = 1.0, samples: int = 6):
    records = []
    for step in range(1, 11):
        records.append(
            {"step": step, "loss": (3.0 - 0.1 * step) * train_scale, "grad_norm": 1.0, "lr": 1e-5,
             "step_time_ms": 100.0, "tokens": 64, "tokens_per_s": 640.0, "peak_allocated_mib": 1.0,
             "peak_reserved_mib": 2.0, "alloc_retries": 0}
        )  # fmt: skip
        if step in val:
            records.append(
                {"step": step, "split": "val", "loss": val[step], "samples": samples, "targets": 99}
            )
    return write_run_dir(path, records, wall_s=5.0)


@pytest.fixture
def runs(tmp_path):
    return {
        "baseline": _run(tmp_path / "baseline", {5: 2.5, 10: 2.25}),
        "close": _run(tmp_path / "close", {5: 2.51, 10: 2.26}),
        "far": _run(tmp_path / "far", {5: 2.7, 10: 2.5}),
        "plain": _run(tmp_path / "plain", {}),
    }


def invoke(*args):
    return runner.invoke(app, ["compare", *map(str, args)])


def test_table_and_json_show_the_validation(runs):
    result = invoke(runs["baseline"], runs["close"], "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    val = report["validation"]
    assert val["steps"] == [5, 10] and val["pass"] is True
    assert val["loss"]["normalized_mean_abs_diff"] == pytest.approx(0.02 / 4.75)
    assert report["steps_compared"] == 10 and report["baseline"]["validation_steps_logged"] == 2
    assert "val loss: norm. mean |diff|" in result.stderr
    assert "val loss at step 10" in result.stderr and "2.2500" in result.stderr and "2.2600" in result.stderr
    assert "val samples" in result.stderr
    assert "PASS" in result.stderr


def test_validation_divergence_fails(runs):
    result = invoke(runs["baseline"], runs["far"])
    assert result.exit_code == 1, result.output
    assert "fail: normalized mean abs validation loss difference" in result.stderr.replace("\n", " ")
    assert "FAIL" in result.stderr


def test_no_validation_rows_without_validation(runs):
    result = invoke(runs["plain"], runs["plain"])
    assert result.exit_code == 0, result.output
    assert "val loss" not in result.stderr
    one_sided = invoke(runs["baseline"], runs["plain"])
    assert one_sided.exit_code == 0
    assert "only the baseline logs validation losses" in one_sided.stderr.replace("\n", " ")
    assert "val loss:" not in one_sided.stderr


def test_plot_with_validation_writes_a_png(runs, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "val.png"
    result = invoke(runs["baseline"], runs["close"], "--plot", path)
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
