"""The torchrun launcher behind ``magistral train``: what a launch does, in order.

``plan_launch`` resolves the recipe, runs the pre-flight checks (``preflight``: the options, the
devices against the world size, the inputs, what it may write and where through ``rundir``, the
memory plan), creates the run directory (``resolved_config.yaml``, ``run_identity.json``,
``logs/``) and builds the exact torchrun command (``supervise.build_command``) and the
environment it adds. A dry run checks the same and writes nothing. ``run_launch`` runs it under
``supervise`` and returns the training's exit status: a failing rank fails the command. The plan
is data (``LaunchPlan``); the CLI renders it (``cli/train_render.py``).

Multi-node runs use torchrun's own static rendezvous (``--nnodes --node-rank
--master-addr --master-port``); nothing here is home-made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from magistral_cli.config import load_recipe, recipe_to_yaml
from magistral_cli.config.schema import Recipe
from magistral_cli.run_record import IDENTITY_NAME, RESOLVED_CONFIG, RESUME_KEY, write_json
from magistral_cli.versions import check_supported_versions

from . import preflight, supervise
from .device import device_defaults, merge_env
from .options import LaunchOptions


@dataclass
class LaunchPlan:
    """What a launch does, as data (JSON: ``to_json``); the CLI renders it (``cli/train_render.py``)."""

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
    #: The memory plan (``engine.memory_plan.MemoryPlan``), None when a dry run could not make it.
    memory: Any = None
    #: The run directory's lock (``run_lock.RunLock``), held from planning to the job's end.
    lock: Any = None
    #: The padding estimate (``preflight.padding_section``): the dataset's cache entry, a note, the estimate.
    padding: dict[str, Any] | None = None
    #: The run's id (kept across its launches; a checkpoint directory records its owner's).
    run_id: str | None = None
    #: How this launch resumes (``rundir.ResumeDecision.record()``), None for a fresh start.
    resume: dict[str, Any] | None = None
    #: Whether the run directory was written (a dry run writes nothing).
    written: bool = False

    @property
    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env_added.items())
        return (env + " " if env else "") + shlex.join(self.command)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "resolved_config": str(self.run_dir / RESOLVED_CONFIG),
            "run_identity": str(self.run_dir / "run_identity.json"),
            "written": self.written,
            "run_id": self.run_id,
            "resume": self.resume,
            "resolved_recipe": self.recipe.model_dump(mode="json"),
            "device": self.device,
            "nproc_per_node": self.nproc_per_node,
            "nnodes": self.nnodes,
            "world_size": self.world_size,
            "command": self.command,
            "env_added": self.env_added,
            "env_kept_from_user": self.env_kept,
            "warnings": self.warnings,
            "memory_plan": self.memory.to_json() if self.memory is not None else None,
            "padding": self.padding,
        }


def _default_run_dir(recipe_path: Path) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe_path.stem}-{stamp}"


def plan_launch(
    recipe_path: str | Path, overrides: list[str], options: LaunchOptions, *, progress=None
) -> LaunchPlan:
    """Resolve the recipe and write the run directory; raise UserError on bad input.

    ``progress(done_rows, total_rows)`` (``data.pipeline.ProgressFn``) follows the dataset
    encoding a real launch does before the ranks start (the CLI passes a rich bar)."""
    recipe_path = Path(recipe_path)
    recipe = load_recipe(recipe_path, overrides)
    warnings: list[str] = []
    check_supported_versions()  # before the meta model is built with transformers
    preflight.check_options(recipe, options)
    device, nproc, detected = preflight.resolve_processes(recipe, recipe_path, options, warnings)
    world_size = nproc * options.nnodes
    preflight.check_inputs(recipe, warnings, options.dry_run)
    run_dir = Path(recipe.training.output_dir or _default_run_dir(recipe_path)).absolute()
    recipe.parallel.device = device  # type: ignore[assignment]
    recipe.parallel.nproc_per_node = nproc
    from magistral_cli.run_lock import RunLock

    if options.writes:  # a job running in this directory first: the checks below would read its files
        RunLock(run_dir, options.node_rank).check_free()
    # What the launch may write and where (reads only, so a refusal is quick and leaves nothing).
    dest = preflight.check_destinations(recipe, recipe_path, options, run_dir, warnings)
    # Pre-flight in this process, before any rank starts: config.json, the tying rule and every
    # module pattern against the meta model (the memory plan builds it), then the save directory.
    memory = preflight.memory_plan(
        recipe, device, world_size, nproc, detected, warnings, required=not options.dry_run
    )

    # Before anything is written there: a job running in this directory keeps its files. A dry
    # run writes nothing, so it takes no lock.
    created = not run_dir.exists()
    lock = RunLock(run_dir, options.node_rank).acquire() if options.writes else None
    try:
        plan = _write_run_dir(recipe, recipe_path, overrides, options, dest, memory, warnings, progress, lock)
        plan.device, plan.nproc_per_node, plan.world_size = device, nproc, world_size
    except BaseException:
        if lock is not None:
            lock.release()
            if created:
                _remove_if_empty(run_dir, lock.path)
        raise
    if lock is not None and options.dry_run:
        lock.release()
    else:
        plan.lock = lock
    return plan


def _remove_if_empty(run_dir: Path, lock_file: Path) -> None:
    """A run directory this launch created and wrote nothing into (a refused launch) is removed."""
    with contextlib.suppress(OSError):
        if [p.name for p in run_dir.iterdir()] == [lock_file.name]:
            lock_file.unlink()
            run_dir.rmdir()


def _write_run_dir(
    recipe, recipe_path, overrides, options, dest, memory, warnings, progress=None, lock=None
) -> LaunchPlan:
    """Unless a dry run: claim the save directory, remove stale temporaries, check the room for
    the checkpoints, write run_identity.json, resolved_config.yaml and logs/, encode the data."""
    from magistral_cli.run_lock import SaveDirClaim

    device, nproc = recipe.parallel.device, recipe.parallel.nproc_per_node
    world_size = nproc * options.nnodes
    run_dir, save_dir, identity = dest.run_dir, dest.save_dir, dest.identity
    claim = None
    if lock is not None and save_dir is not None and options.node_rank == 0:
        # Locked before anything there is touched (stale temporaries): no other job writes it now.
        claim = SaveDirClaim(save_dir)
        lock.hold(claim)
        if save_dir.is_dir():
            claim.lock()
    if save_dir is None:
        warnings.append(
            "no checkpoint will be written (training.save is not set, as in the seed's configs), so this run "
            "cannot be resumed; set training.save=checkpoints (inside the run directory) or a path to keep them"
        )
    else:
        preflight.check_save_dir(recipe, save_dir, memory, warnings, options)
    if dest.shared:
        warnings.append(dest.shared)
    added, kept = merge_env(device_defaults(device, nproc), dict(os.environ))
    command = supervise.build_command(options, nproc, run_dir)

    if lock is not None:
        if claim is not None:
            claim.record(dest.run_id, run_dir, shared=dest.shared is not None)
        if options.node_rank == 0:  # the run's record (every node reads the one resolved recipe)
            write_json(run_dir / IDENTITY_NAME, identity)
        (run_dir / RESOLVED_CONFIG).write_text(
            f"# Resolved from {recipe_path} with overrides: {' '.join(overrides) or '(none)'}\n"
            + recipe_to_yaml(recipe),
            encoding="utf-8",
        )
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dataset = None
    if not options.dry_run and not recipe.data.dataset_param.is_synthetic:
        # Encode (or find the cache) here, once, so that no rank waits in a barrier while
        # rank 0 encodes: a long encode would outlast the collective timeout.
        from magistral_cli.data.loader import dataset_split, prepare_dataset

        dataset = prepare_dataset(recipe, progress=progress)
        dataset_split(recipe, dataset)  # a val_size that leaves no training sample stops here
    # A dry run encodes nothing: it estimates from the cache entry only if that exists already.
    hint = "magistral preprocess " + shlex.join([str(recipe_path), *overrides])
    padding = preflight.padding_section(recipe, world_size, dataset, hint=hint)
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
        memory=memory,
        padding=padding,
        run_id=dest.run_id,
        resume=identity[RESUME_KEY],
        written=lock is not None,
    )


def run_launch(plan: LaunchPlan, console, node_rank: int = 0) -> int:
    """Run torchrun; return the job's exit status (non-zero when any rank failed).

    The run directory is locked for the job (``magistral_cli.run_lock``): a second launch on it
    exits 2. Ctrl-C reaches torchrun directly (same process group); a SIGTERM sent to this
    process is passed on to torchrun, which stops its ranks; a SIGKILL of this process alone
    SIGTERMs torchrun (its parent-death signal); and the ranks die with torchrun, so no rank
    outlives the command (``supervise.run_torchrun``). A failed job prints which rank failed with
    that rank's own error lines (``supervise.failure_report``) on ``console`` (anything with rich's
    ``print``); torchrun's traceback goes to ``logs/torchrun_failure.log``.
    """
    import shutil

    from magistral_cli.engine.run import LOST_PEER, STATUS_DIR
    from magistral_cli.errors import CheckFailed
    from magistral_cli.run_lock import RunLock

    summary = plan.run_dir / "summary.json"
    failure_log = plan.run_dir / "logs" / "torchrun_failure.log"
    lock = plan.lock or RunLock(plan.run_dir, node_rank).acquire()
    try:
        # A summary or rank statuses left by an earlier launch into this run directory (a resume)
        # would describe that launch.
        summary.unlink(missing_ok=True)
        shutil.rmtree(plan.run_dir / STATUS_DIR, ignore_errors=True)
        failure_log.unlink(missing_ok=True)
        start = time.monotonic()
        code = supervise.run_torchrun(plan.command, {**os.environ, **plan.env_added}, failure_log)
        status = code
        lines: list[str] = []
        if code != 0:
            lines, status = supervise.failure_report(plan.run_dir, code, plan.nproc_per_node)
        record = {"steps": None, "wall_s": round(time.monotonic() - start, 3), "exit_status": status}
        if summary.exists():
            with contextlib.suppress(ValueError, OSError):
                record = {**json.loads(summary.read_text(encoding="utf-8")), "exit_status": status}
        if lines and (not record.get("error") or LOST_PEER.search(str(record["error"]))):
            # Rank 0 wrote its own error, which may only be the connection it lost when another rank
            # failed (or it wrote none): the job's error is the cause the report names first.
            record["error"] = lines[0]
        # The engine writes summary.json when it finishes; the launcher records how the whole job
        # ended (a rank can fail after rank 0 wrote its summary).
        try:
            write_json(summary, record)
        except CheckFailed as exc:
            lines.append(str(exc))
            status = status or 1
    finally:
        lock.release()
        plan.lock = None
    if status != 0:
        supervise.print_failure(console, status, lines, plan.run_dir / "logs")
    return status
