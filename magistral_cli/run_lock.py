"""One job per run directory, and no rank outliving its launcher.

Two lock files in the run directory (``flock``, released by the kernel when the holder dies):

- ``.magistral.lock``: the launcher of ``magistral train`` holds it exclusively while its job
  runs, with its pid in the file. A second ``magistral train`` on the same ``output_dir`` exits 2
  naming that pid. Each node of a multi-node run locks its own file (``.magistral.node<R>.lock``).
- ``.magistral.ranks.lock``: every rank holds it shared for its whole life. A launcher that finds
  it held (ranks of a job whose launcher was killed) refuses to start.

Rank processes also die with their parent (torchrun's agent): torchrun starts them in new
sessions, so a ``kill -9`` of the launcher's process group does not reach them. On Linux
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` does; elsewhere (and as a second guard) a thread watches
the parent pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from magistral_cli.errors import UserError

RANKS_LOCK = ".magistral.ranks.lock"
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

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until release)
        if not _flock(file, exclusive=True, wait=False):
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise UserError(
                f"{self.run_dir} is in use by another `magistral train` (pid {holder}); wait for it to end, "
                "stop it, or use another training.output_dir"
            )
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

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.truncate(0)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


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


def die_with_parent(poll_s: float = 1.0) -> None:
    """End this process when its parent ends (rank processes started by torchrun)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the parent ended before the guard was set

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="magistral-parent-watch", daemon=True).start()
