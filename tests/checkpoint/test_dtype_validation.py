"""Dtype checks: every model tensor floating point, and of config.json's dtype unless allowed.

The case this guards: an int32 ``lm_head`` in a bfloat16 model passed ``hf-to-dcp`` and
``validate`` (keys and shapes matched), was exported as I32 and trained from, with a step-1
loss of ln(vocab).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from magistral_cli.checkpoint.keys import transformers_to_official_key
from magistral_cli.checkpoint.validate import config_dtype
from magistral_cli.cli.main import app
from magistral_cli.engine.weights import load_weights
from magistral_cli.errors import UserError
from magistral_cli.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
runner = CliRunner()
HEAD = "lm_head.weight"
ALLOW = "--allow-dtype-mismatch"


def _with_head_dtype(tiny_hf, target: Path, dtype: torch.dtype) -> Path:
    """A copy of the bf16 model directory whose lm_head is stored as ``dtype``."""
    shutil.copytree(tiny_hf.hf_dir, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    name = index["weight_map"][transformers_to_official_key(HEAD)]
    tensors = load_file(target / name)
    head = transformers_to_official_key(HEAD)
    tensors[head] = (tensors[head].float() * 100).to(dtype)
    save_file(tensors, str(target / name), metadata={"format": "pt"})
    return target


def _dcp_with_head_dtype(tiny_hf, target: Path, dtype: torch.dtype, layout: str = "fsdp2") -> Path:
    """A DCP in ``layout`` (as `magistral convert` nests it) whose lm_head is ``dtype``."""
    state = dict(tiny_hf.state)
    state[HEAD] = state[HEAD].to(dtype)
    if layout == "megatron":
        dcp.save({"model": {"model." + k: v for k, v in state.items()}}, checkpoint_id=target / "release")
    elif layout == "engine":
        dcp.save(
            {"model": {k: v.float() if v.is_floating_point() else v for k, v in state.items()}},
            checkpoint_id=target,
        )
    else:
        dcp.save(state, checkpoint_id=target)
    return target


def _hf_to_dcp(model_dir: Path, dcp_dir: Path, *extra: str):
    return runner.invoke(
        app, ["convert", "hf-to-dcp", "--model-dir", str(model_dir), "--dcp-dir", str(dcp_dir), *extra]
    )


def _validate(model_dir: Path, dcp_dir: Path, *extra: str):
    return runner.invoke(
        app, ["convert", "validate", "--model-dir", str(model_dir), "--dcp-dir", str(dcp_dir), *extra]
    )


@pytest.mark.parametrize("dtype", ["int32", "float16"])
def test_hf_to_dcp_refuses_a_head_of_another_dtype(tiny_hf, tmp_path, dtype):
    model_dir = _with_head_dtype(tiny_hf, tmp_path / "hf", getattr(torch, dtype))
    result = _hf_to_dcp(model_dir, tmp_path / "dcp")
    assert result.exit_code == 1, result.output
    assert f"{HEAD}: {dtype}, expected bfloat16" in result.output
    assert "wrong_dtypes=1" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "dcp").exists()  # refused before anything was written


def test_with_the_option_float16_converts_but_int32_never(tiny_hf, tmp_path):
    fp16 = _with_head_dtype(tiny_hf, tmp_path / "fp16", torch.float16)
    result = _hf_to_dcp(fp16, tmp_path / "dcp16", ALLOW, "--json")
    assert result.exit_code == 0, result.output
    assert _validate(fp16, tmp_path / "dcp16", ALLOW).exit_code == 0
    assert _validate(fp16, tmp_path / "dcp16").exit_code == 1  # the option is what let it pass

    int32 = _with_head_dtype(tiny_hf, tmp_path / "i32", torch.int32)
    result = _hf_to_dcp(int32, tmp_path / "dcp32", ALLOW)
    assert result.exit_code == 1, result.output
    assert f"{HEAD}: int32, expected floating point" in result.output
    assert "integer and bool tensors are never model weights" in result.output
    assert not (tmp_path / "dcp32").exists()


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
@pytest.mark.parametrize("dtype", ["int32", "float16"])
def test_validate_refuses_a_head_of_another_dtype(tiny_hf, tmp_path, layout, dtype):
    dcp_dir = _dcp_with_head_dtype(tiny_hf, tmp_path / "dcp", getattr(torch, dtype), layout)
    result = _validate(tiny_hf.hf_dir, dcp_dir, "--layout", layout, "--json")
    assert result.exit_code == 1, result.output
    prefix = {"fsdp2": "", "megatron": "model.model."}[layout]
    assert f"{prefix}{HEAD}: {dtype}, expected bfloat16" in result.output
    report = json.loads(result.stdout)
    assert report["wrong_dtype_count"] == 1 and report["missing_count"] == 0
    assert report["wrong_dtypes"] == [{"key": prefix + HEAD, "expected": "bfloat16", "actual": dtype}]

    allowed = _validate(tiny_hf.hf_dir, dcp_dir, "--layout", layout, ALLOW)
    assert allowed.exit_code == (0 if dtype == "float16" else 1), allowed.output


def test_a_matching_conversion_reports_its_dtype(tiny_hf, tmp_path):
    assert _hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp").exit_code == 0
    result = _validate(tiny_hf.hf_dir, tmp_path / "dcp", "--json")
    assert result.exit_code == 0, result.output
    assert "shapes and dtype bfloat16 match" in result.output
    assert json.loads(result.stdout)["dtype"] == "bfloat16"


def test_training_checkpoints_need_floating_point_not_the_config_dtype(tiny_hf, tmp_path):
    """Training keeps fp32 master weights: a bf16 config's checkpoint is fp32 and valid."""
    good = _dcp_with_head_dtype(tiny_hf, tmp_path / "fp32", torch.float32, "engine")
    result = _validate(tiny_hf.hf_dir, good, "--layout", "engine")
    assert result.exit_code == 0, result.output
    bad = _dcp_with_head_dtype(tiny_hf, tmp_path / "i32", torch.int32, "engine")
    result = _validate(tiny_hf.hf_dir, bad, "--layout", "engine", ALLOW)
    assert result.exit_code == 1 and f"model.{HEAD}: int32, expected floating point" in result.output


def test_dcp_to_hf_refuses_an_integer_head(tiny_hf, tmp_path):
    dcp_dir = _dcp_with_head_dtype(tiny_hf, tmp_path / "dcp", torch.int32)
    out = tmp_path / "out"
    args = ["convert", "dcp-to-hf", "--dcp-dir", str(dcp_dir), "--model-dir", str(tiny_hf.hf_dir)]
    result = runner.invoke(app, [*args, "--out-dir", str(out), ALLOW])
    assert result.exit_code == 1, result.output
    assert f"{HEAD}: int32, expected floating point" in result.output
    assert not out.exists()
    fp16 = _dcp_with_head_dtype(tiny_hf, tmp_path / "fp16", torch.float16)
    args = ["convert", "dcp-to-hf", "--dcp-dir", str(fp16), "--model-dir", str(tiny_hf.hf_dir)]
    assert runner.invoke(app, [*args, "--out-dir", str(out)]).exit_code == 1
    result = runner.invoke(app, [*args, "--out-dir", str(out), ALLOW])
    assert result.exit_code == 0, result.output


def test_the_training_weight_load_refuses_an_integer_tensor(tiny_hf, tmp_path):
    model = build_tiny_model(tiny_hf.config)
    hf_dir = _with_head_dtype(tiny_hf, tmp_path / "hf", torch.int32)
    with pytest.raises(UserError, match=rf"{HEAD} is I32 in model-0000\d-of-00002\.safetensors"):
        load_weights(model, hf_dir, "hf", strict=True)
    dcp_dir = _dcp_with_head_dtype(tiny_hf, tmp_path / "dcp", torch.int32)
    with pytest.raises(UserError, match=rf"{HEAD} is int32 in \.metadata; model weights must be floating"):
        load_weights(model, dcp_dir, "dcp", strict=True)
    # A floating head of another dtype is cast into the fp32 master weights, as before.
    fp16 = _dcp_with_head_dtype(tiny_hf, tmp_path / "fp16", torch.float16)
    assert load_weights(model, fp16, "dcp", strict=True).loaded == len(tiny_hf.state)


def test_config_dtype_reads_dtype_or_the_legacy_torch_dtype(tmp_path):
    for data, want in [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),
        ({"text_config": {"torch_dtype": "float32"}}, "float32"),
        ({"dtype": "auto"}, None),
        ({}, None),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(data))
        assert config_dtype(tmp_path) == want, data
