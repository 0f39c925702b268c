"""`magistral train`: resolve a recipe, create the run directory, launch torchrun (or submit to SLURM)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, List, Optional

import typer

from .output import console, emit_json, json_option

if TYPE_CHECKING:
    from magistral_cli.launch.options import LaunchOptions


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
            help="Resolve and check as a launch does, print the command and the per-rank memory plan, and stop: "
            "nothing is started or written.",
        ),
    ] = False,
    share_checkpoints: Annotated[
        bool,
        typer.Option(
            "--share-checkpoints",
            help="Write into a training.save directory that another run owns, on purpose: this run resumes its "
            "newest checkpoint and moves its `latest` (recorded in that directory).",
        ),
    ] = False,
    restart_data: Annotated[
        bool,
        typer.Option(
            "--restart-data",
            help="Resume a checkpoint under a changed data set-up (dataset, world size, micro-batch, "
            "accumulation, seed, order): its weights, optimizer and step, with the data order started again "
            "(recorded in run_identity.json).",
        ),
    ] = False,
    json_out: Annotated[bool, json_option("the launch plan")] = False,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Write <run_dir>/train.sbatch (srun + torchrun's c10d rendezvous) and submit it with sbatch "
            "(--dry-run: write it only). The run directory must be on storage every node sees.",
        ),
    ] = False,
    nodes: Annotated[
        Optional[int], typer.Option("--nodes", min=1, help="--slurm: number of nodes (default 1).")
    ] = None,
    gpus_per_node: Annotated[
        Optional[int],
        typer.Option(
            "--gpus-per-node",
            min=1,
            help="--slurm: devices (= processes) per node (default: --nproc-per-node, else the recipe's).",
        ),
    ] = None,
    partition: Annotated[Optional[str], typer.Option("--partition", help="--slurm: the partition.")] = None,
    time_limit: Annotated[
        Optional[str], typer.Option("--time", help="--slurm: the time limit, e.g. 2-00:00:00.")
    ] = None,
    account: Annotated[
        Optional[str], typer.Option("--account", help="--slurm: the account to charge.")
    ] = None,
    job_name: Annotated[
        Optional[str],
        typer.Option("--job-name", help="--slurm: the job name (default: the run directory's)."),
    ] = None,
) -> None:
    """Train with the FSDP2 engine under torchrun (per-rank logs in the run directory), or submit it to SLURM."""
    from magistral_cli.launch.launcher import LaunchOptions, plan_launch, run_launch

    slurm_only = {
        "--nodes": nodes,
        "--gpus-per-node": gpus_per_node,
        "--partition": partition,
        "--time": time_limit,
        "--account": account,
        "--job-name": job_name,
    }
    options = LaunchOptions(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        dry_run=dry_run,
        share_checkpoints=share_checkpoints,
        restart_data=restart_data,
    )
    if slurm:
        _train_slurm(recipe, list(overrides or []), options, json_out=json_out, slurm_only=slurm_only)
        return
    given = [flag for flag, value in slurm_only.items() if value is not None]
    if given:
        from magistral_cli.errors import UserError

        raise UserError(f"{', '.join(given)} only apply with --slurm; add --slurm or drop them")

    from .output import rows_progress
    from .train_render import render_launch_plan

    with rows_progress() as progress:  # the dataset encoding before a real launch, if any
        plan = plan_launch(recipe, list(overrides or []), options, progress=progress)
    render_launch_plan(plan, console)
    if json_out:
        emit_json(plan.to_json())
    if dry_run:
        console.print("[green]dry run:[/] nothing was started or written.")
        return
    code = run_launch(plan, console, node_rank=node_rank)
    raise typer.Exit(code)


def _train_slurm(
    recipe: Path,
    overrides: List[str],
    launch: LaunchOptions,
    *,
    json_out: bool,
    slurm_only: dict,
) -> None:
    """``--slurm``: the job script from the same launch options (``launch``) and the SLURM-only ones."""
    from magistral_cli.errors import UserError
    from magistral_cli.launch.slurm import SlurmOptions, plan_slurm, submit

    nproc_per_node = launch.nproc_per_node
    if launch.nnodes != 1 or launch.node_rank != 0 or launch.master_addr is not None:
        raise UserError(
            "--slurm takes --nodes N (SLURM places the nodes and torchrun's rendezvous finds them); "
            "drop --nnodes, --node-rank and --master-addr"
        )
    gpus = slurm_only["--gpus-per-node"]
    if gpus is not None and nproc_per_node is not None and gpus != nproc_per_node:
        raise UserError(
            f"--gpus-per-node {gpus} and --nproc-per-node {nproc_per_node} differ; give one of them"
        )
    options = SlurmOptions(
        nodes=slurm_only["--nodes"] or 1,
        gpus_per_node=gpus or nproc_per_node,
        partition=slurm_only["--partition"],
        time=slurm_only["--time"],
        account=slurm_only["--account"],
        job_name=slurm_only["--job-name"],
        master_port=launch.master_port,
    )
    plan = plan_slurm(
        recipe,
        overrides,
        options,
        dry_run=launch.dry_run,
        share_checkpoints=launch.share_checkpoints,
        restart_data=launch.restart_data,
    )
    plan.render(console)
    job_id = None
    if launch.dry_run:
        console.print(
            f"[green]dry run:[/] not submitted; submit it with: sbatch {plan.script}", soft_wrap=True
        )
    else:
        job_id = submit(plan)
        console.print(
            f"[green]submitted[/] job {job_id}; its log: {plan.launch.run_dir}/logs/slurm-{job_id}.out",
            soft_wrap=True,
        )
    if json_out:
        emit_json(plan.to_json(job_id))


def register(app: typer.Typer) -> None:
    app.command(name="train")(train)
