"""Validation: the loss over the validation split (``evaluate``) and its metrics line (``log_validation``)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from magistral_cli.ops.attention import validate_right_padding

from .batch import per_sample_weights, to_device
from .metrics import MetricsFile, Progress
from .rng import rng_state, set_rng_state

log = logging.getLogger("magistral_cli.engine")


@contextlib.contextmanager
def evaluating(model: torch.nn.Module, device_type: str) -> Iterator[None]:
    """An evaluation's set-up: no gradient, dropout off, and afterwards the model's mode and the RNG
    states as they were, so that the training that follows is what it would have been without it."""
    saved_rng = rng_state(device_type)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        set_rng_state(saved_rng, device_type)


def evaluate(
    model: torch.nn.Module,
    val_data,
    *,
    step: int,
    loss_type: str,
    device: torch.device,
    device_type: str,
    dp_group,
    context_parallel: bool,
) -> dict[str, Any] | None:
    """The mean validation loss over the whole split at this step (None without a split).

    The loss definition is training's (``features.loss_cfg.loss_type``) over the split:
    ``per_token_loss`` the summed token losses over all targets, ``default`` the mean of the
    micro-batches' token means, ``per_sample_loss`` the mean of the samples' token means. Every
    dp rank runs its share (the same number of forwards; filler micro-batches carry no targets)
    and the sums are all-reduced over dp; the ranks of a CP group compute the same sums. No
    gradient, dropout off, and the RNG states are restored afterwards: the training that follows
    is exactly what it would have been without the evaluation.
    """
    if val_data is None:
        return None
    sums = torch.zeros(3, dtype=torch.float32, device=device)  # numerator, denominator, targets
    with evaluating(model, device_type):
        for mb in val_data:
            validate_right_padding(mb["attention_mask"])
            per_sample = (mb["labels"][:, 1:] != -100).sum(dim=1)
            targets = int(per_sample.sum())
            if loss_type == "per_sample_loss":
                weights = per_sample_weights(mb["labels"], mb["attention_mask"], mean=False)
                mb = {**mb, "sample_weights": weights}
            batch = to_device(mb, device)
            if not context_parallel:
                loss = model(**batch)
            else:
                loss = model(**batch, num_items_in_batch=1).loss
            if not targets:
                continue  # a filler: the forward ran for FSDP's collectives, nothing to count
            loss = loss.detach().float()
            if loss_type == "per_token_loss":
                part = torch.stack([loss, loss.new_tensor(float(targets))])
            elif loss_type == "default":
                part = torch.stack([loss / targets, loss.new_tensor(1.0)])
            else:  # per_sample_loss: the weighted sum is the sum of the sample means
                part = torch.stack([loss, loss.new_tensor(float((per_sample > 0).sum()))])
            sums[:2] += part
            sums[2] += targets
    dist.all_reduce(sums, group=dp_group)
    numerator, denominator, targets = sums.tolist()
    record = {
        "step": step,
        "split": "val",
        "loss": numerator / denominator if denominator else float("nan"),
        "samples": int(getattr(val_data, "num_samples", 0)) or None,
        "targets": int(targets),
    }
    return record


def log_validation(
    record: dict[str, Any], metrics: MetricsFile | None, progress: Progress, *, rank: int
) -> None:
    """An evaluation's record into metrics.jsonl (rank 0 holds ``metrics``) and the progress line."""
    if metrics is not None:
        metrics.write(record)
    progress.validation(record)
    if rank == 0 and not math.isfinite(record["loss"]):
        log.warning("step %d: the validation loss is not finite", record["step"])
