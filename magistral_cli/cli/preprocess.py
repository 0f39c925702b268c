"""`magistral preprocess`: encode a LLaVA/ShareGPT dataset into the fingerprinted cache, with a report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from .output import console, emit_json, json_option, rows_progress


def preprocess(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (its data section).", show_default=False)],
    overrides: Annotated[
        Optional[List[str]],
        typer.Argument(
            help="Overrides such as data.dataset_param.basic_parameters.cutoff_len=4096.", show_default=False
        ),
    ] = None,
    json_out: Annotated[bool, json_option("the report")] = False,
    strict: Annotated[
        bool,
        typer.Option("--strict", help="Fail (exit 2) if any row would be dropped, naming the first one."),
    ] = False,
    inspect: Annotated[
        int,
        typer.Option(
            "--inspect",
            min=0,
            help="Print the first N encoded samples decoded, special tokens visible, trained spans marked.",
        ),
    ] = 0,
    export_jsonl: Annotated[
        Optional[Path],
        typer.Option(
            "--export-jsonl",
            help="Write every kept sample (index, input_ids, labels, image_sizes, images) as JSON Lines "
            "(never over a file the command reads: the recipe, the dataset, its images, the model's or the "
            "cache's files).",
        ),
    ] = None,
    overwrite_cache: Annotated[
        bool, typer.Option("--overwrite-cache", help="Encode again even if the cache has this entry.")
    ] = False,
) -> None:
    """Encode the dataset (Mistral template, Pixtral image tokens, truncation checks) into the cache.

    A second run with the same dataset, tokenizer, processor and parameters reuses the cache
    entry; any change makes a new one. The report (kept, dropped by reason, lengths, images,
    speed) is also written as report.json beside the cache entry. With val_size it shows the
    train / validation sample counts (the split is made when training starts, not cached).
    """
    from magistral_cli.config.loader import load_recipe
    from magistral_cli.data.inspection import export_jsonl as write_jsonl
    from magistral_cli.data.inspection import inspect_samples, plain_text, rich_text
    from magistral_cli.data.loader import with_split
    from magistral_cli.data.pipeline import plan_preprocess, run_preprocess
    from magistral_cli.data.report import render_report

    loaded = load_recipe(recipe, list(overrides or []))
    plan = plan_preprocess(loaded, overwrite=True if overwrite_cache else None)
    if export_jsonl is not None:  # before the encoding: a bad path costs nothing
        _check_export(export_jsonl, plan, recipe)
    with rows_progress("encoding") as progress:
        result = run_preprocess(loaded, progress=progress, strict=strict, plan=plan)
    dataset = result.dataset
    if result.reused:
        console.print(f"[green]cache hit:[/] reusing {dataset.path} (same dataset, tokenizer and parameters)")
    report = with_split(result.report, loaded, dataset.num_units)
    render_report(report, console, entry=str(dataset.path), reused=result.reused)

    inspected = inspect_samples(dataset, plan.tokenizer, inspect) if inspect else []
    for item in inspected:
        console.rule(
            f"{item.get('side', 'sample')} from row {item['index']}: {item['tokens']} tokens, "
            f"{item['label_tokens']} trained"
        )
        console.print(rich_text(item["spans"]), soft_wrap=True)
    if inspected:
        console.print("[dim]dim: not trained (label -100); [bold green]green[/bold green]: trained[/]")

    exported = None
    if export_jsonl is not None:
        _check_export(export_jsonl, plan, recipe, dataset)
        exported = write_jsonl(dataset, export_jsonl)
        console.print(f"exported {exported} samples to {export_jsonl}")

    if json_out:
        emit_json(
            {
                "cache_entry": str(dataset.path),
                "fingerprint": dataset.fingerprint,
                "reused": result.reused,
                "report": report,
                "inspect": [
                    {k: v for k, v in item.items() if k != "spans"} | {"text": plain_text(item["spans"])}
                    for item in inspected
                ],
                "exported": exported,
            }
        )


def _check_export(path: Path, plan, recipe: Path, dataset=None) -> None:
    """--export-jsonl never writes over an input (``run_record.refuse_overwriting_inputs``); with the
    encoded ``dataset``, not over one of its images either (looked up only for an existing file in
    the dataset's directory)."""
    from magistral_cli.errors import UserError
    from magistral_cli.run_record import refuse_overwriting_inputs

    if not path.parent.is_dir():  # before the encoding: a file in the way, or no such folder
        what = "is a file" if path.parent.exists() else "does not exist"
        raise UserError(
            f"--export-jsonl {path}: its folder {path.parent} {what}; give a path in an existing folder"
        )
    inputs = [
        ("the recipe", recipe),
        ("the dataset", plan.dataset),
        ("the model directory", plan.model_dir),
        ("the cache directory", plan.cache_dir),
    ]
    if dataset is not None and path.is_file() and plan.dataset_dir.resolve() in path.resolve().parents:
        images = {image for i in range(len(dataset)) for image in dataset[i].images}
        inputs += [("an image of the dataset", image) for image in sorted(images)]
    refuse_overwriting_inputs(path, inputs, "--export-jsonl")


def register(app: typer.Typer) -> None:
    app.command(name="preprocess")(preprocess)
