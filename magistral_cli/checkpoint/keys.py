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
