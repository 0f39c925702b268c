"""Causal ring attention over a zigzag-sharded sequence, forward and backward.

Layout ("zigzag", load-balanced): the sequence is cut into ``2R`` equal chunks and ring rank
``j`` holds chunks ``j`` and ``2R-1-j``, concatenated. Key/value blocks travel around the
ring; at step ``s`` rank ``j`` holds the keys/values of rank ``src = (j - s) mod R`` and
computes exactly one of three blocks, each ``2c x c`` in size (``c`` = chunk length):

- ``s = 0``: its own keys, causal over its ``2c`` tokens (chunk ``j`` precedes chunk ``2R-1-j``);
- ``src < j``: every local query against the first chunk of ``src`` only (the second is later);
- ``src > j``: the local *second* chunk against both chunks of ``src``.

So every rank does the same work at every step and none waits on the others.

Blocks are merged with the online softmax in fp32: each block returns its output and
log-sum-exp (LSE) and ``out = sum_i exp(lse_i - lse) out_i``, ``lse = logaddexp(lse_i)``.

Backward is a custom :class:`torch.autograd.Function` (the FlashAttention / ring-flash
recipe): with the *final* output and LSE saved, every block's gradient is local
(``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dO * O))``), so the backward runs the same
ring once more, carrying each key/value block's ``dK, dV`` accumulator with it and one
extra hop returns the accumulators home. Autograd through differentiable send/recv was not
used: it would keep every block's probabilities alive for backward and it would need the
gradient of the LSE merge, which this formulation avoids.

Block kernels: ``MathBlockKernel`` is plain PyTorch in fp32 (it materialises one ``2c x c``
score block at a time) and runs on every device; ``CpuFlashBlockKernel`` is PyTorch's fused
CPU flash attention (the CPU default). ``BlockKernel`` is the seam for a fused CUDA or NPU
kernel (FlashAttention with LSE, ``npu_fusion_attention``): forward returns the block output
and LSE, backward gets the final output rows and LSE.
"""

from __future__ import annotations

from typing import Protocol

import torch

from magistral_cli.ops.context_parallel.comm import RingExchange


class BlockKernel(Protocol):
    def forward(self, q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out fp32 [B,H,Sq,D], lse fp32 [B,H,Sq])`` for one block."""

    def backward(self, dout, q, k, v, out, lse, delta, scale: float, causal: bool):
        """Return ``(dq, dk, dv)`` in fp32, given the FINAL output rows ``out`` (fp32), their
        LSE and ``delta = rowsum(dO * O)``."""


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(dim=2)


class MathBlockKernel:
    """Attention of one block in fp32 with plain matmuls (GQA by expanding K/V heads)."""

    def _scores(self, q, k, scale, causal):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return scores

    def forward(self, q, k, v, scale, causal):
        groups = q.shape[1] // k.shape[1]
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        scores = self._scores(q, k, scale, causal)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        return torch.matmul(probs, v.float()), lse

    def backward(self, dout, q, k, v, out, lse, delta, scale, causal):
        groups = q.shape[1] // k.shape[1]
        ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
        probs = torch.exp(self._scores(q, ke, scale, causal) - lse.unsqueeze(-1))
        dout = dout.float()
        dv = torch.matmul(probs.transpose(-1, -2), dout)
        dprobs = torch.matmul(dout, ve.float().transpose(-1, -2))
        dscores = probs * (dprobs - delta.unsqueeze(-1))
        dq = torch.matmul(dscores, ke.float()) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), q.float()) * scale
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


class CpuFlashBlockKernel:
    """PyTorch's fused CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``),
    which returns the LSE and whose backward takes the final output and LSE; no score block
    is materialised. The CPU default."""

    def forward(self, q, k, v, scale, causal):
        groups = q.shape[1] // k.shape[1]
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale
        )
        return out.float(), lse.float()

    def backward(self, dout, q, k, v, out, lse, delta, scale, causal):
        groups = q.shape[1] // k.shape[1]
        ke, ve = _expand_kv(k, groups).contiguous(), _expand_kv(v, groups).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q.contiguous(),
            ke,
            ve,
            out.to(q.dtype).contiguous(),
            lse.contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return dq.float(), _reduce_kv(dk.float(), groups), _reduce_kv(dv.float(), groups)


BLOCK_KERNELS = {"math": MathBlockKernel, "cpu_flash": CpuFlashBlockKernel}


def default_block_kernel(device: torch.device) -> BlockKernel:
    """The fused CPU kernel on the CPU; the fp32 math kernel elsewhere (a fused CUDA or NPU
    kernel plugs in through ``set_attention_backends(ring_kernel=...)``)."""
    return CpuFlashBlockKernel() if device.type == "cpu" else MathBlockKernel()


def _merge(out, lse, block_out, block_lse, rows: slice):
    """Online-softmax merge of a block into ``out[..., rows, :]`` / ``lse[..., rows]`` in place."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old_lse - new_lse).unsqueeze(-1) + block_out * torch.exp(
        block_lse - new_lse
    ).unsqueeze(-1)
    lse[:, :, rows] = new_lse


def _block_plan(step: int, ring_rank: int, ring_size: int, chunk: int):
    """``(query rows, key rows, causal)`` of the block computed at ``step`` (see module doc)."""
    src = (ring_rank - step) % ring_size
    if step == 0:
        return slice(None), slice(None), True
    if src < ring_rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, groups, kernel):
        ring_size, ring_rank = groups.ring_size, groups.ring_rank
        seq = q.shape[2]
        if seq % 2:
            raise ValueError(f"ring attention needs an even local length (two zigzag chunks), got {seq}")
        chunk = seq // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        exchange = RingExchange(groups.ring_ranks, ring_rank, groups.ring_group)
        kv = torch.stack((k, v))
        for step in range(ring_size):
            nxt = exchange.start(kv) if step < ring_size - 1 else None  # overlap with compute
            rows, cols, causal = _block_plan(step, ring_rank, ring_size, chunk)
            block_out, block_lse = kernel.forward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, causal
            )
            _merge(out, lse, block_out, block_lse, rows)
            if nxt is not None:
                exchange.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.groups, ctx.kernel = scale, groups, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        groups, kernel, scale = ctx.groups, ctx.kernel, ctx.scale
        ring_size, ring_rank = groups.ring_size, groups.ring_rank
        chunk = q.shape[2] // 2
        delta = (dout.float() * out).sum(dim=-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv_exchange = RingExchange(groups.ring_ranks, ring_rank, groups.ring_group)
        grad_exchange = RingExchange(groups.ring_ranks, ring_rank, groups.ring_group)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with kv
        for step in range(ring_size):
            nxt = kv_exchange.start(kv) if step < ring_size - 1 else None
            rows, cols, causal = _block_plan(step, ring_rank, ring_size, chunk)
            bq, bk, bv = kernel.backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                delta[:, :, rows],
                scale,
                causal,
            )
            dq[:, :, rows] += bq
            dkv[0][:, :, cols] += bk
            dkv[1][:, :, cols] += bv
            if ring_size > 1:
                # The accumulator follows its key/value block; after the last step this hop
                # brings every rank the complete gradient of its own keys and values.
                incoming = grad_exchange.start(dkv)
                grad_exchange.wait()
                dkv = incoming
            if nxt is not None:
                kv_exchange.wait()
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, groups, scale: float, kernel: BlockKernel | None = None) -> torch.Tensor:
    """Causal attention over the ring group for zigzag-sharded ``q, k, v`` ``[B, H, 2c, D]``.

    ``k`` and ``v`` may have fewer heads than ``q`` (GQA); they travel with their own head count.
    Returns ``[B, H, 2c, D]`` in ``q``'s dtype.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return _RingAttention.apply(q, k, v, scale, groups, kernel or default_block_kernel(q.device))
