"""The PNG of a comparison: loss curves, per-step relative error, step times (matplotlib, Agg)."""

from __future__ import annotations

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
    _pyplot()


def plot_comparison(
    comparison: Comparison, path: Path, *, labels: tuple[str, str] = ("baseline", "candidate")
) -> Path:
    """Write a three-panel PNG of ``comparison`` to ``path`` and return the path."""
    plt = _pyplot()
    report = comparison.report
    steps = comparison.steps
    loss, times = report["loss"], report["step_time_ms"]
    fig, (ax_loss, ax_err, ax_time) = plt.subplots(
        3, 1, figsize=(10, 10), sharex=True, constrained_layout=True
    )

    verdict = "PASS" if comparison.passed else "FAIL"
    diff = loss["normalized_mean_abs_diff"]
    title = f"{verdict}: {report['steps_compared']} common steps"
    if diff is not None:
        title += f", normalized mean |Δloss| {diff:.3%} (threshold {loss['threshold']:.2%})"
    if times["mean_ratio"] is not None:
        title += f", step time ratio {times['mean_ratio']:.3f}"
    fig.suptitle(title, color="tab:green" if comparison.passed else "tab:red")

    ax_loss.plot(steps, comparison.baseline_loss, label=labels[0], color="tab:blue", linewidth=1.5)
    ax_loss.plot(
        steps, comparison.candidate_loss, label=labels[1], color="tab:orange", linewidth=1.0, linestyle="--"
    )
    ax_loss.set_title("loss", loc="left", fontsize="medium")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)

    ax_err.plot(steps, [100.0 * e for e in comparison.relative_error], color="tab:purple", linewidth=1.0)
    ax_err.axhline(
        100.0 * loss["threshold"], color="tab:red", linestyle=":", label="threshold (on the normalized mean)"
    )
    if diff is not None:
        ax_err.axhline(
            100.0 * diff, color="tab:purple", linestyle="--", linewidth=0.8, label="normalized mean"
        )
    if loss["relative_error_max_step"] is not None:
        ax_err.scatter(
            [loss["relative_error_max_step"]],
            [100.0 * loss["relative_error_max"]],
            color="tab:red",
            zorder=3,
            label=f"max at step {loss['relative_error_max_step']}",
        )
    ax_err.set_title("per-step relative loss error", loc="left", fontsize="medium")
    ax_err.set_ylabel("|Δloss| / |baseline loss| (%)")
    ax_err.legend(loc="upper right")
    ax_err.grid(alpha=0.3)

    ax_time.plot(steps, comparison.baseline_step_time_ms, label=labels[0], color="tab:blue", linewidth=1.5)
    ax_time.plot(steps, comparison.candidate_step_time_ms, label=labels[1], color="tab:orange", linewidth=1.0)
    if times["skip_steps"] and steps[0] <= times["skip_steps"]:
        ax_time.axvspan(
            steps[0], times["skip_steps"] + 0.5, color="grey", alpha=0.15, label="warm-up (skipped)"
        )
    ax_time.set_title("step time", loc="left", fontsize="medium")
    ax_time.set_ylabel("step time (ms)")
    ax_time.set_xlabel("step")
    ax_time.legend(loc="best")
    ax_time.grid(alpha=0.3)

    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path
