"""Validation losses in `compare`: read apart from the training curve, judged like the loss, plotted.

The runs are real metrics.jsonl files in the trainer's format: training records as
``MetricsFile`` writes them and ``{"step", "split": "val", "loss", "samples", "targets"}`` lines
for the validations.
"""

from __future__ import annotations

import numpy as np
import pytest

from magistral_cli.analysis.logs import StepRecord, ValRecord, read_run
from magistral_cli.analysis.metrics import compare_runs
from magistral_cli.testing.run_logs import write_run_dir


def train_record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-5, "step_time_ms": 100.0 + step,
            "tokens": 512, "tokens_per_s": 5000.0, "peak_allocated_mib": 10.0, "peak_reserved_mib": 20.0,
            "alloc_retries": 0}  # fmt: skip


def val_record(step: int, loss, samples: int = 8, targets: int = 640) -> dict:
    return {"step": step, "split": "val", "loss": loss, "samples": samples, "targets": targets}


def write_run(path, train: dict[int, float], val: dict[int, float], *, samples: int = 8):
    """Records in the trainer's order: step N's training line, then its validation line."""
    records = []
    for step, loss in train.items():
        records.append(train_record(step, loss))
        if step in val:
            records.append(val_record(step, val[step], samples))
    records += [val_record(s, v, samples) for s, v in val.items() if s not in train]
    return write_run_dir(path, records)


TRAIN = {s: 3.0 - 0.1 * s for s in range(1, 13)}
VAL = {4: 2.9, 8: 2.7, 12: 2.6}


def test_val_lines_are_not_training_steps(tmp_path):
    with_val = read_run(write_run(tmp_path / "a", TRAIN, VAL))
    without = read_run(write_run(tmp_path / "b", TRAIN, {}))
    assert with_val.steps == without.steps  # the training curve is the same
    assert with_val.duplicate_steps == []  # step 4's val line is not a second step 4
    assert with_val.val_steps == {s: ValRecord(loss=v, samples=8, targets=640) for s, v in VAL.items()}
    assert without.val_steps == {}
    assert with_val.describe()["validation_steps_logged"] == 3
    assert with_val.steps[4] == StepRecord(
        loss=TRAIN[4], step_time_ms=104.0, peak_allocated_mib=10.0, peak_reserved_mib=20.0, alloc_retries=0
    )


def test_val_line_first_and_other_splits(tmp_path):
    """A file may start with a val line (detected all the same); an unknown split is ignored; the
    training curve reads ``"split": "train"`` lines as training lines; a repeated val step keeps the last."""
    records = [val_record(2, 5.0), {"step": 1, "split": "train", "loss": 1.0}, {"step": 2, "loss": 2.0},
               {"step": 2, "split": "test", "loss": 9.0}, val_record(2, 4.0, samples=9)]  # fmt: skip
    run = read_run(write_run_dir(tmp_path / "run", records))
    assert {s: r.loss for s, r in run.steps.items()} == {1: 1.0, 2: 2.0}
    assert run.duplicate_steps == []
    assert run.val_steps == {2: ValRecord(loss=4.0, samples=9, targets=640)}
    assert run.duplicate_val_steps == [2]
    # A metrics.jsonl with only validation lines logs no training step.
    from magistral_cli.errors import UserError

    with pytest.raises(UserError, match="logs no training step"):
        read_run(write_run_dir(tmp_path / "val-only", [val_record(1, 1.0)]))


def test_validation_section_matches_numpy(tmp_path):
    c_val = {4: 2.93, 8: 2.66, 12: 2.61}
    base = read_run(write_run(tmp_path / "base", TRAIN, VAL))
    cand = read_run(write_run(tmp_path / "cand", TRAIN, c_val))
    result = compare_runs(base, cand)
    val = result.report["validation"]
    b = np.array([VAL[s] for s in (4, 8, 12)])
    c = np.array([c_val[s] for s in (4, 8, 12)])
    assert val["steps_compared"] == 3 and val["steps"] == [4, 8, 12]
    assert val["loss"]["normalized_mean_abs_diff"] == pytest.approx(np.abs(c - b).sum() / np.abs(b).sum())
    rel = np.abs(c - b) / np.abs(b)
    assert val["loss"]["relative_error_max"] == pytest.approx(rel.max())
    assert val["loss"]["relative_error_max_step"] == [4, 8, 12][int(rel.argmax())] == 8
    assert val["loss"]["threshold"] == result.report["criteria"]["loss_threshold"] == 0.02
    assert val["baseline_last"] == 2.6 and val["candidate_last"] == 2.61
    assert val["samples"] == {"baseline": [8], "candidate": [8]}
    assert val["pass"] is True and result.passed
    assert result.report["steps_compared"] == 12  # val lines are no extra training steps
    assert result.baseline_val == VAL and result.candidate_val == c_val
    assert not any("validation" in w for w in result.report["warnings"])


def test_validation_joins_the_verdict_with_the_loss_threshold(tmp_path):
    """Identical training losses, validation 5 % off: the comparison fails on the validation."""
    far = {s: v * 1.05 for s, v in VAL.items()}
    base = read_run(write_run(tmp_path / "base", TRAIN, VAL))
    cand = read_run(write_run(tmp_path / "cand", TRAIN, far))
    result = compare_runs(base, cand)
    assert result.report["loss"]["pass"] is True
    assert result.report["validation"]["pass"] is False and not result.passed
    assert any("validation loss difference 5.0000%" in f for f in result.report["failures"])
    # The same threshold flag governs both: 6 % lets it pass.
    assert compare_runs(base, cand, loss_threshold=0.06).passed


def test_validation_only_in_one_run_is_a_warning(tmp_path):
    base = read_run(write_run(tmp_path / "base", TRAIN, VAL))
    cand = read_run(write_run(tmp_path / "cand", TRAIN, {}))
    result = compare_runs(base, cand)
    assert result.report["validation"] is None and result.passed
    assert "only the baseline logs validation losses: validation not compared" in result.report["warnings"]
    assert result.candidate_val == {} and result.baseline_val == VAL
    neither = compare_runs(cand, cand)
    assert neither.report["validation"] is None
    assert not any("validation" in w for w in neither.report["warnings"])


def test_no_common_validation_step(tmp_path):
    base = read_run(write_run(tmp_path / "base", TRAIN, {4: 2.9, 8: 2.7}))
    cand = read_run(write_run(tmp_path / "cand", TRAIN, {5: 2.9, 10: 2.7}))
    result = compare_runs(base, cand)
    val = result.report["validation"]
    assert val["steps_compared"] == 0 and val["pass"] is None and val["loss"] is None
    assert result.passed
    assert any("no common validation steps" in w for w in result.report["warnings"])


def test_different_splits_and_missing_values_are_named(tmp_path):
    base = read_run(write_run(tmp_path / "base", TRAIN, VAL, samples=8))
    cand_val = {4: 2.9, 8: None, 12: 2.6, 13: 2.5}  # null: a non-finite loss as metrics.jsonl writes it
    cand = read_run(write_run(tmp_path / "cand", TRAIN, cand_val, samples=10))
    result = compare_runs(base, cand)
    val, warnings = result.report["validation"], result.report["warnings"]
    assert val["steps_compared"] == 3 and val["loss"]["steps_used"] == 2
    assert val["loss"]["missing_steps"] == {"baseline": [], "candidate": [8]}
    assert any("the validation splits differ (baseline 8 samples, candidate 10)" in w for w in warnings)
    assert "the candidate has no validation loss at step 8: left out" in warnings
    assert "1 validation step(s) logged by the candidate only are not compared" in warnings
    assert result.passed and np.isnan(result.candidate_val[8])


def test_plot_draws_validation_markers(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from magistral_cli.analysis.plot import plot_comparison

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    base = read_run(write_run(tmp_path / "base", TRAIN, VAL))
    cand = read_run(write_run(tmp_path / "cand", TRAIN, {4: 2.91, 8: 2.71}))
    path = plot_comparison(compare_runs(base, cand), tmp_path / "p.png", labels=("b", "c"))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax_loss = figures[0].axes[0]
    lines = {line.get_label(): line for line in ax_loss.get_lines()}
    assert list(lines["b validation"].get_xdata()) == [4, 8, 12]
    assert list(lines["c validation"].get_ydata()) == [2.91, 2.71]
    assert lines["b validation"].get_marker() == "o" and lines["b"].get_marker() == "None"
    assert "validation" in figures[0].get_suptitle()

    # Without validation losses: no validation curve.
    figures.clear()
    plain = read_run(write_run(tmp_path / "plain", TRAIN, {}))
    plot_comparison(compare_runs(plain, plain), tmp_path / "q.png", labels=("b", "c"))
    assert not any("validation" in line.get_label() for line in figures[0].axes[0].get_lines())
