"""DCP reads run no code from the checkpoint: a planted ``.metadata`` or non-tensor item is refused.

The planted files do what an attacker's would: unpickling them calls ``os.system`` or
``builtins.exec``, which creates a marker file. Each test asserts that the marker does not
exist afterwards; the control tests show that torch's own reader does create it.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from typer.testing import CliRunner

from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
from magistral_cli.checkpoint.safe_dcp import SafeFileSystemReader, read_metadata
from magistral_cli.cli.main import app
from magistral_cli.engine.weights import load_weights
from magistral_cli.errors import UserError
from magistral_cli.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
runner = CliRunner()


class _Call:
    """Unpickles as ``func(*args)``: the way a planted pickle runs code."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _system(marker: Path) -> object:
    return _Call(os.system, f"touch {marker}")


def _exec(marker: Path) -> object:
    return _Call(exec, f"open({str(marker)!r}, 'w').close()")


def _nested(marker: Path, real: Path) -> object:
    """Real metadata with the call hidden deep inside (``storage_meta.modules``)."""
    with open(real / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own conversion's file: trusted
    metadata.storage_meta.modules = ["torch", _system(marker)]
    return metadata


PAYLOADS = {
    "os.system": (_system, "posix.system"),
    "builtins.exec": (_exec, "builtins.exec"),
    "nested in real metadata": (None, "posix.system"),
}


@pytest.fixture(scope="module")
def conversions(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    """Real conversions of the tiny model in both layouts (the DCP directory of each)."""
    root = tmp_path_factory.mktemp("safe")
    convert_hf_to_dcp(tiny_hf.hf_dir, root / "fsdp2", "fsdp2")
    convert_hf_to_dcp(tiny_hf.hf_dir, root / "megatron", "megatron")
    return {"fsdp2": root / "fsdp2", "megatron": root / "megatron" / "release"}


def _plant(conversions, tmp_path: Path, payload: str) -> tuple[Path, Path]:
    """A copy of the fsdp2 conversion whose ``.metadata`` runs code; (its directory, the marker)."""
    target, marker = tmp_path / "planted", tmp_path / "pwned"
    shutil.copytree(conversions["fsdp2"], target)
    make, _ = PAYLOADS[payload]
    obj = make(marker) if make else _nested(marker, conversions["fsdp2"])
    (target / ".metadata").write_bytes(pickle.dumps(obj))
    return target, marker


def test_torchs_own_reader_runs_the_planted_file(conversions, tmp_path):
    """The control: the planted file does run code when torch reads it (the hole being closed)."""
    target, marker = _plant(conversions, tmp_path, "nested in real metadata")
    FileSystemReader(str(target)).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_convert_validate_refuses_a_planted_metadata(tiny_hf, conversions, tmp_path, payload):
    target, marker = _plant(conversions, tmp_path, payload)
    result = runner.invoke(
        app, ["convert", "validate", "--model-dir", str(tiny_hf.hf_dir), "--dcp-dir", str(target)]
    )
    assert not marker.exists()
    assert result.exit_code == 2, result.output
    assert f"{target / '.metadata'} is refused" in result.output
    assert PAYLOADS[payload][1] in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_convert_dcp_to_hf_refuses_a_planted_metadata(tiny_hf, conversions, tmp_path, payload):
    target, marker = _plant(conversions, tmp_path, payload)
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["convert", "dcp-to-hf", "--dcp-dir", str(target), "--model-dir", str(tiny_hf.hf_dir)]
        + ["--out-dir", str(out)],
    )
    assert not marker.exists()
    assert result.exit_code == 2, result.output
    assert f"{target / '.metadata'} is refused" in result.output
    assert not out.exists()


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_training_weight_load_refuses_a_planted_metadata(tiny_hf, conversions, tmp_path, payload):
    target, marker = _plant(conversions, tmp_path, payload)
    model = build_tiny_model(tiny_hf.config)
    with pytest.raises(UserError, match="is refused") as info:
        load_weights(model, target, fmt="dcp", strict=True)
    assert not marker.exists()
    assert str(target / ".metadata") in str(info.value)


def test_admitted_pieces_that_are_not_metadata_are_refused(conversions, tmp_path):
    """Only admitted globals, but not DCP metadata: a foreign root, a data file outside the directory."""
    target = tmp_path / "odd"
    shutil.copytree(conversions["fsdp2"], target)
    (target / ".metadata").write_bytes(pickle.dumps(torch.Size([1, 2])))
    with pytest.raises(UserError, match=r"is not DCP metadata: it holds a Size"):
        read_metadata(target)
    with open(conversions["fsdp2"] / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match="outside the checkpoint directory"):
        read_metadata(target)
    (target / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(UserError, match="is not readable DCP metadata"):
        read_metadata(target)


def test_a_non_tensor_item_that_runs_code_is_refused(tmp_path):
    """A valid ``.metadata`` can declare any key a non-tensor entry; DCP's planner unpickles such
    items with ``weights_only=False``. The safe reader hands it only what ``weights_only`` admits."""
    marker = tmp_path / "pwned"
    dcp.save({"step": _system(marker)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert not marker.exists()
    read_metadata(tmp_path / "dcp")  # the metadata itself is DCP's own: it is admitted
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            {"step": torch.zeros(())}, storage_reader=SafeFileSystemReader(tmp_path / "dcp"), no_dist=True
        )
    assert not marker.exists()
    failures = [failure for failure, _ in info.value.failures.values()]
    assert isinstance(failures[0], UserError), failures
    assert "__0_0.distcp holds a non-tensor entry 'step'" in str(failures[0])
    # The control: torch's own reader runs it.
    dcp.load({"step": torch.zeros(())}, storage_reader=FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert marker.exists()


def test_plain_non_tensor_items_still_load(tmp_path):
    """Behaviour kept: DCP's own non-tensor entries (numbers, strings) load as before."""
    saved = {"step": 3, "version": 3.0, "meta": {"name": "tiny"}, "weight": torch.arange(4.0)}
    dcp.save(saved, checkpoint_id=tmp_path / "dcp", no_dist=True)
    loaded = {"step": 0, "version": 0.0, "meta": {"name": ""}, "weight": torch.zeros(4)}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert loaded["step"] == 3 and loaded["version"] == 3.0 and loaded["meta"] == {"name": "tiny"}
    assert torch.equal(loaded["weight"], saved["weight"])


def test_a_non_tensor_model_entry_is_refused_by_the_weight_load(tiny_hf, tmp_path):
    """A model key declared a non-tensor entry is refused before DCP reads anything."""
    marker = tmp_path / "pwned"
    state = dict(tiny_hf.state)
    state["lm_head.weight"] = _system(marker)
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with pytest.raises(UserError, match=r"lm_head\.weight is a non-tensor entry"):
        load_weights(build_tiny_model(tiny_hf.config), tmp_path / "dcp", fmt="dcp", strict=True)
    assert not marker.exists()


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_real_conversions_read_through_the_safe_reader(tiny_hf, conversions, layout):
    metadata = read_metadata(conversions[layout])
    assert metadata.storage_meta.load_id  # FileSystemReader's bookkeeping is kept
    dcp_dir = conversions[layout].parent if layout == "megatron" else conversions[layout]
    result = runner.invoke(
        app,
        ["convert", "validate", "--model-dir", str(tiny_hf.hf_dir), "--dcp-dir", str(dcp_dir)]
        + ["--layout", layout],
    )
    assert result.exit_code == 0 and "PASS" in result.output, result.output


def test_a_real_conversion_loads_into_the_model(tiny_hf, conversions):
    model = build_tiny_model(tiny_hf.config)
    report = load_weights(model, conversions["fsdp2"], "dcp", True)
    assert report.loaded == len(tiny_hf.state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, tiny_hf.state[key].float()), key


def _training_recipe(model_dir: Path, run_dir: Path):
    from magistral_cli.config.loader import apply_overrides, validate_recipe

    data = {
        "parallel": {"device": "cpu", "fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {"dataset_param": {"dataset_type": "synthetic", "basic_parameters": {"cutoff_len": 32}}},
        "model": {"model_name_or_path": str(model_dir)},
        "training": {
            "micro_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "train_iters": 1,
            "lr": 1.0e-3,
            "lr_warmup_ratio": 0.0,
            "load": str(model_dir),
            "output_dir": str(run_dir),
            "save_interval": 1,
            "save": "checkpoints",
            "resume": "never",
            "seed": 7,
        },
    }
    return validate_recipe(apply_overrides(data, []))


@pytest.mark.slow
def test_a_training_checkpoint_loads_through_the_safe_reader(tmp_path):
    """A checkpoint the trainer wrote (optimizer state, packed RNG and data loader state, step)."""
    from magistral_cli.engine.trainer import Trainer
    from magistral_cli.testing.tiny_model import save_official_checkpoint, tiny_mistral3_config

    config = tiny_mistral3_config(vocab_size=512)
    model_dir = save_official_checkpoint(build_tiny_model(config), tmp_path / "model", dtype="float32")
    trainer = Trainer(_training_recipe(model_dir, tmp_path / "run"))
    try:
        trainer.train()
        trained = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in trainer.model.state_dict().items()
        }
    finally:
        trainer.close()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"
    keys = set(read_metadata(checkpoint).state_dict_metadata)
    assert {"step", "rng.rank_0", "dataloader.dp_rank_0"} <= keys
    assert any(k.startswith("optimizer.") for k in keys)
    result = runner.invoke(
        app,
        ["convert", "validate", "--model-dir", str(model_dir), "--dcp-dir", str(checkpoint)]
        + ["--layout", "engine"],
    )
    assert result.exit_code == 0 and "PASS" in result.output, result.output
    model = build_tiny_model(config)
    load_weights(model, checkpoint, "dcp", True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key
