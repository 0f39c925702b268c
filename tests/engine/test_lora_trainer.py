"""LoRA through the trainer (``model.lora``), one gloo rank, fp32 on the CPU.

The trainer injects PEFT's adapters before parallelisation, loads the base from ``training.load``
under its plain names, trains only the adapters and checkpoints only them; a resumed trainer
continues bit for bit. The function-level equality with an unsharded PEFT model on 2 ranks is
tests/engine/test_lora_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch

from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import UserError

from .helpers import full_params, make_recipe, recipe_dict, write_tiny_model

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    model = write_tiny_model(directory)
    return directory, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _lora_recipe(model_dir, run_dir, r=4, load=None, **training):
    from magistral_cli.config.loader import validate_recipe

    raw = recipe_dict(model_dir, run_dir, **training)
    if load is not None:
        raw["training"]["load"] = str(load)
    raw["model"]["lora"] = {"r": r, "alpha": 2 * r, "target_modules": TARGETS}
    raw["model"]["freeze"] = ["model.vision_tower", "model.multi_modal_projector"]
    raw["training"]["init_model_with_meta_device"] = True
    return validate_recipe(raw)


def _run(recipe, steps=None):
    trainer = Trainer(recipe)
    try:
        records = trainer.train(max_steps=steps)
        return [r["loss"] for r in records], full_params(trainer.model)
    finally:
        trainer.close()


def test_lora_trains_adapters_only_and_resumes_exactly(tiny, tmp_path):
    from magistral_cli.checkpoint.safe_dcp import SafeFileSystemReader
    from magistral_cli.engine import lora

    model_dir, base = tiny
    whole, whole_params = _run(_lora_recipe(model_dir, tmp_path / "whole", train_iters=4))
    # B starts at zero: the first loss is the base model's, as full fine-tuning's first loss is.
    full, _ = _run(make_recipe(model_dir, tmp_path / "full", train_iters=1))
    assert whole[0] == pytest.approx(full[0], rel=1e-6)
    assert whole[-1] < whole[0]

    adapters = {n: p for n, p in whole_params.items() if lora.is_adapter_key(n)}
    assert adapters and all("lora_A" in n or "lora_B" in n for n in adapters)
    assert any(p.abs().max() > 0 for n, p in adapters.items() if "lora_B" in n)  # B moved from zero
    for name, value in whole_params.items():  # the base did not move
        if not lora.is_adapter_key(name):
            assert torch.equal(value, base[lora.base_key(name)]), name

    recipe = _lora_recipe(model_dir, tmp_path / "run", train_iters=4, save_interval=2, resume="auto")
    first, _ = _run(recipe, steps=2)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    keys = set(SafeFileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys == {f"model.{n}" for n in adapters}  # no frozen base in the checkpoint
    assert any(k.startswith("optimizer.") for k in keys)
    record = lora.read_checkpoint_record(checkpoint)
    assert record["r"] == 4 and record["alpha"] == 8 and len(record["target_modules"]) == 7 * 2

    rest, params = _run(recipe)  # a new trainer: resume: auto, the base from training.load
    assert first + rest == whole
    for name in whole_params:
        assert torch.equal(params[name], whole_params[name]), name


def test_lora_checkpoints_refused_where_they_do_not_fit(tiny, tmp_path):
    model_dir, _ = tiny
    run = tmp_path / "run"
    _run(_lora_recipe(model_dir, run, train_iters=2, save_interval=2))
    checkpoint = run / "checkpoints" / "step_2"

    with pytest.raises(UserError, match="LoRA training checkpoint .*not base weights"):
        Trainer(_lora_recipe(model_dir, tmp_path / "other", train_iters=2, load=checkpoint))
    # ... and by the launcher's pre-flight, before torchrun starts, for any recipe (exit 2)
    import yaml

    from magistral_cli.launch.launcher import LaunchOptions, plan_launch

    raw = recipe_dict(model_dir, tmp_path / "launched")
    raw["training"]["load"] = str(checkpoint)
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    for dry_run in (True, False):
        with pytest.raises(
            UserError, match="LoRA training checkpoint .*`magistral convert dcp-to-hf --lora merged`$"
        ):
            plan_launch(tmp_path / "full.yaml", [], LaunchOptions(nproc_per_node=2, dry_run=dry_run))
    with pytest.raises(UserError, match="other model.lora settings .*r 4 there, 8 here"):
        Trainer(_lora_recipe(model_dir, run, r=8, train_iters=4, resume="auto"))
    with pytest.raises(UserError, match="is a LoRA checkpoint .*no model.lora"):
        Trainer(make_recipe(model_dir, run, train_iters=4, resume="auto"))
    import torch.distributed as dist

    if dist.is_initialized():  # the failed constructors left their group behind
        dist.destroy_process_group()
