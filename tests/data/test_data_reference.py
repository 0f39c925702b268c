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


def _ours(model_dir, tokenizer, record, dataset_dir) -> EncodedSample:
    settings = load_image_settings(model_dir, 1024, 262144)
    params = EncodeParams(8192, False, False, False, None, str(dataset_dir))
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
