"""Faults around `magistral train` on 2 CPU processes: a full disk, two jobs on one run, a killed launcher.

The disk-full cases mount a small tmpfs (root only: skipped with the reason otherwise, CI runs as
root) and point ``training.save`` at it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from magistral_cli.engine import checkpoint as ckpt
from magistral_cli.errors import CheckFailed
from magistral_cli.launch.identity import write_json

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from engine.helpers import (  # noqa: E402
    mounted_tmpfs,
    recipe_dict,
    run_train,
    train_command,
    train_env,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("disk")
    write_tiny_model(root / "model")
    data = recipe_dict(root / "model", root / "unused", micro_batch_size=1, train_iters=10, save_interval=5)
    del data["training"]["output_dir"]
    data["training"]["resume"] = "auto"
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs at tmp_path/disk."""
    with mounted_tmpfs(tmp_path / "disk", "size=24m") as disk:
        yield disk


def _fill(disk: Path) -> Path:
    """Write a file until the disk is full."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_and_one_message(
    recipe, tmp_path, small_disk
):
    saves = small_disk / "checkpoints"
    run = tmp_path / "run"
    proc = subprocess.Popen(
        train_command(recipe, run, f"training.save={saves}"),
        env=train_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Fill the disk as soon as step_5 is committed, its `latest` pointer written last (the rename of
    # step_5 comes first; a disk filled between the two fails step 5's save, not step 10's: seen once
    # under load): the save of step 10 then runs out of space.
    latest = saves / "latest"
    deadline = time.monotonic() + 300
    while not (
        (saves / "step_5" / ckpt.INTEGRITY).is_file()
        and latest.is_file()
        and latest.read_text().strip() == "step_5"
    ):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    filler = _fill(small_disk)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert "saving checkpoint step_10" in err and "No space left on device" in err
    assert "Traceback" not in err
    # no .tmp_step_10 (.magistral-owner.json: the run that owns this checkpoint directory)
    assert sorted(p.name for p in saves.iterdir()) == [".magistral-owner.json", "latest", "step_5"]
    assert (saves / "latest").read_text().strip() == "step_5"
    assert json.loads((run / "summary.json").read_text())["exit_status"] == 1

    # Space freed: the same command resumes from step 5 and finishes.
    filler.unlink()
    again = run_train(recipe, run, f"training.save={saves}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (saves / "latest").read_text().strip() == "step_10"


def test_pre_flight_removes_stale_temporaries_then_checks_free_space(recipe, tmp_path, small_disk):
    saves = small_disk / "checkpoints"
    stale = saves / ".tmp_step_3"
    stale.mkdir(parents=True)
    _fill(stale)
    # 100 checkpoints (of about 2 MiB) do not fit in 24 MiB: exit 2 before any rank starts, and
    # the stale save is gone.
    refused = run_train(
        recipe,
        tmp_path / "run",
        f"training.save={saves}",
        "training.save_interval=1",
        "training.train_iters=100",
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "free, but the run will write 100 checkpoint(s)" in refused.stderr
    assert not stale.exists()
    assert not (tmp_path / "run" / "logs").exists() or not list((tmp_path / "run" / "logs").iterdir())


def test_a_summary_that_cannot_be_written_is_one_message_and_no_temporary(small_disk):
    _fill(small_disk)
    with pytest.raises(CheckFailed, match="cannot write .*summary.json: No space left on device"):
        write_json(small_disk / "summary.json", {"steps": 1, "text": "x" * 100_000})
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def _wait_for_steps(run: Path, proc: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + 300
    metrics = run / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= steps):
        assert proc.poll() is None, "the job ended early"
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_second_job_on_a_running_run_exits_2_and_ranks_die_with_a_killed_launcher(recipe, tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen(
        train_command(recipe, run, "training.train_iters=100000", "training.save_interval=0"),
        env=train_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, as a shell job is
    )
    try:
        _wait_for_steps(run, first, 2)
        second = run_train(recipe, run, "training.train_iters=100000")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by another `magistral train` (pid {first.pid})" in second.stderr
        ranks = [int(x) for x in (run / ".magistral.ranks.lock").read_text().split()]
        assert len(ranks) == 2 and all(_alive(pid) for pid in ranks)

        # kill -9 of the launcher's whole process group: torchrun dies, and its ranks with it.
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), "rank processes outlived their launcher"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)

    # The run directory is free again: a new job on it starts (and resumes nothing: no checkpoint).
    again = run_train(recipe, run, "training.train_iters=3")
    assert again.returncode == 0, again.stderr[-3000:]
