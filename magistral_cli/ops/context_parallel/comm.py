"""The collectives of context parallelism, with the autograd rules they need.

All of them run on gloo (CPU), NCCL and HCCL: ``all_to_all_single``, ``all_reduce``,
``all_gather`` and ``batch_isend_irecv``. Each call is recorded by
:func:`groups.record_cp_communication`, so a replicated module (the vision tower) can be
checked to issue none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from magistral_cli.ops.context_parallel.groups import record_cp_communication

# --------------------------------------------------------------------------- Ulysses all-to-all


def _seq_to_head(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[B, H, S/u, D]`` sequence-sharded -> ``[B, H/u, S, D]`` head-sharded."""
    record_cp_communication("ulysses all_to_all")
    b, h, s, d = x.shape
    send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()  # [u, B, H/u, S/u, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[r] is source rank r's sequence piece; pieces are contiguous in rank order.
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _head_to_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[B, H/u, S, D]`` head-sharded -> ``[B, H, S/u, D]`` sequence-sharded."""
    record_cp_communication("ulysses all_to_all")
    b, h, s, d = x.shape
    send = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()  # [u, B, H/u, S/u, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[r] holds head block r for this rank's sequence piece.
    return recv.transpose(0, 1).reshape(b, size * h, s // size, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _seq_to_head(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad.contiguous(), ctx.group, ctx.size), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _head_to_seq(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.group, ctx.size), None, None


def seq_to_head(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Differentiable Ulysses all-to-all, ``[B, H, S/u, D]`` -> ``[B, H/u, S, D]``."""
    if x.shape[1] % size:
        raise ValueError(f"{x.shape[1]} heads do not divide over {size} Ulysses ranks")
    return _SeqToHead.apply(x, group, size)


def head_to_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Differentiable inverse of :func:`seq_to_head`."""
    return _HeadToSeq.apply(x, group, size)


# --------------------------------------------------------------------------- loss reduction


class _SumAcrossRanks(torch.autograd.Function):
    """Forward: all-reduce SUM. Backward: the gradient times the group size, no communication.

    Every CP rank back-propagates the same summed loss, and the true gradient of that sum with
    respect to this rank's part is the incoming gradient: no reduction belongs in backward. The
    factor ``size`` makes every CP rank's parameter gradients ``size`` x its partial gradient,
    so that the ordinary data-parallel *average* over ``dp x cp`` (FSDP2's default over the
    ``dp_cp`` mesh) yields the sum of the CP partial gradients, averaged over DP: the trainer
    needs no special gradient divide factor (and gloo has no PREMUL_SUM to set one).
    """

    @staticmethod
    def forward(ctx, x, group):
        record_cp_communication("loss all_reduce")
        ctx.size = dist.get_world_size(group)
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


def sum_across_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over ``group``; see :class:`_SumAcrossRanks` for the gradient it sends back."""
    if group is None:
        return x
    return _SumAcrossRanks.apply(x, group)


# --------------------------------------------------------------------------- gather


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        record_cp_communication("all_gather")
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_along_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order (differentiable)."""
    if group is None:
        return x
    return _GatherAlongDim.apply(x, group, dim)


# --------------------------------------------------------------------------- ring point-to-point


class RingExchange:
    """Send a tensor to the next ring rank and receive the previous rank's, asynchronously."""

    def __init__(self, ring_ranks: tuple[int, ...], ring_rank: int, group):
        self.group = group
        n = len(ring_ranks)
        self.next = ring_ranks[(ring_rank + 1) % n]
        self.prev = ring_ranks[(ring_rank - 1) % n]
        self._works: list = []

    def start(self, tensor: torch.Tensor) -> torch.Tensor:
        record_cp_communication("ring send/recv")
        tensor = tensor.contiguous()
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        self._works = dist.batch_isend_irecv(ops)
        self._keep = tensor  # the send buffer must live until the send completes
        return recv

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
        self._keep = None
