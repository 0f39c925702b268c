"""`magistral train --dry-run`'s padding section: from the dataset's cache entry when it exists,
a one-line hint when it does not; a dry run never encodes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.cli.train_render import render_padding
from magistral_cli.config import load_recipe
from magistral_cli.data.packing import estimate_padding
from magistral_cli.data.pipeline import run_preprocess
from magistral_cli.launch.preflight import padding_section

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
PACKING = "data.dataset_param.basic_parameters.packing=true"
runner = CliRunner()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The tiny model's config.json and tokenizer (no weights: a dry run reads none) and 24 samples."""
    from magistral_cli.quickstart import QUICKSTART_IMAGE_SIZES
    from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset, write_tiny_tokenizer_files
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    root = tmp_path_factory.mktemp("padding")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_mistral3_config().to_dict()), encoding="utf-8")
    write_tiny_tokenizer_files(model)
    dataset = write_synthetic_llava_dataset(root / "data", 24, seed=0, image_sizes=QUICKSTART_IMAGE_SIZES)
    return {"root": root, "model": model, "dataset": dataset}


def _overrides(inputs, cache: Path, run: Path) -> list[str]:
    model = inputs["model"]
    return [
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"model.model_name_or_path={model}",
        f"training.load={model}",
        f"data.dataset_param.basic_parameters.dataset_dir={inputs['dataset'].parent}",
        f"data.dataset_param.basic_parameters.dataset={inputs['dataset']}",
        f"data.dataset_param.basic_parameters.cache_dir={cache}",
        f"training.output_dir={run}",
    ]


def test_without_a_cache_entry_the_dry_run_says_to_preprocess_first(inputs, tmp_path):
    overrides = _overrides(inputs, tmp_path / "cache", tmp_path / "run")
    result = runner.invoke(app, ["train", str(TINY), *overrides, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    padding = json.loads(result.stdout)["padding"]
    assert padding["estimate"] is None and padding["cache_entry"] is None
    assert (
        f"magistral preprocess {TINY}" in padding["note"]
        and "first for a padding estimate" in padding["note"]
    )
    assert "padding" in result.stderr and "magistral preprocess" in result.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), (
        "a dry run encodes nothing"
    )


def test_with_a_cache_entry_the_dry_run_shows_the_estimate(inputs, tmp_path):
    overrides = _overrides(inputs, tmp_path / "cache", tmp_path / "run")
    prepared = run_preprocess(load_recipe(TINY, overrides))
    result = runner.invoke(app, ["train", str(TINY), *overrides, PACKING, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["memory_plan"] is not None  # the padding sits next to the memory plan
    padding = out["padding"]
    assert padding["cache_entry"] == str(prepared.dataset.path) and padding["note"] is None
    estimate = padding["estimate"]
    assert estimate["source"] == "report histogram" and estimate["recipe_mode"] == "packing"
    assert estimate["samples"] == prepared.report["kept"] and estimate["cutoff_len"] == 512
    expected = estimate_padding(512, 2, histogram=prepared.report["length_histogram"])
    for mode in ("none", "packing"):
        got, want = estimate["modes"][mode], expected[mode]
        assert got["rows"] == want.rows and got["micro_batches_per_epoch"] == want.micro_batches
        assert got["real_fraction"] == round(want.real_fraction, 4)
        assert got["steps_per_epoch"] == want.rows // (2 * 2)  # micro-batch 2 x 2 data-parallel ranks
    assert estimate["modes"]["packing"]["rows"] < estimate["modes"]["none"]["rows"] == estimate["samples"]
    assert "padding per micro-batch" in result.stderr and "packing *" in result.stderr
    for mode in ("none", "packing"):
        assert f"{estimate['modes'][mode]['real_fraction']:.1%}" in result.stderr
    # A real launch (which has just prepared the entry) shows one line.
    console = Console(record=True, width=200)
    render_padding(padding, console, full=False)
    line = console.export_text().strip()
    packing, none = (f"{estimate['modes'][m]['real_fraction']:.1%}" for m in ("packing", "none"))
    assert line.startswith(
        f"padding        {packing} real tokens in a micro-batch (packing; no packing: {none})"
    )


def test_an_entry_without_a_histogram_falls_back_to_its_sample_lengths(inputs, tmp_path):
    """Entries written before the report had ``length_histogram`` still give an exact estimate."""
    overrides = _overrides(inputs, tmp_path / "cache", tmp_path / "run")
    recipe = load_recipe(TINY, overrides)
    entry = run_preprocess(recipe).dataset.path
    report = json.loads((entry / "report.json").read_text())
    del report["length_histogram"]
    (entry / "report.json").write_text(json.dumps(report))
    from magistral_cli.checkpoint.integrity import describe_file

    meta = json.loads((entry / "meta.json").read_text())  # recorded as if written so (else: damaged)
    meta["files"]["report.json"] = describe_file(entry / "report.json")
    (entry / "meta.json").write_text(json.dumps(meta))
    padding = padding_section(recipe, world_size=2)
    estimate = padding["estimate"]
    assert estimate["source"] == "sample lengths"
    from magistral_cli.data.cache import EncodedDataset

    exact = estimate_padding(512, 2, lengths=EncodedDataset(entry).lengths)
    assert estimate["modes"]["none"]["real_fraction"] == round(exact["none"].real_fraction, 4)
    assert estimate["modes"]["packing"]["rows"] == exact["packing"].rows


def test_synthetic_data_and_unusable_inputs_give_a_note_not_an_error(inputs, tmp_path):
    overrides = _overrides(inputs, tmp_path / "cache", tmp_path / "run")
    synthetic = load_recipe(TINY, [*overrides, "data.dataset_param.dataset_type=synthetic"])
    assert padding_section(synthetic, world_size=2)["note"].startswith("synthetic data")
    shutil.copytree(inputs["model"], tmp_path / "no-tokenizer")
    (tmp_path / "no-tokenizer" / "tekken.json").unlink()
    broken = load_recipe(
        TINY,
        [
            *overrides,
            f"data.dataset_param.preprocess_parameters.model_name_or_path={tmp_path / 'no-tokenizer'}",
        ],
    )
    padding = padding_section(broken, world_size=2)
    assert padding["estimate"] is None and padding["note"].startswith("no padding estimate:")
