"""The module torchrun starts on every rank: ``python -m magistral_cli.engine.run RESOLVED_CONFIG``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m magistral_cli.engine.run RESOLVED_CONFIG.yaml", file=sys.stderr)
        return 2
    print(
        "magistral engine: the FSDP2 trainer is not implemented in this version yet; "
        "use `magistral train ... --dry-run` to check a recipe and its launch command.",
        file=sys.stderr,
    )
    return 3


if __name__ == "__main__":
    sys.exit(main())
