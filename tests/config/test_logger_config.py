"""``tools.logger`` (none | tensorboard | wandb) and its ``tools.tensorboard`` / ``tools.wandb`` options."""

from __future__ import annotations

import pytest
import yaml

from magistral_cli.config import recipe_to_yaml, validate_recipe
from magistral_cli.config.loader import apply_overrides
from magistral_cli.errors import UserError

BASE = {"training": {"train_iters": 1}}


def test_defaults_log_nowhere_else_and_keep_files_in_the_run_directory():
    tools = validate_recipe(BASE).tools
    assert tools.logger == "none"
    assert tools.tensorboard.log_dir == "tensorboard"
    wandb = tools.wandb
    assert (wandb.project, wandb.entity, wandb.name, wandb.mode, wandb.dir, wandb.tags) == (
        "magistral",
        None,
        None,
        "offline",  # nothing leaves the machine unless asked
        ".",
        [],
    )


def test_overrides_choose_the_logger_and_its_options():
    data = apply_overrides(
        BASE,
        [
            "tools.logger=wandb",
            "tools.wandb.mode=online",
            "tools.wandb.project=mm",
            "tools.wandb.name=try-3",
            "tools.wandb.tags=[lora,8card]",
            "tools.tensorboard.log_dir=/shared/tb",
        ],
    )
    tools = validate_recipe(data).tools
    assert tools.logger == "wandb" and tools.wandb.mode == "online"
    assert (tools.wandb.project, tools.wandb.name, tools.wandb.tags) == ("mm", "try-3", ["lora", "8card"])
    assert tools.tensorboard.log_dir == "/shared/tb"
    # The resolved recipe (what each rank reads) keeps them.
    again = validate_recipe(yaml.safe_load(recipe_to_yaml(validate_recipe(data))))
    assert again.tools == tools


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        (
            {"logger": "mlflow"},
            "tools.logger: Input should be 'none', 'tensorboard' or 'wandb' (got 'mlflow')",
        ),
        ({"wandb": {"mode": "cloud"}}, "tools.wandb.mode: Input should be 'offline' or 'online'"),
        ({"wandb": {"project": ""}}, "tools.wandb.project"),
        ({"tensorbord": {"log_dir": "x"}}, "did you mean tools.tensorboard?"),
        ({"wandb": {"api_key": "x"}}, "unknown key tools.wandb.api_key"),  # a key never goes in a recipe
    ],
)
def test_bad_values_name_the_key(tools, message):
    with pytest.raises(UserError) as info:
        validate_recipe({**BASE, "tools": tools})
    assert message in str(info.value)
