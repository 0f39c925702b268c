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

Integrity: before the rename, every rank hashes the files it wrote (xxh3-64, at memory speed:
a 24B checkpoint with optimizer state is about 290 GB, and SHA-256 would add minutes) and rank 0
records every file's size and digest in ``integrity.json``. Resume does not trust ``latest``: it
takes the newest ``step_<N>`` whose files all match their record (the ranks verify the files in
parallel), warns about each newer one it skipped and why, and refuses to start fresh over a save
directory that holds checkpoints (see ``choose_resume``). The record, its check and the choice of
the newest intact checkpoint are ``checkpoint.integrity``'s, shared with every other reader
(export, generate, validate); a checkpoint without a record is not resumed from.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

# The directory layout (step_<N>, latest, .metadata) and the integrity record and its check are
# checkpoint/'s; re-exported for the trainer.
from magistral_cli.checkpoint.integrity import DIGEST as DIGEST
from magistral_cli.checkpoint.integrity import INTEGRITY as INTEGRITY
from magistral_cli.checkpoint.integrity import Choice, choose_intact, describe_file, write_integrity
from magistral_cli.checkpoint.integrity import Verification as Verification
from magistral_cli.checkpoint.integrity import file_digest as file_digest
from magistral_cli.checkpoint.integrity import is_training_checkpoint as is_training_checkpoint
from magistral_cli.checkpoint.integrity import verify_checkpoint as verify_checkpoint
from magistral_cli.checkpoint.layout import LATEST, list_checkpoints, step_dir_name
from magistral_cli.checkpoint.layout import checkpoints_dir as checkpoints_dir
from magistral_cli.checkpoint.layout import latest_name as latest_name
from magistral_cli.checkpoint.packed import checkpoint_sizes as checkpoint_sizes
from magistral_cli.checkpoint.packed import pack as pack
from magistral_cli.checkpoint.packed import unpack as unpack

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp_step_"
#: This process's timings of its last save (seconds): DCP write, integrity hashing, commit.
LAST_SAVE: dict[str, float] = {}
#: Fault injection for the crash-safety test: ``kill-during-save:<step>[:<rank>]`` SIGKILLs that
#: rank after its shards of that step's checkpoint are written, before the checkpoint is committed.
FAULT_ENV = "MAGISTRAL_FAULT_INJECT"
#: What resume chose (``checkpoint.integrity.Choice``: path, skipped, unverified).
ResumeChoice = Choice


def resolve_save_dir(save: str | None, run_dir: Path) -> Path | None:
    """Where checkpoints go: ``training.save`` (a relative path is inside the run directory), or None.

    As in the seed, a run writes checkpoints only when ``training.save`` is set.
    """
    if not save:
        return None
    path = Path(save)
    return path if path.is_absolute() else Path(run_dir) / path


def rank_files(checkpoint: Path, rank: int) -> list[Path]:
    """The data files DCP's file-system writer wrote for ``rank`` (``__<rank>_<i>.distcp``)."""
    return sorted(checkpoint.glob(f"__{rank}_*.distcp"))


def choose_resume(save_dir: Path, verify=verify_checkpoint) -> Choice:
    """The newest complete and intact ``step_<N>`` in ``save_dir`` (``checkpoint.integrity.choose_intact``).

    ``verify(path)`` returns the ``Verification`` of one checkpoint (the trainer passes one that
    splits the files over the ranks and combines their findings). Raises ``CheckFailed`` when
    the directory holds checkpoints and none is intact: a fresh start would overwrite them.
    """
    from magistral_cli.errors import CheckFailed

    choice = choose_intact(save_dir, verify)
    if choice.path is None and choice.skipped:
        raise CheckFailed(
            f"{save_dir} holds checkpoints but none is complete and intact, so the run can neither resume nor "
            "start fresh over them:\n  "
            + "\n  ".join(choice.skipped)
            + "\n  fix: point training.load at a good "
            "checkpoint with a new training.output_dir, or move the broken checkpoints away"
        )
    return choice


def refuse_fresh_start(save_dir: Path) -> None:
    """``training.resume=never`` over a save directory that holds checkpoints: a UserError (exit 2)."""
    from magistral_cli.errors import UserError

    existing = list_checkpoints(save_dir)
    if existing:
        raise UserError(
            f"training.resume=never, but {save_dir} holds checkpoints "
            f"({', '.join(p.name for _, p in existing[:5])}); a fresh start would overwrite them. "
            "Use a new training.output_dir (or training.save), or training.resume=auto to continue"
        )


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


def _reason(exc: BaseException) -> str:
    """The underlying cause of a failed save in one line (DCP wraps each rank's error)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure
        text = getattr(inner, "strerror", None) or str(inner)
        return f"rank {rank}: {type(inner).__name__}: {text}"
    return f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"


def _commit(tmp: Path, final: Path, save_dir: Path, files: dict, step: int) -> None:
    """Rank 0: record the integrity, rename the checkpoint into place, then point ``latest`` at it."""
    write_integrity(tmp, files, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    pointer_tmp = save_dir / f".{LATEST}.tmp"
    try:
        pointer_tmp.write_text(final.name + "\n", encoding="utf-8")
        with open(pointer_tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(pointer_tmp, save_dir / LATEST)
    finally:
        pointer_tmp.unlink(missing_ok=True)
    _fsync_dir(save_dir)


def save_checkpoint(state: dict[str, Any], save_dir: Path, step: int) -> Path:
    """Write ``state`` (collective: every rank calls it) and commit it as ``step_<step>``.

    Any failure (a full disk, a read-only one) on any rank ends the same way on every rank: the
    partial ``.tmp_step_<N>`` is removed, nothing is committed, and ``CheckFailed`` names the cause.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from magistral_cli.errors import CheckFailed

    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = save_dir / f"{TMP_PREFIX}{step}"
    final = save_dir / step_dir_name(step)
    problem = None
    if rank == 0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            problem = _reason(exc)
    dist.barrier()
    mine = None
    started = time.perf_counter()
    hashed = started
    try:
        dcp.save(state, checkpoint_id=str(tmp))  # raises on every rank when any rank fails
        _maybe_inject_fault(step)
        written = time.perf_counter()
        # Every rank hashes the files it wrote, in parallel; rank 0 records them all.
        mine = {p.name: describe_file(p) for p in rank_files(tmp, rank)}
        hashed = time.perf_counter()
        LAST_SAVE.update(write_s=written - started, hash_s=hashed - written)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        problem = problem or _reason(exc)
    everyone: list[tuple[str | None, dict | None] | None] = [None] * world
    dist.all_gather_object(everyone, (problem, mine))
    problems = [part[0] for part in everyone if part and part[0]]
    outcome: list[str | None] = [None]
    if rank == 0 and not problems:
        try:
            _commit(
                tmp, final, save_dir, {k: v for part in everyone for k, v in (part[1] or {}).items()}, step
            )
        except OSError as exc:
            outcome[0] = _reason(exc)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        problems.append(outcome[0])
    if problems:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        raise CheckFailed(
            f"saving checkpoint {final.name} in {save_dir} failed ({problems[0]}); the partial save was removed "
            f"and {LATEST} still names the previous checkpoint. Free space there (or point training.save at "
            "another disk) and launch again: the run resumes from its last good checkpoint"
        )
    dist.barrier()
    LAST_SAVE["commit_s"] = time.perf_counter() - hashed
    return final
