"""The one trainer every recipe uses: build, ``train``, ``train_step``, ``state_dict`` / ``load_state_dict``, ``close``."""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from magistral_cli.config.schema import Recipe
from magistral_cli.data.packing import segment_mode
from magistral_cli.errors import UserError
from magistral_cli.ops.attention import resolve_attention
from magistral_cli.ops.context_parallel import check_cp_model, cp_groups_from_mesh
from magistral_cli.run_record import record_resolved
from magistral_cli.runtime import host_to_device, init_distributed, resolve_device_type
from magistral_cli.runtime.device import parse_dtype

from . import checkpoint as ckpt
from . import lora as lora_mod
from .batch import check_micro_batch, per_sample_weights, to_device
from .data import DataSource, build_sources, may_hold_images
from .metrics import FLOP_UNIT, micro_batch_flops, step_record, write_summary
from .model import (
    build_model,
    install_loss_head,
    load_model_config,
    log_parameter_counts,
    loss_head_sum,
)
from .nonfinite import NonFiniteSteps
from .optim import build_optimizer, clip_grads_, grad_norm_and_sums, lr_at
from .parallelize import ParallelDims, parallelize_model, skip_blank_vision_forward
from .preference import PreferenceStep, evaluate_pairs, metrics_of, reference_kind, reference_source
from .profiling import MemoryProfiler, StepProfiler
from .qlora import quantize_base_
from .resume import CheckpointManager, training_checkpoint_to_load
from .rng import seed_everything
from .step_log import StepLog, read_step_values
from .validate import evaluate

log = logging.getLogger("magistral_cli.engine")


class Trainer:
    """FSDP2 training of Mistral3 from a resolved recipe, with optional context parallelism.

    With ``parallel.ulysses_parallel_size x ring_attention_size`` = cp > 1 the world is
    dp x cp: FSDP2 shards over all ranks, the data is split over dp only (the ranks of a CP
    group read the same micro-batches), and the decoder runs on each rank's part of the
    sequence (``ops.context_parallel``); losses, token counts and the gradient equal CP=1's.

    ``data`` replaces the recipe's data source (tests pass ``SyntheticBatches``), ``val_data``
    its validation split (``build_val_data``); everything else comes from the recipe.
    """

    def __init__(self, recipe: Recipe, *, data: DataSource | None = None, val_data=None):
        self.recipe = recipe
        training = recipe.training
        self.started = time.monotonic()
        self.step = 0
        if training.output_dir is None:
            raise UserError("training.output_dir is not set; launch with `magistral train`, which sets it")
        self.run_dir = Path(training.output_dir)
        # None: no checkpoint is written (training.save unset, as in the seed's configs).
        self.save_dir = ckpt.resolve_save_dir(training.save, self.run_dir)

        self.device_type = resolve_device_type(recipe.parallel.device)
        if training.use_deter_comp:
            # cuBLAS reads this when it initialises, so it must be set before any device work.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.device, self._owns_process_group = init_distributed(self.device_type)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Non-finite steps stop the run, or are skipped (training.skip_nonfinite_steps) and counted.
        self.nonfinite = NonFiniteSteps(training.skip_nonfinite_steps, self.rank)
        self.dims = ParallelDims.from_recipe(recipe, self.world_size)
        # Data parallel x context parallel. The data is sharded over dp only (every rank of a
        # CP group reads the same micro-batches); FSDP2 shards the model over dp x cp.
        self.meshes = self.dims.build_mesh(self.device_type)
        self.dp_mesh = self.meshes.dp
        self.dp_group = self.dp_mesh.get_group()
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.fsdp_group = self.meshes.dp_cp.get_group()
        self.cp_groups = cp_groups_from_mesh(self.meshes) if self.dims.cp > 1 else None
        self.cp_rank = self.cp_groups.cp_rank if self.cp_groups is not None else 0
        self.loss_type = recipe.features.loss_cfg.loss_type
        # Packing (plain or neat) runs the packed attention: explicit segments on every device.
        self.segments = segment_mode(recipe)
        # One sample per micro-batch: the same loss, the plain path (per_sample_loss with CP and more
        # samples is refused by the recipe schema).
        if self.loss_type == "per_sample_loss" and training.micro_batch_size == 1:
            self.loss_type = "default"
        seed_everything(training.seed, self.device_type)
        if training.manual_gc_interval:
            gc.disable()

        self.model = self._build_model()
        # training.stage: dpo: the pair step, with its reference model (None: adapters off, no reference,
        # or precomputed log-probabilities, which the pass below provides).
        self.preference = None
        if training.stage == "dpo":
            live = reference_kind(recipe) == "model"
            self.preference = PreferenceStep(self, self._build_reference() if live else None)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        if self.rank == 0:
            log_parameter_counts(self.model, self.lora)
        self.optimizer = build_optimizer(self.model, training, self.device_type)
        if self.rank == 0:
            # Choices only the device can make, next to the launcher's record of the run.
            record_resolved(
                self.run_dir, adamw=self.optimizer.adamw_choice, attn_implementation=self.attn_implementation
            )
        # The training data and the validation split (``data.dataset_param.basic_parameters.val_size``,
        # or None); ``data`` / ``val_data`` replace the recipe's.
        self.data, self.val_data = build_sources(
            recipe,
            data=data,
            val_data=val_data,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp,
            vocab_size=self.model.config.text_config.vocab_size,
        )
        for model in (self.model, self.preference and self.preference.reference):
            if model is not None:
                self.skip_blank_vision_forward(model)
        # The resume policy and the checkpoints' state: what this run starts from.
        self.checkpoints = CheckpointManager(
            recipe,
            run_dir=self.run_dir,
            save_dir=self.save_dir,
            model=self.model,
            optimizer=self.optimizer,
            data=self.data,
            lora=self.lora,
            device_type=self.device_type,
            dp_rank=self.dp_rank,
        )
        self.step = self.checkpoints.load_initial_state()
        self.nonfinite.last_applied = self.step
        if self.preference is not None and self.preference.precomputed:
            # After the weights (a LoRA base is the loaded policy's): stored, or one pass, then no reference.
            from .reference_logps import stored_reference_logps

            self.preference.stored = stored_reference_logps(self)
        self._data_iter = iter(self.data)

        if training.freeze_gc_after_init:
            from magistral_cli.ops.gc_policy import freeze_after_init

            log.info("froze %d setup objects; automatic GC stays on for new ones", freeze_after_init())

    # ------------------------------------------------------------------ build
    def _build_model(self) -> torch.nn.Module:
        """Build the model (meta or real), install the loss head, then ``parallelize_model``."""
        recipe = self.recipe
        if recipe.model.model_name_or_path is None:
            raise UserError(
                "model.model_name_or_path is not set; point it at the model directory (config.json)"
            )
        config = load_model_config(recipe.model.model_name_or_path, recipe.model.trust_remote_code)
        check_cp_model(config.text_config, self.dims.ulysses)
        self.model_config = config
        self.attn_implementation = resolve_attention(
            recipe.model.attn_implementation, self.device_type, packed=self.segments is not None
        )
        model = self._new_model(config)
        # LoRA (model.lora): PEFT's layers in place, the base frozen, before anything wraps a module.
        self.lora = lora_mod.apply_lora_from_recipe(model, recipe)
        # QLoRA (model.lora.quantize_base): the frozen decoder Linear weights become NF4 before FSDP2
        # shards them; the loader quantises the real weights into them.
        quantize_base_(model, recipe.model.lora, shards=self.dims.dp * self.dims.cp)
        done = parallelize_model(
            model,
            recipe,
            device_type=self.device_type,
            device=self.device,
            mesh=self.meshes.dp_cp,
            cp_groups=self.cp_groups,
            loss_fn=loss_head_sum,
            lora=self.lora,
        )
        self.frozen = done.frozen
        log.info(
            "FSDP2 over %d ranks (dp %d x cp %d): %d units + root; frozen: %s",
            self.dims.dp * self.dims.cp,
            self.dims.dp,
            self.dims.cp,
            len(done.units),
            self.frozen,
        )
        return model

    def skip_blank_vision_forward(self, model: torch.nn.Module) -> None:
        """Text-only micro-batches skip ``model``'s frozen vision tower where no rank needs its blank
        forward (``parallelize.skip_blank_vision_forward``; the policy, a reference); after the data."""
        skip_blank_vision_forward(
            model,
            self.recipe.parallel.fsdp_plan,
            fsdp_world=self.dims.dp * self.dims.cp,
            images_possible=may_hold_images(self.data),
        )

    def _new_model(self, config) -> torch.nn.Module:
        """A model of ``config`` (meta or real, ``training.init_model_with_meta_device``) with the loss head."""
        features = self.recipe.features
        model = build_model(
            config,
            meta=self.recipe.training.init_model_with_meta_device,
            attn_implementation=self.attn_implementation,
        )
        chunk = features.chunkloss_plan.chunk_size if features.enable_chunk_loss else None
        install_loss_head(model, features.chunkloss_plan.apply_module, chunk)
        return model

    def _build_reference(self) -> torch.nn.Module | None:
        """The frozen reference model of preference training, in the policy's FSDP2 layout, or None
        (``preference.reference_source``: the policy's base with adapters off, or no reference)."""
        recipe = self.recipe
        source = reference_source(recipe)
        if source is None:
            return None
        from .weights import load_weights

        what = "training.dpo.ref_model" if recipe.training.dpo.ref_model is not None else "training.load"
        # A training checkpoint (or a directory of them) is verified first, as the policy's start is;
        # a LoRA one is refused.
        checkpoint = training_checkpoint_to_load(Path(source), what=what)
        # A fresh config (the policy's build set its attention names on the shared one), and the
        # RNG forked: the policy's initialisation and data order stay as they are without it.
        with torch.random.fork_rng(devices=[]):
            ref = self._new_model(
                load_model_config(recipe.model.model_name_or_path, recipe.model.trust_remote_code)
            )
        ref.requires_grad_(False)
        # Stored in the compute dtype (parallel.fsdp_plan.param_dtype): FSDP2 casts to it for every
        # forward anyway, so a bf16 copy computes exactly what an fp32 one would, at half the memory.
        param_dtype = recipe.parallel.fsdp_plan.param_dtype
        if param_dtype:
            lora_mod.cast_frozen_(ref, parse_dtype(param_dtype))
        parallelize_model(
            ref,
            recipe,
            device_type=self.device_type,
            device=self.device,
            mesh=self.meshes.dp_cp,
            loss_fn=loss_head_sum,
        )
        report = load_weights(ref, source if checkpoint is None else str(checkpoint), "auto", strict=True)
        ref.eval()
        log.info("reference model: %d tensors from %s (%s), frozen", report.loaded, report.source, report.fmt)
        return ref

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint of this step (``CheckpointManager.state_dict``)."""
        return self.checkpoints.state_dict(self.step)

    def load_state_dict(self, path: Path) -> None:
        """Continue from the training checkpoint at ``path`` (every rank calls it)."""
        self.step = self.checkpoints.load(path)

    def save(self) -> Path:
        return self.checkpoints.save(self.step)

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped in this launch (``training.skip_nonfinite_steps``)."""
        return self.nonfinite.skipped

    # ------------------------------------------------------------------ training
    def _next_micro_batch(self) -> dict[str, torch.Tensor]:
        try:
            return next(self._data_iter)
        except StopIteration:
            # End of an epoch: a new pass (the loader's sampler moves to the next epoch).
            self._data_iter = iter(self.data)
            return next(self._data_iter)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Forward and backward over this rank's micro-batches; gradients end up reduce-scattered.

        The loss follows ``features.loss_cfg.loss_type``, with MindSpeed-MM's semantics:

        - ``default``: each micro-batch's own token mean; the step is the mean of the micro-batch
          means over the accumulation steps and the data-parallel ranks.
        - ``per_sample_loss``: each sample's token mean, averaged over the micro-batch's samples,
          then as ``default``.
        - ``per_token_loss``: the summed token losses of the whole global batch over its target
          count (the only one whose gradient does not depend on how the batch is split).

        Returns device tensors: ``loss_sum`` (this rank's summed token losses), ``objective``
        (this rank's share of the logged loss) and ``counts`` (global targets, global non-padding
        tokens, global model FLOPs in ``FLOP_UNIT``s). Nothing here waits for the device.
        Under ``training.stage: dpo`` the pair step does it (``PreferenceStep.forward_backward``).
        """
        if self.preference is not None:
            return self.preference.forward_backward(micro_batches)
        loss_type = self.loss_type
        local = torch.zeros(3, dtype=torch.int64)  # targets, tokens, model FLOPs (FLOP_UNITs)
        targets: list[int] = []
        for mb in micro_batches:
            # Host-side checks and counts: the batches are still on the CPU, so no device sync.
            # Every rank of a CP group holds the same micro-batches: counting over dp counts
            # each token once.
            check_micro_batch(mb, self.model_config, context_parallel=self.cp_groups is not None)
            targets.append(int((mb["labels"][:, 1:] != -100).sum()))
            local[0] += targets[-1]
            local[1] += mb["attention_mask"].sum()
            local[2] += micro_batch_flops(self.model_config, mb) // FLOP_UNIT  # host arithmetic, exact
        counts = host_to_device(local, self.device)  # queued, not waited for
        # The global counts are needed only by per_token_loss's first backward: overlap the
        # all-reduce with the first forward.
        pending = dist.all_reduce(counts, group=self.dp_group, async_op=True)
        scale = None
        accumulation = len(micro_batches)

        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        objective = torch.zeros((), dtype=torch.float32, device=self.device)
        last = len(micro_batches) - 1
        defer = self.recipe.parallel.fsdp_plan.defer_grad_sync
        for i, mb in enumerate(micro_batches):
            # By default every micro-batch's backward reduce-scatters into the gradient shards, so a
            # rank never holds more than its shard (plus one unit's unsharded gradient in flight).
            # defer_grad_sync skips the reduce-scatter until the last micro-batch: less communication,
            # but FSDP2 then keeps every trainable parameter's gradient unsharded on every rank.
            self.model.set_requires_gradient_sync(i == last or not defer)
            if loss_type == "per_sample_loss":
                # Every token of sample b weighs 1 / (its targets x the micro-batch's samples): made
                # on the host, moved with the batch (through pinned memory: no wait for the queue).
                neat = self.segments == "samples"
                weights = per_sample_weights(
                    mb["labels"], mb["attention_mask"], mb.get("cu_seqlens") if neat else None
                )
                mb = {**mb, "sample_weights": weights}
            batch = to_device(mb, self.device)
            if self.cp_groups is None:
                loss = self.model(**batch)
            else:
                # num_items 1: the summed token losses of the whole sequence, like the plain
                # forward. The CP loss reduction scales each rank's backward by cp, which
                # FSDP's average over dp x cp takes back out: the scales below stay right.
                loss = self.model(**batch, num_items_in_batch=1).loss
            if loss_type == "per_token_loss":
                if scale is None:
                    pending.wait()
                    # FSDP averages gradients over the dp ranks; multiplying by dp undoes that
                    # average, so the result is sum(token losses) / global targets.
                    scale = self.dims.dp / counts[0].clamp(min=1).to(torch.float32)
                step_scale = scale
            elif loss_type == "default":
                step_scale = 1.0 / (max(targets[i], 1) * accumulation)
            else:  # per_sample_loss: the weights already normalise within the micro-batch
                step_scale = 1.0 / accumulation
            (loss * step_scale).backward()
            loss_sum += loss.detach()  # summed token losses (per_sample_loss: their weighted sum)
            objective += loss.detach() * (1.0 if loss_type == "per_token_loss" else step_scale)
            self.after_micro_batch(i, last=i == last)
        return {"loss_sum": loss_sum, "objective": objective, "counts": counts}

    def after_micro_batch(self, index: int, *, last: bool) -> None:
        """Called after each micro-batch's backward (a no-op; subclasses measure memory here)."""

    def optimizer_step(
        self, loss_sum: torch.Tensor | None = None, counts: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Gradient norm (always) and clipping, AdamW at this step's learning rate, zero grads.

        ``loss_sum`` is this rank's ``objective``; ``counts`` the step's global counts
        (``forward_backward``). Returns device tensors: ``grad_norm`` and ``loss_sum`` summed over
        the dp ranks (the two travel in one all-reduce), the ``lr`` used, and under ``host`` the
        same values read back in the step's one synchronisation (with ``counts``), so that logging
        reads nothing more. Step k uses the schedule's value after k - 1 scheduler steps, as
        MindSpeed-MM reads the lr before ``scheduler.step()``: a warm-up run's first step has lr 0.
        """
        lr = lr_at(self.step, self.recipe.training)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if loss_sum is None:
            loss_sum = torch.zeros((), device=self.device)
        # The gradient shards span dp x cp; the loss sum is the same on every rank of a CP group,
        # so only CP rank 0 contributes it (the sum then counts each dp replica once).
        if self.cp_rank:
            loss_sum = torch.zeros_like(loss_sum)
        # (Preference training passes a vector: the pair-loss sum, then its metrics' sums.)
        grad_norm, global_loss_sum = grad_norm_and_sums(self.trainable, loss_sum, group=self.fsdp_group)
        # The one host synchronisation of a step: a non-finite loss or gradient norm must stop
        # (or skip) the step before AdamW writes NaN into the weights and the moments. Both
        # values are all-reduced, so every rank takes the same branch. The same read brings back
        # what the step's metrics line needs, before AdamW is queued: the device then runs the
        # update while the host already prepares the next step.
        host = read_step_values(grad_norm, global_loss_sum, counts)
        finite = math.isfinite(host["grad_norm"]) and math.isfinite(host["loss_sum"])
        skipped = False
        if not finite:
            self.nonfinite.not_finite(self.step + 1, host["grad_norm"], host["loss_sum"], lr)
            skipped = True
        else:
            clip_grads_(self.trainable, self.recipe.training.clip_grad, grad_norm)
            self.optimizer.step()
            self.nonfinite.applied(self.step + 1)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "grad_norm": grad_norm,
            "global_loss_sum": global_loss_sum,
            "lr": lr,
            "skipped": skipped,
            "host": host,
        }

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step; returns device tensors and the lr (one host synchronisation: the finiteness check)."""
        out = self.forward_backward(micro_batches)
        out.update(self.optimizer_step(out["objective"], out["counts"]))
        return out

    def evaluate(self) -> dict[str, Any] | None:
        """The mean validation loss over the whole split at this step (None without a split;
        ``validate.evaluate``; preference training: ``preference.evaluate_pairs``)."""
        if self.preference is not None:
            return evaluate_pairs(self.preference, self.val_data, step=self.step)
        return evaluate(
            self.model,
            self.val_data,
            step=self.step,
            loss_type=self.loss_type,
            device=self.device,
            device_type=self.device_type,
            dp_group=self.dp_group,
            context_parallel=self.cp_groups is not None,
        )

    def logged_loss(self, global_objective: float, targets: int) -> float:
        """The step's loss from the objectives summed over the dp ranks (MindSpeed-MM's logged value)."""
        if self.loss_type == "per_token_loss":
            return global_objective / max(targets, 1)
        return global_objective / self.dims.dp

    def _record(self, out: dict[str, Any]) -> dict[str, Any]:
        """The metrics.jsonl record of the step just taken, from the values the step's one
        synchronisation read back (``optimizer_step``; read here only if it did not)."""
        host = out.get("host")
        if host is None or host["counts"] is None:
            host = read_step_values(out["grad_norm"], out["global_loss_sum"], out["counts"])
        if self.preference is not None:
            # The means over the step's pairs (counts[3]).
            pairs = host["counts"][3]
            loss = host["sums"][0] / max(pairs, 1)
        else:
            loss = self.logged_loss(host["loss_sum"], host["counts"][0])
        record = step_record(
            self.step, loss, host, float(out["lr"]), bool(out.get("skipped")), self.device_type
        )
        if self.preference is not None:
            record.update(metrics_of(host["sums"][1:], pairs))
        return record

    def train(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        """Train to ``training.train_iters`` (or ``max_steps`` more steps); return the logged records."""
        training, tools = self.recipe.training, self.recipe.tools
        is_rank0 = self.rank == 0
        steps = StepLog(
            self.recipe,
            self.run_dir,
            step=self.step,
            rank=self.rank,
            device_type=self.device_type,
            world_size=self.world_size,
        )
        profiler = StepProfiler(tools.profile, self.run_dir, self.rank, self.device_type)
        mem_profiler = MemoryProfiler(tools.memory_profile, self.run_dir, self.rank, self.device_type)
        stop = training.train_iters if max_steps is None else min(training.train_iters, self.step + max_steps)
        # Skipped steps stop the run at SKIP_LIMIT in a row, or when every step of a shorter run is.
        self.nonfinite.limit_run(stop - self.step)
        last_saved = last_evaluated = self.step
        save_due = False  # a checkpoint held back while its step's update was skipped
        try:
            steps.restart_interval()
            while self.step < stop:
                step = self.step + 1
                profiler.before_step(step)
                mem_profiler.before_step(step)
                batches = [self._next_micro_batch() for _ in range(training.gradient_accumulation_steps)]
                out = self.train_step(batches)
                # A logged step waited for its forward and backward (the finiteness read): in steady
                # state its interval is the step period, the queued AdamW included.
                logged = step % training.log_interval == 0 or step == stop
                steps.step_taken(self._record(out) if logged else None)
                with steps.paused():
                    if (
                        self.val_data is not None
                        and training.eval_interval
                        and step % training.eval_interval == 0
                    ):
                        steps.validation(self.evaluate())
                        last_evaluated = step
                    if (
                        self.save_dir is not None
                        and training.save_interval
                        and step % training.save_interval == 0
                    ):
                        save_due = True
                        if self.nonfinite.streak and is_rank0:
                            log.warning(
                                "step %d was skipped: its checkpoint waits for the next applied update", step
                            )
                    if save_due and not self.nonfinite.streak:
                        # Never a checkpoint inside a run of skipped steps: one that reaches SKIP_LIMIT
                        # stops the run, and the newest checkpoint is then an update that was applied.
                        path = self.save()
                        last_saved, save_due = step, False
                        steps.message(f"checkpoint {path}")
                if training.manual_gc_interval and step % training.manual_gc_interval == 0:
                    gc.collect()
                mem_profiler.after_step(step)
                profiler.after_step(step)
            if (
                self.val_data is not None
                and self.step == training.train_iters
                and last_evaluated != self.step
            ):
                steps.validation(self.evaluate())  # the end of training: always one evaluation
            if (
                self.save_dir is not None
                and training.save_interval
                and self.step != last_saved
                and self.step == training.train_iters
            ):
                path = self.save()
                steps.message(f"checkpoint {path}")
        finally:
            steps.close()
        return steps.records

    def close(self, exit_status: int = 0, error: str | None = None) -> None:
        """Write summary.json (rank 0) and leave the process group if this trainer joined it.

        summary.json also says how many steps were skipped (``skipped_steps``), the last step whose
        update was applied (``last_applied_step``) and, for a failed run, its ``error``.
        """
        try:
            if self.rank == 0:
                extra: dict[str, Any] = {"error": error} if error else {}
                write_summary(
                    self.run_dir / "summary.json",
                    steps=self.step,
                    wall_s=time.monotonic() - self.started,
                    exit_status=exit_status,
                    skipped_steps=self.nonfinite.skipped,
                    last_applied_step=self.nonfinite.last_applied,
                    **extra,
                )
        finally:
            self._release()

    def _release(self) -> None:
        if self.recipe.training.manual_gc_interval:
            gc.enable()
        if self.recipe.training.freeze_gc_after_init:
            from magistral_cli.ops.gc_policy import release_at_exit

            release_at_exit()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
