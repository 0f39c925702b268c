"""What a run starts from and what its checkpoints hold: the trainer's ``CheckpointManager``.

At start (``load_initial_state``): remove a crashed save's temporaries, then resume from the newest
intact checkpoint of the save directory (``training.resume=auto``), or from a training checkpoint
named by ``training.load``, or load ``training.load`` weights; a LoRA run's base always comes from
``training.load`` first. During the run: the state dict of a checkpoint (``state_dict``, ``save``)
and its load (``load``), with the checks that a checkpoint fits the recipe (model keys, LoRA
settings). The files on disk, their integrity and the commit protocol are ``checkpoint``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from magistral_cli.checkpoint.keys import DCP_MODEL_PREFIX
from magistral_cli.config.schema import Recipe
from magistral_cli.errors import CheckFailed, UserError
from magistral_cli.run_record import restarts_data

from . import checkpoint as ckpt
from . import lora as lora_mod
from .data import DataSource
from .rng import rng_state, set_rng_state
from .weights import load_weights

log = logging.getLogger("magistral_cli.engine")


class CheckpointManager:
    """The resume policy and the checkpoint state of one trainer (every rank holds one).

    The trainer calls ``load_initial_state()`` once after its build (it returns the step to
    continue from), ``save(step)`` at its save steps, and ``state_dict(step)`` / ``load(path)``.
    """

    def __init__(
        self,
        recipe: Recipe,
        *,
        run_dir: Path,
        save_dir: Path | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: DataSource,
        lora: lora_mod.LoraApplied | None,
        device_type: str,
        dp_rank: int,
    ):
        self.recipe = recipe
        self.run_dir = run_dir
        self.save_dir = save_dir  # None: no checkpoint is written (training.save unset)
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.lora = lora
        self.device_type = device_type
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank = dp_rank

    # ------------------------------------------------------------------ start
    def load_initial_state(self) -> int:
        """Resume from a training checkpoint, or load ``training.load`` weights (in that order).

        Returns the step to continue from (0 without a resume). A LoRA run's checkpoints hold the
        adapters only: its base always comes from ``training.load`` (never a LoRA checkpoint)
        first, then a resume replaces the adapters, their optimizer state and the rest.
        """
        training = self.recipe.training
        if self.rank == 0 and self.save_dir is not None:
            for stale in ckpt.remove_stale_temporaries(self.save_dir):
                log.warning("removed %s, left by an interrupted checkpoint save", stale)
        lora_mod.refuse_lora_checkpoint_as_load(training.load, training.load_format)
        resume = None
        if self.save_dir is None:
            pass  # nothing saved, nothing to resume from
        elif training.resume == "auto":
            resume = choose_checkpoint(self.save_dir, what="resume")
        else:
            ckpt.refuse_fresh_start(self.save_dir)
        # training.load naming a training checkpoint (or a directory of them): a full run continues
        # from it; a LoRA run takes its model as the base. Either way it is verified first, so a
        # half-written or damaged checkpoint is never taken as good.
        start = None
        if (self.lora is not None or resume is None) and training.load and training.load_format != "hf":
            start = training_checkpoint_to_load(Path(training.load))
        if self.lora is None and resume is None:
            resume = start
        if self.lora is not None or resume is None:
            self._load_base_weights(start)
        if resume is None:
            return 0
        step = self.load(resume)
        log.info("resumed from %s at step %d", resume, step)
        return step

    def _load_base_weights(self, checkpoint: Path | None = None) -> None:
        """``training.load`` into the model (for a LoRA model: the base, adapters left as initialised);
        ``checkpoint``: the verified training checkpoint it names, read in its place."""
        training = self.recipe.training
        if training.load:
            source = training.load if checkpoint is None else str(checkpoint)
            fmt = training.load_format if checkpoint is None else "dcp"
            report = load_weights(self.model, source, fmt, training.load_strict)
            if report.missing or report.unexpected:
                log.warning(
                    "loaded %s: missing %s, unexpected %s", report.source, report.missing, report.unexpected
                )
                if report.missing and training.init_model_with_meta_device:
                    self._init_missing(report.missing)
            log.info("loaded %d tensors from %s (%s)", report.loaded, report.source, report.fmt)
        elif training.init_model_with_meta_device:
            raise UserError(
                "training.load is not set, so there are no weights to materialize the meta-device model with; "
                "set training.load to the model directory, or init_model_with_meta_device=false for random weights"
            )

    def _init_missing(self, missing: list[str]) -> None:
        """Initialise parameters a non-strict load did not provide (transformers' own initialiser)."""
        owners = {key.rsplit(".", 1)[0] for key in missing}
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for name in owners:
                self.model._init_weights(modules[name])

    # ------------------------------------------------------------------ state
    def state_dict(self, step: int) -> dict[str, Any]:
        """The checkpoint: model, optimizer, scheduler, RNG (per rank), data loader (per dp rank), step."""
        training = self.recipe.training
        state: dict[str, Any] = {"model": self._model_state()}
        if self.lora is not None:
            # The adapters' settings, for `magistral convert dcp-to-hf --lora` and resume checks.
            state.update(lora_mod.checkpoint_entry(self.lora, self.recipe.model.model_name_or_path))
        if not training.no_save_optim:
            state["optimizer"] = {"state": get_optimizer_state_dict(self.model, self.optimizer)["state"]}
        state["scheduler"] = {"last_step": torch.tensor(step, dtype=torch.int64)}
        if not training.no_save_rng:
            state["rng"] = {f"rank_{self.rank}": ckpt.pack(rng_state(self.device_type))}
        state["dataloader"] = {f"dp_rank_{self.dp_rank}": ckpt.pack(self.data.state_dict())}
        state["step"] = torch.tensor(step, dtype=torch.int64)
        return state

    def save(self, step: int) -> Path:
        """Write ``state_dict(step)`` as the checkpoint of ``step`` (every rank calls it)."""
        if self.save_dir is None:
            raise UserError("training.save is not set, so there is nowhere to save a checkpoint")
        path = ckpt.save_checkpoint(self.state_dict(step), self.save_dir, step)
        log.info("saved checkpoint %s", path)
        return path

    def load(self, path: Path) -> int:
        """Continue from the training checkpoint at ``path`` (every rank calls it); returns its step."""
        import torch.distributed.checkpoint as dcp

        from magistral_cli.checkpoint.safe_dcp import SafeFileSystemReader

        training = self.recipe.training
        keys = set(SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata)
        self._check_lora_checkpoint(path, keys)
        state: dict[str, Any] = {"model": self._model_state()}
        prefix = DCP_MODEL_PREFIX["engine"]
        missing = sorted(prefix + k for k in state["model"] if prefix + k not in keys)
        if missing:
            raise UserError(f"checkpoint {path} lacks model keys: {', '.join(missing[:10])}")
        optim_sd = None
        if not training.no_load_optim and any(k.startswith("optimizer.") for k in keys):
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
            state["optimizer"] = {"state": optim_sd["state"]}
        rng_key, data_key = f"rng.rank_{self.rank}", f"dataloader.dp_rank_{self.dp_rank}"
        # The launcher's decision (`magistral train --restart-data`): under a changed data set-up
        # the saved data position would mean other samples, so the order starts again.
        restart = restarts_data(self.run_dir, path)
        skip = {rng_key} if training.no_load_rng else set()
        packed = [
            k for k in (rng_key, data_key) if k in keys and k not in skip | ({data_key} if restart else set())
        ]
        for key, size in ckpt.checkpoint_sizes(path, packed).items():
            section, name = key.split(".", 1)
            state.setdefault(section, {})[name] = torch.empty(size, dtype=torch.uint8)
        state["step"] = torch.zeros((), dtype=torch.int64)
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
        except CheckpointException as exc:  # a BaseException wrapping each rank's failure: one message
            from magistral_cli.checkpoint.dcp_to_hf import _unwrap

            raise _unwrap(exc, path) from None

        if self.lora is not None:
            lora_mod.load_adapter_state_dict(self.model, state["model"])
        else:
            set_model_state_dict(self.model, state["model"])
        if optim_sd is not None:
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                {"state": state["optimizer"]["state"], "param_groups": optim_sd["param_groups"]},
            )
        if "rng" in state:
            set_rng_state(ckpt.unpack(state["rng"][f"rank_{self.rank}"]), self.device_type)
        elif not training.no_load_rng:
            log.warning(
                "checkpoint %s has no RNG state for rank %d; keeping the seeded state", path, self.rank
            )
        if "dataloader" in state:
            self.data.load_state_dict(ckpt.unpack(state["dataloader"][f"dp_rank_{self.dp_rank}"]))
        elif restart:
            log.warning("resuming %s with the data order started again (run_identity.json: resume)", path)
        else:
            log.warning(
                "checkpoint %s has no data-loader state for dp rank %d; data restarts", path, self.dp_rank
            )
        return int(state["step"])

    def _model_state(self) -> dict[str, Any]:
        """The model part of a checkpoint: every tensor, or for LoRA the trainable ones only."""
        if self.lora is not None:
            return lora_mod.adapter_state_dict(self.model)
        return get_model_state_dict(self.model)

    def _check_lora_checkpoint(self, path: Path, keys: set[str]) -> None:
        """A LoRA run resumes only a LoRA checkpoint of the same settings, and a full run no LoRA one."""
        entry = f"{lora_mod.CHECKPOINT_ENTRY}.config"
        if self.lora is None:
            if entry in keys:
                raise UserError(
                    f"checkpoint {path} is a LoRA checkpoint (adapters only) but this recipe has no model.lora; "
                    "resume it with its LoRA recipe, or point training.save at another directory"
                )
            return
        if entry not in keys:
            raise UserError(
                f"checkpoint {path} is a full training checkpoint but this recipe trains LoRA adapters "
                "(model.lora); point training.save at a new directory, or use it as the base with training.load"
            )
        saved = lora_mod.read_checkpoint_record(path) or {}
        mine = self.lora.to_record(self.recipe.model.model_name_or_path)
        # A checkpoint from before QLoRA records no quantize_base: its base was the plain one.
        saved = {"quantize_base": "none", **saved}
        differ = [
            k
            for k in ("r", "alpha", "target_modules", "modules_to_save", "quantize_base")
            if saved.get(k) != mine.get(k)
        ]
        if differ:
            raise UserError(
                f"checkpoint {path} was trained with other model.lora settings ({', '.join(differ)}: "
                + "; ".join(f"{k} {saved.get(k)!r} there, {mine.get(k)!r} here" for k in differ[:2])
                + "); resume with the settings it was trained with, or point training.save at a new directory"
            )


def verify_on_all_ranks(path: Path) -> ckpt.Verification:
    """``ckpt.verify_checkpoint`` with the files split over the ranks; every rank gets every finding."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = ckpt.verify_checkpoint(path, rank, world_size)
    found: list[tuple[list[str], bool] | None] = [None] * world_size
    dist.all_gather_object(found, (mine.problems, mine.recorded))
    problems = [p for part in found for p in (part[0] if part else [])]
    return ckpt.Verification(path, problems, recorded=all(part[1] for part in found if part))


def choose_checkpoint(save_dir: Path, what: str) -> Path | None:
    """The newest intact checkpoint of ``save_dir``, with a warning for each one passed over."""
    choice = ckpt.choose_resume(save_dir, verify=verify_on_all_ranks)
    if dist.get_rank() == 0:
        for skipped in choice.skipped:
            log.warning("%s: skipped checkpoint %s", what, skipped)
        if choice.unverified:
            log.warning("%s: %s has no integrity record (an older save); not verified", what, choice.path)
        name, problem = ckpt.latest_name(save_dir)
        if choice.path is not None and (problem or name != choice.path.name):
            log.warning(
                "%s: %s; taking %s, the newest intact checkpoint",
                what,
                problem or f"{save_dir / ckpt.LATEST} names {name}",
                choice.path.name,
            )
    return choice.path


def training_checkpoint_to_load(path: Path, what: str = "training.load") -> Path | None:
    """The verified training checkpoint that ``path`` names (itself, or the newest intact one of a
    checkpoint directory), or None when it names weights, not a training checkpoint.

    Every rank calls it. A damaged one stops the run (``CheckFailed``), so a half-written checkpoint
    is never taken as good; a LoRA one (adapters only) is never starting weights (``UserError``).
    """
    if ckpt.is_training_checkpoint(path):
        # The cheap refusal first: a LoRA checkpoint is refused before every file is read.
        lora_mod.refuse_lora_checkpoint_as_load(str(path), "dcp", what=what)
        # (verify_checkpoint counts a training checkpoint without its integrity record as a problem.)
        result = verify_on_all_ranks(path)
        if not result.ok:
            raise CheckFailed(f"{what} {path} is a damaged checkpoint: " + "; ".join(result.problems[:5]))
        return path
    if (found := ckpt.checkpoints_dir(path)) is None:
        return None
    chosen = choose_checkpoint(found, what=what)
    lora_mod.refuse_lora_checkpoint_as_load(str(chosen), "dcp", what=what)
    return chosen
