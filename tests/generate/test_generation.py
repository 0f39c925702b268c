"""`magistral_cli.generate`: the prompt is the training encoding, the output is transformers' own generate.

The tiny Mistral3 has the real Tekken vocabulary, so the real tokenizer's ids fit. References are
built independently of the module: prompt ids from the preprocessing encoder on the conversation
with its answer (the training sample) and from mistral-common's generation prompt; outputs from
``from_pretrained`` + ``generate``, or from the checkpoint exported by ``convert dcp-to-hf``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from PIL import Image

from magistral_cli.checkpoint.integrity import describe_file, write_integrity
from magistral_cli.config.schema import DatasetAttr
from magistral_cli.data.encoder import EncodedSample, EncodeParams, Encoder
from magistral_cli.data.pixtral import load_pixel_values
from magistral_cli.data.readers import RecordFormat, RowSource
from magistral_cli.data.template import MAGISTRAL_THINKING_PROMPT
from magistral_cli.errors import UserError
from magistral_cli.generate import (
    PromptEncoder,
    SamplingOptions,
    generate_batch,
    load_generator,
    read_conversations,
    resolve_source,
)
from magistral_cli.testing.tiny_data import write_tiny_tokenizer_files
from magistral_cli.testing.tiny_model import build_tiny_model, save_official_checkpoint

pytestmark = [pytest.mark.compat, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

GREEDY = SamplingOptions(max_new_tokens=6, greedy=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model in the official layout (fp32), its tekken.json, two images (2x3 and 2x2 tokens)."""
    root = tmp_path_factory.mktemp("generate")
    model = build_tiny_model(seed=0)
    hf = save_official_checkpoint(model, root / "model", num_shards=2, dtype="float32")
    write_tiny_tokenizer_files(hf)
    Image.new("RGB", (84, 56), (200, 30, 30)).save(root / "red.png")
    Image.new("RGB", (56, 56), (20, 30, 220)).save(root / "blue.png")
    return {"root": root, "hf": hf, "model": model, "red": root / "red.png", "blue": root / "blue.png"}


@pytest.fixture(scope="module")
def generator(tiny):
    return load_generator(resolve_source(tiny["hf"]), device="cpu")


def _reference_generate(model, ids, images=(), settings=None, max_new_tokens=6):
    """transformers' generate on ``ids``; pixel values straight from the data loader's function."""
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if images:
        pixels = [torch.from_numpy(load_pixel_values(p, settings)) for p in images]
        assert len({tuple(p.shape) for p in pixels}) == 1  # same size: no padding needed
        inputs["pixel_values"] = torch.stack(pixels).to(model.dtype)
        inputs["image_sizes"] = torch.tensor([list(p.shape[1:]) for p in pixels])
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def _training_sample(encoder: PromptEncoder, record, system: str) -> EncodedSample:
    params = EncodeParams(8192, False, False, system, "/")
    enc = Encoder(encoder.tokenizer, encoder.settings, params, RecordFormat.from_attr(DatasetAttr()))
    (sample,) = enc.encode_rows([RowSource(0, record)])
    assert isinstance(sample, EncodedSample), sample
    return sample


def test_the_prompt_is_the_training_sample_up_to_its_answer(generator, tiny):
    encoder = generator.encoder
    assert encoder.default_system == MAGISTRAL_THINKING_PROMPT  # an HF dir: the template's default
    answer = "It is red."
    record = {
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": f"<image>\nAnd this? <image>{' '}"},
            {"role": "assistant", "content": answer},
        ],
        "images": [str(tiny["red"]), str(tiny["blue"])],
    }
    sample = _training_sample(encoder, record, MAGISTRAL_THINKING_PROMPT)
    answer_len = len(encoder.tokenizer.encode(answer)) + 1  # and </s>
    prompt = encoder.encode_record(record)
    assert prompt.input_ids == sample.input_ids.tolist()[:-answer_len]
    assert prompt.reference == answer
    assert prompt.image_sizes == [tuple(s) for s in sample.image_sizes.tolist()] == [(56, 84), (56, 56)]
    # The same conversation without its answer encodes the same.
    without = dict(record, messages=record["messages"][:-1])
    assert encoder.encode_record(without).input_ids == prompt.input_ids


def test_the_prompt_equals_mistral_commons_generation_prompt(generator, tiny):
    pytest.importorskip("cv2")  # mistral-common's image encoder
    from mistral_common.protocol.instruct.chunk import ImageChunk, TextChunk
    from mistral_common.protocol.instruct.messages import SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    reference = MistralTokenizer.from_file(str(tiny["hf"] / "tekken.json"), mode=ValidationMode.test)
    ours = generator.encoder.encode_prompt("What color is it?", [str(tiny["red"])], system="Be brief.")
    theirs = reference.encode_chat_completion(
        ChatCompletionRequest(
            messages=[
                SystemMessage(content="Be brief."),
                UserMessage(
                    content=[ImageChunk(image=Image.open(tiny["red"])), TextChunk(text="What color is it?")]
                ),
            ]
        )
    ).tokens
    assert ours.input_ids == theirs
    text_only = generator.encoder.encode_prompt("Hello there!", system="")  # '' = no system block
    theirs = reference.encode_chat_completion(
        ChatCompletionRequest(messages=[UserMessage(content="Hello there!")])
    ).tokens
    assert text_only.input_ids == theirs


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_greedy_equals_transformers_generate(generator, tiny, with_image):
    from transformers import Mistral3ForConditionalGeneration

    images = [str(tiny["red"])] if with_image else []
    prompt = generator.encoder.encode_prompt("Describe it.", images)
    completion = generator.generate(prompt, GREEDY)

    reference = Mistral3ForConditionalGeneration.from_pretrained(tiny["hf"], dtype=torch.float32).eval()
    expected = _reference_generate(reference, prompt.input_ids, images, generator.encoder.settings)
    assert completion.token_ids == expected and len(expected) == 6
    assert completion.finish_reason == "length"
    assert completion.text == generator.encoder.tokenizer.decode(expected)
    if with_image:  # the image changes the answer: the pixels reached the vision tower
        plain = generator.encoder.encode_prompt("Describe it.")
        assert generator.generate(plain, GREEDY).token_ids != expected


def test_transformers_layout_directory_gives_the_same_output(generator, tiny, tmp_path):
    tiny["model"].save_pretrained(tmp_path / "hf")
    write_tiny_tokenizer_files(tmp_path / "hf")
    other = load_generator(resolve_source(tmp_path / "hf"), device="cpu", dtype="fp32")
    prompt = generator.encoder.encode_prompt("<image>Which color?", [str(tiny["blue"])])
    assert other.generate(prompt, GREEDY).token_ids == generator.generate(prompt, GREEDY).token_ids


def test_sampling_is_seeded_and_streams_the_text(generator):
    prompt = generator.encoder.encode_prompt("Tell me a story.", system="")
    options = SamplingOptions(max_new_tokens=5, seed=3)
    first = generator.generate(prompt, options)
    streamed = []
    second = generator.generate(prompt, options, on_text=streamed.append)
    assert second.token_ids == first.token_ids and "".join(streamed) == first.text
    assert generator.generate(prompt, SamplingOptions(max_new_tokens=5, seed=4)).token_ids != first.token_ids


def _run_dir(tmp_path, base, state, **data_basic):
    """A run directory as training leaves it: resolved_config.yaml and checkpoints/step_2 (engine layout)."""
    from magistral_cli.config.loader import recipe_to_yaml, validate_recipe

    recipe = validate_recipe(
        {
            "data": {"dataset_param": {"basic_parameters": data_basic}},
            "model": {"model_name_or_path": str(base)},
            "training": {"train_iters": 2, "micro_batch_size": 1, "save": "checkpoints"},
        }
    )
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "resolved_config.yaml").write_text("# resolved\n" + recipe_to_yaml(recipe), encoding="utf-8")
    dcp.save(state, checkpoint_id=run / "checkpoints" / "step_2")
    files = {p.name: describe_file(p) for p in (run / "checkpoints" / "step_2").glob("*.distcp")}
    write_integrity(run / "checkpoints" / "step_2", files, 2)  # as the trainer's save records it
    (run / "checkpoints" / "latest").write_text("step_2\n")
    return run


def test_training_checkpoint_equals_its_export(tiny, tmp_path):
    """fp32 master weights (changed from the base) read in memory, in the base's bf16 = the exported
    directory loaded in bf16."""
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf

    base = save_official_checkpoint(tiny["model"], tmp_path / "base", num_shards=2)  # bfloat16
    write_tiny_tokenizer_files(base)
    trained = {k: v.detach().float() * 1.5 for k, v in tiny["model"].state_dict().items()}
    state = {
        "model": trained,
        "optimizer": {"state": {"x": {"exp_avg": torch.ones(3)}}},
        "step": 2,
    }
    run = _run_dir(tmp_path, base, state, default_system="")
    source = resolve_source(run)
    assert source.kind == "checkpoint" and source.checkpoint == run / "checkpoints" / "step_2"
    assert source.model_dir == base
    generator = load_generator(source, device="cpu")
    assert generator.dtype == torch.bfloat16  # config.json's
    assert generator.encoder.default_system == ""  # the run's data section, not the HF default
    prompt = generator.encoder.encode_prompt("<image>What is it?", [str(tiny["red"])])
    assert prompt.input_ids[:2] == [1, generator.encoder.tokenizer.special.inst]  # no system block
    completion = generator.generate(prompt, GREEDY)
    assert not list(run.rglob("*.safetensors"))  # nothing was written

    export_dcp_to_hf(run / "checkpoints", base, tmp_path / "export")
    exported = Mistral3ForConditionalGeneration.from_pretrained(
        tmp_path / "export", dtype=torch.bfloat16
    ).eval()
    assert completion.token_ids == _reference_generate(
        exported, prompt.input_ids, [str(tiny["red"])], generator.encoder.settings
    )
    with pytest.raises(UserError, match="--base"):  # a checkpoint of another model
        small = build_tiny_model(_small_config(), seed=1)
        other = save_official_checkpoint(small, tmp_path / "small", num_shards=1, dtype="float32")
        write_tiny_tokenizer_files(other)
        load_generator(resolve_source(run, base=other), device="cpu")


def _small_config():
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    return tiny_mistral3_config(hidden_size=32)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")
def test_lora_run_checkpoint_equals_peft_on_its_exported_adapters(tiny, tmp_path):
    from peft import PeftModel
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.checkpoint.lora_export import export_lora_adapters
    from magistral_cli.engine.checkpoint import pack

    g = torch.Generator().manual_seed(4)
    modules = [
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.1.mlp.down_proj",
    ]
    dims = {m: tiny["model"].get_submodule(m) for m in modules}
    adapters = {}
    for m, linear in dims.items():
        adapters[f"{m}.lora_A.default.weight"] = torch.randn(4, linear.in_features, generator=g) * 0.1
        adapters[f"{m}.lora_B.default.weight"] = torch.randn(linear.out_features, 4, generator=g) * 0.1
    record = {"format": 1, "r": 4, "alpha": 8, "dropout": 0.0, "init_lora_weights": True}
    record |= {"target_modules": modules, "modules_to_save": [], "base_model_name_or_path": str(tiny["hf"])}
    state = {"model": adapters, "lora": {"config": pack(json.dumps(record))}, "step": 2}
    run = _run_dir(tmp_path, tiny["hf"], state)
    source = resolve_source(run / "checkpoints" / "step_2")
    assert source.kind == "lora_checkpoint"
    generator = load_generator(source, device="cpu", dtype="fp32")
    prompt = generator.encoder.encode_prompt("Hello?")
    completion = generator.generate(prompt, GREEDY)

    export_lora_adapters(run / "checkpoints" / "step_2", tiny["hf"], tmp_path / "adapters")
    base = Mistral3ForConditionalGeneration.from_pretrained(tiny["hf"], dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    assert completion.token_ids == _reference_generate(reference, prompt.input_ids)
    assert (
        completion.token_ids
        != load_generator(resolve_source(tiny["hf"]), device="cpu").generate(prompt, GREEDY).token_ids
    )


def test_batch_lines_equal_single_generations(generator, tiny, tmp_path):
    (tmp_path / "img").mkdir()
    Image.open(tiny["red"]).save(tmp_path / "img" / "red.png")
    rows = [
        {"messages": [{"role": "user", "content": "<image>\nWhat color?"}], "images": ["img/red.png"]},
        {
            "conversations": [
                {"from": "system", "value": "Answer in French."},
                {"from": "human", "value": "Hi."},
                {"from": "gpt", "value": "Bonjour."},
            ]
        },
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    prompts = read_conversations(generator.encoder, data)
    summary = generate_batch(generator, prompts, tmp_path / "out.jsonl", GREEDY)
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert summary["conversations"] == 2 and [x["index"] for x in lines] == [0, 1]
    single = generator.generate(generator.encoder.encode_prompt("\nWhat color?", [str(tiny["red"])]), GREEDY)
    assert lines[0]["token_ids"] == single.token_ids and lines[0]["text"] == single.text
    assert lines[1]["reference"] == "Bonjour." and "reference" not in lines[0]
    system = generator.encoder.encode_prompt("Hi.", system="Answer in French.")
    assert prompts[1][1].input_ids == system.input_ids  # the record's own system message
    assert not (tmp_path / "out.jsonl.partial").exists()

    data.write_text(json.dumps(rows[0]) + "\n" + '{"messages": [{"role": "user"' + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="row 1"):
        read_conversations(generator.encoder, data)


@pytest.mark.parametrize(
    "case",
    ["missing", "file", "not_a_model", "no_weights", "adapter_as_model", "bare_dcp"],
)
def test_what_is_not_a_model_is_named(tiny, tmp_path, case):
    path = tmp_path / "x"
    if case == "file":
        path.write_text("hi")
    elif case == "not_a_model":
        path.mkdir()
        (path / "notes.txt").write_text("hi")
    elif case == "no_weights":
        path.mkdir()
        (path / "config.json").write_text((tiny["hf"] / "config.json").read_text())
    elif case == "adapter_as_model":
        path.mkdir()
        (path / "adapter_config.json").write_text("{}")
    elif case == "bare_dcp":
        dcp.save({"a": torch.ones(2)}, checkpoint_id=path)
    expected = {
        "missing": "does not exist",
        "file": "is a file",
        "not_a_model": "is not a model",
        "no_weights": "no weights",
        "adapter_as_model": "--adapter",
        "bare_dcp": "--base",
    }[case]
    with pytest.raises(UserError, match=expected):
        resolve_source(path)


def test_bad_images_are_named(generator, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(UserError, match="broken.png"):
        generator.encoder.encode_prompt("What is it?", [str(broken)])
    with pytest.raises(UserError, match="not found"):
        generator.encoder.encode_prompt("What is it?", [str(tmp_path / "none.png")])
    with pytest.raises(UserError, match="placeholder"):
        generator.encoder.encode_prompt("<image><image>", [str(broken)])
