"""The module torchrun starts on every rank: ``python -m magistral_cli.engine.run RESOLVED_CONFIG``.

Parse the resolved recipe, build the trainer, train, close. Everything else lives in ``Trainer``.
"""

from __future__ import annotations

import logging
import os
import sys


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m magistral_cli.engine.run RESOLVED_CONFIG.yaml", file=sys.stderr)
        return 2
    _setup_logging()
    from magistral_cli.config import load_recipe
    from magistral_cli.errors import UserError

    from .trainer import Trainer

    trainer = None
    status = 1
    try:
        trainer = Trainer(load_recipe(argv[0]))
        trainer.train()
        status = 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = 2
    finally:
        if trainer is not None:
            trainer.close(status)
    return status


if __name__ == "__main__":
    from magistral_cli.engine.process import finish_rank_process

    finish_rank_process(main())
