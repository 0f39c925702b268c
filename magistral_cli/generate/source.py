"""What ``--model`` names (:func:`resolve_source`) and loading it (:func:`load_model`).

- an HF model directory (``config.json`` + safetensors, official or transformers key layout):
  ``Mistral3ForConditionalGeneration.from_pretrained`` (transformers 5 maps the official
  ``language_model.model.*`` keys itself), with the tying rule of :mod:`magistral_cli.model_config`;
- a training checkpoint (a run directory, its ``checkpoints/``, or ``checkpoints/step_N``; also a
  ``convert hf-to-dcp`` output with ``--base``), verified against its integrity record as every
  reader of one is (``checkpoint.validate.resolve_dcp_checkpoint``: from a run, the newest intact
  checkpoint; ``--allow-unverified`` for one without a record): the model tensors are read by the export path
  (:func:`magistral_cli.checkpoint.dcp_to_hf.read_dcp_model_state`, the same key, shape and dtype
  checks as ``convert dcp-to-hf``) straight into a model built from the base's config.json
  (``--base``, else the run's ``model.model_name_or_path``); no directory is written. A LoRA run's
  checkpoint (adapters only) is the base plus PEFT's LoRA layers holding the trained adapters, as
  in training;
- a base model plus PEFT adapters (``--adapter DIR``: ``adapter_config.json`` +
  ``adapter_model.safetensors``), through ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magistral_cli.checkpoint.hf import CONFIG, SINGLE_WEIGHTS, WEIGHT_INDEX
from magistral_cli.checkpoint.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MEGATRON_RELEASE_DIR, is_dcp_dir
from magistral_cli.errors import CheckFailed, UserError
from magistral_cli.run_record import RESOLVED_CONFIG

DEVICES = ("auto", "cpu", "cuda", "npu")
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")


# --------------------------------------------------------------------------- what --model names


@dataclass
class ModelSource:
    """What ``--model`` (with ``--base`` / ``--adapter``) resolves to."""

    kind: str  # "hf", "checkpoint" (full weights in DCP) or "lora_checkpoint" (adapters in DCP)
    model_dir: Path  # the HF directory: the model itself (hf) or the base config + tokenizer
    checkpoint: Path | None = None
    recipe: Any = None  # the run's resolved recipe, when there is one
    recipe_path: Path | None = None
    adapter: Path | None = None
    #: Read a training checkpoint that has no integrity record (``--allow-unverified``).
    allow_unverified: bool = False

    def describe(self) -> str:
        if self.kind == "hf":
            what = f"HF model {self.model_dir}"
        else:
            lora = "LoRA " if self.kind == "lora_checkpoint" else ""
            what = f"{lora}training checkpoint {self.checkpoint} (base {self.model_dir})"
        return what + (f" + adapter {self.adapter}" if self.adapter else "")

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "model_dir": str(self.model_dir),
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "recipe": str(self.recipe_path) if self.recipe_path else None,
            "adapter": str(self.adapter) if self.adapter else None,
        }


def _has_weights(path: Path) -> bool:
    return (path / WEIGHT_INDEX).is_file() or (path / SINGLE_WEIGHTS).is_file()


def _read_run_recipe(path: Path):
    from magistral_cli.config.loader import read_yaml, validate_recipe

    return validate_recipe(read_yaml(path), source=f"run recipe {path}")


def _find_run_recipe(checkpoint: Path) -> Path | None:
    for run_dir in (checkpoint.parent.parent, checkpoint.parent):
        if (run_dir / RESOLVED_CONFIG).is_file():
            return run_dir / RESOLVED_CONFIG
    return None


def resolve_source(
    model: str | Path,
    adapter: str | Path | None = None,
    base: str | Path | None = None,
    allow_unverified: bool = False,
) -> ModelSource:
    """Classify ``--model``: an HF directory, a run / training checkpoint, or a mistake (UserError).

    A checkpoint is verified here (``CheckFailed`` naming a damaged file), before anything is loaded.
    """
    from magistral_cli.checkpoint.validate import resolve_dcp_checkpoint
    from magistral_cli.engine.checkpoint import checkpoints_dir, resolve_save_dir

    path = Path(model).expanduser()
    if not path.exists():
        raise UserError(
            f"--model {path} does not exist; pass a local model directory (`magistral fetch` writes one), "
            "a run directory or one of its checkpoints/step_N"
        )
    if not path.is_dir():
        raise UserError(
            f"--model {path} is a file, not a directory; pass the directory that holds config.json"
        )
    adapter_dir = _check_adapter_dir(adapter) if adapter is not None else None
    if (path / ADAPTER_CONFIG).is_file() and not (path / CONFIG).is_file():
        raise UserError(
            f"--model {path} holds PEFT adapters ({ADAPTER_CONFIG}), not a model; pass the base model and the "
            f"adapters: --model BASE_DIR --adapter {path}"
        )
    if (path / CONFIG).is_file() and _has_weights(path):
        if base is not None:
            raise UserError(
                f"--base is for training checkpoints; {path} is an HF model directory: drop --base"
            )
        return ModelSource("hf", path, adapter=adapter_dir)

    recipe_path = path / RESOLVED_CONFIG if (path / RESOLVED_CONFIG).is_file() else None
    recipe = _read_run_recipe(recipe_path) if recipe_path else None
    search = None
    if recipe is not None:
        search = resolve_save_dir(recipe.training.save, path)
    if search is None or not search.is_dir():
        search = checkpoints_dir(path)
    if search is None and (is_dcp_dir(path) or is_dcp_dir(path / MEGATRON_RELEASE_DIR)):
        search = path
    if search is None:
        if (path / CONFIG).is_file():
            raise UserError(
                f"--model {path} has {CONFIG} but no weights ({WEIGHT_INDEX} or "
                f"{SINGLE_WEIGHTS}); download them with `magistral fetch` (without --no-weights)"
            )
        raise UserError(
            f"--model {path} is not a model: no config.json with safetensors weights (an HF model directory), "
            "no DCP checkpoint (.metadata) and no checkpoints/step_N (a training run); pass one of those"
        )
    checkpoint = resolve_dcp_checkpoint(search, allow_unverified)
    if recipe is None:
        recipe_path = _find_run_recipe(checkpoint)
        recipe = _read_run_recipe(recipe_path) if recipe_path else None

    if base is not None:
        base_dir = Path(base).expanduser()
    elif recipe is not None and recipe.model.model_name_or_path:
        base_dir = Path(recipe.model.model_name_or_path).expanduser()
        if not (base_dir / CONFIG).is_file():
            raise UserError(
                f"the run's model.model_name_or_path {base_dir} (in {recipe_path}) is not a model directory here; "
                "pass --base DIR, the HF model directory the run trained on"
            )
    else:
        raise UserError(
            f"{checkpoint} is a DCP checkpoint without a run recipe ({RESOLVED_CONFIG}) next to it; pass --base DIR, "
            "the HF model directory it belongs to (config.json and tokenizer)"
        )
    if not base_dir.is_dir() or not (base_dir / CONFIG).is_file():
        raise UserError(
            f"--base {base_dir} is not a model directory (no config.json); pass the run's base model"
        )

    from magistral_cli.checkpoint.lora_export import is_lora_checkpoint

    kind = "lora_checkpoint" if is_lora_checkpoint(checkpoint, allow_unverified) else "checkpoint"
    if kind == "lora_checkpoint" and adapter_dir is not None:
        raise UserError(
            f"{checkpoint} is a LoRA run's checkpoint: it is the base plus its own adapters; drop --adapter"
        )
    return ModelSource(kind, base_dir, checkpoint, recipe, recipe_path, adapter_dir, allow_unverified)


def _check_adapter_dir(adapter: str | Path) -> Path:
    path = Path(adapter).expanduser()
    if not path.is_dir():
        raise UserError(
            f"--adapter {path} is not a directory; pass the PEFT adapter directory ({ADAPTER_CONFIG} + "
            f"{ADAPTER_WEIGHTS}, as `magistral convert dcp-to-hf --lora adapters` writes)"
        )
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / name).is_file()]
    if missing:
        raise UserError(
            f"--adapter {path} has no {' and no '.join(missing)}; pass a PEFT adapter directory "
            "(`magistral convert dcp-to-hf --lora adapters` writes one)"
        )
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path / ADAPTER_CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise UserError(
            f"{path / ADAPTER_CONFIG} is not a LoRA adapter config (peft_type {config.get('peft_type')!r})"
        )
    return path


# --------------------------------------------------------------------------- the model


def resolve_device(requested: str):
    """``--device`` as a torch.device (auto: npu, then cuda, then cpu), set current."""
    from magistral_cli.runtime import resolve_device as resolve_requested
    from magistral_cli.runtime import set_device

    if requested not in DEVICES:
        raise UserError(f"--device {requested!r}: use one of {', '.join(DEVICES)}")
    resolved = resolve_requested(requested)
    device_type = resolved.type
    if device_type == "cuda" and resolved.problem is not None:
        raise UserError("--device cuda: no CUDA device is visible here; use --device cpu (or auto)")
    try:
        return set_device(device_type, 0)
    except (ImportError, RuntimeError) as exc:
        raise UserError(
            f"--device {device_type}: the device cannot be used ({exc}); use --device cpu (or auto)"
        ) from None


def resolve_dtype(requested: str, model_dir: Path):
    """``--dtype``: auto is config.json's dtype (bfloat16 for Magistral), float32 without one."""
    import torch

    from magistral_cli.checkpoint.validate import config_dtype
    from magistral_cli.runtime import parse_dtype

    if requested == "auto":
        name = config_dtype(model_dir)
        return getattr(torch, name) if name else torch.float32
    try:
        return parse_dtype(requested)
    except ValueError as exc:
        raise UserError(f"--dtype: {exc}") from None


def _quiet_transformers():
    import transformers

    transformers.utils.logging.disable_progress_bar()


def _load_hf(model_dir: Path, dtype, device):
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.model_config import read_model_config

    config = read_model_config(model_dir, what="--model")
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype, "local_files_only": True}
    if device.type != "cpu":
        kwargs["device_map"] = str(device)
    try:
        model = Mistral3ForConditionalGeneration.from_pretrained(str(model_dir), **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise UserError(f"cannot load the model in {model_dir}: {exc}") from None
    return model.to(device).eval()


def _load_checkpoint(source: ModelSource, dtype, device):
    """The base's architecture on ``device`` in ``dtype``, its tensors read from the DCP checkpoint."""
    import torch
    from transformers import GenerationConfig, Mistral3ForConditionalGeneration

    from magistral_cli.checkpoint.dcp_to_hf import read_dcp_model_state
    from magistral_cli.checkpoint.validate import resolve_dcp_checkpoint
    from magistral_cli.engine.model import materialize
    from magistral_cli.engine.weights import load_targets
    from magistral_cli.model_config import read_model_config, text_ties

    config = read_model_config(source.model_dir, what="--base")
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration._from_config(config, dtype=dtype)
    materialize(model, device)  # storage for the parameters, rotary buffers recomputed in fp32
    if text_ties(config):
        model.tie_weights()
    # Verified (again, or found unchanged since resolve_source): damage is CheckFailed, not a misfit.
    checkpoint = resolve_dcp_checkpoint(source.checkpoint, source.allow_unverified)
    try:
        read_dcp_model_state(
            checkpoint,
            source.model_dir,
            into=load_targets(model),
            allow_dtype_mismatch=True,
            allow_unverified=source.allow_unverified,
        )
    except CheckFailed as exc:
        problem = str(exc).replace(
            "Pass a checkpoint of the model that --model-dir's config.json describes.", ""
        )
        raise UserError(
            f"{problem.rstrip()} The checkpoint does not fit the base {source.model_dir}: pass --base DIR, the model "
            "directory the run trained on"
        ) from None
    if (source.model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(
            str(source.model_dir), local_files_only=True
        )
    return model.eval()


def _apply_lora_checkpoint(model, checkpoint: Path, allow_unverified: bool = False) -> dict:
    """PEFT's LoRA layers in ``model`` (as training injects them) holding the checkpoint's adapters."""
    from peft import inject_adapter_in_model

    from magistral_cli.checkpoint.lora_export import fit_problems, lora_spec, read_lora_checkpoint
    from magistral_cli.checkpoint.lora_format import ADAPTER, peft_config

    ck = read_lora_checkpoint(checkpoint, allow_unverified)
    problems = fit_problems(ck, {key: tuple(value.shape) for key, value in model.state_dict().items()})
    if problems:
        raise UserError(
            f"the LoRA checkpoint {checkpoint} does not fit the base: {'; '.join(problems[:5])}; pass --base DIR, "
            "the base model the run trained on"
        )
    spec, targets = lora_spec(ck)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        inject_adapter_in_model(peft_config(spec, targets), model, adapter_name=ADAPTER)
    state = model.state_dict()
    for key, value in ck.tensors.items():
        if key not in state or tuple(state[key].shape) != tuple(value.shape):
            raise UserError(
                f"the LoRA checkpoint {checkpoint}: {key} does not fit the base; pass the run's base (--base)"
            )
    model.load_state_dict(ck.tensors, strict=False)
    return {
        "r": ck.r,
        "alpha": ck.alpha,
        "targets": len(ck.targets),
        "modules_to_save": list(ck.modules_to_save),
    }


def _check_adapter_fits(model, adapter: Path) -> None:
    """The adapter's tensors must fit the base's modules (before PEFT loads them)."""
    from magistral_cli.checkpoint.safetensors_io import read_safetensors_header

    try:
        specs, _ = read_safetensors_header(adapter / ADAPTER_WEIGHTS)
    except (OSError, ValueError) as exc:
        raise UserError(f"{adapter / ADAPTER_WEIGHTS} is not a safetensors file ({exc})") from None
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    problems = []
    for spec in specs:
        key = spec.name.removeprefix("base_model.model.")
        for part, dim in ((".lora_A.weight", "in_features"), (".lora_B.weight", "out_features")):
            if key.endswith(part):
                module = modules.get(key[: -len(part)])
                if module is None:
                    problems.append(f"{key[: -len(part)]} is not a module of the base")
                elif getattr(module, dim, None) not in (
                    None,
                    spec.shape[1 if part == ".lora_A.weight" else 0],
                ):
                    problems.append(
                        f"{key[: -len(part)]} has {dim}={getattr(module, dim)} in the base, the adapter has "
                        f"{spec.shape[1 if part == '.lora_A.weight' else 0]}"
                    )
                break
        else:
            if key in params and tuple(params[key].shape) != tuple(spec.shape):
                problems.append(
                    f"{key} is {tuple(params[key].shape)} in the base, {tuple(spec.shape)} in the adapter"
                )
    if problems:
        config = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        recorded = config.get("base_model_name_or_path")
        raise UserError(
            f"the adapter {adapter} does not fit this base model: {'; '.join(problems[:5])}"
            + (f" ({len(problems)} problems)" if len(problems) > 5 else "")
            + "; pass the base it was trained on as --model"
            + (f" (its {ADAPTER_CONFIG} names {recorded})" if recorded else "")
        )


def _apply_adapter(model, adapter: Path):
    from peft import PeftModel

    _check_adapter_fits(model, adapter)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            return PeftModel.from_pretrained(model, str(adapter), is_trainable=False).eval()
    except (ValueError, RuntimeError, KeyError, OSError) as exc:
        raise UserError(
            f"cannot load the adapter {adapter} onto the base: {exc}; pass the base it was trained on as --model"
        ) from None


def load_model(source: ModelSource, device: str = "auto", dtype: str = "auto"):
    """(model, torch device, torch dtype, LoRA record or None): the model ``source`` names on
    ``device`` (``--device``) in ``dtype`` (``--dtype``)."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, source.model_dir)
    _quiet_transformers()
    lora = None
    if source.kind == "hf":
        model = _load_hf(source.model_dir, torch_dtype, torch_device)
    elif source.kind == "checkpoint":
        model = _load_checkpoint(source, torch_dtype, torch_device)
    else:
        model = _load_hf(source.model_dir, torch_dtype, torch_device)
        lora = _apply_lora_checkpoint(model, source.checkpoint, source.allow_unverified)
        model.eval()
    if source.adapter is not None:
        model = _apply_adapter(model, source.adapter)
    return model, torch_device, torch_dtype, lora
