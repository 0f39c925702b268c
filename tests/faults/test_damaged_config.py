"""A damaged model config.json is one message naming the file, exit 2, never a traceback.

The quickstart's tiny model is copied and its config.json broken as a hand edit or a failed copy
would: cut short, an array, a ``text_config`` that is a number, a width that is a string. Each
command that reads the model is then run as a user would (train's dry run, preprocess, generate,
convert hf-to-dcp and validate).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
runner = CliRunner()


def _cut_short(raw: dict) -> str:
    return json.dumps(raw)[:40]


def _an_array(raw: dict) -> str:
    return json.dumps([1, 2])


def _text_config_a_number(raw: dict) -> str:
    return json.dumps({**raw, "text_config": 5})


def _a_width_that_is_a_string(raw: dict) -> str:
    return json.dumps({**raw, "text_config": {**raw["text_config"], "hidden_size": "big"}})


DAMAGE = {
    "cut short": (_cut_short, "cannot be read as JSON"),
    "an array": (_an_array, "holds a JSON list"),
    "text_config a number": (_text_config_a_number, "text_config is a int, not an object"),
    "a width that is a string": (_a_width_that_is_a_string, "cannot be read by transformers"),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from magistral_cli.quickstart import write_assets

    root = tmp_path_factory.mktemp("damaged-config")
    return root, write_assets(root, 4)


def _commands(model: Path, data: dict, tmp: Path) -> dict[str, list[str]]:
    basic = "data.dataset_param.basic_parameters"
    recipe = [
        str(TINY),
        f"model.model_name_or_path={model}",
        f"training.load={model}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"{basic}.dataset={data['dataset']}",
        f"{basic}.dataset_dir={Path(data['dataset']).parent}",
        f"{basic}.cache_dir={tmp / 'cache'}",
        f"training.output_dir={tmp / 'run'}",
    ]
    return {
        "train --dry-run": ["train", *recipe, "--dry-run"],
        "preprocess": ["preprocess", *recipe],
        "generate": ["generate", "--model", str(model), "--prompt", "Hi", "--greedy"],
        "convert hf-to-dcp": [
            "convert",
            "hf-to-dcp",
            "--model-dir",
            str(model),
            "--dcp-dir",
            str(tmp / "dcp"),
        ],
    }


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_config_is_one_message_with_exit_2(assets, tmp_path, damage):
    root, data = assets
    model = tmp_path / "model"
    shutil.copytree(data["model"], model)
    config = model / "config.json"
    write, expected = DAMAGE[damage]
    config.write_text(write(json.loads(config.read_text(encoding="utf-8"))), encoding="utf-8")
    for name, args in _commands(model, data, tmp_path).items():
        if name == "preprocess" and damage == "a width that is a string":
            continue  # preprocess reads the image and token settings only; the widths are train's
        result = runner.invoke(app, args)
        output = " ".join(result.output.split())
        assert result.exit_code == 2, (name, result.output[-2000:], result.exception)
        assert "Traceback" not in result.output, (name, result.output[-2000:])
        assert str(config) in output and expected in output, (name, output[-2000:])
    assert not (tmp_path / "dcp").exists() or not any((tmp_path / "dcp").iterdir())
