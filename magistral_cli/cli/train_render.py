"""What `magistral train` shows: the launch plan, its memory plan and its padding estimate (rich).

The launcher (``launch/launcher.py``) returns the plan as data (``LaunchPlan``); this module
renders it on the console.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from magistral_cli.launch.launcher import LaunchPlan


def render_launch_plan(plan: LaunchPlan, console) -> None:
    """What a launch will do: warnings, the run directory, the device and world size, the environment
    added (and the user's kept), the torchrun command, the memory plan and the padding estimate.

    A dry run (the plan holds no lock) shows the memory plan's and the padding's whole tables; a
    launch shows one line of each."""
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    console.print(f"[bold]run directory[/]  {plan.run_dir}")
    console.print(
        f"[bold]device[/]         {plan.device}, {plan.nproc_per_node} process(es) per node x {plan.nnodes} node(s)"
        f" = world size {plan.world_size}"
    )
    for key, value in plan.env_added.items():
        console.print(f"[bold]env[/]            {key}={value}")
    for key, value in plan.env_kept.items():
        console.print(f"[bold]env[/]            {key}={value} [dim](yours, kept)[/]")
    console.print("[bold]command[/]")
    console.print(plan.command_line, soft_wrap=True, markup=False)
    if plan.memory is not None and plan.lock is None:
        render_memory_plan(plan.memory, console)  # the dry run: the whole table
    elif plan.memory is not None:
        from magistral_cli.engine.memory_plan import GIB

        console.print(
            f"[bold]memory plan[/]    {plan.memory.device_peak / GIB:.2f} GiB per rank on the device, "
            f"{plan.memory.host_peak / GIB:.2f} GiB on the host (--dry-run shows the items)"
        )
    if plan.padding is not None:
        render_padding(plan.padding, console, full=plan.lock is None)


def render_memory_plan(plan, console) -> None:
    """The memory plan as a table: one row per item, then the peak per rank (device and host)."""
    from rich.table import Table

    from magistral_cli.engine.memory_plan import GIB, PHASES

    counts = plan.parameters
    console.print(
        f"[bold]parameters[/]     {counts['total']:,} total, {counts['trainable']:,} trainable, "
        f"{counts['frozen']:,} frozen"
    )
    s = plan.settings
    batch = f"{s.micro_batch_size}"
    if s.sequences_per_sample == 2:
        batch += f" pair{'s' if s.micro_batch_size > 1 else ''} (2 sequences each)"
    table = Table(
        title=f"memory plan per rank (world size {s.world_size}, micro-batch {batch} x "
        f"{s.cutoff_len} tokens, accumulation {s.gradient_accumulation_steps})",
        title_justify="left",
    )
    table.add_column("item")
    table.add_column("where")
    table.add_column("GiB", justify="right")
    table.add_column("alive", no_wrap=True)
    table.add_column("how", overflow="fold")
    for item in plan.items:
        if item.bytes == 0:
            continue
        alive = "".join(mark if ph in item.phases else "-" for ph, mark in zip(PHASES, "LBS", strict=True))
        table.add_row(item.name, item.where, f"{item.bytes / GIB:.2f}", alive, item.formula)
    console.print(table)
    console.print("[dim]alive: L loss (start of backward), B end of backward, S optimizer step[/]")
    phases = ", ".join(f"{name} {value / GIB:.2f}" for name, value in plan.phases.items())
    console.print(f"[bold]device phases[/]  {phases} GiB")
    device = f"{plan.device_peak / GIB:.2f} GiB on the device ({plan.peak_phase})"
    if s.device_memory_bytes:
        device += f" of {s.device_memory_bytes / GIB:.1f} GiB ({s.device_memory_source})"
    host = f"{plan.host_peak / GIB:.2f} GiB on the host"
    if s.nproc_per_node > 1:
        host += f" ({plan.host_peak * s.nproc_per_node / GIB:.2f} GiB per node)"
    console.print(f"[bold]peak per rank[/]  {device}, {host}")
    for note in plan.notes:
        console.print(f"[dim]{note}[/]")


#: ``render_padding``'s names of the recipe's packing modes.
PADDING_MODES = {"none": "no packing", "packing": "packing"}


def render_padding(padding: dict[str, Any], console, *, full: bool = True) -> None:
    """The padding section: one line per mode (``full``, the dry run) or one line in all."""
    from rich.markup import escape

    estimate = padding["estimate"]
    if estimate is None:
        console.print(f"[bold]padding[/]        {escape(padding['note'])}", soft_wrap=True)
        return
    modes, used = estimate["modes"], estimate["recipe_mode"]
    used_key = "none" if used == "none" else "packing"

    def fraction(mode: dict) -> str:
        return "n/a" if mode["real_fraction"] is None else f"{mode['real_fraction']:.1%}"

    if not full:
        other = "packing" if used_key == "none" else "none"
        mode = modes[used_key]
        console.print(
            f"[bold]padding[/]        {fraction(mode)} real tokens in a micro-batch ({used}; "
            f"{PADDING_MODES[other]}: {fraction(modes[other])}), {mode['steps_per_epoch']:,} steps an epoch "
            "(--dry-run shows both)"
        )
        return
    from rich.table import Table

    mb = estimate["micro_batch_size"]
    pairs = estimate.get("pairs_per_micro_batch")
    size = f"{mb}" if pairs is None else f"{pairs} pair{'s' if pairs != 1 else ''} ({mb} sequences)"
    counted = "samples" if pairs is None else "sequences"
    table = Table(
        title=f"padding per micro-batch of {size} ({estimate['samples']:,} {counted}; {estimate['source']})",
        title_justify="left",
    )
    table.add_column("mode", no_wrap=True)
    table.add_column("real tokens", justify="right")
    table.add_column("micro-batch (mean)", justify="right")
    table.add_column("micro-batches / epoch", justify="right")
    table.add_column("steps / epoch", justify="right")
    for key, label in PADDING_MODES.items():
        mode = modes[key]
        if key == used_key:
            label = f"[bold]{label if used == 'none' else used}[/] *"
        table.add_row(
            label,
            fraction(mode),
            f"{mode.get('rows_per_micro_batch', mb)} x "
            f"{mode['padded_tokens_per_micro_batch'] / mode.get('rows_per_micro_batch', mb):,.0f}",
            f"{mode['micro_batches_per_epoch']:,}",
            f"{mode['steps_per_epoch']:,}",
        )
    console.print(table)
    dim = (
        f"* this recipe; expected over random orders, rows padded to the longest of their micro-batch; "
        f"packing and neat_packing pad the same; cache entry {escape(str(padding['cache_entry']))}"
    )
    if padding["note"]:
        dim += f"; {padding['note']}"
    console.print(f"[dim]{dim}[/]", soft_wrap=True)
