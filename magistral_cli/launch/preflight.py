"""Pre-flight: what ``magistral train`` checks before any process starts.

The command line's options against each other, the device and the processes per node against this
machine and the recipe's world-size rules, the recipe's inputs (paths, a LoRA checkpoint given as
``training.load``, the logger's package), what the launch may write and where (``rundir``) with the
run identity, the memory plan (config.json, the tying rule and every module pattern against the
meta model), the checkpoint directory (writable, room for the saves) and the padding estimate.
Each check raises UserError on bad input; a dry run (often made on another machine) turns what
this machine lacks into warnings. Nothing here writes the run directory or starts a process
(``launcher.py`` does, in order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magistral_cli.config import check_world_size
from magistral_cli.config.schema import Recipe
from magistral_cli.errors import UserError
from magistral_cli.run_record import RESUME_KEY

from .device import device_defaults, merge_env, resolve_device
from .identity import build_identity

if TYPE_CHECKING:
    from .options import LaunchOptions


def check_options(recipe: Recipe, options: LaunchOptions) -> None:
    """The multi-node options: an address for the rank-0 node, a node rank below the node count,
    and one run directory every node sees."""
    if options.nnodes > 1 and options.master_addr is None:
        raise UserError("--nnodes > 1 needs --master-addr (the address of the node with --node-rank 0)")
    if options.node_rank >= options.nnodes:
        raise UserError(f"--node-rank {options.node_rank} must be smaller than --nnodes {options.nnodes}")
    if options.nnodes > 1 and recipe.training.output_dir is None:
        raise UserError(
            "a multi-node run needs training.output_dir=<a path every node sees>, so all nodes write one run directory"
        )


def resolve_processes(
    recipe: Recipe, recipe_path: Path, options: LaunchOptions, warnings: list[str]
) -> tuple[str, int, bool]:
    """(the device, the processes per node, whether the device count was detected here).

    The device must be on this machine and the processes must not outnumber its devices (a dry
    run only warns), and the world size must suit the recipe (``config.check_world_size``)."""
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
    check_world_size(recipe, nproc * options.nnodes, source=f"recipe {recipe_path}")
    return device, nproc, warning is None and count is not None


def check_paths(recipe: Recipe, warnings: list[str], dry_run: bool) -> None:
    """Missing inputs stop a real launch; a dry run (often made on another machine) only warns."""
    basic = recipe.data.dataset_param.basic_parameters
    checks = [
        ("model.model_name_or_path", recipe.model.model_name_or_path, "is_dir"),
        # A model directory, a DCP directory, a run or its checkpoints: always a directory.
        ("training.load", recipe.training.load, "is_dir"),
    ]
    if not recipe.data.dataset_param.is_synthetic:
        checks.append(("data.dataset_param.basic_parameters.dataset", basic.dataset, "is_file"))
    problems = []
    for key, value, kind in checks:
        path = Path(value) if value else None
        if path is None or getattr(path, kind)():
            continue
        if not path.exists():
            problems.append(f"{key} points to {value}, which does not exist")
        elif kind == "is_dir":
            problems.append(f"{key} points to {value}, which is a file; it takes a directory")
        else:
            problems.append(f"{key} points to {value}, which is a directory; it takes a file")
    if not problems:
        return
    if dry_run:
        warnings.extend(problems)
        return
    raise UserError(
        "; ".join(problems) + ". Fix the path in the recipe or override it (for example "
        "model.model_name_or_path=/path/to/Magistral-Small-2509)."
    )


def check_inputs(recipe: Recipe, warnings: list[str], dry_run: bool) -> None:
    """The recipe's inputs: the paths (``check_paths``), no LoRA checkpoint as ``training.load``,
    and the optional packages the recipe needs (``tools.logger``'s, torchao for QLoRA) installed,
    before any rank starts."""
    check_paths(recipe, warnings, dry_run)
    lora = recipe.model.lora
    if lora is not None and lora.quantize_base != "none":
        from magistral_cli.versions import optional_problem

        problem = optional_problem("torchao")
        if problem:
            raise UserError(problem)
    from magistral_cli.engine.lora import refuse_lora_checkpoint_as_load

    refuse_lora_checkpoint_as_load(recipe.training.load, recipe.training.load_format)
    from magistral_cli.engine.loggers import check_logger_available

    check_logger_available(recipe)  # tools.logger's package, before any rank starts


@dataclass
class Destinations:
    """What ``check_destinations`` found: where the launch writes, and how it resumes."""

    run_dir: Path
    save_dir: Path | None
    run_id: str
    identity: dict[str, Any]
    #: The warning of a checkpoint directory shared on purpose, else None.
    shared: str | None = None
    decision: Any = None


def check_destinations(recipe, recipe_path, options, run_dir, warnings) -> Destinations:
    """The checks of ``rundir`` (the run directory, the checkpoint directory's owner, checkpoints
    left behind, a resume under a changed set-up) and the run identity: reads only, no lock."""
    import uuid

    from magistral_cli.engine.checkpoint import resolve_save_dir

    from . import rundir

    device, nproc = recipe.parallel.device, recipe.parallel.nproc_per_node
    world_size = nproc * options.nnodes
    training, basic = recipe.training, recipe.data.dataset_param.basic_parameters
    save_dir = resolve_save_dir(training.save, run_dir)
    previous = rundir.read_previous(run_dir)
    rundir.check_run_dir(run_dir, previous, save_dir)
    rundir.check_inputs_not_outputs(
        run_dir,
        [("the recipe", recipe_path), ("the dataset", basic.dataset), ("training.load", training.load)],
    )
    run_id = str((previous.identity or {}).get("run_id") or uuid.uuid4().hex)
    shared = None
    if save_dir is not None:
        shared = rundir.check_save_owner(save_dir, run_dir, run_id, previous, share=options.share_checkpoints)
    rundir.check_checkpoints_kept(run_dir, previous, save_dir, training.load)
    if save_dir is not None and training.resume == "never":
        from magistral_cli.engine.checkpoint import refuse_fresh_start

        refuse_fresh_start(save_dir)
    recipe.training.output_dir = str(run_dir)
    identity = build_identity(
        recipe_path=recipe_path,
        dataset=basic.dataset,
        model_dir=recipe.model.model_name_or_path,
        device=device,
        world_size=world_size,
        nnodes=options.nnodes,
        nproc_per_node=nproc,
        env={**os.environ, **merge_env(device_defaults(device, nproc), dict(os.environ))[0]},
    )
    resolved = recipe.model_dump(mode="json")
    setup = rundir.data_setup(resolved, world_size, identity["dataset"])
    decision = rundir.decide_resume(
        save_dir, resolved, setup, world_size, previous, restart_data=options.restart_data
    )
    if decision is not None and decision.message():
        warnings.append(decision.message())
    if options.restart_data and (decision is None or decision.data != "restart"):
        warnings.append(
            "--restart-data has no effect: this launch "
            + (
                "starts fresh"
                if decision is None
                else f"resumes {decision.checkpoint} under the data set-up it was saved under"
            )
        )
    identity.update(run_id=run_id, data_setup=setup)
    identity[RESUME_KEY] = decision.record() if decision is not None else None
    return Destinations(run_dir, save_dir, run_id, identity, shared, decision)


def memory_plan(
    recipe: Recipe,
    device: str,
    world_size: int,
    nproc: int,
    detected: bool,
    warnings: list[str],
    required: bool = False,
):
    """The memory plan, or None (with a warning) when the model's config.json is not here.

    A dry run (often made on another machine) may lack the config; a launch (``required``) may
    not. A config that is there but unreadable, or a module pattern that matches nothing, is the
    user's error (UserError) like any other bad input.
    """
    from magistral_cli.model_config import CONFIG_FILE, PARAMS_FILE

    model_dir = recipe.model.model_name_or_path
    # A directory of Mistral's native layout describes the model in params.json instead.
    if not model_dir or not any((Path(model_dir) / name).is_file() for name in (CONFIG_FILE, PARAMS_FILE)):
        if required:
            raise UserError(
                f"model.model_name_or_path {model_dir} holds no config.json; point it at the model directory "
                "(magistral fetch writes one)"
            )
        warnings.append(
            f"no memory plan: model.model_name_or_path {model_dir} holds no config.json "
            "(magistral fetch --no-weights writes one)"
        )
        return None
    from magistral_cli.engine.memory_plan import plan_recipe
    from magistral_cli.model_config import read_model_config
    from magistral_cli.ops.context_parallel import check_cp_model

    # The rules that need the model's config, as the ranks check them: Ulysses splits the heads.
    config = read_model_config(
        model_dir, trust_remote_code=recipe.model.trust_remote_code, what="model.model_name_or_path"
    )
    check_cp_model(config.text_config, recipe.parallel.ulysses_parallel_size)
    plan = plan_recipe(recipe, device=device, world_size=world_size, nproc_per_node=nproc, detected=detected)
    warnings.extend(plan.warnings)
    return plan


def check_save_dir(
    recipe: Recipe, save_dir: Path, memory, warnings: list[str], options: LaunchOptions
) -> None:
    """Stale temporaries removed, writable, room for the saves."""
    import shutil

    from magistral_cli.engine import checkpoint as ckpt

    training = recipe.training
    if options.dry_run or options.node_rank != 0:
        return
    for stale in ckpt.remove_stale_temporaries(save_dir):
        warnings.append(f"removed {stale}, left by an interrupted checkpoint save")
    probe_dir = save_dir
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise UserError(
            f"{probe_dir} is not writable; set training.output_dir (or training.save) to a writable place"
        )
    saves = max(planned_saves(training) - len(ckpt.list_checkpoints(save_dir)), 0)
    if memory is None or not saves:
        return
    need = saves * checkpoint_bytes(recipe, memory)
    free = shutil.disk_usage(probe_dir).free
    if need > free:
        raise UserError(
            f"{probe_dir} has {_size(free)} free, but the run will write {saves} checkpoint(s) of "
            f"{_size(need // saves)} ({_size(need)}); free space, point training.save at a larger disk, "
            "or save less often (training.save_interval, training.no_save_optim)"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def checkpoint_bytes(recipe: Recipe, memory) -> int:
    """The size of one training checkpoint: fp32 parameters, AdamW's two fp32 moments (unless
    ``no_save_optim``); the RNG and data-loader entries are a few KiB. A LoRA checkpoint holds
    the trainable tensors only (the plan's ``checkpointed`` count), not the frozen base."""
    counts = memory.parameters
    size = 4 * counts.get("checkpointed", counts["total"])
    if not recipe.training.no_save_optim:
        size += 8 * counts["trainable"]
    return size


def planned_saves(training) -> int:
    """How many checkpoints a whole run writes: every ``save_interval`` steps and at the end."""
    if not training.save_interval:
        return 0
    return training.train_iters // training.save_interval + (
        1 if training.train_iters % training.save_interval else 0
    )


def padding_section(recipe: Recipe, world_size: int, dataset=None, *, hint: str = "") -> dict[str, Any]:
    """How much of the recipe's micro-batches is padding, without and with packing.

    From the dataset's cache entry: ``dataset`` (a real launch has just prepared it) or, for a
    dry run, the entry if it already exists (``data.pipeline.find_cached_dataset``: nothing is
    encoded). The estimate (``data.packing.estimate_padding``) reads the preprocess report's
    ``length_histogram``, or the entry's sample lengths when an older report lacks it. Returns
    ``{"cache_entry", "note", "estimate"}``: ``estimate`` None and a one-line ``note`` when there
    is nothing to estimate from; ``hint`` is the preprocess command to suggest then.
    """
    basic = recipe.data.dataset_param.basic_parameters
    out: dict[str, Any] = {"cache_entry": None, "note": None, "estimate": None}
    if recipe.data.dataset_param.is_synthetic:
        out["note"] = "synthetic data: no dataset to estimate the padding from"
        return out
    from magistral_cli.data.packing import estimate_padding

    # training.stage: dpo: a micro-batch is 2 sequences per pair.
    per_sample = 2 if recipe.training.stage == "dpo" else 1
    rows_per_micro_batch = recipe.training.micro_batch_size * per_sample
    try:
        if dataset is None:
            from magistral_cli.data.pipeline import find_cached_dataset

            dataset = find_cached_dataset(recipe)
        if dataset is None:
            command = hint or "magistral preprocess RECIPE"
            out["note"] = f"no cache entry for this dataset yet: run `{command}` first for a padding estimate"
            return out
        out["cache_entry"] = str(dataset.path)
        histogram = dataset.report.get("length_histogram")
        if histogram is not None:
            source, estimates = (
                "report histogram",
                estimate_padding(basic.cutoff_len, rows_per_micro_batch, histogram=histogram),
            )
        else:  # an entry written before the report had a histogram: its offsets.npy is as good
            source, estimates = (
                "sample lengths",
                estimate_padding(basic.cutoff_len, rows_per_micro_batch, lengths=dataset.lengths),
            )
        # Rows a micro-batch holds in each mode: under dpo, packing packs whole pairs (up to
        # 2 x cutoff_len tokens, micro_batch_size packs), planned from the pairs' own lengths.
        rows_of = {"none": rows_per_micro_batch, "packing": rows_per_micro_batch}
        if per_sample == 2:
            from magistral_cli.data.packing import packing_units

            pair_lengths, capacity = packing_units(dataset.lengths, basic.cutoff_len, pairs=True)
            mbs = recipe.training.micro_batch_size
            estimates = {
                **estimates,
                "packing": estimate_padding(capacity, mbs, lengths=pair_lengths)["packing"],
            }
            rows_of["packing"] = mbs
    except (UserError, OSError, ValueError, KeyError) as exc:
        out["note"] = f"no padding estimate: {exc}"
        return out
    dp = max(1, world_size // recipe.parallel.cp_size)
    modes = {}
    for name, e in estimates.items():
        per_step = rows_of[name] * dp * recipe.training.gradient_accumulation_steps
        modes[name] = {
            "rows": e.rows,
            "rows_per_micro_batch": rows_of[name],
            "micro_batches_per_epoch": e.micro_batches,
            "steps_per_epoch": e.rows // per_step,
            "real_fraction": None if e.real_fraction is None else round(e.real_fraction, 4),
            "real_tokens_per_micro_batch": round(e.real_tokens, 1),
            "padded_tokens_per_micro_batch": round(e.padded_tokens, 1),
        }
    used = "neat_packing" if basic.neat_packing else "packing" if basic.packing else "none"
    out["estimate"] = {
        "source": source,
        "samples": estimates["none"].rows,
        "cutoff_len": basic.cutoff_len,
        "micro_batch_size": rows_per_micro_batch,
        # Under dpo the recipe's micro_batch_size counts pairs, each of 2 sequences (rows).
        "pairs_per_micro_batch": recipe.training.micro_batch_size if per_sample == 2 else None,
        "recipe_mode": used,
        "modes": modes,
    }
    notes = []
    if basic.val_size:
        notes.append("over every kept sample: the val_size split is not taken out")
    if per_sample == 2:
        from magistral_cli.data.packing import packing_units

        pair_capacity = packing_units([], basic.cutoff_len, pairs=True)[1]
        notes.append(
            "stage dpo: sequences, 2 per pair (a micro-batch of "
            f"{recipe.training.micro_batch_size} pairs is {rows_per_micro_batch} rows), drawn as if independent; "
            f"packing packs whole pairs, up to {pair_capacity} tokens a pack"
        )
    out["note"] = "; ".join(notes) or None
    return out
