"""`magistral train`: resolve a recipe, create the run directory, launch torchrun."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from .output import console, emit_json


def train(
    recipe: Annotated[
        Path, typer.Argument(help="Recipe YAML (MindSpeed-MM FSDP2 format).", show_default=False)
    ],
    overrides: Annotated[
        Optional[List[str]],
        typer.Argument(
            help="Overrides such as training.lr=2e-5 model.freeze=[model.vision_tower].", show_default=False
        ),
    ] = None,
    nproc_per_node: Annotated[
        Optional[int],
        typer.Option(
            "--nproc-per-node", min=1, help="Processes per node (default: the recipe's, else one per device)."
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Number of nodes.")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="Rank of this node.")] = 0,
    master_addr: Annotated[
        Optional[str], typer.Option("--master-addr", help="Address of the rank-0 node (multi-node runs).")
    ] = None,
    master_port: Annotated[
        Optional[int],
        typer.Option(
            "--master-port",
            min=1,
            max=65535,
            help="Rendezvous port (default: a free port on one node, 29500 across nodes).",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Resolve, write the run directory, print the command and the per-rank memory plan, and stop.",
        ),
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the launch plan as one JSON object on stdout.")
    ] = False,
) -> None:
    """Train with the FSDP2 engine under torchrun (per-rank logs in the run directory)."""
    from magistral_cli.launch.launcher import LaunchOptions, plan_launch, run_launch

    options = LaunchOptions(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        dry_run=dry_run,
    )
    plan = plan_launch(recipe, list(overrides or []), options)
    plan.render(console)
    if json_out:
        emit_json(plan.to_json())
    if dry_run:
        console.print("[green]dry run:[/] nothing was started.")
        return
    code = run_launch(plan, console, node_rank=node_rank)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command(name="train")(train)
