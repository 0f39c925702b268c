"""Export a checkpoint that two FSDP2 ranks saved (each tensor in two chunks), as training does."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf
from magistral_cli.checkpoint.keys import transformers_to_official_key
from magistral_cli.runtime import spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


COLUMN_SPLIT = "model.multi_modal_projector.linear_1.weight"


def _save_sharded(rank: int, config, state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from magistral_cli.testing.tiny_model import build_tiny_model

    model = build_tiny_model(config, dtype=torch.bfloat16)
    model.load_state_dict(state)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard(model)
    sd = get_model_state_dict(model)
    assert all(type(v).__name__ == "DTensor" for v in sd.values())
    # One tensor split by columns instead of rows: the export must assemble it whole.
    key = COLUMN_SPLIT
    sd[key] = distribute_tensor(sd[key].full_tensor(), sd[key].device_mesh, [Shard(1)])
    dcp.save({"model": sd, "step": 7}, checkpoint_id=path)


def test_fsdp2_sharded_checkpoint_exports_whole_tensors(tiny_hf, tmp_path, recorded):
    ckpt = tmp_path / "checkpoints" / "step_7"
    spawn_ranks(_save_sharded, 2, (tiny_hf.config, tiny_hf.state, str(ckpt)))
    recorded(ckpt, 7)
    from magistral_cli.checkpoint.validate import read_dcp_metadata

    metadata = read_dcp_metadata(ckpt)
    chunks = metadata.state_dict_metadata["model.lm_head.weight"].chunks
    assert len(chunks) == 2  # one per rank: the export must put them together
    columns = metadata.state_dict_metadata["model." + COLUMN_SPLIT].chunks
    assert sorted(c.offsets[1] for c in columns) == [0, columns[0].sizes[1]]

    result = export_dcp_to_hf(ckpt, tiny_hf.hf_dir, tmp_path / "out")
    assert result.dcp_layout == "engine"
    # Row blocks are copied file to file; the two column halves go through torch.load.
    assert result.reads == {"direct": 2 * len(tiny_hf.state) - 2, "torch_load": 2}
    reference = export_dcp_to_hf(ckpt, tiny_hf.hf_dir, tmp_path / "loaded", direct=False)
    assert reference.reads == {"direct": 0, "torch_load": 2 * len(tiny_hf.state)}
    for path in (tmp_path / "out").iterdir():
        assert path.read_bytes() == (tmp_path / "loaded" / path.name).read_bytes(), path.name
    exported = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        exported.update(load_file(path))
    assert len(exported) == len(tiny_hf.state)
    for key, value in tiny_hf.state.items():
        assert torch.equal(exported[transformers_to_official_key(key)], value), key

    # The native layout from the same row blocks (the query and key rows move; direct copies and
    # DCP's reader agree) equals the native export of the source model directory.
    import shutil

    from magistral_cli.checkpoint.dcp_to_hf import export_hf_to_native

    base = tmp_path / "base"
    shutil.copytree(tiny_hf.hf_dir, base)
    (base / "tekken.json").write_text("{}", encoding="utf-8")
    export_hf_to_native(base, tmp_path / "native_reference")
    for direct in (True, False):
        out = tmp_path / f"native_{direct}"
        export_dcp_to_hf(ckpt, base, out, format="mistral", direct=direct)
        for path in (tmp_path / "native_reference").iterdir():
            assert (out / path.name).read_bytes() == path.read_bytes(), (direct, path.name)
