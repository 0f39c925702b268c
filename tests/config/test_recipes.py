"""Every shipped recipe and every seed config validates; bad input names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from magistral_cli.config import check_world_size, load_recipe, read_yaml, recipe_to_yaml, validate_recipe
from magistral_cli.errors import UserError

REPO = Path(__file__).resolve().parents[2]
SEED_CONFIGS = sorted((REPO / "tests" / "fixtures" / "seed_configs").glob("*.yaml"))
SHIPPED = sorted((REPO / "recipes").rglob("*.yaml"))


def test_fixture_sets_are_complete():
    assert len(SEED_CONFIGS) == 4
    assert {p.parent.name for p in SHIPPED} == {"magistral-small-2509", "tiny"}
    # The seed's four ported configs, the LoRA, QLoRA and DPO recipes.
    assert len([p for p in SHIPPED if p.parent.name == "magistral-small-2509"]) == 7


@pytest.mark.parametrize("path", SEED_CONFIGS, ids=lambda p: p.name)
def test_seed_configs_validate_with_path_overrides(path, tmp_path):
    overrides = [
        f"data.dataset_param.preprocess_parameters.model_name_or_path={tmp_path}/model",
        f"model.model_name_or_path={tmp_path}/model",
        f"training.load={tmp_path}/model",
        f"data.dataset_param.basic_parameters.dataset={tmp_path}/data.json",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp_path}",
    ]
    recipe = load_recipe(path, overrides)
    assert recipe.model.model_name_or_path == f"{tmp_path}/model"
    assert recipe.training.load == f"{tmp_path}/model"
    assert recipe.parallel.fsdp_plan.param_dtype == "bf16"
    assert recipe.model.freeze == ["model.vision_tower", "model.multi_modal_projector"]


def test_seed_config_values_are_read_not_defaulted():
    by_name = {p.name: load_recipe(p) for p in SEED_CONFIGS}
    assert by_name["magistral_2509_config_v1_4card.yaml"].training.optimizer == "adamw_swap"
    assert by_name["magistral_2509_config_v1_4card.yaml"].training.gradient_accumulation_steps == 2
    optimized = by_name["magistral_2509_config_optimized.yaml"]
    assert optimized.parallel.fsdp_plan.use_triton_split_copy is True
    assert optimized.parallel.fsdp_plan.num_to_forward_prefetch == 1
    assert optimized.training.freeze_gc_after_init is True
    assert optimized.features.chunkloss_plan.chunk_size == 1024
    assert len(optimized.features.contiguous_linear_grad_modules) == 3
    assert by_name["baseline_pure_fsdp2.yaml"].training.train_iters == 2000
    assert by_name["baseline_pure_fsdp2.yaml"].training.load_format == "hf"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_recipes_validate_and_open_with_commands(path):
    recipe = load_recipe(path)
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#"), "every recipe opens with a comment giving the commands"
    assert f"magistral train recipes/{path.parent.name}/{path.name}" in text
    assert text.isascii()
    if path.parent.name == "magistral-small-2509":
        assert "magistral fetch --model-dir" in text
        # The seed's 4- and 8-card recipes; LoRA fits one device.
        assert recipe.parallel.nproc_per_node in ((1,) if recipe.model.lora is not None else (4, 8))
    if recipe.model.lora is not None and recipe.model.lora.quantize_base != "none":
        # QLoRA recipes say what they need installed and that the adapters apply to the bf16 base.
        assert "pip install 'magistral-cli[qlora]'" in text and "--lora adapters" in text


def test_ported_recipes_keep_the_seed_settings():
    """The ported copies differ from the seed configs only in paths, comments and additions."""
    pairs = {
        "v1_8card.yaml": "magistral_2509_config_v1.yaml",
        "v1_4card_adamw_swap.yaml": "magistral_2509_config_v1_4card.yaml",
        "a3_optimized.yaml": "magistral_2509_config_optimized.yaml",
        "baseline_2000_steps.yaml": "baseline_pure_fsdp2.yaml",
    }
    for ours, seed in pairs.items():
        a = load_recipe(REPO / "recipes" / "magistral-small-2509" / ours).model_dump()
        b = load_recipe(REPO / "tests" / "fixtures" / "seed_configs" / seed).model_dump()
        for d in (a, b):
            d["parallel"].pop("nproc_per_node")
            d["training"]["plugin"] = []
            for key in ("model_name_or_path",):
                d["data"]["dataset_param"]["preprocess_parameters"][key] = None
                d["model"][key] = None
            d["training"]["load"] = None
            basic = d["data"]["dataset_param"]["basic_parameters"]
            basic["dataset"] = basic["dataset_dir"] = basic["cache_dir"] = None
        assert a == b, ours


def test_anchors_and_aliases(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "model:\n  model_name_or_path: &M /models/x\ntraining:\n  train_iters: 3\n  load: *M\n",
        encoding="utf-8",
    )
    recipe = load_recipe(path)
    assert recipe.training.load == "/models/x" == recipe.model.model_name_or_path


def test_unsafe_yaml_tags_are_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("training: !!python/object/apply:os.system ['echo hi']\n", encoding="utf-8")
    with pytest.raises(UserError, match="not valid YAML"):
        read_yaml(path)


def _minimal(**training):
    return {"training": {"train_iters": 10, **training}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_minimal(lrr=1e-5), r"unknown key training\.lrr \(did you mean training\.lr\?\)"),
        ({"trainig": {"train_iters": 1}}, r"unknown key trainig \(did you mean training\?\)"),
        (_minimal(lr="fast"), r"training\.lr: .*valid number.*'fast'"),
        (
            _minimal(gradient_accumulation_steps=0),
            r"training\.gradient_accumulation_steps: .*greater than or equal to 1",
        ),
        (_minimal(lr_warmup_ratio=1.5), r"training\.lr_warmup_ratio: .*less than or equal to 1"),
        (_minimal(lr_warmup_ratio=-0.1), r"training\.lr_warmup_ratio: .*greater than or equal to 0"),
        (
            _minimal(freeze_gc_after_init=True, manual_gc_interval=10),
            r"freeze_gc_after_init cannot be combined with manual_gc_interval",
        ),
        ({"training": {}}, r"training\.train_iters: required but missing"),
        (
            {**_minimal(), "parallel": {"fsdp_plan": {"param_dtype": "bf8"}}},
            r"parallel\.fsdp_plan\.param_dtype: .*'bf16'",
        ),
        ({**_minimal(), "parallel": {"tensor_parallel_size": 2}}, r"tensor parallelism is not supported"),
        ({**_minimal(), "parallel": {"fully_shard_parallel_size": 0}}, r"'auto' or a positive integer"),
        ({**_minimal(), "model": {"model_id": "qwen2_vl"}}, r"model\.model_id: .*not supported"),
        ({**_minimal(), "features": {"recompute": True}}, r"recompute_plan\.apply_modules is empty"),
        (
            {**_minimal(), "data": {"dataset_param": {"attr": {"imagez": "x"}}}},
            r"data\.dataset_param\.attr\.imagez \(did you mean data\.dataset_param\.attr\.images\?\)",
        ),
    ],
)
def test_bad_recipes_name_the_problem(data, message):
    with pytest.raises(UserError, match=message):
        validate_recipe(data)


def test_neat_packing_turns_packing_on_and_is_refused_with_context_parallelism():
    neat = {"data": {"dataset_param": {"basic_parameters": {"neat_packing": True}}}}
    recipe = validate_recipe({**_minimal(), **neat})
    basic = recipe.data.dataset_param.basic_parameters
    assert basic.neat_packing and basic.packing  # LLaMA-Factory's rule: a neat pack is a pack
    with pytest.raises(UserError) as info:
        validate_recipe({**_minimal(), **neat, "parallel": {"ulysses_parallel_size": 2}})
    message = str(info.value)
    assert (
        "neat_packing with context parallelism" in message
        and "would let packed samples see each other" in message
    )
    assert "set both CP sizes to 1, or use packing: true" in message
    with pytest.raises(UserError, match="neat_packing: true with packing: false"):
        validate_recipe(
            {
                **_minimal(),
                "data": {"dataset_param": {"basic_parameters": {"packing": False, "neat_packing": True}}},
            }
        )
    plain = validate_recipe(
        {**_minimal(), "data": {"dataset_param": {"basic_parameters": {"packing": True}}}}
    )
    with pytest.raises(ValueError, match="with packing: false"):  # assignment is validated too
        plain.data.dataset_param.basic_parameters.packing = False
        plain.data.dataset_param.basic_parameters.neat_packing = True


def test_all_problems_are_reported_at_once():
    with pytest.raises(UserError) as info:
        validate_recipe(_minimal(lrr=1, seedd=2))
    assert "training.lrr" in str(info.value) and "training.seedd" in str(info.value)


@pytest.mark.parametrize(
    ("ulysses", "ring", "fsdp", "world", "expected"),
    [(1, 1, "auto", 8, 8), (2, 1, "auto", 8, 4), (2, 2, "auto", 8, 2), (2, 1, 4, 8, 4)],
)
def test_world_size_divisibility(ulysses, ring, fsdp, world, expected):
    recipe = validate_recipe(
        {
            **_minimal(),
            "parallel": {
                "ulysses_parallel_size": ulysses,
                "ring_attention_size": ring,
                "fully_shard_parallel_size": fsdp,
            },
        }
    )
    assert check_world_size(recipe, world) == expected


@pytest.mark.parametrize(
    ("parallel", "world", "message"),
    [
        ({"ulysses_parallel_size": 3}, 8, "does not divide the world size 8"),
        ({"ulysses_parallel_size": 2, "ring_attention_size": 2}, 6, "= 4\\) does not divide"),
        ({"fully_shard_parallel_size": 3}, 8, "set it to 8 or 'auto'"),
    ],
)
def test_world_size_errors(parallel, world, message):
    recipe = validate_recipe({**_minimal(), "parallel": parallel})
    with pytest.raises(UserError, match=message):
        check_world_size(recipe, world)


def test_resolved_yaml_round_trips_with_every_default():
    recipe = load_recipe(SEED_CONFIGS[0])
    text = recipe_to_yaml(recipe)
    data = yaml.safe_load(text)
    assert data["training"]["adam_beta2"] == 0.999  # a default filled in
    assert validate_recipe(data) == recipe
