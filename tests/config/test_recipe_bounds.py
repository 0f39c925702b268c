"""Rules of the recipe alone are the schema's: integers within C's range, the seed and token bounds,
the attention kernels, the context-parallel rules, and recipes nested too deeply to read."""

from __future__ import annotations

import pytest

from magistral_cli.config.loader import apply_overrides, load_recipe, validate_recipe
from magistral_cli.config.schema import ATTN_IMPLEMENTATIONS, INT64_MAX, SEED_MAX, TOKENS_MAX
from magistral_cli.errors import UserError

BASIC = "data.dataset_param.basic_parameters"


def _recipe(*overrides: str):
    data = {"training": {"train_iters": 3}}
    return validate_recipe(apply_overrides(data, list(overrides)))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (f"training.train_iters={10**30}", f"training.train_iters: {10**30} does not fit in 64 bits"),
        (f"training.save_interval={2**63}", f"training.save_interval: {2**63} does not fit in 64 bits"),
        (
            f"tools.profile.ranks=[0, {10**20}]",
            f"tools.profile.ranks: item 1 ({10**20}) does not fit in 64 bits",
        ),
        (f"{BASIC}.val_size={10**30}", f"{BASIC}.val_size: {10**30} does not fit in 64 bits"),
        (f"training.seed={10**30}", "training.seed: Input should be less than or equal to 4294967295"),
        (f"training.seed={SEED_MAX + 1}", "training.seed: Input should be less than or equal to 4294967295"),
        ("training.seed=-1", "training.seed: Input should be greater than or equal to 0"),
        (
            f"{BASIC}.cutoff_len={10**30}",
            f"{BASIC}.cutoff_len: Input should be less than or equal to {TOKENS_MAX}",
        ),
        (
            f"{BASIC}.cutoff_len={2**31}",
            f"{BASIC}.cutoff_len: Input should be less than or equal to {TOKENS_MAX}",
        ),
        ("model.attn_implementation=flash", "model.attn_implementation: 'flash' is not supported; use sdpa"),
        (
            "parallel.fsdp_plan.reshard_after_forward=sometimes",
            "parallel.fsdp_plan.reshard_after_forward: must be true, false or 'always', got 'sometimes'",
        ),
    ],
)
def test_out_of_range_values_name_the_key(override, message):
    with pytest.raises(UserError, match="invalid recipe") as info:
        _recipe(override)
    assert message in str(info.value)


def test_the_bounds_themselves_are_accepted():
    recipe = _recipe(
        f"training.seed={SEED_MAX}", f"{BASIC}.cutoff_len={TOKENS_MAX}", f"training.train_iters={INT64_MAX}"
    )
    assert recipe.training.seed == SEED_MAX and recipe.training.train_iters == INT64_MAX
    assert _recipe("training.seed=0").training.seed == 0
    for value in (True, False, "always"):
        plan = _recipe(f"parallel.fsdp_plan.reshard_after_forward={str(value).lower()}").parallel.fsdp_plan
        assert plan.reshard_after_forward == value


def test_a_packed_micro_batch_must_fit_the_int32_attention_offsets():
    with pytest.raises(UserError, match="int32 offsets"):
        _recipe(f"{BASIC}.packing=true", "training.micro_batch_size=2", f"{BASIC}.cutoff_len={2**30}")
    _recipe("training.micro_batch_size=2", f"{BASIC}.cutoff_len={2**30}")  # unpacked: no offsets


def test_every_attention_the_schema_accepts_is_one_the_ops_resolve():
    from magistral_cli.ops.attention import resolve_attention

    for name in ATTN_IMPLEMENTATIONS:
        assert _recipe(f"model.attn_implementation={name}").model.attn_implementation == name
        resolve_attention(name, "cpu")  # no ValueError: the two lists agree
    with pytest.raises(ValueError):
        resolve_attention("flash", "cpu")


def test_context_parallel_rules_of_the_recipe_alone():
    cp = "parallel.ulysses_parallel_size=2"
    with pytest.raises(UserError, match="ignore_pad_token_for_loss: false would train differently"):
        _recipe(cp, "data.dataloader_param.collate_param.ignore_pad_token_for_loss=false")
    with pytest.raises(
        UserError, match="per_sample_loss with context parallelism .* needs training.micro_batch_size: 1"
    ):
        _recipe(cp, "features.loss_cfg.loss_type=per_sample_loss", "training.micro_batch_size=2")
    _recipe(cp, "features.loss_cfg.loss_type=per_sample_loss", "training.micro_batch_size=1")
    _recipe("data.dataloader_param.collate_param.ignore_pad_token_for_loss=false")  # no CP: fine


def test_a_recipe_nested_too_deeply_is_one_yaml_error(tmp_path):
    deep = "[" * 5000 + "1" + "]" * 5000
    path = tmp_path / "deep.yaml"
    path.write_text(f"training:\n  train_iters: {deep}\n")
    with pytest.raises(UserError, match="is not valid YAML: lists or mappings nested too deeply to read"):
        load_recipe(path)
    path.write_text("training:\n  train_iters: 3\n")
    with pytest.raises(UserError, match="not valid YAML .lists or mappings nested too deeply to read"):
        load_recipe(path, [f"training.train_iters={deep}"])
