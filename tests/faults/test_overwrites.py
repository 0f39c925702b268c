"""Writing over what the user has, through the real CLI: each case once refused (exit 2, one message
naming the problem and the fix, nothing changed on disk), and the deliberate way through where one
exists.

The fixture trains one real run (2 CPU processes, 4 steps, checkpoints step_2 and step_4); the
cases copy it and launch `magistral train` at the copy as a user would. Refusals happen in the
launcher's pre-flight, before torchrun starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_process import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from engine.helpers import (  # noqa: E402
    file_digests,
    run_train,
    train_env,
    trained_four_steps,
)

OWNER = ".magistral-owner.json"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(recipe, a finished 2-process run of 4 steps with checkpoints step_2 and step_4)."""
    return trained_four_steps(tmp_path_factory.mktemp("overwrites"), "A")


def _tree(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (lock files aside) with its SHA-256."""
    return file_digests(directory, skip_prefix=".magistral.")


def _refused(result: subprocess.CompletedProcess, *parts: str) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    message = " ".join(result.stderr.split())  # the console wraps long lines
    for part in parts:
        assert part in message, message[-3000:]
    return message


def test_a_save_dir_of_another_run_is_refused_unless_shared_on_purpose(trained, tmp_path):
    recipe, base = trained
    a = tmp_path / "A"
    shutil.copytree(base, a)
    before = _tree(a)
    assert json.loads((a / "checkpoints" / OWNER).read_text())["run_dir"] == str(base)
    b = tmp_path / "B"
    refused = run_train(recipe, b, f"training.save={a / 'checkpoints'}", "training.train_iters=6")
    _refused(
        refused,
        f"training.save {a / 'checkpoints'} holds the checkpoints of another run ({base}); this run is {b}",
        "move its `latest`",
        f"training.load={a / 'checkpoints'}",
        "--share-checkpoints",
    )
    assert _tree(a) == before and not b.exists()  # nothing written, not even B's directory

    # A checkpoint directory written before owner records existed: the run directory holding it owns it.
    (a / "checkpoints" / OWNER).unlink()
    refused = run_train(recipe, b, f"training.save={a / 'checkpoints'}")
    _refused(refused, f"holds the checkpoints of another run ({a})")

    # Shared on purpose: the dry run says what will happen and writes nothing.
    shared = run_train(recipe, b, f"training.save={a / 'checkpoints'}", "--share-checkpoints", "--dry-run")
    assert shared.returncode == 0, shared.stderr[-3000:]
    message = " ".join(shared.stderr.split())
    assert f"belongs to the run {a}, shared with this one on purpose" in message
    assert "nothing was started or written" in message and not b.exists()


def test_a_dry_run_on_a_finished_run_writes_nothing(trained, tmp_path):
    recipe, base = trained
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = _tree(run), sorted(p.name for p in run.iterdir())
    dry = run_train(recipe, run, "training.lr=5e-4", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "nothing was started or written" in dry.stderr
    # It still says what a launch would do: resume step_4, with the change named.
    assert "resuming step_4" in " ".join(dry.stderr.split()) and "training.lr 0.001 -> 0.0005" in dry.stderr
    assert (_tree(run), sorted(p.name for p in run.iterdir())) == before
    new = tmp_path / "new"
    assert run_train(recipe, new, "--dry-run").returncode == 0 and not new.exists()


def test_an_output_dir_of_the_users_or_a_recipe_inside_the_run_is_refused(trained, tmp_path):
    recipe, base = trained
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "summary.json").write_text("my summary\n")
    (mine / "notes.txt").write_text("my notes\n")
    before = _tree(mine)
    refused = run_train(recipe, mine, "training.train_iters=2")
    _refused(
        refused,
        f"training.output_dir {mine} is an existing directory that is not a magistral run directory",
        "notes.txt, summary.json",
        "Set training.output_dir to a new or empty directory",
    )
    assert _tree(mine) == before and sorted(p.name for p in mine.iterdir()) == ["notes.txt", "summary.json"]

    # The run's own resolved recipe as the recipe: a launch would write over the file it reads.
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = _tree(run)
    resolved = run / "resolved_config.yaml"
    refused = run_train(resolved, run, "training.train_iters=6")
    _refused(refused, f"{resolved} is the recipe", f"cp {resolved} recipe.yaml")
    assert _tree(run) == before


def test_a_relaunch_that_would_pass_over_the_runs_checkpoints_is_refused(trained, tmp_path):
    recipe, base = trained
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = _tree(run)
    for override, why in (
        ("training.save=null", "training.save is not set"),
        (f"training.save={tmp_path / 'elsewhere'}", f"training.save is {tmp_path / 'elsewhere'}"),
    ):
        refused = run_train(recipe, run, override, "training.train_iters=6")
        _refused(
            refused,
            f"{run} holds checkpoints of an earlier launch in {run / 'checkpoints'} (step_4, step_2)",
            f"would not resume ({why}): it would start again from step 1",
            "launch with training.save=checkpoints",
            "new training.output_dir",
        )
        assert _tree(run) == before
    assert not (tmp_path / "elsewhere").exists()


def test_preprocess_never_exports_over_its_dataset(tmp_path):
    from magistral_cli.quickstart import write_assets

    assets = write_assets(tmp_path, 4)
    model, dataset = assets["model"], assets["dataset"]
    config = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
    overrides = [
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp_path / 'data'}",
        f"data.dataset_param.basic_parameters.dataset={dataset}",
        f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}",
    ]
    before = _tree(tmp_path / "data")

    def preprocess(target: Path) -> subprocess.CompletedProcess:
        args = ["preprocess", str(config), *overrides, "--export-jsonl", str(target)]
        return run_cli(args, env=train_env(), cwd=REPO)

    # A folder that is a file: refused before the encoding (no cache entry made), not after it.
    _refused(preprocess(config / "out.jsonl"), f"its folder {config} is a file")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    _refused(preprocess(dataset), f"--export-jsonl {dataset} is the dataset", "give another path")
    _refused(preprocess(model / "config.json"), "is an existing file inside the model directory")
    image = next(p for p in (tmp_path / "data").rglob("*") if p.suffix in (".png", ".jpg"))
    _refused(preprocess(image), "is an image of the dataset")
    assert _tree(tmp_path / "data") == before
    done = preprocess(tmp_path / "data" / "export.jsonl")  # a new file beside them is fine
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((tmp_path / "data" / "export.jsonl").read_text().splitlines()) >= 1


def test_generate_never_writes_its_answers_over_a_file_it_reads(tmp_path):
    """`generate --output` over the model's config.json, over --input, or onto the model directory:
    exit 2 before anything is loaded, every file unchanged (a new path is tests/cli/test_generate.py's
    normal case)."""
    from magistral_cli.quickstart import write_assets

    assets = write_assets(tmp_path, 4)
    model = assets["model"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n", encoding="utf-8")
    before = {p: p.read_bytes() for p in [*model.iterdir(), prompts] if p.is_file()}

    def generate(target: Path) -> subprocess.CompletedProcess:
        args = [
            "generate",
            "--model",
            str(model),
            "--input",
            str(prompts),
            "--output",
            str(target),
            "--greedy",
        ]
        return run_cli(args, env=train_env(), cwd=REPO)

    _refused(generate(model / "config.json"), "is an existing file inside --model", "give another path")
    _refused(generate(prompts), "--output must differ from --input")
    _refused(generate(model), "is a directory")
    assert {p: p.read_bytes() for p in before} == before
