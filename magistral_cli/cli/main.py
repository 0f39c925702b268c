"""The ``magistral`` command: a thin Typer app over the core package.

Each subcommand lives in its own module with a ``register(app)`` function. Those modules
import torch and transformers inside their command functions only, so that
``magistral --help`` and ``magistral --version`` stay fast and import neither.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
from rich.markup import escape
from typer.core import TyperGroup

from magistral_cli import __version__
from magistral_cli.errors import MagistralError, os_error

from . import compare, convert, fetch, generate, preprocess, probe, quickstart, train
from .output import console

_state = {"debug": False}


def debug_enabled() -> bool:
    """True with ``--debug`` or ``MAGISTRAL_DEBUG=1``: errors then show their traceback."""
    return _state["debug"] or os.environ.get("MAGISTRAL_DEBUG", "") not in ("", "0", "false")


class _Group(TyperGroup):
    """Turns our errors into one message and an exit code instead of a traceback."""

    def invoke(self, ctx):
        try:
            try:
                return super().invoke(ctx)
            except OSError as exc:  # a path or a disk: one message naming it (errors.os_error)
                if debug_enabled():
                    raise
                raise os_error(exc) from None
        except MagistralError as exc:
            if debug_enabled():
                raise
            console.print(
                f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False, soft_wrap=True
            )
            raise typer.Exit(exc.exit_code) from None

    def list_commands(self, ctx):
        # The workflow order (the order of registration), not alphabetical.
        return sorted(
            self.commands, key=lambda name: WORKFLOW.index(name) if name in WORKFLOW else len(WORKFLOW)
        )


app = typer.Typer(
    cls=_Group,
    name="magistral",
    help="Fine-tune Magistral-Small-2509 with PyTorch FSDP2: fetch -> convert -> preprocess -> train -> compare, generate, and probe.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"magistral-cli {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="MAGISTRAL_DEBUG", help="Show tracebacks of errors.")
    ] = False,
) -> None:
    _state["debug"] = debug


#: The subcommands in the order their modules register them: the workflow order ``--help`` lists.
#: (Typer itself puts sub-apps such as ``convert`` after all the plain commands.)
WORKFLOW: list[str] = []
for _module in (fetch, convert, preprocess, train, compare, generate, probe, quickstart):
    _module.register(app)
    WORKFLOW += [
        info.name
        for info in (*app.registered_commands, *app.registered_groups)
        if info.name and info.name not in WORKFLOW
    ]


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
