"""`magistral quickstart` end to end (short): assets, convert, preprocess, train, resume, export, native,
LoRA, compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.quickstart import (
    NATIVE_LOGIT_TOLERANCE,
    QUICKSTART_IMAGE_SIZES,
    QUICKSTART_REASONING_EVERY,
    QuickstartContext,
    QuickstartOptions,
    step_assets,
    step_preprocess,
)
from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset, write_tiny_tokenizer_files


def _steps(run_dir: Path, split: str = "train") -> list[int]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [x["step"] for x in lines if x.get("split", "train") == split]


@pytest.mark.slow
@pytest.mark.compat  # CI's lowest-versions leg runs the quickstart through this test
def test_quickstart_runs_the_whole_workflow(tmp_path, push_hub):
    result = CliRunner().invoke(
        app, ["quickstart", "--workdir", str(tmp_path), "--steps", "4", "--no-probes", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    names = [step["name"] for step in summary["steps"]]
    assert names == [
        "assets",
        "convert",
        "preprocess",
        "train",
        "resume",
        "optimized",
        "export",
        "native",
        "lora",
        "compare",
    ]
    assert summary["pass"] is True
    by_name = {step["name"]: step for step in summary["steps"]}
    assert by_name["compare"]["verdict"] == "PASS"
    assert by_name["compare"]["normalized_mean_abs_diff"] < 0.02
    assert by_name["preprocess"]["kept"] > 0 and by_name["preprocess"]["cache_reused"] is False
    # Every fourth of the 64 rows has a reasoning_content; the step checked one sample's [THINK] ids.
    assert by_name["preprocess"]["reasoning_samples"] == 64 // QUICKSTART_REASONING_EVERY
    train = Path(summary["runs"]["train"])
    assert (train / "checkpoints" / "latest").read_text().strip().endswith("step_4")
    resumed = _steps(Path(summary["runs"]["resumed"]))
    assert resumed == [3, 4]
    # The validation split (8 samples) is evaluated half-way and at the end, in its own records.
    assert _steps(train, split="val") == [2, 4]
    assert _steps(train) == [1, 2, 3, 4]
    assert by_name["compare"]["validation_steps"] == [2, 4]
    assert Path(by_name["compare"]["plot"]).stat().st_size > 0
    assert (Path(summary["export"]) / "model.safetensors.index.json").is_file()
    native = by_name["native"]
    assert native["files"] == ["consolidated.safetensors", "params.json", "tekken.json"]
    assert sorted(p.name for p in Path(summary["native"]).iterdir()) == native["files"]
    assert 0 <= native["max_logit_diff"] <= NATIVE_LOGIT_TOLERANCE
    lora = by_name["lora"]
    assert (Path(lora["adapters"]) / "adapter_model.safetensors").is_file()
    assert (Path(lora["adapters"]) / "adapter_config.json").is_file()
    assert (Path(lora["merged"]) / "model.safetensors.index.json").is_file()
    assert _steps(Path(lora["resumed"])) == [3, 4]
    assert lora["max_logit_diff"] < 0.05  # the merged weights are rounded to the base's bf16

    # The trained run and the LoRA run published to the local Hub: the cards read the real run records.
    cards = {}
    for repo, args in (
        ("me/tiny-ft", ["--dcp-dir", str(train / "checkpoints"), "--model-dir", str(tmp_path / "model")]),
        ("me/tiny-lora", ["--dcp-dir", str(Path(lora["run"]) / "checkpoints"), "--lora", "adapters"]),
    ):
        out = tmp_path / repo.split("/")[1]
        pushed = CliRunner().invoke(
            app, ["convert", "dcp-to-hf", *args, "--out-dir", str(out), "--push-to-hub", repo]
        )
        assert pushed.exit_code == 0, pushed.output
        arrived = push_hub.root / repo / "main"
        assert {p.name: p.read_bytes() for p in arrived.iterdir()} == {
            p.name: p.read_bytes() for p in out.iterdir()
        }
        cards[repo] = card = (arrived / "README.md").read_text()
        assert "exported from step 4 of a fine-tuning run" in card and "| training loss |" in card
        assert "dataset SHA-256" in card and "train_iters: 4" in card
    assert "| validation loss |" in cards["me/tiny-ft"]  # the 8-sample split, evaluated at step 4
    assert (
        cards["me/tiny-lora"].startswith("---\nlibrary_name: peft\n")
        and "| LoRA r / alpha |" in cards["me/tiny-lora"]
    )

    # A second quickstart in the same workdir reuses the model, the data and the preprocessing cache.
    # Its first steps are what decides that, so they run alone (the rest is the run above again).
    # The workdir is made to look like one of a quickstart from before reasoning traces (a v7
    # tokenizer, no reasoning_content): the assets step writes both again, as the first run had them.
    model_index = tmp_path / "model" / "model.safetensors.index.json"
    before = model_index.stat().st_mtime_ns
    tekken = (tmp_path / "model" / "tekken.json").read_bytes()
    write_tiny_tokenizer_files(tmp_path / "model", version="v7")
    write_synthetic_llava_dataset(tmp_path / "data", 64, seed=0, image_sizes=QUICKSTART_IMAGE_SIZES)
    ctx = QuickstartContext(
        options=QuickstartOptions(workdir=tmp_path, steps=2, probes=False),
        console=Console(quiet=True),
        workdir=tmp_path,
        out=tmp_path / "second",
    )
    assert step_assets(ctx).name == "assets"
    assert model_index.stat().st_mtime_ns == before
    assert (tmp_path / "model" / "tekken.json").read_bytes() == tekken
    again = step_preprocess(ctx)
    assert again.data["cache_reused"] is True and again.data["kept"] == by_name["preprocess"]["kept"]
    assert again.data["reasoning_samples"] == by_name["preprocess"]["reasoning_samples"]
