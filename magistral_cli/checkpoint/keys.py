"""Checkpoint key layouts, in one place (DESIGN.md, "Checkpoint key layouts").

| layout       | example key                                           |
| official     | language_model.model.layers.0.mlp.up_proj.weight      |
|              | language_model.lm_head.weight, vision_tower.*, multi_modal_projector.* |
| transformers | model.language_model.layers.0.mlp.up_proj.weight      |
|              | lm_head.weight, model.vision_tower.*, model.multi_modal_projector.* |
| megatron     | "model." + the transformers key (MindSpeed-MM's TransformersModel wrapper) |

Inside a torch.distributed.checkpoint (DCP) directory, the model tensors sit under flattened
keys (DCP joins nested state-dict keys with "."). ``DCP_MODEL_PREFIX`` says which prefix each
DCP layout puts before the transformers key:

| DCP layout | DCP key of ``lm_head.weight``  | state dict that was saved                          |
| fsdp2      | ``lm_head.weight``             | the transformers state dict itself, at the root    |
| engine     | ``model.lm_head.weight``       | ``{"model": <transformers keys>, "optimizer": ...}`` (training checkpoints) |
| megatron   | ``model.model.lm_head.weight`` | ``{"model": <megatron keys>, "checkpoint_version": 3.0}`` under ``release/`` |

Where these checkpoints sit on disk (``.metadata``, ``release/``, ``step_<N>/``) is ``layout``'s.
"""

from __future__ import annotations

#: What MindSpeed-MM's megatron wrapper puts before every transformers key.
MEGATRON_PREFIX = "model."

# (official prefix, transformers prefix); the first match wins, so longer prefixes come first.
_OFFICIAL_TO_TRANSFORMERS = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def official_to_transformers_key(key: str) -> str:
    """``language_model.model.layers.0...`` -> ``model.language_model.layers.0...``."""
    for src, dst in _OFFICIAL_TO_TRANSFORMERS:
        if key.startswith(src):
            return dst + key[len(src) :]
    raise KeyError(f"{key!r} is not a key of the official Magistral/Mistral3 layout")


def transformers_to_official_key(key: str) -> str:
    """The inverse of ``official_to_transformers_key``."""
    for src, dst in _OFFICIAL_TO_TRANSFORMERS:
        if key.startswith(dst):
            return src + key[len(dst) :]
    raise KeyError(f"{key!r} is not a key of transformers' Mistral3ForConditionalGeneration")


def is_transformers_key(key: str) -> bool:
    return key == "lm_head.weight" or key.startswith(
        ("lm_head.", "model.language_model.", "model.vision_tower.", "model.multi_modal_projector.")
    )


def to_transformers_key(key: str) -> str:
    """Any source key (official or already transformers) to the transformers layout."""
    return key if is_transformers_key(key) else official_to_transformers_key(key)


#: DCP layout -> prefix of the model's transformers keys among the checkpoint's flattened keys.
DCP_MODEL_PREFIX = {"fsdp2": "", "engine": "model.", "megatron": "model." + MEGATRON_PREFIX}
#: The DCP layouts ``hf-to-dcp`` writes (``engine`` checkpoints come from training).
CONVERSION_LAYOUTS = ("fsdp2", "megatron")


# Mistral's native layout (``consolidated.safetensors`` + ``params.json``): the names of
# mistral-inference, which vLLM's ``--load-format mistral`` reads and transformers' Mistral3
# conversion script maps from. Values are the same tensors, except that the query and key
# weights keep the rows of each head in rotary order (``checkpoint.native`` permutes them).
# (native prefix, transformers prefix) of the parts outside the layers, first match wins.
_NATIVE_TOP = (
    ("tok_embeddings.", "model.language_model.embed_tokens."),
    ("norm.", "model.language_model.norm."),
    ("output.", "lm_head."),
    ("vision_encoder.ln_pre.", "model.vision_tower.ln_pre."),
    ("vision_encoder.patch_conv.", "model.vision_tower.patch_conv."),
    ("vision_language_adapter.w_in.", "model.multi_modal_projector.linear_1."),
    ("vision_language_adapter.w_out.", "model.multi_modal_projector.linear_2."),
    ("patch_merger.merging_layer.", "model.multi_modal_projector.patch_merger.merging_layer."),
    ("pre_mm_projector_norm.", "model.multi_modal_projector.norm."),
)
# (native, transformers) prefix of layer i, and the module names inside a layer.
_NATIVE_LAYERS = {
    "text": ("layers.", "model.language_model.layers."),
    "vision": ("vision_encoder.transformer.layers.", "model.vision_tower.transformer.layers."),
}
_NATIVE_IN_LAYER = {
    "text": (
        ("attention.wq.", "self_attn.q_proj."),
        ("attention.wk.", "self_attn.k_proj."),
        ("attention.wv.", "self_attn.v_proj."),
        ("attention.wo.", "self_attn.o_proj."),
        ("attention_norm.", "input_layernorm."),
        ("ffn_norm.", "post_attention_layernorm."),
        ("feed_forward.w1.", "mlp.gate_proj."),
        ("feed_forward.w2.", "mlp.down_proj."),
        ("feed_forward.w3.", "mlp.up_proj."),
    ),
    "vision": (
        ("attention.wq.", "attention.q_proj."),
        ("attention.wk.", "attention.k_proj."),
        ("attention.wv.", "attention.v_proj."),
        ("attention.wo.", "attention.o_proj."),
        ("attention_norm.", "attention_norm."),
        ("ffn_norm.", "ffn_norm."),
        ("feed_forward.w1.", "feed_forward.gate_proj."),
        ("feed_forward.w2.", "feed_forward.down_proj."),
        ("feed_forward.w3.", "feed_forward.up_proj."),
    ),
}
#: The native names of the weights whose rows are in rotary order (per tower: text, vision).
NATIVE_ROTARY = ("attention.wq.weight", "attention.wk.weight")


def _map_native(key: str, to_native: bool) -> str | None:
    src, dst = (1, 0) if to_native else (0, 1)
    for pair in _NATIVE_TOP:
        if key.startswith(pair[src]):
            return pair[dst] + key[len(pair[src]) :]
    for tower, layer_prefix in _NATIVE_LAYERS.items():
        if not key.startswith(layer_prefix[src]):
            continue
        index, _, rest = key[len(layer_prefix[src]) :].partition(".")
        if not index.isdigit():
            return None
        for pair in _NATIVE_IN_LAYER[tower]:
            if rest.startswith(pair[src]):
                return f"{layer_prefix[dst]}{index}.{pair[dst]}{rest[len(pair[src]) :]}"
    return None


def native_to_transformers_key(key: str) -> str:
    """``layers.0.attention.wq.weight`` -> ``model.language_model.layers.0.self_attn.q_proj.weight``."""
    out = _map_native(key, to_native=False)
    if out is None:
        raise KeyError(f"{key!r} is not a key of Mistral's native (consolidated.safetensors) layout")
    return out


def transformers_to_native_key(key: str) -> str:
    """The inverse of ``native_to_transformers_key``."""
    out = _map_native(key, to_native=True)
    if out is None:
        raise KeyError(f"{key!r} has no name in Mistral's native (consolidated.safetensors) layout")
    return out


def native_rotary_tower(native_key: str) -> str | None:
    """``text`` or ``vision`` for a query or key weight (rows in rotary order), else None."""
    for tower, (prefix, _) in _NATIVE_LAYERS.items():
        if native_key.startswith(prefix) and native_key.endswith(NATIVE_ROTARY):
            return tower
    return None
