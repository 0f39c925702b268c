"""HF (official layout, two shards) -> DCP in the fsdp2 and megatron layouts, read back with DCP."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from transformers import Mistral3ForConditionalGeneration

from magistral_cli.checkpoint.hf_to_dcp import MEGATRON_TRACKER, convert_hf_to_dcp
from magistral_cli.checkpoint.keys import transformers_to_official_key
from magistral_cli.checkpoint.validate import read_dcp_metadata
from magistral_cli.errors import CheckFailed, UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_fsdp2_layout_has_the_transformers_keys_at_the_root(tiny_hf, tmp_path):
    result = convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", "fsdp2")
    assert result.checkpoint_dir == tmp_path / "dcp"
    assert result.tensors == len(tiny_hf.state) == result.validated_keys
    with torch.device("meta"):
        keys = set(Mistral3ForConditionalGeneration(tiny_hf.config).state_dict())
    assert set(read_dcp_metadata(tmp_path / "dcp").state_dict_metadata) == keys
    state = {k: torch.empty_like(v) for k, v in tiny_hf.state.items()}
    dcp.load(state, checkpoint_id=tmp_path / "dcp")
    for key, value in tiny_hf.state.items():
        assert state[key].dtype == torch.bfloat16
        assert torch.equal(state[key], value), key
    # One DCP data file per source shard: the shards were streamed one at a time.
    assert sorted(p.name for p in (tmp_path / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_fsync_conversion_and_torch_save_settings_restored(tiny_hf, tmp_path):
    from torch.utils.serialization import config

    assert config.save.compute_crc32 is True
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", "megatron", fsync=True)
    assert config.save.compute_crc32 is True  # switched off only while writing
    state = {"model": {"model." + k: torch.empty_like(v) for k, v in tiny_hf.state.items()}}
    dcp.load(state, checkpoint_id=tmp_path / "dcp" / "release")
    assert all(torch.equal(state["model"]["model." + k], v) for k, v in tiny_hf.state.items())


def test_megatron_layout_loads_into_the_wrapper_keys(tiny_hf, tmp_path):
    """The seed's test: {"model": {"model." + key}} from <dcp>/release, bf16 and equal."""
    target = tmp_path / "converted"
    result = convert_hf_to_dcp(tiny_hf.hf_dir, target, "megatron")
    assert result.checkpoint_dir == target / "release"
    assert (target / MEGATRON_TRACKER).read_text().strip() == "release"
    state = {"model": {"model." + key: torch.zeros_like(value) for key, value in tiny_hf.state.items()}}
    dcp.load(state, checkpoint_id=target / "release")
    assert all(k.startswith(("model.model.", "model.lm_head.")) for k in state["model"])
    for key, value in tiny_hf.state.items():
        assert state["model"]["model." + key].dtype == torch.bfloat16
        assert torch.equal(state["model"]["model." + key], value), key
    extra = {"checkpoint_version": 0.0}
    dcp.load(extra, checkpoint_id=target / "release")
    assert extra["checkpoint_version"] == 3.0


def test_transformers_keys_in_one_file_give_the_same_dcp(tiny_hf, tmp_path):
    src = tmp_path / "hf_transformers"
    src.mkdir()
    shutil.copy(tiny_hf.hf_dir / "config.json", src)
    save_file(tiny_hf.state, src / "model.safetensors", metadata={"format": "pt"})
    convert_hf_to_dcp(src, tmp_path / "dcp", "fsdp2")
    state = {k: torch.empty_like(v) for k, v in tiny_hf.state.items()}
    dcp.load(state, checkpoint_id=tmp_path / "dcp")
    assert all(torch.equal(state[k], v) for k, v in tiny_hf.state.items())


def test_existing_target_is_refused_and_left_alone(tiny_hf, tmp_path):
    target = tmp_path / "dcp"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        convert_hf_to_dcp(tiny_hf.hf_dir, target, "fsdp2")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_a_truncated_shard_is_refused_before_writing(tiny_hf, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(tiny_hf.hf_dir, src)
    second = src / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-100])
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors is truncated"):
        convert_hf_to_dcp(src, tmp_path / "dcp", "fsdp2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_an_interruption_mid_way_leaves_nothing(tiny_hf, tmp_path, layout):
    calls = []

    def interrupt_in_second_shard(done, total):
        calls.append(done)
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", layout, progress=interrupt_in_second_shard)
    assert len(calls) > 1
    assert list(tmp_path.iterdir()) == []  # no target, no partial sibling


def test_weights_that_do_not_fit_config_are_rejected_before_writing(tiny_hf, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(tiny_hf.hf_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["vocab_size"] = 640
    config["text_config"]["num_hidden_layers"] = 3
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckFailed) as info:
        convert_hf_to_dcp(src, tmp_path / "dcp", "fsdp2")
    message = str(info.value)
    assert "missing=" in message and "model.language_model.layers.2." in message
    assert "wrong_shapes=2" in message and "embed_tokens" in message and "[640, 64]" in message
    assert not (tmp_path / "dcp").exists()


def test_unknown_layout_and_foreign_model_are_user_errors(tiny_hf, tmp_path):
    with pytest.raises(UserError, match="unknown layout"):
        convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "a", "engine")
    src = tmp_path / "llama"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"x": torch.zeros(1)}, src / "model.safetensors")
    with pytest.raises(UserError, match="Mistral3"):
        convert_hf_to_dcp(src, tmp_path / "b", "fsdp2")


def test_official_keys_map_to_transformers_keys(tiny_hf):
    index = json.loads((tiny_hf.hf_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {transformers_to_official_key(k) for k in tiny_hf.state}
