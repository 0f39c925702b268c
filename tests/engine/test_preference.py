"""Preference training (``training.stage: dpo``) against an independent computation.

The expectation is computed from transformers' own forward of the same checkpoints in fp32: each
row's summed log-probabilities of its answer's targets, the pair losses written out here from the
papers' formulas (not ``ops.preference_loss``), their mean over every pair of the step, and the
gradient by autograd on that expectation. The policy and the reference come from two different
checkpoints, so the loss is not trivially ln 2. The batches hold pairs with images.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from magistral_cli.engine.synthetic import SyntheticBatches
from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import UserError
from magistral_cli.ops.preference_loss import token_logps

from .helpers import VOCAB, make_recipe, write_tiny_model

#: The preference step reads transformers' forward: it runs on the lowest supported transformers too.
pytestmark = pytest.mark.compat
SEQ = 48
BETA = 0.3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    policy_dir = tmp_path_factory.mktemp("dpo-policy")
    reference_dir = tmp_path_factory.mktemp("dpo-reference")
    return (
        policy_dir,
        write_tiny_model(policy_dir, seed=0),
        reference_dir,
        write_tiny_model(reference_dir, seed=5),
    )


def pair_batches(micro_batch_size=2, accumulation=2, dp_rank=0, dp_size=1) -> list[dict]:
    data = SyntheticBatches(
        vocab_size=VOCAB,
        seq_len=SEQ,
        micro_batch_size=micro_batch_size,
        grad_accumulation=accumulation,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=3,
        pairs=True,
    )
    return [next(data) for _ in range(accumulation)]


def row_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's summed answer log-probabilities, each row's target count) from transformers' logits."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    picked = logits.log_softmax(-1).gather(2, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1).float()


def expected(policy, reference, batches, loss: str, *, ftx=0.0, smoothing=0.0, gamma=0.5):
    """The step's mean pair loss and mean metrics, written from the papers' formulas."""
    losses, rewards_c, rewards_r = [], [], []
    for batch in batches:
        pi, n = row_logps(policy, batch)
        p = pi.shape[0] // 2
        pc, pr, nc, nr = pi[:p], pi[p:], n[:p], n[p:]
        if loss in ("sigmoid", "ipo"):
            with torch.no_grad():
                ref, _ = row_logps(reference, batch)
            rc, rr = ref[:p], ref[p:]
        if loss == "sigmoid":
            z = BETA * ((pc - rc) - (pr - rr))
            pair = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
            wc, wr = BETA * (pc - rc), BETA * (pr - rr)
        elif loss == "ipo":
            h = (pc / nc - rc / nc) - (pr / nr - rr / nr)
            pair = (h - 1 / (2 * BETA)) ** 2
            wc, wr = BETA * (pc / nc - rc / nc), BETA * (pr / nr - rr / nr)
        elif loss == "orpo":
            ac, ar = pc / nc, pr / nr
            odds = (ac - torch.log(1 - ac.exp())) - (ar - torch.log(1 - ar.exp()))
            pair = -ac - BETA * F.logsigmoid(odds)
            wc, wr = BETA * ac, BETA * ar
        else:  # simpo
            ac, ar = pc / nc, pr / nr
            pair = -F.logsigmoid(BETA * (ac - ar) - gamma)
            wc, wr = BETA * ac, BETA * ar
        pair = pair + ftx * (-pc / nc)
        losses.append(pair)
        rewards_c.append(wc.detach())
        rewards_r.append(wr.detach())
    pairs = torch.cat(losses)
    wc, wr = torch.cat(rewards_c), torch.cat(rewards_r)
    metrics = {
        "rewards/chosen": float(wc.mean()),
        "rewards/rejected": float(wr.mean()),
        "rewards/accuracies": float((wc > wr).float().mean()),
        "rewards/margins": float((wc - wr).mean()),
    }
    return pairs.mean(), metrics


def frozen_like_recipe(model):
    model = copy.deepcopy(model).train()
    model.model.vision_tower.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(False)
    return model


def dpo_recipe(policy_dir, run_dir, overrides=(), **training):
    base = ["training.stage=dpo", "features.loss_cfg.loss_type=default", f"training.dpo.beta={BETA}"]
    return make_recipe(policy_dir, run_dir, base + list(overrides), **training)


CASES = {
    "sigmoid": {},
    "sigmoid-smoothing-ftx-chunked": {"smoothing": 0.1, "ftx": 0.5, "chunk": 16},
    "ipo": {},
    "orpo": {},
    "simpo": {"gamma": 0.7},
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_loss_equals_its_formula_with_a_different_reference(models, tmp_path, case):
    policy_dir, policy, reference_dir, reference = models
    opts = CASES[case]
    loss = case.split("-")[0]
    overrides = [f"training.dpo.loss={loss}"]
    if loss in ("sigmoid", "ipo"):
        overrides.append(f"training.dpo.ref_model={reference_dir}")
    if "smoothing" in opts:
        overrides += [f"training.dpo.label_smoothing={opts['smoothing']}", f"training.dpo.ftx={opts['ftx']}"]
    if "gamma" in opts:
        overrides.append(f"training.dpo.simpo_gamma={opts['gamma']}")
    if "chunk" in opts:
        overrides += [
            "features.enable_chunk_loss=true",
            f"features.chunkloss_plan.chunk_size={opts['chunk']}",
        ]
    batches = pair_batches()
    assert any("pixel_values" in b for b in batches), "the pairs must carry images"

    oracle = frozen_like_recipe(policy)
    want, want_metrics = expected(
        oracle,
        reference.eval(),
        batches,
        loss,
        ftx=opts.get("ftx", 0.0),
        smoothing=opts.get("smoothing", 0.0),
        gamma=opts.get("gamma", 0.5),
    )
    if loss == "sigmoid":
        assert abs(want.item() - 0.6931) > 1e-3, "the reference must differ from the policy"
    want.backward()
    want_grads = {n: p.grad for n, p in oracle.named_parameters() if p.grad is not None}

    trainer = Trainer(
        dpo_recipe(policy_dir, tmp_path / "run", overrides, micro_batch_size=2, gradient_accumulation_steps=2)
    )
    try:
        assert (trainer.preference.reference is not None) == (loss in ("sigmoid", "ipo"))
        out = trainer.forward_backward(batches)
        sums, pairs = out["objective"].tolist(), int(out["counts"][3])
        assert pairs == 4
        assert sums[0] / pairs == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
        got_metrics = dict(zip(want_metrics, [v / pairs for v in sums[1:5]], strict=True))
        for name, value in want_metrics.items():
            # A reward is beta x a difference of two log-prob sums near -200, whose fp32 spacing is
            # 1.5e-5: the chunked and plain sums round differently by that much.
            assert got_metrics[name] == pytest.approx(value, rel=1e-5, abs=2e-5), name
        grads = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters() if p.grad is not None}
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, want_grads[name], rtol=1e-4, atol=1e-6), name
    finally:
        trainer.close()


def test_lora_reference_is_the_base_with_adapters_off(models, tmp_path):
    policy_dir, policy, _, _ = models
    recipe = dpo_recipe(
        policy_dir,
        tmp_path / "run",
        [
            "model.lora.r=4",
            "model.lora.target_modules=[q_proj,v_proj]",
            "model.lora.init_lora_weights=false",
        ],
    )
    batch = pair_batches(accumulation=1)[0]
    trainer = Trainer(recipe)
    try:
        assert trainer.preference.reference is None and trainer.preference.uses_adapters_off
        on_device = {k: v for k, v in batch.items()}
        ref = trainer.preference.reference_logps(on_device)
        with torch.no_grad():
            lora_logps = trainer.model(**on_device, sequence_logps=True)
            want, _ = row_logps(copy.deepcopy(policy).eval(), batch)
        assert torch.allclose(ref, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(lora_logps, want, atol=1e-3), "random adapters must change the policy"
    finally:
        trainer.close()


def test_token_logps_chunked_equals_plain_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::5] = -100
    coef = torch.randn(37, generator=g, dtype=torch.float64)
    plain = token_logps(hidden, weight, labels)
    grads = torch.autograd.grad((plain * coef).sum(), (hidden, weight))
    chunked = token_logps(hidden, weight, labels, chunk_size=8)
    grads_chunked = torch.autograd.grad((chunked * coef).sum(), (hidden, weight))
    assert torch.allclose(plain, chunked.to(plain.dtype), atol=1e-6)
    assert bool((chunked[::5] == 0).all())
    for a, b in zip(grads, grads_chunked, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_recipe_rules(models, tmp_path):
    policy_dir = models[0]
    with pytest.raises(UserError, match="uses no reference model"):
        dpo_recipe(
            policy_dir, tmp_path / "a", ["training.dpo.loss=simpo", f"training.dpo.ref_model={policy_dir}"]
        )
    # Plain packing would let a pack's chosen and rejected answers attend to each other; neat packing is allowed.
    with pytest.raises(
        UserError, match="mixing a pair's chosen and rejected answers; set data.dataset_param"
    ):
        dpo_recipe(policy_dir, tmp_path / "b", ["data.dataset_param.basic_parameters.packing=true"])
    dpo_recipe(policy_dir, tmp_path / "b", ["data.dataset_param.basic_parameters.neat_packing=true"])
    with pytest.raises(UserError, match="loss_type"):
        make_recipe(policy_dir, tmp_path / "c", ["training.stage=dpo"])
    with pytest.raises(
        UserError, match="precompute_ref stores the reference model's log-probabilities, but loss"
    ):
        dpo_recipe(policy_dir, tmp_path / "e", ["training.dpo.loss=orpo", "training.dpo.precompute_ref=true"])
    with pytest.raises(
        UserError, match="synthetic data has no cache; set training.dpo.precompute_ref: false"
    ):
        dpo_recipe(policy_dir, tmp_path / "f", ["training.dpo.precompute_ref=true"])
    with pytest.raises(UserError, match="modules_to_save"):
        dpo_recipe(
            policy_dir,
            tmp_path / "d",
            ["model.lora.target_modules=[q_proj]", "model.lora.modules_to_save=[lm_head]"],
        )
