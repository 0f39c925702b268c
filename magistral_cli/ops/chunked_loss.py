"""Token-level cross entropy over the output projection, optionally in chunks of tokens.

The plain path computes ``logits = hidden @ W.T`` for every token and lets autograd keep them
for the backward. Over Magistral's 131072-token vocabulary that is 512 KiB per token in fp32,
so a 2048-token sequence holds 1 GiB of logits plus their gradient. The chunked path
(``ChunkedCrossEntropy``) computes the loss *and* both gradients chunk by chunk during the
forward, keeps only ``d loss / d hidden`` and ``d loss / d W`` (the sizes of the inputs), and
scales them by the incoming gradient in the backward. No chunk's logits outlive the chunk.

Both paths return the **sum** of the per-token losses over the non-ignored targets; the caller
normalises (the trainer divides by the global number of target tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _chunk_loss_and_grad_logits(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted sum of cross entropy, d sum / d logits) for one chunk; ``logits`` is fp32 and reused in place."""
    valid = (labels != IGNORE_INDEX).to(torch.float32)
    if weights is not None:
        valid = valid * weights
    safe = torch.where(labels != IGNORE_INDEX, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss = ((lse - target) * valid).sum()
    # softmax - one_hot(target), zero on ignored rows; computed in the logits buffer itself.
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    # One index per row, so a plain indexed update (deterministic on every device, unlike scatter_add_).
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, safe] -= 1.0
    grad.mul_(valid.unsqueeze(1))
    return loss, grad


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of cross entropy of ``hidden @ weight.T`` against ``labels``, computed ``chunk_size`` tokens at a time."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        token_weights: torch.Tensor | None = None,
    ):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            logits = (h @ weight.t()).float()
            w = None if token_weights is None else token_weights[start : start + chunk_size]
            loss, grad_logits = _chunk_loss_and_grad_logits(logits, labels[start : start + chunk_size], w)
            total += loss
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                torch.matmul(grad_logits, weight, out=grad_hidden[start : start + chunk_size])
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), h)
            # Release this chunk's [chunk, vocab] buffers before the next chunk allocates its own.
            del logits, grad_logits, loss
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output.to(torch.float32)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * scale.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * scale.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over non-ignored targets of ``cross_entropy(hidden @ weight.T, labels)``, an fp32 scalar.

    ``hidden`` is ``[..., H]`` and ``labels`` the matching ``[...]`` (already aligned: the label
    of position i is the token to predict there; ``-100`` is ignored). ``token_weights`` (the
    shape of ``labels``, fp32) weighs each token's loss (``per_sample_loss``: one over the
    sample's target count). With ``chunk_size`` set and more tokens than one chunk, the logits
    are never materialised for the whole input; with a single chunk ordinary autograd does the
    same work without a precomputed weight gradient (the seed's single-chunk path).
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if token_weights is not None:
        token_weights = token_weights.reshape(-1).to(device=hidden.device, dtype=torch.float32)
    if chunk_size is None or hidden.shape[0] <= chunk_size:
        logits = F.linear(hidden, weight).float()
        if token_weights is None:
            return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
        return (losses * token_weights).sum()
    return ChunkedCrossEntropy.apply(hidden.contiguous(), weight, labels, chunk_size, token_weights)
