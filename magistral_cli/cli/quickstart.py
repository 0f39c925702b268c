"""`magistral quickstart`."""

from __future__ import annotations

import typer

from .pending import register_pending


def register(app: typer.Typer) -> None:
    register_pending(
        app,
        "quickstart",
        "Run the whole workflow on a tiny model on the CPU.",
        "the quickstart needs the training engine; try 'magistral train recipes/tiny/tiny_cpu.yaml --dry-run'.",
    )
