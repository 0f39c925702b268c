"""LoRA export: a training checkpoint holding only adapters -> PEFT adapter files, or -> merged HF weights.

A rank process loads the tiny base (official layout) with ``from_pretrained``, injects LoRA with
``engine.lora`` (r 4, alpha 8, the seven projections of the language model, ``lm_head`` trained in full),
trains 2 AdamW steps (B is no longer zero) and saves the adapters through the engine's checkpoint writer
(real DCP: ``{"model": adapters, "optimizer": ..., "lora": ...}``). The exports must then give the trained
model's logits: the adapters through ``peft.PeftModel.from_pretrained(base, dir)``, the merged weights through
``from_pretrained`` (fp32, 1e-5). With a bf16 base each merged weight is ``W + (alpha/r) B A`` computed
in fp32 and rounded once: exactly PEFT's ``merge_and_unload()`` of the fp32 model, rounded to bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from magistral_cli.runtime import spawn_ranks

pytestmark = pytest.mark.slow

VOCAB = 512
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
runner = CliRunner()


def _ids() -> torch.Tensor:
    return torch.randint(20, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _train_and_save(rank: int, base_dir: str, run_dir: str) -> dict:
    """Train the adapters on the fp32 base, save the engine checkpoint, keep the trained logits."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.config.schema import LoraConfig
    from magistral_cli.engine import checkpoint as ckpt
    from magistral_cli.engine import lora

    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    spec = LoraConfig(r=4, alpha=8, target_modules=TARGETS, modules_to_save=["lm_head"])
    applied = lora.apply_lora(model, spec)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(5)
    model.train()
    for _ in range(2):
        ids = torch.randint(20, VOCAB, (2, 24), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    state = {
        "model": lora.adapter_state_dict(model),
        "optimizer": {"state": get_optimizer_state_dict(model, optimizer)["state"]},
        "step": torch.tensor(2),
        **lora.checkpoint_entry(applied, base_dir),
    }
    path = ckpt.save_checkpoint(state, Path(run_dir) / "checkpoints", 2)
    torch.save(logits, Path(run_dir) / "logits.pt")
    b_max = max(float(p.abs().max()) for n, p in model.named_parameters() if ".lora_B." in n)
    return {"checkpoint": str(path), "b_max": b_max, "keys": sorted(state["model"])}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    root = tmp_path_factory.mktemp("lora_export")
    model = build_tiny_model(tiny_mistral3_config(vocab_size=VOCAB), seed=0)
    # The bf16 base, and the same values in fp32: W_fp32 is exactly the bf16 weight upcast.
    bf16_dir = save_official_checkpoint(model, root / "base_bf16", num_shards=2, dtype="bfloat16")
    fp32_dir = save_official_checkpoint(
        model.to(torch.bfloat16).float(), root / "base_fp32", num_shards=2, dtype="float32"
    )
    (root / "run").mkdir()
    (info,) = spawn_ranks(_train_and_save, 1, (str(fp32_dir), str(root / "run")), timeout_s=300)
    return {
        "root": root,
        "fp32": fp32_dir,
        "bf16": bf16_dir,
        "checkpoint": Path(info["checkpoint"]),
        "logits": torch.load(root / "run" / "logits.pt"),
        **info,
    }


def _base(path: Path, dtype=torch.float32):
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's shards, by transformers key."""
    from safetensors import safe_open

    from magistral_cli.checkpoint.keys import to_transformers_key

    out = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names = f.keys()
            out.update({to_transformers_key(k): f.get_tensor(k) for k in names})
    return out


def test_the_checkpoint_holds_only_the_adapters_and_lm_head(trained):
    keys = trained["keys"]
    assert trained["b_max"] > 1e-3  # trained: B is not zero
    assert "lm_head.weight" in keys
    adapters = [k for k in keys if k != "lm_head.weight"]
    assert len(adapters) == 2 * 7 * 2 and all(
        ".lora_A.default." in k or ".lora_B.default." in k for k in adapters
    )
    assert not any(".base_layer." in k for k in keys)


def test_adapters_load_with_peft_and_give_the_trained_logits(trained, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open

    from magistral_cli.checkpoint.lora_export import export_lora_adapters

    out = tmp_path / "adapters"
    result = export_lora_adapters(trained["checkpoint"], trained["fp32"], out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # readable like every other exported file (safetensors itself writes 0600), for serving from
    # shared storage by another user
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"], modes
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert result.tensors == len(keys) == 29
    assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.lm_head.weight" in keys and not any(".default." in k for k in keys)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["task_type"] == "CAUSAL_LM" and config["modules_to_save"] == ["lm_head"]
    assert len(config["target_modules"]) == 14 and config["target_modules"] == sorted(
        config["target_modules"]
    )

    peft_model = PeftModel.from_pretrained(_base(trained["fp32"]), out).eval()
    with torch.no_grad():
        logits = peft_model(input_ids=_ids()).logits
    torch.testing.assert_close(logits, trained["logits"], atol=1e-5, rtol=1e-5)

    # PEFT's own save of what it loaded writes the same keys, values and settings.
    again = tmp_path / "again"
    peft_model.save_pretrained(again)
    with (
        safe_open(str(again / "adapter_model.safetensors"), "pt") as theirs,
        safe_open(str(out / "adapter_model.safetensors"), "pt") as ours,
    ):
        assert set(theirs.keys()) == set(ours.keys())
        names = ours.keys()
        for key in names:
            assert torch.equal(theirs.get_tensor(key), ours.get_tensor(key)), key
    theirs_config = json.loads((again / "adapter_config.json").read_text())
    for key in ("target_modules", "modules_to_save"):
        theirs_config[key] = sorted(theirs_config[key])
    assert theirs_config == config


def test_merged_weights_give_the_trained_logits_in_the_bases_split(trained, tmp_path):
    from magistral_cli.checkpoint.hf import read_weight_index
    from magistral_cli.checkpoint.lora_export import export_lora_merged

    out = tmp_path / "merged"
    result = export_lora_merged(trained["checkpoint"], trained["fp32"], out)
    assert result.merged == 14 and result.replaced == 1
    base_index, out_index = read_weight_index(trained["fp32"]), read_weight_index(out)
    assert out_index == base_index  # same files, same (official) key names, same sizes
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(base_index[0].values()))
    with torch.no_grad():
        logits = _base(out)(input_ids=_ids()).logits
    torch.testing.assert_close(logits, trained["logits"], atol=1e-5, rtol=1e-5)


def test_merged_in_the_native_layout_is_the_merged_export_written_natively(trained, tmp_path):
    """--lora merged --format mistral: the same merge, through the native writer (bf16 base)."""
    import shutil

    from magistral_cli.checkpoint.dcp_to_hf import export_hf_to_native
    from magistral_cli.checkpoint.lora_export import export_lora, export_lora_merged

    base = tmp_path / "base"
    shutil.copytree(trained["bf16"], base)
    (base / "tekken.json").write_text("{}", encoding="utf-8")  # the native layout ships the base's tokenizer
    native = export_lora(trained["checkpoint"], base, tmp_path / "native", "merged", format="mistral")
    assert (native.merged, native.replaced) == (14, 1)
    export_lora_merged(trained["checkpoint"], base, tmp_path / "merged")
    export_hf_to_native(tmp_path / "merged", tmp_path / "native_of_merged")
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [
        "consolidated.safetensors",
        "params.json",
        "tekken.json",
    ]
    for path in (tmp_path / "native").iterdir():
        assert path.read_bytes() == (tmp_path / "native_of_merged" / path.name).read_bytes(), path.name


def test_bf16_merge_rounds_once_and_equals_peft_merge_and_unload(trained, tmp_path):
    from peft import PeftModel

    from magistral_cli.checkpoint.lora_export import export_lora_adapters, export_lora_merged

    adapters = tmp_path / "adapters"
    export_lora_adapters(trained["checkpoint"], trained["bf16"], adapters)
    merged_dir = tmp_path / "merged_bf16"
    export_lora_merged(trained["checkpoint"], trained["bf16"], merged_dir)
    ours = _tensors(merged_dir)
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}

    # PEFT's merge of the fp32 model (the bf16 base upcast exactly), rounded to bf16.
    reference = PeftModel.from_pretrained(_base(trained["bf16"]), adapters).merge_and_unload()
    state = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    adapted = [k for k in ours if ".self_attn." in k or ".mlp." in k]
    assert len(adapted) == 14 and set(ours) == set(state)
    for key, tensor in ours.items():
        assert torch.equal(tensor, state[key]), key
    # The merge changed the adapted weights (else the check above would prove nothing).
    base = _tensors(trained["bf16"])
    assert all(not torch.equal(ours[k], base[k]) for k in adapted)

    # PEFT on the bf16 model: its default autocast_adapter_dtype keeps the adapters fp32 and adds the
    # fp32 delta into the bf16 weight in place (one rounding): the same. Adapters held in bf16 round
    # B A before the add (two roundings) and differ.
    bf16 = PeftModel.from_pretrained(_base(trained["bf16"], torch.bfloat16), adapters).merge_and_unload()
    assert all(torch.equal(v, ours[k]) for k, v in bf16.state_dict().items() if k in adapted)
    twice = PeftModel.from_pretrained(
        _base(trained["bf16"], torch.bfloat16), adapters, autocast_adapter_dtype=False
    ).merge_and_unload()
    assert any(not torch.equal(v, ours[k]) for k, v in twice.state_dict().items() if k in adapted)


def test_convert_cli_exports_both_ways_and_refuses_a_plain_export(trained, tmp_path):
    from magistral_cli.cli.main import app

    ck = str(trained["checkpoint"])
    plain = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            ck,
            "--model-dir",
            str(trained["fp32"]),
            "--out-dir",
            str(tmp_path / "x"),
        ],
    )
    assert plain.exit_code == 2 and "--lora adapters" in plain.output and "Traceback" not in plain.output
    both = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            ck,
            "--merge",
            "--lora",
            "adapters",
            "--out-dir",
            str(tmp_path / "y"),
        ],
    )
    assert both.exit_code == 2 and "--merge means --lora merged" in both.output
    # --base defaults to the model.model_name_or_path the checkpoint records (the fp32 base here).
    adapters = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            ck,
            "--lora",
            "adapters",
            "--out-dir",
            str(tmp_path / "a"),
            "--json",
        ],
    )
    assert adapters.exit_code == 0, adapters.output
    assert json.loads(adapters.stdout)["tensors"] == 29
    merged = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            ck,
            "--merge",
            "--base",
            str(trained["bf16"]),
            "--out-dir",
            str(tmp_path / "m"),
            "--json",
        ],
    )
    assert merged.exit_code == 0, merged.output
    report = json.loads(merged.stdout)
    assert report["lora"] == "merged" and report["merged"] == 14 and "config.json" in report["copied"]
    # A full (non-LoRA) DCP is refused with --lora.
    from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp

    convert_hf_to_dcp(trained["fp32"], tmp_path / "dcp", "fsdp2", allow_dtype_mismatch=True)
    wrong = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            str(tmp_path / "dcp"),
            "--lora",
            "merged",
            "--base",
            str(trained["fp32"]),
            "--out-dir",
            str(tmp_path / "w"),
        ],
    )
    assert (
        wrong.exit_code == 2 and "holds no LoRA adapters" in wrong.output and "without --lora" in wrong.output
    )


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_lora_exports_follow_the_umask_not_the_bases_modes(trained, tmp_path, mode):
    """The base's config.json (0644 here) is copied by contents: under umask 077 the export is private."""
    import os
    import stat

    from magistral_cli.checkpoint.lora_export import export_lora

    assert stat.S_IMODE((trained["fp32"] / "config.json").stat().st_mode) & 0o044  # readable by others
    out = tmp_path / mode
    old = os.umask(0o077)
    try:
        export_lora(trained["checkpoint"], trained["fp32"], out, mode)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert set(modes.values()) == {0o600}, {k: oct(v) for k, v in modes.items()}
    if mode == "merged":
        assert {"config.json", "model.safetensors.index.json"} <= set(modes)
