"""`magistral preprocess`."""

from __future__ import annotations

import typer

from .pending import register_pending


def register(app: typer.Typer) -> None:
    register_pending(
        app,
        "preprocess",
        "Encode a LLaVA-style dataset into the cache, with a report.",
        "dataset encoding and caching are planned.",
    )
