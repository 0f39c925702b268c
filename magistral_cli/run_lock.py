"""One job per run directory, one run per checkpoint directory, and no process outliving its launcher.

Two lock files in the run directory (``flock``, released by the kernel when the holder dies):

- ``.magistral.lock``: the launcher of ``magistral train`` holds it exclusively while its job
  runs, with its pid in the file. A second ``magistral train`` on the same ``output_dir`` exits 2
  naming that pid. Each node of a multi-node run locks its own file (``.magistral.node<R>.lock``).
- ``.magistral.ranks.lock``: every rank holds it shared for its whole life. A launcher that finds
  it held (ranks of a job whose launcher was killed) refuses to start.

A checkpoint directory (``training.save``) records the run that owns it in ``.magistral-owner.json``
(``SaveDirClaim``: the owner's run id and run directory, and the runs it was shared with on
purpose); the launcher holds that file locked while its job runs, so two jobs never write one
checkpoint directory at the same time. Who may claim it is the launcher's decision
(``launch/rundir.py``).

No process outlives the launcher: torchrun is started with a parent-death signal
(``parent_death_preexec``: a ``kill -9`` of the launcher's pid alone, as the out-of-memory killer
sends it, SIGTERMs torchrun, which stops its ranks), and every rank dies with torchrun
(``die_with_parent``): torchrun starts the ranks in new sessions, so a ``kill -9`` of the
launcher's process group does not reach them. On Linux ``prctl(PR_SET_PDEATHSIG)`` does it;
elsewhere (and as a second guard for the ranks) a thread watches the parent pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from magistral_cli.errors import UserError

RANKS_LOCK = ".magistral.ranks.lock"
#: A checkpoint directory's owner record (and the lock a job holds on it while it runs).
SAVE_OWNER = ".magistral-owner.json"
_PR_SET_PDEATHSIG = 1
#: Held by the rank processes for their whole life (module global: never closed, never collected).
_rank_lock_file = None


def launcher_lock_name(node_rank: int = 0) -> str:
    return ".magistral.lock" if node_rank == 0 else f".magistral.node{node_rank}.lock"


def _flock(file, exclusive: bool, wait: bool) -> bool:
    import fcntl

    flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(file.fileno(), flags)
        return True
    except BlockingIOError:
        return False


class RunLock:
    """The launcher's exclusive lock on a run directory (a context manager)."""

    def __init__(self, run_dir: Path, node_rank: int = 0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / launcher_lock_name(node_rank)
        self._file = None
        self._held: list = []

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until release)
        if not _flock(file, exclusive=True, wait=False):
            file.close()
            self._in_use()
        ranks = self.run_dir / RANKS_LOCK
        if ranks.exists():
            with open(ranks, "a+", encoding="utf-8") as probe:
                if not _flock(probe, exclusive=True, wait=False):
                    probe.seek(0)
                    pids = " ".join(probe.read().split()) or "unknown"
                    file.close()
                    raise UserError(
                        f"rank processes of an earlier job still run in {self.run_dir} (pids {pids}); "
                        "stop them (kill PID) before launching again"
                    )
                probe.truncate(0)  # the pids of ranks that are gone
        file.seek(0)
        file.truncate(0)
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file
        return self

    def _in_use(self):
        try:
            holder = self.path.read_text(encoding="utf-8").strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise UserError(
            f"{self.run_dir} is in use by another `magistral train` (pid {holder}); wait for it to end, "
            "stop it, or use another training.output_dir"
        )

    def check_free(self) -> None:
        """Refuse (UserError) a run directory that a job holds, creating nothing (before ``acquire``)."""
        try:
            probe = open(self.path, encoding="utf-8")  # noqa: SIM115 (closed below)
        except OSError:
            return  # no lock file: no job
        with probe:
            if not _flock(probe, exclusive=True, wait=False):
                self._in_use()

    def hold(self, other) -> None:
        """Release ``other`` (a ``SaveDirClaim``) with this lock."""
        self._held.append(other)

    def release(self) -> None:
        while self._held:
            self._held.pop().release()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.truncate(0)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class SaveDirClaim:
    """A job's hold on its checkpoint directory: the owner record, locked until ``release``.

    ``lock`` takes the lock (before the launcher touches anything there: stale temporaries);
    ``record`` then writes the record when the directory has none (this run becomes its owner) or
    adds a run it is shared with. The record is rewritten in place under the lock (a rename would
    swap the locked file). A directory locked by a running job is a UserError naming its run.
    """

    def __init__(self, save_dir: Path):
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / SAVE_OWNER
        self._file = None

    def lock(self) -> SaveDirClaim:
        if self._file is not None:
            return self
        self.save_dir.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until release)
        if not _flock(file, exclusive=True, wait=False):
            file.close()
            owner = read_save_owner(self.save_dir) or {}
            users = ", ".join(
                [str(owner.get("run_dir"))] + [str(s.get("run_dir")) for s in owner.get("shared_with", [])]
            )
            raise UserError(
                f"the checkpoint directory {self.save_dir} is being written by another `magistral train` "
                f"(a job of {users}); wait for it to end, or set training.save to another directory"
            )
        self._file = file
        return self

    def record(self, run_id: str, run_dir: Path, *, shared: bool = False) -> SaveDirClaim:
        file = self.lock()._file
        file.seek(0)
        text = file.read()
        record = _parse_owner(text, self.path) if text.strip() else {}
        now = _utc_now()
        if not record:
            record = {
                "format": 1,
                "run_id": run_id,
                "run_dir": str(run_dir),
                "claimed_at": now,
                "shared_with": [],
            }
        elif shared and record.get("run_id") != run_id:
            users = record.setdefault("shared_with", [])
            if run_id not in {u.get("run_id") for u in users}:
                users.append({"run_id": run_id, "run_dir": str(run_dir), "since": now})
        else:
            return self
        file.seek(0)
        file.truncate(0)
        file.write(json.dumps(record, indent=2) + "\n")
        file.flush()
        os.fsync(file.fileno())
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _utc_now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _parse_owner(text: str, path: Path) -> dict:
    try:
        record = json.loads(text)
    except ValueError as exc:
        record, exc_text = None, str(exc)
    else:
        exc_text = "not a JSON object"
    if not isinstance(record, dict) or "run_id" not in record:
        raise UserError(
            f"{path} (the record of the run that owns these checkpoints) is unreadable ({exc_text}); restore it, "
            "or remove it if this run is the owner"
        )
    return record


def read_save_owner(save_dir: Path) -> dict | None:
    """The owner record of checkpoint directory ``save_dir``, or None when it has none."""
    path = Path(save_dir) / SAVE_OWNER
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    return _parse_owner(text, path) if text.strip() else None


def hold_rank_lock(run_dir: Path) -> None:
    """Hold the ranks' shared lock on ``run_dir`` until this process ends (rank processes only)."""
    global _rank_lock_file
    if _rank_lock_file is not None:
        return
    path = Path(run_dir) / RANKS_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held for the process's life)
    _flock(file, exclusive=False, wait=True)
    file.write(f"{os.getpid()}\n")
    file.flush()
    _rank_lock_file = file


def _libc():
    """The C library (for ``prctl``) on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def parent_death_preexec(sig: int = signal.SIGTERM):
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child get ``sig`` when this process dies.

    For torchrun under the launcher: ``prctl(PR_SET_PDEATHSIG)`` is set in the child between the
    fork and the exec (it survives the exec), and a child whose parent died before that ends at
    once. SIGTERM lets torchrun stop its ranks itself (they also die with torchrun). None where
    there is no ``prctl`` (not Linux).
    """
    libc = _libc()  # loaded before the fork: the child only calls it
    if libc is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def die_with_parent(poll_s: float = 1.0) -> None:
    """End this process when its parent ends (rank processes started by torchrun)."""
    parent = os.getppid()
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(OSError, AttributeError):
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the parent ended before the guard was set

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="magistral-parent-watch", daemon=True).start()
