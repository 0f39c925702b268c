"""`magistral compare`."""

from __future__ import annotations

import typer

from .pending import register_pending


def register(app: typer.Typer) -> None:
    register_pending(
        app,
        "compare",
        "Compare loss and step time of two runs or logs, with a verdict.",
        "run comparison is planned.",
    )
