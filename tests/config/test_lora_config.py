"""``model.lora``: the schema (MindSpeed-MM's --lora-r / --lora-alpha / --lora-dropout / --lora-target-modules)
and how its names and patterns resolve on the model; every bad value names the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from magistral_cli.config import load_recipe, recipe_to_yaml, validate_recipe
from magistral_cli.config.loader import apply_overrides
from magistral_cli.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TINY_LORA = REPO / "recipes" / "tiny" / "tiny_cpu_lora.yaml"
LORA_1GPU = REPO / "recipes" / "magistral-small-2509" / "lora_1gpu.yaml"
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _recipe(lora, **model):
    return {"training": {"train_iters": 1}, "model": {"lora": lora, **model}}


def test_the_lora_recipes_validate():
    tiny = load_recipe(TINY_LORA).model.lora
    assert (tiny.r, tiny.alpha, tiny.dropout, tiny.target_modules) == (
        8,
        16,
        0.0,
        SEVEN,
    )  # MindSpeed's example
    big = load_recipe(LORA_1GPU)
    assert (big.model.lora.r, big.model.lora.alpha, big.model.lora.scaling) == (16, 32, 2.0)
    assert big.parallel.nproc_per_node == 1 and big.parallel.device == "cuda"
    assert (
        big.parallel.fsdp_plan.param_dtype == "bf16"
        and big.features.recompute
        and big.features.enable_chunk_loss
    )


def test_defaults_and_absence():
    assert validate_recipe({"training": {"train_iters": 1}}).model.lora is None  # full fine-tuning
    spec = validate_recipe(_recipe({"target_modules": ["q_proj"]})).model.lora
    assert (spec.r, spec.alpha, spec.dropout, spec.apply_to, spec.modules_to_save) == (
        16,
        32,
        0.0,
        ["language_model"],
        [],
    )
    assert spec.init_lora_weights is True  # PEFT's default
    assert (
        validate_recipe(
            _recipe({"target_modules": ["q_proj"], "init_lora_weights": "Gaussian"})
        ).model.lora.init_lora_weights
        == "gaussian"
    )


def test_overrides_set_and_remove_lora():
    data = apply_overrides(
        {"training": {"train_iters": 1}},
        ["model.lora.target_modules=[q_proj,v_proj]", "model.lora.r=8", "model.lora.dropout=0.1"],
    )
    spec = validate_recipe(data).model.lora
    assert spec.target_modules == ["q_proj", "v_proj"] and spec.r == 8 and spec.dropout == 0.1
    off = apply_overrides(yaml.safe_load(LORA_1GPU.read_text()), ["model.lora=null"])
    assert validate_recipe(off).model.lora is None
    # Patterns with {*} parse unquoted, as for model.freeze.
    data = apply_overrides(
        {"training": {"train_iters": 1}},
        ["model.lora.target_modules=[model.language_model.layers.{*}.mlp.up_proj]"],
    )
    assert validate_recipe(data).model.lora.target_modules == ["model.language_model.layers.{*}.mlp.up_proj"]


def test_the_resolved_recipe_round_trips():
    recipe = load_recipe(LORA_1GPU)
    assert validate_recipe(yaml.safe_load(recipe_to_yaml(recipe))) == recipe


@pytest.mark.parametrize(
    ("lora", "model", "message"),
    [
        (
            {},
            {},
            r"model\.lora\.target_modules: is empty; list the Linear layers to adapt.*or remove model\.lora",
        ),
        ({"target_modules": []}, {}, r"model\.lora\.target_modules: is empty"),
        (
            {"target_modules": ["q_proj"], "rank": 8},
            {},
            r"unknown key model\.lora\.rank \(valid keys here: r, alpha",
        ),
        (
            {"target_modules": ["q_proj"], "lora_alpha": 8},
            {},
            r"unknown key model\.lora\.lora_alpha \(did you mean model\.lora\.alpha\?\)",
        ),
        ({"target_modules": ["q_proj"], "r": 0}, {}, r"model\.lora\.r: .*greater than or equal to 1"),
        ({"target_modules": ["q_proj"], "dropout": 1.0}, {}, r"model\.lora\.dropout: .*less than 1"),
        (
            {"target_modules": ["q_proj"], "r": True},
            {},
            r"model\.lora\.r: got the boolean true, which is not an integer",
        ),
        (
            {"target_modules": ["q_proj", "q_proj"]},
            {},
            r"model\.lora\.target_modules: 'q_proj' is listed twice; list each name once",
        ),
        (
            {"target_modules": ["q proj"]},
            {},
            r"model\.lora\.target_modules: 'q proj' is empty or has spaces; write a layer name",
        ),
        (
            {"target_modules": ["q_proj"], "init_lora_weights": "pissa"},
            {},
            r"model\.lora\.init_lora_weights: 'pissa' is not supported; use true",
        ),
        (
            {"target_modules": ["q_proj"], "apply_to": ["decoder"]},
            {},
            r"model\.lora\.apply_to\[0\]: .*'language_model', 'projector' or 'vision_tower'",
        ),
        ({"target_modules": ["q_proj"], "apply_to": []}, {}, r"model\.lora\.apply_to: .*at least 1 item"),
        (
            {"target_modules": ["linear_1"], "apply_to": ["projector"]},
            {},
            r"model: lora\.apply_to has 'projector' but freeze has 'model\.multi_modal_projector'.*remove "
            r"'model\.multi_modal_projector' from model\.freeze",
        ),
    ],
)
def test_bad_lora_settings_name_the_key_and_the_fix(lora, model, message):
    with pytest.raises(UserError, match=message):
        validate_recipe(_recipe(lora, **model))


@pytest.mark.parametrize(
    ("lora", "section", "message"),
    [
        ({"quantize_base": "int4"}, {}, r"model\.lora\.quantize_base: .*'none' or 'nf4'"),
        ({"quantize_block_size": 63}, {}, r"model\.lora\.quantize_block_size: .*63 is odd; NF4 packs two"),
        (
            {},
            {"training": {"load": None}},
            r"quantize_base: nf4 quantises the base .*training\.load is unset",
        ),
        ({}, {"model": {"compile": True}}, r"model\.compile with model\.lora\.quantize_base: nf4 .*false"),
        (
            {},
            {"features": {"contiguous_linear_grad_modules": ["model.language_model.layers.{*}.mlp.up_proj"]}},
            r"contiguous_linear_grad_modules with model\.lora\.quantize_base: nf4: .*\[\]",
        ),
    ],
)
def test_bad_qlora_settings_name_the_key_and_the_fix(lora, section, message):
    raw = _recipe({"target_modules": SEVEN, "quantize_base": "nf4", **lora})
    raw["training"]["load"] = "/models/base"
    for key, values in section.items():
        raw.setdefault(key, {}).update(values)
    with pytest.raises(UserError, match=message):
        validate_recipe(raw)
    qlora = load_recipe(REPO / "recipes" / "tiny" / "tiny_cpu_qlora.yaml").model.lora
    assert (qlora.quantize_base, qlora.quantize_block_size, qlora.quantize_scaler_block_size) == (
        "nf4",
        64,
        16,
    )
    assert load_recipe(TINY_LORA).model.lora.quantize_base == "none"  # the default: plain LoRA


def test_adapting_the_projector_is_accepted_once_it_is_not_frozen():
    spec = validate_recipe(
        _recipe({"target_modules": ["linear_1"], "apply_to": ["projector"]}, freeze=["model.vision_tower"])
    ).model.lora
    assert spec.apply_to == ["projector"]


# --------------------------------------------------------------------------- names and patterns on the model


@pytest.fixture(scope="module")
def meta_model():
    from magistral_cli.engine.model import build_model, install_loss_head
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    def build():
        model = build_model(tiny_mistral3_config(vocab_size=512), meta=True, attn_implementation="sdpa")
        install_loss_head(model, "lm_head", None)
        return model

    return build


def _spec(**lora):
    return validate_recipe(_recipe(lora, freeze=[])).model.lora


def test_bare_names_stay_in_the_language_model_and_patterns_reach_anywhere(meta_model):
    from magistral_cli.engine.lora import resolve_targets

    model = meta_model()
    lm = resolve_targets(model, _spec(target_modules=SEVEN))
    assert len(lm.modules) == 2 * 7 and all(n.startswith("model.language_model.layers.") for n in lm.modules)
    # Pixtral's attention has q_proj too: only apply_to vision_tower reaches it by name.
    both = resolve_targets(
        model, _spec(target_modules=["q_proj"], apply_to=["language_model", "vision_tower"])
    )
    assert sum(n.startswith("model.vision_tower.") for n in both.modules) == 2 and len(both.modules) == 4
    patterns = resolve_targets(
        model,
        _spec(
            target_modules=[
                "model.multi_modal_projector.linear_1",
                "model.language_model.layers.{*}.mlp.down_proj",
            ]
        ),
    )
    assert patterns.modules == (  # in the model's order
        "model.multi_modal_projector.linear_1",
        "model.language_model.layers.0.mlp.down_proj",
        "model.language_model.layers.1.mlp.down_proj",
    )
    saved = resolve_targets(model, _spec(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert saved.modules_to_save == ("lm_head",)


@pytest.mark.parametrize(
    ("lora", "freeze", "message"),
    [
        (
            {"target_modules": ["qkv_proj"]},
            [],
            r"model\.lora\.target_modules: 'qkv_proj' is not the name of a Linear layer in language_model "
            r"\(model\.lora\.apply_to\); the Linear layers there are: down_proj, gate_proj, k_proj, o_proj, q_proj",
        ),
        (
            {"target_modules": ["linear_1"]},
            [],
            r"'linear_1' is not the name .* it exists in projector: add that to model\.lora\.apply_to",
        ),
        (
            {"target_modules": ["model.language_model.layer.{*}.self_attn.q_proj"]},
            [],
            r"model\.lora\.target_modules pattern 'model\.language_model\.layer\.\{\*\}\.self_attn\.q_proj' matches "
            r"no module of the model; closest module names: model\.language_model\.layers\.0\.self_attn\.q_proj",
        ),
        (
            {"target_modules": ["model.language_model.layers.{*}.self_attn"]},
            [],
            r"matches 'model\.language_model\.layers\.0\.self_attn', a MistralAttention, not a Linear layer.*"
            r"name the Linear layers themselves, e\.g\. model\.language_model\.layers\.0\.self_attn\.q_proj",
        ),
        (
            {"target_modules": ["lm_head"]},
            [],
            r"'lm_head' is the output head.*model\.lora\.modules_to_save: \[lm_head\]",
        ),
        (
            {"target_modules": ["q_proj"], "modules_to_save": ["model.language_model.layers.0.self_attn"]},
            [],
            r"'model\.language_model\.layers\.0\.self_attn\.q_proj' is both a LoRA target and \(inside\) a module of modules_to_save",
        ),
        (
            {"target_modules": ["q_proj"], "modules_to_save": ["model.language_model.normm"]},
            [],
            r"model\.lora\.modules_to_save pattern 'model\.language_model\.normm' matches no module",
        ),
        (
            {"target_modules": ["q_proj"]},
            ["model.language_model.layers.{*}"],
            r"'model\.language_model\.layers\.0\.self_attn\.q_proj' is inside 'model\.language_model\.layers\.0', "
            r"which model\.freeze freezes.*remove that pattern from model\.freeze",
        ),
    ],
)
def test_unknown_or_unmatched_targets_are_errors(meta_model, lora, freeze, message):
    from magistral_cli.engine.lora import resolve_targets

    with pytest.raises(UserError, match=message):
        resolve_targets(meta_model(), _spec(**lora), freeze)


def test_apply_lora_freezes_the_base_and_maps_the_keys(meta_model):
    from magistral_cli.engine import lora

    model = meta_model()
    plain = set(model.state_dict())
    applied = lora.apply_lora(
        model, _spec(target_modules=SEVEN, r=4, modules_to_save=["lm_head"]), frozen_dtype=torch.bfloat16
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(applied.trainable) and "lm_head.weight" in trainable
    assert {n for n in trainable if n != "lm_head.weight"} == {
        f"{m}.lora_{x}.default.weight" for m in applied.targets.modules for x in "AB"
    }
    assert {p.dtype for n, p in model.named_parameters() if n not in trainable} == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if n in trainable} == {torch.float32}
    # The base's keys come back from the wrapped model's, and go there again.
    wrapped = model.state_dict()
    assert set(lora.base_state_dict(wrapped)) == plain
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert (
        lora.wrapped_key(key, applied.targets)
        == "model.language_model.layers.0.self_attn.q_proj.base_layer.weight"
    )
    assert lora.wrapped_key("lm_head.weight", applied.targets) == "lm_head.weight"
    assert lora.peft_file_key("model.language_model.layers.0.mlp.up_proj.lora_B.default.weight") == (
        "base_model.model.model.language_model.layers.0.mlp.up_proj.lora_B.weight"
    )
    # The contiguous-Linear kernel is pointed at PEFT's wrapped nn.Linear.
    assert lora.contiguous_linear_patterns(
        ["model.language_model.layers.{*}.mlp.down_proj", "lm_head"], applied.targets
    ) == [
        "model.language_model.layers.{*}.mlp.down_proj.base_layer",
        "lm_head",
    ]


def test_a_kernel_pattern_over_adapted_and_plain_layers_is_refused(meta_model):
    from magistral_cli.engine import lora

    model = meta_model()
    applied = lora.apply_lora(model, _spec(target_modules=["model.language_model.layers.0.self_attn.q_proj"]))
    with pytest.raises(
        UserError, match=r"matches LoRA targets .* and plain Linear layers .*separate patterns"
    ):
        lora.contiguous_linear_patterns(
            ["model.language_model.layers.{*}.self_attn.q_proj"], applied.targets, model
        )
    assert lora.contiguous_linear_patterns(
        ["model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.1.self_attn.q_proj"],
        applied.targets,
        model,
    ) == [
        "model.language_model.layers.0.self_attn.q_proj.base_layer",
        "model.language_model.layers.1.self_attn.q_proj",
    ]


def test_meta_init_follows_peft_defaults_after_materialize(meta_model):
    import math

    from magistral_cli.engine import lora
    from magistral_cli.engine.model import materialize

    model = meta_model()
    lora.apply_lora(model, _spec(target_modules=["q_proj", "down_proj"], r=4))
    materialize(model, torch.device("cpu"))
    assert lora.init_adapter_weights(model, True, seed=3) == 4
    layer = model.model.language_model.layers[1].mlp.down_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert torch.count_nonzero(b) == 0  # B zero: the model is the base at step 0
    bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
    a = a.detach()
    assert float(a.abs().max()) <= bound and float(a.std()) > bound / 3
    again = meta_model()
    lora.apply_lora(again, _spec(target_modules=["q_proj", "down_proj"], r=4))
    materialize(again, torch.device("cpu"))
    lora.init_adapter_weights(again, True, seed=3)
    assert torch.equal(
        again.model.language_model.layers[1].mlp.down_proj.lora_A["default"].weight, a
    )  # seeded
    lora.init_adapter_weights(again, "gaussian", seed=3)
    gauss = again.model.language_model.layers[1].mlp.down_proj.lora_A["default"].weight
    assert abs(float(gauss.detach().std()) - 1 / 4) < 0.05


def test_a_bad_target_through_the_cli_is_exit_2(tmp_path):
    from magistral_cli.cli.main import app
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    model_dir = save_official_checkpoint(
        build_tiny_model(tiny_mistral3_config(vocab_size=512)), tmp_path / "m"
    )
    result = CliRunner().invoke(
        app,
        [
            "train",
            str(TINY_LORA),
            f"model.model_name_or_path={model_dir}",
            f"training.load={model_dir}",
            f"training.output_dir={tmp_path / 'run'}",
            "model.lora.target_modules=[q_proj,qkv]",
            "--dry-run",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "'qkv' is not the name of a Linear layer" in result.output and "Traceback" not in result.output
