"""Asset lock files: which repositories, revisions and files make up a model, with their sums.

A lock pins every repository to a full commit hash and lists the files to fetch from it with
their SHA-256 and size. Weight shards may be listed by pattern instead (``weights``): the seed
records no sums for Magistral's shards, so their names come from the safetensors index (itself
pinned by SHA-256) and their sums are recorded in the model directory's manifest at first
download (see :mod:`magistral_cli.assets.fetch`).

Format (``format: 1``)::

    {
      "format": 1,
      "model": "mistralai/Magistral-Small-2509",
      "files": [
        {"name": "config.json", "repo": "...", "revision": "<40 hex>", "sha256": "<64 hex>",
         "bytes": 1166, "source": "official"},
        ...
      ],
      "weights": {"repo": "...", "revision": "<40 hex>", "index": "model.safetensors.index.json",
                  "pattern": "model-*.safetensors", "sha256": null, "note": "..."},
      "native": {"repo": "...", "revision": "<40 hex>",
                 "files": ["params.json", "consolidated.safetensors"], "note": "..."}
    }

``native`` (optional) lists Mistral's own layout's files, fetched only when asked for
(``magistral fetch --native``): pinned by revision like the shards, each checked at first download
against the SHA-256 the Hub serves as an LFS file's ETag, and recorded in the manifest.

``source`` is ``official`` (the model's own repository) or the name of a third-party source
(``unsloth``) whose files are fetched only when asked for (``--tokenizer-source unsloth``).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from magistral_cli.errors import UserError

LOCK_FORMAT = 1
OFFICIAL_SOURCE = "official"
#: Tokenizer sources `magistral fetch --tokenizer-source` accepts.
TOKENIZER_SOURCES = ("official", "unsloth")
#: The lock shipped with the package (a copy of recipes/magistral-small-2509/assets.lock.json).
PACKAGED_LOCK = "magistral-small-2509.assets.lock.json"

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class LockedFile:
    """One file to fetch: ``name`` is its path both in the repository and under the model directory."""

    name: str
    repo: str
    revision: str
    sha256: str | None
    bytes: int | None
    source: str = OFFICIAL_SOURCE


@dataclass(frozen=True)
class WeightsSpec:
    """Weight shards pinned by revision; the names come from ``index``'s ``weight_map``."""

    repo: str
    revision: str
    index: str
    pattern: str
    note: str = ""

    def shard_files(self, index_path: Path) -> list[LockedFile]:
        """The shards that ``index_path`` (a safetensors index) names, each checked to be safe."""
        try:
            data = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(
                f"{index_path} is not a safetensors index with a weight_map ({exc}); "
                "remove it and run `magistral fetch` again"
            ) from exc
        if not names:
            raise UserError(f"{index_path} names no weight shards")
        files = []
        for name in names:
            if not isinstance(name, str):
                raise UserError(f"{index_path}: shard name {name!r} is not a string")
            check_relative_name(name, f"shard named in {index_path.name}")
            if not fnmatch.fnmatchcase(name, self.pattern):
                raise UserError(
                    f"{index_path.name} names shard {name!r}, which does not match the lock's pattern "
                    f"{self.pattern!r}; the lock and the index disagree about the weight files"
                )
            files.append(LockedFile(name, self.repo, self.revision, None, None, OFFICIAL_SOURCE))
        return files


@dataclass(frozen=True)
class NativeSpec:
    """Mistral's native layout's files (``params.json``, ``consolidated.safetensors``), pinned by revision."""

    repo: str
    revision: str
    names: tuple[str, ...]
    note: str = ""

    def locked_files(self) -> list[LockedFile]:
        return [
            LockedFile(name, self.repo, self.revision, None, None, OFFICIAL_SOURCE) for name in self.names
        ]


@dataclass(frozen=True)
class AssetLock:
    """A parsed, validated lock file."""

    path: Path
    model: str
    files: tuple[LockedFile, ...]
    weights: WeightsSpec | None
    extra: dict[str, Any] = field(default_factory=dict)
    native: NativeSpec | None = None

    def select(self, tokenizer_source: str = OFFICIAL_SOURCE) -> list[LockedFile]:
        """The listed files for a tokenizer source: ``official`` takes only the official repository's
        files, any other source adds its own files to those."""
        if tokenizer_source not in TOKENIZER_SOURCES:
            raise UserError(
                f"unknown tokenizer source {tokenizer_source!r}: use one of {', '.join(TOKENIZER_SOURCES)}"
            )
        wanted = {OFFICIAL_SOURCE, tokenizer_source}
        return [f for f in self.files if f.source in wanted]


def check_relative_name(name: str, what: str = "file name") -> str:
    """Refuse names that would land outside the model directory (absolute, ``..``, backslashes)."""
    if not isinstance(name, str) or not name:
        raise UserError(f"{what}: empty or non-string name {name!r}")
    pure = PurePosixPath(name)
    bad = (
        name.startswith(("/", "~"))
        or "\\" in name
        or "\x00" in name
        or re.match(r"[A-Za-z]:", name) is not None
        or any(part in ("..", ".", "") for part in name.split("/"))
        or pure.is_absolute()
    )
    if bad:
        raise UserError(
            f"{what} {name!r} would escape the model directory: names must be relative paths "
            "without '..', '.', empty parts, backslashes or a leading '/'; fix the lock file"
        )
    return name


def default_lock_path() -> Path:
    """The lock shipped inside the package (works from a source checkout and an installed wheel)."""
    ref = resources.files("magistral_cli.assets").joinpath("locks", PACKAGED_LOCK)
    return Path(str(ref))


def _req(obj: dict, key: str, where: str) -> Any:
    if key not in obj:
        raise UserError(f"{where}: missing key {key!r}")
    return obj[key]


def _check_repo_revision(repo: Any, revision: Any, where: str) -> None:
    if not isinstance(repo, str) or not _REPO_ID.fullmatch(repo) or ".." in repo:
        raise UserError(f"{where}: repo {repo!r} is not a Hub repository id like 'owner/name'")
    if not isinstance(revision, str) or not _COMMIT.fullmatch(revision):
        raise UserError(
            f"{where}: revision {revision!r} is not a full 40-character commit hash; a lock pins "
            "commits, not branches or tags"
        )


def load_lock(path: str | Path | None = None) -> AssetLock:
    """Read and validate a lock file (``None``: the packaged Magistral-Small-2509 lock)."""
    lock_path = Path(path) if path is not None else default_lock_path()
    try:
        data = json.loads(lock_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"lock file {lock_path} does not exist; pass an existing --lock FILE") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"lock file {lock_path} is not readable JSON: {exc}") from exc
    where = f"lock file {lock_path}"
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object")
    if data.get("format") != LOCK_FORMAT:
        raise UserError(f"{where}: format {data.get('format')!r} is not supported (expected {LOCK_FORMAT})")
    raw_files = _req(data, "files", where)
    if not isinstance(raw_files, list) or not raw_files:
        raise UserError(f"{where}: 'files' must be a non-empty list")

    files: list[LockedFile] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_files):
        w = f"{where}, files[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{w}: expected an object")
        unknown = set(raw) - {"name", "repo", "revision", "sha256", "bytes", "source", "note"}
        if unknown:
            raise UserError(f"{w}: unknown keys {sorted(unknown)}")
        name = check_relative_name(_req(raw, "name", w), f"{w}: name")
        if name in seen:
            raise UserError(f"{w}: {name!r} is listed twice")
        seen.add(name)
        repo, revision = _req(raw, "repo", w), _req(raw, "revision", w)
        _check_repo_revision(repo, revision, w)
        sha = _req(raw, "sha256", w)
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise UserError(f"{w}: sha256 {sha!r} is not 64 lowercase hex digits")
        size = _req(raw, "bytes", w)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UserError(f"{w}: bytes {size!r} is not a non-negative integer")
        source = raw.get("source", OFFICIAL_SOURCE)
        if source not in TOKENIZER_SOURCES:
            raise UserError(f"{w}: source {source!r} is not one of {', '.join(TOKENIZER_SOURCES)}")
        files.append(LockedFile(name, repo, revision, sha, size, source))

    weights = None
    raw_w = data.get("weights")
    if raw_w is not None:
        w = f"{where}, weights"
        if not isinstance(raw_w, dict):
            raise UserError(f"{w}: expected an object")
        repo, revision = _req(raw_w, "repo", w), _req(raw_w, "revision", w)
        _check_repo_revision(repo, revision, w)
        index = check_relative_name(_req(raw_w, "index", w), f"{w}: index")
        pattern = _req(raw_w, "pattern", w)
        if not isinstance(pattern, str) or not pattern:
            raise UserError(f"{w}: pattern must be a non-empty glob like 'model-*.safetensors'")
        check_relative_name(pattern, f"{w}: pattern")
        if raw_w.get("sha256") is not None:
            raise UserError(f"{w}: per-shard sums go in 'files'; the weights entry must have sha256 null")
        index_entry = next((f for f in files if f.name == index), None)
        if index_entry is None or (index_entry.repo, index_entry.revision) != (repo, revision):
            raise UserError(
                f"{w}: the index {index!r} must also be listed in 'files' (with its sha256) at the same "
                "repo and revision, so that the list of shards is itself verified"
            )
        weights = WeightsSpec(repo, revision, index, pattern, str(raw_w.get("note", "")))

    native = _native_spec(data.get("native"), f"{where}, native", seen)
    model = data.get("model") or (weights.repo if weights else files[0].repo)
    extra = {k: v for k, v in data.items() if k not in ("format", "files", "weights", "model", "native")}
    return AssetLock(lock_path, str(model), tuple(files), weights, extra, native)


def _native_spec(raw: Any, where: str, listed: set[str]) -> NativeSpec | None:
    """The lock's optional ``native`` entry (None when absent), every name checked."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected an object")
    unknown = set(raw) - {"repo", "revision", "files", "note"}
    if unknown:
        raise UserError(f"{where}: unknown keys {sorted(unknown)}")
    repo, revision = _req(raw, "repo", where), _req(raw, "revision", where)
    _check_repo_revision(repo, revision, where)
    names = _req(raw, "files", where)
    if not isinstance(names, list) or not names:
        raise UserError(f"{where}: 'files' must be a non-empty list of file names")
    for name in names:
        check_relative_name(name, f"{where}: file name")
        if name in listed or names.count(name) > 1:
            raise UserError(f"{where}: {name!r} is listed twice (each file belongs to one entry)")
    return NativeSpec(repo, revision, tuple(names), str(raw.get("note", "")))
