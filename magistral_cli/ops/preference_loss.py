"""Preference training's pieces: per-token log-probabilities over the output projection, and the
pair losses of ``training.dpo.loss``.

``token_logps`` is ``log softmax(hidden @ W.T)[label]`` for every token (0 where the label is
ignored). With ``chunk_size`` it never holds the logits of more than one chunk: the forward keeps
only the log-probabilities, and the backward recomputes each chunk's logits (one extra output
matmul) to form ``d logp / d logits = onehot(label) - softmax`` scaled by the incoming gradient.
Unlike the SFT loss (``ops.chunked_loss``) the gradient cannot be formed in the forward: each
sequence's coefficient depends on the whole pair's loss, known only after the forward.

The losses take per-sequence log-probabilities (summed over the answer's target tokens) and the
answers' target counts, and return per-pair losses and trl's reward metrics. ``ipo``, ``orpo`` and
``simpo`` use the mean token log-probability (divided by the count), as LLaMA-Factory does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from magistral_cli.metric_names import PREFERENCE_METRICS

from .chunked_loss import IGNORE_INDEX


class ChunkedTokenLogps(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)`` at ``labels`` for each row of ``hidden``, ``chunk_size`` rows at a time."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int):
        out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        safe = torch.where(labels != IGNORE_INDEX, labels, 0)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = (hidden[start:end] @ weight.t()).float()
            picked = logits.gather(1, safe[start:end, None]).squeeze(1)
            out[start:end] = (picked - torch.logsumexp(logits, dim=-1)) * (labels[start:end] != IGNORE_INDEX)
            del logits
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, labels = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, 0)
        scale = grad_out.to(torch.float32) * valid
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            logits = (h @ weight.t()).float()
            # d logp / d logits = onehot - softmax, computed in the logits buffer: -softmax * g, then + g at the label.
            grad = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()
            grad.mul_(-scale[start:end, None])
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, safe[start:end]] += scale[start:end]
            grad = grad.to(hidden.dtype)
            if need_hidden:
                torch.matmul(grad, weight, out=grad_hidden[start:end])
            if need_weight:
                grad_weight.addmm_(grad.t(), h)
            del logits, grad
        return grad_hidden, grad_weight, None, None


def token_logps(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """fp32 log-probability of each label under ``hidden @ weight.T`` (the shape of ``labels``; 0 where ignored).

    ``hidden`` is ``[..., H]``, ``labels`` the matching ``[...]``, already aligned (the label of
    position i is the token to predict there). With ``chunk_size`` and more rows than one chunk,
    at most one chunk's logits exist at a time, in the forward and in the backward.
    """
    shape = labels.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if chunk_size is None or hidden.shape[0] <= chunk_size:
        logits = F.linear(hidden, weight).float()
        out = -F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
        return out.reshape(shape)
    return ChunkedTokenLogps.apply(hidden.contiguous(), weight, labels, chunk_size).reshape(shape)


#: The per-pair metrics ``PreferenceLoss`` returns, in this order (trl's names).
METRIC_NAMES = PREFERENCE_METRICS


@dataclass(frozen=True)
class PreferenceLoss:
    """``training.dpo``'s loss settings (``config.schema.DpoConfig`` without the recipe)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    ftx: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def needs_reference(self) -> bool:
        return self.loss in ("sigmoid", "ipo")

    @property
    def length_normalized(self) -> bool:
        """Whether the loss reads the mean token log-probability (ipo, orpo, simpo) rather than the sum."""
        return self.loss in ("ipo", "orpo", "simpo")

    def __call__(
        self,
        chosen_sum: torch.Tensor,
        rejected_sum: torch.Tensor,
        chosen_count: torch.Tensor,
        rejected_count: torch.Tensor,
        ref_chosen_sum: torch.Tensor | None = None,
        ref_rejected_sum: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses ``[P]``, detached metrics ``[P, len(METRIC_NAMES)]``).

        ``*_sum`` are the answers' summed target log-probabilities ``[P]`` (policy, and the
        reference's for sigmoid / ipo), ``*_count`` their target counts (float ``[P]``).

        - sigmoid (DPO, Rafailov et al. 2023, eq. 7, with cDPO's label smoothing eps):
          ``z = beta * ((pi_c - ref_c) - (pi_r - ref_r))``,
          ``loss = -(1 - eps) log sigma(z) - eps log sigma(-z)``.
        - ipo (Azar et al. 2023, eq. 17; mean log-probs): ``loss = (h - 1 / (2 beta))^2``,
          ``h = (pi_c - ref_c) - (pi_r - ref_r)``.
        - orpo (Hong et al. 2024, eq. 6-7; mean log-probs ``p``): ``loss = -p_c + beta *
          -log sigma(log odds(c) - log odds(r))``, ``log odds(y) = p_y - log(1 - exp(p_y))``.
        - simpo (Meng et al. 2024, eq. 6; mean log-probs): ``loss = -log sigma(beta (p_c - p_r) - gamma)``,
          with ``gamma = simpo_gamma`` (LLaMA-Factory's ``beta * (p_c - p_r - gamma / beta)``).

        ``ftx`` > 0 adds ``ftx x`` the chosen answer's mean token NLL to every loss (LLaMA-Factory's
        ``pref_ftx``; orpo's own NLL term stays). Rewards are ``beta x (pi - ref)`` for sigmoid / ipo and ``beta x p``
        for orpo / simpo; the logps metrics are what the loss read (sums, or means).
        """
        chosen, rejected = chosen_sum, rejected_sum
        if self.length_normalized:
            chosen, rejected = chosen / chosen_count, rejected / rejected_count
        beta = self.beta
        if self.needs_reference:
            if ref_chosen_sum is None or ref_rejected_sum is None:
                raise ValueError(f"loss {self.loss!r} needs the reference model's log-probabilities")
            ref_c, ref_r = ref_chosen_sum, ref_rejected_sum
            if self.length_normalized:
                ref_c, ref_r = ref_c / chosen_count, ref_r / rejected_count
            chosen_ratio, rejected_ratio = chosen - ref_c, rejected - ref_r
            h = chosen_ratio - rejected_ratio
            if self.loss == "sigmoid":
                eps = self.label_smoothing
                losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
            else:
                losses = (h - 1 / (2 * beta)) ** 2
            reward_c, reward_r = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
        elif self.loss == "orpo":
            log_odds = (chosen - rejected) - (
                torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected))
            )
            losses = -chosen - beta * F.logsigmoid(log_odds)
            reward_c, reward_r = beta * chosen.detach(), beta * rejected.detach()
        elif self.loss == "simpo":
            losses = -F.logsigmoid(beta * (chosen - rejected) - self.simpo_gamma)
            reward_c, reward_r = beta * chosen.detach(), beta * rejected.detach()
        else:
            raise ValueError(f"unknown preference loss {self.loss!r}")
        if self.ftx:
            losses = losses + self.ftx * (-chosen_sum / chosen_count)
        metrics = torch.stack(
            [
                reward_c,
                reward_r,
                (reward_c > reward_r).to(torch.float32),
                reward_c - reward_r,
                chosen.detach(),
                rejected.detach(),
            ],
            dim=1,
        )
        return losses, metrics
