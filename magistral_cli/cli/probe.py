"""`magistral probe`."""

from __future__ import annotations

import typer

from .pending import register_pending


def register(app: typer.Typer) -> None:
    register_pending(
        app,
        "probe",
        "Device and numerics checks (split-copy, vision attention, train smoke).",
        "device probes are planned.",
    )
