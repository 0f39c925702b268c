"""`magistral generate`: chat with an HF model, a training checkpoint, or a base plus LoRA adapters."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.markup import escape

from magistral_cli.generate import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P

from .output import console, emit_json, json_option


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


class DType(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


_HELP = (
    "Generate a reply with a checkpoint, encoded exactly as `preprocess` encodes training samples.\n\n"
    "--model: an HF model directory (official or transformers key layout), a training run directory, its "
    "checkpoints/ or a checkpoints/step_N (read in memory through the export path; the base config and the "
    "tokenizer / processor / template options come from the run's recipe), or a base with --adapter DIR "
    "(PEFT adapter_config.json + adapter_model.safetensors).\n\n"
    "Input: --prompt TEXT [--image PATH ...] [--system TEXT], or --input FILE.jsonl --output FILE (one "
    "conversation per line, LLaVA `messages` + `images` or ShareGPT; a final assistant turn is answered anew "
    "and kept as `reference`). Sampling: temperature 0.7, top-p 0.95 (the model card's), or --greedy."
)


def generate(
    model: Annotated[
        Path,
        typer.Option(
            "--model",
            help="HF model directory, training run directory, checkpoints/ or checkpoints/step_N.",
            show_default=False,
        ),
    ],
    prompt: Annotated[
        Optional[str],
        typer.Option(
            "--prompt",
            help="The user message. Images go where it says <image>, else before its text.",
            show_default=False,
        ),
    ] = None,
    images: Annotated[
        Optional[List[Path]],
        typer.Option("--image", help="An image for --prompt (repeatable, in order).", show_default=False),
    ] = None,
    system: Annotated[
        Optional[str],
        typer.Option(
            "--system",
            help="System prompt (default: the template's, Magistral's thinking prompt, or the run's "
            "data...default_system); '' for none.",
            show_default=False,
        ),
    ] = None,
    input_file: Annotated[
        Optional[Path],
        typer.Option(
            "--input",
            help="JSON Lines of conversations to answer (batch; needs --output).",
            show_default=False,
        ),
    ] = None,
    output_file: Annotated[
        Optional[Path],
        typer.Option(
            "--output",
            help="Where --input's answers go: one JSON line per conversation (never over a file the "
            "command reads: --input, or a file in --model, --base or --adapter).",
            show_default=False,
        ),
    ] = None,
    adapter: Annotated[
        Optional[Path],
        typer.Option(
            "--adapter",
            help="PEFT LoRA adapter directory to apply to --model (its base).",
            show_default=False,
        ),
    ] = None,
    base: Annotated[
        Optional[Path],
        typer.Option(
            "--base",
            help="For a training checkpoint: the HF model directory it belongs to (default: the run's "
            "model.model_name_or_path).",
            show_default=False,
        ),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="At most this many generated tokens.")
    ] = DEFAULT_MAX_NEW_TOKENS,
    greedy: Annotated[
        bool, typer.Option("--greedy", help="Argmax decoding (deterministic) instead of sampling.")
    ] = False,
    temperature: Annotated[
        Optional[float],
        typer.Option(
            "--temperature",
            help=f"Sampling temperature (default {DEFAULT_TEMPERATURE}); not with --greedy.",
            show_default=False,
        ),
    ] = None,
    top_p: Annotated[
        Optional[float],
        typer.Option(
            "--top-p",
            help=f"Nucleus sampling: keep this much probability mass (default {DEFAULT_TOP_P}); "
            "not with --greedy.",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        Optional[int],
        typer.Option("--seed", help="Seed the sampler (per conversation in a batch).", show_default=False),
    ] = None,
    device: Annotated[Device, typer.Option("--device", help="auto: npu, then cuda, then cpu.")] = Device.auto,
    dtype: Annotated[
        DType, typer.Option("--dtype", help="Weights dtype; auto: config.json's (bfloat16 for Magistral).")
    ] = DType.auto,
    allow_unverified: Annotated[
        bool,
        typer.Option(
            "--allow-unverified",
            help="Read a training checkpoint that has no integrity.json (a save from before training wrote "
            "integrity records, whose files you trust); without it such a checkpoint is refused.",
        ),
    ] = False,
    show_tokens: Annotated[
        bool,
        typer.Option(
            "--show-tokens",
            help="Show the prompt's tokens (special tokens visible, image blocks summarized).",
        ),
    ] = False,
    json_out: Annotated[
        bool,
        json_option(
            "the result (text, token_ids, finish_reason, ...; with --show-tokens also prompt_token_ids)"
        ),
    ] = False,
) -> None:
    from magistral_cli.errors import UserError
    from magistral_cli.generate import (
        PromptEncoder,
        SamplingOptions,
        generate_batch,
        load_generator,
        read_conversations,
        resolve_source,
    )

    batch = input_file is not None
    if batch and prompt is not None:
        raise UserError("pass either --prompt (one conversation) or --input FILE.jsonl (a batch), not both")
    if not batch and prompt is None:
        raise UserError("nothing to answer: pass --prompt TEXT, or --input FILE.jsonl --output FILE")
    if batch and output_file is None:
        raise UserError("--input needs --output FILE (one JSON line per conversation goes there)")
    if output_file is not None and not batch:
        raise UserError("--output is for batches: pass --input FILE.jsonl too (with --prompt, use --json)")
    if images and batch:
        raise UserError("--image goes with --prompt; in --input records list their images in `images`")
    if batch and output_file.absolute() == input_file.absolute():
        raise UserError("--output must differ from --input")
    if batch:  # before any work: never over a file the command reads
        from magistral_cli.run_record import refuse_overwriting_inputs

        refuse_overwriting_inputs(
            output_file,
            [("--input", input_file), ("--model", model), ("--base", base), ("--adapter", adapter)],
            "--output",
        )
    if greedy and (temperature is not None or top_p is not None):
        given = " and ".join(
            name for name, value in (("--temperature", temperature), ("--top-p", top_p)) if value is not None
        )
        raise UserError(f"--greedy decodes by argmax, which {given} would not change: drop one or the other")
    options = SamplingOptions(
        max_new_tokens,
        greedy,
        DEFAULT_TEMPERATURE if temperature is None else temperature,
        DEFAULT_TOP_P if top_p is None else top_p,
        seed,
    )
    options.check()

    source = resolve_source(model, adapter=adapter, base=base, allow_unverified=allow_unverified)
    encoder = PromptEncoder.for_source(source)
    # Encode before loading the model: a bad image or row fails in a second, not after the load.
    if batch:
        prompts = read_conversations(encoder, input_file, system)
    else:
        prompts = [(0, encoder.encode_prompt(prompt, [str(p) for p in images or []], system))]
    if show_tokens:
        for index, item in prompts:
            title = f"prompt: {len(item.input_ids)} tokens" + (f" (row {index})" if batch else "")
            console.rule(title)
            console.print(escape(encoder.prompt_text(item)), soft_wrap=True, markup=True)
        console.rule()

    with console.status(f"loading {source.describe()}"):
        generator = load_generator(source, device=device.value, dtype=dtype.value, encoder=encoder)
    info = generator.describe()
    console.print(
        f"[dim]{escape(source.describe())} on {info['device']} ({info['dtype']}), loaded in "
        f"{generator.load_seconds:.1f} s; "
        + ("greedy" if greedy else f"temperature {temperature}, top-p {top_p}")
        + (f", seed {seed}" if seed is not None else "")
        + "[/]",
        soft_wrap=True,
    )

    if batch:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("generate", total=len(prompts))
            summary = generate_batch(
                generator,
                prompts,
                output_file,
                options,
                progress=lambda done, _: bar.update(task, completed=done),
                prompt_ids=show_tokens,
            )
        console.print(
            f"[green]wrote[/] {escape(str(output_file))}: {summary['conversations']} conversations, "
            f"{summary['generated_tokens']} tokens in {summary['seconds']:.1f} s "
            f"(stop {summary['finish_reasons']['stop']}, length {summary['finish_reasons']['length']})",
            soft_wrap=True,
        )
        if json_out:
            emit_json({**summary, "model": info, "sampling": options.to_dict()})
        return

    _, item = prompts[0]
    if json_out:
        completion = generator.generate(item, options)
        emit_json({**completion.to_dict(show_tokens), "model": info, "sampling": options.to_dict()})
    else:

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        completion = generator.generate(item, options, on_text=write)
        sys.stdout.write("\n")
        sys.stdout.flush()
    rate = len(completion.token_ids) / completion.seconds if completion.seconds > 0 else 0.0
    console.print(
        f"[dim]{len(completion.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated "
        f"({completion.finish_reason}) in {completion.seconds:.1f} s, {rate:.1f} tokens/s[/]"
    )


def register(app: typer.Typer) -> None:
    app.command(name="generate", help=_HELP)(generate)
