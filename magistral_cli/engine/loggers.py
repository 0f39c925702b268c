"""``tools.logger``: rank 0's metrics.jsonl records and the resolved recipe, also sent to
TensorBoard (``torch.utils.tensorboard``) or Weights & Biases (offline or online).

A sink gets each line exactly as metrics.jsonl stores it (non-finite values already null).
Train fields are logged as ``train/<field>``; a record with ``"split": "val"`` (validation)
as ``val/<field>``. The packages are optional extras: a missing one is a UserError naming
``pip install 'magistral-cli[<logger>]'``, raised by the launcher's pre-flight and again
when rank 0 builds the sink, so a run never trains without the logging it asked for.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any, Protocol

from magistral_cli.errors import UserError

log = logging.getLogger(__name__)

#: tools.logger value -> the package it needs (the extra has the logger's name).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def install_hint(logger: str) -> str:
    return f"pip install 'magistral-cli[{logger}]'"


def _missing(logger: str, detail: str = "") -> UserError:
    return UserError(
        f"tools.logger is {logger} but the {PACKAGES[logger]} package is not installed{detail}; "
        f"install it with {install_hint(logger)} (or set tools.logger=none)"
    )


def check_logger_available(recipe) -> None:
    """Raise UserError (with the pip command) when ``tools.logger``'s package is not installed."""
    logger = recipe.tools.logger
    if logger == "none":
        return
    if importlib.util.find_spec(PACKAGES[logger]) is None:
        raise _missing(logger)


def _under(run_dir: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else run_dir / p


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, {"train/<field>" | "<split>/<field>": value}) for the numbers of a metrics line."""
    prefix = record.get("split") or "train"
    out = {}
    for key, value in record.items():
        if key in ("step", "split") or value is None or isinstance(value, str):
            continue
        if isinstance(value, bool | int | float) and math.isfinite(value):
            out[f"{prefix}/{key}"] = float(value)
    return int(record["step"]), out


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars and the recipe (a text summary, tag ``recipe``) in ``tools.tensorboard.log_dir``."""

    def __init__(self, recipe, run_dir: Path, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing("tensorboard", f" or does not import ({exc})") from None
        from magistral_cli.config import recipe_to_yaml

        self.log_dir = _under(run_dir, recipe.tools.tensorboard.log_dir)
        # On resume from step N, TensorBoard drops the events this directory holds after step N
        # (the steps the resumed run takes again), as metrics.jsonl moves those lines aside.
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=resume_step + 1 if resume_step else None
        )
        text = "\n".join("    " + line for line in recipe_to_yaml(recipe).splitlines())
        self.writer.add_text("recipe", text, global_step=resume_step)
        self.writer.flush()

    def log(self, record: dict[str, Any]) -> None:
        step, values = scalars(record)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run (``tools.wandb``): the recipe as its config, the records as its history.

    Offline (the default) writes ``<dir>/wandb/offline-run-*`` only; ``wandb sync`` uploads it.
    Each launch is a new W&B run (a resumed one notes ``resumed_from_step`` in its config).
    """

    def __init__(self, recipe, run_dir: Path, resume_step: int = 0):
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", f" or does not import ({exc})") from None
        from magistral_cli.runtime import at_rank_exit

        at_rank_exit(_remove_wandb_temporaries)
        opts = recipe.tools.wandb
        self.dir = _under(run_dir, opts.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        config = recipe.model_dump(mode="json")
        if resume_step:
            config["resumed_from_step"] = resume_step
        try:
            self.run = wandb.init(
                project=opts.project,
                entity=opts.entity,
                name=opts.name or run_dir.name,
                tags=list(opts.tags) or None,
                dir=str(self.dir),
                mode=opts.mode,
                config=config,
                # The rank's own output stays as it is (its log is in the run directory already).
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as exc:
            hint = (
                "; log in first (`wandb login`) or set tools.wandb.mode=offline"
                if opts.mode == "online"
                else ""
            )
            raise UserError(f"tools.logger wandb: could not start the W&B run: {exc}{hint}") from None

    def log(self, record: dict[str, Any]) -> None:
        step, values = scalars(record)
        if values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


#: Where wandb keeps its module-level temporary directories (``tempfile.TemporaryDirectory``), which only
#: the interpreter's exit handlers remove: (module, attribute path).
WANDB_TEMPORARIES = (
    ("wandb.sdk.data_types._private", "MEDIA_TMP"),
    ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"),
)


def _remove_wandb_temporaries() -> None:
    """Remove wandb's temporary directories (``WANDB_TEMPORARIES``) at a rank's end: the rank leaves
    with ``os._exit`` (``runtime.finish_rank_process``), which skips the exit handlers that would,
    and every run would leave two empty directories in the temporary directory. A wandb that keeps
    them elsewhere is left alone."""
    import sys

    for module_name, path in WANDB_TEMPORARIES:
        target = sys.modules.get(module_name)
        for attr in path.split("."):
            target = getattr(target, attr, None)
        cleanup = getattr(target, "cleanup", None)
        if callable(cleanup):
            cleanup()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


def build_sinks(recipe, run_dir: Path, resume_step: int = 0) -> list[Sink]:
    """The sinks ``tools.logger`` asks for (rank 0 only); UserError when its package is missing."""
    logger = recipe.tools.logger
    if logger == "none":
        return []
    check_logger_available(recipe)
    return [SINKS[logger](recipe, Path(run_dir), resume_step)]
