"""On one rank FSDP2 leaves the frozen parameters that are already in the compute dtype alone.

There is nothing to shard on one rank, yet FSDP2 copies every unit's parameters into a second,
unsharded buffer at each forward and again in the backward. A frozen parameter in the compute
dtype (a LoRA base, a preference reference, a frozen vision tower in fp32) is used as it is:
``parallelize.left_unsharded``. Such a run computes what it did, and its checkpoints resume on
any number of ranks, both ways.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor

from magistral_cli.engine.parallelize import left_unsharded
from magistral_cli.engine.trainer import Trainer
from magistral_cli.runtime import spawn_ranks

from .helpers import full_params, make_recipe, write_tiny_model

pytestmark = [pytest.mark.compat]

FROZEN = ["model.freeze=[model.vision_tower,model.multi_modal_projector]"]


def _recipe(model_dir, run_dir, overrides=(), **training):
    training = {"save_interval": 2, "resume": "auto", **training}
    return make_recipe(model_dir, run_dir, [*FROZEN, *overrides], **training)


def _train(recipe, steps=None) -> tuple[list[float], dict[str, torch.Tensor], dict[str, bool]]:
    """Losses, the parameters gathered, and which parameters stayed plain tensors."""
    trainer = Trainer(recipe)
    try:
        losses = [r["loss"] for r in trainer.train(max_steps=steps)]
        plain = {n: not isinstance(p, DTensor) for n, p in trainer.model.named_parameters()}
        return losses, full_params(trainer.model), plain
    finally:
        trainer.close()


def test_the_rule():
    model = _meta_model()
    model.model.vision_tower.requires_grad_(False)
    frozen = {p for p in model.model.vision_tower.parameters()}
    assert left_unsharded(model, 1, torch.float32) == frozen
    assert left_unsharded(model, 1, None) == frozen
    assert left_unsharded(model, 2, torch.float32) == set()
    # Stored fp32, computed in bf16: FSDP2 casts them, as it does on more ranks.
    assert left_unsharded(model, 1, torch.bfloat16) == set()
    model.model.vision_tower.to(torch.bfloat16)
    assert left_unsharded(model, 1, torch.bfloat16) == frozen


def _meta_model():
    from magistral_cli.engine.model import build_model
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    return build_model(tiny_mistral3_config(), meta=True, attn_implementation="sdpa")


def _resume_worker(rank: int, model_dir: str, run_dir: str, steps: int) -> dict:
    # One sample per rank: the global batch of one rank's two (per_token_loss: the same loss).
    recipe = _recipe(model_dir, run_dir, train_iters=steps, micro_batch_size=1)
    trainer = Trainer(recipe)
    try:
        start = trainer.step
        loaded = {n: v.tolist() for n, v in full_params(trainer.model).items()}
        plain = [n for n, p in trainer.model.named_parameters() if not isinstance(p, DTensor)]
        losses = [r["loss"] for r in trainer.train()]
        trained = {n: v.tolist() for n, v in full_params(trainer.model).items()}
        return {"start": start, "loaded": loaded, "trained": trained, "plain": plain, "losses": losses}
    finally:
        trainer.close()


def _same(loaded: dict, params: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == params.keys() and loaded
    for name, value in params.items():
        assert torch.equal(torch.tensor(loaded[name]), value), name


@pytest.mark.slow
def test_one_rank_leaves_frozen_weights_plain_and_its_checkpoints_resume_on_two_ranks(tmp_path):
    model_dir = tmp_path / "model"
    write_tiny_model(model_dir)
    one = tmp_path / "one"
    losses, params, plain = _train(_recipe(model_dir, one, train_iters=2))
    frozen = {n for n in plain if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    assert frozen and {n for n, is_plain in plain.items() if is_plain} == frozen
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    # The same steps on two ranks (every parameter sharded, a sample each) give the same losses.
    two = spawn_ranks(_resume_worker, 2, (str(model_dir), str(tmp_path / "two"), 2), timeout_s=300)
    assert two[0]["plain"] == [] and two[0]["start"] == 0
    assert two[0]["losses"] == pytest.approx(losses, rel=1e-5)

    # One rank's step_2 resumed on two ranks: every parameter, frozen ones included, as saved.
    resumed = tmp_path / "one-on-two"
    shutil.copytree(one, resumed)
    out = spawn_ranks(_resume_worker, 2, (str(model_dir), str(resumed), 3), timeout_s=300)
    assert out[0]["start"] == 2 and len(out[0]["losses"]) == 1
    _same(out[0]["loaded"], params)

    # ... and two ranks' step_2 resumed on one: the frozen weights load into the plain tensors.
    back = tmp_path / "two-on-one"
    shutil.copytree(tmp_path / "two", back)
    trainer = Trainer(_recipe(model_dir, back, train_iters=3))
    try:
        assert trainer.step == 2
        loaded = full_params(trainer.model)
        assert all(not isinstance(trainer.model.get_parameter(n), DTensor) for n in frozen)
    finally:
        trainer.close()
    _same(two[0]["trained"], loaded)


def test_a_one_rank_lora_run_gathers_only_its_adapters(tmp_path, caplog):
    """The whole base (decoder, embedding, head, vision tower) is used in place; FSDP2 manages the
    adapters, which train as on more ranks (tests/engine/test_lora_fsdp.py)."""
    from magistral_cli.engine import lora

    model_dir = tmp_path / "model"
    write_tiny_model(model_dir)
    lora_overrides = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"]
    caplog.set_level(logging.INFO, logger="magistral_cli.engine.parallelize")
    losses, params, plain = _train(_recipe(model_dir, tmp_path / "run", lora_overrides, train_iters=2))
    managed = {n for n, is_plain in plain.items() if not is_plain}
    base = sum(v.numel() for n, v in params.items() if n not in managed)
    assert f"one rank: {base:,} frozen parameter elements used in place" in caplog.text
    assert managed and all(lora.is_adapter_key(n) for n in managed)
    assert {n for n in plain if lora.is_adapter_key(n)} == managed
    assert all(torch.isfinite(torch.tensor(losses)))
