"""`magistral probe NAME`: device and numerics checks for CI.

vision-attention, packed-attention, split-copy, train-smoke, cp-equivalence, or all. Each prints PASS / FAIL /
SKIP with the reason (``--json``: one object, or a list for ``all``; a SKIP also has its
``skip_kind``). Exit 1 on any FAIL, 0 otherwise. ``--require-device``, for CI machines that do
have the device, makes a SKIP a FAIL, except one for fewer devices than a probe's processes need
(``too_few_devices``): a one-GPU machine passes ``probe all --device cuda --require-device``
with the 2-process probes skipped, while a machine without CUDA fails it (``no_device``).
"""

from __future__ import annotations

from typing import Annotated, Any, List, Optional

import typer

from magistral_cli.errors import CheckFailed, UserError

from .output import console, emit_json, json_option

NAMES = ("vision-attention", "packed-attention", "split-copy", "train-smoke", "cp-equivalence", "all")
DTYPES = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda", "npu")
_STYLE = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}


def register(app: typer.Typer) -> None:
    @app.command(
        name="probe",
        help=(
            "Device and numerics checks: vision-attention (--mode default|ulysses|ring|hybrid), "
            "packed-attention (the neat / plain packing attention against per-sample attention), "
            "split-copy (the Triton FSDP2 copy-out; interpreted on the CPU), "
            "train-smoke (--nproc, --mode default|multi, --steps), "
            "cp-equivalence (--mode ulysses|ring|hybrid, --nproc, --dtype, --chunk-loss), "
            "or all (every probe in its default mode, and cp-equivalence in all three modes)."
        ),
    )
    def probe(
        name: Annotated[str, typer.Argument(help=f"One of: {', '.join(NAMES)}.", show_default=False)],
        device: Annotated[
            str, typer.Option("--device", help="auto (npu, then cuda, then cpu), cpu, cuda or npu.")
        ] = "auto",
        mode: Annotated[
            Optional[str],
            typer.Option(
                "--mode",
                help=(
                    "vision-attention: default|ulysses|ring|hybrid; train-smoke: default|multi; "
                    "cp-equivalence: ulysses|ring|hybrid."
                ),
                show_default=False,
            ),
        ] = None,
        nproc: Annotated[
            Optional[int],
            typer.Option(
                "--nproc",
                min=1,
                help=(
                    "Processes: train-smoke ranks (default 2 on the CPU); cp-equivalence and the "
                    "context-parallel vision-attention modes (default 2, hybrid 4)."
                ),
                show_default=False,
            ),
        ] = None,
        dtype: Annotated[
            Optional[str],
            typer.Option("--dtype", help="cp-equivalence: fp32 or bf16 (default: both).", show_default=False),
        ] = None,
        chunk_loss: Annotated[
            bool, typer.Option("--chunk-loss", help="cp-equivalence: chunked cross-entropy loss.")
        ] = False,
        steps: Annotated[int, typer.Option("--steps", min=1, help="train-smoke steps.")] = 30,
        json_out: Annotated[bool, json_option("each probe's result")] = False,
        require_device: Annotated[
            bool,
            typer.Option(
                "--require-device",
                help=(
                    "Treat SKIP as a failure (CI with the device), except a SKIP for fewer devices "
                    "than a probe's processes need."
                ),
            ),
        ] = False,
    ) -> None:
        results = run(
            name,
            device=device,
            mode=mode,
            nproc=nproc,
            steps=steps,
            dtype=dtype,
            chunk_loss=chunk_loss,
            require_device=require_device,
        )
        payload: Any = results if name == "all" else results[0]
        if json_out:
            emit_json(payload)
        else:
            render(results)
        failed = [r for r in results if r["result"] == "FAIL"]
        if failed:
            names = ", ".join(f"{r['probe']} ({r['mode']})" for r in failed)
            raise CheckFailed(f"probe failed: {names}")


def run(
    name: str,
    *,
    device: str = "auto",
    mode: str | None = None,
    nproc: int | None = None,
    steps: int = 30,
    dtype: str | None = None,
    chunk_loss: bool = False,
    require_device: bool = False,
) -> List[dict]:
    """Validate the arguments, run the probe(s) and return their JSON objects."""
    if name not in NAMES:
        raise UserError(f"unknown probe {name!r}: choose one of {', '.join(NAMES)}")
    if device not in DEVICES:
        raise UserError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    from magistral_cli.probes import PROBE_MODES, resolve_probe_device, run_all, run_probe

    if name == "all":
        if mode is not None:
            raise UserError(
                "--mode applies to one probe; `magistral probe all` runs each probe in its default mode"
            )
    else:
        modes = PROBE_MODES[name]
        if mode is not None and mode not in modes:
            raise UserError(f"--mode {mode!r} is not a mode of {name}: choose one of {', '.join(modes)}")
    mode = mode or (None if name == "all" else PROBE_MODES[name][0])
    context_parallel = name == "cp-equivalence" or (name == "vision-attention" and mode != "default")
    if nproc is not None and not (name in ("train-smoke", "all") or context_parallel):
        raise UserError(
            "--nproc applies to train-smoke, cp-equivalence and the context-parallel vision-attention modes"
        )
    if context_parallel and nproc is not None:
        from magistral_cli.probes.cp_workers import check_cp_nproc

        problem = check_cp_nproc(mode, nproc)
        if problem:
            raise UserError(problem)
    if name != "cp-equivalence" and (dtype is not None or chunk_loss):
        raise UserError("--dtype and --chunk-loss apply to cp-equivalence only")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    resolved = resolve_probe_device(device)
    if name == "all":
        results = run_all(resolved, nproc=nproc, steps=steps)
    else:
        options = {"nproc": nproc, "steps": steps}
        if name == "cp-equivalence":
            options.update(dtypes=(dtype,) if dtype else None, chunk_loss=chunk_loss)
        results = [run_probe(name, resolved, mode, **options)]
    out = [r.to_json() for r in results]
    if require_device:
        apply_require_device(out)
    return out


def apply_require_device(results: List[dict]) -> List[dict]:
    """``--require-device``: the SKIPs it does not allow become FAILs (in place), keeping their
    ``skip_kind``; a SKIP for too few devices stays a SKIP (``probes.common.fails_require_device``)."""
    from magistral_cli.probes.common import fails_require_device

    for r in results:
        if fails_require_device(r):
            r["result"] = "FAIL"
            kind = f" ({r['skip_kind']})" if r.get("skip_kind") else ""
            r["reason"] = f"skipped{kind}, which --require-device does not allow: {r['reason']}"
    return results


def render(results: List[dict]) -> None:
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    for column in ("probe", "device", "mode", "result", "reason"):
        table.add_column(column, overflow="fold")
    for r in results:
        style = _STYLE.get(r["result"], "")
        table.add_row(r["probe"], r["device"], r["mode"], f"[{style}]{r['result']}[/]", r["reason"])
    console.print(table)
    for r in results:
        for case in r["cases"]:
            if case.get("result") == "FAIL":
                console.print(
                    f"[red]{r['probe']}: {case['name']}: {case.get('error', '')}[/]", soft_wrap=True
                )
