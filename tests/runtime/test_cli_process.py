"""``tests/cli_process.py``'s ``run_cli``: a `magistral` command forked with the engine imported exits and
prints as the same command in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from tests.cli_process import cli_start_method, run_cli
from tests.engine.helpers import recipe_dict, train_env, write_tiny_model


@pytest.fixture
def recipe_dir(tmp_path):
    write_tiny_model(tmp_path / "model")
    (tmp_path / "recipe.yaml").write_text(
        yaml.safe_dump(recipe_dict(tmp_path / "model", tmp_path / "unused"))
    )
    return tmp_path


def test_a_forked_command_exits_and_prints_as_a_fresh_interpreter(recipe_dir, monkeypatch):
    env = train_env()
    assert cli_start_method(env) == "forkserver"
    # Relative paths: the command runs in its own working directory.
    plan = ["train", "recipe.yaml", "--nproc-per-node", "2", "training.output_dir=run", "--dry-run", "--json"]
    missing = ["train", "no-such-recipe.yaml"]
    forked = [run_cli(args, env=env, cwd=recipe_dir) for args in (plan, missing)]
    monkeypatch.setenv("MAGISTRAL_RANK_START", "spawn")
    assert cli_start_method(env) == "spawn"
    fresh = [run_cli(args, env=env, cwd=recipe_dir) for args in (plan, missing)]

    assert forked[0].returncode == fresh[0].returncode == 0, forked[0].stderr + fresh[0].stderr
    plans = [json.loads(done.stdout) for done in (forked[0], fresh[0])]
    assert plans[0].pop("run_id") != plans[1].pop("run_id")  # each process draws its own
    assert plans[0] == plans[1] and plans[0]["run_dir"] == str(recipe_dir / "run")
    assert forked[0].stderr == fresh[0].stderr
    assert forked[1].returncode == fresh[1].returncode == 2
    assert "no-such-recipe.yaml" in forked[1].stderr and forked[1].stderr == fresh[1].stderr
    assert forked[1].stdout == fresh[1].stdout == ""


def test_another_environment_or_import_path_runs_a_fresh_interpreter(tmp_path):
    env = train_env()
    assert cli_start_method({**env, "MAGISTRAL_TEST_SET_LATER": "yes"}) == "spawn"
    assert cli_start_method({**env, "PYTHONPATH": str(tmp_path)}) == "spawn"
    assert cli_start_method({k: v for k, v in os.environ.items()}) == "forkserver"


def test_a_forked_command_past_its_time_is_stopped(recipe_dir):
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(["train", "recipe.yaml", "--dry-run"], env=train_env(), cwd=recipe_dir, timeout=0.01)
