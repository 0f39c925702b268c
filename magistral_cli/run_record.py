"""Writing a run directory's JSON records: ``run_identity.json``'s name, atomic JSON writes and
``record_resolved`` (what only the training process can know, added to the run identity).

A root module (DESIGN.md, "Layers"): the launcher writes the identity, the engine adds to it,
and neither has to import the other. It imports nothing heavy (no torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from magistral_cli.errors import CheckFailed, UserError

#: The run directory's resolved recipe (written by the launcher, read by the ranks, generate and export).
RESOLVED_CONFIG = "resolved_config.yaml"

IDENTITY_NAME = "run_identity.json"


def write_json(path: Path, obj: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    text = json.dumps(obj, indent=2) + "\n"  # before the temporary file: a bad value leaves nothing behind
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        # A full disk (or a read-only one): no temporary file left behind, one message.
        tmp.unlink(missing_ok=True)
        raise CheckFailed(f"cannot write {path}: {exc.strerror or exc}; free space on that disk") from None


def record_resolved(run_dir: str | Path, **fields: Any) -> Path:
    """Add what only the training process can know to ``run_identity.json``, under ``"resolved"``.

    The launcher writes the file on the host before torchrun starts, without touching the
    device; choices made on the device (which AdamW kernel really runs, say) are recorded here
    by rank 0 once they are made. Each field replaces the one of the same name; everything else
    is kept. The update is atomic (write_json). A run started without the launcher gets a file
    holding only ``"resolved"`` (and its run directory, if missing).
    """
    path = Path(run_dir) / IDENTITY_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    identity: dict[str, Any] = {}
    if path.is_file():
        try:
            identity = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise UserError(
                f"{path} is not valid JSON ({exc}); remove it or relaunch with `magistral train`"
            ) from None
        if not isinstance(identity, dict):
            raise UserError(f"{path} holds a {type(identity).__name__}, not a run identity object")
    identity.setdefault("resolved", {}).update(fields)
    write_json(path, identity)
    return path


__all__ = ["IDENTITY_NAME", "record_resolved", "write_json"]
