"""``run_identity.json``: what exactly a run was made of (DESIGN.md, "Run directory").

Asset sums are read from the model directory's ``magistral-manifest.json`` (written by
``magistral fetch``) rather than recomputed: a 48 GB model is not rehashed at every launch.
The dataset file is hashed, streamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from magistral_cli import __version__
from magistral_cli.errors import CheckFailed, UserError

MANIFEST_NAME = "magistral-manifest.json"
IDENTITY_NAME = "run_identity.json"

#: Environment variables worth recording (prefixes and exact names).
_ENV_PREFIXES = (
    "HCCL_",
    "NCCL_",
    "PYTORCH_",
    "TORCH_",
    "ASCEND_",
    "CUDA_",
    "MULTI_STREAM",
    "TASK_QUEUE",
    "CPU_AFFINITY",
)
_ENV_NAMES = (
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "TRITON_INTERPRET",
)
#: Never recorded, whatever their prefix: credentials.
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY", re.IGNORECASE)

_VERSIONED = ("torch", "torch_npu", "transformers", "triton", "triton-ascend", "torchdata", "mistral_common")


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    """SHA-256 of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def package_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata (nothing is imported)."""
    out: dict[str, str | None] = {"python": platform.python_version(), "magistral-cli": __version__}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def source_git_sha() -> dict[str, Any]:
    """The git commit of the source tree this package runs from, when it is a checkout."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return {"sha": None, "dirty": None}
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha or None, "dirty": bool(dirty)}


def relevant_environment(env: dict[str, str]) -> dict[str, str]:
    """The launch-relevant variables of ``env``, credentials excluded."""
    out = {}
    for key in sorted(env):
        if _SECRET.search(key):
            continue
        if key.startswith(_ENV_PREFIXES) or key in _ENV_NAMES:
            out[key] = env[key]
    return out


def read_asset_sums(model_dir: str | Path | None) -> dict[str, Any]:
    """``{"manifest": path, "files": {name: sha256}}`` from a fetched model directory, if any."""
    if not model_dir:
        return {"manifest": None, "files": {}}
    manifest = Path(model_dir) / MANIFEST_NAME
    if not manifest.is_file():
        return {"manifest": None, "files": {}}
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files = {entry["name"]: entry.get("sha256") for entry in data.get("files", [])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"manifest": str(manifest), "files": {}, "error": "unreadable manifest"}
    return {"manifest": str(manifest), "files": files}


def build_identity(
    *,
    recipe_path: Path,
    dataset: str | None,
    model_dir: str | None,
    device: str,
    world_size: int,
    nnodes: int,
    nproc_per_node: int,
    env: dict[str, str],
) -> dict[str, Any]:
    """Everything ``run_identity.json`` records."""
    dataset_entry: dict[str, Any] = {"path": dataset, "sha256": None}
    if dataset and Path(dataset).is_file():
        dataset_entry["sha256"] = sha256_file(dataset)
    elif dataset:
        dataset_entry["missing"] = True
    return {
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "source": source_git_sha(),
        "package_version": __version__,
        "recipe": {"path": str(recipe_path), "sha256": sha256_file(recipe_path)},
        "dataset": dataset_entry,
        "assets": read_asset_sums(model_dir),
        "versions": package_versions(),
        "device": device,
        "world_size": world_size,
        "nnodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "environment": relevant_environment(env),
    }


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
