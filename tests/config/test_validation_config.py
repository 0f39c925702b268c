"""``data.dataset_param.basic_parameters.val_size`` and ``training.eval_interval``: defaults, the
fraction / count reading, and every bad value refused with the key and the fix."""

from __future__ import annotations

import pytest

from magistral_cli.config import recipe_to_yaml, validate_recipe
from magistral_cli.config.loader import apply_overrides
from magistral_cli.config.schema import BasicParameters, Training
from magistral_cli.errors import UserError

VAL_SIZE = "data.dataset_param.basic_parameters.val_size"


def _recipe(val_size=None, eval_interval=None, dataset_type=None) -> dict:
    data: dict = {"training": {"train_iters": 4}}
    overrides = []
    if val_size is not None:
        overrides.append(f"{VAL_SIZE}={val_size}")
    if eval_interval is not None:
        overrides.append(f"training.eval_interval={eval_interval}")
    if dataset_type is not None:
        overrides.append(f"data.dataset_param.dataset_type={dataset_type}")
    return apply_overrides(data, overrides)


def test_defaults_mean_no_validation():
    recipe = validate_recipe(_recipe())
    assert recipe.data.dataset_param.basic_parameters.val_size == 0
    assert recipe.training.eval_interval is None
    assert "val_size: 0" in recipe_to_yaml(recipe) and "eval_interval: null" in recipe_to_yaml(recipe)


@pytest.mark.parametrize(
    ("given", "kept"),
    [("0.05", 0.05), ("0.5", 0.5), ("1", 1), ("200", 200), ("200.0", 200), ("3.0", 3), ("0", 0), ("0.0", 0)],
)
def test_fraction_or_count(given, kept):
    value = validate_recipe(_recipe(val_size=given)).data.dataset_param.basic_parameters.val_size
    assert value == kept and type(value) is type(kept)  # an integral float >= 1 is a count (an int)


def test_yaml_values_and_the_schema_class():
    assert BasicParameters(val_size=0.25).val_size == 0.25
    assert BasicParameters(val_size=12).val_size == 12
    assert BasicParameters(val_size=12.0).val_size == 12
    assert isinstance(BasicParameters(val_size=12.0).val_size, int)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("-1", "must be 0 (no validation), a fraction in (0, 1) or a count >= 1"),
        ("-0.1", "must be 0 (no validation), a fraction in (0, 1) or a count >= 1"),
        ("1.5", "neither a fraction in (0, 1) nor a whole count"),
        ("1.0", "1.0 as a fraction would take the whole dataset"),
        ("true", "boolean true"),
        ("ten", "val_size"),
        (".inf", "finite"),
    ],
)
def test_bad_val_size_is_refused_naming_the_key(given, message):
    with pytest.raises(UserError) as err:
        validate_recipe(_recipe(val_size=given))
    text = str(err.value)
    assert VAL_SIZE in text and message in text


def test_eval_interval():
    recipe = validate_recipe(_recipe(val_size="0.1", eval_interval="5"))
    assert recipe.training.eval_interval == 5
    # No interval with a split: evaluate at the end only (the trainer's reading of None).
    assert validate_recipe(_recipe(val_size="8")).training.eval_interval is None
    for bad in ("0", "-2"):
        with pytest.raises(UserError, match=r"training\.eval_interval: .*greater than or equal to 1"):
            validate_recipe(_recipe(val_size="0.1", eval_interval=bad))
    with pytest.raises(UserError, match=r"training\.eval_interval"):
        validate_recipe(_recipe(val_size="0.1", eval_interval="1.5"))


def test_eval_interval_needs_a_validation_split():
    for val_size in (None, "0"):
        with pytest.raises(UserError) as err:
            validate_recipe(_recipe(val_size=val_size, eval_interval="10"))
        assert (
            "training.eval_interval needs a validation split: set data.dataset_param.basic_parameters.val_size"
            in str(err.value)
        )


def test_synthetic_data_takes_a_count_only():
    recipe = validate_recipe(_recipe(val_size="4", dataset_type="synthetic"))
    assert recipe.data.dataset_param.basic_parameters.val_size == 4
    with pytest.raises(UserError) as err:
        validate_recipe(_recipe(val_size="0.1", dataset_type="synthetic"))
    assert VAL_SIZE in str(err.value) and "count" in str(err.value)


def test_val_interval_points_to_eval_interval():
    """The skeleton's placeholder ``training.val_interval`` (0 only) now names the key that works."""
    assert Training(train_iters=1, val_interval=0).val_interval == 0
    with pytest.raises(UserError) as err:
        validate_recipe(apply_overrides(_recipe(), ["training.val_interval=10"]))
    assert "training.val_interval" in str(err.value) and "training.eval_interval" in str(err.value)


def test_descriptions_mark_the_additions():
    for model, name in ((BasicParameters, "val_size"), (Training, "eval_interval")):
        description = model.model_fields[name].description
        assert description.startswith("Addition.") and len(description) > 40
