"""DCP -> HF export: bit-exact round trips, from_pretrained, training checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import Mistral3ForConditionalGeneration

from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf
from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
from magistral_cli.checkpoint.keys import transformers_to_official_key
from magistral_cli.errors import CheckFailed, UserError
from magistral_cli.testing.tiny_model import IMAGE_TOKEN_ID, build_tiny_model

pytestmark = [pytest.mark.compat, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for key, value in load_file(path).items():
            out[key] = (path.name, value)
    return out


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_hf_dcp_hf_round_trip_is_bit_exact(tiny_hf, tmp_path, layout):
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", layout)
    result = export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "out")
    assert result.dcp_layout == layout and result.layout == "official"
    source, exported = _tensors(tiny_hf.hf_dir), _tensors(tmp_path / "out")
    assert exported.keys() == source.keys()
    for key, (file, value) in source.items():
        out_file, out_value = exported[key]
        assert out_file == file, key  # same file split
        assert out_value.dtype == value.dtype and out_value.shape == value.shape, key
        assert torch.equal(out_value.view(torch.uint8), value.view(torch.uint8)), key  # same bytes
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index == json.loads((tiny_hf.hf_dir / "model.safetensors.index.json").read_text())
    assert (tmp_path / "out" / "config.json").read_bytes() == (tiny_hf.hf_dir / "config.json").read_bytes()
    # The streaming writer lays files out as safetensors does: the shards come back byte for byte.
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (tmp_path / "out" / name).read_bytes() == (tiny_hf.hf_dir / name).read_bytes()


def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tiny_hf, tmp_path):
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", "megatron")
    export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "out", layout="transformers")
    keys = set(_tensors(tmp_path / "out"))
    assert keys == set(tiny_hf.state)  # transformers keys

    reference = build_tiny_model(tiny_hf.config)
    reference.load_state_dict({k: v.float() for k, v in tiny_hf.state.items()})
    loaded = Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()

    # A 56x56 image is 2x2 image tokens (patch 14, spatial merge 2): the vision tower runs too.
    ids = torch.tensor([[1, 5, *[IMAGE_TOKEN_ID] * 4, 7, 300, 42, 9]])
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "pixel_values": pixels, "image_sizes": torch.tensor([[56, 56]])}
    with torch.no_grad():
        expected = reference(**inputs).logits
        actual = loaded(**inputs).logits
    assert torch.equal(actual, expected)


def test_engine_training_checkpoint_exports_model_weights_only(tiny_hf, tmp_path, recorded):
    """A checkpoint as the engine writes it: {"model", "optimizer", "scheduler", "rng", "dataloader", "step"}."""
    trained = {k: (v.float() + 0.5).to(torch.bfloat16) for k, v in tiny_hf.state.items()}
    run = tmp_path / "run" / "checkpoints"
    state = {
        "model": trained,
        "optimizer": {"state": {k: {"exp_avg": torch.ones(v.shape)} for k, v in list(trained.items())[:3]}},
        "scheduler": {"last_epoch": 3},
        "rng": {"torch": torch.get_rng_state()},
        "dataloader": {"consumed": 12},
        "step": 3,
    }
    dcp.save(state, checkpoint_id=run / "step_3")
    recorded(run / "step_3", 3)
    (run / "latest").write_text("step_3\n")
    result = export_dcp_to_hf(run, tiny_hf.hf_dir, tmp_path / "out")  # through checkpoints/latest
    assert result.dcp_layout == "engine" and result.checkpoint_dir == run / "step_3"
    exported = _tensors(tmp_path / "out")
    assert set(exported) == {transformers_to_official_key(k) for k in trained}
    for key, value in trained.items():
        assert torch.equal(exported[transformers_to_official_key(key)][1], value), key


def test_existing_output_is_refused(tiny_hf, tmp_path):
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", "fsdp2")
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="already exists"):
        export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_interruption_leaves_nothing(tiny_hf, tmp_path):
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", "fsdp2")

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # not wrapped into DCP's CheckpointException
        export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "out", progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


def test_checkpoint_of_another_model_is_rejected(tiny_hf, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_hf.hf_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(config))
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", "fsdp2")
    with pytest.raises(CheckFailed, match="wrong_shapes=6"):
        export_dcp_to_hf(tmp_path / "dcp", other, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_without_source_weights_the_export_is_split_by_size(tiny_hf, tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    shutil.copy(tiny_hf.hf_dir / "config.json", assets)
    (assets / "tokenizer_config.json").write_text("{}")
    (assets / "magistral-manifest.json").write_text("{}")
    dcp.save(dict(tiny_hf.state), checkpoint_id=tmp_path / "dcp")
    result = export_dcp_to_hf(tmp_path / "dcp", assets, tmp_path / "out", layout="transformers")
    assert result.files == ["model.safetensors"]
    assert sorted(result.copied) == ["config.json", "tokenizer_config.json"]
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert loaded.keys() == tiny_hf.state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tiny_hf.state.items())


def _file_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_direct_copy_writes_the_same_bytes_as_dcps_reader(tiny_hf, tmp_path, layout):
    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", layout)
    direct = export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "direct")
    loaded = export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "loaded", direct=False)
    n = direct.tensors
    assert direct.reads == {"direct": n, "torch_load": 0}  # every item of a conversion goes direct
    assert loaded.reads == {"direct": 0, "torch_load": n}
    assert _file_bytes(tmp_path / "direct") == _file_bytes(tmp_path / "loaded")


def test_direct_copy_without_copy_file_range(tiny_hf, tmp_path, monkeypatch):
    from magistral_cli.checkpoint import safetensors_io

    convert_hf_to_dcp(tiny_hf.hf_dir, tmp_path / "dcp", "fsdp2")
    monkeypatch.setattr(safetensors_io, "_copy_file_range_works", False)  # the pread/pwrite loop
    result = export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "out")
    assert result.reads["direct"] == result.tensors
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (tmp_path / "out" / name).read_bytes() == (tiny_hf.hf_dir / name).read_bytes()


def test_items_the_direct_copy_cannot_place_go_through_torch_load(tiny_hf, tmp_path):
    """A non-contiguous tensor (DCP saves its strides) and one of another dtype than the model's
    (the checkpoint metadata's dtype is what counts) are read by DCP's reader, in order with the rest."""
    state = dict(tiny_hf.state)
    strided = "model.multi_modal_projector.linear_1.weight"
    state[strided] = state[strided].t().contiguous().t()  # same values, column-major
    assert not state[strided].is_contiguous()
    dcp.save(state, checkpoint_id=tmp_path / "dcp")
    result = export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "out")
    assert result.reads == {"direct": result.tensors - 1, "torch_load": 1}
    exported = _tensors(tmp_path / "out")
    for key, value in tiny_hf.state.items():
        assert torch.equal(exported[transformers_to_official_key(key)][1], value), key
    reference = export_dcp_to_hf(tmp_path / "dcp", tiny_hf.hf_dir, tmp_path / "loaded", direct=False)
    assert reference.reads["direct"] == 0
    assert _file_bytes(tmp_path / "out") == _file_bytes(tmp_path / "loaded")


def test_locate_rows_finds_the_bytes_of_a_row_block(tmp_path):
    import io
    import os

    from magistral_cli.checkpoint.dcp_to_hf import locate_rows

    base = torch.arange(8 * 6, dtype=torch.int16).view(8, 6).to(torch.bfloat16)
    view = base[2:]  # a view: torch.save stores the whole storage and a storage offset
    items = []
    path = tmp_path / "items.bin"
    with path.open("wb") as f:
        f.write(b"x" * 100)  # items start anywhere in a .distcp file
        for t in (base, view):
            buf = io.BytesIO()
            torch.save(t, buf)
            items.append((f.tell(), len(buf.getvalue()), t))
            f.write(buf.getvalue())
    data = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, length, t in items:
            offset, nbytes = locate_rows(fd, start, length, torch.bfloat16, (3, 0), (2, 6))
            expected = t[3:5].contiguous().view(torch.uint8).numpy().tobytes()
            assert data[offset : offset + nbytes] == expected
            whole = locate_rows(fd, start, length, torch.bfloat16, (0, 0), tuple(t.shape))
            assert data[whole[0] : whole[0] + whole[1]] == t.contiguous().view(torch.uint8).numpy().tobytes()
            # Not placeable: a split of the columns, another dtype, rows past the end.
            assert locate_rows(fd, start, length, torch.bfloat16, (0, 3), (2, 3)) is None
            assert locate_rows(fd, start, length, torch.float16, (0, 0), tuple(t.shape)) is None
            assert locate_rows(fd, start, length, torch.bfloat16, (t.shape[0] - 1, 0), (2, 6)) is None
        # Bytes that are not a torch.save archive.
        assert locate_rows(fd, 0, 100, torch.bfloat16, (0, 0), (2, 6)) is None
        # With a cache of loaded geometries: the same places, one torch.load per distinct pickle
        # (the whole tensor and the view pickle differently: a storage offset).
        loaded: dict = {}
        for _repeat in range(2):
            for start, length, _ in items:
                args = (fd, start, length, torch.bfloat16, (3, 0), (2, 6))
                assert locate_rows(*args, loaded) == locate_rows(*args)
        assert len(loaded) == 2
    finally:
        os.close(fd)
