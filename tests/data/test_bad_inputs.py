"""Inputs that used to crash `magistral preprocess` or poison training (the "run safety" cases).

Each test builds the bad input for real (undecodable bytes, PIL images of extreme shapes,
a directory where an image should be) and checks that the run names it instead of crashing.
"""

from __future__ import annotations

import json

import pytest
from PIL import Image
from typer.testing import CliRunner

from magistral_cli.config.schema import DatasetAttr
from magistral_cli.data.encoder import EncodedSample, EncodeParams, Encoder
from magistral_cli.data.pixtral import (
    ImageSettings,
    ImageSizeError,
    load_image_settings,
    load_pixel_values,
    plan_image,
)
from magistral_cli.data.readers import Drop, RecordFormat, RowSource, read_rows

from .helpers import write_recipe

# mistral-common's image encoder is the reference (before 1.12 it fails on thin images)
pytestmark = pytest.mark.compat

runner = CliRunner()


def _row(text: str, images: list[str] | None = None) -> dict:
    record = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
    if images is not None:
        record["images"] = images
    return record


def _encoder(model_dir, tokenizer, dataset_dir) -> Encoder:
    settings = load_image_settings(model_dir, 1024, 262144)
    params = EncodeParams(2048, False, False, "", str(dataset_dir))
    return Encoder(tokenizer, settings, params, RecordFormat.from_attr(DatasetAttr()))


# ----------------------------------------------------------------------------- undecodable text


def test_an_undecodable_jsonl_line_is_dropped_and_the_rest_kept(tmp_path, model_dir):
    """One line of Latin-1 bytes in a UTF-8 file costs that line only; --strict names it."""
    from magistral_cli.cli.main import app

    good = [json.dumps(_row(f"question {i}")).encode() for i in range(5)]
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "x"}]}'
    lines = [*good[:2], bad, *good[2:]]
    dataset = tmp_path / "data.jsonl"
    dataset.write_bytes(b"\n".join(lines) + b"\n")
    offset = len(lines[0]) + len(lines[1]) + 2 + bad.index(b"\xe9")
    recipe = write_recipe(tmp_path / "r.yaml", model_dir, dataset, tmp_path / "cache")

    result = runner.invoke(app, ["preprocess", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["report"]
    assert report["kept"] == 5 and report["dropped_by_reason"] == {"invalid_utf8": 1}
    (example,) = report["drop_examples"]["invalid_utf8"]
    assert example["index"] == 2
    assert example["detail"] == f"line 3: byte offset {offset} is not valid UTF-8 (b'\\xe9\"}},')"

    strict = runner.invoke(app, ["preprocess", str(recipe), "--strict"])
    assert strict.exit_code == 2
    assert "row 2 (invalid_utf8): line 3: byte offset" in strict.output
    assert "Traceback" not in strict.output


def test_an_undecodable_json_array_exits_2_naming_the_byte_offset(tmp_path, model_dir):
    from magistral_cli.cli.main import app

    head = json.dumps([_row("a"), _row("b")])[:-1].encode()
    data = b"\xef\xbb\xbf" + head + b', {"messages": "\xff"}]'
    dataset = tmp_path / "data.json"
    dataset.write_bytes(data)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir, dataset, tmp_path / "cache")

    offset = data.index(b"\xff")
    result = runner.invoke(app, ["preprocess", str(recipe)])
    assert result.exit_code == 2, result.output
    # The offset counts from the start of the file, BOM included, so that `xxd -s` finds it.
    assert f"byte offset {offset} is not valid UTF-8" in result.output
    assert "JSON Lines" in result.output and "Traceback" not in result.output


def test_an_unpaired_surrogate_escape_is_dropped_not_a_tokenizer_crash(model_dir, tokenizer, tmp_path):
    """``"\\ud800"`` is valid JSON; the tokenizer's TypeError on it would stop the whole batch."""
    (tmp_path / "d.jsonl").write_text(
        json.dumps(_row("fine")) + "\n" + json.dumps(_row("half a pair: \ud800")) + "\n", encoding="utf-8"
    )
    rows = read_rows(tmp_path / "d.jsonl")
    kept, dropped = _encoder(model_dir, tokenizer, tmp_path).encode_rows(rows)
    assert isinstance(kept, EncodedSample)
    assert dropped == Drop(
        "invalid_utf8", "prompt 0 holds an unpaired surrogate '\\ud800' (a \\u escape of half a pair)"
    )


def test_a_line_separator_inside_a_jsonl_string_does_not_split_the_record(tmp_path):
    """str.splitlines() cut at U+2028, which JSON allows raw inside strings."""
    (tmp_path / "d.jsonl").write_text(
        json.dumps(_row("a\u2028b"), ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (row,) = read_rows(tmp_path / "d.jsonl")
    assert row.error is None and row.record["messages"][0]["content"] == "a\u2028b"


def test_a_utf16_dataset_is_refused_with_the_fix(tmp_path):
    from magistral_cli.errors import UserError

    (tmp_path / "d.jsonl").write_bytes(json.dumps(_row("a")).encode("utf-16"))
    with pytest.raises(UserError, match="UTF-16 text; convert it to UTF-8"):
        read_rows(tmp_path / "d.jsonl")


# ----------------------------------------------------------------------------- image shapes


@pytest.fixture(scope="module")
def mistral_image_encoder(model_dir):
    pytest.importorskip("cv2")  # mistral-common resizes with OpenCV
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    reference = MistralTokenizer.from_file(str(model_dir / "tekken.json"), mode=ValidationMode.finetuning)
    return reference.instruct_tokenizer.image_encoder


@pytest.mark.parametrize(
    "size", [(1, 5000), (5000, 1), (2, 3100), (1, 300000)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_a_thin_image_gets_one_token_a_side_as_in_mistral_common(
    size, model_dir, tokenizer, tmp_path, mistral_image_encoder
):
    """Seen: 1x5000 was kept as image_sizes [1540, 0] (0 [IMG], 54 [IMG_BREAK]) and training failed.

    1x300000 also needs the pixel limit's downscale, which used to reach 0 pixels.
    """
    from mistral_common.protocol.instruct.chunk import ImageChunk

    image = Image.new("RGB", size, (200, 30, 30))
    image.save(tmp_path / "thin.png")
    sample = _encoder(model_dir, tokenizer, tmp_path).encode_rows(
        [RowSource(0, _row("<image>", ["thin.png"]))]
    )[0]
    assert isinstance(sample, EncodedSample), sample
    height, width = sample.image_sizes[0].tolist()
    assert height >= 28 and width >= 28

    theirs = mistral_image_encoder(ImageChunk(image=image))
    special = tokenizer.special
    ids = sample.input_ids.tolist()
    start = ids.index(special.img)
    ours = ids[start : ids.index(special.img_end) + 1]
    assert ours == theirs.tokens
    pixels = load_pixel_values(
        tmp_path / "thin.png", load_image_settings(model_dir, 1024, 262144), (height, width)
    )
    assert pixels.shape == theirs.image.shape


def test_an_image_size_with_no_token_is_refused_by_reason():
    """The encoder drops such a row as ``unusable_image_size`` instead of keeping 0 tokens."""
    with pytest.raises(ImageSizeError, match=r"no pixels \(0x7\)"):
        plan_image(0, 7, ImageSettings())


def test_a_directory_given_as_an_image_is_named_a_directory(model_dir, tokenizer, tmp_path):
    (tmp_path / "pictures").mkdir()
    result = _encoder(model_dir, tokenizer, tmp_path).encode_rows(
        [RowSource(0, _row("<image>", ["pictures"]))]
    )[0]
    assert result == Drop("unreadable_image", f"{tmp_path / 'pictures'} is a directory, not an image file")


def test_alpaca_formatting_exits_2_naming_the_record_styles_that_are_read(tmp_path, model_dir):
    """The schema takes MindSpeed-MM's ``formatting`` values, but alpaca records are not read: one
    error naming the two record styles, exit 2, before anything is written."""
    from magistral_cli.cli.main import app

    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps(_row("a")) + "\n", encoding="utf-8")
    cache = tmp_path / "cache"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir, dataset, cache)
    result = runner.invoke(app, ["preprocess", str(recipe), "data.dataset_param.attr.formatting=alpaca"])
    assert result.exit_code == 2, result.output
    assert "formatting 'alpaca' is not supported" in result.output
    assert "'messages'" in result.output and "'conversations'" in result.output
    assert "Traceback" not in result.output
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize(
    ("stage", "rows", "hint"),
    [
        ("sft", [{"messages": 5}, {"x": 1}], "fix the rows, or point data.dataset_param.basic_parameters.dataset"),
        (
            "sft",
            [{"messages": [{"role": "user", "content": "Q"}], "chosen": {"role": "assistant", "content": "A"},
              "rejected": {"role": "assistant", "content": "B"}}],
            "preference pairs (chosen / rejected) train with training.stage: dpo",
        ),
        ("dpo", [_row("a"), _row("b")], "SFT conversations train with training.stage: sft"),
    ],
    ids=["broken rows", "pairs under sft", "conversations under dpo"],
)  # fmt: skip
def test_a_dataset_with_no_usable_row_exits_2_with_the_fix(tmp_path, model_dir, stage, rows, hint):
    from magistral_cli.cli.main import app

    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    recipe = write_recipe(
        tmp_path / "r.yaml", model_dir, dataset, tmp_path / "cache", training={"stage": stage}
    )
    args = ["preprocess", str(recipe)] + (["features.loss_cfg.loss_type=default"] if stage == "dpo" else [])
    result = runner.invoke(app, args)
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "could be kept" in output and hint in output, output
    assert "Traceback" not in result.output
