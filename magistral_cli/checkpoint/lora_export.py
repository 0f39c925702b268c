"""A LoRA training checkpoint -> PEFT adapter files, or -> full HF weights with the adapters merged in.

The input is a training checkpoint of a ``model.lora`` run (``checkpoints/step_N/``, DCP): it holds
only what training changed, the adapters ``model.<module>.lora_A.default.weight`` ``[r, in]`` /
``lora_B.default.weight`` ``[out, r]`` (fp32) and any ``modules_to_save`` in full, plus the LoRA
settings (``lora.config``, written by ``engine.lora.checkpoint_entry``; an older checkpoint falls
back to the run's ``resolved_config.yaml``). The base model directory (``--base``) supplies
config.json, the tokenizer files and, for a merge, the base weights.

- ``adapters``: ``adapter_model.safetensors`` under PEFT's keys (``base_model.model.<module>.lora_A.weight``,
  no adapter name; modules to save as ``base_model.model.<module>.weight``), in the checkpoint's fp32,
  and ``adapter_config.json`` written by ``peft.LoraConfig.save_pretrained`` (task CAUSAL_LM,
  inference mode, the full module names as ``target_modules``). ``PeftModel.from_pretrained(base,
  out_dir)`` loads it; vLLM serves it with ``--lora-modules``.
- ``merged``: every base shard rewritten with the same file names, tensor names, dtypes and index:
  an adapted weight becomes ``W + (alpha / r) * (B @ A)``, computed in fp32 and rounded to the base's
  dtype once (PEFT's ``merge_and_unload`` of an fp32 model, whose ``get_delta_weight`` is
  ``(B @ A) * scaling`` added to ``W``: the same operations in the same order); a module to save is
  its trained tensor in the base's dtype; every other tensor's bytes are copied unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magistral_cli.errors import CheckFailed, UserError
from magistral_cli.run_record import RESOLVED_CONFIG

from .hf import CONFIG, WEIGHT_INDEX, read_hf_weights, read_weight_index, require_model_dir, support_files
from .keys import DCP_MODEL_PREFIX, to_transformers_key
from .layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .safetensors_io import StreamWriters, read_data_offsets, read_safetensors_header
from .staging import refuse_existing, staged_directory
from .validate import read_dcp_metadata, resolve_dcp_checkpoint

MODES = ("adapters", "merged")
#: The engine layout's prefix of model keys in a training checkpoint.
MODEL_PREFIX = DCP_MODEL_PREFIX["engine"]


@dataclass
class LoraCheckpoint:
    """The trained tensors of a LoRA training checkpoint and the settings they were trained with."""

    path: Path
    r: int
    alpha: int
    dropout: float
    init_lora_weights: Any
    targets: tuple[str, ...]  # adapted Linear modules (transformers names)
    modules_to_save: tuple[str, ...]
    #: transformers-layout state-dict key of the wrapped model -> fp32 CPU tensor.
    tensors: dict[str, Any]
    base_model_name_or_path: str | None = None
    settings_from: str = "checkpoint"

    def lora_pair(self, module: str):
        return (
            self.tensors[f"{module}.lora_A.default.weight"],
            self.tensors[f"{module}.lora_B.default.weight"],
        )


@dataclass
class LoraExportResult:
    out_dir: Path
    checkpoint_dir: Path
    mode: str
    files: list[str]
    tensors: int
    merged: int = 0
    replaced: int = 0
    copied_tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "out_dir": str(self.out_dir),
            "checkpoint_dir": str(self.checkpoint_dir),
            "lora": self.mode,
            "files": self.files,
            "tensors": self.tensors,
            "merged": self.merged,
            "replaced": self.replaced,
            "copied_tensors": self.copied_tensors,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "copied": self.copied,
        }


# --------------------------------------------------------------------------- reading the checkpoint


def _model_tensor_keys(metadata) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k[len(MODEL_PREFIX) :]: md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)
    }


def is_lora_checkpoint(dcp_dir: str | Path, allow_unverified: bool = False) -> bool:
    """Whether ``dcp_dir`` resolves to a training checkpoint holding LoRA adapters."""
    from .lora_format import is_adapter_key

    checkpoint_dir = resolve_dcp_checkpoint(dcp_dir, allow_unverified)
    return any(is_adapter_key(k) for k in _model_tensor_keys(read_dcp_metadata(checkpoint_dir)))


def _settings_from_run(checkpoint_dir: Path) -> tuple[dict | None, str | None]:
    """``model.lora`` of the run that wrote ``checkpoint_dir`` (its ``resolved_config.yaml``)."""
    for run_dir in (checkpoint_dir.parent.parent, checkpoint_dir.parent):
        path = run_dir / RESOLVED_CONFIG
        if path.is_file():
            from magistral_cli.config.loader import read_yaml

            model = read_yaml(path).get("model") or {}
            if model.get("lora"):
                return {**model["lora"], "base_model_name_or_path": model.get("model_name_or_path")}, str(
                    path
                )
    return None, None


def read_lora_checkpoint(dcp_dir: str | Path, allow_unverified: bool = False) -> LoraCheckpoint:
    """The adapters, modules to save and LoRA settings of a training checkpoint (all read into memory:
    at 24B with r = 16 the adapters are 370 MB in fp32), verified first (``resolve_dcp_checkpoint``)."""
    import torch

    from .dcp_to_hf import load_in_process
    from .lora_format import is_adapter_key, read_checkpoint_record

    checkpoint_dir = resolve_dcp_checkpoint(dcp_dir, allow_unverified)
    metadata = read_dcp_metadata(checkpoint_dir)
    model_keys = _model_tensor_keys(metadata)
    adapter_keys = sorted(k for k in model_keys if is_adapter_key(k))
    if not adapter_keys:
        raise UserError(
            f"{checkpoint_dir} holds no LoRA adapters (no model.*.lora_A.default.weight); it is not a "
            "model.lora run's checkpoint: export it without --lora"
        )
    targets = sorted({k.rsplit(".lora_", 1)[0] for k in adapter_keys})
    for module in targets:
        for part in ("lora_A", "lora_B"):
            if f"{module}.{part}.default.weight" not in model_keys:
                raise CheckFailed(
                    f"{checkpoint_dir} has no {module}.{part}.default.weight; the checkpoint is incomplete"
                )
    saved_keys = sorted(k for k in model_keys if not is_adapter_key(k))
    modules_to_save = sorted({k.rsplit(".", 1)[0] for k in saved_keys})

    record = read_checkpoint_record(checkpoint_dir)
    source = "checkpoint"
    if record is None:
        record, source = _settings_from_run(checkpoint_dir)
        if record is None:
            raise UserError(
                f"{checkpoint_dir} records no LoRA settings (lora.config) and no {RESOLVED_CONFIG} of its run "
                f"was found next to it (in {checkpoint_dir.parent.parent} or {checkpoint_dir.parent}); export "
                "from the run's checkpoints/step_N directory"
            )
    ranks = {int(model_keys[f"{m}.lora_A.default.weight"].size[0]) for m in targets}
    r = int(record["r"])
    if ranks != {r}:
        raise CheckFailed(
            f"{checkpoint_dir}: the adapters have rank {sorted(ranks)} but the run's settings say r={r}"
        )
    recorded = record.get("target_modules")
    if recorded is not None and sorted(recorded) != targets:
        raise CheckFailed(
            f"{checkpoint_dir}: the adapters cover {len(targets)} modules but lora.config lists {len(recorded)}"
        )

    state = {
        MODEL_PREFIX + k: torch.empty(tuple(model_keys[k].size), dtype=model_keys[k].properties.dtype)
        for k in adapter_keys + saved_keys
    }
    load_in_process(state, checkpoint_dir)
    return LoraCheckpoint(
        path=checkpoint_dir,
        r=r,
        alpha=int(record["alpha"]),
        dropout=float(record.get("dropout", 0.0)),
        init_lora_weights=record.get("init_lora_weights", True),
        targets=tuple(targets),
        modules_to_save=tuple(modules_to_save),
        tensors={k[len(MODEL_PREFIX) :]: v for k, v in state.items()},
        base_model_name_or_path=record.get("base_model_name_or_path"),
        settings_from=source,
    )


# --------------------------------------------------------------------------- checks against the base


def _base_specs(base_dir: Path) -> dict[str, tuple[str, Any]]:
    """transformers key -> (file, TensorSpec) of the base's weights."""
    weights = read_hf_weights(base_dir)
    out = {}
    for name, specs in weights.files.items():
        for spec in specs:
            try:
                out[to_transformers_key(spec.name)] = (name, spec)
            except KeyError:
                continue
    return out


def fit_problems(ck: LoraCheckpoint, base: Mapping[str, tuple[int, ...]]) -> list[str]:
    """What keeps ``ck`` from fitting a base whose tensors have these shapes (transformers key -> shape):
    an adapted module's weight must be ``(out, in)`` of its adapters, a module to save's tensors the
    checkpoint's shapes. Empty when it fits."""
    problems = []
    for module in ck.targets:
        a, b = ck.lora_pair(module)
        found = base.get(f"{module}.weight")
        if found is None:
            problems.append(f"{module}.weight is not in the base")
        elif tuple(found) != (b.shape[0], a.shape[1]):
            problems.append(
                f"{module}.weight is {tuple(found)} in the base, the adapters make {(b.shape[0], a.shape[1])}"
            )
    for key, tensor in ck.tensors.items():
        if key.rsplit(".", 1)[0] in ck.modules_to_save:
            found = base.get(key)
            if found is None:
                problems.append(f"{key} (modules_to_save) is not in the base")
            elif tuple(found) != tuple(tensor.shape):
                problems.append(
                    f"{key} is {tuple(found)} in the base, {tuple(tensor.shape)} in the checkpoint"
                )
    return problems


def _check_against_base(ck: LoraCheckpoint, base: dict[str, tuple[str, Any]], base_dir: Path) -> None:
    problems = fit_problems(ck, {key: tuple(spec.shape) for key, (_, spec) in base.items()})
    if problems:
        raise CheckFailed(
            f"the LoRA checkpoint {ck.path} does not fit the base {base_dir}: "
            + "; ".join(problems[:5])
            + "; pass the base model the run trained on (--base)"
        )


# --------------------------------------------------------------------------- adapters


def lora_spec(ck: LoraCheckpoint):
    """(the ``model.lora`` settings, the ``LoraTargets``) ``ck`` was trained with: what
    ``lora_format.peft_config`` turns into a ``peft.LoraConfig``."""
    from magistral_cli.config.schema import LoraConfig

    from .lora_format import LoraTargets

    spec = LoraConfig(
        r=ck.r,
        alpha=ck.alpha,
        dropout=ck.dropout,
        target_modules=list(ck.targets),
        init_lora_weights=ck.init_lora_weights,
    )
    return spec, LoraTargets(modules=ck.targets, modules_to_save=ck.modules_to_save)


def write_adapter_config(ck: LoraCheckpoint, out_dir: Path, base_model_name_or_path: str | None) -> dict:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (lists sorted: stable files)."""
    from .lora_format import peft_config

    spec, targets = lora_spec(ck)
    config = peft_config(spec, targets, for_export=True, base_model_name_or_path=base_model_name_or_path)
    config.save_pretrained(str(out_dir))
    path = out_dir / ADAPTER_CONFIG
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in ("target_modules", "modules_to_save"):
        if isinstance(data.get(key), list):
            data[key] = sorted(data[key])
    path.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    return data


def export_lora_adapters(
    dcp_dir: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    fsync: bool = False,
    allow_unverified: bool = False,
) -> LoraExportResult:
    """Write PEFT's ``adapter_model.safetensors`` + ``adapter_config.json`` for the checkpoint's adapters."""
    from safetensors.torch import save_file

    from .lora_format import peft_file_key

    started = time.perf_counter()
    base_dir = require_model_dir(base_dir)
    out_dir = Path(out_dir)
    refuse_existing(out_dir, "output directory")
    ck = read_lora_checkpoint(dcp_dir, allow_unverified)
    _check_against_base(ck, _base_specs(base_dir), base_dir)
    tensors = {peft_file_key(k): v.contiguous() for k, v in ck.tensors.items()}
    with staged_directory(out_dir, "output directory") as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        write_adapter_config(ck, tmp, str(base_dir))
        if fsync:
            for path in tmp.iterdir():
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
    return LoraExportResult(
        out_dir=out_dir,
        checkpoint_dir=ck.path,
        mode="adapters",
        files=[ADAPTER_WEIGHTS, ADAPTER_CONFIG],
        tensors=len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        seconds=time.perf_counter() - started,
    )


# --------------------------------------------------------------------------- merged


def merged_weight(weight, lora_a, lora_b, scaling: float):
    """``W + scaling * (B @ A)`` in fp32, rounded once to ``W``'s dtype (PEFT's delta: ``(B @ A) * scaling``)."""
    import torch

    delta = (lora_b.to(torch.float32) @ lora_a.to(torch.float32)) * scaling
    return (weight.to(torch.float32) + delta).to(weight.dtype)


def export_lora_merged(
    dcp_dir: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    fsync: bool = False,
    progress=None,
    allow_unverified: bool = False,
) -> LoraExportResult:
    """Write the base's safetensors shards with the adapters merged into the adapted weights.

    Same files, tensor names, dtypes and index as ``base_dir``; one tensor in memory at a time
    (untouched tensors are copied file to file).
    """
    from safetensors import safe_open

    started = time.perf_counter()
    base_dir = require_model_dir(base_dir)
    out_dir = Path(out_dir)
    refuse_existing(out_dir, "output directory")
    ck = read_lora_checkpoint(dcp_dir, allow_unverified)
    base = _base_specs(base_dir)
    _check_against_base(ck, base, base_dir)
    weights = read_hf_weights(base_dir)
    targets = set(ck.targets)
    # alpha / r, as the recipe's model.lora defines it (config.schema.LoraConfig.scaling).
    scaling = lora_spec(ck)[0].scaling
    trained_full = {k for k in ck.tensors if k.rsplit(".", 1)[0] in set(ck.modules_to_save)}
    result = LoraExportResult(
        out_dir=out_dir, checkpoint_dir=ck.path, mode="merged", files=list(weights.files), tensors=0
    )
    total = weights.total_bytes
    written: set[str] = set()
    # Each file's sync (--fsync) runs while the next file is filled (StreamWriters).
    with staged_directory(out_dir, "output directory") as tmp:
        with StreamWriters(fsync) as group:
            for name, specs in weights.files.items():
                source = base_dir / name
                _, metadata = read_safetensors_header(source)
                data_start, offsets = read_data_offsets(source)
                writer = group.open(tmp / name, specs, metadata=metadata or None)
                fd = os.open(source, os.O_RDONLY)
                try:
                    with safe_open(str(source), framework="pt") as f:
                        for spec in writer.layout:
                            try:
                                key = to_transformers_key(spec.name)
                            except KeyError:
                                key = spec.name
                            module = key.rsplit(".", 1)[0]
                            if key.endswith(".weight") and module in targets:
                                lora_a, lora_b = ck.lora_pair(module)
                                tensor = merged_weight(f.get_tensor(spec.name), lora_a, lora_b, scaling)
                                result.bytes += writer.write(spec.name, tensor)
                                result.merged += 1
                                written.add(module)
                            elif key in trained_full:
                                tensor = ck.tensors[key].to(spec.torch_dtype()).contiguous()
                                result.bytes += writer.write(spec.name, tensor)
                                result.replaced += 1
                                written.add(key)
                            else:
                                begin, end = offsets[spec.name]
                                result.bytes += writer.copy_range(
                                    spec.name, fd, data_start + begin, end - begin
                                )
                                result.copied_tensors += 1
                            result.tensors += 1
                            if progress is not None:
                                progress(result.bytes, total)
                finally:
                    os.close(fd)
        missing = sorted((targets | trained_full) - written)
        if missing:
            raise CheckFailed(f"the base {base_dir} has no tensor for {missing[:5]}; nothing was written")
        if read_weight_index(base_dir) is not None:
            shutil.copyfile(base_dir / WEIGHT_INDEX, tmp / WEIGHT_INDEX)
        for path in support_files(base_dir):
            shutil.copyfile(path, tmp / path.name)
            result.copied.append(path.name)
    result.seconds = time.perf_counter() - started
    return result


def export_lora_merged_native(
    dcp_dir: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    fsync: bool = False,
    progress=None,
    allow_unverified: bool = False,
) -> LoraExportResult:
    """The merged weights (as ``export_lora_merged`` computes them) in Mistral's native layout:
    the base's tensors written by ``dcp_to_hf.export_hf_to_native`` with the merge folded in."""
    from .dcp_to_hf import export_hf_to_native

    started = time.perf_counter()
    base_dir = require_model_dir(base_dir)
    refuse_existing(Path(out_dir), "output directory")
    ck = read_lora_checkpoint(dcp_dir, allow_unverified)
    _check_against_base(ck, _base_specs(base_dir), base_dir)
    targets = set(ck.targets)
    trained_full = {k for k in ck.tensors if k.rsplit(".", 1)[0] in set(ck.modules_to_save)}
    counts = {"merged": 0, "replaced": 0}
    scaling = lora_spec(ck)[0].scaling  # alpha / r: config.schema.LoraConfig.scaling

    def replace(key: str, read):
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and module in targets:
            counts["merged"] += 1
            return merged_weight(read(), *ck.lora_pair(module), scaling)
        if key in trained_full:
            counts["replaced"] += 1
            return ck.tensors[key].to(read().dtype).contiguous()
        return None

    written = export_hf_to_native(
        base_dir, out_dir, progress=progress, fsync=fsync, replace=replace, checkpoint_dir=ck.path
    )
    return LoraExportResult(
        out_dir=written.out_dir,
        checkpoint_dir=ck.path,
        mode="merged",
        files=written.files,
        tensors=written.tensors,
        merged=counts["merged"],
        replaced=counts["replaced"],
        copied_tensors=written.tensors - counts["merged"] - counts["replaced"],
        bytes=written.bytes,
        seconds=time.perf_counter() - started,
        copied=written.copied,
    )


def export_lora(
    dcp_dir: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    mode: str,
    fsync: bool = False,
    progress=None,
    allow_unverified: bool = False,
    format: str = "hf",
) -> LoraExportResult:
    """``mode`` ``adapters`` (PEFT files) or ``merged`` (full weights: HF, or with ``format="mistral"``
    Mistral's native layout) of a LoRA training checkpoint."""
    if format == "mistral":
        if mode != "merged":
            raise UserError(
                "--format mistral writes full weights: use it with --lora merged (adapters are PEFT files)"
            )
        return export_lora_merged_native(
            dcp_dir, base_dir, out_dir, fsync=fsync, progress=progress, allow_unverified=allow_unverified
        )
    if mode == "adapters":
        return export_lora_adapters(
            dcp_dir, base_dir, out_dir, fsync=fsync, allow_unverified=allow_unverified
        )
    if mode == "merged":
        return export_lora_merged(
            dcp_dir, base_dir, out_dir, fsync=fsync, progress=progress, allow_unverified=allow_unverified
        )
    raise UserError(f"unknown --lora {mode!r}; use one of {', '.join(MODES)}")


def default_base(dcp_dir: str | Path, allow_unverified: bool = False) -> Path | None:
    """The base model directory the run trained on (``model.model_name_or_path`` it recorded), if it exists."""
    try:
        ck_dir = resolve_dcp_checkpoint(dcp_dir, allow_unverified)
    except UserError:
        return None
    from .lora_format import read_checkpoint_record

    record = read_checkpoint_record(ck_dir) or _settings_from_run(ck_dir)[0] or {}
    base = record.get("base_model_name_or_path")
    return Path(base) if base and (Path(base) / CONFIG).is_file() else None
