"""`magistral generate` through the command line: real transformers generate, real PEFT adapters."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.testing.tiny_data import write_tiny_tokenizer_files
from magistral_cli.testing.tiny_model import build_tiny_model, save_official_checkpoint, tiny_mistral3_config

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")
TOKEN = "hf_generateTestSentinel0123456789"
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_cli")
    hf = save_official_checkpoint(build_tiny_model(seed=0), root / "model", num_shards=2, dtype="float32")
    write_tiny_tokenizer_files(hf)
    Image.new("RGB", (84, 56), (200, 30, 30)).save(root / "red.png")
    return {"root": root, "hf": hf, "red": root / "red.png"}


def _base(path):
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _invoke(*args):
    return runner.invoke(app, ["generate", *map(str, args)])


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _reference(model, ids, pixel_values=None, image_sizes=None, max_new_tokens=6):
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if pixel_values is not None:
        inputs |= {"pixel_values": pixel_values.to(model.dtype), "image_sizes": image_sizes}
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_greedy_json_equals_transformers_generate(tiny, with_image, monkeypatch):
    from magistral_cli.data.pixtral import load_image_settings, load_pixel_values

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    image = ["--image", tiny["red"]] if with_image else []
    result = _invoke(
        "--model", tiny["hf"], "--prompt", "What is it?", *image, "--greedy", "--max-new-tokens", 6, "--json",
        "--show-tokens", "--device", "cpu",
    )  # fmt: skip
    out = _json(result)
    assert {"text", "token_ids", "prompt_token_ids", "finish_reason"} <= set(out)
    assert out["model"]["kind"] == "hf" and out["sampling"]["greedy"] is True
    assert "[INST]" in result.stderr and "What is it?[/INST]" in result.stderr  # --show-tokens
    assert ("[IMG_END]" in result.stderr) == with_image
    assert TOKEN not in result.output

    pixels = sizes = None
    if with_image:
        settings = load_image_settings(tiny["hf"], 1024, 262144)
        pixels = torch.from_numpy(load_pixel_values(tiny["red"], settings))[None]
        sizes = torch.tensor([list(pixels.shape[2:])])
    assert out["token_ids"] == _reference(_base(tiny["hf"]), out["prompt_token_ids"], pixels, sizes)
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"


def test_text_goes_to_stdout(tiny):
    result = _invoke(
        "--model", tiny["hf"], "--prompt", "Hi", "--greedy", "--max-new-tokens", 4, "--system", ""
    )
    assert result.exit_code == 0, result.output
    as_json = _json(
        _invoke(
            "--model",
            tiny["hf"],
            "--prompt",
            "Hi",
            "--greedy",
            "--max-new-tokens",
            4,
            "--system",
            "",
            "--json",
        )
    )
    assert result.stdout == as_json["text"] + "\n"
    assert "4 generated (length)" in result.stderr


def _adapter(base_dir, out_dir, config=None):
    """PEFT LoRA adapters on ``base_dir`` with random (nonzero) B, saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model

    model = _base(base_dir) if config is None else build_tiny_model(config, seed=0)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    peft_model.save_pretrained(out_dir)
    return out_dir


def test_base_plus_adapter_equals_peft_generate(tiny, tmp_path):
    from peft import PeftModel

    adapter = _adapter(tiny["hf"], tmp_path / "adapter")
    args = ("--model", tiny["hf"], "--prompt", "<image>Describe.", "--image", tiny["red"], "--greedy")
    out = _json(_invoke(*args, "--adapter", adapter, "--max-new-tokens", 6, "--json", "--show-tokens"))
    plain = _json(_invoke(*args, "--max-new-tokens", 6, "--json"))
    assert out["model"]["adapter"] == str(adapter)

    from magistral_cli.data.pixtral import load_image_settings, load_pixel_values

    settings = load_image_settings(tiny["hf"], 1024, 262144)
    pixels = torch.from_numpy(load_pixel_values(tiny["red"], settings))[None]
    reference = PeftModel.from_pretrained(_base(tiny["hf"]), adapter).eval()
    expected = _reference(reference, out["prompt_token_ids"], pixels, torch.tensor([list(pixels.shape[2:])]))
    assert out["token_ids"] == expected
    assert plain["token_ids"] != expected  # the adapters change the output


def test_adapter_of_another_base_is_refused(tiny, tmp_path):
    adapter = _adapter(None, tmp_path / "other", config=tiny_mistral3_config(hidden_size=32))
    result = _invoke(
        "--model", tiny["hf"], "--adapter", adapter, "--prompt", "Hi", "--greedy", "--max-new-tokens", 2
    )
    assert result.exit_code == 2, result.output
    assert "does not fit this base model" in result.output and "--model" in result.output
    assert "Traceback" not in result.output


def test_batch_writes_one_line_per_conversation(tiny, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "<image>Color?"}], "images": [str(tiny["red"])]},
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _invoke(
        "--model",
        tiny["hf"],
        "--input",
        data,
        "--output",
        tmp_path / "out.jsonl",
        "--greedy",
        "--max-new-tokens",
        3,
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [len(x["token_ids"]) for x in lines] == [3, 3] and lines[1]["reference"] == "Hello."
    single = _json(
        _invoke("--model", tiny["hf"], "--prompt", "Hi.", "--greedy", "--max-new-tokens", 3, "--json")
    )
    assert lines[1]["token_ids"] == single["token_ids"]


@pytest.mark.parametrize(
    "case",
    [
        "missing_model",
        "not_a_model",
        "bad_image",
        "adapter_without_files",
        "prompt_and_input",
        "nothing",
        "input_no_output",
        "greedy_with_temperature",
        "greedy_with_top_p",
    ],
)
def test_bad_input_is_one_message_and_exit_2(tiny, tmp_path, case):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\ngarbage")
    model = ["--model", tiny["hf"]]
    args, expected = {
        "missing_model": (["--model", tmp_path / "nope", "--prompt", "x"], "does not exist"),
        "not_a_model": (["--model", tmp_path / "empty", "--prompt", "x"], "is not a model"),
        "bad_image": ([*model, "--prompt", "x", "--image", tmp_path / "broken.png"], "broken.png"),
        "adapter_without_files": (
            [*model, "--prompt", "x", "--adapter", tmp_path / "empty"],
            "adapter_config.json",
        ),
        "prompt_and_input": (
            [*model, "--prompt", "x", "--input", tmp_path / "a.jsonl", "--output", tmp_path / "b"],
            "not both",
        ),
        "nothing": (model, "--prompt"),
        "input_no_output": ([*model, "--input", tmp_path / "a.jsonl"], "--output"),
        "greedy_with_temperature": (
            [*model, "--prompt", "x", "--greedy", "--temperature", "1.5"],
            "--greedy decodes by argmax, which --temperature would not change",
        ),
        "greedy_with_top_p": (
            [*model, "--prompt", "x", "--greedy", "--top-p", "0.5"],
            "which --top-p would not change",
        ),
    }[case]
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and expected in result.output
    assert "Traceback" not in result.output


def test_help_does_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        from typer.testing import CliRunner
        from magistral_cli.cli.main import app
        result = CliRunner().invoke(app, ["generate", "--help"])
        assert result.exit_code == 0 and "--adapter" in result.output, result.output
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
