"""End-to-end faults on `magistral train` with 2 CPU processes: what a user sees, and what is kept.

Each case breaks a real run directory (or the run itself) and launches `magistral train` again
from the command line, as a user would: a damaged newest checkpoint, a non-finite step, a fresh
start over checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from magistral_cli.engine import checkpoint as ckpt

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from engine.helpers import run_train, trained_four_steps  # noqa: E402


def _rank_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run_dir / "logs").rglob("stderr.log")))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-process run of 4 steps that saved step_2 and step_4."""
    return trained_four_steps(tmp_path_factory.mktemp("faults"))


def test_bytes_changed_in_the_newest_checkpoint_resume_from_the_previous_one(trained, tmp_path):
    recipe, base = trained
    run = tmp_path / "run"
    shutil.copytree(base, run)
    newest = run / "checkpoints" / "step_4"
    record = json.loads((newest / ckpt.INTEGRITY).read_text())
    # Overwrite the middle of rank 1's data file, size unchanged.
    victim = newest / next(n for n in record["files"] if n.startswith("__1_"))
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(min(4096, size // 4)))
    resumed = run_train(recipe, run, "training.train_iters=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logs = _rank_logs(run)
    assert f"skipped checkpoint step_4: {victim} does not match its xxh3_64 checksum" in logs
    assert "resumed from" in logs and "step_2" in logs
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    aside = [
        json.loads(line)["step"] for line in (run / "metrics.after_step_2.jsonl").read_text().splitlines()
    ]
    assert aside == [3, 4]


def test_a_non_finite_step_exits_1_naming_the_step(trained, tmp_path):
    recipe, _ = trained
    run = tmp_path / "nan"
    failed = run_train(recipe, run, "training.lr=1e30", "training.save_interval=1")
    assert failed.returncode == 1, failed.stderr[-3000:]
    logs = _rank_logs(run)
    # Step 1 runs at lr 0 (the warm-up's first value); step 2's update at 1e30 makes step 3 non-finite.
    assert "error: step 3: " in logs and "is not finite; the update was not applied" in logs
    assert "Traceback" not in logs
    assert [p.name for _, p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_2", "step_1"]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_status"] == 1


def test_a_fresh_start_over_checkpoints_exits_2(trained, tmp_path):
    recipe, base = trained
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    refused = run_train(recipe, run, "training.resume=never")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "training.resume=never" in _rank_logs(run) + refused.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before
