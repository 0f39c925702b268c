"""torchrun supervision: the torchrun command, running it, and naming the rank that failed.

``build_command`` builds the exact command (torchrun's own rendezvous, per-rank logs under
``logs/``). ``run_torchrun`` starts it and waits: signals are passed on and no rank outlives this
process. When the job fails, ``failure_report`` reads the ranks' statuses (``rank_status/``),
torchrun's failure report and the ranks' logs, and names the failing rank first with its own
error and the command's exit status (2 for a user error, 1 otherwise); ``print_failure`` prints
it as plain text on the caller's console.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from magistral_cli.run_record import RESOLVED_CONFIG

if TYPE_CHECKING:
    from .options import LaunchOptions

#: The module torchrun starts on every rank.
ENGINE_MODULE = "magistral_cli.engine.run"


def build_command(plan_args: LaunchOptions, nproc: int, run_dir: Path) -> list[str]:
    """The torchrun command (``python -m torch.distributed.run``, so the same interpreter runs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if plan_args.nnodes == 1 and plan_args.master_addr is None and plan_args.master_port is None:
        # One node: a local rendezvous on a free port, so two runs on one machine never clash.
        cmd += ["--standalone"]
    else:
        cmd += [
            "--nnodes",
            str(plan_args.nnodes),
            "--node-rank",
            str(plan_args.node_rank),
            "--master-addr",
            plan_args.master_addr or "127.0.0.1",
            "--master-port",
            str(plan_args.master_port or 29500),
        ]
    # Every rank's stdout/stderr goes to logs/ (torchrun's --log-dir); the console shows rank 0.
    cmd += ["--log-dir", str(run_dir / "logs"), "--tee", "3", "--local-ranks-filter", "0"]
    cmd += ["-m", ENGINE_MODULE, str(run_dir / RESOLVED_CONFIG)]
    return cmd


#: torchrun's own report of a failed rank starts with one of these (its log line or its traceback).
_TORCHRUN_FAILURE = re.compile(r"^(E\d{4} .*\] failed \(exitcode|Traceback \(most recent call last\):)")
#: How many lines of a crashed rank's log the failure report shows.
LOG_TAIL = 15


def _forward_stderr(stream, failure_log: Path) -> None:
    """Copy torchrun's stderr to ours until its failure report starts; keep that report in a file.

    The stream is drained to its end whatever happens to the file: a reader that stopped would
    leave torchrun blocked on a full pipe. Should the file fail (a full disk, a read-only log
    directory), the report goes on to our stderr after one line saying why.
    """
    out = None
    kept = True  # whether the report can still go to the file
    for line in stream:
        if out is None and kept and _TORCHRUN_FAILURE.match(line):
            try:
                # Line-buffered, so a full disk shows at the line that hits it, not at close.
                out = open(failure_log, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed below)
            except OSError as error:
                kept = _report_stays_on_stderr(failure_log, error)
        if out is not None:
            try:
                out.write(line)
                continue
            except OSError as error:
                with contextlib.suppress(OSError):
                    out.close()
                out, kept = None, _report_stays_on_stderr(failure_log, error)
        sys.stderr.write(line)
        sys.stderr.flush()
    if out is not None:
        with contextlib.suppress(OSError):
            out.close()


def _report_stays_on_stderr(failure_log: Path, error: OSError) -> bool:
    sys.stderr.write(
        f"magistral: cannot keep torchrun's failure report in {failure_log} "
        f"({error.strerror or error}); it follows here\n"
    )
    return False


def _rank_log(run_dir: Path, rank: int) -> Path | None:
    """The newest ``stderr.log`` torchrun wrote for local rank ``rank``."""
    logs = sorted((run_dir / "logs").glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


#: One failure in torchrun's report: ``rank : 1 (local_rank: 1)``, then ``exitcode : -9 (pid: N)``.
_TORCHRUN_RANK = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exits(run_dir: Path) -> tuple[dict[int, int], int | None]:
    """({rank: exit code} from torchrun's failure report, the rank it names as the root cause).

    A negative code is the signal that killed the rank (torchrun's own convention).
    """
    try:
        text = (run_dir / "logs" / "torchrun_failure.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}, None
    root = text.partition("Root Cause")[2]
    codes = {int(m.group(1)): int(m.group(2)) for m in _TORCHRUN_RANK.finditer(text)}
    first = _TORCHRUN_RANK.search(root)
    return codes, int(first.group(1)) if first else None


def _signal_name(number: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


def _failed_at(record: dict) -> float:
    at = record.get("failed_at")
    return at if isinstance(at, (int, float)) else float("inf")


def failure_report(run_dir: Path, code: int, nproc: int) -> tuple[list[str], int]:
    """(lines naming each failed rank with its own error, the command's exit status).

    The cause comes first: a rank killed by a signal (torchrun's report gives the signal; the
    other ranks then fail on their lost connection, which comes after it), then a rank that
    ended without a status, then the ranks' own errors, earliest first. A rank whose only error
    is the connection it lost after another rank failed is named last, without its traceback.
    Exit 2 when every rank that failed on its own stopped on a user error (a bad recipe, a bad
    path, a changed image), 1 otherwise.
    """
    from magistral_cli.engine.run import STATUS_DIR

    statuses = {}
    for path in sorted((run_dir / STATUS_DIR).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text(encoding="utf-8"))
            statuses[int(record["rank"])] = record
    failed = {r: s for r, s in statuses.items() if s.get("exit_status")}
    missing = [r for r in range(nproc) if r not in statuses]
    # A rank whose collective lost its connection failed because another one did (or was killed):
    # named last, after that cause, so that rank 0's lost connection does not hide rank 1's error.
    lost = sorted(r for r, s in failed.items() if s.get("kind") == "lost")
    if len(lost) == len(failed) and not missing:
        lost = []  # nothing else failed that this node saw: those errors are all there is
    lost_line = (
        [f"rank(s) {', '.join(map(str, lost))} lost the connection after that failure"] if lost else []
    )
    failed = {r: s for r, s in failed.items() if r not in lost}
    # The ranks' own failures, earliest first (a record without a time last, in rank order).
    order = sorted(failed, key=lambda r: (_failed_at(failed[r]), r))
    user_errors = [r for r in order if failed[r].get("kind") == "user"]
    if user_errors and all(s.get("kind") == "user" for s in failed.values()):
        # A rank stopped on bad input: torchrun then stops the others (SIGTERM), and a rank stopped
        # before it could record anything is that consequence, not a second failure.
        lines = [f"rank {rank} failed: {_short_error(failed[rank])}" for rank in user_errors]
        lines += lost_line
        if missing:
            stopped = ", ".join(str(r) for r in missing)
            lines.append(f"rank(s) {stopped} stopped by torchrun after that failure (no status of their own)")
        return lines, 2
    codes, root = torchrun_exits(run_dir)
    # Killed by a signal: the likeliest cause, first. A SIGTERM that torchrun sent after another
    # rank's failure (it stops the rest) is a consequence, not a cause.
    killed = {
        r: -c
        for r, c in codes.items()
        if c < 0
        and r not in failed
        and r not in lost
        and not (-c == signal.SIGTERM and root is not None and r != root)
    }
    stopped = [
        r
        for r, c in codes.items()
        if c == -signal.SIGTERM and r not in killed and r not in failed and r not in lost
    ]
    lines: list[str] = []
    for rank, number in sorted(killed.items()):
        why = ": the out-of-memory killer or a `kill -9`" if number == signal.SIGKILL else ""
        lines.append(f"rank {rank} was killed by signal {number} ({_signal_name(number)}){why}")
        if rank < nproc:
            lines += _log_tail(run_dir, rank)
    # Ranks of this node that recorded nothing, for no reason torchrun gave, were killed (the
    # out-of-memory killer) or died before start-up, with their log's last lines.
    for rank in missing:
        if rank in killed or rank in stopped:
            continue
        lines.append(
            f"rank {rank} ended without a status (torchrun exit status {code}): killed, out of memory, "
            "or a crash before start-up"
        )
        lines += _log_tail(run_dir, rank)
    after = f" after rank {min(killed)} was killed" if killed else ""
    for rank in order:
        record = failed[rank]
        error = _short_error(record)
        if record.get("kind") in ("user", "check"):
            lines.append(f"rank {rank} failed{after}: {error}")
        else:
            lines.append(f"rank {rank} crashed{after}: {error}")
            if not missing and not killed and rank < nproc:
                lines += _log_tail(run_dir, rank)
    lines += lost_line
    if stopped:
        ranks = ", ".join(map(str, sorted(stopped)))
        lines.append(
            f"rank(s) {ranks} stopped by torchrun" + (" after that failure" if lines else " (SIGTERM)")
        )
    if not lines:
        lines.append(f"torchrun exit status {code}, but every rank recorded success")
    return lines, 1


def _short_error(record: dict) -> str:
    error = str(record.get("error"))
    return error[:400] + " ..." if len(error) > 400 else error


def _log_tail(run_dir: Path, local_rank: int) -> list[str]:
    log = _rank_log(run_dir, local_rank)
    if log is None:
        return []
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_TAIL:]
    return [f"  {line}" for line in tail]


def run_torchrun(command: list[str], env: dict[str, str], failure_log: Path) -> int:
    """Start torchrun and wait for it; return its exit status.

    torchrun gets SIGTERM when this process dies, even by SIGKILL alone (the out-of-memory
    killer's way; ``run_lock.parent_death_preexec``), and stops its ranks; they die with torchrun
    in any case. A SIGTERM sent to this process is passed on to torchrun; Ctrl-C reaches it
    directly (same process group), and this process waits for it to stop its ranks. torchrun's
    stderr is copied to ours until its failure report, which goes to ``failure_log``.
    """
    import threading

    from magistral_cli.run_lock import parent_death_preexec

    child = subprocess.Popen(
        command,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        preexec_fn=parent_death_preexec(),
    )
    reader = threading.Thread(target=_forward_stderr, args=(child.stderr, failure_log), daemon=True)
    reader.start()

    def _forward(signum, _frame):
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, _forward)
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                continue  # torchrun got the same SIGINT and is stopping its ranks: wait for it
    finally:
        signal.signal(signal.SIGTERM, previous)
    reader.join(timeout=10)
    return code


def print_failure(console, status: int, lines: list[str], logs: Path) -> None:
    """The failed job's report on ``console`` (the caller's; anything with rich's ``print``):
    the exit status, ``failure_report``'s lines as plain text, where the per-rank logs are."""
    console.print(f"[red]training failed[/] (exit status {status})", highlight=False)
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(f"per-rank logs: {logs}", markup=False, highlight=False)
