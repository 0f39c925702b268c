"""``magistral train RECIPE --slurm``: an sbatch script for the launcher's plan, and its submission.

The run directory is planned exactly as for a local launch (``plan_launch``: the resolved
recipe, ``run_identity.json``, ``logs/``, the pre-flight checks), then ``<run_dir>/train.sbatch``
is written. The job runs one ``srun`` task per node, each a torchrun agent
(``python -m torch.distributed.run``, the interpreter that wrote the script) that meets the
others through torchrun's c10d rendezvous on the job's first node; SLURM gives the node list,
the launcher's per-device environment defaults are exported (a variable already set in the
job's environment wins). Every node reads the resolved recipe and writes into the run
directory, so it must be on storage that all nodes see.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from magistral_cli.checkpoint.staging import current_umask
from magistral_cli.config import load_recipe
from magistral_cli.engine.loggers import check_logger_available
from magistral_cli.errors import UserError
from magistral_cli.run_record import RESOLVED_CONFIG

from .device import device_defaults, resolve_device
from .launcher import LaunchOptions, LaunchPlan, plan_launch
from .preflight import check_paths
from .supervise import ENGINE_MODULE

#: The rendezvous port on the first node (``MASTER_PORT`` in the job's environment wins).
DEFAULT_PORT = 29500
SCRIPT_NAME = "train.sbatch"
#: Node-local places: a run directory there is not seen by the job's other nodes.
NODE_LOCAL = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
#: SLURM's --time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (or UNLIMITED).
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite)$", re.I)
_TOKEN = re.compile(r"^[A-Za-z0-9_.,:+@=-]+$")


@dataclass
class SlurmOptions:
    nodes: int = 1
    #: Processes (one per device) on each node; None = the recipe's parallel.nproc_per_node.
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    job_name: str | None = None
    master_port: int | None = None


@dataclass
class SlurmPlan:
    launch: LaunchPlan
    script: Path
    text: str
    nodes: int
    procs_per_node: int
    warnings: list[str] = field(default_factory=list)

    def to_json(self, job_id: str | None = None) -> dict[str, Any]:
        return {
            "run_dir": str(self.launch.run_dir),
            "resolved_config": str(self.launch.run_dir / RESOLVED_CONFIG),
            "script": str(self.script),
            "device": self.launch.device,
            "nodes": self.nodes,
            "procs_per_node": self.procs_per_node,
            "world_size": self.nodes * self.procs_per_node,
            "job_id": job_id,
            "warnings": self.warnings,
        }

    def render(self, console) -> None:
        from rich.markup import escape

        for warning in self.warnings:
            console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
        console.print(f"[bold]run directory[/]  {escape(str(self.launch.run_dir))}", soft_wrap=True)
        console.print(
            f"[bold]device[/]         {self.launch.device}, {self.procs_per_node} process(es) per node x "
            f"{self.nodes} node(s) = world size {self.nodes * self.procs_per_node}"
        )
        console.print(f"[bold]sbatch script[/]  {escape(str(self.script))}", soft_wrap=True)


def _check_token(flag: str, value: str | None) -> None:
    if value is not None and not _TOKEN.match(value):
        raise UserError(f"{flag} {value!r}: use letters, digits and _.,:+@=- only")


def _slurm_device(recipe) -> str:
    """The compute nodes' device: the recipe's, else this machine's accelerator, else cuda."""
    requested = recipe.parallel.device
    device, _, _ = resolve_device(requested)
    return "cuda" if requested == "auto" and device == "cpu" else device


def _dq(value: str) -> str:
    """``value`` inside double quotes (shell variables in it are not expanded)."""
    return '"' + re.sub(r'(["\\$`])', r"\\\1", value) + '"'


def node_local(path: Path) -> bool:
    resolved = Path(path).resolve()
    return any(resolved == p or p in resolved.parents for p in NODE_LOCAL)


def plan_slurm(
    recipe_path: str | Path,
    overrides: list[str],
    options: SlurmOptions,
    *,
    dry_run: bool = False,
    share_checkpoints: bool = False,
    restart_data: bool = False,
) -> SlurmPlan:
    """Plan the run directory as ``magistral train`` does and write its sbatch script.

    For a submission (not ``dry_run``) missing inputs and a missing ``tools.logger`` package stop
    it before anything is written, as for a local launch; a dry run only warns about them. What
    this machine's devices are is not checked: the job runs on the compute nodes.
    """
    recipe_path = Path(recipe_path)
    overrides = list(overrides)
    for flag, value in (("--partition", options.partition), ("--account", options.account)):
        _check_token(flag, value)
    _check_token("--job-name", options.job_name)
    if options.time is not None and not _TIME.match(options.time):
        raise UserError(
            f"--time {options.time!r} is not a SLURM time limit; use minutes, HH:MM:SS or D-HH:MM:SS (e.g. 2-00:00:00)"
        )
    recipe = load_recipe(recipe_path, overrides)
    procs = options.gpus_per_node or recipe.parallel.nproc_per_node
    if procs is None:
        raise UserError(
            "--slurm needs the processes per node: pass --gpus-per-node G (or set parallel.nproc_per_node)"
        )
    device = _slurm_device(recipe)
    pre_flight: list[str] = []
    try:
        check_logger_available(recipe)
    except UserError as exc:
        if not dry_run:
            raise
        pre_flight.append(str(exc))
    if not dry_run:
        check_paths(recipe, pre_flight, dry_run=False)  # raises on a missing model / dataset / load
    extra = [f"parallel.device={device}"]
    if recipe.training.output_dir is None:
        # On the submitting directory's storage, which the job starts in (sbatch's default --chdir).
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        extra.append(f"training.output_dir={Path.cwd() / 'runs' / f'{recipe_path.stem}-{stamp}'}")
    launch_options = LaunchOptions(
        nproc_per_node=procs,
        nnodes=options.nodes,
        master_addr="$MASTER_ADDR",  # the launcher's own command is not used: srun runs torchrun
        master_port=options.master_port or DEFAULT_PORT,
        # The devices are on the compute nodes, not here: what this machine lacks is not an error;
        # the run directory is written all the same (the job reads it).
        dry_run=True,
        write_run_dir=True,
        share_checkpoints=share_checkpoints,
        restart_data=restart_data,
    )
    launch = plan_launch(recipe_path, overrides + extra, launch_options)
    # Device detection on the submitting machine (often a login node without accelerators).
    _, count, not_here = resolve_device(device)
    local_only = {not_here, f"{procs} processes per node but only {count} {device} device(s) are visible"}
    warnings = pre_flight + [w for w in launch.warnings if w not in local_only]
    run_dir, workdir = launch.run_dir, Path.cwd()
    for what, path in (("the run directory", run_dir), ("the working directory", workdir)):
        if re.search(r"\s", str(path)):
            raise UserError(f"{what} {path} has whitespace, which #SBATCH lines cannot hold; use another")
    if node_local(run_dir):
        warnings.append(
            f"the run directory {run_dir} is on node-local storage: the job's nodes will not see it; set "
            "training.output_dir=<a path on shared storage>"
        )
    text = render_script(launch, options, procs, recipe_path, overrides, workdir)
    script = run_dir / SCRIPT_NAME
    script.write_text(text, encoding="utf-8")
    # Executable by whoever may read it: the user's umask decides (077 keeps the job script private).
    script.chmod(0o777 & ~current_umask())
    return SlurmPlan(launch, script, text, options.nodes, procs, warnings)


def render_script(
    launch: LaunchPlan,
    options: SlurmOptions,
    procs: int,
    recipe_path: Path,
    overrides: list[str],
    workdir: Path,
) -> str:
    """The sbatch script. The job runs in ``workdir`` (where the recipe's relative paths point)."""
    run_dir, device = launch.run_dir, launch.device
    port = options.master_port or DEFAULT_PORT
    given = " ".join(overrides).replace("\n", " ") or "none"
    lines = [
        "#!/bin/bash",
        f"# Written by `magistral train --slurm` from {recipe_path} (overrides: {given}).",
        f"# Submit it with: sbatch {run_dir / SCRIPT_NAME}",
        f"#SBATCH --job-name={options.job_name or run_dir.name}",
        f"#SBATCH --nodes={options.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if device == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={procs}")
    elif device == "npu":
        lines.append(f"#SBATCH --gres=npu:{procs}")
    if options.partition:
        lines.append(f"#SBATCH --partition={options.partition}")
    if options.time:
        lines.append(f"#SBATCH --time={options.time}")
    if options.account:
        lines.append(f"#SBATCH --account={options.account}")
    lines += [
        f"#SBATCH --output={run_dir}/logs/slurm-%j.out",
        # Relative paths of the recipe (data, cache) mean what they meant where it was planned.
        f"#SBATCH --chdir={workdir}",
        "set -euo pipefail",
        "",
        f"# {device} defaults of `magistral train`; a variable already set in the job's environment wins.",
    ]
    for key, value in device_defaults(device, procs).items():
        lines.append(f'export {key}="${{{key}:-{_dq(value)[1:-1]}}}"')
    lines += [
        "",
        "# torchrun's c10d rendezvous on the job's first node.",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f'MASTER_PORT="${{MASTER_PORT:-{port}}}"',
        f"RUN_DIR={_dq(str(run_dir))}",
        "# A summary or rank statuses left by an earlier launch into this run directory describe that launch.",
        'rm -rf "$RUN_DIR/summary.json" "$RUN_DIR/rank_status"',
    ]
    python = shlex.quote(sys.executable)
    if not launch.recipe.data.dataset_param.is_synthetic:
        lines += [
            "# Encode the dataset (or find its cache entry) once, before any rank waits for it.",
            f'{python} -m magistral_cli preprocess "$RUN_DIR/resolved_config.yaml"',
        ]
    lines += [
        "",
        f"srun --kill-on-bad-exit=1 {python} -m torch.distributed.run"
        f' --nnodes "$SLURM_NNODES" --nproc-per-node {procs}'
        ' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID"'
        ' --log-dir "$RUN_DIR/logs" --tee 3 --local-ranks-filter 0'
        f' -m {ENGINE_MODULE} "$RUN_DIR/resolved_config.yaml"',
    ]
    return "\n".join(lines) + "\n"


def submit(plan: SlurmPlan) -> str:
    """``sbatch --parsable SCRIPT``; the job id. UserError when sbatch is missing or refuses the job."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError(
            f"sbatch was not found on PATH, so the job was not submitted; the script is {plan.script}. "
            "Run on a SLURM login node (or load its module, e.g. `module load slurm`) and submit it with "
            f"`sbatch {plan.script}`, or pass --dry-run to only write it"
        )
    done = subprocess.run([sbatch, "--parsable", str(plan.script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(
            f"sbatch refused {plan.script} (exit status {done.returncode}): "
            + (done.stderr.strip() or done.stdout.strip() or "no message")
        )
    # --parsable prints "<job id>[;<cluster>]"
    return done.stdout.strip().split(";")[0]
