"""Tokenizer loading from tekken.json or tokenizer.json, and the special-token checks."""

from __future__ import annotations

import json

import pytest

from magistral_cli.data.tokenizer import TEKKEN_PATTERN, check_against_model_config, load_tokenizer
from magistral_cli.errors import UserError

TEXT = "Hello world! Ünïcödé 12345 and   spaces\n\nnew lines, [INST] literal."


def _tokenizer_json(tokenizer, tmp_path, mutate=None):
    """A third-party style tokenizer.json of the same vocabulary (what unsloth's files hold)."""
    data = json.loads(tokenizer.to_str())
    if mutate:
        mutate(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return tmp_path


def test_official_special_ids(tokenizer):
    s = tokenizer.special
    assert (s.bos, s.eos, s.inst, s.inst_end, s.img, s.img_break, s.img_end) == (1, 2, 3, 4, 10, 12, 13)
    assert (s.system, s.system_end) == (17, 18)
    assert tokenizer.source == "official"


def test_tekken_encoding_equals_mistral_common(tokenizer, model_dir):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    reference = Tekkenizer.from_file(str(model_dir / "tekken.json"))
    plain = "Hello world! Ünïcödé 12345 and   spaces\n\nnew lines."
    assert tokenizer.encode(plain) == reference.encode(plain, bos=False, eos=False)


def test_split_special_tokens(model_dir):
    parsed = load_tokenizer(model_dir, split_special_tokens=False)
    split = load_tokenizer(model_dir, split_special_tokens=True)
    assert 3 in parsed.encode("a [INST] b")
    assert 3 not in split.encode("a [INST] b")


def test_tokenizer_json_source_gives_the_same_ids(tokenizer, tmp_path):
    _tokenizer_json(tokenizer, tmp_path)
    other = load_tokenizer(tmp_path, source="unsloth")
    assert other.source == "unsloth"
    assert other.encode(TEXT) == tokenizer.encode(TEXT)
    assert other.special == tokenizer.special


def test_broken_regex_needs_fix_mistral_regex(tokenizer, tmp_path):
    def break_regex(data):
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"

    _tokenizer_json(tokenizer, tmp_path, break_regex)
    with pytest.raises(UserError, match="fix_mistral_regex=true"):
        load_tokenizer(tmp_path, source="unsloth")
    fixed = load_tokenizer(tmp_path, source="unsloth", fix_mistral_regex=True)
    assert fixed.encode(TEXT) == tokenizer.encode(TEXT)
    assert (
        json.loads(fixed.to_str())["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == TEKKEN_PATTERN
    )


def test_missing_special_token_is_refused(tokenizer, tmp_path):
    def drop_img(data):
        data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "[IMG]"]
        data["model"]["vocab"].pop("[IMG]", None)

    _tokenizer_json(tokenizer, tmp_path, drop_img)
    with pytest.raises(UserError, match=r"\[IMG\]"):
        load_tokenizer(tmp_path, source="unsloth")


def test_old_tekken_version_is_refused(tmp_path, model_dir):
    data = json.loads((model_dir / "tekken.json").read_text())
    data["config"]["version"] = "v3"
    (tmp_path / "tekken.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="v3"):
        load_tokenizer(tmp_path)


def test_missing_files_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="magistral fetch"):
        load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="tokenizer_source=unsloth"):
        load_tokenizer(tmp_path, source="official")
    with pytest.raises(UserError, match="model directory not found"):
        load_tokenizer(tmp_path / "absent")


def test_model_config_must_agree(tokenizer, tmp_path):
    with pytest.raises(UserError, match="image_token_index=11"):
        check_against_model_config(tokenizer.special, {"image_token_index": 11}, tmp_path / "config.json")
    with pytest.raises(UserError, match="bos_token_id=5"):
        check_against_model_config(tokenizer.special, {"text_config": {"bos_token_id": 5}}, tmp_path)
    check_against_model_config(
        tokenizer.special, {"image_token_index": 10, "text_config": {"bos_token_id": 1}}, tmp_path
    )
