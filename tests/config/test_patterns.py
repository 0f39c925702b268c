"""The one module-pattern matcher behind fsdp_plan, recompute_plan, freeze and contiguous Linear."""

from __future__ import annotations

import pytest

from magistral_cli.config.patterns import compile_pattern, match_names, select_modules
from magistral_cli.errors import UserError

NAMES = [
    "",
    "model",
    "model.language_model",
    "model.language_model.embed_tokens",
    "model.language_model.layers",
    "model.language_model.layers.0",
    "model.language_model.layers.0.mlp",
    "model.language_model.layers.0.mlp.up_proj",
    "model.language_model.layers.1",
    "model.language_model.layers.1.mlp.up_proj",
    "model.language_model.layers.10",
    "model.vision_tower",
    "lm_head",
]


def test_wildcard_matches_one_component_at_every_index():
    hits = match_names(NAMES, ["model.language_model.layers.{*}"])
    assert hits == {
        "model.language_model.layers.{*}": [
            "model.language_model.layers.0",
            "model.language_model.layers.1",
            "model.language_model.layers.10",
        ]
    }


def test_wildcard_in_the_middle():
    hits = match_names(NAMES, ["model.language_model.layers.{*}.mlp.up_proj"])
    assert hits["model.language_model.layers.{*}.mlp.up_proj"] == [
        "model.language_model.layers.0.mlp.up_proj",
        "model.language_model.layers.1.mlp.up_proj",
    ]


def test_literal_patterns_are_exact():
    assert match_names(NAMES, ["lm_head"]) == {"lm_head": ["lm_head"]}
    assert not compile_pattern("model.language_model.layers.1").match("model.language_model.layers.10")
    assert not compile_pattern("model.language.model").match("model.language_model")  # dots are literal


def test_a_pattern_matching_nothing_is_an_error_with_suggestions():
    with pytest.raises(
        UserError, match=r"freeze pattern 'model\.vison_tower' matches no module.*model\.vision_tower"
    ):
        match_names(NAMES, ["model.vison_tower"], what="freeze pattern")


def test_select_modules_on_a_real_module_tree():
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(2, 2, bias=False)

    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([Block(), Block()])
    picked = select_modules(root, ["layers.{*}.up_proj", "layers.1.up_proj"])
    assert [name for name, _ in picked] == ["layers.0.up_proj", "layers.1.up_proj"]  # no duplicates
    assert picked[0][1] is root.layers[0].up_proj
