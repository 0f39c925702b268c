"""`magistral` as its own process, for tests: ``run_cli`` is ``subprocess.run`` of the command line
with its output captured, in a process that starts with the engine already imported where it can.

A fresh interpreter running ``magistral train`` spends 5-10 s of CPU importing torch and
transformers (the pre-flight's memory plan builds the model on the meta device) before its first
line of work; the test suite starts about sixty. Here the process is forked from the fork server
of CPU ranks (``runtime.distributed``), which imported the engine once, whenever the environment
the command is to have is the server's: the command then runs the same code in a process of its
own (its own pid, working directory, environment, standard output and error, exit code), without
the imports. A command with another environment (a variable that a test set or a fault to inject:
some act at a process's start) runs in a fresh interpreter as before, and so do the tests that
signal or kill the command (they start it with ``subprocess.Popen``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The command line a fresh interpreter runs (``python -c CLI_CODE ARGS``).
CLI_CODE = "from magistral_cli.cli.main import main; main()"


def cli_command(args: Sequence[str]) -> list[str]:
    """``python -c "...main()" ARGS``: the ``magistral`` command line of this interpreter."""
    return [sys.executable, "-c", CLI_CODE, *args]


def cli_start_method(env: Mapping[str, str]) -> str:
    """How :func:`run_cli` starts a command that is to have ``env``: ``forkserver`` (forked with the
    engine imported) or ``spawn`` (a fresh interpreter). ``env`` must equal the fork server's
    environment (``runtime.distributed.rank_start_method``), less a ``PYTHONPATH`` that names only
    directories this process imports from (the forked process keeps the server's ``sys.path``,
    which is this process's)."""
    from magistral_cli.runtime.distributed import rank_start_method

    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if any(os.path.abspath(p) not in {os.path.abspath(q or ".") for q in sys.path} for p in extra):
        return "spawn"
    compared = dict(env)
    if "PYTHONPATH" not in os.environ:
        compared.pop("PYTHONPATH", None)
    return rank_start_method("cpu", compared)


def _forked_cli(args: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    """The forked process: the command's directory, environment and output files, then ``main()``
    (its ``SystemExit`` is the process's exit code, an uncaught error's traceback goes to stderr)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        # Onto the descriptors themselves: sys.stdout/stderr, the logging handlers made at import and
        # every child (torchrun and its ranks) write there.
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["-c", *args]
    from magistral_cli.cli.main import main

    main()


def run_cli(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | Path,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """Run ``magistral ARGS`` with ``env`` in ``cwd`` to its end; its exit code and text output, as
    ``subprocess.run(cli_command(args), env=env, cwd=cwd, capture_output=True, text=True,
    timeout=timeout)`` gives them (that is what runs when the environment cannot be forked)."""
    import multiprocessing

    command = cli_command(args)
    if cli_start_method(env) != "forkserver":
        return subprocess.run(
            command, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory(prefix="magistral-cli-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = multiprocessing.get_context("forkserver").Process(
            target=_forked_cli, args=(list(args), dict(env), str(cwd), out_path, err_path)
        )
        process.start()
        process.join(timeout)
        timed_out = process.exitcode is None
        if timed_out:
            process.kill()
            process.join()
        out, err = (
            Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out_path, err_path)
        )
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(command, process.exitcode, out, err)
