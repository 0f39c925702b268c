"""Loading initial weights into the sharded model: ``training.load`` with ``load_format``.

Three sources, one rule: every rank reads only the slices of the tensors it holds.

- ``hf``: safetensors shards (official or transformers key layout; ``model.safetensors.index.json``
  or a single ``model.safetensors``), or Mistral's native ``consolidated*.safetensors``
  (``checkpoint.native``). Keys go through ``checkpoint.keys.to_transformers_key`` (native:
  ``native_to_transformers_key``); each DTensor's local shard is read with safetensors' lazy slicing.
- ``dcp``: a torch.distributed.checkpoint directory: the fsdp2 layout (transformers keys at the
  root), the megatron layout (``"model." + key``, in ``<dir>/release/``) or one of our training
  checkpoints (``model.<key>``, plus optimizer, RNG, ...: only the model is read here).

Key checks happen before any tensor is read, so ``load_strict`` stops the run before step 1
with the lists of missing and unexpected keys.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from magistral_cli.checkpoint.hf import (
    NATIVE_INDEX,
    NATIVE_WEIGHTS,
    SINGLE_WEIGHTS,
    WEIGHT_INDEX,
    is_native_dir,
)
from magistral_cli.checkpoint.keys import DCP_MODEL_PREFIX, native_to_transformers_key, to_transformers_key
from magistral_cli.checkpoint.layout import DCP_METADATA, MEGATRON_RELEASE_DIR, is_dcp_dir
from magistral_cli.checkpoint.native import from_native_rows, rotary_head_dim
from magistral_cli.errors import UserError

from .qlora import is_nf4, load_nf4_

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    source: str
    fmt: str
    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def detect_format(path: Path) -> str:
    """``hf`` or ``dcp`` for an existing directory (a megatron DCP keeps its files in ``release/``);
    Mistral's native layout (consolidated.safetensors + params.json) is read as ``hf``."""
    if (path / WEIGHT_INDEX).is_file() or (path / SINGLE_WEIGHTS).is_file() or is_native_dir(path):
        return "hf"
    if is_dcp_dir(path) or is_dcp_dir(path / MEGATRON_RELEASE_DIR):
        return "dcp"
    raise UserError(
        f"training.load {path} holds neither safetensors weights ({WEIGHT_INDEX} or {SINGLE_WEIGHTS}) nor a DCP "
        f"checkpoint ({DCP_METADATA}); point it at a model directory, a `magistral convert` output or a run checkpoint"
    )


def _check_keys(
    report: LoadReport, model_keys: list[str], source_keys: set[str], strict: bool, problems: list[str]
) -> None:
    report.missing = sorted(k for k in model_keys if k not in source_keys)
    report.unexpected = sorted(source_keys - set(model_keys))
    if strict and (report.missing or report.unexpected or problems):
        lines = [f"cannot load {report.source} ({report.fmt}) with training.load_strict: true:"]
        if report.missing:
            lines.append(f"  missing keys ({len(report.missing)}): " + ", ".join(report.missing))
        if report.unexpected:
            lines.append(f"  unexpected keys ({len(report.unexpected)}): " + ", ".join(report.unexpected))
        lines += [f"  {p}" for p in problems]
        lines.append(
            "  fix: point training.load at a checkpoint of this model, or set training.load_strict=false"
        )
        raise UserError("\n".join(lines))
    if problems:
        raise UserError(f"cannot load {report.source}: " + "; ".join(problems))


def load_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under the checkpoint's names, without tied aliases (a tied head is
    the embedding: loaded once).

    A tied model's source (as tied models ship) has no ``lm_head.weight``; an untied one's must.
    A LoRA model's wrapped layers are keyed by their base names (``q_proj.base_layer.weight`` is
    ``q_proj.weight``) and its adapters are left out: the base checkpoint has none.
    """
    from magistral_cli.checkpoint.lora_format import base_state_dict
    from magistral_cli.model_config import tied_aliases

    aliases = tied_aliases(model)
    return {k: v for k, v in base_state_dict(model.state_dict()).items() if k not in aliases}


def local_slices(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(local storage, slices of the global tensor it holds) for a DTensor or a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        return tensor.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return tensor, tuple(slice(0, s) for s in tensor.shape)


def _require_floating(path: Path, key: str, dtype, where: str) -> None:
    """Refuse a model tensor that is not floating point (safetensors ``I32``, torch ``int32``, a
    non-tensor DCP entry): copying it into a float parameter would cast it silently, and a run
    would train from garbage (an int32 lm_head gave a step-1 loss of ln(vocab))."""
    name = str(dtype).removeprefix("torch.")
    if isinstance(dtype, torch.dtype):
        floating = dtype.is_floating_point
    else:  # a safetensors dtype name: F16, BF16, F32, F64, F8_E4M3, ...
        floating = name == "BF16" or name.startswith("F")
    if not floating:
        raise UserError(
            f"cannot load {path}: {key} is {name} in {where}; model weights must be floating point "
            "(the file holds something else than this model's weights)"
        )


def _hf_weight_map(path: Path, native: bool = False) -> dict[str, str]:
    """source key -> file name."""
    index_name, single = (NATIVE_INDEX, NATIVE_WEIGHTS) if native else (WEIGHT_INDEX, SINGLE_WEIGHTS)
    index = path / index_name
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    from safetensors import safe_open

    with safe_open(str(path / single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_hf(model: nn.Module, path: Path, strict: bool) -> LoadReport:
    """Read safetensors shards (official or transformers keys, or Mistral's native layout) into the
    model's local shards. A native query or key weight is read whole and its rows put back in
    transformers' order before the local slice is taken."""
    from safetensors import safe_open

    native = is_native_dir(path)
    report = LoadReport(source=str(path), fmt="mistral" if native else "hf")
    weight_map = _hf_weight_map(path, native)
    to_key = native_to_transformers_key if native else to_transformers_key
    by_key: dict[str, tuple[str, str]] = {}  # transformers key -> (source key, file)
    problems: list[str] = []
    unmappable: set[str] = set()
    for key, fname in weight_map.items():
        try:
            by_key[to_key(key)] = (key, fname)
        except KeyError:
            unmappable.add(key)
    targets = load_targets(model)
    _check_keys(report, list(targets), set(by_key) | unmappable, strict, problems)

    by_file: dict[str, list[str]] = {}
    for key in targets:
        if key in by_key:
            by_file.setdefault(by_key[key][1], []).append(key)
    with torch.no_grad():
        for fname, keys in by_file.items():
            with safe_open(str(path / fname), framework="pt") as f:
                for key in keys:
                    source = f.get_slice(by_key[key][0])
                    _require_floating(path, key, source.get_dtype(), fname)
                    if tuple(source.get_shape()) != tuple(targets[key].shape):
                        problems.append(
                            f"{key}: shape {tuple(source.get_shape())} in {fname}, {tuple(targets[key].shape)} in the model"
                        )
                        continue
                    local, slices = local_slices(targets[key])
                    head_dim = rotary_head_dim(by_key[key][0], model.config) if native else None
                    if is_nf4(local):
                        # QLoRA: the whole weight, quantised on this rank's device; one at a time.
                        full = f.get_tensor(by_key[key][0])
                        load_nf4_(local, slices[0], from_native_rows(full, head_dim) if head_dim else full)
                        del full
                    elif local.numel() and head_dim is not None:
                        local.copy_(from_native_rows(f.get_tensor(by_key[key][0]), head_dim)[slices])
                    elif local.numel():
                        local.copy_(source[slices])
                    report.loaded += 1
    if problems:
        raise UserError(
            f"cannot load {path}: " + "; ".join(problems) + "; the checkpoint belongs to another model config"
        )
    return report


def dcp_model_prefix(keys: set[str]) -> str:
    """The prefix before the transformers keys: ``DCP_MODEL_PREFIX`` of the layout the keys show.

    megatron ``model.model.`` (MindSpeed-MM's wrapper, under ``{"model": ...}``), engine
    ``model.`` (training checkpoints), fsdp2 ``""``; the longest prefix is tried first.
    """
    for layout in ("megatron", "engine"):
        prefix = DCP_MODEL_PREFIX[layout]
        if any(k.startswith((prefix + "lm_head.", prefix + "model.language_model.")) for k in keys):
            return prefix
    return ""


def load_dcp(model: nn.Module, path: Path, strict: bool) -> LoadReport:
    """Read the model tensors of a DCP directory (any of our layouts) into the model's local shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from magistral_cli.checkpoint.safe_dcp import SafeFileSystemReader

    if not is_dcp_dir(path) and is_dcp_dir(path / MEGATRON_RELEASE_DIR):
        path = path / MEGATRON_RELEASE_DIR
    report = LoadReport(source=str(path), fmt="dcp")
    metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = dcp_model_prefix(set(metadata))
    source_keys = {k[len(prefix) :] for k in metadata if k.startswith(prefix)}
    if prefix:
        # Training checkpoints also hold optimizer/rng/... entries: only the model's count as keys.
        source_keys = {k for k in source_keys if k.startswith(("model.", "lm_head."))}
    targets = load_targets(model)
    problems = []
    for key, tensor in targets.items():
        meta = metadata.get(prefix + key)
        if meta is not None:
            dtype = meta.properties.dtype if isinstance(meta, TensorStorageMetadata) else "a non-tensor entry"
            _require_floating(path, key, dtype, DCP_METADATA)
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(tensor.shape):
            problems.append(
                f"{key}: shape {tuple(meta.size)} in the checkpoint, {tuple(tensor.shape)} in the model"
            )
    _check_keys(report, list(targets), source_keys, strict, problems)
    wanted = {prefix + k: v for k, v in targets.items() if k in source_keys}
    # QLoRA's NF4 weights are read whole, one at a time, and quantised (``qlora.load_nf4_``).
    quantized = {k: v for k, v in wanted.items() if is_nf4(v)}
    dcp.load(
        {k: v for k, v in wanted.items() if k not in quantized},
        storage_reader=SafeFileSystemReader(str(path)),
    )
    for key, target in quantized.items():
        meta = metadata[key]
        full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        dcp.load({key: full}, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
        local, slices = local_slices(target)
        load_nf4_(local, slices[0], full)
        del full
    report.loaded = len(wanted)
    return report


def load_weights(model: nn.Module, path: str | Path, fmt: str, strict: bool) -> LoadReport:
    """Load ``training.load`` into the model (``fmt``: hf, dcp or auto)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"training.load {path} does not exist")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "hf":
        return load_hf(model, path, strict)
    return load_dcp(model, path, strict)
