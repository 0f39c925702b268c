"""Labels, truncation and record reading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from magistral_cli.config.schema import DatasetAttr
from magistral_cli.data.encoder import EncodedSample, EncodeParams, Encoder, infer_seqlen
from magistral_cli.data.pixtral import load_image_settings
from magistral_cli.data.readers import Drop, RecordFormat, RowSource, read_rows
from magistral_cli.data.template import MAGISTRAL_THINKING_PROMPT
from magistral_cli.errors import UserError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

TWO_TURNS = {
    "messages": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second answer"},
    ]
}


def encode(model_dir, tokenizer, record, dataset_dir=".", attr=None, **params):
    # default_system "" (no system prompt) keeps the expected texts short; the default is tested below.
    values = dict(cutoff_len=2048, train_on_prompt=False, mask_history=False, default_system="")
    values.update(params)
    encoder = Encoder(
        tokenizer,
        load_image_settings(model_dir, 1024, 262144),
        EncodeParams(dataset_dir=str(dataset_dir), **values),
        RecordFormat.from_attr(attr or DatasetAttr()),
    )
    return encoder.encode_rows([RowSource(0, record)])[0]


def trained_text(tokenizer, sample):
    return tokenizer.decode([int(t) for t in sample.labels if t != -100])


def test_labels_cover_every_response_and_eos(model_dir, tokenizer):
    sample = encode(model_dir, tokenizer, TWO_TURNS)
    assert trained_text(tokenizer, sample) == "first answer</s>second answer</s>"
    assert np.all((sample.labels == -100) | (sample.labels == sample.input_ids))


def test_train_on_prompt_and_mask_history(model_dir, tokenizer):
    on_prompt = encode(model_dir, tokenizer, TWO_TURNS, train_on_prompt=True)
    assert (on_prompt.labels == on_prompt.input_ids).all()
    last_only = encode(model_dir, tokenizer, TWO_TURNS, mask_history=True)
    assert trained_text(tokenizer, last_only) == "second answer</s>"
    assert last_only.input_ids.tolist() == encode(model_dir, tokenizer, TWO_TURNS).input_ids.tolist()


def _params_of(make_recipe, model_dir, tmp_path, **basic) -> EncodeParams:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps(TWO_TURNS) + "\n", encoding="utf-8")
    return EncodeParams.from_recipe(make_recipe(model_dir, dataset, tmp_path, basic=basic), tmp_path)


def test_seed_default_system_prompt_is_the_seeds_text():
    """Character for character the seed template's default_system (copied into the fixture)."""
    seed = json.loads((FIXTURES / "seed_template_mistral.json").read_text(encoding="utf-8"))
    assert seed["default_system"] == MAGISTRAL_THINKING_PROMPT


def test_recipe_default_system_spellings(make_recipe, model_dir, tmp_path):
    """Absent or null: the seed's thinking prompt, whatever enable_thinking says; '': none."""
    absent = _params_of(make_recipe, model_dir, tmp_path)
    assert absent.default_system == MAGISTRAL_THINKING_PROMPT
    for basic in ({"default_system": None}, {"enable_thinking": True}, {"enable_thinking": False}):
        assert _params_of(make_recipe, model_dir, tmp_path, **basic) == absent
    assert _params_of(make_recipe, model_dir, tmp_path, default_system="").default_system == ""
    assert (
        _params_of(make_recipe, model_dir, tmp_path, default_system="Be brief.").default_system == "Be brief."
    )
    with pytest.raises(UserError, match="enable_thinking: true .* default_system: ''"):
        _params_of(make_recipe, model_dir, tmp_path, default_system="", enable_thinking=True)


def test_system_prompt_sources(model_dir, tokenizer):
    special = tokenizer.special
    seeds = encode(model_dir, tokenizer, TWO_TURNS, default_system=MAGISTRAL_THINKING_PROMPT)
    prompt_ids = tokenizer.encode(MAGISTRAL_THINKING_PROMPT)
    block = [special.bos, special.system, *prompt_ids, special.system_end, special.inst]
    assert seeds.input_ids[: len(block)].tolist() == block
    plain = encode(model_dir, tokenizer, TWO_TURNS)
    assert special.system not in plain.input_ids
    assert len(seeds.input_ids) == len(plain.input_ids) + len(prompt_ids) + 2
    default = encode(model_dir, tokenizer, TWO_TURNS, default_system="Be brief.")
    assert tokenizer.decode(default.input_ids.tolist()).startswith(
        "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]"
    )
    own = dict(TWO_TURNS, messages=[{"role": "system", "content": "Own."}, *TWO_TURNS["messages"]])
    text = tokenizer.decode(
        encode(model_dir, tokenizer, own, default_system=MAGISTRAL_THINKING_PROMPT).input_ids.tolist()
    )
    assert "[SYSTEM_PROMPT]Own.[/SYSTEM_PROMPT]" in text and "thinking" not in text
    # An empty system message of the record falls back to the default (LLaMA-Factory's `system or default`).
    empty = dict(TWO_TURNS, messages=[{"role": "system", "content": ""}, *TWO_TURNS["messages"]])
    assert (
        encode(model_dir, tokenizer, empty, default_system="Be brief.").input_ids.tolist()
        == default.input_ids.tolist()
    )


def test_tool_results_turn(model_dir, tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "calling"},
            {"role": "observation", "content": '{"temp": 20}'},
            {"role": "assistant", "content": "20 degrees"},
        ]
    }
    text = tokenizer.decode(encode(model_dir, tokenizer, record).input_ids.tolist())
    assert (
        text == '<s>[INST]weather?[/INST]calling</s>[TOOL_RESULTS]{"temp": 20}[/TOOL_RESULTS]20 degrees</s>'
    )


def test_infer_seqlen_matches_llamafactory():
    # LLaMA-Factory's processor_utils.infer_seqlen, three branches
    assert infer_seqlen(100, 10, 50) == (40, 10)
    assert infer_seqlen(10, 100, 50) == (10, 40)
    assert infer_seqlen(60, 40, 50) == (30, 20)


def test_text_sample_is_truncated_and_kept(model_dir, tokenizer):
    record = {
        "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok " * 50}]
    }
    sample = encode(model_dir, tokenizer, record, cutoff_len=64)
    assert isinstance(sample, EncodedSample) and sample.truncated
    assert len(sample.input_ids) == 64 and (sample.labels != -100).any()


@pytest.fixture
def image_dir(tmp_path):
    Image.new("RGB", (84, 56), (1, 2, 3)).save(tmp_path / "x.png")  # 2 rows x 3 tokens + breaks = 8 tokens
    return tmp_path


def test_sample_whose_image_would_be_cut_is_dropped(model_dir, tokenizer, image_dir):
    record = {
        "messages": [
            {"role": "user", "content": "look " * 40 + "<image>"},
            {"role": "assistant", "content": "fine"},
        ],
        "images": ["x.png"],
    }
    full = encode(model_dir, tokenizer, record, image_dir)
    assert isinstance(full, EncodedSample) and not full.truncated
    img_end = int(np.flatnonzero(full.input_ids == tokenizer.special.img_end)[0])
    response = len(full.input_ids) - (img_end + 2)  # the prompt ends with [IMG_END][/INST]
    # The response is short, so truncation shortens the prompt to cutoff_len - response tokens.
    cut_inside = encode(model_dir, tokenizer, record, image_dir, cutoff_len=img_end - 3 + response)
    assert isinstance(cut_inside, Drop) and cut_inside.reason == "image_tokens_truncated"
    # Cut right before [IMG_END]: every [IMG] survives, the block is still broken.
    cut_before_end = encode(model_dir, tokenizer, record, image_dir, cutoff_len=img_end + response)
    assert isinstance(cut_before_end, Drop) and cut_before_end.reason == "image_tokens_truncated"
    # Cut after the image ([/INST] goes): kept, truncated, image block whole.
    after = encode(model_dir, tokenizer, record, image_dir, cutoff_len=img_end + 1 + response)
    assert isinstance(after, EncodedSample) and after.truncated
    assert after.input_ids[: img_end + 1].tolist() == full.input_ids[: img_end + 1].tolist()


def test_prompt_that_fills_cutoff_leaves_nothing_to_train(model_dir, tokenizer):
    record = {
        "messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y " * 300}]
    }
    result = encode(model_dir, tokenizer, record, cutoff_len=1)
    assert isinstance(result, Drop) and result.reason == "no_label_tokens"


BAD = {
    "unknown_role": {"messages": [{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}]},
    "missing_assistant": {"messages": [{"role": "user", "content": "a"}]},
    "bad_turn_order": {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    "empty_assistant": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
    "image_count_mismatch": {
        "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "b"}],
        "images": [],
    },
    "image_in_assistant_turn": {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<image>"}],
        "images": ["x.png"],
    },
    "missing_image": {
        "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "b"}],
        "images": ["nope.png"],
    },
    "unreadable_image": {
        "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "b"}],
        "images": ["broken.png"],
    },
    "invalid_record": {"messages": "not a list"},
    "unsupported_role": {"messages": [{"role": "function_call", "content": "{}"}]},
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_bad_records_are_dropped_with_their_reason(reason, model_dir, tokenizer, image_dir):
    (image_dir / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    result = encode(model_dir, tokenizer, BAD[reason], image_dir)
    assert isinstance(result, Drop) and result.reason == reason, result


def test_sharegpt_records_through_attr(model_dir, tokenizer):
    record = {
        "conversations": [
            {"from": "system", "value": "Sys."},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
        ]
    }
    auto = encode(model_dir, tokenizer, record)
    assert (
        tokenizer.decode(auto.input_ids.tolist())
        == "<s>[SYSTEM_PROMPT]Sys.[/SYSTEM_PROMPT][INST]hi[/INST]hello</s>"
    )
    mapped = DatasetAttr(
        messages="conversations", role_tag="from", content_tag="value", user_tag="human", assistant_tag="gpt"
    )
    assert encode(model_dir, tokenizer, record, attr=mapped).input_ids.tolist() == auto.input_ids.tolist()


def test_read_rows_json_array_and_jsonl(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"x": 1}, {"x": 2}, {"x": 3}]))
    assert [r.record for r in read_rows(tmp_path / "a.json", max_samples=2)] == [{"x": 1}, {"x": 2}]
    (tmp_path / "b.jsonl").write_text('{"x": 1}\n\n{"x": \n{"x": 3}\n')
    rows = read_rows(tmp_path / "b.jsonl")
    assert [r.index for r in rows] == [0, 1, 2] and rows[1].error.startswith("line 3")
    (tmp_path / "c.json").write_text('[{"x": 1},')
    with pytest.raises(UserError, match="not valid JSON"):
        read_rows(tmp_path / "c.json")
