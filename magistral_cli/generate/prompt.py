"""What ``generate`` sends (:class:`PromptEncoder`): a conversation up to its assistant turn as ids.

The conversation is encoded by the preprocessing :class:`~magistral_cli.data.encoder.Encoder`
itself (template ``mistral``, the Pixtral image plugin, the recipe's tokenizer and processor
options when generating from a run), so the prompt ids are exactly the prefix of a training sample
that precedes its answer. The encoder takes whole conversations only; the generation prompt is the
encoding of the conversation with a placeholder answer, with that answer's tokens and ``</s>`` cut
off again (the template tokenizes each text piece on its own, so the prefix is unchanged). Pixel
values are computed by the data loader's function and batched by its collator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magistral_cli.checkpoint.hf import CONFIG
from magistral_cli.errors import CheckFailed, UserError
from magistral_cli.model_config import read_config_json

from .source import ModelSource

#: The placeholder answer appended to a conversation that ends with a user turn (see the module doc).
_PLACEHOLDER_ANSWER = "x"
#: Long enough that the encoder never truncates a prompt (the model's context is checked instead).
_NO_CUTOFF = 1 << 40


@dataclass
class EncodedPrompt:
    """A conversation up to its assistant turn: the ids the model gets and its images."""

    input_ids: list[int]
    images: list[str]
    image_sizes: list[tuple[int, int]]  # (height, width) after resizing, as preprocess records them
    #: The answer the input conversation ended with, if it did (batch input from a dataset).
    reference: str | None = None


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
        from magistral_cli.data.template import resolve_default_system
        from magistral_cli.data.tokenizer import check_against_model_config, load_tokenizer

        data = source.recipe.data if source.recipe is not None else Data()
        pre, basic = data.dataset_param.preprocess_parameters, data.dataset_param.basic_parameters
        tokenizer_dir = source.model_dir
        if source.recipe is not None and pre.model_name_or_path and Path(pre.model_name_or_path).is_dir():
            tokenizer_dir = Path(pre.model_name_or_path)
        tokenizer = load_tokenizer(
            tokenizer_dir, pre.tokenizer_source, pre.fix_mistral_regex, pre.split_special_tokens
        )
        config_path = source.model_dir / CONFIG
        check_against_model_config(tokenizer.special, read_config_json(config_path), config_path)
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
