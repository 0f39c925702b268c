"""The memory plan of a QLoRA run: the 24B model (the published config.json), r = 16, on one device.

The decoder's seven projections per layer are NF4 (4 bits a value, an int8 scale per 64 values, a
quantisation factor per 256 scales); the rest of the base stays bf16. The 1-GPU QLoRA recipe must fit a
24 GB device at micro-batch 1 with 2048 and 4096 tokens (recompute on), where LoRA's bf16 base does
not fit 48 GB. A weight that does not split into whole scale blocks per rank stops the dry run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.config import load_recipe
from magistral_cli.engine import memory_plan as mp_plan
from magistral_cli.errors import UserError

REPO = Path(__file__).resolve().parents[2]
QLORA_1GPU = REPO / "recipes" / "magistral-small-2509" / "qlora_1gpu.yaml"
LORA_1GPU = REPO / "recipes" / "magistral-small-2509" / "lora_1gpu.yaml"
REAL_CONFIG = REPO / "tests" / "fixtures" / "magistral-small-2509" / "config.json"
GIB = 1 << 30
runner = CliRunner()


def _plan(recipe: Path, model_dir: Path, *extra: str, world: int = 1):
    overrides = [f"model.model_name_or_path={model_dir}", f"training.load={model_dir}", *extra]
    return mp_plan.plan_recipe(
        load_recipe(recipe, overrides), device="cuda", world_size=world, nproc_per_node=world, detected=False
    )


def _decoder_linear_numel() -> tuple[int, int]:
    """(every decoder projection's elements, the largest projection's) from config.json."""
    text = json.loads(REAL_CONFIG.read_text())["text_config"]
    h, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    d = text.get("head_dim") or h // text["num_attention_heads"]
    q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
    shapes = [h * q, h * kv, h * kv, q * h, h * inter, h * inter, inter * h]
    return layers * sum(shapes), max(shapes)


def test_the_24b_qlora_plan_counts_nf4_weights_and_the_dequantisation_workspace(real_model_dir):
    plan = _plan(QLORA_1GPU, real_model_dir)
    lora = _plan(LORA_1GPU, real_model_dir)
    quantized, largest = _decoder_linear_numel()
    assert plan.parameters["quantized"] == quantized
    assert plan.parameters["trainable"] == lora.parameters["trainable"]
    items = {i.key: i.bytes for i in plan.items}
    lora_items = {i.key: i.bytes for i in lora.items}
    # The NF4 bytes replace the bf16 ones: Q/2 + Q/64 + 4 Q/(64 x 256) for 2 Q.
    nf4 = quantized // 2 + quantized // 64 + 4 * (quantized // (64 * 256))
    assert lora_items["parameter_shards"] - items["parameter_shards"] == 2 * quantized - nf4
    assert items["dequant_workspace"] == (8 + 3 * 2) * largest
    # Adapters' gradients and AdamW states, activations and the loss head are LoRA's.
    for key in ("gradient_shards", "optimizer_states", "activations", "loss_logits"):
        assert items[key] == lora_items[key], key
    assert any(n.startswith("QLoRA: ") for n in plan.notes)


@pytest.mark.parametrize("cutoff", [2048, 4096])
def test_the_1_gpu_qlora_recipe_fits_24_gb_where_lora_does_not_fit_48(real_model_dir, cutoff):
    tokens = f"data.dataset_param.basic_parameters.cutoff_len={cutoff}"
    plan = _plan(QLORA_1GPU, real_model_dir, tokens)  # the recipe's parallel.device_memory_gib: 24
    assert plan.settings.micro_batch_size == 1 and plan.settings.device_memory_bytes == 24 * GIB
    assert plan.device_peak < 0.95 * 24 * GIB and not plan.warnings
    lora = _plan(LORA_1GPU, real_model_dir, tokens, "parallel.device_memory_gib=48")
    assert any("above 95%" in w for w in lora.warnings)


def test_the_dry_run_shows_the_qlora_plan_and_refuses_unsplittable_weights(real_model_dir, tmp_path):
    paths = [
        f"model.model_name_or_path={real_model_dir}",
        f"training.load={real_model_dir}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={real_model_dir}",
        f"training.output_dir={tmp_path / 'run'}",
    ]
    result = runner.invoke(app, ["train", str(QLORA_1GPU), *paths, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["memory_plan"]
    assert plan["memory"]["items"]["dequant_workspace"] > 2
    assert plan["memory"]["per_rank_device_gib"] < 0.95 * 24

    # Over 3 ranks no weight splits into whole scale blocks; over 128 the k/v projections (1024 x 5120:
    # 320 blocks of 64 x 256) do with scaler blocks of 128, which the message names.
    with pytest.raises(
        UserError, match=r"q_proj.* not a multiple of .* = 64 x 256 x 3; change the FSDP group"
    ):
        _plan(QLORA_1GPU, real_model_dir, world=3)
    with pytest.raises(
        UserError, match=r"k_proj.* = 64 x 256 x 128; set model.lora.quantize_scaler_block_size to 128"
    ):
        _plan(QLORA_1GPU, real_model_dir, world=128)
