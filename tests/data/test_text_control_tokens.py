"""Control-token strings written in the data text (``[INST] </s> [IMG] <s>``).

Text is text, as mistral-common encodes it, unless the recipe asks for the seed's
``split_special_tokens: false``: then such strings become control tokens, which the report
counts and warns about, and a sample whose text would make an image token is dropped. Either
way a sample's image tokens are exactly its images' features.
"""

from __future__ import annotations

import json

import pytest
from PIL import Image
from typer.testing import CliRunner

from magistral_cli.config.schema import DatasetAttr
from magistral_cli.data.encoder import EncodedSample, EncodeParams, Encoder
from magistral_cli.data.pixtral import load_image_settings
from magistral_cli.data.readers import Drop, RecordFormat, RowSource
from magistral_cli.data.tokenizer import load_tokenizer

from .helpers import write_recipe

pytest.importorskip("mistral_common")
pytest.importorskip("cv2")  # mistral-common's image encoder resizes with OpenCV

runner = CliRunner()

CONTROL_TEXT = "[INST] </s> [IMG] <s>"


@pytest.fixture(scope="module")
def reference(model_dir):
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(model_dir / "tekken.json"), mode=ValidationMode.finetuning)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("control_images") / "red.png"
    Image.new("RGB", (56, 84), (200, 20, 20)).save(path)  # 3 rows of 2 image tokens
    return path


def _record(user: str, assistant: str = "ok", system: str | None = None, images=None) -> dict:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, **({"images": [str(p) for p in images]} if images else {})}


def _encode(model_dir, record, dataset_dir, *, split: bool = True, default_system: str = ""):
    tokenizer = load_tokenizer(model_dir, split_special_tokens=split)
    settings = load_image_settings(model_dir, 1024, 262144)
    params = EncodeParams(8192, False, False, default_system, str(dataset_dir))
    encoder = Encoder(tokenizer, settings, params, RecordFormat.from_attr(DatasetAttr()))
    return encoder.encode_rows([RowSource(0, record)])[0]


def _theirs(reference, record) -> list[int]:
    """mistral-common's ids of the same conversation (an ``<image>`` becomes an image chunk)."""
    from mistral_common.protocol.instruct.chunk import ImageChunk, TextChunk
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    images = iter(record.get("images", []))
    messages = []
    for message in record["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":
            messages.append(SystemMessage(content=content))
        elif role == "assistant":
            messages.append(AssistantMessage(content=content))
        else:
            chunks = []
            for i, part in enumerate(content.split("<image>")):
                if i:
                    chunks.append(ImageChunk(image=Image.open(next(images))))
                if part:
                    chunks.append(TextChunk(text=part))
            messages.append(UserMessage(content=chunks))
    return reference.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens


# ----------------------------------------------------------------------------- text is text (the default)


@pytest.mark.parametrize(
    "record",
    [
        _record(CONTROL_TEXT),
        _record("hi", assistant=f"ok {CONTROL_TEXT} [/INST] <SPECIAL_20>", system="be [INST] terse [THINK]"),
        _record("<image> " + CONTROL_TEXT + " [IMG_BREAK][IMG_END]", images=["IMAGE"]),
    ],
    ids=["user", "system_and_assistant", "with_an_image"],
)
def test_control_strings_are_text_token_for_token_with_mistral_common(record, model_dir, reference, image):
    if "images" in record:
        record = dict(record, images=[str(image)])
    ours = _encode(model_dir, record, image.parent)
    assert isinstance(ours, EncodedSample), ours
    assert ours.input_ids.tolist() == _theirs(reference, record)
    # Counted for the report, as text.
    texts = [m["content"] for m in record["messages"]]
    for token in ("[INST]", "</s>", "[IMG]", "<s>"):
        assert ours.text_control_tokens.get(token, 0) == sum(t.count(token) for t in texts)


def test_the_default_is_text_in_the_schema_and_the_tokenizer(model_dir):
    from magistral_cli.config.schema import PreprocessParameters

    assert PreprocessParameters().split_special_tokens is True
    assert load_tokenizer(model_dir).split_special_tokens is True


# ----------------------------------------------------------------------------- the seed's split_special_tokens: false


def test_seed_setting_makes_control_tokens_and_counts_them(model_dir, tokenizer, tmp_path):
    sample = _encode(model_dir, _record("[INST] hi </s>", assistant="a </s> b"), tmp_path, split=False)
    assert isinstance(sample, EncodedSample)
    special = tokenizer.special
    ids = sample.input_ids.tolist()
    # <s> [INST] [INST] hi </s> [/INST] a </s> b </s>: the text's strings are control ids.
    assert ids.count(special.inst) == 2 and ids.count(special.eos) == 3
    assert sample.text_control_tokens == {"[INST]": 1, "</s>": 2}


@pytest.mark.parametrize("token", ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
@pytest.mark.parametrize("where", ["user", "assistant", "system"])
def test_seed_setting_drops_a_sample_whose_text_makes_an_image_token(token, where, model_dir, tmp_path):
    text = f"look {token} here"
    record = _record(
        text if where == "user" else "hi",
        assistant=text if where == "assistant" else "ok",
        system=text if where == "system" else None,
    )
    drop = _encode(model_dir, record, tmp_path, split=False)
    assert isinstance(drop, Drop) and drop.reason == "image_token_in_text"
    named = {"user": "prompt 0", "assistant": "assistant turn 0", "system": "the system prompt"}[where]
    assert drop.detail.startswith(f"{named} holds the text {token}")
    assert "<image>" in drop.detail and "split_special_tokens=true" in drop.detail


def test_a_dropped_sample_does_not_shift_the_next_ones(model_dir, tmp_path):
    """Texts of a batch are encoded together: a drop after encoding must consume all of its own."""
    tokenizer = load_tokenizer(model_dir, split_special_tokens=False)
    settings = load_image_settings(model_dir, 1024, 262144)
    encoder = Encoder(
        tokenizer,
        settings,
        EncodeParams(8192, False, False, "", str(tmp_path)),
        RecordFormat.from_attr(DatasetAttr()),
    )
    rows = [
        _record("[IMG] first", assistant="one"),
        _record("second", assistant="two"),
        _record("third [IMG_END]", assistant="x </s>"),
        _record("fourth", assistant="four"),
    ]
    out = encoder.encode_rows([RowSource(i, r) for i, r in enumerate(rows)])
    assert [type(o).__name__ for o in out] == ["Drop", "EncodedSample", "Drop", "EncodedSample"]
    for sample, record in ((out[1], rows[1]), (out[3], rows[3])):
        alone = _encode(model_dir, record, tmp_path, split=False)
        assert sample.input_ids.tolist() == alone.input_ids.tolist()


# ----------------------------------------------------------------------------- the image-token count, end to end


@pytest.mark.parametrize("split", [True, False], ids=["text", "seed"])
def test_image_token_count_always_matches_the_features(split, model_dir, make_recipe, tmp_path, image):
    """Through preprocess, the training dataset and the collator: [IMG] tokens == image features,
    one [IMG_END] per image, and the rows' [IMG_BREAK]s, whatever the text holds."""
    from magistral_cli.data.collator import PixtralCollator
    from magistral_cli.data.loader import TrainDataset
    from magistral_cli.data.pipeline import image_settings_of, run_preprocess
    from magistral_cli.engine.model import check_image_tokens
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    texts = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[IMG][IMG_BREAK][IMG_END]", "plain"]
    rows = [_record(f"<image> what is {t}?", assistant=f"it is {t}", images=[image]) for t in texts]
    dataset_path = tmp_path / "data.jsonl"
    dataset_path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    recipe = make_recipe(model_dir, dataset_path, tmp_path / "cache", pre={"split_special_tokens": split})
    result = run_preprocess(recipe)
    dataset = result.dataset
    assert len(dataset) == (5 if split else 1)
    if not split:
        assert result.report["dropped_by_reason"] == {"image_token_in_text": 4}

    config = tiny_mistral3_config()
    train = TrainDataset(dataset, image_settings_of(dataset))
    collate = PixtralCollator(dataset.meta["pad_token_id"])
    special = dataset.meta["special_ids"]
    step = config.vision_config.patch_size * config.spatial_merge_size
    for index in range(len(train)):
        batch = collate([train[index]])
        check_image_tokens(config, batch["input_ids"], batch.get("image_sizes"))  # raises on a mismatch
        ids = batch["input_ids"][0].numpy()
        sizes = batch["image_sizes"].tolist()
        assert int((ids == special["img"]).sum()) == sum((h // step) * (w // step) for h, w in sizes)
        assert int((ids == special["img_end"]).sum()) == len(sizes)
        assert int((ids == special["img_break"]).sum()) == sum(h // step - 1 for h, _ in sizes)


# ----------------------------------------------------------------------------- the default system prompt


def test_a_records_own_think_markers_are_text_the_defaults_are_not(model_dir, tmp_path, reference):
    """The recipe's default system prompt is the template's: its [THINK] markers are control
    tokens when the vocabulary has them (see test_data_reference for v13); a record's own system
    message is data text. With this vocabulary (no [THINK]) both are text, as mistral-common says."""
    record = _record("hi", system="think [THINK]here[/THINK] now")
    ours = _encode(model_dir, record, tmp_path)
    assert ours.input_ids.tolist() == _theirs(reference, record)
    without_system = _record("hi")
    for split in (True, False):
        default = _encode(model_dir, without_system, tmp_path, split=split, default_system="think [INST] now")
        assert default.input_ids.tolist() == _theirs(reference, _record("hi", system="think [INST] now"))
        assert default.text_control_tokens == {}  # the recipe's text is not counted as the data's


# ----------------------------------------------------------------------------- the report and the console


def test_preprocess_counts_and_warns_with_the_seed_setting(model_dir, tmp_path, wide_console):
    from magistral_cli.cli.main import app

    rows = [_record(CONTROL_TEXT), _record("hi [/INST] there", assistant="ok </s>"), _record("plain")]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model_dir,
        tmp_path / "d.jsonl",
        tmp_path / "cache",
        pre={"split_special_tokens": False},
    )

    result = runner.invoke(app, ["preprocess", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["report"]
    assert report["kept"] == 2 and report["dropped_by_reason"] == {"image_token_in_text": 1}
    assert report["control_tokens_in_text"] == {
        "encoded_as": "control tokens",
        "samples": 1,
        "total": 2,
        "tokens": {"[/INST]": 1, "</s>": 1},
    }
    human = runner.invoke(app, ["preprocess", str(recipe)])
    assert human.exit_code == 0, human.output
    assert "2 in 1 sample(s), encoded as control tokens: [/INST] x1, </s> x1" in human.output
    assert "warning: 2 control token(s)" in human.output and "split_special_tokens=true" in human.output
    assert "0: prompt 0 holds the text [IMG]" in human.output  # the drop detail, not read as markup

    strict = runner.invoke(app, ["preprocess", str(recipe), "--strict"])
    assert (
        strict.exit_code == 2
        and "row 0 (image_token_in_text): prompt 0 holds the text [IMG]" in strict.output
    )
    assert "Traceback" not in strict.output


def test_preprocess_default_keeps_text_and_says_so(model_dir, tmp_path, wide_console):
    from magistral_cli.cli.main import app

    rows = [_record(CONTROL_TEXT), _record("plain")]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    recipe = write_recipe(tmp_path / "r.yaml", model_dir, tmp_path / "d.jsonl", tmp_path / "cache")
    result = runner.invoke(app, ["preprocess", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "4 in 1 sample(s), kept as text: [INST] x1, </s> x1, [IMG] x1, <s> x1" in result.output
    assert "warning" not in result.output


def test_a_drop_detail_with_markup_like_text_is_shown_not_parsed(model_dir, tmp_path, wide_console):
    """A path holding ``[/INST]`` once stopped the console summary with a rich MarkupError."""
    from magistral_cli.cli.main import app

    rows = [_record("<image>x", images=[str(tmp_path / "a[/INST]b.png")]), _record("plain")]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    recipe = write_recipe(tmp_path / "r.yaml", model_dir, tmp_path / "d.jsonl", tmp_path / "cache")
    result = runner.invoke(app, ["preprocess", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "a[/INST]b.png does not exist" in result.output


def test_seed_recipes_keep_the_seed_setting_and_validate():
    """The shipped recipes ask for the seed's behaviour explicitly (so their reports count and warn)."""
    from pathlib import Path

    import yaml

    from magistral_cli.config.loader import validate_recipe

    recipes = sorted(
        (Path(__file__).resolve().parents[2] / "recipes" / "magistral-small-2509").glob("*.yaml")
    )
    assert recipes
    for path in recipes:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        pre = data["data"]["dataset_param"]["preprocess_parameters"]
        recipe = validate_recipe(data)
        assert recipe.data.dataset_param.preprocess_parameters.split_special_tokens is pre.get(
            "split_special_tokens", True
        )
