"""Chatting with a checkpoint: ``magistral generate``.

What it loads (:func:`resolve_source`, :func:`load_generator`):

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

What it sends (:class:`PromptEncoder`): the conversation up to the assistant turn, encoded by the
preprocessing :class:`~magistral_cli.data.encoder.Encoder` itself (template ``mistral``, the
Pixtral image plugin, the recipe's tokenizer and processor options when generating from a run),
so the prompt ids are exactly the prefix of a training sample that precedes its answer. The
encoder takes whole conversations only; the generation prompt is the encoding of the
conversation with a placeholder answer, with that answer's tokens and ``</s>`` cut off again
(the template tokenizes each text piece on its own, so the prefix is unchanged). Pixel values are
computed by the data loader's function and batched by its collator.

Generation is transformers' own ``generate`` (sampling with temperature 0.7 and top-p 0.95 as
the model card recommends, or greedy), one conversation at a time.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magistral_cli.checkpoint.hf import CONFIG, SINGLE_WEIGHTS, WEIGHT_INDEX
from magistral_cli.checkpoint.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MEGATRON_RELEASE_DIR, is_dcp_dir
from magistral_cli.errors import CheckFailed, UserError
from magistral_cli.run_record import RESOLVED_CONFIG

#: Sampling defaults of Magistral-Small-2509's model card.
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_NEW_TOKENS = 1024
DEVICES = ("auto", "cpu", "cuda", "npu")
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
#: The placeholder answer appended to a conversation that ends with a user turn (see the module doc).
_PLACEHOLDER_ANSWER = "x"
#: Long enough that the encoder never truncates a prompt (the model's context is checked instead).
_NO_CUTOFF = 1 << 40


# --------------------------------------------------------------------------- options and results


@dataclass
class SamplingOptions:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    greedy: bool = False
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if not self.greedy:
            if not self.temperature > 0:
                raise UserError(
                    f"--temperature must be > 0 (got {self.temperature}); use --greedy for argmax"
                )
            if not 0 < self.top_p <= 1:
                raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})")

    def to_dict(self) -> dict:
        if self.greedy:
            return {"greedy": True, "max_new_tokens": self.max_new_tokens, "seed": self.seed}
        return {
            "greedy": False,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


@dataclass
class EncodedPrompt:
    """A conversation up to its assistant turn: the ids the model gets and its images."""

    input_ids: list[int]
    images: list[str]
    image_sizes: list[tuple[int, int]]  # (height, width) after resizing, as preprocess records them
    #: The answer the input conversation ended with, if it did (batch input from a dataset).
    reference: str | None = None


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # the generated ids (a final </s> included when generation stopped there)
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (</s>) or "length" (--max-new-tokens)
    seconds: float

    def to_dict(self, prompt_ids: bool = False) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_token_ids),
            "generated_tokens": len(self.token_ids),
            "seconds": round(self.seconds, 3),
        }
        if prompt_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


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


# --------------------------------------------------------------------------- prompts


@dataclass
class PromptEncoder:
    """The preprocessing encoder, set up as training was: tokenizer, processor, template default."""

    tokenizer: Any  # data.tokenizer.TekkenTokenizer
    settings: Any  # data.pixtral.ImageSettings
    default_system: str  # resolved: "" = no system block
    fmt: Any  # data.readers.RecordFormat of batch input (the run's data.dataset_param.attr)
    tokenizer_dir: Path

    @classmethod
    def for_source(cls, source: ModelSource) -> PromptEncoder:
        """From the run's data section when there is a run, else the recipe defaults, as preprocess."""
        from magistral_cli.config.schema import Data
        from magistral_cli.data.pixtral import load_image_settings
        from magistral_cli.data.readers import RecordFormat
        from magistral_cli.data.template import check_template, resolve_default_system
        from magistral_cli.data.tokenizer import check_against_model_config, load_tokenizer

        data = source.recipe.data if source.recipe is not None else Data()
        pre, basic = data.dataset_param.preprocess_parameters, data.dataset_param.basic_parameters
        check_template(basic.template)
        tokenizer_dir = source.model_dir
        if source.recipe is not None and pre.model_name_or_path and Path(pre.model_name_or_path).is_dir():
            tokenizer_dir = Path(pre.model_name_or_path)
        tokenizer = load_tokenizer(
            tokenizer_dir, pre.tokenizer_source, pre.fix_mistral_regex, pre.split_special_tokens
        )
        config_path = source.model_dir / CONFIG
        check_against_model_config(
            tokenizer.special, json.loads(config_path.read_text(encoding="utf-8")), config_path
        )
        settings = load_image_settings(
            tokenizer_dir, pre.image_min_pixels, pre.image_max_pixels, pre.image_grid
        )
        return cls(
            tokenizer=tokenizer,
            settings=settings,
            default_system=resolve_default_system(basic.default_system),
            fmt=RecordFormat.from_attr(data.dataset_param.attr),
            tokenizer_dir=tokenizer_dir,
        )

    def _encoder(self, fmt, dataset_dir: Path, default_system: str):
        from magistral_cli.data.encoder import EncodeParams, Encoder

        params = EncodeParams(
            cutoff_len=_NO_CUTOFF,
            train_on_prompt=False,
            mask_history=False,
            default_system=default_system,
            dataset_dir=str(dataset_dir),
        )
        return Encoder(self.tokenizer, self.settings, params, fmt)

    def encode_record(
        self,
        record: Any,
        *,
        fmt=None,
        dataset_dir: Path | None = None,
        system: str | None = None,
        index: int = 0,
    ) -> EncodedPrompt:
        """One record (LLaVA ``messages`` + ``images``, or ShareGPT) as a generation prompt.

        A conversation that ends with an assistant turn is answered anew: that turn is left out
        (and kept as ``reference``). ``system`` replaces the default system prompt (a record's
        own system message still wins; ``""`` means none). Raises ``_Dropped`` for a record the
        preprocessing would drop.
        """
        from magistral_cli.data.encoder import EncodedSample
        from magistral_cli.data.readers import RowSource

        fmt = fmt or self.fmt
        record, reference = _with_placeholder_answer(record, fmt)
        encoder = self._encoder(
            fmt, dataset_dir or Path.cwd(), self.default_system if system is None else system
        )
        (result,) = encoder.encode_rows([RowSource(index, record)])
        if not isinstance(result, EncodedSample):
            raise _Dropped(result.reason, result.detail)
        tail = [*self.tokenizer.encode(_PLACEHOLDER_ANSWER), self.tokenizer.special.eos]
        ids = result.input_ids.tolist()
        if ids[-len(tail) :] != tail:  # the template changed: the prefix would not be the prompt
            raise CheckFailed(
                "the encoder's output does not end with the placeholder answer; report this bug"
            )
        sizes = [(int(h), int(w)) for h, w in result.image_sizes.tolist()]
        return EncodedPrompt(ids[: -len(tail)], list(result.images), sizes, reference)

    def encode_prompt(
        self, prompt: str, images: list[str] | None = None, system: str | None = None
    ) -> EncodedPrompt:
        """``--prompt`` with ``--image`` files: one user turn. Images without ``<image>`` placeholders in
        the prompt go before its text (mistral-common's order for image chunks followed by text)."""
        from magistral_cli.config.schema import DatasetAttr
        from magistral_cli.data.readers import DROP_REASONS, IMAGE_PLACEHOLDER, RecordFormat

        images = [str(Path(p).expanduser().absolute()) for p in images or []]
        for path in images:
            if not Path(path).is_file():
                what = "a directory" if Path(path).is_dir() else "not found"
                raise UserError(f"--image {path}: {what}; pass an image file (PNG, JPEG, ...)")
        placeholders = prompt.count(IMAGE_PLACEHOLDER)
        if placeholders and placeholders != len(images):
            raise UserError(
                f"the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} --image file(s) "
                f"were given; give one --image per {IMAGE_PLACEHOLDER}, or no placeholder to put the images first"
            )
        if not placeholders:
            prompt = IMAGE_PLACEHOLDER * len(images) + prompt
        if not prompt.replace(IMAGE_PLACEHOLDER, "").strip() and not images:
            raise UserError("--prompt is empty; pass the text to answer")
        record = {"messages": [{"role": "user", "content": prompt}], "images": images}
        try:
            return self.encode_record(record, fmt=RecordFormat.from_attr(DatasetAttr()), system=system)
        except _Dropped as drop:
            if drop.reason in ("unreadable_image", "missing_image", "unusable_image_size"):
                raise UserError(f"--image: {drop.detail}; pass an image file that Pillow can read") from None
            raise UserError(
                f"cannot encode the prompt: {DROP_REASONS.get(drop.reason, drop.reason)} ({drop.detail})"
            ) from None

    def prompt_text(self, prompt: EncodedPrompt) -> str:
        """The prompt decoded, special tokens visible, image blocks summarized (``--show-tokens``)."""
        import numpy as np

        from magistral_cli.data.encoder import IGNORE_INDEX
        from magistral_cli.data.inspection import sample_spans

        ids = np.asarray(prompt.input_ids)
        return "".join(s.text for s in sample_spans(ids, np.full_like(ids, IGNORE_INDEX), self.tokenizer))

    def model_inputs(self, prompt: EncodedPrompt, device, dtype) -> dict:
        """``input_ids``, ``attention_mask`` and, with images, ``pixel_values`` / ``image_sizes``: the
        data loader's pixel values and the training collator's batching, for a batch of one."""
        import numpy as np

        from magistral_cli.data.collator import PixtralCollator
        from magistral_cli.data.encoder import IGNORE_INDEX
        from magistral_cli.data.pixtral import load_pixel_values

        pixels = []
        for path, size in zip(prompt.images, prompt.image_sizes, strict=True):
            try:
                pixels.append(load_pixel_values(path, self.settings, expected_hw=size))
            except (OSError, RuntimeError) as exc:
                raise UserError(f"cannot read image {path}: {exc}") from None
        ids = np.asarray(prompt.input_ids, dtype=np.int64)
        batch = PixtralCollator(self.tokenizer.special.pad)(
            [
                {
                    "input_ids": ids,
                    "labels": np.full_like(ids, IGNORE_INDEX),
                    "position_ids": np.arange(len(ids), dtype=np.int64),
                    "pixel_values": pixels,
                }
            ]
        )
        out = {
            "input_ids": batch["input_ids"].to(device),
            "attention_mask": batch["attention_mask"].to(device),
        }
        if pixels:
            out["pixel_values"] = batch["pixel_values"].to(device=device, dtype=dtype)
            out["image_sizes"] = batch["image_sizes"].to(device)
        return out


class _Dropped(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _with_placeholder_answer(record: Any, fmt) -> tuple[Any, str | None]:
    """``record`` ending with an assistant turn holding the placeholder answer; the answer it had."""
    if not isinstance(record, dict):
        return record, None
    key, role, content, assistant = fmt.messages, fmt.role_tag, fmt.content_tag, fmt.assistant
    if key not in record and fmt.sharegpt_fallback and "conversations" in record:
        key, role, content, assistant = "conversations", "from", "value", "gpt"
    messages = record.get(key)
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return record, None
    reference = None
    if messages[-1].get(role) == assistant:
        reference = messages[-1].get(content)
        messages = messages[:-1]
    return {**record, key: [*messages, {role: assistant, content: _PLACEHOLDER_ANSWER}]}, reference


# --------------------------------------------------------------------------- the model


def resolve_device(requested: str):
    """``--device`` as a torch.device (auto: npu, then cuda, then cpu), set current."""
    import torch

    from magistral_cli.runtime import detect_device, set_device

    if requested not in DEVICES:
        raise UserError(f"--device {requested!r}: use one of {', '.join(DEVICES)}")
    device_type = detect_device()[0] if requested == "auto" else requested
    if device_type == "cuda" and not torch.cuda.is_available():
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


@dataclass
class Generator:
    source: ModelSource
    model: Any
    encoder: PromptEncoder
    device: Any
    dtype: Any
    load_seconds: float = 0.0
    lora: dict | None = None
    _eos_ids: set[int] = field(default_factory=set)

    @property
    def max_positions(self) -> int | None:
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else None
        return getattr(text, "max_position_embeddings", None)

    def generate(
        self, prompt: EncodedPrompt, options: SamplingOptions, on_text: Callable[[str], None] | None = None
    ) -> Completion:
        """transformers' ``generate`` on the prompt; ``on_text`` receives the text as it is produced."""
        import torch
        import transformers

        options.check()
        limit = self.max_positions
        if limit is not None and len(prompt.input_ids) >= limit:
            raise UserError(
                f"the prompt has {len(prompt.input_ids)} tokens, the model's context is {limit}; shorten it"
            )
        inputs = self.encoder.model_inputs(prompt, self.device, self.dtype)
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = options.max_new_tokens
        config.pad_token_id = self.encoder.tokenizer.special.pad
        if config.eos_token_id is None:
            config.eos_token_id = self.encoder.tokenizer.special.eos
        if options.greedy:
            config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        else:
            config.do_sample, config.temperature, config.top_p, config.top_k = (
                True,
                options.temperature,
                options.top_p,
                None,
            )
        if options.seed is not None:
            transformers.set_seed(options.seed)
        streamer = _Streamer(self.encoder.tokenizer, on_text) if on_text is not None else None
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=config, streamer=streamer)
        seconds = time.perf_counter() - started
        generated = out[0, inputs["input_ids"].shape[1] :].tolist()
        eos = config.eos_token_id
        eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
        finish = "stop" if generated and generated[-1] in eos_ids else "length"
        text_ids = generated[:-1] if finish == "stop" else generated
        return Completion(
            text=self.encoder.tokenizer.decode(text_ids),
            token_ids=generated,
            prompt_token_ids=list(prompt.input_ids),
            finish_reason=finish,
            seconds=seconds,
        )

    def describe(self) -> dict:
        import torch

        return {
            **self.source.to_dict(),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "tokenizer": str(self.encoder.tokenizer_dir),
            "default_system": self.encoder.default_system != "",
            "parameters": sum(p.numel() for p in self.model.parameters())
            if isinstance(self.model, torch.nn.Module)
            else None,
            "load_seconds": round(self.load_seconds, 3),
            **({"lora": self.lora} if self.lora else {}),
        }


class _Streamer:
    """A transformers streamer that hands on the new text after each token (whole characters only).

    Only the tokens since the last newline are decoded again at each step, so a long answer costs
    no more than its longest line.
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.pending: list[int] = []  # tokens since the last newline that was handed on
        self.sent = 0  # characters of ``pending``'s text already handed on
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate passes the prompt first
            self.prompt_seen = True
            return
        eos = self.tokenizer.special.eos
        self.pending.extend(i for i in (int(t) for t in value.reshape(-1).tolist()) if i != eos)
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd") and not final:  # half a UTF-8 character: wait for the rest
            return
        if len(text) > self.sent:
            self.on_text(text[self.sent :])
        self.sent = len(text)
        if text.endswith("\n"):
            self.pending, self.sent = [], 0


def load_generator(
    source: ModelSource, *, device: str = "auto", dtype: str = "auto", encoder: PromptEncoder | None = None
) -> Generator:
    """Load the model that ``source`` names onto ``device`` (``--device``) in ``dtype`` (``--dtype``)."""
    started = time.perf_counter()
    encoder = encoder or PromptEncoder.for_source(source)
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
    return Generator(source, model, encoder, torch_device, torch_dtype, time.perf_counter() - started, lora)


# --------------------------------------------------------------------------- batch


def read_conversations(
    encoder: PromptEncoder, input_path: Path, system: str | None = None
) -> list[tuple[int, EncodedPrompt]]:
    """Every record of a JSON Lines (or JSON array) file as a generation prompt; images are relative
    to the file's directory. A record the preprocessing would drop is an error naming its row."""
    from magistral_cli.data.readers import DROP_REASONS, read_rows

    input_path = Path(input_path)
    if not input_path.is_file():
        raise UserError(f"--input {input_path} does not exist; pass a JSON Lines file of conversations")
    rows = read_rows(input_path)
    prompts, problems = [], []
    for row in rows:
        if row.error is not None:
            problems.append(f"row {row.index}: {row.error}")
            continue
        try:
            prompts.append(
                (
                    row.index,
                    encoder.encode_record(
                        row.record, dataset_dir=input_path.parent.absolute(), system=system, index=row.index
                    ),
                )
            )
        except _Dropped as drop:
            problems.append(f"row {row.index}: {DROP_REASONS.get(drop.reason, drop.reason)} ({drop.detail})")
    if problems:
        raise UserError(
            f"{input_path}: {len(problems)} of {len(rows)} conversation(s) cannot be encoded; fix or remove them:\n  "
            + "\n  ".join(problems[:10])
            + ("\n  ..." if len(problems) > 10 else "")
        )
    return prompts


def generate_batch(
    generator: Generator,
    prompts: list[tuple[int, EncodedPrompt]],
    output_path: Path,
    options: SamplingOptions,
    progress: Callable[[int, int], None] | None = None,
    prompt_ids: bool = False,
) -> dict:
    """Answer every prompt; one JSON line per conversation in ``output_path`` (written whole at the end),
    with the prompt's ids too when ``prompt_ids``.

    With ``--seed`` every conversation starts from that seed: its line equals a single
    ``generate`` of it with the same seed, whatever the other rows.
    """
    output_path = Path(output_path)
    if not output_path.parent.is_dir():
        raise UserError(f"--output {output_path}: the directory {output_path.parent} does not exist")
    tmp = output_path.with_name(output_path.name + ".partial")
    started = time.perf_counter()
    generated = 0
    finish = {"stop": 0, "length": 0}
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            for n, (index, prompt) in enumerate(prompts):
                completion = generator.generate(prompt, options)
                line = {"index": index, **completion.to_dict(prompt_ids)}
                if prompt.reference is not None:
                    line["reference"] = prompt.reference
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")
                generated += len(completion.token_ids)
                finish[completion.finish_reason] += 1
                if progress is not None:
                    progress(n + 1, len(prompts))
        tmp.replace(output_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "output": str(output_path),
        "conversations": len(prompts),
        "generated_tokens": generated,
        "finish_reasons": finish,
        "seconds": round(time.perf_counter() - started, 3),
    }
