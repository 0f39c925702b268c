"""Preference training (``training.stage: dpo``): the reference model and the pair step.

The trainer keeps everything else (build, FSDP2, optimizer, checkpoints, resume, logging); under
``stage: dpo`` its ``forward_backward`` is ``PreferenceStep.forward_backward``:

- a micro-batch holds ``B`` pairs as ``2B`` rows, the chosen sequences first, then the rejected
  ones of the same pairs in the same order (``data``'s pair collation); the policy scores both in
  one forward (``Mistral3ForTraining(..., sequence_logps=True)``: each row's summed target
  log-probabilities, chunked like the SFT loss); with neat packing a micro-batch is packs of whole
  pairs instead, each sequence its own segment, summed per segment (``data.collator.PairLayout``);
- the reference scores the same rows under ``no_grad``: the policy itself with its LoRA adapters
  switched off (LoRA, ``ref_model: null``), or a frozen second model in the same FSDP2 layout
  (``reference_model``); orpo and simpo use none. With ``training.dpo.precompute_ref`` the
  reference's row sums were computed once before training (``engine.reference_logps``) and are
  looked up by each row's cache sample (``data.collator.SAMPLE_INDEX``): no reference in memory;
- the step's loss is the mean of the per-pair losses over every pair of the step (all micro-batches
  and data-parallel ranks): each micro-batch's backward is scaled by ``dp / global pairs``, and
  FSDP2's average over dp takes the ``dp`` back out, so the gradient does not depend on how the
  pairs are split.

The logged metrics (trl's names, ``ops.preference_loss.METRIC_NAMES``) are summed over the step's
pairs on the device and travel in the step's one all-reduce and one host read with the loss.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from magistral_cli.data.collator import SAMPLE_INDEX, PairLayout
from magistral_cli.errors import UserError
from magistral_cli.ops.preference_loss import METRIC_NAMES, PreferenceLoss
from magistral_cli.runtime import host_to_device

from .batch import check_micro_batch, to_device
from .metrics import FLOP_UNIT, micro_batch_flops

log = logging.getLogger("magistral_cli.engine")


def preference_loss(recipe) -> PreferenceLoss:
    """The recipe's ``training.dpo`` loss settings."""
    dpo = recipe.training.dpo
    return PreferenceLoss(
        loss=dpo.loss,
        beta=dpo.beta,
        label_smoothing=dpo.label_smoothing,
        ftx=dpo.ftx,
        simpo_gamma=dpo.simpo_gamma,
    )


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base: every PEFT LoRA layer's adapters switched off (no parameter or
    ``requires_grad`` changes, so FSDP2's parameter groups stay as built)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, state in zip(layers, before, strict=True):
            m._disable_adapters = state


def reference_model_kind(recipe) -> str | None:
    """What computes the reference's log-probabilities (while training, or in the precompute pass):
    "model" (a frozen second model), "adapters off" (the LoRA policy's base: LoRA with no
    ``ref_model``) or None (sft, or a loss without one: orpo, simpo)."""
    train = recipe.training
    if train.stage != "dpo" or not train.dpo.needs_reference:
        return None
    if train.dpo.ref_model is None and recipe.model.lora is not None:
        return "adapters off"
    return "model"


def reference_kind(recipe) -> str | None:
    """What serves as the reference while training: ``reference_model_kind``, or "precomputed"
    (``training.dpo.precompute_ref``: stored log-probabilities, no reference in memory)."""
    kind = reference_model_kind(recipe)
    if kind is not None and recipe.training.dpo.precompute_ref:
        return "precomputed"
    return kind


def reference_source(recipe) -> str | None:
    """Where a separate reference model's weights come from (None: ``reference_model_kind`` is not "model").

    ``ref_model`` when set; else (without LoRA) the starting weights, ``training.load``.
    """
    if reference_model_kind(recipe) != "model":
        return None
    dpo = recipe.training.dpo
    if dpo.ref_model is not None:
        return dpo.ref_model
    if not recipe.training.load:
        raise UserError(
            "training.stage: dpo without LoRA compares with a frozen copy of the starting weights, but "
            "training.load is not set; set training.load to the model directory or training.dpo.ref_model"
        )
    return recipe.training.load


def model_inputs(mb: dict, device: torch.device) -> dict:
    """A host micro-batch of pairs as the model's inputs on ``device`` (its ``SAMPLE_INDEX`` left out)."""
    return to_device({k: v for k, v in mb.items() if k != SAMPLE_INDEX}, device)


class PreferenceStep:
    """``forward_backward`` of a ``stage: dpo`` trainer (the trainer's model, groups and counts).

    ``reference``: the frozen reference model, or None; ``stored``: the precomputed reference row
    sums of every sample of the cache entry (host fp32, ``engine.reference_logps``), or None.
    """

    def __init__(self, trainer, reference: nn.Module | None):
        self.trainer = trainer
        self.loss = preference_loss(trainer.recipe)
        self.reference = reference
        #: ``training.dpo.precompute_ref``: the trainer sets ``stored`` before the first step.
        self.precomputed = reference_kind(trainer.recipe) == "precomputed"
        self.stored: torch.Tensor | None = None
        self.uses_adapters_off = self.loss.needs_reference and reference is None and not self.precomputed
        if self.uses_adapters_off and trainer.lora is None:
            raise ValueError("a reference-model loss without LoRA needs a reference model")

    @property
    def live_reference(self) -> bool:
        """Whether each step runs a reference forward (not with precomputed log-probabilities)."""
        return self.loss.needs_reference and not self.precomputed

    def reference_logps(self, batch: dict, mb: dict | None = None) -> torch.Tensor | None:
        """Each row's summed target log-probabilities under the reference (None: the loss uses none).

        ``batch`` is the device micro-batch; ``mb`` the host one, whose ``SAMPLE_INDEX`` finds the
        precomputed sums (needed then).
        """
        if not self.loss.needs_reference:
            return None
        if self.precomputed:
            if self.stored is None or mb is None or SAMPLE_INDEX not in mb:
                raise ValueError(
                    "precomputed reference log-probabilities need stored sums and a sample_index"
                )
            return host_to_device(self.stored[mb[SAMPLE_INDEX]], self.trainer.device)
        with torch.no_grad():
            if self.reference is not None:
                return self.reference(**batch, sequence_logps=True)
            with adapters_off(self.trainer.model):
                return self.trainer.model(**batch, sequence_logps=True)

    def scored(self, mb: dict, layout: PairLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses, per-pair metrics) of one host micro-batch (its ``PairLayout``)."""
        device = self.trainer.device
        batch = model_inputs(mb, device)
        if layout.sequence_ids is not None:
            batch["sequence_ids"] = host_to_device(layout.sequence_ids, device)
            batch["num_sequences"] = len(layout.counts)
        ref = self.reference_logps(batch, mb)
        logps = self.trainer.model(**batch, sequence_logps=True)
        if layout.order is not None:  # pack order -> chosen first
            order = host_to_device(layout.order, device)
            logps = logps[order]
            ref = None if ref is None else ref[order]
        counts = host_to_device(layout.counts, device)
        pairs = layout.pairs
        return self.loss(
            logps[:pairs],
            logps[pairs:],
            counts[:pairs],
            counts[pairs:],
            None if ref is None else ref[:pairs],
            None if ref is None else ref[pairs:],
        )

    def forward_backward(self, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
        """Forward and backward over this rank's micro-batches of pairs.

        Returns device tensors: ``loss_sum`` and ``objective`` (both the vector ``[sum of pair
        losses, sums of the METRIC_NAMES]`` over this rank's pairs) and ``counts`` (global targets,
        tokens, model FLOPs in ``FLOP_UNIT``s, pairs).
        """
        t = self.trainer
        local = torch.zeros(4, dtype=torch.int64)  # targets, tokens, model FLOPs (FLOP_UNITs), pairs
        layouts = []
        for mb in micro_batches:
            check_micro_batch(mb, t.model_config, context_parallel=False)
            layouts.append(PairLayout.of(mb))
            local[3] += layouts[-1].pairs
            local[0] += int(layouts[-1].counts.sum())
            local[1] += mb["attention_mask"].sum()
            flops = micro_batch_flops(t.model_config, mb)
            if self.live_reference:
                flops += flops // 3  # the reference's forward: a third of a training step's FLOPs
            local[2] += flops // FLOP_UNIT
        counts = host_to_device(local, t.device)
        pending = dist.all_reduce(counts, group=t.dp_group, async_op=True)
        sums = torch.zeros(1 + len(METRIC_NAMES), dtype=torch.float32, device=t.device)
        scale = None
        last = len(micro_batches) - 1
        defer = t.recipe.parallel.fsdp_plan.defer_grad_sync
        for i, mb in enumerate(micro_batches):
            t.model.set_requires_gradient_sync(i == last or not defer)
            losses, metrics = self.scored(mb, layouts[i])
            if scale is None:
                pending.wait()
                # The mean over the step's pairs on every rank: FSDP2 averages the gradients over dp.
                scale = t.dims.dp / counts[3].clamp(min=1).to(torch.float32)
            (losses.sum() * scale).backward()
            sums[0] += losses.detach().sum()
            sums[1:] += metrics.sum(dim=0)
            t.after_micro_batch(i, last=i == last)
        return {"loss_sum": sums, "objective": sums, "counts": counts}


def metrics_of(sums: list[float], pairs: int) -> dict[str, float]:
    """A step's (or an evaluation's) preference metrics: the means over its pairs."""
    n = max(pairs, 1)
    return {name: value / n for name, value in zip(METRIC_NAMES, sums, strict=True)}


def evaluate_pairs(step_obj: PreferenceStep, val_data, *, step: int) -> dict | None:
    """The validation split's preference loss and metrics at this step: means over its pairs.

    As ``validate.evaluate``: every dp rank runs its share (filler micro-batches carry no targets
    and count nothing), no gradient, dropout off, the RNG states restored afterwards.
    """
    from .validate import evaluating

    if val_data is None:
        return None
    t = step_obj.trainer
    sums = torch.zeros(2 + len(METRIC_NAMES), dtype=torch.float32, device=t.device)  # pairs, loss, metrics
    with evaluating(t.model, t.device_type):
        for mb in val_data:
            layout = PairLayout.of(mb)
            losses, metrics = step_obj.scored(mb, layout)
            if not int(layout.counts.sum()):
                continue  # a filler: the forwards ran for FSDP's collectives, nothing to count
            sums[0] += layout.pairs
            sums[1] += losses.sum()
            sums[2:] += metrics.sum(dim=0)
    dist.all_reduce(sums, group=t.dp_group)
    pairs, loss, *metric_sums = sums.tolist()
    record = {
        "step": step,
        "split": "val",
        "loss": loss / pairs if pairs else float("nan"),
        "pairs": int(pairs),
    }
    record.update(metrics_of(metric_sums, int(pairs)))
    return record
