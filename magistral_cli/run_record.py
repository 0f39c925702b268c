"""Writing a run directory's JSON records: ``run_identity.json``'s name, atomic JSON writes,
``record_resolved`` (what only the training process can know, added to the run identity), the
launcher's resume decision as the ranks read it (``restarts_data``), and the rule every command
that writes a file follows: never over one of its inputs (``refuse_overwriting_inputs``).

A root module (DESIGN.md, "Layers"): the launcher writes the identity, the engine adds to it,
and neither has to import the other. It imports nothing heavy (no torch).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from magistral_cli.errors import CheckFailed, UserError

#: The run directory's resolved recipe (written by the launcher, read by the ranks, generate and export).
RESOLVED_CONFIG = "resolved_config.yaml"

IDENTITY_NAME = "run_identity.json"


def write_text_atomic(path: Path, text: str | bytes, *, fsync: bool = False) -> None:
    """``text`` (UTF-8, or ``bytes`` as they are) into ``path`` through a temporary file next to it
    and a rename, so readers never see half a file; the file gets a new file's mode (the umask's).
    ``fsync``: the bytes reach the disk before the rename. A failure (a full disk) leaves the old
    file and no temporary, and raises an ``OSError`` naming ``path``."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    binary = isinstance(text, bytes)
    try:
        with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any, *, fsync: bool = False, check_failed: bool = True) -> None:
    """Write JSON (indented by 2, one final newline) atomically (``write_text_atomic``).

    A failure is a ``CheckFailed`` naming ``path`` (free space); ``check_failed=False`` raises the
    ``OSError`` naming it instead, for callers that report OS errors their own way.
    """
    text = json.dumps(obj, indent=2) + "\n"  # before the temporary file: a bad value leaves nothing behind
    try:
        write_text_atomic(path, text, fsync=fsync)
    except OSError as exc:
        if not check_failed:
            raise
        # A full disk (or a read-only one): no temporary file left behind, one message.
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


def read_identity(run_dir: str | Path) -> dict[str, Any] | None:
    """``run_identity.json`` of ``run_dir`` as a dict; None when there is none or it is not an object."""
    path = Path(run_dir) / IDENTITY_NAME
    try:
        identity = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return identity if isinstance(identity, dict) else None


#: The identity's record of how a launch resumed (written by the launcher before any rank starts).
RESUME_KEY = "resume"


def restarts_data(run_dir: str | Path, checkpoint: str | Path) -> bool:
    """Whether the launcher decided that resuming ``checkpoint`` starts the data order again.

    ``magistral train --restart-data`` resumes a checkpoint under a changed data set-up (dataset,
    data-parallel size, micro-batch...): the checkpoint's data position would mean other samples,
    so it is not loaded. That holds for the checkpoints written before the change (step up to the
    recorded one, in the recorded save directory); a newer one was written under the new set-up.
    """
    decision = (read_identity(run_dir) or {}).get(RESUME_KEY) or {}
    if decision.get("data") != "restart":
        return False
    checkpoint = Path(checkpoint)
    match = re.fullmatch(r"step_(\d+)", checkpoint.name)
    try:
        same_dir = Path(decision["save_dir"]).resolve() == checkpoint.parent.resolve()
        return bool(match) and same_dir and int(match.group(1)) <= int(decision["step"])
    except (KeyError, TypeError, ValueError, OSError):
        return False


def refuse_overwriting_inputs(
    output: str | Path,
    inputs: Iterable[tuple[str, str | Path | None]],
    option: str,
    fix: str = "give another path",
) -> None:
    """Refuse (UserError) to write ``output`` over something the command reads.

    ``inputs`` are ``(what, path)`` pairs: a file may not be ``output`` itself (or the same file
    through a link); a directory (a model directory, a cache) may not hold an existing ``output``.
    ``option`` names the flag or key that chose ``output`` and ``fix`` says what to do instead, for
    the message. ``output`` may not be a directory either.
    """
    out = Path(output).expanduser()
    if out.is_dir():
        raise UserError(f"{option} {output} is a directory; give a file path")
    target = out.resolve()
    for what, path in inputs:
        if not path:
            continue
        source = Path(path).expanduser()
        try:
            if source.is_file() and out.exists() and os.path.samefile(source, out):
                raise UserError(
                    f"{option} {output} is {what} ({source}), which this command reads; writing there would "
                    f"replace it; {fix}"
                )
            if source.is_dir() and out.exists() and source.resolve() in target.parents:
                raise UserError(
                    f"{option} {output} is an existing file inside {what} {source}, which this command reads; "
                    f"writing there would replace it; {fix}"
                )
        except OSError:
            continue


__all__ = [
    "IDENTITY_NAME",
    "RESUME_KEY",
    "read_identity",
    "record_resolved",
    "refuse_overwriting_inputs",
    "restarts_data",
    "write_json",
]
