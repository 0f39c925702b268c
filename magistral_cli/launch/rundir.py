"""What a launch may write, and where: decided by the launcher before anything is written.

One rule for each place a launch writes (DESIGN.md, "Run directory"):

- **The run directory** (``training.output_dir``) is new, empty, a magistral run directory (it
  holds ``run_identity.json``), or a directory that holds nothing but the checkpoint directory this
  run resumes (a run seeded with a copied checkpoint). Any other directory of the user's is
  refused: a run writes ``summary.json``, ``resolved_config.yaml``... there. No file the launch
  reads (the recipe, the dataset, ``training.load``) may be one the launch writes.
- **A checkpoint directory** (``training.save``) belongs to one run. The first launch that writes
  it records its run id there (``run_lock.SaveDirClaim``); without a record, the run directory
  that contains it, or this run's own previous launch that saved there, is its owner. Another
  run's is refused unless shared on purpose (``--share-checkpoints``).
- **Checkpoints the run directory holds are never passed over in silence**: a launch that would
  not resume them (``training.save`` unset, or another directory) is refused.
- **A resume under a changed set-up** (``decide_resume``): a change to what the checkpoint's data
  position counts (the dataset, the data-parallel size, the micro-batch, the accumulation, the
  seed, the order) is refused unless ``--restart-data`` (the weights, optimizer and step are
  resumed; the data order starts again); any other change continues and is named. The decision
  is recorded in ``run_identity.json`` (``"resume"``) and the ranks follow it
  (``run_record.restarts_data``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magistral_cli.checkpoint.layout import LATEST, STEP_DIR, list_checkpoints
from magistral_cli.errors import UserError
from magistral_cli.run_lock import RANKS_LOCK, SAVE_OWNER, read_save_owner
from magistral_cli.run_record import IDENTITY_NAME, RESOLVED_CONFIG, RESUME_KEY, read_identity

#: The files a launch writes at the top of its run directory (a launch never reads one of them).
RUN_FILES = (RESOLVED_CONFIG, IDENTITY_NAME, "summary.json", "metrics.jsonl")

#: What a checkpoint's data position is counted in, besides the dataset's content and the
#: data-parallel size: a change makes the saved position mean other samples.
DATA_POSITION_KEYS = (
    "training.micro_batch_size",
    "training.gradient_accumulation_steps",
    "training.seed",
    "data.dataset_param.dataset_type",
    "data.dataset_param.basic_parameters.cutoff_len",
    "data.dataset_param.basic_parameters.max_samples",
    "data.dataset_param.basic_parameters.packing",
    "data.dataset_param.basic_parameters.neat_packing",
    "data.dataset_param.basic_parameters.val_size",
    "data.dataloader_param.shuffle",
    "data.dataloader_param.drop_last",
    "data.dataloader_param.sampler_type",
    "data.dataloader_param.infinite_sampler",
)
#: Recipe keys that differ between launches of one run without changing it.
_NOT_A_CHANGE = ("training.output_dir",)


def _lock_file(name: str) -> bool:
    return name == RANKS_LOCK or re.fullmatch(r"\.magistral(\.node\d+)?\.lock", name) is not None


def _checkpoint_entry(name: str) -> bool:
    """A name that a run writes in a checkpoint directory."""
    return (
        STEP_DIR.fullmatch(name) is not None
        or name in (LATEST, f".{LATEST}.tmp", SAVE_OWNER)
        or name.startswith(".tmp_step_")
    )


def _entries(directory: Path) -> list[str]:
    """The names in ``directory`` (none when it does not exist), less the launcher's lock files."""
    try:
        return sorted(name for name in os.listdir(directory) if not _lock_file(name))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise UserError(f"{directory} is a file, not a directory; give a directory path") from None


def _same(a: Path | None, b: Path | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def _inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or under it (links resolved)."""
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def _names(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


@dataclass
class Previous:
    """The run directory's last launch: its ``run_identity.json``, resolved recipe and save directory.

    ``identity`` is None for a directory that is no run directory yet; ``{}`` for a run directory
    whose identity cannot be read.
    """

    identity: dict[str, Any] | None = None
    recipe: dict[str, Any] | None = None
    save_dir: Path | None = None

    @property
    def is_run(self) -> bool:
        return self.identity is not None


def read_previous(run_dir: Path) -> Previous:
    import yaml

    from magistral_cli.engine.checkpoint import resolve_save_dir

    if not (run_dir / IDENTITY_NAME).is_file():
        return Previous()
    identity = read_identity(run_dir) or {}
    try:
        recipe = yaml.safe_load((run_dir / RESOLVED_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        recipe = None
    if not isinstance(recipe, dict):
        recipe = None
    save = ((recipe or {}).get("training") or {}).get("save")
    return Previous(identity, recipe, resolve_save_dir(save, run_dir) if isinstance(save, str) else None)


# --------------------------------------------------------------------------- the run directory
def check_run_dir(run_dir: Path, previous: Previous, save_dir: Path | None) -> None:
    """Refuse a ``training.output_dir`` that is an existing directory of the user's (UserError)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(
            f"training.output_dir {run_dir} is a file; set it to a directory (new, or a run directory)"
        )
    if previous.is_run:
        return
    seeded = save_dir is not None and save_dir.parent.resolve() == run_dir.resolve()
    foreign = [
        name
        for name in _entries(run_dir)
        if not (seeded and name == save_dir.name and all(map(_checkpoint_entry, _entries(save_dir))))
    ]
    if foreign:
        raise UserError(
            f"training.output_dir {run_dir} is an existing directory that is not a magistral run directory "
            f"(it has no {IDENTITY_NAME} and holds {_names(foreign)}): a run writes {', '.join(RUN_FILES)} and "
            "logs/ there, over any file of those names. Set training.output_dir to a new or empty directory "
            "(unset, it is runs/<recipe>-<time>)"
        )


def check_inputs_not_outputs(run_dir: Path, inputs: list[tuple[str, Any]]) -> None:
    """No file the launch reads is one it writes in the run directory (its resolved recipe, say)."""
    from magistral_cli.run_record import refuse_overwriting_inputs

    for name in RUN_FILES:
        refuse_overwriting_inputs(
            run_dir / name,
            inputs,
            "the run directory's",
            fix=f"copy it out of the run directory first (cp {run_dir / name} recipe.yaml), or set "
            "training.output_dir to another directory",
        )


# --------------------------------------------------------------------------- the checkpoint directory
def _enclosing_run(path: Path) -> Path | None:
    """The nearest directory at or above ``path`` that is a magistral run directory."""
    for candidate in [path.resolve(), *path.resolve().parents]:
        if (candidate / IDENTITY_NAME).is_file():
            return candidate
    return None


def check_save_owner(
    save_dir: Path, run_dir: Path, run_id: str, previous: Previous, *, share: bool
) -> str | None:
    """Refuse a checkpoint directory that belongs to another run (UserError); None, or the warning
    for one shared on purpose (``share``)."""
    record = read_save_owner(save_dir)
    if record is not None:
        users = {record.get("run_id")} | {u.get("run_id") for u in record.get("shared_with") or []}
        if run_id in users:
            return None
        owner = str(record.get("run_dir"))
    else:
        # A stale temporary (a save cut short) is no checkpoint: it is removed before training.
        entries = [
            n for n in _entries(save_dir) if n != SAVE_OWNER and not n.startswith((".tmp_step_", ".latest."))
        ]
        if not entries or _inside(save_dir, run_dir) or _same(previous.save_dir, save_dir):
            return None  # new or empty, inside this run directory, or where this run saved before
        enclosing = _enclosing_run(save_dir)
        if enclosing is None and not all(map(_checkpoint_entry, entries)):
            raise UserError(
                f"training.save {save_dir} is an existing directory that holds other files ({_names(entries)}) "
                "and no checkpoints of a run: checkpoints go only into a new or empty directory, or one that a "
                "run of yours wrote. Set training.save to one (training.save=checkpoints: inside the run directory)"
            )
        owner = str(enclosing) if enclosing is not None else "a run that left no record of itself"
    if share:
        return (
            f"training.save {save_dir} belongs to the run {owner}, shared with this one on purpose "
            "(--share-checkpoints): this run resumes its newest checkpoint and moves its `latest`"
        )
    raise UserError(
        f"training.save {save_dir} holds the checkpoints of another run ({owner}); this run is {run_dir}. "
        "Writing there would resume that run's newest checkpoint and move its `latest`. Give this run its own "
        f"directory (training.save=checkpoints, inside {run_dir}); to start from those checkpoints, set "
        f"training.load={save_dir} as well (this run then saves in its own directory); or pass "
        "--share-checkpoints to write into it on purpose"
    )


def check_checkpoints_kept(
    run_dir: Path, previous: Previous, save_dir: Path | None, load: str | None
) -> None:
    """Refuse a launch that would pass over the checkpoints the run directory holds (UserError)."""
    known: list[Path] = [run_dir / "checkpoints"]
    if previous.save_dir is not None:
        known.append(previous.save_dir)
    for directory in known:
        if _same(directory, save_dir) or (load and _inside(Path(load), directory)):
            continue
        found = list_checkpoints(directory)
        if not found:
            continue
        names = _names([path.name for _, path in found], 3)
        why = "training.save is not set" if save_dir is None else f"training.save is {save_dir}"
        where = (
            str(directory.resolve().relative_to(run_dir.resolve()))
            if _inside(directory, run_dir)
            else str(directory)
        )
        raise UserError(
            f"{run_dir} holds checkpoints of an earlier launch in {directory} ({names}) that this launch would "
            f"not resume ({why}): it would start again from step 1 beside them. To continue them, launch with "
            f"training.save={where}; for a fresh run, use a new training.output_dir"
        )


# --------------------------------------------------------------------------- resuming
def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def data_setup(
    recipe: dict[str, Any], world_size: int | None, dataset: dict[str, Any] | None
) -> dict[str, Any]:
    """What the data position of a checkpoint written under ``recipe`` (a resolved recipe as a
    dict) is counted in: the dataset's content, the data-parallel size, ``DATA_POSITION_KEYS``."""
    flat = _flatten(recipe)
    cp = int(flat.get("parallel.ulysses_parallel_size") or 1) * int(
        flat.get("parallel.ring_attention_size") or 1
    )
    dataset = dataset or {}
    setup: dict[str, Any] = {"dataset": dataset.get("sha256") or dataset.get("path")}
    if world_size:  # unknown for a run directory whose identity cannot be read: not compared
        setup["data_parallel_size"] = world_size // cp
    setup.update({key: flat.get(key) for key in DATA_POSITION_KEYS})
    return setup


def _describe(change: dict[str, Any]) -> str:
    key, was, now = change["key"], change["was"], change["now"]
    if key == "dataset":
        short = [str(v)[:12] + "..." if isinstance(v, str) and len(v) == 64 else str(v) for v in (was, now)]
        return f"the dataset's content (SHA-256 {short[0]} -> {short[1]})"
    if key == "data_parallel_size":
        return f"the data-parallel size {was} -> {now} (world size / context-parallel size)"
    return f"{key} {was!r} -> {now!r}"


def _diff(old: dict[str, Any], new: dict[str, Any], keys=None) -> list[dict[str, Any]]:
    keys = keys if keys is not None else sorted(set(old) | set(new))
    return [{"key": k, "was": old.get(k), "now": new.get(k)} for k in keys if old.get(k) != new.get(k)]


@dataclass
class ResumeDecision:
    """How a launch continues its save directory's newest checkpoint (``run_identity.json``'s ``"resume"``)."""

    checkpoint: str
    step: int
    save_dir: Path
    #: Every difference from the last launch (recipe keys and the world size).
    changes: list[dict[str, Any]] = field(default_factory=list)
    #: The differences from the set-up the checkpoint was written under that move its data position.
    data_changes: list[dict[str, Any]] = field(default_factory=list)
    #: ``continue`` (the checkpoint's data position is loaded) or ``restart`` (the order starts again).
    data: str = "continue"
    checkpoint_setup: dict[str, Any] | None = None
    #: Why the data order restarts: ``--restart-data``, or the previous launch's same decision.
    reason: str | None = None

    def record(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "step": self.step,
            "save_dir": str(self.save_dir),
            "data": self.data,
            "reason": self.reason,
            "changes": self.changes,
            "data_changes": self.data_changes,
            "checkpoint_setup": self.checkpoint_setup,
        }

    def message(self) -> str | None:
        """The line the launch prints about it (None: an unchanged resume)."""
        where = f"{self.checkpoint} of {self.save_dir}"
        if self.data == "restart":
            return (
                f"resuming {where} (weights, optimizer, step) with the data order started again ({self.reason}): "
                + "; ".join(map(_describe, self.data_changes))
            )
        if self.changes:
            return (
                f"resuming {where} with changes since the last launch: "
                + "; ".join(map(_describe, self.changes[:8]))
                + (
                    f"; and {len(self.changes) - 8} more (run_identity.json lists them)"
                    if len(self.changes) > 8
                    else ""
                )
            )
        return None


def decide_resume(
    save_dir: Path | None,
    recipe: dict[str, Any],
    setup: dict[str, Any],
    world_size: int,
    previous: Previous,
    *,
    restart_data: bool,
) -> ResumeDecision | None:
    """The decision for a launch that will resume ``save_dir``'s newest checkpoint (None: no resume).

    The checkpoint's set-up is the previous launch's, unless that launch itself restarted the data
    order from this very checkpoint (then it is the one that launch recorded for it). A data-position
    change is a UserError naming it and ``--restart-data``; any other change is named in the decision.
    """
    if save_dir is None or (recipe.get("training") or {}).get("resume") != "auto":
        return None
    found = list_checkpoints(save_dir)
    if not found:
        return None
    step, path = found[0]
    decision = ResumeDecision(path.name, step, save_dir)
    if not previous.identity and previous.recipe is None:
        return decision  # a seeded directory: nothing recorded to compare with
    identity = previous.identity or {}
    before = (identity.get(RESUME_KEY) or {}) if isinstance(identity.get(RESUME_KEY), dict) else {}
    pending = before.get("data") == "restart" and step <= int(before.get("step") or -1)
    if pending and isinstance(before.get("checkpoint_setup"), dict):
        checkpoint_setup = before["checkpoint_setup"]
    else:
        checkpoint_setup = identity.get("data_setup") or data_setup(
            previous.recipe or {}, identity.get("world_size"), identity.get("dataset")
        )
    decision.checkpoint_setup = checkpoint_setup
    decision.changes = [
        c for c in _diff(_flatten(previous.recipe or {}), _flatten(recipe)) if c["key"] not in _NOT_A_CHANGE
    ]
    if identity.get("world_size") not in (None, world_size):
        decision.changes.insert(
            0, {"key": "world size", "was": identity.get("world_size"), "now": world_size}
        )
    decision.data_changes = _diff(checkpoint_setup, setup, keys=[k for k in setup if k in checkpoint_setup])
    if not decision.data_changes:
        return decision
    if restart_data:
        decision.data, decision.reason = "restart", "--restart-data"
    elif pending and setup == identity.get("data_setup"):
        decision.data = "restart"
        decision.reason = (
            "as the previous launch decided for this checkpoint (--restart-data), which saved none since"
        )
    else:
        raise UserError(
            f"resuming {path.name} of {save_dir} would apply its data position to a changed set-up: "
            + "; ".join(map(_describe, decision.data_changes))
            + ". The position counts batches of the set-up it was saved under, so this one would repeat or skip "
            "samples (or stop, if the dataset shrank). Relaunch with the set-up it was saved under; pass "
            "--restart-data to resume its weights, optimizer and step with the data order started again; or use "
            "a new training.output_dir for a fresh run"
        )
    return decision
