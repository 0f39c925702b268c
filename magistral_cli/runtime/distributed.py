"""Process groups and rank processes.

``init_distributed`` joins torchrun's group (the trainer); ``spawn_ranks`` starts a fresh group
of rank processes in-process (probes, the CP harness, tests, benchmarks), runs one function on
every rank and returns each rank's JSON result; ``finish_rank_process`` ends a rank.

CPU ranks start from a fork server that has imported the engine once (``RANK_PRELOAD``): a fresh
interpreter spends about 6 s of CPU importing torch, transformers' Mistral3 and FSDP before its
first line of work (the test suite starts about a hundred ranks this way). The server is
started on first use with the caller's environment, and a call made with a different environment
(a variable set since, as a test's ``monkeypatch.setenv`` does: ``MALLOC_*``, ``TMPDIR`` and the
like act at a process's start) starts fresh interpreters instead, so a rank never starts with other
settings than a spawned one would. What imports write into the environment and a fresh rank would
write the same or never read is no difference (``_comparable_env``). CUDA and NPU ranks are always
spawned (a server that imported torch_npu or touched a device must not fork).

After a gloo process group is destroyed, the interpreter's normal teardown can still abort the
process ("terminate called without an active exception", SIGABRT) while C++ static objects are
destroyed under a background communication thread. It happened in about 1 of 15 otherwise
successful CPU runs here, after all the work was done, and torchrun or ``mp.spawn`` then report the
rank as failed. A rank whose work is finished therefore flushes its output and leaves with
``os._exit``, skipping that teardown.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from magistral_cli.runtime.device import BACKENDS, set_device

#: A spawned rank that waits on a collective longer than this fails instead of hanging.
COLLECTIVE_TIMEOUT_S = 180


#: What a rank runs before it leaves with ``os._exit``, which skips the interpreter's exit handlers:
#: the clean-ups of those handlers that the rank needs (``at_rank_exit``), newest first.
_AT_RANK_EXIT: list[Callable[[], None]] = []


def at_rank_exit(func: Callable[[], None]) -> None:
    """Run ``func`` when this rank ends through :func:`finish_rank_process` (once; its errors ignored):
    the part of an exit handler that ``os._exit`` would skip, such as removing temporary files."""
    if func not in _AT_RANK_EXIT:
        _AT_RANK_EXIT.append(func)


def finish_rank_process(code: int = 0) -> NoReturn:
    """Run the ``at_rank_exit`` clean-ups, flush logs and standard streams, then end this process
    with ``code`` at once."""
    while _AT_RANK_EXIT:
        with contextlib.suppress(Exception):
            _AT_RANK_EXIT.pop()()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream must not change the exit code.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(device_type: str) -> tuple[torch.device, bool]:
    """Join torchrun's process group (or reuse one already set up); return (device, created_here).

    Without torchrun's environment (tests, notebooks) and no group yet, a one-process group on a
    free local port.
    """
    device = set_device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return device, False
    backend = BACKENDS[device_type]
    # Eager communicator creation is a NCCL feature; gloo and hccl connect lazily.
    device_id = device if device_type == "cuda" else None
    if "RANK" not in os.environ:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            device_id=device_id,
        )
    else:
        dist.init_process_group(backend=backend, device_id=device_id)
    return device, True


def destroy_distributed() -> None:
    """Leave the process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


class RankFailure(RuntimeError):
    """A spawned rank raised, died or ran past its time; the message carries the rank's traceback."""


class RankTimeout(RankFailure, TimeoutError):
    """The rank processes were still running after ``spawn_ranks``'s ``timeout_s`` (they were stopped)."""


def run_jobs(run_job: Callable[[Any], Any], jobs: Sequence[Any], *, where_lines: int = 4) -> list[Any]:
    """``run_job(job)`` for every job in turn, on this rank; the list of their results.

    A job that raises gives ``{"error": "Type: message", "where": [...]}`` (the last
    ``where_lines`` lines of its traceback) in its place, and the jobs after it still run: one
    failing check does not hide the others. For the body of a :func:`spawn_ranks` function.
    """
    results = []
    for job in jobs:
        try:
            results.append(run_job(job))
        except Exception as error:  # reported per job
            where = traceback.format_exc(limit=-where_lines).strip().splitlines()[-where_lines:]
            results.append({"error": f"{type(error).__name__}: {error}", "where": where})
    return results


#: What the fork server of CPU ranks imports once (see the module docstring).
RANK_PRELOAD = ("magistral_cli.engine.trainer",)
#: Environment variables that may differ between the fork server's start and a later call: pytest
#: rewrites this one at every phase of every test, and nothing reads it when a process starts.
#: A rank gets the caller's value all the same (``_rank_main`` sets the caller's environment).
ENV_NOT_COMPARED = frozenset({"PYTEST_CURRENT_TEST"})
#: The environment the fork server was started with (None: this process has not started one).
_server_env: dict[str, str] | None = None


#: Variables that torch's compiler writes before each use of them, in its own process (a pointer):
#: whatever a process starts with is never read.
WRITTEN_BEFORE_USE = frozenset({"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"})
_NEVER_COMPARED = ENV_NOT_COMPARED | WRITTEN_BEFORE_USE


def _default_inductor_cache_dir() -> str | None:
    """The inductor cache directory that importing torch's compiler (transformers' models import
    it) writes into its process's environment where none was set; a fresh interpreter writes the
    same."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without it writes nothing
        return None
    return os.path.abspath(default_cache_dir())


def _comparable_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) less what cannot make a new process differ: the variables
    of ``ENV_NOT_COMPARED`` and ``WRITTEN_BEFORE_USE``, the inductor cache directory at torch's
    default, and the entries of ``LD_LIBRARY_PATH`` that are no directory (OpenCV's import adds
    one for its subprocesses)."""
    env = os.environ if env is None else env
    comparable = {k: v for k, v in env.items() if k not in _NEVER_COMPARED}
    if comparable.get("TORCHINDUCTOR_CACHE_DIR") == _default_inductor_cache_dir():
        del comparable["TORCHINDUCTOR_CACHE_DIR"]
    if "LD_LIBRARY_PATH" in comparable:
        found = [p for p in comparable.pop("LD_LIBRARY_PATH").split(os.pathsep) if os.path.isdir(p)]
        if found:
            comparable["LD_LIBRARY_PATH"] = os.pathsep.join(found)
    return comparable


def rank_start_method(device_type: str, env: dict[str, str] | None = None) -> str:
    """How :func:`spawn_ranks` starts ranks for this call: ``forkserver`` or ``spawn``.

    ``forkserver`` for CPU ranks when this process's fork server runs (it is started here on first
    use, ``RANK_PRELOAD`` imported in it) with the environment the caller has now (or ``env``, the
    one the new process will have); ``spawn`` otherwise: another device, a different environment,
    a server started by someone else, or ``MAGISTRAL_RANK_START=spawn``.
    """
    global _server_env
    if device_type != "cpu" or os.environ.get("MAGISTRAL_RANK_START") == "spawn":
        return "spawn"
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_forkserver_pid"):
        return "spawn"  # an interpreter whose fork server works otherwise
    before = server._forkserver_pid
    if before is None:
        if _server_env is not None:
            return "spawn"  # stopped since (stop_forkserver): not ours to restart
        server.set_forkserver_preload(list(RANK_PRELOAD))
    elif _server_env is None:
        return "spawn"  # started by other code, with other modules and settings
    server.ensure_running()  # starts it, or again if it died
    if server._forkserver_pid != before:
        _server_env = _comparable_env()
    return "forkserver" if _comparable_env(env) == _server_env else "spawn"


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    world_size: int,
    device_type: str,
    threads: int,
    init_file: str,
    out_dir: str,
    environ: dict[str, str],
) -> None:
    if os.environ != environ:  # a forked rank: the caller's values of ENV_NOT_COMPARED
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(threads)
    device = set_device(device_type, rank)
    dist.init_process_group(
        BACKENDS[device_type],
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if device_type == "cuda" else None,
    )
    code = 0
    try:
        record = {"result": fn(rank, *args)}
    except BaseException as error:  # reported to the parent with its traceback
        record = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        code = 1
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    finish_rank_process(code)


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    device: str = "cpu",
    timeout_s: float | None = None,
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` new processes in one process group.

    ``fn`` must be importable (a module-level function) and return something JSON can write; the
    list of every rank's return value comes back in rank order. Each rank joins the group (gloo
    on the CPU, NCCL on CUDA, HCCL on NPU, device = rank) before ``fn`` runs and leaves it after.
    CPU ranks share the cores (``threads`` each, default cores / world_size). A rank that raises
    or dies raises :class:`RankFailure` naming the rank, a group still running after ``timeout_s``
    :class:`RankTimeout` (also a ``TimeoutError``); the other processes are terminated. CPU ranks
    start from a fork server with the engine imported when the environment allows it
    (:func:`rank_start_method`), the others as fresh interpreters.
    """
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="magistral-ranks-") as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(
            _rank_main,
            args=(fn, tuple(args), world_size, device, threads, init_file, tmp, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=rank_start_method(device),
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failure = None
        try:
            # Waits of at most 1 s, none past the deadline: a group is stopped at its time, not at
            # the next whole second (one that ended after its time but within that second returned
            # as if it had been in time).
            while not context.join(
                timeout=1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ):
                if deadline is not None and time.monotonic() >= deadline:
                    raise RankTimeout(f"the {world_size} rank processes ran past {timeout_s:g} s")
        except mp.ProcessExitedException as error:
            failure = error
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        records = []
        for rank in range(world_size):
            path = Path(tmp, f"rank{rank}.json")
            records.append(json.loads(path.read_text(encoding="utf-8")) if path.exists() else None)
    for rank, record in enumerate(records):
        if record is not None and "error" in record:
            raise RankFailure(f"rank {rank} failed: {record['error']}\n{record['traceback']}")
    if failure is not None:
        raise RankFailure(
            f"rank {failure.error_index} ended without a result (exit code {failure.exit_code}); "
            "the other ranks were stopped"
        )
    if any(record is None for record in records):
        dead = [rank for rank, record in enumerate(records) if record is None]
        raise RankFailure(f"rank(s) {dead} ended without a result")
    return [record["result"] for record in records]
