"""Images whose path leads outside ``dataset_dir``: ``../``, absolute, or through a symlink.

LLaVA data often names images by absolute path, so they are read by default and counted in
the preprocess report; ``allow_outside_dataset_dir: false`` drops such a sample (never opening
the file) with a reason naming the path and the fix.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from PIL import Image
from typer.testing import CliRunner

from magistral_cli.config.schema import BasicParameters, DatasetAttr
from magistral_cli.data.encoder import EncodedSample, EncodeParams, Encoder
from magistral_cli.data.pixtral import load_image_settings
from magistral_cli.data.readers import Drop, RecordFormat, RowSource

from .helpers import write_recipe

runner = CliRunner()


@pytest.fixture
def tree(tmp_path):
    """``data/`` (the dataset_dir) with an image, a subfolder and symlinks; ``elsewhere/`` outside it."""
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    (data / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    Image.new("RGB", (56, 56), (10, 200, 10)).save(data / "in.png")
    Image.new("RGB", (56, 56), (200, 10, 10)).save(elsewhere / "out.png")
    os.symlink(elsewhere / "out.png", data / "link_out.png")  # a file link leading out
    os.symlink(data / "in.png", data / "sub" / "link_in.png")  # a link that stays inside
    os.symlink(elsewhere, data / "mounted")  # a folder link leading out
    return tmp_path


#: image path as written in the record -> whether it lies outside dataset_dir
CASES = {
    "in.png": False,
    "sub/../in.png": False,
    "sub/link_in.png": False,
    "ABS_INSIDE": False,
    "../elsewhere/out.png": True,
    "ABS_OUTSIDE": True,
    "link_out.png": True,
    "mounted/out.png": True,
}


def _path(written: str, tree) -> str:
    return {
        "ABS_INSIDE": str(tree / "data" / "in.png"),
        "ABS_OUTSIDE": str(tree / "elsewhere" / "out.png"),
    }.get(written, written)


def _record(image: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "<image>What?"},
            {"role": "assistant", "content": "A square."},
        ],
        "images": [image],
    }


def _encoder(model_dir, tokenizer, dataset_dir, allow: bool) -> Encoder:
    settings = load_image_settings(model_dir, 1024, 262144)
    params = EncodeParams(2048, False, False, "", str(dataset_dir), allow_outside_dataset_dir=allow)
    return Encoder(tokenizer, settings, params, RecordFormat.from_attr(DatasetAttr()))


def test_outside_images_are_read_and_counted_by_default(model_dir, tokenizer, tree):
    assert BasicParameters().allow_outside_dataset_dir is True
    rows = [RowSource(i, _record(_path(w, tree))) for i, w in enumerate(CASES)]
    out = _encoder(model_dir, tokenizer, tree / "data", True).encode_rows(rows)
    assert all(isinstance(o, EncodedSample) for o in out), out
    assert [o.outside_images for o in out] == [int(outside) for outside in CASES.values()]


def test_with_false_outside_images_drop_their_sample_naming_path_and_fix(model_dir, tokenizer, tree):
    rows = [RowSource(i, _record(_path(w, tree))) for i, w in enumerate(CASES)]
    out = _encoder(model_dir, tokenizer, tree / "data", False).encode_rows(rows)
    for (written, outside), result in zip(CASES.items(), out, strict=True):
        if not outside:
            assert isinstance(result, EncodedSample) and result.outside_images == 0, (written, result)
            continue
        assert isinstance(result, Drop) and result.reason == "image_outside_dataset_dir", (written, result)
        assert f"is outside dataset_dir {tree / 'data'}" in result.detail
        assert result.detail.endswith("data.dataset_param.basic_parameters.allow_outside_dataset_dir=true")
    # A link is named with where it really leads.
    link = out[list(CASES).index("link_out.png")]
    assert f"link_out.png (really {tree / 'elsewhere' / 'out.png'})" in link.detail


def test_with_false_an_outside_file_is_never_opened(model_dir, tokenizer, tree):
    """The reason is the place, not the file: a missing file outside is not looked at."""
    record = _record(str(tree / "elsewhere" / "missing.png"))
    (result,) = _encoder(model_dir, tokenizer, tree / "data", False).encode_rows([RowSource(0, record)])
    assert isinstance(result, Drop) and result.reason == "image_outside_dataset_dir"


def test_a_symlinked_dataset_dir_is_its_target(model_dir, tokenizer, tree):
    os.symlink(tree / "data", tree / "data_link")
    (result,) = _encoder(model_dir, tokenizer, tree / "data_link", False).encode_rows(
        [RowSource(0, _record("in.png"))]
    )
    assert isinstance(result, EncodedSample) and result.outside_images == 0


# ----------------------------------------------------------------------------- through `magistral preprocess`


def test_preprocess_reports_outside_images_and_drops_them_with_false(model_dir, tree, wide_console):
    from magistral_cli.cli.main import app

    dataset = tree / "data" / "train.jsonl"
    dataset.write_text("\n".join(json.dumps(_record(_path(w, tree))) for w in CASES) + "\n", encoding="utf-8")
    recipe = write_recipe(tree / "r.yaml", model_dir, dataset, tree / "cache")
    result = runner.invoke(app, ["preprocess", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["report"]
    assert report["kept"] == 8 and report["images_outside_dataset_dir"] == 4
    assert re.search(r"images outside dataset_dir\s*│\s*4\s", result.output), result.output

    refuse = "data.dataset_param.basic_parameters.allow_outside_dataset_dir=false"
    result = runner.invoke(app, ["preprocess", str(recipe), refuse, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert not out["reused"]  # the setting is part of the cache fingerprint
    report = out["report"]
    assert report["kept"] == 4 and report["images_outside_dataset_dir"] == 0
    assert report["dropped_by_reason"] == {"image_outside_dataset_dir": 4}
    assert re.search(r"images outside dataset_dir\s*│\s*0\s", result.output), result.output
    assert "image_outside_dataset_dir" in result.output and "allow_outside_dataset_dir=true" in result.output

    strict = runner.invoke(app, ["preprocess", str(recipe), refuse, "--strict"])
    assert strict.exit_code == 2
    assert "4 row(s) would be dropped; first: row 4 (image_outside_dataset_dir)" in strict.output
    assert "Traceback" not in strict.output

    wrong = runner.invoke(
        app,
        ["preprocess", str(recipe), "data.dataset_param.basic_parameters.allow_outside_dataset_dir=maybe"],
    )
    assert wrong.exit_code == 2 and "allow_outside_dataset_dir" in wrong.output
    assert "Traceback" not in wrong.output
