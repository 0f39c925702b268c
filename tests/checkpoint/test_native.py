"""Mistral's native layout (consolidated.safetensors + params.json + tekken.json): export and import.

The mapping is checked here against a table of this file's own (the inverse of transformers' Mistral3
conversion, written out again, not the exporter's code), and the rotary rows of the query and key
weights against the conversion's permutation recomputed here; then by the logits of a model loaded
from the native files through our import against the HF export loaded by ``from_pretrained``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from typer.testing import CliRunner

from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf, export_hf_to_native
from magistral_cli.checkpoint.hf import NATIVE_INDEX, TEKKEN
from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
from magistral_cli.checkpoint.keys import to_transformers_key
from magistral_cli.checkpoint.native import from_native_rows, to_native_rows, write_rows
from magistral_cli.checkpoint.safetensors_io import (
    SafetensorsStreamWriter,
    TensorSpec,
    read_safetensors_header,
)
from magistral_cli.cli.main import app
from magistral_cli.errors import UserError
from magistral_cli.model_config import config_from_params, params_from_config, read_model_config
from magistral_cli.testing.tiny_model import IMAGE_TOKEN_ID, build_tiny_model, tiny_mistral3_config

FIXTURE = Path(__file__).parents[1] / "fixtures" / "magistral-small-2509"
runner = CliRunner()

# native name -> transformers name, this test's own table (transformers' convert_mistral3_weights_to_hf.py
# maps native -> official names; the official prefix "language_model.model." is transformers'
# "model.language_model." and so on).
REFERENCE = [
    (r"^tok_embeddings\.weight$", "model.language_model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.language_model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (
        r"^layers\.(\d+)\.attention\.w([qkvo])\.weight$",
        r"model.language_model.layers.\1.self_attn.\2_proj.weight",
    ),
    (r"^layers\.(\d+)\.attention_norm\.weight$", r"model.language_model.layers.\1.input_layernorm.weight"),
    (r"^layers\.(\d+)\.ffn_norm\.weight$", r"model.language_model.layers.\1.post_attention_layernorm.weight"),
    (r"^layers\.(\d+)\.feed_forward\.w1\.weight$", r"model.language_model.layers.\1.mlp.gate_proj.weight"),
    (r"^layers\.(\d+)\.feed_forward\.w2\.weight$", r"model.language_model.layers.\1.mlp.down_proj.weight"),
    (r"^layers\.(\d+)\.feed_forward\.w3\.weight$", r"model.language_model.layers.\1.mlp.up_proj.weight"),
    (r"^vision_encoder\.ln_pre\.weight$", "model.vision_tower.ln_pre.weight"),
    (r"^vision_encoder\.patch_conv\.weight$", "model.vision_tower.patch_conv.weight"),
    (
        r"^vision_encoder\.transformer\.layers\.(\d+)\.attention\.w([qkvo])\.weight$",
        r"model.vision_tower.transformer.layers.\1.attention.\2_proj.weight",
    ),
    (
        r"^vision_encoder\.transformer\.layers\.(\d+)\.(attention_norm|ffn_norm)\.weight$",
        r"model.vision_tower.transformer.layers.\1.\2.weight",
    ),
    (
        r"^vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w1\.weight$",
        r"model.vision_tower.transformer.layers.\1.feed_forward.gate_proj.weight",
    ),
    (
        r"^vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w2\.weight$",
        r"model.vision_tower.transformer.layers.\1.feed_forward.down_proj.weight",
    ),
    (
        r"^vision_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w3\.weight$",
        r"model.vision_tower.transformer.layers.\1.feed_forward.up_proj.weight",
    ),
    (r"^vision_language_adapter\.w_in\.weight$", "model.multi_modal_projector.linear_1.weight"),
    (r"^vision_language_adapter\.w_out\.weight$", "model.multi_modal_projector.linear_2.weight"),
    (
        r"^patch_merger\.merging_layer\.weight$",
        "model.multi_modal_projector.patch_merger.merging_layer.weight",
    ),
    (r"^pre_mm_projector_norm\.weight$", "model.multi_modal_projector.norm.weight"),
]


def fields(config) -> dict:
    """A config's fields, less those params.json does not carry (the dtype, the path, the class name)."""
    data = config.to_dict()
    for name in ("dtype", "_name_or_path", "architectures"):
        data.pop(name, None)
    return data


def reference_name(native: str) -> str:
    for pattern, replacement in REFERENCE:
        name, n = re.subn(pattern, replacement, native)
        if n:
            return name
    raise AssertionError(f"{native} is not a native name")


def reference_from_native(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' conversion of a native query/key weight: per head, rows (pair, 2) -> (2, pair)."""
    rows, cols = tensor.shape
    return tensor.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def read_dir(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = f.keys()
            out.update({k: f.get_tensor(k) for k in names})
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny untied Mistral3 in the official layout, with a tekken.json (any bytes: it is copied)."""
    from magistral_cli.testing.tiny_model import save_official_checkpoint

    root = tmp_path_factory.mktemp("native")
    model = build_tiny_model(tiny_mistral3_config(vocab_size=512))
    hf_dir = save_official_checkpoint(model, root / "hf", num_shards=2)
    (hf_dir / TEKKEN).write_text(json.dumps({"config": {"version": "v13"}}), encoding="utf-8")
    native = export_hf_to_native(hf_dir, root / "native")
    return {"root": root, "hf": hf_dir, "native": root / "native", "result": native, "config": model.config}


def test_every_tensor_maps_by_an_independent_table_and_qk_rows_are_in_rotary_order(base):
    config = base["config"]
    source = {to_transformers_key(k): v for k, v in read_dir(base["hf"]).items()}
    native = read_dir(base["native"])
    assert sorted(p.name for p in base["native"].iterdir()) == [
        "consolidated.safetensors",
        "params.json",
        TEKKEN,
    ]
    assert "output.weight" in native  # the untied head is written
    assert sorted(reference_name(k) for k in native) == sorted(source)
    rotary = 0
    for name, tensor in native.items():
        key = reference_name(name)
        heads = None
        if re.search(r"\.w[qk]\.weight$", name):
            vision = name.startswith("vision_encoder.")
            heads = (
                config.vision_config.num_attention_heads
                if vision
                else config.text_config.num_attention_heads
                if ".wq." in name
                else config.text_config.num_key_value_heads
            )
        expected = source[key]
        if heads is not None:
            rotary += 1
            assert not torch.equal(tensor, expected), name  # the rows did move
            tensor = reference_from_native(tensor, heads)
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
    assert rotary == 2 * (config.text_config.num_hidden_layers + config.vision_config.num_hidden_layers)
    assert base["native"].joinpath(TEKKEN).read_bytes() == base["hf"].joinpath(TEKKEN).read_bytes()


def test_hf_to_native_to_hf_is_bit_exact(base, tmp_path):
    """The native directory alone (no config.json: params.json describes the model) converts back."""
    convert_hf_to_dcp(base["native"], tmp_path / "dcp")
    export_dcp_to_hf(tmp_path / "dcp", base["hf"], tmp_path / "hf")
    for path in base["hf"].glob("*.safetensors"):
        assert (tmp_path / "hf" / path.name).read_bytes() == path.read_bytes(), path.name
    # with only the native directory as the base, the HF export gets a config.json from params.json
    from transformers import Mistral3ForConditionalGeneration

    export_dcp_to_hf(tmp_path / "dcp", base["native"], tmp_path / "hf_from_native")
    loaded = Mistral3ForConditionalGeneration.from_pretrained(
        tmp_path / "hf_from_native", dtype=torch.bfloat16
    )
    source = {to_transformers_key(k): v for k, v in read_dir(base["hf"]).items()}
    assert loaded.state_dict().keys() == source.keys()
    assert all(torch.equal(v, source[k]) for k, v in loaded.state_dict().items())
    # and a DCP exported natively writes the same bytes as the export from the HF directory
    export_dcp_to_hf(tmp_path / "dcp", base["hf"], tmp_path / "native", format="mistral")
    for path in base["native"].iterdir():
        assert (tmp_path / "native" / path.name).read_bytes() == path.read_bytes(), path.name


def test_trained_checkpoint_native_export_loads_to_the_hf_exports_logits(base, tmp_path, recorded):
    """An engine checkpoint (fp32) exported both ways; the native files go through training.load."""
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.engine.weights import load_weights

    g = torch.Generator().manual_seed(7)
    trained = {
        k: v.float() + 0.01 * torch.randn(v.shape, generator=g)
        for k, v in build_tiny_model(base["config"]).state_dict().items()
    }
    run = tmp_path / "run" / "checkpoints"
    dcp.save({"model": trained, "step": 2}, checkpoint_id=run / "step_2")
    recorded(run / "step_2", 2)
    export_dcp_to_hf(run / "step_2", base["hf"], tmp_path / "hf")
    export_dcp_to_hf(run / "step_2", base["hf"], tmp_path / "native", format="mistral")
    assert read_safetensors_header(tmp_path / "native" / "consolidated.safetensors")[0][0].dtype == "F32"

    reference = Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    imported = build_tiny_model(base["config"], seed=1)  # other values: all must be replaced
    report = load_weights(imported, tmp_path / "native", "auto", strict=True)
    assert report.fmt == "mistral" and report.loaded == len(trained)
    ids = torch.tensor([[1, 5, *[IMAGE_TOKEN_ID] * 4, 7, 300, 42, 9]])
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "pixel_values": pixels, "image_sizes": torch.tensor([[56, 56]])}
    with torch.no_grad():
        expected, actual = reference(**inputs).logits, imported(**inputs).logits
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


def test_a_block_of_rows_that_splits_heads_is_written_in_rotary_order(tmp_path):
    """FSDP2 saves row blocks of any size: a block that cuts a head goes row by row."""
    weight = torch.arange(12 * 3, dtype=torch.float32).view(12, 3)  # 3 heads of 4 rows
    writer = SafetensorsStreamWriter(tmp_path / "w.safetensors", [TensorSpec("wq", "F32", (12, 3))])
    for start in (0, 5, 7):  # blocks of 5, 2 and 5 rows
        stop = {0: 5, 5: 7, 7: 12}[start]
        write_rows(writer, "wq", weight[start:stop], start, 4)
    writer.close()
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        written = f.get_tensor("wq")
    assert torch.equal(written, to_native_rows(weight, 4))
    assert torch.equal(reference_from_native(written, 3), weight)


@pytest.mark.parametrize(
    ("rows", "heads"),
    [(32 * 128, 32), (8 * 128, 8), (16 * 64, 16)],  # Magistral's q, k (decoder) and the vision tower's q/k
    ids=["text-q", "text-k", "vision-qk"],
)
def test_full_width_query_and_key_rows_round_trip(rows, heads):
    """At Magistral's own widths (columns cut to 8: the permutation is of rows), against the conversion's."""
    weight = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    native = to_native_rows(weight, rows // heads)
    assert torch.equal(reference_from_native(native, heads), weight)
    assert torch.equal(from_native_rows(native, rows // heads), weight)


def test_sharded_export_has_an_index(base, tmp_path, monkeypatch):
    from magistral_cli.checkpoint import dcp_to_hf

    monkeypatch.setattr(dcp_to_hf, "DEFAULT_MAX_SHARD_BYTES", 100_000)
    result = export_hf_to_native(base["hf"], tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").glob("consolidated*.safetensors"))
    assert len(files) > 1 and files == sorted(result.files)
    assert all(re.fullmatch(r"consolidated-\d{5}-of-\d{5}\.safetensors", f) for f in files)
    index = json.loads((tmp_path / "out" / NATIVE_INDEX).read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == result.bytes
    assert read_dir(tmp_path / "out").keys() == read_dir(base["native"]).keys()
    convert_hf_to_dcp(tmp_path / "out", tmp_path / "dcp")  # the sharded layout reads back too
    export_dcp_to_hf(tmp_path / "dcp", base["hf"], tmp_path / "hf")
    for path in base["hf"].glob("*.safetensors"):
        assert (tmp_path / "hf" / path.name).read_bytes() == path.read_bytes(), path.name


# Every key vLLM's mistral config parser and its native Pixtral model read from params.json, with where:
# vllm/transformers_utils/configs/mistral.py (_remap_general_mistral_args: these renamed to the HF names,
# tied_embeddings and max_position_embeddings defaulted; _remap_mistral_vision_args: the vision_encoder
# section) and vllm/model_executor/models/pixtral.py (VisionEncoderArgs; a field with a default that is
# not Magistral's must be written), and head_dim / vocab_size / rope_theta read by its Llama-style decoder.
VLLM_TEXT = {
    "dim": 5120,  # -> hidden_size
    "n_layers": 40,  # -> num_hidden_layers
    "n_heads": 32,  # -> num_attention_heads
    "n_kv_heads": 8,  # -> num_key_value_heads
    "hidden_dim": 32768,  # -> intermediate_size
    "norm_eps": 1e-05,  # -> rms_norm_eps
    "head_dim": 128,  # the decoder's head size (5120 / 32 would be 160)
    "vocab_size": 131072,
    "rope_theta": 1e9,
    "max_position_embeddings": 131072,  # vLLM's default is 128_000
}
VLLM_VISION = {  # params["vision_encoder"] -> VisionEncoderArgs
    "hidden_size": 1024,
    "num_channels": 3,
    "image_size": 1540,
    "patch_size": 14,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "rope_theta": 10000.0,
    "image_token_id": 10,
    "adapter_bias": False,  # default True
    "spatial_merge_size": 2,  # default 1
    "add_pre_mm_projector_layer_norm": True,  # default False
    "mm_projector_id": "patch_merge",  # default "" (no patch merger)
    # transformers' conversion script reads these too (max_image_size without a default)
    "max_image_size": 1540,
    "image_break_token_id": 12,
    "image_end_token_id": 13,
}


def test_params_from_the_published_config_has_what_vllm_reads():
    config = read_model_config(FIXTURE)
    params = params_from_config(config)
    assert {k: params[k] for k in VLLM_TEXT} == VLLM_TEXT
    assert params["vision_encoder"] == VLLM_VISION
    assert "tied_embeddings" not in params  # untied (vLLM's default False), as Magistral is
    assert set(params) == set(VLLM_TEXT) | {"vision_encoder"}
    # and it describes the published model, field for field (activations, ids, sizes, untied)
    assert fields(config_from_params(json.loads(json.dumps(params)))) == fields(config)


def test_params_json_describes_the_same_model_as_config_json(base):
    """params.json -> config: equal to config.json's, every field (less the dtype params.json lacks)."""
    config = read_model_config(base["hf"])
    assert fields(config_from_params(params_from_config(config))) == fields(config)
    assert fields(read_model_config(base["native"])) == fields(config)  # a native directory's config


def test_the_bases_own_params_json_is_written(base, tmp_path):
    model_dir = tmp_path / "with_params"
    shutil.copytree(base["hf"], model_dir)
    own = {**params_from_config(base["config"]), "yarn": None}
    (model_dir / "params.json").write_text(json.dumps(own))
    export_hf_to_native(model_dir, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "params.json").read_text()) == own


def test_a_base_without_tekken_json_is_refused_before_anything_is_written(base, tmp_path):
    model_dir = tmp_path / "no_tokenizer"
    shutil.copytree(base["hf"], model_dir)
    (model_dir / TEKKEN).unlink()
    with pytest.raises(UserError, match="has no tekken.json"):
        export_hf_to_native(model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_model_the_native_layout_cannot_hold_is_refused():
    config = tiny_mistral3_config(vocab_size=512)
    config.vision_config.hidden_act = "gelu"
    with pytest.raises(UserError, match="vision_config.hidden_act is 'gelu'"):
        params_from_config(config)


def test_cli_exports_a_model_directory_and_refuses_native_adapters(base, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--format",
            "mistral",
            "--model-dir",
            str(base["hf"]),
            "--out-dir",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "mistral"
    assert (out / "consolidated.safetensors").read_bytes() == (
        base["native"] / "consolidated.safetensors"
    ).read_bytes()
    refused = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--format",
            "mistral",
            "--lora",
            "adapters",
            "--dcp-dir",
            str(tmp_path),
            "--out-dir",
            str(tmp_path / "x"),
        ],
    )
    assert refused.exit_code == 2 and "--lora merged" in refused.output
