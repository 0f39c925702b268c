"""`magistral quickstart`: the whole workflow on a tiny model on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .output import console, emit_json, json_option


def quickstart(
    workdir: Annotated[
        Path, typer.Option("--workdir", help="Where the tiny model, data, cache and runs go.")
    ] = Path("quickstart"),
    steps: Annotated[
        int, typer.Option("--steps", min=2, help="Training steps (checkpoint and resume half-way).")
    ] = 10,
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="CPU processes under torchrun.")] = 2,
    probes: Annotated[
        bool, typer.Option("--probes/--no-probes", help="End with `magistral probe all`.")
    ] = True,
    json_out: Annotated[bool, json_option("the summary")] = False,
) -> None:
    """Run fetch-free assets -> convert -> preprocess -> train -> resume -> export (HF and native) -> LoRA -> compare -> probe on the CPU."""
    from rich.markup import escape

    from magistral_cli.quickstart import QuickstartOptions, StepRecord, run_quickstart

    def progress(step: StepRecord) -> None:
        # A detail is plain text: [THINK] or a list in it is not rich markup.
        console.print(
            f"[bold green]{step.name:>10}[/] [dim]{step.seconds:6.1f} s[/]  {escape(step.detail)}",
            soft_wrap=True,
        )

    console.print(
        f"[bold]magistral quickstart[/]: the whole workflow on a tiny Mistral3 on the CPU, in {workdir}/"
    )
    summary = run_quickstart(
        QuickstartOptions(workdir=workdir, steps=steps, nproc=nproc, probes=probes), console, progress
    )
    console.print(
        f"\n[bold green]quickstart passed[/] in {summary['wall_s']} s. Outputs in {summary['outputs']}:"
    )
    for name, path in summary["runs"].items():
        console.print(f"  {name:<10} {path}  (metrics.jsonl, checkpoints/, logs/)", soft_wrap=True)
    console.print(
        f"  {'export':<10} {summary['export']}  (HF safetensors, loads with from_pretrained)", soft_wrap=True
    )
    console.print(
        f"  {'native':<10} {summary['native']}  (Mistral's native layout, vLLM's --load-format mistral)",
        soft_wrap=True,
    )
    console.print(
        f"Next: magistral compare {summary['runs']['train']} {summary['runs']['optimized']} --plot compare.png",
        soft_wrap=True,
    )
    if json_out:
        emit_json(summary)


def register(app: typer.Typer) -> None:
    app.command(name="quickstart")(quickstart)
