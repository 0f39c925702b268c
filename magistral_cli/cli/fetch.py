"""`magistral fetch`."""

from __future__ import annotations

import typer

from .pending import register_pending


def register(app: typer.Typer) -> None:
    register_pending(
        app,
        "fetch",
        "Download the model and tokenizer at pinned revisions and verify SHA-256.",
        "pinned downloads with SHA-256 verification are planned.",
    )
