"""`magistral compare` on preference-training runs: trl's metrics side by side, reported, not judged."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.metric_names import FORMER_PREFERENCE_NAMES, PREFERENCE_METRICS
from magistral_cli.testing.run_logs import write_run_dir

runner = CliRunner()


def _run(path, *, accuracy: float | None, former_names: bool = False):
    records = []
    for step in range(1, 5):
        record = {"step": step, "loss": 0.7 - 0.01 * step, "grad_norm": 1.0, "lr": 1e-5, "step_time_ms": 100.0,
                  "tokens": 64, "tokens_per_s": 640.0}  # fmt: skip
        if accuracy is not None:
            record.update({
                "rewards/chosen": 0.1 * step, "rewards/rejected": -0.1 * step, "rewards/accuracies": accuracy,
                "rewards/margins": 0.2 * step, "logps/chosen": -50.0 + step, "logps/rejected": -60.0 - step,
            })  # fmt: skip
            if former_names:  # what magistral-cli 0.1.0 wrote in place of trl's two names
                for old, new in FORMER_PREFERENCE_NAMES.items():
                    record[old] = record.pop(new)
        records.append(record)
    return write_run_dir(path, records, wall_s=1.0)


def test_preference_metrics_side_by_side(tmp_path):
    base, cand = _run(tmp_path / "a", accuracy=0.5), _run(tmp_path / "b", accuracy=0.75)
    result = runner.invoke(app, ["compare", str(base), str(cand), "--json"])
    assert result.exit_code == 0, result.output
    pref = json.loads(result.stdout)["preference"]
    assert list(pref) == list(PREFERENCE_METRICS)
    assert pref["rewards/accuracies"]["baseline"] == 0.5 and pref["rewards/accuracies"]["candidate"] == 0.75
    assert pref["rewards/margins"]["candidate"] == pytest.approx(0.5)  # mean of 0.2, 0.4, 0.6, 0.8
    assert pref["logps/rejected"]["candidate_last"] == -64.0
    assert "rewards/accuracies (mean)" in result.stderr and "75.00%" in result.stderr


def test_an_sft_run_against_a_dpo_run_is_named(tmp_path):
    sft, dpo = _run(tmp_path / "sft", accuracy=None), _run(tmp_path / "dpo", accuracy=0.5)
    result = runner.invoke(app, ["compare", str(sft), str(dpo), "--json"])
    report = json.loads(result.stdout)
    assert any("the candidate logs preference metrics" in w for w in report["warnings"])
    plain = runner.invoke(app, ["compare", str(sft), str(sft), "--json"])
    assert json.loads(plain.stdout)["preference"] is None


def test_a_run_logged_under_the_former_names_is_read_under_trls(tmp_path):
    """A DPO run written before the rename (``rewards/accuracy``, ``rewards/margin``) against a new one:
    both sides' values are found, under trl's names."""
    old, new = _run(tmp_path / "old", accuracy=0.25, former_names=True), _run(tmp_path / "new", accuracy=0.75)
    old_line = json.loads((old / "metrics.jsonl").read_text().splitlines()[0])
    assert "rewards/accuracy" in old_line and "rewards/accuracies" not in old_line
    result = runner.invoke(app, ["compare", str(old), str(new), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    pref = report["preference"]
    assert list(pref) == list(PREFERENCE_METRICS)
    assert pref["rewards/accuracies"]["baseline"] == 0.25 and pref["rewards/accuracies"]["candidate"] == 0.75
    assert pref["rewards/margins"]["baseline"] == pytest.approx(0.5) == pref["rewards/margins"]["candidate"]
    assert not any("preference metrics" in w for w in report["warnings"])
