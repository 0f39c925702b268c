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
"""

from __future__ import annotations

LAYOUTS = ("official", "transformers", "megatron")
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


def transformers_to_megatron_key(key: str) -> str:
    return MEGATRON_PREFIX + key


def megatron_to_transformers_key(key: str) -> str:
    if not key.startswith(MEGATRON_PREFIX + "model.") and not key.startswith(MEGATRON_PREFIX + "lm_head."):
        raise KeyError(
            f"{key!r} is not a key of the megatron layout (expected 'model.model.*' or 'model.lm_head.*')"
        )
    return key[len(MEGATRON_PREFIX) :]


def convert_key(key: str, src: str, dst: str) -> str:
    """Map ``key`` from layout ``src`` to layout ``dst`` (each one of LAYOUTS)."""
    if src not in LAYOUTS or dst not in LAYOUTS:
        raise ValueError(f"layouts must be among {LAYOUTS}, got {src!r} -> {dst!r}")
    if src == "official":
        key = official_to_transformers_key(key)
    elif src == "megatron":
        key = megatron_to_transformers_key(key)
    if dst == "official":
        return transformers_to_official_key(key)
    if dst == "megatron":
        return transformers_to_megatron_key(key)
    return key


#: DCP layout -> prefix of the model's transformers keys among the checkpoint's flattened keys.
DCP_MODEL_PREFIX = {"fsdp2": "", "engine": "model.", "megatron": "model." + MEGATRON_PREFIX}
#: The DCP layouts ``hf-to-dcp`` writes (``engine`` checkpoints come from training).
CONVERSION_LAYOUTS = ("fsdp2", "megatron")
#: Sub-directory that holds a megatron-layout DCP (Megatron's "release" iteration).
MEGATRON_RELEASE_DIR = "release"


def transformers_to_dcp_key(key: str, dcp_layout: str) -> str:
    """``lm_head.weight`` -> its flattened DCP key in ``dcp_layout`` (fsdp2, engine or megatron)."""
    return DCP_MODEL_PREFIX[dcp_layout] + key


def dcp_to_transformers_key(key: str, dcp_layout: str) -> str:
    """The inverse of ``transformers_to_dcp_key``."""
    prefix = DCP_MODEL_PREFIX[dcp_layout]
    if not key.startswith(prefix):
        raise KeyError(f"{key!r} is not a model key of the {dcp_layout} DCP layout (prefix {prefix!r})")
    return key[len(prefix) :]
