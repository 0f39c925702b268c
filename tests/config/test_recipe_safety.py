"""Recipe inputs that used to be accepted silently (the "run safety" cases).

Seen: a duplicate ``lr:`` or ``training:`` silently replaced the first, ``train_iters: true``
ran as 1, ``lr: .inf`` passed the check, and ``model.freeze=[model.vision_tower.{*}]`` did not
parse unquoted. Each must now be one UserError (exit 2) naming the key and the fix, or work.
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.config import apply_overrides, load_recipe, read_yaml, validate_recipe
from magistral_cli.config.loader import join_split_overrides, parse_override
from magistral_cli.config.schema import Recipe
from magistral_cli.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
runner = CliRunner()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _train(*args: str):
    return runner.invoke(app, ["train", *args, "--dry-run"])


# ----------------------------------------------------------------------------- duplicate keys


def test_a_duplicate_key_names_the_key_and_both_lines(tmp_path):
    path = _write(tmp_path, "training:\n  train_iters: 2\n  lr: 1.0e-3\n  lr: 7.0\n")
    with pytest.raises(UserError, match=r"duplicate key training\.lr at line 4 \(first set at line 3\)"):
        read_yaml(path)


def test_a_second_section_is_a_duplicate(tmp_path):
    path = _write(tmp_path, "training:\n  train_iters: 2\nmodel:\n  freeze: []\ntraining:\n  lr: 1.0e-3\n")
    with pytest.raises(UserError, match=r"duplicate key training at line 5 \(first set at line 1\)"):
        read_yaml(path)


def test_duplicates_are_found_in_flow_mappings_and_list_items(tmp_path):
    with pytest.raises(UserError, match=r"duplicate key a\[1\]\.b at line 4 \(first set at line 3\)"):
        read_yaml(_write(tmp_path, "a:\n  - {b: 1}\n  - b: 1\n    b: 2\n"))
    with pytest.raises(UserError, match=r"duplicate key x\.y at line 1"):
        read_yaml(_write(tmp_path, "x: {y: 1, y: 2}\n"))


def test_anchors_aliases_and_merge_keys_keep_working(tmp_path):
    """A key next to ``<<: *base`` overrides the merged one: that is the point of merging."""
    path = _write(
        tmp_path,
        "base: &base {lr: 1.0e-3, seed: 3}\n"
        "nested: &nested\n  <<: *base\n  seed: 4\n"
        "training:\n  <<: *nested\n  lr: 2.0e-3\n  load: &m /models/m\n  save: *m\n",
    )
    data = read_yaml(path)
    assert data["training"] == {"lr": 2.0e-3, "seed": 4, "load": "/models/m", "save": "/models/m"}
    assert data["nested"] == {"lr": 1.0e-3, "seed": 4}


def test_a_duplicate_inside_an_anchored_mapping_is_still_found(tmp_path):
    path = _write(tmp_path, "base: &b\n  lr: 1\n  lr: 2\ntraining:\n  <<: *b\n  train_iters: 1\n")
    with pytest.raises(UserError, match=r"duplicate key base\.lr at line 3"):
        read_yaml(path)


def test_an_override_value_that_repeats_a_key_is_refused():
    with pytest.raises(UserError, match="sets key a twice"):
        parse_override("tools.x={a: 1, a: 2}")


def test_duplicate_key_through_the_cli_is_exit_2_without_traceback(tmp_path):
    result = _train(str(_write(tmp_path, "training:\n  train_iters: 2\n  lr: 1.0e-3\n  lr: 7.0\n")))
    assert result.exit_code == 2, result.output
    assert "duplicate key training.lr at line 4 (first set at line 3)" in result.output
    assert "delete one of them" in result.output
    assert "Traceback" not in result.output


# ----------------------------------------------------------------------------- numbers


def _section_models(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    """(path, annotation) of every leaf field of the schema."""
    for name, field in model.model_fields.items():
        inner = _model_in(field.annotation)
        if inner is not None:
            yield from _section_models(inner, (*prefix, name))
        else:
            yield (*prefix, name), field.annotation


def _model_in(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _accepts(annotation, kind) -> bool:
    """``kind`` itself, or inside Optional / Union (not as the item type of a list)."""
    union = typing.get_origin(annotation) is typing.Union
    return annotation is kind or (union and any(arg is kind for arg in typing.get_args(annotation)))


LEAVES = list(_section_models(Recipe))
INT_FIELDS = [path for path, ann in LEAVES if _accepts(ann, int)]
FLOAT_FIELDS = [path for path, ann in LEAVES if _accepts(ann, float)]
INT_LIST_FIELDS = [
    path for path, ann in LEAVES if typing.get_origin(ann) is list and typing.get_args(ann) == (int,)
]


def _with(path: tuple[str, ...], value) -> dict:
    data: dict = {"training": {"train_iters": 1}}
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return data


def test_the_schema_walk_sees_the_fields_that_were_seen_failing():
    assert ("training", "train_iters") in INT_FIELDS
    assert {("training", "lr"), ("parallel", "device_memory_gib"), ("training", "adam_eps")} <= set(
        FLOAT_FIELDS
    )
    assert ("parallel", "fully_shard_parallel_size") in INT_FIELDS  # Union['auto', int]
    assert ("tools", "profile", "ranks") in INT_LIST_FIELDS
    assert len(INT_FIELDS) > 20 and len(FLOAT_FIELDS) >= 10


@pytest.mark.parametrize("path", INT_FIELDS + FLOAT_FIELDS, ids=".".join)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_a_number_in_any_field(path, value):
    with pytest.raises(UserError) as info:
        validate_recipe(_with(path, value))
    assert f"{'.'.join(path)}: got the boolean {str(value).lower()}" in str(info.value)


@pytest.mark.parametrize("path", INT_LIST_FIELDS, ids=".".join)
def test_a_boolean_is_not_an_item_of_a_list_of_integers(path):
    with pytest.raises(UserError, match=rf"{'.'.join(path)}: item 1 is the boolean true"):
        validate_recipe(_with(path, [0, True]))


@pytest.mark.parametrize("path", FLOAT_FIELDS, ids=".".join)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "inf", "-Infinity", "nan"], ids=str)
def test_every_float_field_refuses_non_finite_values(path, value):
    with pytest.raises(UserError) as info:
        validate_recipe(_with(path, value))
    assert f"{'.'.join(path)}: must be a finite number" in str(info.value)


def test_ints_and_number_strings_still_coerce_to_floats():
    recipe = validate_recipe({"training": {"train_iters": 1, "lr": 1, "clip_grad": "2e-1"}})
    assert recipe.training.lr == 1.0 and isinstance(recipe.training.lr, float)
    assert recipe.training.clip_grad == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("recipe_text", "overrides", "message"),
    [
        (
            "training:\n  train_iters: true\n",
            [],
            "training.train_iters: got the boolean true, which is not an integer",
        ),
        ("training:\n  train_iters: 2\n  lr: .inf\n", [], "training.lr: must be a finite number, got inf"),
        (
            "training:\n  train_iters: 2\n",
            ["training.lr=inf"],
            "training.lr: must be a finite number, got 'inf'",
        ),
        ("training:\n  train_iters: 2\n", ["training.train_iters=yes"], "YAML reads true/false, yes/no"),
        (
            "training:\n  train_iters: 2\n",
            ["parallel.device_memory_gib=.nan"],
            "parallel.device_memory_gib: must be",
        ),
    ],
)
def test_number_errors_through_the_cli_are_exit_2(tmp_path, recipe_text, overrides, message):
    result = _train(str(_write(tmp_path, recipe_text)), *overrides)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


# ----------------------------------------------------------------------------- patterns on the command line


def test_patterns_parse_unquoted():
    assert parse_override("model.freeze=[model.vision_tower.{*}]") == (
        ["model", "freeze"],
        ["model.vision_tower.{*}"],
    )
    assert parse_override("model.freeze=[a.{*}.b,'c.{*}']")[1] == ["a.{*}.b", "c.{*}"]
    assert parse_override("features.chunkloss_plan.apply_module=lm_head")[1] == "lm_head"


def test_a_list_split_by_the_shell_is_joined_again():
    pieces = ["model.freeze=[model.vision_tower.{*},", "model.multi_modal_projector]", "training.lr=1e-4"]
    assert join_split_overrides(pieces) == [
        "model.freeze=[model.vision_tower.{*}, model.multi_modal_projector]",
        "training.lr=1e-4",
    ]
    data = apply_overrides({"training": {"train_iters": 1}}, pieces)
    assert validate_recipe(data).model.freeze == ["model.vision_tower.{*}", "model.multi_modal_projector"]


@pytest.mark.parametrize(
    "pieces",
    [["model.freeze=[model.vision_tower.{*},"], ["model.freeze=[a]", "b]"], ["model.freeze=[a,", "x=1]"]],
)
def test_an_unjoinable_list_says_how_to_quote_it(pieces):
    with pytest.raises(
        UserError, match=r"quote the whole override as one shell argument, e\.g\. 'model\.freeze=\["
    ):
        apply_overrides({}, pieces)


def test_a_single_pattern_where_a_list_is_expected_says_how_to_write_the_list():
    data = apply_overrides({"training": {"train_iters": 1}}, ["model.freeze=model.vision_tower.{*}"])
    with pytest.raises(UserError, match=r"model\.freeze: expected a list.*model\.freeze=\[a, b\]"):
        validate_recipe(data)


def test_an_unquoted_pattern_in_a_yaml_flow_list_says_how_to_quote_it(tmp_path):
    path = _write(tmp_path, "model:\n  freeze: [model.vision_tower.{*}]\ntraining:\n  train_iters: 1\n")
    with pytest.raises(UserError, match=r"must be quoted: \['model\.language_model\.layers\.\{\*\}'\]"):
        read_yaml(path)


def test_unquoted_patterns_through_the_cli(tmp_path):
    """As bash passes ``model.freeze=[model.vision_tower.{*}, model.multi_modal_projector]`` unquoted."""
    result = runner.invoke(
        app,
        [
            "train",
            str(TINY),
            "model.freeze=[model.vision_tower.{*},",
            "model.multi_modal_projector]",
            f"training.output_dir={tmp_path / 'run'}",
            "--dry-run",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    freeze = json.loads(result.stdout)["resolved_recipe"]["model"]["freeze"]  # a dry run writes no file
    assert freeze == ["model.vision_tower.{*}", "model.multi_modal_projector"]


def test_a_recipe_that_is_not_utf8_names_the_byte_offset(tmp_path):
    path = tmp_path / "recipe.yaml"
    data = b"training:\n  train_iters: 1\n  output_dir: caf\xe9\n"
    path.write_bytes(data)
    offset = data.index(b"\xe9")
    result = _train(str(path))
    assert result.exit_code == 2, result.output
    assert f"byte offset {offset} (line 3) is not valid UTF-8" in result.output


def test_seed_configs_with_anchors_still_load():
    for path in sorted((REPO / "tests" / "fixtures" / "seed_configs").glob("*.yaml")):
        recipe = load_recipe(path)
        assert recipe.training.load == recipe.model.model_name_or_path  # the seed's &HF_MODEL_LOAD_PATH alias
