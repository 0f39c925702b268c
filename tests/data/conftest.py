"""Shared fixtures: a tiny model directory with the real Tekken vocabulary, datasets, recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from magistral_cli.config.loader import validate_recipe
from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset, write_tiny_tokenizer_files


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """config.json of the tiny Mistral3 plus tekken.json (no weights: the data side needs none)."""
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(tiny_mistral3_config().to_dict()), encoding="utf-8")
    write_tiny_tokenizer_files(path)
    return path


@pytest.fixture(scope="session")
def v13_model_dir(model_dir, tmp_path_factory) -> Path:
    """The tiny model with a v13 tekken.json (Magistral's version: [THINK] is a control token)."""
    path = tmp_path_factory.mktemp("v13")
    (path / "config.json").write_text(
        (model_dir / "config.json").read_text(encoding="utf-8"), encoding="utf-8"
    )
    write_tiny_tokenizer_files(path, version="v13")
    return path


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from magistral_cli.data.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def broken_dataset(tmp_path_factory) -> Path:
    """40 good rows and one of each broken kind (see write_synthetic_llava_dataset)."""
    return write_synthetic_llava_dataset(tmp_path_factory.mktemp("broken"), 40, broken_rows=True, seed=1)


@pytest.fixture
def wide_console(monkeypatch):
    """The CLI's console without line wrapping, so that rows and warnings are read whole."""
    from magistral_cli.cli.output import console

    monkeypatch.setattr(console, "_width", 1000)


@pytest.fixture(scope="session")
def make_recipe():
    """Factory: make_recipe(model_dir, dataset, cache_dir, basic=, pre=, loader=, training= {...})."""
    return _make_recipe


def _make_recipe(model_dir: Path, dataset: Path, cache_dir: Path, **basic):
    """A recipe whose data section points at the fixtures."""
    data_basic = {"dataset": str(dataset), "cache_dir": str(cache_dir), "cutoff_len": 1024}
    data_basic.update(basic.pop("basic", {}))
    loader = basic.pop("loader", {})
    pre = {"model_name_or_path": str(model_dir), **basic.pop("pre", {})}
    training = {"train_iters": 10, "micro_batch_size": 2, "seed": 7}
    training.update(basic.pop("training", {}))
    return validate_recipe(
        {
            "data": {
                "dataset_param": {
                    "preprocess_parameters": pre,
                    "basic_parameters": data_basic,
                },
                "dataloader_param": loader,
            },
            "training": training,
        }
    )
