"""The frozen vision tower's blank forward on text-only micro-batches runs only where it is needed.

It keeps FSDP's collectives in step when some ranks' micro-batches hold images and others' do not,
and gives a trainable tower a zero gradient. Where neither applies (one rank, or no image in the
whole run, with the tower and projector frozen) it is pure cost: every vision layer's forward and,
under FSDP2, the all-gather of its weights, every micro-batch. Skipping it must change no loss.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from magistral_cli.engine.model import blank_vision_forward_needed
from magistral_cli.engine.parallelize import apply_prefetch
from magistral_cli.engine.trainer import Trainer
from magistral_cli.runtime import spawn_ranks

from .helpers import make_recipe, write_tiny_model

pytestmark = [pytest.mark.compat]

FROZEN = ["model.freeze=[model.vision_tower,model.multi_modal_projector]"]
PREFETCH = [
    "parallel.fsdp_plan.apply_modules=[model.vision_tower.transformer.layers.{*},model.multi_modal_projector,"
    "model.language_model.embed_tokens,model.language_model.layers.{*}]",
    "parallel.fsdp_plan.num_to_forward_prefetch=1",
    "parallel.fsdp_plan.num_to_backward_prefetch=1",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


def test_the_rule(tiny):
    model = write_tiny_model(tiny.parent / "rule")
    model.requires_grad_(True)
    vision = [model.model.vision_tower, model.model.multi_modal_projector]
    # A trainable tower or projector keeps it (its zero gradient is what AdamW's decay acts on).
    assert blank_vision_forward_needed(model, fsdp_world=1, images_possible=False)
    for module in vision:
        module.requires_grad_(False)
    assert not blank_vision_forward_needed(model, fsdp_world=1, images_possible=True)
    assert not blank_vision_forward_needed(model, fsdp_world=8, images_possible=False)
    assert blank_vision_forward_needed(model, fsdp_world=2, images_possible=True)
    model.model.multi_modal_projector.linear_1.weight.requires_grad_(True)
    assert blank_vision_forward_needed(model, fsdp_world=1, images_possible=False)


def _tower_calls(model) -> list[int]:
    calls = [0]
    model.model.vision_tower.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_one_rank_skips_it_with_the_same_losses(tiny, tmp_path):
    """One process, micro-batches with and without images: the same losses with and without the blank forward."""
    runs = {}
    for blank in (False, True):
        recipe = make_recipe(
            tiny, tmp_path / f"run-{blank}", FROZEN + PREFETCH, micro_batch_size=1, train_iters=4
        )
        trainer = Trainer(recipe)
        try:
            assert trainer.model.blank_vision_forward is False  # one rank, tower frozen: skipped
            if blank:  # as before: every micro-batch runs the tower
                trainer.model.blank_vision_forward = True
                apply_prefetch(trainer.model, recipe.parallel.fsdp_plan)
            calls = _tower_calls(trainer.model)
            records = trainer.train()
        finally:
            trainer.close()
        runs[blank] = ([r["loss"] for r in records], calls[0])
    (skipped, skipped_calls), (kept, kept_calls) = runs[False], runs[True]
    assert skipped == kept
    assert kept_calls == 4  # every micro-batch
    assert 0 < skipped_calls < 4  # only those with images (the synthetic source gives every other one)


def _two_ranks(rank: int, model_dir: str, out: str) -> dict:
    from pathlib import Path

    result = {}
    for blank in (False, True):
        recipe = make_recipe(
            Path(model_dir),
            Path(out) / f"run-{blank}",
            [*FROZEN, *PREFETCH, "data.dataset_param.synthetic.image_every=0"],
            train_iters=3,
        )
        trainer = Trainer(recipe)
        try:
            skipped = not trainer.model.blank_vision_forward
            if blank:
                trainer.model.blank_vision_forward = True
                apply_prefetch(trainer.model, recipe.parallel.fsdp_plan)
            calls = _tower_calls(trainer.model)
            records = trainer.train()
            tower = trainer.model.model.vision_tower
            # Prefetched but never run, the tower's units would stay gathered (plain tensors).
            sharded = all(isinstance(p, DTensor) for p in tower.parameters())
        finally:
            trainer.close()
        result[str(blank)] = {
            "skipped": skipped,
            "calls": calls[0],
            "losses": [r["loss"] for r in records],
            "sharded": sharded,
        }
    return result


@pytest.mark.slow
def test_two_ranks_without_images_skip_it_and_keep_the_tower_sharded(tiny, tmp_path):
    torch.manual_seed(0)
    ranks = spawn_ranks(_two_ranks, 2, (str(tiny), str(tmp_path)), timeout_s=300)
    for result in ranks:
        off, on = result["False"], result["True"]
        assert off["skipped"] and off["calls"] == 0 and off["sharded"]
        assert on["calls"] == 3 and on["sharded"]
        assert off["losses"] == on["losses"]
    assert ranks[0]["False"]["losses"] == ranks[1]["False"]["losses"]
