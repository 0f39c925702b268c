"""Token ids must equal mistral-common's ``encode_chat_completion`` in fine-tuning mode.

mistral-common is Mistral's own implementation of the instruct format: agreeing with it on
the same Tekken file is the proof that template ``mistral`` and the Pixtral image tokens are
right. Image sizes are multiples of 28 within the pixel limits, so neither side resizes.
"""

from __future__ import annotations

import pytest
from PIL import Image

from magistral_cli.config.schema import DatasetAttr
from magistral_cli.data.encoder import EncodedSample, EncodeParams, Encoder
from magistral_cli.data.pixtral import load_image_settings
from magistral_cli.data.readers import RecordFormat, RowSource

pytestmark = pytest.mark.compat  # token-exact with the installed mistral-common

mistral_common = pytest.importorskip("mistral_common")
pytest.importorskip("cv2")  # mistral-common's image encoder resizes with OpenCV


@pytest.fixture(scope="module")
def reference(model_dir):
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(model_dir / "tekken.json"), mode=ValidationMode.finetuning)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref_images")
    paths = {}
    for name, (w, h), color in [
        ("a", (56, 84), (200, 20, 20)),
        ("b", (112, 56), (20, 200, 20)),
        ("c", (280, 196), (9, 9, 240)),
    ]:
        Image.new("RGB", (w, h), color).save(root / f"{name}.png")
        paths[name] = root / f"{name}.png"
    return paths


def _ours(model_dir, tokenizer, record, dataset_dir, default_system="") -> EncodedSample:
    settings = load_image_settings(model_dir, 1024, 262144)
    params = EncodeParams(8192, False, False, default_system, str(dataset_dir))
    encoder = Encoder(tokenizer, settings, params, RecordFormat.from_attr(DatasetAttr()))
    result = encoder.encode_rows([RowSource(0, record)])[0]
    assert isinstance(result, EncodedSample), result
    return result


def _theirs(reference, record, paths):
    """The same conversation as mistral-common messages (text and image chunks in placeholder order)."""
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
        elif "<image>" not in content:
            messages.append(UserMessage(content=content))
        else:
            chunks = []
            for i, part in enumerate(content.split("<image>")):
                if i:
                    chunks.append(ImageChunk(image=Image.open(paths[next(images)])))
                if part:
                    chunks.append(TextChunk(text=part))
            messages.append(UserMessage(content=chunks))
    return reference.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens


CASES = {
    "text_only": {
        "messages": [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi."}]
    },
    "system_and_turns": {
        "messages": [
            {"role": "system", "content": "You are terse.\nAnswer in one line."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": " And  3+3 ?\n"},
            {"role": "assistant", "content": "6, as before: simple.\n"},
        ]
    },
    "image_first": {
        "messages": [
            {"role": "user", "content": "<image>\nWhat color is this?"},
            {"role": "assistant", "content": "Red."},
        ],
        "images": ["a"],
    },
    "images_between_text": {
        "messages": [
            {"role": "system", "content": "Compare images."},
            {"role": "user", "content": "First <image> then <image> - which is wider?"},
            {"role": "assistant", "content": "The second one."},
            {"role": "user", "content": "<image>And this one?"},
            {"role": "assistant", "content": "Blue and larger."},
        ],
        "images": ["a", "b", "c"],
    },
    "two_images_only": {
        "messages": [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "Two."}],
        "images": ["b", "a"],
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ids_equal_mistral_common(case, model_dir, tokenizer, reference, images):
    record = dict(CASES[case])
    paths = images
    ours_record = dict(record, images=[str(paths[name]) for name in record.get("images", [])])
    ours = _ours(model_dir, tokenizer, ours_record, paths["a"].parent)
    theirs = _theirs(reference, record, paths)
    assert ours.input_ids.tolist() == theirs
    # The last assistant turn and its </s> are trained on; the prompt is not.
    assert ours.labels[-1] == tokenizer.special.eos
    assert ours.labels[0] == -100


def test_known_difference_trailing_image(model_dir, tokenizer, reference, images):
    """mistral-common moves a single trailing image before the text of a user message; we keep
    placeholder order. The two encodings hold the same tokens, only the image block moves."""
    record = {
        "messages": [
            {"role": "user", "content": "Describe this: <image>"},
            {"role": "assistant", "content": "A box."},
        ],
        "images": ["a"],
    }
    ours = _ours(model_dir, tokenizer, dict(record, images=[str(images["a"])]), images["a"].parent)
    theirs = _theirs(reference, record, images)
    assert ours.input_ids.tolist() != theirs
    assert sorted(ours.input_ids.tolist()) == sorted(theirs)
    special = tokenizer.special
    # ours: [INST] text [IMG]... ; theirs: [INST] [IMG]... text
    assert ours.input_ids[2] != special.img and theirs[2] == special.img


# ----------------------------------------------------------------------------- the seed's default system prompt


@pytest.mark.parametrize("split", [True, False], ids=["text_is_text", "seed_split_false"])
def test_default_system_prompt_equals_mistral_common_think_chunks(split, v13_model_dir, tmp_path):
    """A row without a system message gets the seed's default system prompt: the same ids as
    mistral-common's system message of text + ThinkChunk + text (how Magistral's own
    SYSTEM_PROMPT.txt is meant), with [THINK] / [/THINK] as special tokens. The prompt is the
    template's, not data text: both split_special_tokens settings give these ids."""
    import json
    from pathlib import Path

    from mistral_common.protocol.instruct.chunk import TextChunk, ThinkChunk
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from magistral_cli.data.template import resolve_default_system
    from magistral_cli.data.tokenizer import load_tokenizer

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "seed_template_mistral.json"
    seed_prompt = json.loads(fixture.read_text(encoding="utf-8"))["default_system"]
    before, rest = seed_prompt.split("[THINK]")
    thinking, after = rest.split("[/THINK]")
    reference = MistralTokenizer.from_file(str(v13_model_dir / "tekken.json"), mode=ValidationMode.finetuning)
    system = SystemMessage(
        content=[TextChunk(text=before), ThinkChunk(thinking=thinking, closed=True), TextChunk(text=after)]
    )
    turns = [UserMessage(content="Hello there!"), AssistantMessage(content="Hi.")]
    theirs = reference.encode_chat_completion(ChatCompletionRequest(messages=[system, *turns])).tokens

    tokenizer = load_tokenizer(v13_model_dir, split_special_tokens=split)
    record = {
        "messages": [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi."}]
    }
    ours = _ours(v13_model_dir, tokenizer, record, tmp_path, default_system=resolve_default_system(None))
    assert ours.input_ids.tolist() == theirs
    assert 34 in theirs and 35 in theirs  # [THINK] / [/THINK] are special ids, not text
    without = _ours(v13_model_dir, tokenizer, record, tmp_path, default_system="")
    no_system = reference.encode_chat_completion(ChatCompletionRequest(messages=turns)).tokens
    assert without.input_ids.tolist() == no_system and len(theirs) > len(no_system) + 100


def test_a_records_own_think_markers_are_text_as_in_mistral_common(v13_model_dir, tmp_path):
    """A record's system message is data text: its [THINK] is text by default (mistral-common's
    plain string content), even where the vocabulary has [THINK] as a control token."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from magistral_cli.data.tokenizer import load_tokenizer

    system = "Think first: [THINK]draft[/THINK] then answer."
    reference = MistralTokenizer.from_file(str(v13_model_dir / "tekken.json"), mode=ValidationMode.finetuning)
    messages = [SystemMessage(content=system), UserMessage(content="Hi"), AssistantMessage(content="Yo.")]
    theirs = reference.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens
    record = {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo."},
        ]
    }
    ours = _ours(v13_model_dir, load_tokenizer(v13_model_dir), record, tmp_path)
    assert ours.input_ids.tolist() == theirs and 34 not in theirs
    assert ours.text_control_tokens == {"[THINK]": 1, "[/THINK]": 1}
