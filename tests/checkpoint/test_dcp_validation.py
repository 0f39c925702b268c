"""Key and shape validation of DCP checkpoints against a meta model built from config.json."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
from magistral_cli.checkpoint.validate import model_keys, require_valid, validate_dcp
from magistral_cli.errors import CheckFailed, UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_generic_conversion_rejected_by_megatron_validation(tiny_hf, tmp_path):
    target = tmp_path / "wrong_namespace"
    convert_hf_to_dcp(tiny_hf.hf_dir, target, "fsdp2")
    assert validate_dcp(tiny_hf.hf_dir, target, "fsdp2").ok
    validation = validate_dcp(tiny_hf.hf_dir, target, "megatron")
    assert not validation.ok
    assert validation.report.to_dict()["missing_count"] == len(tiny_hf.state)
    assert validation.matching_layout == "fsdp2"
    with pytest.raises(CheckFailed, match="model keys do not match") as info:
        require_valid(validation)
    assert "unexpected=" in str(info.value) and "layout megatron" in str(info.value)


def test_megatron_conversion_rejected_by_fsdp2_validation(tiny_hf, tmp_path):
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "m", "megatron")
    validation = validate_dcp(tiny_hf.hf_dir, tmp_path / "m", "fsdp2")
    assert not validation.ok and validation.matching_layout == "megatron"
    with pytest.raises(CheckFailed, match="These keys are those of the megatron layout"):
        require_valid(validation)


def test_wrong_tensor_shapes_rejected(tiny_hf, tmp_path):
    """The seed's test: a megatron-layout DCP whose tensors were cut to one row."""
    target = tmp_path / "wrong_shapes" / "release"
    state = {"model": {"model." + key: value[:1] for key, value in tiny_hf.state.items()}}
    dcp.save(state, checkpoint_id=target)
    validation = validate_dcp(tiny_hf.hf_dir, target.parent, "megatron")
    report = validation.report.to_dict()
    assert report["missing_count"] == 0 and report["unexpected_count"] == 0
    multi_row = [k for k, v in tiny_hf.state.items() if v.dim() and v.shape[0] > 1]
    assert report["wrong_shape_count"] == len(multi_row)
    assert len(report["wrong_shapes"]) == 5  # the first five are listed
    with pytest.raises(CheckFailed, match="wrong_shapes="):
        require_valid(validation)


def test_engine_checkpoint_validates_as_engine_only(tiny_hf, tmp_path, recorded):
    ckpt = tmp_path / "step_3"
    dcp.save({"model": dict(tiny_hf.state), "step": 3}, checkpoint_id=ckpt)
    recorded(ckpt, 3)
    assert validate_dcp(tiny_hf.hf_dir, ckpt, "engine").ok
    assert not validate_dcp(tiny_hf.hf_dir, ckpt, "fsdp2").ok
    assert not validate_dcp(tiny_hf.hf_dir, ckpt, "megatron").ok


def test_missing_checkpoint_is_a_user_error(tiny_hf, tmp_path):
    with pytest.raises(UserError, match="no release/"):
        validate_dcp(tiny_hf.hf_dir, tmp_path, "megatron")
    with pytest.raises(UserError, match="no DCP checkpoint"):
        validate_dcp(tiny_hf.hf_dir, tmp_path, "fsdp2")


def test_tied_embeddings_may_be_left_out(tiny_hf, tmp_path):
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    config = tiny_mistral3_config(vocab_size=64)
    config.text_config.tie_word_embeddings = True
    config.tie_word_embeddings = True
    config.save_pretrained(tmp_path)
    keys = model_keys(tmp_path)
    assert keys.aliases == {"lm_head.weight"}
    assert "lm_head.weight" not in keys.required and torch.Size(keys.shapes["lm_head.weight"]) == (64, 64)
