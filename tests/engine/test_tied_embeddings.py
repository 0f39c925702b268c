"""The tying rule on the real config.json and on tiny models shaped like the real files.

Magistral's published config.json has no ``tie_word_embeddings`` key anywhere; transformers 5
defaults the top-level one to true and would tie the trained head to the embedding. The rule
(``magistral_cli.model_config``): ``text_config`` decides. These tests build the real config,
and train and export three tiny models on 2 CPU processes: one with the real file's key
structure (no tie key), one as transformers' ``save_pretrained`` writes it (top-level true, text
false) and one whose ``text_config`` ties.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf
from magistral_cli.checkpoint.keys import to_transformers_key
from magistral_cli.checkpoint.validate import model_keys
from magistral_cli.engine.model import build_model, load_model_config
from magistral_cli.engine.parallelize import apply_freeze
from magistral_cli.model_config import EMBED_KEY, HEAD_KEY, parameter_counts, read_model_config

from .helpers import recipe_dict, run_train

REPO = Path(__file__).resolve().parents[2]
REAL_CONFIG = REPO / "tests" / "fixtures" / "magistral-small-2509" / "config.json"
DEFAULT_FREEZE = ["model.vision_tower", "model.multi_modal_projector"]


def _model_dir(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def test_real_config_builds_untied_with_the_exact_parameter_counts(tmp_path):
    raw = json.loads(REAL_CONFIG.read_text(encoding="utf-8"))
    assert "tie_word_embeddings" not in raw and "tie_word_embeddings" not in raw["text_config"]
    config = load_model_config(_model_dir(tmp_path, raw))
    assert config.tie_word_embeddings is False and config.text_config.tie_word_embeddings is False
    model = build_model(config, meta=True, attn_implementation="sdpa")
    assert model.lm_head.weight is not model.model.language_model.embed_tokens.weight
    frozen = apply_freeze(model, DEFAULT_FREEZE)
    counts = parameter_counts(model)
    print(f"Magistral-Small-2509 parameters: {counts}")
    assert counts == {"total": 24_011_361_280, "trainable": 23_572_403_200, "frozen": 438_958_080}
    # The split by the recipe's freeze names equals the split by requires_grad.
    assert parameter_counts(model, frozen) == counts
    # convert validate checks the head as its own key: 0 aliases, every tensor required.
    keys = model_keys(REAL_CONFIG.parent)
    assert keys.aliases == set() and HEAD_KEY in keys.required
    assert keys.shapes[HEAD_KEY] == (131072, 5120) and len(keys.required) == len(keys.shapes)


@pytest.mark.parametrize(
    ("top", "text", "tied"),
    [(None, None, False), (True, False, False), (True, None, False), (None, True, True), (False, True, True)],
)
def test_text_config_decides(tmp_path, top, text, tied):
    raw = json.loads(REAL_CONFIG.read_text(encoding="utf-8"))
    raw["text_config"]["num_hidden_layers"] = 1
    raw["vision_config"]["num_hidden_layers"] = 1
    if top is not None:
        raw["tie_word_embeddings"] = top
    if text is not None:
        raw["text_config"]["tie_word_embeddings"] = text
    model_dir = _model_dir(tmp_path, raw)
    config = read_model_config(model_dir)
    assert config.tie_word_embeddings is tied
    model = build_model(config, meta=True, attn_implementation="sdpa")
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) is tied
    assert (HEAD_KEY in model_keys(model_dir).aliases) is tied


# --------------------------------------------------------------------------- 2-process training

STEPS = 3


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[to_transformers_key(key)] = f.get_tensor(key)
    return out


def _checkpoint_tensor(checkpoint: Path, key: str) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata[f"model.{key}"]
    state = {f"model.{key}": torch.empty(meta.size, dtype=meta.properties.dtype)}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state[f"model.{key}"]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["official", "transformers", "tied"])
def test_train_and_export_keep_the_head(tmp_path, form):
    """The seed's FSDP plan (embedding, layers and head as their own units) on 2 CPU processes.

    Untied (the real file's form and transformers' saved form): the exported head is the trained
    one and differs from the embedding. Tied: the two train as one FSDP unit and export one tensor.
    """
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    tied = form == "tied"
    model = build_tiny_model(tiny_mistral3_config(vocab_size=512, tie=True if tied else None), seed=0)
    model_dir = tmp_path / "model"
    config_form = "transformers" if form == "transformers" else "official"
    save_official_checkpoint(model, model_dir, dtype="float32", config_form=config_form)
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if form == "official":
        assert "tie_word_embeddings" not in raw and "tie_word_embeddings" not in raw["text_config"]
    elif form == "transformers":
        assert raw["tie_word_embeddings"] is True and raw["text_config"]["tie_word_embeddings"] is False
    source = _tensors(model_dir)
    assert (HEAD_KEY in source) is not tied

    data = recipe_dict(
        model_dir, tmp_path / "unused", micro_batch_size=1, train_iters=STEPS, save_interval=STEPS
    )
    del data["training"]["output_dir"]
    # The seed's plan: the default apply_modules, with embed_tokens and lm_head as units of their own.
    assert "parallel" in data and "apply_modules" not in data["parallel"]["fsdp_plan"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    run = run_train(recipe, tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{STEPS}"

    export = export_dcp_to_hf(checkpoint, model_dir, tmp_path / "export").out_dir
    exported = _tensors(export)
    assert set(exported) == set(source)
    trained_embed = _checkpoint_tensor(checkpoint, EMBED_KEY)
    assert torch.equal(exported[EMBED_KEY], trained_embed)
    assert not torch.equal(exported[EMBED_KEY], source[EMBED_KEY]), "the embedding did not train"
    if tied:
        assert HEAD_KEY not in exported
        assert "tied embedding and head: sharded as one FSDP unit" in run.stderr
        return
    trained_head = _checkpoint_tensor(checkpoint, HEAD_KEY)
    assert torch.equal(exported[HEAD_KEY], trained_head)
    assert not torch.equal(exported[HEAD_KEY], source[HEAD_KEY]), "the head did not train"
    assert not torch.equal(exported[HEAD_KEY], exported[EMBED_KEY])
