"""A host micro-batch on its way into the model: the checks a training step makes of it on the host
(``check_micro_batch``), which entries go to the device (``to_device``) and the ``per_sample_loss``
weights of its tokens (``per_sample_weights``, shared by training and validation)."""

from __future__ import annotations

from typing import Any

import torch

from magistral_cli.errors import UserError
from magistral_cli.ops.attention import validate_right_padding
from magistral_cli.ops.packed_attention import packed_inputs
from magistral_cli.runtime import host_to_device

from .model import check_image_tokens, sequential_positions

#: Batch entries the model reads on the host.
HOST_KEYS = frozenset({"image_sizes"})


def check_micro_batch(mb: dict[str, torch.Tensor], model_config, *, context_parallel: bool) -> None:
    """A training micro-batch's host-side checks (no device sync): right padding (a UserError under
    context parallelism), image tokens that match its images, and 0..L-1 positions when unpacked."""
    try:
        validate_right_padding(mb["attention_mask"])
    except ValueError as exc:
        if not context_parallel:
            raise
        raise UserError(f"context parallelism: {exc}") from None
    check_image_tokens(model_config, mb["input_ids"], mb.get("image_sizes"))
    if "cu_seqlens" not in mb and "position_ids" in mb and not sequential_positions(mb["position_ids"]):
        raise ValueError("an unpacked micro-batch's position_ids must be 0..L-1 in every row")


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The model's inputs on ``device``; a packed batch's ``cu_seqlens`` becomes the packed
    attention's arguments (``ops.packed_attention.packed_inputs``: device offsets, host ints)."""
    # ``image_sizes`` stays on the host: the model only slices and counts with it
    # (``Mistral3ForTraining.embed_inputs``), and a device copy would be read back every forward.
    # Through pinned memory (the loader's batches are pinned already; synthetic ones are not): a
    # copy from pageable memory would make the host wait for the queued AdamW of the last step.
    out: dict[str, Any] = {
        k: v if k in HOST_KEYS else host_to_device(v, device) for k, v in batch.items() if k != "cu_seqlens"
    }
    if "cu_seqlens" in batch:
        out.update(packed_inputs(batch["cu_seqlens"], tuple(batch["input_ids"].shape), device))
    return out


def per_sample_weights(
    labels: torch.Tensor, attention_mask: torch.Tensor, cu_seqlens=None, *, mean: bool = True
) -> torch.Tensor:
    """``per_sample_loss`` weights of a host micro-batch: each sample's tokens weigh
    1 / (its targets x the micro-batch's samples).

    A row is a sample (``[B]`` weights), except in a neat pack (``cu_seqlens`` of a collator with
    ``segments="samples"``), where each packed sample is one (``[B, L - 1]`` target weights), so a
    neat pack weighs its samples as a micro-batch of them one by one would. ``mean=False`` (rows
    only) leaves out the division by the samples: the weighted loss is then the sum of the samples'
    token means, which an evaluation adds up over the whole split.
    """
    targets = labels[:, 1:] != -100
    if cu_seqlens is None:
        per_sample = targets.sum(dim=1).to(torch.float32)
        weights = torch.where(per_sample > 0, 1.0 / per_sample.clamp(min=1), 0.0)
        return weights / len(per_sample) if mean else weights
    bounds = cu_seqlens.to(torch.int64)
    segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds[1:] - bounds[:-1]).view(
        labels.shape
    )
    samples = int(torch.unique(segment[attention_mask.bool()]).numel())  # padding segments are no samples
    target_segment = segment[:, 1:]
    counts = torch.bincount(target_segment[targets], minlength=len(bounds) - 1).to(torch.float32)
    weights = 1.0 / counts.clamp(min=1)[target_segment] / max(samples, 1)
    return torch.where(targets, weights, 0.0)
