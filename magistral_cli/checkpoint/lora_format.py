"""The LoRA file and checkpoint format: PEFT's key names, the ``lora.config`` record, PEFT's config.

Shared by the trainer (``engine.lora``, which builds and trains the adapters) and the export
(``checkpoint.lora_export``), so that both read and write one format.

**Key names.** PEFT moves a wrapped Linear's weight to ``<module>.base_layer.weight`` and adds
``<module>.lora_A.default.weight`` ``[r, in]`` and ``<module>.lora_B.default.weight`` ``[out, r]``.
HF and DCP base weights use the plain names: :func:`base_key` / :func:`wrapped_key` map between
them, and :func:`base_state_dict` is a LoRA model's state dict keyed as the base checkpoint is
(adapter tensors left out). PEFT's adapter files drop the adapter name and prefix
``base_model.model.`` (:func:`peft_file_key`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from magistral_cli.config.schema import LoraConfig as LoraSpec

#: PEFT's adapter name for the one adapter trained here.
ADAPTER = "default"
BASE_LAYER = "base_layer"
#: Parameter containers PEFT's LoRA Linear adds (``lora_A.default.weight``, ``lora_B.default.weight``).
ADAPTER_PARTS = ("lora_A", "lora_B")
#: Prefix of every key of PEFT's adapter files (``PeftModel`` -> ``LoraModel`` -> the model).
PEFT_FILE_PREFIX = "base_model.model."
#: The ``lora.config`` entry of a training checkpoint (a packed JSON-ready dict).
CHECKPOINT_ENTRY = "lora"
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class LoraTargets:
    """Full module names, in the model's order: the adapted Linear layers and the modules trained in full."""

    modules: tuple[str, ...]
    modules_to_save: tuple[str, ...] = ()


def is_adapter_key(key: str) -> bool:
    """Whether a parameter/state-dict key is a LoRA adapter tensor (``.lora_A.`` / ``.lora_B.``)."""
    return any(f".{part}." in f".{key}" for part in ADAPTER_PARTS)


def base_key(key: str) -> str:
    """The base checkpoint's name of a wrapped model's key: ``q_proj.base_layer.weight`` -> ``q_proj.weight``."""
    return key.replace(f".{BASE_LAYER}.", ".")


def wrapped_key(key: str, targets: LoraTargets | tuple[str, ...]) -> str:
    """The inverse of :func:`base_key` for the LoRA target modules ``targets``."""
    modules = targets.modules if isinstance(targets, LoraTargets) else targets
    module, _, leaf = key.rpartition(".")
    return f"{module}.{BASE_LAYER}.{leaf}" if module in set(modules) else key


def base_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` of a LoRA model keyed as the base checkpoint is (adapter tensors left out).

    The values are the model's own tensors: copying a checkpoint's tensors into them loads the base.
    """
    return {base_key(k): v for k, v in state_dict.items() if not is_adapter_key(k)}


def peft_file_key(key: str) -> str:
    """A trained key in PEFT's adapter-file name: ``base_model.model.<module>.lora_A.weight``.

    ``x.q_proj.lora_A.default.weight`` -> ``base_model.model.x.q_proj.lora_A.weight``; a module
    trained in full keeps its key (``lm_head.weight`` -> ``base_model.model.lm_head.weight``).
    """
    for part in ADAPTER_PARTS:
        key = key.replace(f".{part}.{ADAPTER}.", f".{part}.")
    return PEFT_FILE_PREFIX + key


def peft_config(
    spec: LoraSpec,
    targets: LoraTargets,
    *,
    for_export: bool = False,
    base_model_name_or_path: str | None = None,
):
    """The ``peft.LoraConfig`` of ``spec`` over the resolved full module names.

    For training (``for_export=False``) the modules to save are left out (see the module doc).
    For export: ``inference_mode=True`` and ``task_type="CAUSAL_LM"``, as ``PeftModel.save_pretrained``
    writes for a causal LM, and the modules to save listed.
    """
    import peft

    kwargs: dict[str, Any] = {}
    if for_export:
        kwargs.update(
            inference_mode=True,
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model_name_or_path,
            modules_to_save=list(targets.modules_to_save) or None,
        )
    return peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(targets.modules),
        init_lora_weights=spec.init_lora_weights,
        bias="none",
        **kwargs,
    )


def read_checkpoint_record(checkpoint_dir) -> dict[str, Any] | None:
    """The ``lora.config`` settings of a training checkpoint, or None when it has none."""
    import torch.distributed.checkpoint as dcp

    from .packed import checkpoint_sizes, unpack
    from .safe_dcp import SafeFileSystemReader

    key = f"{CHECKPOINT_ENTRY}.config"
    sizes = checkpoint_sizes(checkpoint_dir, [key])
    if key not in sizes:
        return None
    state = {CHECKPOINT_ENTRY: {"config": torch.empty(sizes[key], dtype=torch.uint8)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint_dir)), no_dist=True)
    return json.loads(unpack(state[CHECKPOINT_ENTRY]["config"]))
