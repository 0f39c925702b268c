"""Collator ``pixtral``: pads a micro-batch on the right and batches its images.

Each item is a dict from :class:`magistral_cli.data.loader.TrainDataset`: ``input_ids``,
``labels``, ``position_ids`` (int arrays of one length) and ``pixel_values`` (a list of
[3, h, w] float arrays, in the order of the sample's ``[IMG]`` blocks). The batch:

- ``input_ids`` [B, L], right padded with the pad id; ``labels`` [B, L], -100 on padding;
  ``attention_mask`` [B, L], 1 on real tokens; ``position_ids`` [B, L] (restarting per packed
  sample; padding continues counting so that it never looks like a new sequence);
- ``pixel_values`` [N, 3, H_max, W_max] zero-padded at the bottom/right like the Pixtral
  processor does, and ``image_sizes`` [N, 2] (height, width), images in the order their
  ``[IMG]`` blocks appear in the flattened batch; both absent when the batch has no image;
- with ``segments`` (packing), ``cu_seqlens`` [S + 1] int32: the attention segments over the
  flattened [B * L] tokens (``ops.packed_attention``). ``"samples"`` (neat_packing): each sample
  of a pack is a segment (an item's ``sample_lengths``); ``"rows"`` (plain packing): a row's real
  tokens are one segment. A row's padding is always a segment of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .encoder import IGNORE_INDEX

COLLATORS = ("pixtral",)
#: what an attention segment is in a packed batch (None: no segments, plain causal rows)
SEGMENT_MODES = (None, "rows", "samples")
#: A pair batch's entry naming each row's sample in the cache entry (int64 ``[2B]``; pair k is
#: samples 2k, 2k + 1): where precomputed reference log-probabilities are looked up. Not a model input.
SAMPLE_INDEX = "sample_index"


class PixtralCollator:
    def __init__(
        self,
        pad_token_id: int,
        ignore_pad_token_for_loss: bool = True,
        pad_to_multiple_of: int = 1,
        segments: str | None = None,
    ):
        if segments not in SEGMENT_MODES:
            raise ValueError(f"segments must be one of {SEGMENT_MODES}, got {segments!r}")
        self.segments = segments
        self.pad_token_id = int(pad_token_id)
        self.label_pad = IGNORE_INDEX if ignore_pad_token_for_loss else int(pad_token_id)
        self.pad_to_multiple_of = max(1, int(pad_to_multiple_of))

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(items)
        input_ids = np.full((batch, length), self.pad_token_id, dtype=np.int64)
        labels = np.full((batch, length), self.label_pad, dtype=np.int64)
        attention = np.zeros((batch, length), dtype=np.int64)
        positions = np.tile(np.arange(length, dtype=np.int64), (batch, 1))
        images: list[np.ndarray] = []
        ends: list[int] = []
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            input_ids[row, :n] = item["input_ids"]
            labels[row, :n] = item["labels"]
            attention[row, :n] = 1
            pos = np.asarray(item["position_ids"], dtype=np.int64)
            positions[row, :n] = pos
            positions[row, n:] = np.arange(pos[-1] + 1, pos[-1] + 1 + length - n) if n else positions[row, n:]
            images.extend(item["pixel_values"])
            if self.segments is not None:
                start = row * length
                lengths = item.get("sample_lengths", [n]) if self.segments == "samples" else [n]
                if sum(int(x) for x in lengths) != n:
                    raise ValueError(f"sample_lengths {list(lengths)} do not add up to the row's {n} tokens")
                for size in lengths:
                    if size:
                        start += int(size)
                        ends.append(start)
                if n < length:
                    ends.append((row + 1) * length)
        out = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attention),
            "position_ids": torch.from_numpy(positions),
        }
        if self.segments is not None:
            out["cu_seqlens"] = torch.tensor([0, *ends], dtype=torch.int32)
        if images:
            height = max(image.shape[1] for image in images)
            width = max(image.shape[2] for image in images)
            pixels = np.zeros((len(images), 3, height, width), dtype=np.float32)
            sizes = np.zeros((len(images), 2), dtype=np.int64)
            for i, image in enumerate(images):
                pixels[i, :, : image.shape[1], : image.shape[2]] = image
                sizes[i] = image.shape[1:]
            out["pixel_values"] = torch.from_numpy(pixels)
            out["image_sizes"] = torch.from_numpy(sizes)
        return out


class PairCollator:
    """Preference pairs as one batch: ``2B`` unpacked rows, or neat packs of whole pairs.

    Unpacked (``segments`` None), each item is ``{"chosen": item, "rejected": item}``
    (``loader.TrainDataset`` of a pair entry). Rows ``0..B-1`` are the chosen sequences of pairs
    ``0..B-1``, rows ``B..2B-1`` the rejected sequences of the same pairs in the same order: exactly
    what ``collator`` makes of the list ``[chosen_0, ..., chosen_{B-1}, rejected_0, ..., rejected_{B-1}]``,
    so ``pixel_values`` and ``image_sizes`` follow that row order (a pair's prompt images appear twice).

    Neat packing (``segments="samples"``): each item is a pack of whole pairs (chosen, rejected,
    chosen, rejected, ...), one row each, every sequence its own attention segment (``cu_seqlens``).

    Items that carry their cache samples (``SAMPLE_INDEX``, ``loader.TrainDataset``) add
    ``SAMPLE_INDEX``: one per row unpacked, one per sequence (in pack order) packed.
    """

    def __init__(self, collator: PixtralCollator):
        if collator.segments == "rows":
            raise ValueError(
                "preference pairs are packed neatly (segments 'samples'), never with attention across a row"
            )
        self.collator = collator

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        if self.collator.segments == "samples":
            out = self.collator(items)
            if all(SAMPLE_INDEX in item for item in items):
                indices = np.concatenate([np.asarray(item[SAMPLE_INDEX], dtype=np.int64) for item in items])
                out[SAMPLE_INDEX] = torch.from_numpy(indices)
            return out
        rows = [item["chosen"] for item in items] + [item["rejected"] for item in items]
        out = self.collator(rows)
        if all(SAMPLE_INDEX in row for row in rows):
            out[SAMPLE_INDEX] = torch.tensor([int(row[SAMPLE_INDEX]) for row in rows], dtype=torch.int64)
        return out


def pair_rows(batch: dict) -> int:
    """B, the pairs in a micro-batch of preference pairs (``PairCollator``): unpacked, its rows are
    ``2B``, chosen rows ``[:B]``, rejected rows ``[B:]``; neat packs hold ``2B`` sequences."""
    if "cu_seqlens" in batch:
        sequences = len(sequence_lengths(batch["attention_mask"], batch["cu_seqlens"]))
    else:
        sequences = int(batch["input_ids"].shape[0])
    if sequences % 2:
        raise ValueError(f"a batch of preference pairs has an even number of sequences, not {sequences}")
    return sequences // 2


def answer_counts(labels: torch.Tensor) -> torch.Tensor:
    """Each row's target count (float, host): the answer's tokens and its end of sequence."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).to(torch.float32)


@dataclass(frozen=True)
class PairLayout:
    """Where a host micro-batch of pairs keeps its sequences (host tensors, no device work).

    ``counts``: each sequence's target count (float), the chosen sequences of the ``pairs`` pairs
    first, then their rejected ones in the same order. Unpacked, that is the row order. In neat
    packs of whole pairs (``cu_seqlens``) the sequences come in pack order (chosen, rejected, chosen,
    ...): ``sequence_ids`` ``[B, L - 1]`` names the sequence of every target (the model sums each
    sequence's log-probabilities by it) and ``order`` puts the pack order chosen first.
    """

    pairs: int
    counts: torch.Tensor
    sequence_ids: torch.Tensor | None = None
    order: torch.Tensor | None = None

    @classmethod
    def of(cls, mb: dict) -> PairLayout:
        if "cu_seqlens" not in mb:
            return cls(pair_rows(mb), answer_counts(mb["labels"]))
        bounds = mb["cu_seqlens"].to(torch.int64)
        rows, length = mb["input_ids"].shape
        segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds[1:] - bounds[:-1]).view(
            rows, length
        )
        real = torch.zeros(len(bounds) - 1, dtype=torch.bool)
        real[segment[mb["attention_mask"].bool()]] = True  # padding segments hold no sequence
        number = torch.where(real, torch.cumsum(real.to(torch.int64), 0) - 1, 0)
        # The target at (r, c) is predicted by position c; a sequence's first label is never a target,
        # so no target is predicted across a boundary.
        sequence_ids = number[segment][:, :-1].contiguous()
        sequences = int(real.sum())
        if sequences % 2:
            raise ValueError(f"a pack of pairs holds an even number of sequences, not {sequences}")
        targets = mb["labels"][:, 1:] != IGNORE_INDEX
        counts = torch.bincount(sequence_ids[targets], minlength=sequences).to(torch.float32)
        order = torch.cat([torch.arange(0, sequences, 2), torch.arange(1, sequences, 2)])
        if SAMPLE_INDEX in mb:
            index = mb[SAMPLE_INDEX][order]
            pairs = sequences // 2
            if len(mb[SAMPLE_INDEX]) != sequences or not bool(
                ((index[:pairs] % 2 == 0) & (index[pairs:] == index[:pairs] + 1)).all()
            ):
                raise ValueError("a pack of pairs holds each pair's chosen sequence, then its rejected one")
        return cls(sequences // 2, counts[order], sequence_ids, order)


def sequence_lengths(attention_mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> list[int]:
    """The real-token lengths of a micro-batch's causal sequences (host tensors, no device work).

    Without ``cu_seqlens`` each row is one sequence (its non-padding tokens). With it, each
    attention segment is one (a neat pack's samples; a plain pack's rows); padding segments, which
    hold no real token, are left out.
    """
    mask = attention_mask.bool()
    if cu_seqlens is None:
        return [int(n) for n in mask.sum(dim=1).tolist() if n]
    bounds = cu_seqlens.to(torch.int64)
    segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds[1:] - bounds[:-1])
    counts = torch.bincount(segment[mask.reshape(-1)], minlength=len(bounds) - 1)
    return [int(n) for n in counts.tolist() if n]
