"""The torchrun launcher behind ``magistral train``.

``plan_launch`` resolves the recipe, checks it against the world size, creates the run
directory (``resolved_config.yaml``, ``run_identity.json``, ``logs/``) and builds the exact
torchrun command and the environment it adds. ``run_launch`` runs it and returns the
training's exit status: a failing rank fails the command.

Multi-node runs use torchrun's own static rendezvous (``--nnodes --node-rank
--master-addr --master-port``); nothing here is home-made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from magistral_cli.config import check_world_size, load_recipe, recipe_to_yaml
from magistral_cli.config.schema import Recipe
from magistral_cli.errors import UserError

from .device import device_defaults, merge_env, resolve_device
from .identity import build_identity, write_json

#: The module torchrun starts on every rank.
ENGINE_MODULE = "magistral_cli.engine.run"


@dataclass
class LaunchOptions:
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    dry_run: bool = False


@dataclass
class LaunchPlan:
    recipe: Recipe
    recipe_path: Path
    run_dir: Path
    device: str
    nproc_per_node: int
    nnodes: int
    world_size: int
    command: list[str]
    env_added: dict[str, str]
    env_kept: dict[str, str]
    warnings: list[str] = field(default_factory=list)

    @property
    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_added.items())
        return (env + " " if env else "") + shlex.join(self.command)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "resolved_config": str(self.run_dir / "resolved_config.yaml"),
            "run_identity": str(self.run_dir / "run_identity.json"),
            "device": self.device,
            "nproc_per_node": self.nproc_per_node,
            "nnodes": self.nnodes,
            "world_size": self.world_size,
            "command": self.command,
            "env_added": self.env_added,
            "env_kept_from_user": self.env_kept,
            "warnings": self.warnings,
        }

    def render(self, console) -> None:
        for warning in self.warnings:
            console.print(f"[yellow]warning:[/] {warning}")
        console.print(f"[bold]run directory[/]  {self.run_dir}")
        console.print(
            f"[bold]device[/]         {self.device}, {self.nproc_per_node} process(es) per node x {self.nnodes} node(s)"
            f" = world size {self.world_size}"
        )
        for key, value in self.env_added.items():
            console.print(f"[bold]env[/]            {key}={value}")
        for key, value in self.env_kept.items():
            console.print(f"[bold]env[/]            {key}={value} [dim](yours, kept)[/]")
        console.print("[bold]command[/]")
        console.print(self.command_line, soft_wrap=True, markup=False)


def _default_run_dir(recipe_path: Path) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe_path.stem}-{stamp}"


def _check_paths(recipe: Recipe, warnings: list[str], dry_run: bool) -> None:
    """Missing inputs stop a real launch; a dry run (often made on another machine) only warns."""
    basic = recipe.data.dataset_param.basic_parameters
    checks = [
        ("model.model_name_or_path", recipe.model.model_name_or_path, "is_dir"),
        ("training.load", recipe.training.load, "exists"),
        ("data.dataset_param.basic_parameters.dataset", basic.dataset, "is_file"),
    ]
    problems = []
    for key, value, kind in checks:
        if value and not getattr(Path(value), kind)():
            problems.append(f"{key} points to {value}, which does not exist")
    if not problems:
        return
    if dry_run:
        warnings.extend(problems)
        return
    raise UserError(
        "; ".join(problems) + ". Fix the path in the recipe or override it (for example "
        "model.model_name_or_path=/path/to/Magistral-Small-2509)."
    )


def build_command(plan_args: LaunchOptions, nproc: int, run_dir: Path) -> list[str]:
    """The torchrun command (``python -m torch.distributed.run``, so the same interpreter runs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if plan_args.nnodes == 1 and plan_args.master_addr is None and plan_args.master_port is None:
        # One node: a local rendezvous on a free port, so two runs on one machine never clash.
        cmd += ["--standalone"]
    else:
        cmd += [
            "--nnodes",
            str(plan_args.nnodes),
            "--node-rank",
            str(plan_args.node_rank),
            "--master-addr",
            plan_args.master_addr or "127.0.0.1",
            "--master-port",
            str(plan_args.master_port or 29500),
        ]
    # Every rank's stdout/stderr goes to logs/ (torchrun's --log-dir); the console shows rank 0.
    cmd += ["--log-dir", str(run_dir / "logs"), "--tee", "3", "--local-ranks-filter", "0"]
    cmd += ["-m", ENGINE_MODULE, str(run_dir / "resolved_config.yaml")]
    return cmd


def plan_launch(recipe_path: str | Path, overrides: list[str], options: LaunchOptions) -> LaunchPlan:
    """Resolve the recipe and write the run directory; raise UserError on bad input."""
    recipe_path = Path(recipe_path)
    recipe = load_recipe(recipe_path, overrides)
    warnings: list[str] = []

    if options.nnodes > 1 and options.master_addr is None:
        raise UserError("--nnodes > 1 needs --master-addr (the address of the node with --node-rank 0)")
    if options.node_rank >= options.nnodes:
        raise UserError(f"--node-rank {options.node_rank} must be smaller than --nnodes {options.nnodes}")
    if options.nnodes > 1 and recipe.training.output_dir is None:
        raise UserError(
            "a multi-node run needs training.output_dir=<a path every node sees>, so all nodes write one run directory"
        )

    device, count, warning = resolve_device(recipe.parallel.device)
    if warning:
        if not options.dry_run:
            raise UserError(warning + "; set parallel.device=auto or run on a machine with that device")
        warnings.append(warning)
    nproc = options.nproc_per_node or recipe.parallel.nproc_per_node or count or 1
    if device in ("cuda", "npu") and count is not None and nproc > count:
        message = f"{nproc} processes per node but only {count} {device} device(s) are visible"
        if not options.dry_run:
            raise UserError(message + "; lower --nproc-per-node")
        warnings.append(message)
    world_size = nproc * options.nnodes
    try:
        check_world_size(recipe, world_size)
    except ValueError as exc:
        raise UserError(f"recipe {recipe_path}: {exc}") from None
    _check_paths(recipe, warnings, options.dry_run)

    run_dir = Path(recipe.training.output_dir or _default_run_dir(recipe_path)).absolute()
    recipe.training.output_dir = str(run_dir)
    recipe.parallel.device = device  # type: ignore[assignment]
    recipe.parallel.nproc_per_node = nproc

    added, kept = merge_env(device_defaults(device, nproc), dict(os.environ))
    command = build_command(options, nproc, run_dir)

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "resolved_config.yaml").write_text(
        f"# Resolved from {recipe_path} with overrides: {' '.join(overrides) or '(none)'}\n"
        + recipe_to_yaml(recipe),
        encoding="utf-8",
    )
    identity = build_identity(
        recipe_path=recipe_path,
        dataset=recipe.data.dataset_param.basic_parameters.dataset,
        model_dir=recipe.model.model_name_or_path,
        device=device,
        world_size=world_size,
        nnodes=options.nnodes,
        nproc_per_node=nproc,
        env={**os.environ, **added},
    )
    write_json(run_dir / "run_identity.json", identity)
    return LaunchPlan(
        recipe=recipe,
        recipe_path=recipe_path,
        run_dir=run_dir,
        device=device,
        nproc_per_node=nproc,
        nnodes=options.nnodes,
        world_size=world_size,
        command=command,
        env_added=added,
        env_kept=kept,
        warnings=warnings,
    )


def run_launch(plan: LaunchPlan, console) -> int:
    """Run torchrun; return its exit status (non-zero when any rank failed).

    Ctrl-C reaches torchrun directly (same process group); a SIGTERM sent to this process is
    passed on to torchrun, which stops its ranks, so no rank outlives the command.
    """
    env = {**os.environ, **plan.env_added}
    summary = plan.run_dir / "summary.json"
    # A summary left by an earlier launch into this run directory (a resume) would describe that launch.
    summary.unlink(missing_ok=True)
    start = time.monotonic()
    child = subprocess.Popen(plan.command, env=env)

    def _forward(signum, _frame):
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, _forward)
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:
                continue  # torchrun got the same SIGINT and is stopping its ranks: wait for it
    finally:
        signal.signal(signal.SIGTERM, previous)
    record = {"steps": None, "wall_s": round(time.monotonic() - start, 3), "exit_status": code}
    if summary.exists():
        with contextlib.suppress(ValueError):
            record = {**json.loads(summary.read_text(encoding="utf-8")), "exit_status": code}
    # The engine writes summary.json when it finishes; the launcher records how the whole job ended
    # (a rank can fail after rank 0 wrote its summary).
    write_json(summary, record)
    if code != 0:
        console.print(f"[red]training failed[/] (exit status {code}); per-rank logs: {plan.run_dir / 'logs'}")
    return code
