"""A relaunch into a run directory under a changed set-up, through the real CLI on 2 CPU processes.

The launcher decides before any rank starts (``launch/rundir.py``): a change to what the
checkpoint's data position counts (data-parallel size, micro-batch, dataset...) is refused, exit 2,
naming the change and ``--restart-data``; with it the run resumes weights, optimizer and step and
starts the data order again; any other change continues and is named. run_identity.json records
the decision (``"resume"``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from engine.helpers import file_digests, run_train, trained_four_steps  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(recipe, a finished 2-process run of 4 steps with checkpoints step_2 and step_4)."""
    return trained_four_steps(tmp_path_factory.mktemp("resume_changes"))


def _tree(directory: Path) -> dict[str, str]:
    return file_digests(directory, skip_prefix=".magistral.")


def _text(result) -> str:
    return " ".join(result.stderr.split())  # the console wraps long lines


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _rank_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run_dir / "logs").rglob("stderr.log")))


def test_a_data_position_change_is_refused_naming_it_and_the_option(trained, tmp_path):
    recipe, base = trained
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = _tree(run)
    for extra, change in (
        (["training.micro_batch_size=2"], "training.micro_batch_size 1 -> 2"),
        (["--nproc-per-node", "1"], "the data-parallel size 2 -> 1"),
    ):
        refused = run_train(recipe, run, "training.train_iters=6", *extra)
        assert refused.returncode == 2, refused.stderr[-3000:]
        text = _text(refused)
        assert "Traceback" not in text
        assert (
            f"resuming step_4 of {run / 'checkpoints'} would apply its data position to a changed set-up"
            in text
        )
        assert change in text and "--restart-data" in text and "new training.output_dir" in text
        assert _tree(run) == before


def test_restart_data_resumes_the_step_and_is_recorded_then_continues(trained, tmp_path):
    recipe, base = trained
    run = tmp_path / "run"
    shutil.copytree(base, run)
    # `--nproc-per-node 1` after the helper's 2: the world size changes, on purpose.
    done = run_train(recipe, run, "training.train_iters=6", "--nproc-per-node", "1", "--restart-data")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "with the data order started again (--restart-data)" in _text(done)
    assert "resuming" in _rank_logs(run) and "data order started again" in _rank_logs(run)
    assert _steps(run) == [1, 2, 3, 4, 5, 6]
    identity = json.loads((run / "run_identity.json").read_text())
    resume = identity["resume"]
    assert (resume["checkpoint"], resume["step"], resume["data"], resume["reason"]) == (
        "step_4",
        4,
        "restart",
        "--restart-data",
    )
    assert {"key": "data_parallel_size", "was": 2, "now": 1} in resume["data_changes"]
    assert identity["data_setup"]["data_parallel_size"] == 1

    # step_6 was saved under the new set-up: the next launch with it continues, nothing to restart.
    again = run_train(recipe, run, "training.train_iters=7", "--nproc-per-node", "1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming step_6" in _text(again) and "training.train_iters 6 -> 7" in _text(again)
    resume = json.loads((run / "run_identity.json").read_text())["resume"]
    assert (resume["checkpoint"], resume["data"], resume["data_changes"]) == ("step_6", "continue", [])
    assert _steps(run) == [1, 2, 3, 4, 5, 6, 7]
