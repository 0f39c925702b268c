"""How a sequence is laid out over the CP ranks: padding, split and gather.

Ring (and Hybrid) use the zigzag layout: ``2R`` chunks, ring rank ``j`` holds chunks ``j`` and
``2R-1-j``. Inside one ring rank's part, the ``U`` Ulysses ranks hold contiguous pieces
(so the Ulysses all-to-all reassembles exactly that ring rank's part). Pure Ulysses is the
special case ``R = 1``: contiguous pieces of the whole sequence. The CP rank is
``ring_rank * U + ulysses_rank``.

Splitting is an ``index_select`` (differentiable: the gradient of a rank's part flows back to
the full sequence with zeros elsewhere, so the gradients of modules that run on the full
sequence, the embeddings and the vision tower, are per-rank partial sums like every other
gradient and add up over the CP group).
"""

from __future__ import annotations

import torch

from magistral_cli.ops.context_parallel.comm import gather_along_dim


def pad_multiple(ulysses_size: int, ring_size: int) -> int:
    """The sequence length must be a multiple of this (``U``, times ``2R`` with a ring)."""
    return ulysses_size * (2 * ring_size if ring_size > 1 else 1)


def padded_length(seq_len: int, ulysses_size: int, ring_size: int) -> int:
    m = pad_multiple(ulysses_size, ring_size)
    return -(-seq_len // m) * m


def pad_sequence(x: torch.Tensor, length: int, dim: int = 1, value: float | int = 0) -> torch.Tensor:
    """Pad ``x`` along ``dim`` at the end up to ``length`` with ``value`` (differentiable)."""
    extra = length - x.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad a length-{x.shape[dim]} sequence to {length}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_full(shape, value)), dim=dim)


def pad_position_ids(position_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Continue each row's positions into the padding (padding sits after every real token,
    so under causal attention it never affects them; its labels are ignored)."""
    extra = length - position_ids.shape[-1]
    if extra <= 0:
        return position_ids
    step = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
    return torch.cat((position_ids, position_ids[..., -1:] + step), dim=-1)


def shard_indices(seq_len: int, ulysses_size: int, ring_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by ``cp_rank``, in local order."""
    if seq_len % pad_multiple(ulysses_size, ring_size):
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of {pad_multiple(ulysses_size, ring_size)}; pad it first"
        )
    ring_rank, ulysses_rank = divmod(cp_rank, ulysses_size)
    if ring_size > 1:
        chunk = seq_len // (2 * ring_size)
        second = 2 * ring_size - 1 - ring_rank
        part = torch.cat(
            (
                torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk),
                torch.arange(second * chunk, (second + 1) * chunk),
            )
        )
    else:
        part = torch.arange(seq_len)
    piece = part.numel() // ulysses_size
    return part[ulysses_rank * piece : (ulysses_rank + 1) * piece]


def split_for_cp(x: torch.Tensor, groups, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full (padded) sequence along ``dim``."""
    index = shard_indices(x.shape[dim], groups.ulysses_size, groups.ring_size, groups.cp_rank)
    return x.index_select(dim, index.to(x.device))


def gather_from_cp(x: torch.Tensor, groups, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's part (inverse of :func:`split_for_cp`; differentiable)."""
    if groups.cp_size == 1:
        return x
    gathered = gather_along_dim(x, groups.cp_group, dim)
    seq_len = gathered.shape[dim]
    order = torch.cat(
        [shard_indices(seq_len, groups.ulysses_size, groups.ring_size, r) for r in range(groups.cp_size)]
    )
    return gathered.index_select(dim, torch.argsort(order).to(x.device))
