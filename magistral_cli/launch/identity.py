"""``run_identity.json``: what exactly a run was made of (DESIGN.md, "Run directory").

Asset sums are read from the model directory's ``magistral-manifest.json`` (written by
``magistral fetch``) rather than recomputed: a 48 GB model is not rehashed at every launch.
The dataset file is hashed, streamed.
"""

from __future__ import annotations

import json
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
from magistral_cli.assets.hashing import sha256_file
from magistral_cli.assets.manifest import MANIFEST_NAME
from magistral_cli.run_record import IDENTITY_NAME, record_resolved, write_json

# IDENTITY_NAME, write_json and record_resolved live in the root module run_record (the
# engine records into the identity too); they stay importable from here.

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
        dataset_entry["sha256"] = sha256_file(dataset)[0]
    elif dataset:
        dataset_entry["missing"] = True
    return {
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "source": source_git_sha(),
        "package_version": __version__,
        "recipe": {"path": str(recipe_path), "sha256": sha256_file(recipe_path)[0]},
        "dataset": dataset_entry,
        "assets": read_asset_sums(model_dir),
        "versions": package_versions(),
        "device": device,
        "world_size": world_size,
        "nnodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "environment": relevant_environment(env),
    }


__all__ = [
    "IDENTITY_NAME",
    "MANIFEST_NAME",
    "build_identity",
    "package_versions",
    "read_asset_sums",
    "record_resolved",
    "relevant_environment",
    "source_git_sha",
    "write_json",
]
