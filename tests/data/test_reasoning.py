"""Reasoning traces: every layout encodes as mistral-common's ``ThinkChunk`` under tokenizer v13.

An assistant turn's reasoning may be a ``reasoning_content`` field, thinking content chunks, or
literal ``[THINK]...[/THINK]`` in its text. The proof is mistral-common itself: its
``encode_chat_completion`` of ``AssistantMessage`` objects with a ``ThinkChunk``, on a tekken.json
shaped like Magistral-Small-2509's (v13, ``[THINK]`` / ``[/THINK]`` control tokens 34 and 35).
``train_on_reasoning: false`` gives the same ids with the reasoning's labels ignored.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from magistral_cli.config.schema import DatasetAttr
from magistral_cli.data.encoder import IGNORE_INDEX, EncodedSample, EncodeParams, Encoder
from magistral_cli.data.pixtral import load_image_settings
from magistral_cli.data.readers import Drop, RecordFormat, RowSource
from magistral_cli.data.tokenizer import load_tokenizer
from magistral_cli.errors import UserError

pytest.importorskip("mistral_common")
pytest.importorskip("cv2")  # mistral-common's image encoder resizes with OpenCV

runner = CliRunner()

SYSTEM = "You answer briefly."
#: (user text, reasoning, answer) per turn; ``<image>`` marks where the image goes.
TURNS = [
    ("<image>What colour is this?", "The picture is one flat colour: lots of red, little else.", "Red."),
    ("And its shape?", "It is 56 px wide and 84 px tall, so a standing rectangle.", "A rectangle."),
]
LAYOUTS = ["reasoning_content", "thinking_chunks", "thinking_chunk_list", "literal_markers"]


def _assistant(layout: str, thinking: str, answer: str) -> dict:
    if layout == "reasoning_content":
        return {"role": "assistant", "content": answer, "reasoning_content": thinking}
    if layout == "thinking_chunks":
        return {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": thinking}, {"type": "text", "text": answer}],
        }
    if layout == "thinking_chunk_list":  # Mistral's API: the thinking as a list of text chunks
        half = len(thinking) // 2
        pieces = [{"type": "text", "text": thinking[:half]}, {"type": "text", "text": thinking[half:]}]
        return {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": pieces}, {"type": "text", "text": answer}],
        }
    return {"role": "assistant", "content": f"[THINK]{thinking}[/THINK]{answer}"}


def _record(layout: str, image=None) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for user, thinking, answer in TURNS:
        messages.append({"role": "user", "content": user if image else user.replace("<image>", "")})
        messages.append(_assistant(layout, thinking, answer))
    return {"messages": messages, **({"images": [str(image)]} if image else {})}


def _theirs(reference, image=None) -> list[int]:
    """mistral-common's ids of the conversation: each assistant turn a ThinkChunk and a TextChunk."""
    from mistral_common.protocol.instruct.chunk import ImageChunk, TextChunk, ThinkChunk
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    messages = [SystemMessage(content=SYSTEM)]
    for user, thinking, answer in TURNS:
        if "<image>" in user and image:
            text = user.replace("<image>", "")
            messages.append(UserMessage(content=[ImageChunk(image=Image.open(image)), TextChunk(text=text)]))
        else:
            messages.append(UserMessage(content=user.replace("<image>", "")))
        messages.append(AssistantMessage(content=[ThinkChunk(thinking=thinking), TextChunk(text=answer)]))
    return reference.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens


def _encode(model_dir, record, dataset_dir, *, split=True, train_on_reasoning=True, index=0):
    tokenizer = load_tokenizer(model_dir, split_special_tokens=split)
    settings = load_image_settings(model_dir, 1024, 262144)
    params = EncodeParams(8192, False, False, "", str(dataset_dir), train_on_reasoning=train_on_reasoning)
    encoder = Encoder(tokenizer, settings, params, RecordFormat.from_attr(DatasetAttr()))
    return encoder.encode_rows([RowSource(index, record)])[0]


@pytest.fixture(scope="module")
def reference(v13_model_dir):
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(v13_model_dir / "tekken.json"), mode=ValidationMode.finetuning)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoning_images") / "red.png"
    Image.new("RGB", (56, 84), (200, 20, 20)).save(path)  # 3 rows of 2 image tokens
    return path


def _think_spans(ids: list[int], think_ids: tuple[int, int]) -> list[tuple[int, int]]:
    """(start, end) of every [THINK] ... [/THINK] span, markers included (end exclusive)."""
    begin, end = think_ids
    starts = [i for i, t in enumerate(ids) if t == begin]
    ends = [i + 1 for i, t in enumerate(ids) if t == end]
    return list(zip(starts, ends, strict=True))


# ----------------------------------------------------------------------------- the ids: mistral-common's


@pytest.mark.parametrize("split", [True, False], ids=["text_is_text", "seed_split_false"])
@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_equals_mistral_common_think_chunks(
    layout, with_image, split, v13_model_dir, reference, image
):
    record = _record(layout, image if with_image else None)
    theirs = _theirs(reference, image if with_image else None)
    trained = _encode(v13_model_dir, record, image.parent, split=split)
    masked = _encode(v13_model_dir, record, image.parent, split=split, train_on_reasoning=False)
    assert isinstance(trained, EncodedSample) and isinstance(masked, EncodedSample), (trained, masked)
    assert trained.input_ids.tolist() == theirs
    assert masked.input_ids.tolist() == theirs

    # [THINK] / [/THINK] are the vocabulary's control tokens 34 and 35, once per turn, never text pieces.
    tokenizer = load_tokenizer(v13_model_dir, split_special_tokens=split)
    assert tokenizer.think_ids == (34, 35)
    assert tokenizer.control_tokens[34] == "[THINK]" and tokenizer.control_tokens[35] == "[/THINK]"
    assert theirs.count(34) == theirs.count(35) == len(TURNS)
    assert tokenizer.encode_as_text("[THINK]") != [34]  # as text it would be other ids
    assert trained.text_control_tokens == {}  # the markers are reasoning, not control strings in text

    # Labels: the same except over the reasoning spans (markers included), masked there only.
    spans = _think_spans(theirs, (34, 35))
    in_span = np.zeros(len(theirs), dtype=bool)
    for start, end in spans:
        in_span[start:end] = True
    assert (trained.labels[in_span] == trained.input_ids[in_span]).all()
    assert (masked.labels[in_span] == IGNORE_INDEX).all()
    assert (masked.labels[~in_span] == trained.labels[~in_span]).all()
    for _, end in spans:  # the answer after [/THINK] is still trained
        assert masked.labels[end] == masked.input_ids[end] != IGNORE_INDEX
    assert trained.reasoning_tokens == masked.reasoning_tokens == int(in_span.sum())


def test_the_default_is_to_train_on_reasoning():
    from magistral_cli.config.schema import BasicParameters

    assert BasicParameters().train_on_reasoning is True
    assert EncodeParams(1, False, False, "", "/").train_on_reasoning is True
    assert DatasetAttr().reasoning_tag == "reasoning_content"


def test_an_empty_reasoning_content_is_no_reasoning(v13_model_dir, tmp_path):
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    empty = json.loads(json.dumps(plain))
    empty["messages"][1]["reasoning_content"] = ""
    nulled = json.loads(json.dumps(plain))
    nulled["messages"][1]["reasoning_content"] = None
    ids = [_encode(v13_model_dir, r, tmp_path).input_ids.tolist() for r in (plain, empty, nulled)]
    assert ids[0] == ids[1] == ids[2] and 34 not in ids[0]


def test_sharegpt_records_carry_reasoning_too(v13_model_dir, tmp_path):
    llava = _record("reasoning_content")
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {
        "conversations": [
            {
                "from": roles[m["role"]],
                "value": m["content"],
                **{k: v for k, v in m.items() if k == "reasoning_content"},
            }
            for m in llava["messages"]
        ]
    }
    ours = _encode(v13_model_dir, sharegpt, tmp_path)
    assert ours.input_ids.tolist() == _encode(v13_model_dir, llava, tmp_path).input_ids.tolist()
    assert ours.input_ids.tolist().count(34) == len(TURNS)


@pytest.mark.parametrize(
    ("content", "reasoning", "reason", "words"),
    [
        ("[THINK]never closed", None, "malformed_reasoning", "[THINK] without [/THINK]"),
        (
            "closed[/THINK] never opened",
            None,
            "malformed_reasoning",
            "message 1 has [/THINK] without [THINK]",
        ),
        ("[THINK]a[THINK]b[/THINK]c", None, "malformed_reasoning", "opens [THINK] inside [THINK]"),
        ("[THINK]a[/THINK]b", "also here", "malformed_reasoning", "keep one of them"),
        ("answer", "holds [/THINK] inside", "malformed_reasoning", "remove them from the reasoning"),
        (
            [{"type": "thinking", "thinking": "a", "closed": False}, {"type": "text", "text": "b"}],
            None,
            "malformed_reasoning",
            "closed: false",
        ),
        ([{"type": "image_url", "image_url": "x.png"}], None, "invalid_record", "content chunk 0"),
        ("answer", ["not", "a string"], "invalid_record", "'reasoning_content' is not a string"),
        ("[THINK]only reasoning, empty[/THINK]  ", None, None, None),
        ("[THINK][/THINK]  ", None, "empty_assistant", "assistant turn 0 is empty"),
    ],
    ids=[
        "unclosed",
        "unopened",
        "nested",
        "two_layouts",
        "marker_in_reasoning",
        "open_chunk",
        "other_chunk",
        "not_a_string",
        "reasoning_only",
        "nothing",
    ],
)
def test_malformed_reasoning_drops_the_sample_and_says_why(
    content, reasoning, reason, words, v13_model_dir, tmp_path
):
    assistant = {"role": "assistant", "content": content}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    record = {"messages": [{"role": "user", "content": "Hi"}, assistant]}
    result = _encode(v13_model_dir, record, tmp_path)
    if reason is None:
        assert isinstance(result, EncodedSample) and result.input_ids.tolist().count(34) == 1
        return
    assert isinstance(result, Drop) and result.reason == reason, result
    assert words in result.detail


# ----------------------------------------------------------------------------- tokenizers older than v13


@pytest.mark.parametrize("layout", ["reasoning_content", "thinking_chunks"])
def test_reasoning_with_an_older_tokenizer_is_a_clear_error(layout, model_dir, tmp_path):
    record = {"messages": [{"role": "user", "content": "Hi"}, _assistant(layout, "hmm", "Hello.")]}
    with pytest.raises(UserError) as caught:
        _encode(model_dir, record, tmp_path, index=7)
    message = str(caught.value)
    assert message.startswith("row 7: an assistant turn carries reasoning")
    assert "(tekken.json v7)" in message and "v13" in message and "magistral fetch" in message


def test_literal_markers_stay_text_with_an_older_tokenizer_as_in_mistral_common(model_dir, tmp_path):
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    text = "[THINK]draft[/THINK]Hello."
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}]}
    reference = MistralTokenizer.from_file(str(model_dir / "tekken.json"), mode=ValidationMode.finetuning)
    request = ChatCompletionRequest(messages=[UserMessage(content="Hi"), AssistantMessage(content=text)])
    ours = _encode(model_dir, record, tmp_path)
    assert ours.input_ids.tolist() == reference.encode_chat_completion(request).tokens
    assert ours.reasoning_tokens == 0


# ----------------------------------------------------------------------------- through preprocess


def _write(tmp_path, model_dir, rows, pre="") -> object:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"""
data:
  dataset_param:
    preprocess_parameters:
      model_name_or_path: {model_dir}
    basic_parameters:
      dataset: {dataset}
      cache_dir: {tmp_path / "cache"}
      cutoff_len: 1024
      default_system: ""
{pre}
training:
  train_iters: 1
""",
        encoding="utf-8",
    )
    return recipe


def test_preprocess_encodes_reasoning_content_as_control_tokens_and_counts_it(
    v13_model_dir, tmp_path, image, monkeypatch
):
    from magistral_cli.cli.main import app
    from magistral_cli.cli.output import console
    from magistral_cli.data.cache import EncodedDataset

    rows = [
        _record("reasoning_content", image),
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {
            "messages": [
                {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
            ]
        },
    ]
    recipe = _write(tmp_path, v13_model_dir, rows)
    result = runner.invoke(app, ["preprocess", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    report = out["report"]
    assert report["kept"] == 3
    assert report["reasoning"]["samples"] == 2 and report["reasoning"]["trained"] is True

    dataset = EncodedDataset(out["cache_entry"])
    first = dataset[0]
    ids, labels = first.input_ids.tolist(), first.labels
    spans = _think_spans(ids, (34, 35))
    assert len(spans) == len(TURNS)  # [THINK] ids are the control tokens, one pair per turn
    assert report["reasoning"]["tokens"] == sum(e - s for s, e in spans) + sum(
        e - s for s, e in _think_spans(dataset[2].input_ids.tolist(), (34, 35))
    )
    assert all((labels[s:e] == first.input_ids[s:e]).all() for s, e in spans)

    masked = runner.invoke(
        app,
        ["preprocess", str(recipe), "data.dataset_param.basic_parameters.train_on_reasoning=false", "--json"],
    )
    assert masked.exit_code == 0, masked.output
    out = json.loads(masked.stdout)
    assert out["report"]["reasoning"]["trained"] is False
    masked_first = EncodedDataset(out["cache_entry"])[0]
    assert masked_first.input_ids.tolist() == ids
    assert all((masked_first.labels[s:e] == IGNORE_INDEX).all() for s, e in spans)

    monkeypatch.setattr(console, "_width", 1000)  # rows read whole, not wrapped
    human = runner.invoke(
        app, ["preprocess", str(recipe), "data.dataset_param.basic_parameters.train_on_reasoning=false"]
    )
    assert human.exit_code == 0, human.output
    assert "2 sample(s)" in human.output and "masked (train_on_reasoning: false)" in human.output


def test_preprocess_with_an_older_tokenizer_exits_2_naming_the_row(model_dir, tmp_path):
    from magistral_cli.cli.main import app

    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "Hi"}, _assistant("reasoning_content", "hmm", "Hello.")]},
    ]
    result = runner.invoke(app, ["preprocess", str(_write(tmp_path, model_dir, rows))])
    assert result.exit_code == 2, result.output
    assert "row 1: an assistant turn carries reasoning" in result.output and "v13" in result.output
    assert "Traceback" not in result.output
