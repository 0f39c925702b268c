"""Placeholder for subcommands whose work has not landed yet: says so and exits 2."""

from __future__ import annotations

import typer

from magistral_cli.errors import UserError


def register_pending(app: typer.Typer, name: str, help_text: str, what: str) -> None:
    """Register ``name`` as a command that accepts anything and explains it is not available yet."""

    @app.command(
        name=name,
        help=f"{help_text} (not available yet)",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def _pending(ctx: typer.Context) -> None:
        raise UserError(f"`magistral {name}` is not available in this version yet: {what}")
