"""Command-line overrides in torchtune's form, typed by the schema."""

from __future__ import annotations

import pytest

from magistral_cli.config import apply_overrides, validate_recipe
from magistral_cli.config.loader import parse_override
from magistral_cli.errors import UserError


def test_overrides_are_typed_by_the_schema():
    data = apply_overrides(
        {"training": {"train_iters": 5}},
        [
            "training.lr=2e-5",
            "parallel.ulysses_parallel_size=2",
            "model.freeze=[model.vision_tower]",
            "training.adam_fused=true",
            "training.load=null",
        ],
    )
    recipe = validate_recipe(data)
    assert recipe.training.lr == pytest.approx(2e-5) and isinstance(recipe.training.lr, float)
    assert recipe.parallel.ulysses_parallel_size == 2
    assert recipe.model.freeze == ["model.vision_tower"]
    assert recipe.training.adam_fused is True
    assert recipe.training.load is None


def test_override_creates_missing_sections_and_replaces_values():
    data = apply_overrides(
        {"training": {"train_iters": 5}}, ["features.chunkloss_plan.chunk_size=64", "training.train_iters=7"]
    )
    assert data["features"] == {"chunkloss_plan": {"chunk_size": 64}}
    assert data["training"]["train_iters"] == 7


def test_override_value_may_contain_equals():
    assert parse_override("training.output_dir=/runs/a=b") == (["training", "output_dir"], "/runs/a=b")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("training.lr", "not of the form key=value"),
        ("=3", "empty key"),
        ("training..lr=3", "empty key"),
        ("training.lr=[1, 2", "not valid YAML"),
    ],
)
def test_malformed_overrides(text, message):
    with pytest.raises(UserError, match=message):
        parse_override(text)


def test_override_into_a_value_is_refused():
    with pytest.raises(UserError, match="training.lr is a value, not a section"):
        apply_overrides({"training": {"lr": 1.0}}, ["training.lr.x=1"])


def test_unknown_override_key_names_the_nearest():
    data = apply_overrides({"training": {"train_iters": 5}}, ["training.lrr=1e-5"])
    with pytest.raises(UserError, match=r"did you mean training\.lr\?"):
        validate_recipe(data)
