"""The memory plan of preference training: the 24B model (the published config.json) on 8 devices.

A pair is two sequences, so the activations and the loss head count twice the rows of an SFT
micro-batch; the frozen reference is every base parameter's shard in bf16 beside the policy, and
there is none for the LoRA base (adapters off), orpo or simpo.
"""

from __future__ import annotations

import math
from pathlib import Path

from magistral_cli.config import load_recipe
from magistral_cli.engine import memory_plan as mp_plan

REPO = Path(__file__).resolve().parents[2]
DPO_8CARD = REPO / "recipes" / "magistral-small-2509" / "dpo_8card.yaml"
LORA_1GPU = REPO / "recipes" / "magistral-small-2509" / "lora_1gpu.yaml"
REAL_CONFIG = REPO / "tests" / "fixtures" / "magistral-small-2509" / "config.json"
#: The published config's parameters (untied head), as tests/engine/test_memory_plan.py counts them.
BASE_PARAMS = 24_011_361_280


def _plan(path: Path, model_dir: Path, world: int, *extra: str):
    recipe = load_recipe(
        path,
        [
            f"model.model_name_or_path={model_dir}",
            f"data.dataset_param.preprocess_parameters.model_name_or_path={model_dir}",
            f"training.load={model_dir}",
            f"parallel.nproc_per_node={world}",
            "parallel.device_memory_gib=80",
            *extra,
        ],
    )
    return mp_plan.plan_recipe(recipe, device="cuda", world_size=world, nproc_per_node=world, detected=False)


def test_dpo_24b_on_8_devices_counts_the_reference_and_both_sequences(real_model_dir):
    plan = _plan(DPO_8CARD, real_model_dir, 8)
    items = {i.key: i.bytes for i in plan.items}
    # The reference: bf16, every parameter's shard (the largest rank's: ceil(dim0 / 8) rows).
    assert items["reference_shards"] == 2 * (items["parameter_shards"] // 4)
    assert items["reference_shards"] >= 2 * math.ceil(BASE_PARAMS / 8)
    sft = _plan(DPO_8CARD, real_model_dir, 8, "training.stage=sft")
    sft_items = {i.key: i.bytes for i in sft.items}
    assert "reference_shards" not in sft_items
    # Two sequences per pair: twice the activations of the same micro-batch in SFT.
    assert items["activations"] == 2 * sft_items["activations"]
    assert plan.device_peak > sft.device_peak + items["reference_shards"]
    assert any("a frozen reference model is held beside the policy" in n for n in plan.notes)
    # Precomputed log-probabilities: no reference while training.
    pre = _plan(DPO_8CARD, real_model_dir, 8, "training.dpo.precompute_ref=true")
    pre_items = {i.key: i.bytes for i in pre.items}
    assert "reference_shards" not in pre_items and pre_items["activations"] == items["activations"]
    assert pre.device_peak == plan.device_peak - items["reference_shards"]
    assert any("training.dpo.precompute_ref" in n for n in pre.notes)
    # orpo and simpo need no reference.
    orpo = _plan(DPO_8CARD, real_model_dir, 8, "training.dpo.loss=orpo")
    assert "reference_shards" not in {i.key for i in orpo.items}
    assert any("uses no reference model" in n for n in orpo.notes)


def test_dpo_lora_uses_the_base_as_reference(real_model_dir):
    plan = _plan(LORA_1GPU, real_model_dir, 1, "training.stage=dpo")
    assert "reference_shards" not in {i.key for i in plan.items}
    assert any("adapters off" in n for n in plan.notes)
    with_model = _plan(
        LORA_1GPU, real_model_dir, 1, "training.stage=dpo", f"training.dpo.ref_model={real_model_dir}"
    )
    ref = next(i.bytes for i in with_model.items if i.key == "reference_shards")
    assert ref == 2 * BASE_PARAMS  # one device: the whole base in bf16, no adapters
