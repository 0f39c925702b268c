"""A tiny Mistral3 (Mistral decoder + Pixtral vision tower) with Magistral's token layout.

The shapes are small, the structure is Magistral-Small-2509's: patch size 14, spatial merge 2
(one image token per 28x28 pixels), image token id 10 (``[IMG]``), and by default the real
131072-entry Tekken vocabulary so the real tokenizer's ids fit. ``save_official_checkpoint``
writes it the way the official repository ships weights: ``config.json``, safetensors shards
in the *official* key layout and ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
):
    """A transformers ``Mistral3Config`` with Magistral's structure and tiny sizes."""
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
        "tie_word_embeddings": False,
        "sliding_window": None,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": vision_layers,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": 1540,
        "patch_size": 14,
        "num_channels": 3,
        "rope_theta": 10000.0,
    }
    return Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=IMAGE_TOKEN_ID,
        spatial_merge_size=2,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )


def build_tiny_model(config=None, seed: int = 0, dtype: Any = None):
    """A randomly initialised ``Mistral3ForConditionalGeneration`` (deterministic for a seed)."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    config = config or tiny_mistral3_config()
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_official_checkpoint(
    model, out_dir: str | Path, num_shards: int = 2, dtype: Any = "bfloat16"
) -> Path:
    """Write ``model`` as the official repository does: config.json, shards, index (official keys).

    Tensors are split over ``num_shards`` files in state-dict order, like the official
    ``model-0000N-of-0000M.safetensors`` files.
    """
    import torch
    from safetensors.torch import save_file

    from magistral_cli.checkpoint.keys import transformers_to_official_key

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    state = {
        transformers_to_official_key(k): v.detach().to(torch_dtype).contiguous().clone()
        for k, v in model.state_dict().items()
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
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = model.config.to_dict()
    config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
