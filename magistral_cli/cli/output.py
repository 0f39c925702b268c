"""Where output goes: humans read stderr (rich), machines read one JSON object on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

#: Human-readable output. stderr, so that ``--json`` output on stdout stays clean.
console = Console(stderr=True, highlight=False)


def emit_json(obj: Any) -> None:
    """Print one JSON object on stdout (the machine contract in DESIGN.md)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()
