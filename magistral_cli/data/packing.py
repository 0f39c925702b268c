"""Packing: several samples concatenated into one sequence of at most ``cutoff_len`` tokens.

Packs are planned from the cached sample lengths when the loader is built (so switching
``packing`` on or off does not re-encode anything). The plan is LLaMA-Factory's greedy
knapsack, deterministic for given lengths. Position ids restart at 0 for every sample in a pack,
and a sample's first token is never a target, so the loss never crosses a sample boundary.

Two modes, the same on every device (``segment_mode``; the attention is ``ops.packed_attention``):

- ``packing: true``: attention is causal across the samples of a pack, as the seed documents;
- ``neat_packing: true`` (which turns ``packing`` on): each sample attends to its own tokens only,
  so a pack trains exactly like its samples one by one.
"""

from __future__ import annotations

import bisect

import numpy as np


def segment_mode(recipe) -> str | None:
    """What an attention segment of a training batch is: ``"samples"`` (neat_packing), ``"rows"``
    (plain packing) or None (no packing; or context parallelism, whose attention is causal over
    the whole sequence, which is plain packing's meaning, and which refuses neat_packing)."""
    basic = recipe.data.dataset_param.basic_parameters
    if not (basic.packing or basic.neat_packing) or recipe.parallel.cp_size > 1:
        return None
    return "samples" if basic.neat_packing else "rows"


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
