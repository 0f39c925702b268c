"""Packing: several samples concatenated into one sequence of at most ``cutoff_len`` tokens.

Packs are planned from the cached sample lengths when the loader is built (so switching
``packing`` on or off does not re-encode anything). The plan is LLaMA-Factory's greedy
knapsack, deterministic for given lengths. Position ids restart at 0 for every sample in a pack,
and a sample's first token is never a target, so the loss never crosses a sample boundary.

Two modes, the same on every device (``segment_mode``; the attention is ``ops.packed_attention``):

- ``packing: true``: attention is causal across the samples of a pack, as the seed documents;
- ``neat_packing: true`` (which turns ``packing`` on): each sample attends to its own tokens only,
  so a pack trains exactly like its samples one by one. Under ``training.stage: dpo`` only this mode
  is allowed, and a pack holds whole pairs (``loader.build_train_dataset``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


def segment_mode(recipe) -> str | None:
    """What an attention segment of a training batch is: ``"samples"`` (neat_packing), ``"rows"``
    (plain packing) or None (no packing; or context parallelism, whose attention is causal over
    the whole sequence, which is plain packing's meaning, and which refuses neat_packing)."""
    basic = recipe.data.dataset_param.basic_parameters
    if not (basic.packing or basic.neat_packing) or recipe.parallel.cp_size > 1:
        return None
    return "samples" if basic.neat_packing else "rows"


def packing_units(sample_lengths, cutoff_len: int, *, pairs: bool) -> tuple[np.ndarray, int]:
    """(the lengths of what is packed, a pack's capacity): samples up to ``cutoff_len``, or in a pair
    entry whole pairs (sample 2k with 2k + 1) up to ``2 x cutoff_len``, each sequence up to ``cutoff_len``."""
    lengths = np.asarray(sample_lengths, dtype=np.int64)
    if not pairs:
        return lengths, int(cutoff_len)
    return lengths[0::2] + lengths[1::2], 2 * int(cutoff_len)


def plan_packs(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Groups of sample indices whose lengths add up to at most ``capacity``.

    Each pack takes the longest remaining sample that still fits, until none does (binary
    search over the sorted lengths, as LLaMA-Factory's ``greedy_knapsack``).
    """
    items = sorted((int(length), index) for index, length in enumerate(np.asarray(lengths, dtype=np.int64)))
    if items and items[-1][0] > capacity:
        raise ValueError(
            f"sample {items[-1][1]} has {items[-1][0]} tokens, more than the pack capacity {capacity}"
        )
    packs: list[list[int]] = []
    while items:
        pack: list[int] = []
        room = capacity
        while True:
            # the last item with length <= room (ties: the highest index sorts last)
            at = bisect.bisect_right(items, (room, len(lengths)))
            if at == 0:
                break
            length, index = items.pop(at - 1)
            room -= length
            pack.append(index)
        # Within a pack keep dataset order, so a pack reads like consecutive samples.
        packs.append(sorted(pack))
    return packs


# ----------------------------------------------------------------------------- padding estimate

#: Bins of the preprocess report's ``length_histogram``: ``ceil(cutoff_len / 256)`` tokens wide
#: (8 at a cutoff_len of 2048), a few KiB of JSON for any number of samples.
LENGTH_BINS = 256


def length_histogram(lengths, cutoff_len: int) -> dict:
    """The kept samples' lengths in fixed bins: JSON-friendly, the same size for any dataset.

    Bin ``i`` holds the lengths in ``(i * bin_width, (i + 1) * bin_width]``, ``bin_width =
    ceil(cutoff_len / LENGTH_BINS)``, up to ``cutoff_len`` (or the longest sample, were one
    longer): ``counts[i]`` samples with ``tokens[i]`` tokens together, so each bin's mean
    length is known (``histogram_lengths``).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    width = max(1, -(-int(cutoff_len) // LENGTH_BINS))
    top = max(int(cutoff_len), int(lengths.max()) if len(lengths) else 0, 1)
    bins = -(-top // width)
    index = np.clip((lengths - 1) // width, 0, bins - 1)
    return {
        "bin_width": width,
        "counts": np.bincount(index, minlength=bins).tolist(),
        "tokens": np.bincount(index, weights=lengths, minlength=bins).round().astype(np.int64).tolist(),
    }


def histogram_lengths(histogram: dict) -> np.ndarray:
    """Sample lengths that reproduce a ``length_histogram``, ascending: each bin's samples get its
    mean length (``tokens // counts``, one token more for ``tokens % counts`` of them), so every
    bin keeps its token total and its lengths stay inside the bin."""
    counts = np.asarray(histogram["counts"], dtype=np.int64)
    tokens = np.asarray(histogram["tokens"], dtype=np.int64)
    width = int(histogram["bin_width"])
    if counts.shape != tokens.shape or counts.ndim != 1 or width < 1:
        raise ValueError("a length histogram needs bin_width >= 1 and counts and tokens of one length")
    low = np.arange(len(counts)) * width
    if (counts < 0).any() or (tokens < counts * (low + 1)).any() or (tokens > counts * (low + width)).any():
        raise ValueError("a length histogram's bins must hold counts >= 0 of lengths inside their bin")
    parts = []
    for count, total in zip(counts.tolist(), tokens.tolist(), strict=True):
        if count:
            base, extra = divmod(total, count)
            parts.append(np.repeat(np.array([base, base + 1], dtype=np.int64), [count - extra, extra]))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def pack_lengths(lengths, capacity: int) -> np.ndarray:
    """The token count of every pack ``plan_packs(lengths, capacity)`` makes (ascending), without
    planning sample by sample: the same greedy knapsack over the distinct lengths and their counts,
    with a run of identical packs taken at once. Fast for a million samples."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    if len(values) and values[-1] > capacity:
        raise ValueError(f"a sample has {int(values[-1])} tokens, more than the pack capacity {capacity}")
    left = dict(zip(values.tolist(), counts.tolist(), strict=True))
    available = sorted(left)  # the distinct lengths with samples left, ascending
    totals: list[int] = []
    repeats: list[int] = []
    while available:
        room, used, emptied = capacity, {}, False
        while (at := bisect.bisect_right(available, room)) > 0:
            value = available[at - 1]
            take = min(left[value], room // value)  # the longest that fits, as often as it fits
            used[value] = take
            left[value] -= take
            room -= take * value
            if not left[value]:
                del available[at - 1]
                emptied = True
        # Unless a length ran out, the next packs find the same lengths and room: the same pack,
        # as long as every length it takes has enough samples left.
        more = 0 if emptied else min(left[value] // n for value, n in used.items())
        if more:
            for value, n in used.items():
                left[value] -= more * n
                if not left[value]:
                    available.remove(value)
        totals.append(capacity - room)
        repeats.append(1 + more)
    return np.sort(np.repeat(np.asarray(totals, dtype=np.int64), repeats))


@dataclass(frozen=True)
class PaddingEstimate:
    """What the micro-batches of one epoch hold, on average over the sampler's random orders.

    ``rows``: samples (no packing) or packs; ``micro_batches``: full micro-batches of them per
    epoch, all data-parallel ranks together (``rows // micro_batch_size``, the incomplete one
    dropped); ``real_tokens`` and ``padded_tokens``: a micro-batch's mean token count without
    and with its padding (rows padded to the micro-batch's longest row, as the collator does);
    ``real_fraction``: their ratio over the epoch.
    """

    rows: int
    micro_batches: int
    real_tokens: float
    padded_tokens: float
    real_fraction: float | None


def expected_padding(row_lengths, micro_batch_size: int) -> PaddingEstimate:
    """The exact expectation over random orders of rows of ``row_lengths`` cut into micro-batches.

    A micro-batch is ``m = micro_batch_size`` rows drawn without replacement; it is padded to
    its longest row, whose expectation follows from ``P(max <= v) = C(c(v), m) / C(n, m)``
    (``c(v)``: the rows of at most ``v`` tokens). No random draw: deterministic, no noise.
    """
    rows = np.sort(np.asarray(row_lengths, dtype=np.int64))
    n, m = len(rows), int(micro_batch_size)
    if n < m:
        return PaddingEstimate(n, 0, 0.0, 0.0, None)
    values, counts = np.unique(rows, return_counts=True)
    at_most = np.cumsum(counts).astype(np.float64)
    cdf = np.ones_like(at_most)
    for j in range(m):
        cdf *= np.clip(at_most - j, 0, None) / (n - j)
    longest = float(np.dot(values, np.diff(cdf, prepend=0.0)))
    real = m * float(rows.mean())
    padded = m * longest
    return PaddingEstimate(n, n // m, real, padded, real / padded if padded else None)


def estimate_padding(
    cutoff_len: int, micro_batch_size: int, *, lengths=None, histogram: dict | None = None
) -> dict[str, PaddingEstimate]:
    """Padding of a dataset's micro-batches without packing (``"none"``) and with it (``"packing"``).

    From the samples' ``lengths`` (exact) or a ``length_histogram`` (each bin's samples taken at
    its mean length, see ``histogram_lengths``). Packing plans packs of at most ``cutoff_len``
    tokens as ``plan_packs`` does; ``packing`` and ``neat_packing`` make the same packs and pad
    them the same (they differ in attention only).
    """
    if (lengths is None) == (histogram is None):
        raise ValueError("give the sample lengths or a length histogram, one of the two")
    samples = histogram_lengths(histogram) if histogram is not None else np.asarray(lengths, dtype=np.int64)
    return {
        "none": expected_padding(samples, micro_batch_size),
        "packing": expected_padding(pack_lengths(samples, cutoff_len), micro_batch_size),
    }
