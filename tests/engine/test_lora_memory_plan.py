"""The memory plan of a LoRA run: the 24B model (the published config.json) with r = 16 on 1, 2 and 8 devices.

The adapters are counted from the real config: ``r x (in + out)`` per adapted Linear layer, seven
per decoder layer. The frozen base is held in bf16 (no fp32 master, no gradient, no AdamW state),
so the 1-GPU recipe fits an 80 GB device.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.config import load_recipe
from magistral_cli.engine import memory_plan as mp_plan
from magistral_cli.errors import UserError

REPO = Path(__file__).resolve().parents[2]
LORA_1GPU = REPO / "recipes" / "magistral-small-2509" / "lora_1gpu.yaml"
REAL_CONFIG = REPO / "tests" / "fixtures" / "magistral-small-2509" / "config.json"
GIB = 1 << 30
#: The published config's parameters (untied head), as tests/engine/test_memory_plan.py counts them.
BASE_PARAMS = 24_011_361_280
runner = CliRunner()


def _expected_adapters(r: int) -> int:
    """r x (in + out) over q, k, v, o, gate, up, down of every decoder layer, from config.json."""
    text = json.loads(REAL_CONFIG.read_text())["text_config"]
    h, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    d = text.get("head_dim") or h // text["num_attention_heads"]
    q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    return layers * sum(r * (i + o) for i, o in shapes)


def _plan(model_dir: Path, world: int, *extra: str):
    overrides = [
        f"model.model_name_or_path={model_dir}",
        f"training.load={model_dir}",
        f"parallel.nproc_per_node={world}",
        "parallel.device_memory_gib=80",
        *extra,
    ]
    recipe = load_recipe(LORA_1GPU, overrides)
    return mp_plan.plan_recipe(recipe, device="cuda", world_size=world, nproc_per_node=world, detected=False)


def test_adapter_counts_follow_the_real_config(real_model_dir):
    plan = _plan(real_model_dir, 1)
    adapters = _expected_adapters(16)
    assert adapters == 92_405_760  # 40 layers x 16 x 144,384
    assert plan.parameters["adapters"] == adapters == plan.parameters["trainable"]
    assert plan.parameters["frozen"] == BASE_PARAMS
    assert plan.parameters["total"] == BASE_PARAMS + adapters
    assert plan.parameters["checkpointed"] == adapters  # checkpoints hold the adapters only
    assert any("LoRA r=16 on 280 Linear layers" in n and "bf16" in n for n in plan.notes)
    # model.lora.r moves the count linearly.
    assert _plan(real_model_dir, 1, "model.lora.r=8", "model.lora.alpha=16").parameters["adapters"] == (
        _expected_adapters(8)
    )


@pytest.mark.parametrize(("world", "peak_gib"), [(1, 47.39), (2, 27.01), (8, 9.85)])
def test_per_rank_memory_on_1_2_and_8_devices(real_model_dir, world, peak_gib):
    plan = _plan(real_model_dir, world)
    items = {i.key: i.bytes for i in plan.items}
    adapters, frozen = plan.parameters["trainable"], plan.parameters["frozen"]
    # bf16 frozen base + fp32 adapters, sharded over the ranks (FSDP2 pads dim 0: rel 1e-3).
    assert items["parameter_shards"] == pytest.approx((4 * adapters + 2 * frozen) / world, rel=1e-3)
    # Gradients and AdamW moments exist for the adapters only.
    assert items["gradient_shards"] == pytest.approx(4 * adapters / world, rel=1e-3)
    assert items["optimizer_states"] == pytest.approx(8 * adapters / world, rel=1e-3)
    assert items["gradient_shards"] < 0.4 * GIB
    # On one device the bf16 base is used in place: only the adapters are gathered (a few MiB); on
    # more, the largest unit (the embedding, 1.25 GiB in bf16) and one ahead, sharded as it is.
    if world == 1:
        assert items["all_gather"] < 0.02 * GIB
    else:
        assert items["all_gather"] == pytest.approx(2 * 2 * 131072 * 5120, rel=1e-3)
    assert plan.device_peak / GIB == pytest.approx(peak_gib, abs=0.01)
    assert not plan.warnings


def test_the_1_gpu_lora_recipe_fits_80_gb_and_full_fine_tuning_does_not(real_model_dir):
    plan = _plan(real_model_dir, 1, "parallel.device_memory_gib=74.5")  # 80 GB = 74.5 GiB
    assert plan.device_peak < 0.95 * 74.5 * GIB and not plan.warnings
    full = _plan(real_model_dir, 1, "model.lora=null", "parallel.device_memory_gib=74.5")
    assert full.device_peak > 4 * plan.device_peak  # fp32 masters, gradients and AdamW of 24B
    assert any("above 95%" in w for w in full.warnings)


def test_dropout_adds_the_adapters_inputs_to_the_activations(real_model_dir):
    plain = {i.key: i.bytes for i in _plan(real_model_dir, 1).items}
    dropped = {i.key: i.bytes for i in _plan(real_model_dir, 1, "model.lora.dropout=0.05").items}
    text = json.loads(REAL_CONFIG.read_text())["text_config"]
    h, inter, d = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    inputs = 5 * h + text["num_attention_heads"] * d + inter  # q k v gate up read h; o reads q; down reads I
    # The recomputed layer's backward holds one layer's activations: (p + 1) B per input and token more.
    assert dropped["layer_backward"] - plain["layer_backward"] == 2048 * 3 * inputs
    assert math.isclose(dropped["activations"], plain["activations"])  # checkpointed layers keep only inputs


def test_the_dry_run_shows_the_lora_plan(real_model_dir, tmp_path):
    overrides = [
        f"model.model_name_or_path={real_model_dir}",
        f"training.load={real_model_dir}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={real_model_dir}",
        f"training.output_dir={tmp_path / 'run'}",
        "parallel.device_memory_gib=80",
    ]
    result = runner.invoke(app, ["train", str(LORA_1GPU), *overrides, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["memory_plan"]
    assert plan["parameters"]["adapters"] == 92_405_760 and plan["settings"]["frozen_param_dtype"] == "bf16"
    assert plan["memory"]["per_rank_device_gib"] == pytest.approx(47.39, abs=0.01)


def test_an_unmatched_lora_target_stops_the_dry_run(real_model_dir):
    with pytest.raises(
        UserError, match=r"'qkv_proj' is not the name of a Linear layer in language_model.*q_proj"
    ):
        _plan(real_model_dir, 1, "model.lora.target_modules=[qkv_proj]")
