"""The module torchrun starts on every rank: ``python -m magistral_cli.engine.run RESOLVED_CONFIG``.

Parse the resolved recipe, build the trainer, train, close. Everything else lives in ``Trainer``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


STATUS_DIR = "rank_status"
#: Bytes a rank reserves for its status file when it starts, so that the status can still be
#: written over them if the disk fills up during the run (the record is cut to fit).
STATUS_RESERVE = 4096


def _status_path(run_dir: str) -> Path:
    return Path(run_dir) / STATUS_DIR / f"rank{int(os.environ.get('RANK', '0'))}.json"


def _reserve_status(run_dir: str | None) -> None:
    """Hold ``STATUS_RESERVE`` bytes of blanks for this rank's status (not JSON: a rank that dies
    without writing its status still reads as one that recorded nothing)."""
    if not run_dir:
        return
    path = _status_path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b" " * STATUS_RESERVE)
    except OSError:
        pass  # _write_status tries again at the end


def _write_status(
    run_dir: str | None, status: int, kind: str, error: str, failed_at: float | None = None
) -> None:
    """``<run_dir>/rank_status/rank<R>.json``: how this rank ended, for the launcher's report.

    ``failed_at`` (seconds since the epoch) is when the rank's error was raised: the launcher
    names the earliest failure first, since a rank that fails makes the others fail after it
    (their collectives lose the connection). Written over the blanks reserved at start-up (no
    new disk space needed); the launcher reads it only after every rank has ended.
    """
    if not run_dir:
        return
    import json

    path = _status_path(run_dir)
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "exit_status": status,
        "kind": kind,
        "error": error,
        "failed_at": failed_at,
    }
    data = (json.dumps(record) + "\n").encode("utf-8")
    while len(data) > STATUS_RESERVE:
        error = error[: len(error) // 2]
        record["error"] = error + " ..."
        data = (json.dumps(record) + "\n").encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if path.is_file() else "wb") as f:
            f.write(data)
            f.truncate()
    except OSError:
        pass  # no status: the launcher falls back to the rank's log


def _worker_origin(message: str) -> str:
    """The original error's own line of an error that a data-loader worker raised.

    torch's DataLoader re-raises a worker's exception in the rank as the same type with the
    worker's whole traceback as its message; the last line is the original ``Type: message``.
    """
    if not (message.startswith("Caught ") and "Original Traceback" in message):
        return message
    last = next((line for line in reversed(message.splitlines()) if line.strip()), message)
    name, sep, text = last.partition(": ")
    return text if sep and name.rpartition(".")[2].endswith(("Error", "Exception", "Failed")) else last


#: How a collective fails when another rank is gone: a consequence of that rank's failure (or of a
#: broken network), never a cause of its own. gloo: "Connection closed by peer", "Connection reset by
#: peer"; NCCL: "remote process exited or there was a network error" (ncclRemoteError), "A call failed
#: possibly due to ... a remote process exiting prematurely", "Net : Connection closed by remote peer"
#: (older NCCL reports it as an internal error), "communicator was aborted". HCCL's words for a gone peer
#: are a timeout ("Remote Rank did not send the data in time"), which a hung rank also causes: not here.
LOST_PEER = re.compile(
    r"Connection (?:closed|reset) by (?:remote )?peer|remote process exit|communicator was aborted"
)


def describe_failure(exc: BaseException) -> tuple[int, str, str]:
    """(exit status, kind, one-line message) of the exception that ended a rank.

    One rule for every failure: our errors keep their exit code (``UserError`` 2: kind ``user``;
    a failed check 1: ``check``); an operating-system error (a path, a full or read-only disk)
    becomes one through ``errors.os_error`` wherever it happened; a collective that lost its
    connection to another rank is ``lost`` (exit 1: the launcher names the rank that failed
    first); anything else is a crash (exit 1, with its traceback in the rank's log).
    """
    from magistral_cli.errors import MagistralError, UserError, os_error

    if isinstance(exc, OSError):
        exc = os_error(exc)
    if isinstance(exc, MagistralError):
        kind = "user" if isinstance(exc, UserError) else "check"
        return exc.exit_code, kind, _worker_origin(str(exc))
    message = f"{type(exc).__name__}: {exc}"
    return 1, "lost" if LOST_PEER.search(message) else "crash", message


def _report(status: int, kind: str, error: str) -> None:
    """The rank's one line (our errors, a lost connection), or the traceback (a crash) on its stderr."""
    try:
        if kind == "crash":
            import traceback

            traceback.print_exc()
        elif kind == "lost":
            lost = f"error: lost the connection to another rank, which failed or was stopped; its log says why ({error})"
            print(lost, file=sys.stderr, flush=True)
        else:
            print(f"error: {error}", file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr is a log file on a full disk: the status file still says it


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m magistral_cli.engine.run RESOLVED_CONFIG.yaml", file=sys.stderr)
        return 2
    _setup_logging()
    from magistral_cli.config import load_recipe
    from magistral_cli.versions import check_supported_versions

    trainer = None
    status, kind, error = 1, "crash", ""
    failed_at = None
    run_dir = None
    try:
        recipe = load_recipe(argv[0])
        run_dir = recipe.training.output_dir
        if "RANK" in os.environ and run_dir:
            # Under torchrun: die with the agent, and mark the run directory as in use.
            from magistral_cli.run_lock import die_with_parent, hold_rank_lock

            die_with_parent()
            hold_rank_lock(Path(run_dir))
        _reserve_status(run_dir)
        # Before transformers is imported: an unsupported one may not even import cleanly.
        check_supported_versions()
        from .trainer import Trainer

        trainer = Trainer(recipe)
        trainer.train()
        status, kind = 0, "ok"
    except BaseException as exc:  # any failure (DCP's CheckpointException is a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failed_at = time.time()
        status, kind, error = describe_failure(exc)
        _report(status, kind, error)
    finally:
        try:
            if trainer is not None:
                trainer.close(status, error or None)
        except Exception as exc:  # summary.json on a full disk: reported like any other failure
            failure = describe_failure(exc)
            _report(*failure)
            if status == 0:
                status, kind, error = failure
                failed_at = time.time()
        finally:
            _write_status(run_dir, status, kind, error, failed_at)
    return status


if __name__ == "__main__":
    from magistral_cli.runtime import finish_rank_process

    finish_rank_process(main())
