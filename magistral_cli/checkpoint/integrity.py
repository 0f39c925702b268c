"""Integrity of DCP checkpoints: the record training writes, and the one check every reader makes.

A training checkpoint (``step_<N>/``, a DCP whose state holds ``step``) carries ``integrity.json``:
the size and xxh3-64 digest of every file, written by rank 0 from every rank's hashes before
the checkpoint is committed (``engine.checkpoint.save_checkpoint``). Every reader of a training
checkpoint (export, ``generate``, ``convert validate``, resume, ``training.load``) goes through
``verify_checkpoint``:

- a file that is missing, has another size or another digest than its record is named, with
  what differs; the checkpoint is not read (``CheckFailed``, exit 1);
- the record's step must be the directory's (a record or files moved between checkpoints);
- a training checkpoint without ``integrity.json`` is refused: the record was removed, or the
  checkpoint was saved before training wrote records, and nothing in the directory tells the
  two apart. ``allow_unverified`` (``--allow-unverified`` on the commands) reads it anyway.

Given a directory of checkpoints, readers take the newest intact ``step_<N>`` (``choose_intact``),
as resume does, and warn about each newer one they passed over.

A DCP that is not a training checkpoint (a ``convert hf-to-dcp`` output) has no record; its
``.metadata`` is still checked against the files on disk: every data file it names must exist and
hold the bytes it places there (``safe_dcp.storage_problems``, run by the safe reader on every read).

Verifying reads every byte (at memory speed: xxh3-64). A process that reads the same checkpoint
several times (``generate`` classifies it, then loads it) hashes it once: an outcome is reused
while every file keeps its name, size, inode and modification and change times (a write moves
the change time, which no user-space call can set back).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from magistral_cli.errors import CheckFailed
from magistral_cli.run_record import write_json

from .layout import DCP_METADATA, STEP_DIR, latest_name, list_checkpoints

log = logging.getLogger(__name__)

INTEGRITY = "integrity.json"
DIGEST = "xxh3_64"
RECORD_FORMAT = 1
#: The state-dict entry that makes a DCP a training checkpoint (``engine.trainer.Trainer.state_dict``).
STEP_KEY = "step"
#: The option that reads a training checkpoint without its record (the commands' flag).
ALLOW_UNVERIFIED = "--allow-unverified"
_READ_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """The xxh3-64 digest of ``path`` (hex), read in 8 MiB pieces into one buffer.

    Plain reads, not a memory map: a file cut short while it is hashed gives a short read (and a
    digest that differs), never a SIGBUS.
    """
    import xxhash

    digest = xxhash.xxh3_64()
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def describe_file(path: Path) -> dict[str, Any]:
    """``{"size", "xxh3_64"}`` of one file: its entry in ``integrity.json``."""
    return {"size": path.stat().st_size, DIGEST: file_digest(path)}


def write_integrity(checkpoint: Path, files: dict[str, dict[str, Any]], step: int) -> None:
    """Record every file's size and digest (``.metadata`` is described here), then fsync."""
    files = dict(files)
    files[DCP_METADATA] = describe_file(checkpoint / DCP_METADATA)
    record = {
        "format": RECORD_FORMAT,
        "algorithm": DIGEST,
        "step": step,
        "files": dict(sorted(files.items())),
    }
    write_json(checkpoint / INTEGRITY, record, fsync=True, check_failed=False)


# --------------------------------------------------------------------------- the metadata's own claims


def is_training_metadata(metadata: Any) -> bool:
    """Whether a DCP ``Metadata`` is a training checkpoint's (it records the step)."""
    return STEP_KEY in metadata.state_dict_metadata


def is_training_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a DCP written by the trainer (its ``.metadata`` records the step)."""
    if not (Path(path) / DCP_METADATA).is_file():
        return False
    from .safe_dcp import read_metadata

    return is_training_metadata(read_metadata(path, check_files=False))


# --------------------------------------------------------------------------- verification


@dataclass
class Verification:
    """What ``verify_checkpoint`` found in one checkpoint (for one rank's share of its files)."""

    path: Path
    problems: list[str] = field(default_factory=list)
    #: Whether the checkpoint has an integrity record (a conversion has none, and needs none).
    recorded: bool = True
    #: Whether it is a training checkpoint (None where the share did not look).
    training: bool | None = None
    #: A training checkpoint read without its record (``allow_unverified``).
    unverified: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


#: (directory, rank, world size) -> (the files' stat signature, what was found): see the module doc.
_SEEN: dict[tuple[str, int, int], tuple[tuple, Verification]] = {}


def _signature(path: Path) -> tuple:
    entries = []
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                entries.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(sorted(entries))


def _no_record(path: Path) -> str:
    return (
        f"{path} is a training checkpoint ({DCP_METADATA} records a step) without {INTEGRITY}: the record was "
        "removed, or the checkpoint was saved before training wrote records, and nothing tells the two apart, "
        "so its files cannot be checked"
    )


def _inspect(path: Path, rank: int, world_size: int) -> Verification:
    """The findings, before the policy for a missing record is applied (``verify_checkpoint``)."""
    result = Verification(path)
    record_path = path / INTEGRITY
    if not record_path.is_file():
        result.recorded = False
        if rank != 0:
            return result  # the record-level findings are rank 0's share
        if not (path / DCP_METADATA).is_file():
            result.problems.append(f"{path} has no {DCP_METADATA} (an incomplete save)")
            return result
        from .safe_dcp import read_metadata, storage_problems

        metadata = read_metadata(path, check_files=False)  # a planted or foreign file: its UserError
        result.training = is_training_metadata(metadata)
        result.problems += storage_problems(path, metadata)
        return result
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        files = dict(record["files"])
        if record.get("algorithm") != DIGEST:
            raise ValueError(f"algorithm {record.get('algorithm')!r}")
        if not all(isinstance(want, dict) for want in files.values()):
            raise ValueError("a file entry is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if rank == 0:
            result.problems.append(f"{record_path} is unreadable ({exc})")
        return result
    result.training = True
    match = STEP_DIR.fullmatch(path.name)
    if rank == 0 and match and record.get("step") != int(match.group(1)):
        result.problems.append(
            f"{record_path} records step {record.get('step')}, but the directory is {path.name} "
            "(a record or files moved between checkpoints)"
        )
    for i, (name, want) in enumerate(sorted(files.items())):
        if i % world_size != rank:
            continue
        file = path / name
        if not file.is_file():
            result.problems.append(f"{file} is missing ({INTEGRITY} records {want.get('size')} bytes)")
            continue
        size = file.stat().st_size
        if size != want.get("size"):
            result.problems.append(f"{file} has {size} bytes, {want.get('size')} were written")
        elif file_digest(file) != want.get(DIGEST):
            result.problems.append(
                f"{file} does not match its {DIGEST} checksum in {INTEGRITY} (same size, other bytes: "
                "changed after the save)"
            )
    return result


def verify_checkpoint(
    path: Path, rank: int = 0, world_size: int = 1, allow_unverified: bool = False
) -> Verification:
    """Check the checkpoint ``path`` against its ``integrity.json``; the one check of every reader.

    File ``i`` of the record is this rank's share when ``i % world_size == rank`` (the trainer's
    ranks each call it and combine the findings, so the files are read once, in parallel); the
    record itself and a missing record are rank 0's share. Without a record: a conversion passes
    (its data files must still hold what its ``.metadata`` places in them); a training checkpoint
    is a problem unless ``allow_unverified``.
    """
    path = Path(path)
    if not path.is_dir():
        return Verification(path, [f"{path} does not exist"])
    key = (str(path.resolve()), rank, world_size)
    signature = _signature(path)
    seen = _SEEN.get(key)
    if seen is not None and seen[0] == signature:
        result = replace(seen[1], problems=list(seen[1].problems))
    else:
        result = _inspect(path, rank, world_size)
        _SEEN[key] = (signature, replace(result, problems=list(result.problems)))
    if not result.recorded and result.training and not result.problems:
        if allow_unverified:
            result.unverified = True
        else:
            result.problems.append(_no_record(path))
    return result


def require_intact(path: Path, allow_unverified: bool = False) -> Path:
    """``path`` when ``verify_checkpoint`` finds nothing wrong; else ``CheckFailed`` naming every problem."""
    result = verify_checkpoint(path, allow_unverified=allow_unverified)
    if not result.ok:
        raise CheckFailed(f"{path} was not read: " + "; ".join(result.problems[:5]) + ". " + fix_for(result))
    if result.unverified:
        log.warning("%s has no %s: read without verification (%s)", path, INTEGRITY, ALLOW_UNVERIFIED)
    return path


def fix_for(result: Verification) -> str:
    """What to do about a checkpoint ``verify_checkpoint`` found problems in (one sentence or two)."""
    if not result.recorded and result.training:
        return (
            f"If you trust its files (a save from before integrity records), pass {ALLOW_UNVERIFIED} to read it "
            "anyway; training resumes and loads only verified checkpoints"
        )
    return (
        "Use an intact checkpoint: an earlier checkpoints/step_N, or the run's checkpoints/ directory (its newest "
        "intact checkpoint is taken)"
    )


# --------------------------------------------------------------------------- choosing among checkpoints


@dataclass
class Choice:
    """The newest intact checkpoint of a directory (or None), and what was passed over on the way."""

    path: Path | None
    skipped: list[str] = field(default_factory=list)
    unverified: bool = False


def choose_intact(save_dir: Path, verify: Callable[[Path], Verification] = verify_checkpoint) -> Choice:
    """The newest ``step_<N>`` of ``save_dir`` that ``verify`` passes, newest first; never raises.

    ``verify(path)`` returns the ``Verification`` of one checkpoint (the trainer passes one that
    splits the files over its ranks and combines their findings).
    """
    choice = Choice(None)
    for _, path in list_checkpoints(save_dir):
        result = verify(path)
        if result.ok:
            choice.path, choice.unverified = path, result.unverified
            break
        choice.skipped.append(f"{path.name}: " + "; ".join(result.problems[:3]))
    return choice


def latest_disagreement(save_dir: Path, chosen: Path) -> str | None:
    """Why ``save_dir/latest`` does not name ``chosen`` (missing, unusable, another step), or None."""
    name, problem = latest_name(save_dir)
    if problem:
        return problem
    if name != chosen.name:
        return f"{save_dir / 'latest'} names {name}"
    return None


def newest_intact(save_dir: Path, allow_unverified: bool = False, what: str = "checkpoint") -> Path:
    """The newest intact ``step_<N>`` of ``save_dir`` for a reader, with a warning for each newer
    one passed over; ``CheckFailed`` listing them all when none is intact."""

    def verify(path: Path) -> Verification:
        return verify_checkpoint(path, allow_unverified=allow_unverified)

    choice = choose_intact(save_dir, verify)
    if choice.path is None:
        raise CheckFailed(
            f"{save_dir} holds checkpoints but none is complete and intact:\n  "
            + "\n  ".join(choice.skipped)
            + "\n  fix: restore them, or use another run's checkpoint; "
            f"{ALLOW_UNVERIFIED} reads a save from before integrity records whose files you trust"
        )
    for skipped in choice.skipped:
        log.warning("%s: skipped %s", what, skipped)
    note = latest_disagreement(save_dir, choice.path)
    if choice.skipped or note:
        log.warning(
            "%s: %staking %s, the newest intact checkpoint",
            what,
            f"{note}; " if note else "",
            choice.path.name,
        )
    if choice.unverified:
        log.warning("%s has no %s: read without verification (%s)", choice.path, INTEGRITY, ALLOW_UNVERIFIED)
    return choice.path


__all__ = [
    "ALLOW_UNVERIFIED",
    "DIGEST",
    "INTEGRITY",
    "Choice",
    "Verification",
    "choose_intact",
    "describe_file",
    "file_digest",
    "fix_for",
    "is_training_checkpoint",
    "is_training_metadata",
    "latest_disagreement",
    "newest_intact",
    "require_intact",
    "verify_checkpoint",
    "write_integrity",
]
