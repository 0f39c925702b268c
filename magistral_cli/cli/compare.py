"""`magistral compare BASELINE CANDIDATE`: loss and step-time metrics between two runs, with a verdict."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from magistral_cli.analysis.logs import KNOWN_FORMATS, read_run
from magistral_cli.analysis.metrics import (
    DEFAULT_LOSS_THRESHOLD,
    SEED_MAX_STEP_TIME_RATIO,
    SEED_WARMUP_STEPS,
    SHORT_RUN_SKIP_STEPS,
    Comparison,
    compare_runs,
)
from magistral_cli.metric_names import PREFERENCE_FRACTION

from .output import console, emit_json, json_option

_SOURCE_HELP = "A run directory, a metrics.jsonl, or a MindSpeed-MM FSDP2 / Megatron training log."


def register(app: typer.Typer) -> None:
    app.command(name="compare", help=_HELP)(compare)


_HELP = (
    "Compare loss and step time of two runs or logs, with a verdict.\n\n"
    "Loss: sum|candidate - baseline| / sum|baseline| over the common steps, at most --loss-threshold. "
    "Step time: mean / median / p95 after --skip-steps, and the candidate/baseline ratio of the means; "
    "beside it the mean model TFLOP/s per device and MFU where the runs logged them (reported, not judged).\n\n"
    f"Default verdict, the seed's: when the common steps go past step {SEED_WARMUP_STEPS}, loss within "
    f"{DEFAULT_LOSS_THRESHOLD:.0%} and the mean step time of steps {SEED_WARMUP_STEPS + 1}.. at most "
    f"{SEED_MAX_STEP_TIME_RATIO:g} x the baseline's. Shorter runs: the loss alone, step times after step "
    f"{SHORT_RUN_SKIP_STEPS} reported, not judged. The output names the criteria applied. "
    'Validation losses (metrics.jsonl records with "split": "val") are compared the same way on '
    "the validation steps both runs logged, and join the verdict.\n\n"
    "Exit 0 pass, 1 fail, 2 bad input.\n\n"
    "Formats: " + ", ".join(KNOWN_FORMATS) + "."
)


def compare(
    baseline: Annotated[
        Path, typer.Argument(metavar="BASELINE", help=f"The reference. {_SOURCE_HELP}", show_default=False)
    ],
    candidate: Annotated[
        Path, typer.Argument(metavar="CANDIDATE", help=f"The run judged. {_SOURCE_HELP}", show_default=False)
    ],
    skip_steps: Annotated[
        Optional[int],
        typer.Option(
            "--skip-steps",
            min=0,
            help=f"Warm-up: step times of steps 1..N are left out [default: {SEED_WARMUP_STEPS} when the "
            f"common steps go past step {SEED_WARMUP_STEPS}, else {SHORT_RUN_SKIP_STEPS}].",
            show_default=False,
        ),
    ] = None,
    loss_threshold: Annotated[
        Optional[float],
        typer.Option(
            "--loss-threshold",
            min=0.0,
            help=f"Largest normalized mean abs loss difference that passes [default: {DEFAULT_LOSS_THRESHOLD}].",
            show_default=False,
        ),
    ] = None,
    max_step_time_ratio: Annotated[
        Optional[float],
        typer.Option(
            "--max-step-time-ratio",
            help="Fail when candidate mean step time / baseline mean exceeds this (1.0 = no slower) "
            f"[default: {SEED_MAX_STEP_TIME_RATIO:g} when the common steps go past step {SEED_WARMUP_STEPS}, "
            "else not judged].",
            show_default=False,
        ),
    ] = None,
    no_step_time_check: Annotated[
        bool,
        typer.Option(
            "--no-step-time-check",
            help="Report step times without judging them (runs on different machines, say).",
        ),
    ] = False,
    json_out: Annotated[bool, json_option("the comparison report")] = False,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot",
            help="Write a PNG with loss curves (validation losses as markers), relative error and step "
            "times (needs the \\[plot] extra).",
        ),
    ] = None,
) -> None:
    if plot is not None:
        from magistral_cli.analysis.plot import check_plot_path

        check_plot_path(plot)  # before the work, so that a bad path costs nothing
    result = compare_runs(
        read_run(baseline),
        read_run(candidate),
        skip_steps=skip_steps,
        loss_threshold=loss_threshold,
        max_step_time_ratio=max_step_time_ratio,
        step_time_check=not no_step_time_check,
    )
    _render(result)
    if plot is not None:
        from magistral_cli.analysis.plot import plot_comparison

        plot_comparison(result, plot, labels=(f"baseline ({baseline.name})", f"candidate ({candidate.name})"))
        console.print(f"plot: {escape(str(plot))}")
    if json_out:
        emit_json(result.report)
    if not result.passed:
        raise typer.Exit(1)


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{unit}"


def _render(result: Comparison) -> None:
    """The human table on stderr (fits 80 columns: the sources are named above it)."""
    r = result.report
    loss, times, memory = r["loss"], r["step_time_ms"], r["memory_mib"]
    for side in ("baseline", "candidate"):
        source = r[side]
        console.print(
            f"{side}: {escape(source['path'])} ({source['format']}, {source['steps_logged']} steps)",
            soft_wrap=True,
        )
    console.print(f"criteria: {escape(r['criteria']['description'])}", soft_wrap=True)
    table = Table(
        title=f"{r['steps_compared']} common steps; step times of steps > {times['skip_steps']}",
        title_justify="left",
    )
    table.add_column("metric")
    table.add_column("baseline", justify="right")
    table.add_column("candidate", justify="right")
    table.add_column("check", justify="right")

    _loss_diff_row(table, "loss", loss)
    table.add_row("loss: rel. error mean", "", _fmt(loss["relative_error_mean"], ".4%"), "")
    worst_step = loss["relative_error_max_step"]
    where = f"at step {worst_step}" if worst_step is not None else ""
    table.add_row("loss: rel. error max", "", _fmt(loss["relative_error_max"], ".4%"), where)
    _nonfinite_row(table, "loss", loss)
    _validation_rows(table, r.get("validation"))
    _preference_rows(table, r.get("preference"))
    b, c = times["baseline"] or {}, times["candidate"] or {}
    for stat in ("mean", "median", "p95"):
        table.add_row(f"step time {stat} (ms)", _fmt(b.get(stat), ".1f"), _fmt(c.get(stat), ".1f"), "")
    limit = f"<= {times['max_ratio']:g} " if times["max_ratio"] is not None else ""
    table.add_row("step time ratio", "", _fmt(times["mean_ratio"], ".3f"), f"{limit}{_ok(times['pass'])}")
    _throughput_rows(table, r.get("throughput"))
    for key, label in (("peak_allocated", "peak allocated (MiB)"), ("peak_reserved", "peak reserved (MiB)")):
        table.add_row(label, _fmt(memory["baseline"][key], ".0f"), _fmt(memory["candidate"][key], ".0f"), "")
    retries = r["alloc_retries"]
    table.add_row("allocation retries", _fmt(retries["baseline"], "d"), _fmt(retries["candidate"], "d"), "")
    wall = r["wall_s"]
    table.add_row("wall time (s)", _fmt(wall["baseline"], ".1f"), _fmt(wall["candidate"], ".1f"), "")
    console.print(table)
    for warning in r["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    for failure in r["failures"]:
        console.print(f"[red]fail:[/] {escape(failure)}", soft_wrap=True)
    console.print("[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]")


def _preference_rows(table: Table, preference: dict | None) -> None:
    """Preference training's metrics (means over the compared steps): only when a run logged them."""
    if not preference:
        return
    for name, row in preference.items():
        if row["baseline"] is None and row["candidate"] is None:
            continue
        spec = ".2%" if name == PREFERENCE_FRACTION else ".4f"
        table.add_row(f"{name} (mean)", _fmt(row["baseline"], spec), _fmt(row["candidate"], spec), "")


def _throughput_rows(table: Table, throughput: dict | None) -> None:
    """Mean model TFLOP/s per device and MFU (same steps as the step times): only when a run logged them."""
    if not throughput or not (throughput["baseline"] or throughput["candidate"]):
        return
    b, c = throughput["baseline"] or {}, throughput["candidate"] or {}

    def tflops(value) -> str:  # one decimal as Megatron prints it; 3 significant digits below 1 (CPU runs)
        return _fmt(value, ".1f" if value is None or value >= 1 else ".3g")

    table.add_row(
        "TFLOP/s per device (mean)",
        tflops(b.get("tflops_per_gpu")),
        tflops(c.get("tflops_per_gpu")),
        f"ratio {_fmt(throughput['tflops_ratio'], '.3f')}" if throughput["tflops_ratio"] is not None else "",
    )
    if b.get("mfu") is not None or c.get("mfu") is not None:
        table.add_row("MFU (mean)", _fmt(b.get("mfu"), ".2%"), _fmt(c.get("mfu"), ".2%"), "")


def _ok(flag) -> str:
    return "" if flag is None else ("[green]pass[/]" if flag else "[red]FAIL[/]")


def _loss_diff_row(table: Table, label: str, loss: dict) -> None:
    """The loss criterion's row (training or validation losses: ``analysis.metrics``' loss report)."""
    diff = loss["normalized_mean_abs_diff"]
    within = None if diff is None else diff <= loss["threshold"]
    table.add_row(
        f"{label}: norm. mean |diff|", "", _fmt(diff, ".4%"), f"<= {loss['threshold']:.2%} {_ok(within)}"
    )


def _nonfinite_row(table: Table, label: str, loss: dict) -> None:
    """The steps whose loss was NaN or inf on either side, when there are any (the candidate's fail)."""
    bad = loss["nonfinite_steps"]
    if bad["baseline"] or bad["candidate"]:
        table.add_row(
            f"{label}: NaN/inf steps",
            str(len(bad["baseline"])),
            str(len(bad["candidate"])),
            _ok(not bad["candidate"]),
        )


def _validation_rows(table: Table, val: dict | None) -> None:
    """The validation rows: only when both runs logged validation losses at common steps."""
    if not val or not val["steps_compared"]:
        return
    loss = val["loss"]
    _loss_diff_row(table, "val loss", loss)
    table.add_row("val loss: common steps", "", str(val["steps_compared"]), "")
    table.add_row(
        f"val loss at step {val['steps'][-1]}",
        _fmt(val["baseline_last"], ".4f"),
        _fmt(val["candidate_last"], ".4f"),
        "",
    )
    samples = val["samples"]
    table.add_row(
        "val samples",
        "/".join(map(str, samples["baseline"])) or "-",
        "/".join(map(str, samples["candidate"])) or "-",
        "",
    )
    _nonfinite_row(table, "val loss", loss)
