"""A tiny Mistral3 (Mistral decoder + Pixtral vision tower) with Magistral's token layout.

The shapes are small, the structure is Magistral-Small-2509's: patch size 14, spatial merge 2
(one image token per 28x28 pixels), image token id 10 (``[IMG]``), and by default the real
131072-entry Tekken vocabulary so the real tokenizer's ids fit. ``save_official_checkpoint``
writes it the way the official repository ships weights: ``config.json``, safetensors shards
in the *official* key layout and ``model.safetensors.index.json``.

It is the one small model of the tests, benchmarks, quickstart and probes; the probes that
need many patches from small images (vision-attention) ask for ``patch_size=2``.

The config is built the way the real file is: by default no ``tie_word_embeddings`` key
anywhere (transformers then defaults the top-level flag to true, and the tying rule of
``magistral_cli.model_config`` makes the model untied, as Magistral is). ``tie=True`` gives a
model whose ``text_config`` ties (as Ministral-3 3B does); ``config_form="transformers"`` writes
config.json as transformers' ``save_pretrained`` does (top-level ``true``, ``text_config``
``false``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from magistral_cli.model_config import HEAD_KEY, apply_tying_rule, text_ties

#: Magistral's special ids in the Tekken vocabulary.
IMAGE_TOKEN_ID = 10
IMAGE_BREAK_TOKEN_ID = 12
IMAGE_END_TOKEN_ID = 13


def tiny_mistral3_config(
    vocab_size: int = 131072,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    vision_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie: bool | None = None,
    patch_size: int = 14,
):
    """A transformers ``Mistral3Config`` with Magistral's structure and tiny sizes.

    ``tie``: None leaves ``tie_word_embeddings`` out, as Magistral's config.json does; True or
    False sets it in ``text_config`` (the flag that counts). The tying rule is applied.
    ``patch_size``: Magistral's 14 (one image token per 28x28 pixels after the 2x2 merge); the
    longest image edge stays 110 patches, as Magistral's 1540 pixels are.
    """
    from transformers import Mistral3Config

    head_dim = hidden_size // num_attention_heads
    text = {
        "model_type": "mistral",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": vision_layers,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": 110 * patch_size,
        "patch_size": patch_size,
        "num_channels": 3,
        "rope_theta": 10000.0,
        "hidden_act": "silu",  # as the published config.json (PixtralVisionConfig's default is gelu)
    }
    if tie is not None:
        text["tie_word_embeddings"] = tie
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=IMAGE_TOKEN_ID,
        spatial_merge_size=2,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
    )
    return apply_tying_rule(config)


def build_tiny_model(config=None, seed: int = 0, dtype: Any = None):
    """A randomly initialised ``Mistral3ForConditionalGeneration`` (deterministic for a seed)."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    config = apply_tying_rule(config or tiny_mistral3_config())
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def official_config_dict(config, form: str = "official") -> dict[str, Any]:
    """``config`` as the dict a config.json holds.

    ``official``: the key structure of Magistral's published file, no ``tie_word_embeddings``
    anywhere unless ``text_config`` ties (then only there). ``transformers``: what transformers'
    ``save_pretrained`` writes for a config read from that file (top-level ``true``, text ``false``).
    """
    data = config.to_dict()
    tied = text_ties(config)
    data.pop("tie_word_embeddings", None)
    data["text_config"].pop("tie_word_embeddings", None)
    if form == "transformers":
        data["tie_word_embeddings"] = True
        data["text_config"]["tie_word_embeddings"] = tied
    elif form != "official":
        raise ValueError(f"unknown config form {form!r}: official or transformers")
    elif tied:
        data["text_config"]["tie_word_embeddings"] = True
    return data


def save_official_checkpoint(
    model, out_dir: str | Path, num_shards: int = 2, dtype: Any = "bfloat16", config_form: str = "official"
) -> Path:
    """Write ``model`` as the official repository does: config.json, shards, index (official keys).

    Tensors are split over ``num_shards`` files in state-dict order, like the official
    ``model-0000N-of-0000M.safetensors`` files. A tied model's head is left out (one tensor for
    both, as tied models ship).
    """
    import torch
    from safetensors.torch import save_file

    from magistral_cli.checkpoint.hf import CONFIG, WEIGHT_INDEX
    from magistral_cli.checkpoint.keys import transformers_to_official_key

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tied = text_ties(model.config)
    state = {
        transformers_to_official_key(k): v.detach().to(torch_dtype).contiguous().clone()
        for k, v in model.state_dict().items()
        if not (tied and k == HEAD_KEY)
    }
    keys = list(state)
    per_shard = -(-len(keys) // num_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(num_shards):
        part = keys[i * per_shard : (i + 1) * per_shard]
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(out / name), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = name
            total += state[k].numel() * state[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / WEIGHT_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = official_config_dict(model.config, config_form)
    config.pop("torch_dtype", None)
    config["dtype"] = str(torch_dtype).removeprefix("torch.")
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
