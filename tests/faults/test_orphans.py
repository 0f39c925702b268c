"""Processes left behind, for real: `magistral train` on 2 CPU processes, then ``kill -9`` of the
launcher's pid alone (what the out-of-memory killer does), or of one rank.

No process of the job may survive its launcher; a killed rank is named first in the failure report,
with its signal, before the other rank's lost connection.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from engine.helpers import recipe_dict, train_command, train_env, write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("orphans")
    write_tiny_model(root / "model")
    data = recipe_dict(
        root / "model", root / "unused", micro_batch_size=1, train_iters=100000, save_interval=0
    )
    del data["training"]["output_dir"]
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _start(recipe: Path, run: Path) -> tuple[subprocess.Popen, list[int]]:
    """The job, once it has logged 2 steps, and its rank pids."""
    proc = subprocess.Popen(
        train_command(recipe, run),
        env=train_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so that the test's cleanup reaches all of it
    )
    deadline = time.monotonic() + 120
    metrics = run / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job logged no steps"
        time.sleep(0.1)
    ranks = [int(x) for x in (run / ".magistral.ranks.lock").read_text().split()]
    assert len(ranks) == 2 and all(map(_alive, ranks))
    return proc, ranks


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=", 1)[1])


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


def test_kill_9_of_the_launcher_pid_alone_takes_torchrun_and_the_ranks_with_it(recipe, tmp_path):
    run = tmp_path / "run"
    proc, ranks = _start(recipe, run)
    try:
        (torchrun,) = _children(proc.pid)
        # SIGKILL to the launcher's pid only: its process group (torchrun) is not signalled.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = _wait_gone([torchrun, *ranks], 15)
        assert not left, f"processes {left} outlived their launcher"
    finally:
        for pid in ranks:  # only if the test failed: no process of it is left for the next test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def test_a_rank_killed_by_a_signal_is_named_first(recipe, tmp_path):
    run = tmp_path / "run"
    proc, ranks = _start(recipe, run)
    try:
        victim = next(pid for pid in ranks if _rank_of(pid) == 1)
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, err[-3000:]
    report = err[err.index("training failed (exit status 1)") :].splitlines()
    assert report[1] == "rank 1 was killed by signal 9 (SIGKILL): the out-of-memory killer or a `kill -9`", (
        report
    )
    # The other rank is named after it, as what followed: its collective lost the connection (no
    # traceback), or torchrun stopped it first.
    later = "\n".join(report[2:])
    assert (
        "rank(s) 0 lost the connection after that failure" in later
        or "rank(s) 0 stopped by torchrun" in later
    ), report
    assert "Traceback" not in "\n".join(report), report
    assert not _wait_gone(ranks, 10)
