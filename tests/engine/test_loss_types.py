"""``features.loss_cfg.loss_type``: MindSpeed-MM's three reductions, each against a hand computation.

The three differ only when micro-batches (and samples) hold different numbers of target tokens,
so the batches here do: two micro-batches of two samples keeping all, a fifth, 60% and a tenth
of their targets. The
expectation is computed independently from transformers' logits of the same model and batches,
and the gradient from autograd on that expectation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from magistral_cli.engine.synthetic import SyntheticBatches
from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import UserError

from .helpers import VOCAB, make_recipe, write_tiny_model

SEQ = 48
#: The share of each sample's target tokens kept (the rest of its labels are set to -100).
KEEP = [[1.0, 0.2], [0.6, 0.1]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("loss-model")
    return directory, write_tiny_model(directory)


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    data = SyntheticBatches(
        vocab_size=VOCAB, seq_len=SEQ, micro_batch_size=2, grad_accumulation=2, dp_rank=0, dp_size=1, seed=3
    )
    batches = []
    for keep in KEEP:
        batch = next(data)
        for row, share in enumerate(keep):
            targets = (batch["labels"][row, 1:] != -100).nonzero().flatten() + 1
            n = max(1, int(len(targets) * share))
            batch["labels"][row, targets[n:]] = -100
            assert int((batch["labels"][row, 1:] != -100).sum()) == n
        batches.append(batch)
    return batches


def _token_losses(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token cross entropy [B, S-1], target mask [B, S-1]) from transformers' own logits."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
    targets = batch["labels"][:, 1:]
    ce = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none"
    ).view(targets.shape)
    return ce, targets != -100


def expected_loss(model, batches, loss_type: str) -> torch.Tensor:
    per_mb = []
    total, count = 0.0, 0
    for batch in batches:
        ce, mask = _token_losses(model, batch)
        if loss_type == "default":
            per_mb.append(ce.sum() / mask.sum())
        elif loss_type == "per_sample_loss":
            per_mb.append((ce.sum(1) / mask.sum(1)).mean())
        total, count = total + ce.sum(), count + mask.sum()
    if loss_type == "per_token_loss":
        return total / count
    return torch.stack(per_mb).mean()


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("loss_type", ["default", "per_sample_loss", "per_token_loss"])
def test_each_loss_type_equals_its_definition(tiny, tmp_path, loss_type, chunk):
    model_dir, source = tiny
    batches = _micro_batches()
    reference = copy.deepcopy(source).train()
    reference.model.vision_tower.requires_grad_(False)
    reference.model.multi_modal_projector.requires_grad_(False)
    want = expected_loss(reference, batches, loss_type)
    want.backward()
    want_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    others = {
        t: float(expected_loss(reference, batches, t))
        for t in ("default", "per_sample_loss", "per_token_loss")
    }
    assert len({round(v, 6) for v in others.values()}) == 3, (
        f"the batches do not tell the types apart: {others}"
    )

    overrides = [f"features.loss_cfg.loss_type={loss_type}"]
    if chunk:
        overrides += ["features.enable_chunk_loss=true", f"features.chunkloss_plan.chunk_size={chunk}"]
    trainer = Trainer(
        make_recipe(model_dir, tmp_path / "run", overrides, micro_batch_size=2, gradient_accumulation_steps=2)
    )
    try:
        out = trainer.forward_backward(batches)
        got = trainer.logged_loss(float(out["objective"]), int(out["counts"][0]))
        assert got == pytest.approx(float(want), rel=1e-5), others
        grads = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters() if p.grad is not None}
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, want_grads[name], rtol=1e-4, atol=1e-6), name
    finally:
        trainer.close()


def test_an_unknown_loss_type_is_refused(tiny, tmp_path):
    model_dir, _ = tiny
    with pytest.raises(UserError, match="features.loss_cfg.loss_type"):
        make_recipe(model_dir, tmp_path / "run", ["features.loss_cfg.loss_type=mean"])


def test_per_sample_weights_move_with_the_batch_through_pinned_memory(tiny, tmp_path, monkeypatch):
    """per_sample_loss's weights are made on the host and moved with the batch by ``to_device``
    (``runtime.host_to_device``: pinned memory on an accelerator), not by a pageable ``.to(device)``
    that would make the host wait for the queue. The spy records what ``to_device`` moves and calls
    the real function."""
    from magistral_cli.engine import batch as batch_mod
    from magistral_cli.engine.batch import per_sample_weights

    moved: list[torch.Tensor] = []
    real = batch_mod.host_to_device

    def spy(tensor, device):
        moved.append(tensor)
        return real(tensor, device)

    monkeypatch.setattr(batch_mod, "host_to_device", spy)
    model_dir, _ = tiny
    batches = _micro_batches()
    trainer = Trainer(
        make_recipe(
            model_dir,
            tmp_path / "run",
            ["features.loss_cfg.loss_type=per_sample_loss"],
            micro_batch_size=2,
            gradient_accumulation_steps=2,
        )
    )
    try:
        trainer.forward_backward(batches)
    finally:
        trainer.close()
    for mb in batches:
        want = per_sample_weights(mb["labels"], mb["attention_mask"])
        assert any(t.shape == want.shape and torch.equal(t, want) for t in moved), (
            "the micro-batch's per-sample weights did not go through to_device"
        )
