"""The torchrun launcher behind ``magistral train``.

``plan_launch`` resolves the recipe, checks it against the world size, checks what it may write
and where (``rundir``: the run directory, the checkpoint directory's owner, checkpoints left
behind, a resume under a changed set-up), creates the run directory (``resolved_config.yaml``,
``run_identity.json``, ``logs/``) and builds the exact torchrun command and the environment it
adds. A dry run checks the same and writes nothing. ``run_launch`` runs it and returns the
training's exit status: a failing rank fails the command.

Multi-node runs use torchrun's own static rendezvous (``--nnodes --node-rank
--master-addr --master-port``); nothing here is home-made.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from magistral_cli.config import load_recipe, recipe_to_yaml
from magistral_cli.config.schema import Recipe
from magistral_cli.run_record import RESOLVED_CONFIG, RESUME_KEY
from magistral_cli.versions import check_supported_versions

from . import preflight
from .device import device_defaults, merge_env
from .identity import write_json

#: The module torchrun starts on every rank.
ENGINE_MODULE = "magistral_cli.engine.run"


@dataclass
class LaunchOptions:
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    #: Start nothing, write nothing (the checks run, and what this machine lacks only warns).
    dry_run: bool = False
    #: With ``dry_run``: write the run directory all the same, for a job started elsewhere (``--slurm``).
    write_run_dir: bool = False
    #: Write into a checkpoint directory that another run owns, on purpose (``--share-checkpoints``).
    share_checkpoints: bool = False
    #: Resume a checkpoint under a changed data set-up, the data order started again (``--restart-data``).
    restart_data: bool = False

    @property
    def writes(self) -> bool:
        return not self.dry_run or self.write_run_dir


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
    cmd += ["-m", ENGINE_MODULE, str(run_dir / RESOLVED_CONFIG)]
    return cmd


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
    command = build_command(options, nproc, run_dir)

    if lock is not None:
        if claim is not None:
            claim.record(dest.run_id, run_dir, shared=dest.shared is not None)
        if options.node_rank == 0:  # the run's record (every node reads the one resolved recipe)
            write_json(run_dir / "run_identity.json", identity)
        (run_dir / RESOLVED_CONFIG).write_text(
            f"# Resolved from {recipe_path} with overrides: {' '.join(overrides) or '(none)'}\n"
            + recipe_to_yaml(recipe),
            encoding="utf-8",
        )
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dataset = None
    if not options.dry_run and recipe.data.dataset_param.dataset_type != "synthetic":
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


#: torchrun's own report of a failed rank starts with one of these (its log line or its traceback).
_TORCHRUN_FAILURE = re.compile(r"^(E\d{4} .*\] failed \(exitcode|Traceback \(most recent call last\):)")
#: How many lines of a crashed rank's log the failure report shows.
LOG_TAIL = 15


def _forward_stderr(stream, failure_log: Path) -> None:
    """Copy torchrun's stderr to ours until its failure report starts; keep that report in a file."""
    out = None
    try:
        for line in stream:
            if out is None and _TORCHRUN_FAILURE.match(line):
                out = open(failure_log, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
            if out is None:
                sys.stderr.write(line)
                sys.stderr.flush()
            else:
                out.write(line)
    finally:
        if out is not None:
            out.close()


def _rank_log(run_dir: Path, rank: int) -> Path | None:
    """The newest ``stderr.log`` torchrun wrote for local rank ``rank``."""
    logs = sorted((run_dir / "logs").glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


#: One failure in torchrun's report: ``rank : 1 (local_rank: 1)``, then ``exitcode : -9 (pid: N)``.
_TORCHRUN_RANK = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exits(run_dir: Path) -> tuple[dict[int, int], int | None]:
    """({rank: exit code} from torchrun's failure report, the rank it names as the root cause).

    A negative code is the signal that killed the rank (torchrun's own convention).
    """
    try:
        text = (run_dir / "logs" / "torchrun_failure.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}, None
    root = text.partition("Root Cause")[2]
    codes = {int(m.group(1)): int(m.group(2)) for m in _TORCHRUN_RANK.finditer(text)}
    first = _TORCHRUN_RANK.search(root)
    return codes, int(first.group(1)) if first else None


def _signal_name(number: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


def failure_report(run_dir: Path, code: int, nproc: int) -> tuple[list[str], int]:
    """(lines naming each failed rank with its own error, the command's exit status).

    The cause comes first: a rank killed by a signal (torchrun's report gives the signal; the
    other ranks then fail on their lost connection, which comes after it), then a rank that
    ended without a status, then the ranks' own errors. Exit 2 when every failed rank stopped on
    a user error (a bad recipe, a bad path), 1 otherwise.
    """
    from magistral_cli.engine.run import STATUS_DIR

    statuses = {}
    for path in sorted((run_dir / STATUS_DIR).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text(encoding="utf-8"))
            statuses[int(record["rank"])] = record
    failed = {r: s for r, s in statuses.items() if s.get("exit_status")}
    missing = [r for r in range(nproc) if r not in statuses]
    user_errors = [r for r, s in failed.items() if s.get("kind") == "user"]
    if user_errors and all(s.get("kind") == "user" for s in failed.values()):
        # A rank stopped on bad input: torchrun then stops the others (SIGTERM), and a rank stopped
        # before it could record anything is that consequence, not a second failure.
        lines = [f"rank {rank} failed: {_short_error(failed[rank])}" for rank in sorted(user_errors)]
        if missing:
            stopped = ", ".join(str(r) for r in missing)
            lines.append(f"rank(s) {stopped} stopped by torchrun after that failure (no status of their own)")
        return lines, 2
    codes, root = torchrun_exits(run_dir)
    # Killed by a signal: the likeliest cause, first. A SIGTERM that torchrun sent after another
    # rank's failure (it stops the rest) is a consequence, not a cause.
    killed = {
        r: -c
        for r, c in codes.items()
        if c < 0 and r not in failed and not (-c == signal.SIGTERM and root is not None and r != root)
    }
    stopped = [r for r, c in codes.items() if c == -signal.SIGTERM and r not in killed and r not in failed]
    lines: list[str] = []
    for rank, number in sorted(killed.items()):
        why = ": the out-of-memory killer or a `kill -9`" if number == signal.SIGKILL else ""
        lines.append(f"rank {rank} was killed by signal {number} ({_signal_name(number)}){why}")
        if rank < nproc:
            lines += _log_tail(run_dir, rank)
    # Ranks of this node that recorded nothing, for no reason torchrun gave, were killed (the
    # out-of-memory killer) or died before start-up, with their log's last lines.
    for rank in missing:
        if rank in killed or rank in stopped:
            continue
        lines.append(
            f"rank {rank} ended without a status (torchrun exit status {code}): killed, out of memory, "
            "or a crash before start-up"
        )
        lines += _log_tail(run_dir, rank)
    after = f" after rank {min(killed)} was killed" if killed else ""
    for rank, record in sorted(failed.items()):
        error = _short_error(record)
        if record.get("kind") in ("user", "check"):
            lines.append(f"rank {rank} failed{after}: {error}")
        else:
            lines.append(f"rank {rank} crashed{after}: {error}")
            if not missing and not killed and rank < nproc:
                lines += _log_tail(run_dir, rank)
    if stopped:
        ranks = ", ".join(map(str, sorted(stopped)))
        lines.append(
            f"rank(s) {ranks} stopped by torchrun" + (" after that failure" if lines else " (SIGTERM)")
        )
    if not lines:
        lines.append(f"torchrun exit status {code}, but every rank recorded success")
    return lines, 1


def _short_error(record: dict) -> str:
    error = str(record.get("error"))
    return error[:400] + " ..." if len(error) > 400 else error


def _log_tail(run_dir: Path, local_rank: int) -> list[str]:
    log = _rank_log(run_dir, local_rank)
    if log is None:
        return []
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_TAIL:]
    return [f"  {line}" for line in tail]


def run_launch(plan: LaunchPlan, console, node_rank: int = 0) -> int:
    """Run torchrun; return the job's exit status (non-zero when any rank failed).

    The run directory is locked for the job (``magistral_cli.run_lock``): a second launch on it
    exits 2. Ctrl-C reaches torchrun directly (same process group); a SIGTERM sent to this
    process is passed on to torchrun, which stops its ranks; a SIGKILL of this process alone
    SIGTERMs torchrun (its parent-death signal); and the ranks die with torchrun, so no rank
    outlives the command. A failed job prints which rank failed with that rank's own
    error lines; torchrun's traceback goes to ``logs/torchrun_failure.log``.
    """
    import shutil
    import threading

    from magistral_cli.engine.run import STATUS_DIR
    from magistral_cli.errors import CheckFailed
    from magistral_cli.run_lock import RunLock, parent_death_preexec

    env = {**os.environ, **plan.env_added}
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
        # torchrun gets SIGTERM when this process dies, even by SIGKILL alone (the out-of-memory
        # killer's way), and stops its ranks; they die with torchrun in any case.
        child = subprocess.Popen(
            plan.command,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            preexec_fn=parent_death_preexec(),
        )
        reader = threading.Thread(target=_forward_stderr, args=(child.stderr, failure_log), daemon=True)
        reader.start()

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
        reader.join(timeout=10)
        status = code
        lines: list[str] = []
        if code != 0:
            lines, status = failure_report(plan.run_dir, code, plan.nproc_per_node)
        record = {"steps": None, "wall_s": round(time.monotonic() - start, 3), "exit_status": status}
        if summary.exists():
            with contextlib.suppress(ValueError, OSError):
                record = {**json.loads(summary.read_text(encoding="utf-8")), "exit_status": status}
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
        console.print(f"[red]training failed[/] (exit status {status})", highlight=False)
        for line in lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        console.print(f"per-rank logs: {plan.run_dir / 'logs'}", markup=False, highlight=False)
    return status
