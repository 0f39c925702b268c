"""`magistral convert`."""

from __future__ import annotations

import typer

from .pending import register_pending


def register(app: typer.Typer) -> None:
    register_pending(
        app,
        "convert",
        "Convert checkpoints between HF safetensors and torch DCP, validate, export.",
        "HF <-> DCP conversion is planned.",
    )
