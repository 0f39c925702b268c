"""``DIR/magistral-manifest.json``: the sums of the files `magistral fetch` verified in a model directory.

Format (``format: 1``)::

    {"format": 1,
     "files": [{"name": "config.json", "repo": "mistralai/Magistral-Small-2509",
                "revision": "<commit>", "sha256": "<hex>", "bytes": 1166,
                "verified_at": "2026-12-02T10:47:05Z"}, ...]}

For files the lock gives a sum for, the entry repeats it. For weight shards (no sum in the
lock) the entry is the record made at first download, and later runs verify against it. The
file is replaced atomically (written next to it, fsynced, renamed), so a reader never sees half
a manifest. ``magistral_cli.launch.identity`` reads it for ``run_identity.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from magistral_cli.errors import UserError
from magistral_cli.run_record import write_json

MANIFEST_NAME = "magistral-manifest.json"
MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    repo: str
    revision: str
    sha256: str
    bytes: int
    verified_at: str


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def manifest_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / MANIFEST_NAME


def read_manifest(model_dir: str | Path) -> dict[str, ManifestEntry]:
    """The manifest's entries by name; ``{}`` when there is none yet."""
    path = manifest_path(model_dir)
    if not path.is_file():
        return {}
    fix = f"move {path} aside and run `magistral fetch` again to rebuild it"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is not readable JSON ({exc}); {fix}") from exc
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise UserError(f"{path} is not a format-{MANIFEST_FORMAT} magistral manifest; {fix}")
    entries: dict[str, ManifestEntry] = {}
    for i, raw in enumerate(data.get("files", [])):
        try:
            entry = ManifestEntry(
                name=str(raw["name"]),
                repo=str(raw["repo"]),
                revision=str(raw["revision"]),
                sha256=str(raw["sha256"]),
                bytes=int(raw["bytes"]),
                verified_at=str(raw["verified_at"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path}: files[{i}] is malformed ({exc}); {fix}") from exc
        entries[entry.name] = entry
    return entries


def write_manifest(model_dir: str | Path, entries: dict[str, ManifestEntry]) -> Path:
    """Replace the manifest atomically with ``entries`` (sorted by name)."""
    path = manifest_path(model_dir)
    payload = {
        "format": MANIFEST_FORMAT,
        "files": [asdict(entries[name]) for name in sorted(entries)],
    }
    write_json(path, payload, fsync=True, check_failed=False)
    return path
