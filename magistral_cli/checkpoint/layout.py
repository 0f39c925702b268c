"""Where things sit in a DCP checkpoint directory, in one place (the file names; the key layouts
inside the checkpoint are in ``keys``, a Hugging Face model directory's files in ``hf``).

- ``<dir>/.metadata``: the torch.distributed.checkpoint metadata (a directory with one is a DCP).
- ``<dir>/release/``: where a megatron-layout conversion keeps its DCP (Megatron's "release"
  iteration), next to Megatron's tracker file ``latest_checkpointed_iteration.txt``.
- ``<save dir>/step_<N>/``: a training checkpoint, and ``<save dir>/latest``: a file that holds
  the name of the newest committed one (a hint: resume decides from the directories).

This module imports nothing heavy: the trainer, the launcher and the converters all read it.
"""

from __future__ import annotations

import re
from pathlib import Path

#: PEFT's adapter files (``convert dcp-to-hf --lora adapters`` writes them, ``generate --adapter`` reads them)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

#: The DCP metadata file of a checkpoint directory.
DCP_METADATA = ".metadata"
#: Sub-directory that holds a megatron-layout DCP (Megatron's "release" iteration).
MEGATRON_RELEASE_DIR = "release"
#: Megatron's tracker file: names the iteration directory to load ("release" for converted weights).
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
#: The file in a save directory that names its newest committed ``step_<N>``.
LATEST = "latest"
#: The name of a training checkpoint directory.
STEP_DIR = re.compile(r"step_(\d+)")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def is_dcp_dir(path: Path) -> bool:
    """Whether ``path`` holds a DCP checkpoint (its ``.metadata``)."""
    return (Path(path) / DCP_METADATA).is_file()


def latest_name(save_dir: Path) -> tuple[str | None, str | None]:
    """(the ``step_<N>`` name ``save_dir/latest`` holds, or None; why it was not usable, or None).

    ``latest`` is a hint for people and other tools; resume decides from the directories. A name
    that is not ``step_<N>`` (a path, ``..``, garbage bytes) is never followed.
    """
    pointer = save_dir / LATEST
    if not pointer.is_file():
        return None, f"{pointer} does not exist" if save_dir.is_dir() else None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{pointer} is unreadable ({exc.__class__.__name__})"
    if not STEP_DIR.fullmatch(name):
        return None, f"{pointer} holds {name[:80]!r}, not a step_<N> name in {save_dir}; it is not followed"
    return name, None


def list_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` directory in ``save_dir``, newest first (complete or not)."""
    if not save_dir.is_dir():
        return []
    found = []
    for entry in save_dir.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def checkpoints_dir(path: Path) -> Path | None:
    """The directory of ``step_<N>`` checkpoints that ``path`` names: itself, or a run's ``checkpoints/``."""
    for candidate in (Path(path), Path(path) / "checkpoints"):
        if list_checkpoints(candidate):
            return candidate
    return None
