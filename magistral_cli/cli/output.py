"""Where output goes: humans read stderr (rich), machines read one JSON object on stdout."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress

#: Human-readable output. stderr, so that ``--json`` output on stdout stays clean.
console = Console(stderr=True, highlight=False)


def json_option(what: str = "the result") -> Any:
    """The ``--json`` flag of every subcommand that reports (DESIGN.md, "Output for machines").

    ``what`` names what the object holds in the help line; the flag's spelling and its promise
    (one object on stdout, the human output on stderr) are written here only.
    """
    return typer.Option("--json", help=f"Print {what} as one JSON object on stdout.")


#: ``json_out: JsonOut = False``: the flag with the plain help line.
JsonOut = Annotated[bool, json_option()]


def emit_json(obj: Any) -> None:
    """Print one JSON object on stdout (the machine contract in DESIGN.md)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def bytes_progress(*, binary_units: bool = False) -> Progress:
    """A rich progress bar of bytes (done / total, speed, time left) on stderr that disappears when
    it stops; ``binary_units``: GiB rather than GB."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=binary_units),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


@contextmanager
def rows_progress(description: str = "encoding") -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar (rows: done/total, time left) on stderr, driven by a core's
    ``progress(done, total)`` callback (``data.pipeline.ProgressFn``).

    The bar appears at the first call only, so a job that has nothing to do (a cache hit)
    shows none; it disappears when the block ends.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar: Progress | None = None
    task = None

    def update(done: int, total: int) -> None:
        nonlocal bar, task
        if bar is None:
            bar = Progress(
                TextColumn(description),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            bar.start()
            task = bar.add_task(description, total=total)
        bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()
