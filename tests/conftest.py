"""Shared test fixtures."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

import pytest

from magistral_cli.testing.local_hub import LocalHub, add_synthetic_model

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


# --------------------------------------------------------------------------- sharing the machine
# The README runs the suite on pytest-xdist workers (`-n 2`): two tests at a time, which fills the
# cores where one test alone waits on a subprocess's start, the disk or a rank. Each worker's own
# torch computes on its share of the cores (the ranks tests start choose their own threads). A test
# marked `exclusive` (its memory peak needs the machine) runs with no other test beside it: every
# test holds a shared lock on a file of the run while it runs, an exclusive one takes it whole, and
# a turnstile in front of both keeps a waiting exclusive test from being passed by shared ones.


def _use_cores(share: int) -> None:
    """This worker's torch computes on 1/``share`` of the machine's cores."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // share))


def _use_worker_share() -> None:
    """This worker's share of the cores: one of pytest-xdist's workers."""
    _use_cores(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" in os.environ:
        _use_worker_share()


@pytest.fixture(scope="session", autouse=True)
def _rank_fork_server():
    """Start the fork server of CPU ranks (``runtime.spawn_ranks``) before any test changes the
    environment: one started inside a test that had set a variable would hold that variable, and every
    later call with the session's environment would start fresh interpreters (correct, but each one
    about 6 s of CPU slower)."""
    from magistral_cli.runtime.distributed import rank_start_method

    rank_start_method("cpu")


@pytest.fixture(autouse=True)
def _environment_restored():
    """What a test's in-process code writes into ``os.environ`` goes with the test: wandb's service
    address, the trainer's ``CUBLAS_WORKSPACE_CONFIG`` (the processes of later tests would inherit
    them, and the rank fork server would no longer match the session's environment: every later rank
    and command a fresh interpreter)."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[name]
    for name, value in before.items():
        if name != "PYTEST_CURRENT_TEST" and os.environ.get(name) != value:
            os.environ[name] = value


@contextlib.contextmanager
def _machine_share(item):
    exclusive = item.get_closest_marker("exclusive") is not None
    # xdist gives each worker its base directory (pytest-N/popen-gwK) in the run's own pytest-N.
    run_dir = Path(item.config.option.basetemp).parent
    with open(run_dir / "machine.lock", "a") as held, open(run_dir / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield exclusive
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with _machine_share(item) as exclusive:
        if exclusive:  # it has the machine: all of its cores
            _use_cores(1)
        yield
    if exclusive:
        _use_worker_share()


@pytest.fixture
def repo_root() -> Path:
    return REPO


# The local Hub server on 127.0.0.1 and a lock for its synthetic model (fetch tests, core and CLI).
@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub(tmp_path / "hub") as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


@pytest.fixture
def push_hub(hub, tmp_path, monkeypatch):
    """The local Hub taking uploads: HF_TOKEN set to the token it expects (``hub.token``, never to be
    seen in any output), no stored token read, and the client's LFS transfer (the local Hub does not
    serve Xet storage)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
    hub.token = "hf_localtesttoken0123456789"
    monkeypatch.setenv("HF_TOKEN", hub.token)
    return hub


@pytest.fixture
def lock(tmp_path, hub):
    path = tmp_path / "lock.json"
    path.write_text(json.dumps(add_synthetic_model(hub)))
    return path
