"""The module torchrun starts on every rank: ``python -m magistral_cli.engine.run RESOLVED_CONFIG``.

Parse the resolved recipe, build the trainer, train, close. Everything else lives in ``Trainer``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


STATUS_DIR = "rank_status"


def _write_status(run_dir: str | None, status: int, kind: str, error: str) -> None:
    """``<run_dir>/rank_status/rank<R>.json``: how this rank ended, for the launcher's report."""
    if not run_dir:
        return
    import json

    rank = int(os.environ.get("RANK", "0"))
    path = Path(run_dir) / STATUS_DIR / f"rank{rank}.json"
    record = {"rank": rank, "exit_status": status, "kind": kind, "error": error}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a full disk: the launcher falls back to the rank's log


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m magistral_cli.engine.run RESOLVED_CONFIG.yaml", file=sys.stderr)
        return 2
    _setup_logging()
    from magistral_cli.config import load_recipe
    from magistral_cli.errors import MagistralError, UserError
    from magistral_cli.versions import check_supported_versions

    trainer = None
    status, kind, error = 1, "crash", ""
    run_dir = None
    try:
        recipe = load_recipe(argv[0])
        run_dir = recipe.training.output_dir
        if "RANK" in os.environ and run_dir:
            # Under torchrun: die with the agent, and mark the run directory as in use.
            from magistral_cli.run_lock import die_with_parent, hold_rank_lock

            die_with_parent()
            hold_rank_lock(Path(run_dir))
        # Before transformers is imported: an unsupported one may not even import cleanly.
        check_supported_versions()
        from .trainer import Trainer

        trainer = Trainer(recipe)
        trainer.train()
        status, kind = 0, "ok"
    except MagistralError as exc:
        # One message, no traceback: a user error (exit 2) or a failed check such as a
        # non-finite step or a damaged checkpoint (exit 1).
        print(f"error: {exc}", file=sys.stderr)
        status, error = exc.exit_code, str(exc)
        kind = "user" if isinstance(exc, UserError) else "check"
    except BaseException as exc:  # any other failure (DCP's CheckpointException is a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        import traceback

        traceback.print_exc()
        status, kind, error = 1, "crash", f"{type(exc).__name__}: {exc}"
    finally:
        try:
            if trainer is not None:
                trainer.close(status)
        finally:
            _write_status(run_dir, status, kind, error)
    return status


if __name__ == "__main__":
    from magistral_cli.runtime import finish_rank_process

    finish_rank_process(main())
