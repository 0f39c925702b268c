"""The PNG of a comparison: loss curves, per-step relative error, step times (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path

from magistral_cli.errors import UserError

from .metrics import Comparison

PLOT_EXTRA_HINT = "pip install 'magistral-cli[plot]'"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}") from None
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: Path) -> None:
    """Refuse a plot path that would fail only after the comparison ran."""
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot writes a PNG: give a path ending in .png (got {path})")
    if not path.parent.is_dir():
        raise UserError(f"--plot {path}: the folder {path.parent} does not exist; create it first")
    if path.is_dir():
        raise UserError(f"--plot {path} is a directory; give a file path ending in .png")
    _pyplot()


def plot_comparison(
    comparison: Comparison, path: Path, *, labels: tuple[str, str] = ("baseline", "candidate")
) -> Path:
    """Write a three-panel PNG of ``comparison`` to ``path`` and return the path.

    Panels: both loss curves (NaN/inf candidate steps marked; each run's validation losses as
    markers on a dotted line, when it logged any), the per-step relative loss error with the
    threshold and the normalized mean, and both step-time curves with the warm-up shaded.
    """
    plt = _pyplot()
    report = comparison.report
    fig, (ax_loss, ax_err, ax_time) = plt.subplots(
        3, 1, figsize=(10, 10), sharex=True, constrained_layout=True
    )
    fig.suptitle(_title(report), color="tab:green" if comparison.passed else "tab:red")
    _loss_panel(ax_loss, comparison, labels)
    _error_panel(ax_err, comparison)
    _step_time_panel(ax_time, comparison, labels)
    ax_time.set_xlabel("step")
    for ax in (ax_loss, ax_err, ax_time):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path


def _title(report: dict) -> str:
    """The verdict in short lines (a long single line is clipped at the figure's edges)."""
    import textwrap

    loss, times = report["loss"], report["step_time_ms"]
    first = f"{'PASS' if report['pass'] else 'FAIL'}: {report['steps_compared']} common steps"
    if times["mean_ratio"] is not None:
        first += f", step time ratio {times['mean_ratio']:.3f}"
    lines = [first]
    parts = []
    if loss["normalized_mean_abs_diff"] is not None:
        parts.append(
            f"normalized mean |Δloss| {loss['normalized_mean_abs_diff']:.3%} (threshold {loss['threshold']:.2%})"
        )
    val = (report.get("validation") or {}).get("loss") or {}
    if val.get("normalized_mean_abs_diff") is not None:
        parts.append(f"validation |Δloss| {val['normalized_mean_abs_diff']:.3%}")
    if parts:
        lines.append(", ".join(parts))
    if report["failures"]:
        lines.extend(textwrap.wrap(report["failures"][0], width=90))
    return "\n".join(lines)


def _loss_panel(ax, comparison: Comparison, labels) -> None:
    ax.plot(comparison.steps, comparison.baseline_loss, label=labels[0], color="tab:blue", linewidth=1.5)
    ax.plot(
        comparison.steps,
        comparison.candidate_loss,
        label=labels[1],
        color="tab:orange",
        linewidth=1.0,
        linestyle="--",
    )
    for values, label, color, marker in (
        (comparison.baseline_val, labels[0], "tab:green", "o"),
        (comparison.candidate_val, labels[1], "tab:red", "s"),
    ):
        if values:
            steps = sorted(values)
            ax.plot(
                steps, [values[s] for s in steps], label=f"{label} validation", color=color, marker=marker,
                markersize=5, linestyle=":", linewidth=1.0, fillstyle="none" if marker == "s" else "full",
            )  # fmt: skip
    bad = comparison.report["loss"]["nonfinite_steps"]["candidate"]
    for i, step in enumerate(bad[:50]):
        ax.axvline(
            step, color="tab:red", alpha=0.6, linewidth=1.0, label="candidate NaN/inf" if i == 0 else None
        )
    title = "loss (markers: validation)" if comparison.baseline_val or comparison.candidate_val else "loss"
    ax.set_title(title, loc="left", fontsize="medium")
    ax.set_ylabel("loss")


def _error_panel(ax, comparison: Comparison) -> None:
    loss = comparison.report["loss"]
    ax.plot(
        comparison.steps, [100.0 * e for e in comparison.relative_error], color="tab:purple", linewidth=1.0
    )
    ax.axhline(
        100.0 * loss["threshold"], color="tab:red", linestyle=":", label="threshold (on the normalized mean)"
    )
    if loss["normalized_mean_abs_diff"] is not None:
        ax.axhline(
            100.0 * loss["normalized_mean_abs_diff"], color="tab:purple", linestyle="--", linewidth=0.8,
            label="normalized mean",
        )  # fmt: skip
    if loss["relative_error_max_step"] is not None:
        ax.scatter(
            [loss["relative_error_max_step"]], [100.0 * loss["relative_error_max"]], color="tab:red", zorder=3,
            label=f"max at step {loss['relative_error_max_step']}",
        )  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.set_title("per-step relative loss error", loc="left", fontsize="medium")
    ax.set_ylabel("|Δloss| / |baseline loss| (%)")


def _step_time_panel(ax, comparison: Comparison, labels) -> None:
    steps, skip = comparison.steps, comparison.report["step_time_ms"]["skip_steps"]
    ax.plot(steps, comparison.baseline_step_time_ms, label=labels[0], color="tab:blue", linewidth=1.5)
    ax.plot(steps, comparison.candidate_step_time_ms, label=labels[1], color="tab:orange", linewidth=1.0)
    if skip and steps[0] <= skip:
        ax.axvspan(
            steps[0], skip + 0.5, color="grey", alpha=0.15, label=f"warm-up, steps <= {skip} (skipped)"
        )
    # Scale to the measured steps: one slow warm-up step would otherwise flatten every other curve.
    series = (comparison.baseline_step_time_ms, comparison.candidate_step_time_ms)
    measured = [
        t
        for times in series
        for step, t in zip(steps, times, strict=True)
        if step > skip and math.isfinite(t)
    ]
    if measured:
        low, high = min(measured), max(measured)
        pad = max(0.05 * (high - low), 0.01 * high, 1e-3)
        ax.set_ylim(low - pad, high + pad)
    ax.set_title("step time", loc="left", fontsize="medium")
    ax.set_ylabel("step time (ms)")
