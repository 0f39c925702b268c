"""Generation: transformers' own ``generate`` on an encoded prompt (sampling with temperature 0.7
and top-p 0.95 as the model card recommends, or greedy), one conversation at a time; a batch
(``--input`` / ``--output``) answers each record of a file into one JSON line.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magistral_cli.errors import UserError
from magistral_cli.model_config import parameter_counts

from .prompt import EncodedPrompt, PromptEncoder, _Dropped
from .source import ModelSource, load_model

#: Sampling defaults of Magistral-Small-2509's model card.
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_NEW_TOKENS = 1024


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
            "parameters": parameter_counts(self.model)["total"]
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
    model, torch_device, torch_dtype, lora = load_model(source, device, dtype)
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
