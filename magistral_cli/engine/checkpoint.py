"""Training checkpoints: DCP directories ``checkpoints/step_<N>/`` and the ``checkpoints/latest`` pointer.

The state dict is ``{"model": {transformers keys}, "optimizer": {"state": ...}, "scheduler": ...,
"rng": {"rank_<r>": ...}, "dataloader": {"dp_rank_<r>": ...}, "step": N}``, so the flattened model
keys are ``model.<transformers key>`` (what ``magistral convert`` and ``engine.weights`` read).

Every value is a tensor. Non-tensor state (RNG tuples, the data loader's state) is serialised
with ``torch.save`` into a uint8 tensor and read back with ``torch.load(weights_only=True)``:
DCP would otherwise pickle it and unpickle it with ``weights_only=False``.

Crash safety: a checkpoint is written to ``.tmp_step_<N>``, renamed to ``step_<N>`` when every
rank has finished, and only then does ``latest`` (replaced atomically) name it. A crash at any
point leaves ``latest`` on the previous complete checkpoint.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

LATEST = "latest"
TMP_PREFIX = ".tmp_step_"
#: Fault injection for the crash-safety test: ``kill-during-save:<step>[:<rank>]`` SIGKILLs that
#: rank after its shards of that step's checkpoint are written, before the checkpoint is committed.
FAULT_ENV = "MAGISTRAL_FAULT_INJECT"


def pack(obj: Any) -> torch.Tensor:
    """``obj`` (tensors, numbers, strings, lists, tuples, dicts) as a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(tensor: torch.Tensor) -> Any:
    try:
        return torch.load(io.BytesIO(tensor.cpu().numpy().tobytes()), weights_only=True)
    except Exception as exc:  # an object weights_only refuses: say what, not a pickle traceback
        raise ValueError(
            f"a checkpoint entry holds an object torch.load(weights_only=True) refuses ({exc}); "
            "state saved in checkpoints must be tensors, numbers, strings and containers of them"
        ) from None


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def read_latest(save_dir: Path) -> Path | None:
    """The checkpoint ``save_dir/latest`` names, or None (no pointer, or it names a missing directory)."""
    pointer = save_dir / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    target = save_dir / name
    if not (target / ".metadata").is_file():
        log.warning("%s names %s, which is not a complete checkpoint; ignoring it", pointer, target)
        return None
    return target


def resolve_checkpoint(path: Path) -> Path | None:
    """A training checkpoint directory from ``path``: a ``step_<N>`` dir, a checkpoints dir or a run dir."""
    for candidate in (path, path / "checkpoints"):
        latest = read_latest(candidate)
        if latest is not None:
            return latest
    return None


def is_training_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a DCP written by this trainer (it records the step)."""
    if not (path / ".metadata").is_file():
        return False
    from torch.distributed.checkpoint import FileSystemReader

    return "step" in FileSystemReader(str(path)).read_metadata().state_dict_metadata


def remove_stale_temporaries(save_dir: Path) -> list[Path]:
    """Delete ``.tmp_step_*`` left by a crashed save (rank 0, before training)."""
    removed = []
    if save_dir.is_dir():
        for tmp in save_dir.glob(TMP_PREFIX + "*"):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _maybe_inject_fault(step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec.startswith("kill-during-save:"):
        return
    parts = spec.split(":")[1:]
    rank = int(parts[1]) if len(parts) > 1 else 0
    if int(parts[0]) == step and dist.get_rank() == rank:
        log.error("fault injection: killing rank %d during the save of step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(state: dict[str, Any], save_dir: Path, step: int) -> Path:
    """Write ``state`` (collective: every rank calls it) and commit it as ``step_<step>``."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    tmp = save_dir / f"{TMP_PREFIX}{step}"
    final = save_dir / step_dir_name(step)
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    _maybe_inject_fault(step)
    # dcp.save returns on every rank after rank 0 wrote .metadata; the barrier makes sure no rank
    # is still flushing when the directory is renamed.
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(save_dir)
        pointer_tmp = save_dir / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name + "\n", encoding="utf-8")
        with open(pointer_tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(pointer_tmp, save_dir / LATEST)
        _fsync_dir(save_dir)
    dist.barrier()
    return final


def checkpoint_sizes(path: Path, keys: list[str]) -> dict[str, torch.Size]:
    """Sizes of the tensors ``keys`` in a DCP (packed entries have a size only known from the file)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: metadata[k].size for k in keys if isinstance(metadata.get(k), TensorStorageMetadata)}
