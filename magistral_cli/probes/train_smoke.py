"""Probe ``train-smoke``: the trainer trains the tiny Mistral3 under FSDP2 for N steps on every rank.

Starts ``--nproc`` rank processes with torchrun (gloo on the CPU, nccl on CUDA, hccl on NPU),
each running :mod:`magistral_cli.probes.train_smoke_worker`: the engine's ``Trainer`` from a
recipe (tiny model in the official layout, the default FSDP2 plan, bf16 compute with fp32
gradient reduction, synthetic batches with one or two images per sample). Then reads every
rank's JSON lines. PASS only if the processes exited 0 and every rank logged steps 1..N in
order, each with a finite loss, finite gradients and the update applied, and then its
completion record.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import FAIL, PASS, TOO_FEW_DEVICES, ProbeResult, device_missing_reason, skip

PROBE = "train-smoke"
MODES = ("default", "multi")
DEFAULT_STEPS = 30
#: Generous: on two busy CPU cores start-up alone takes a while.
TIMEOUT_S = 900


def default_nproc(device: str) -> int:
    """2 ranks on the CPU (real sharding); on a device as many as are visible, at most 2."""
    if device == "cpu":
        return 2
    return max(1, min(2, _visible(device)))


def read_records(out_dir: Path, nproc: int) -> dict[int, list[dict[str, Any]]]:
    """Every rank's JSON lines (a missing file is an empty list; a bad line is kept as an error record)."""
    records: dict[int, list[dict[str, Any]]] = {}
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        parsed = []
        for line in lines:
            try:
                parsed.append(json.loads(line))
            except json.JSONDecodeError:
                parsed.append({"unparsable": line})
        records[rank] = parsed
    return records


def check_records(records: dict[int, list[dict[str, Any]]], nproc: int, steps: int) -> list[dict[str, Any]]:
    """One case per rank: steps 1..``steps`` in order, finite loss and gradients, no update
    skipped, no error, then done."""
    cases = []
    for rank in range(nproc):
        lines = records.get(rank, [])
        case: dict[str, Any] = {"name": f"rank {rank}", "rank": rank}
        step_lines = [r for r in lines if "step" in r]
        logged = [r.get("step") for r in step_lines]
        problems = []
        if any("unparsable" in r for r in lines):
            problems.append("unparsable log lines")
        if any(r.get("rank") != rank for r in lines if "unparsable" not in r):
            problems.append("lines from another rank")
        if logged != list(range(1, steps + 1)):
            shown = logged if len(logged) <= 8 else [*logged[:4], "...", *logged[-3:]]
            problems.append(f"logged steps {shown}, expected 1..{steps} in order")
        bad_loss = [r["step"] for r in step_lines if not _finite(r.get("loss"))]
        if bad_loss:
            problems.append(f"non-finite loss at steps {bad_loss[:5]}")
        bad_grad = [r["step"] for r in step_lines if r.get("grads_finite") is not True]
        if bad_grad:
            problems.append(f"non-finite gradients at steps {bad_grad[:5]}")
        skipped = [r["step"] for r in step_lines if r.get("skipped")]
        if skipped:
            problems.append(f"the trainer skipped the update at steps {skipped[:5]}")
        errors = [str(r["error"]) for r in lines if "error" in r]
        if errors:
            problems.append(f"error: {errors[0][:300]}")
        done = [r for r in lines if r.get("done")]
        if len(done) != 1 or done[0].get("steps") != steps:
            problems.append("no completion record")
        if step_lines:
            case["first_loss"] = step_lines[0].get("loss")
            case["last_loss"] = step_lines[-1].get("loss")
        case["steps_logged"] = len(step_lines)
        case["result"] = FAIL if problems else PASS
        if problems:
            case["error"] = "; ".join(problems)
        cases.append(case)
    return cases


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def run_train_smoke_probe(
    device: str = "cpu",
    mode: str = "default",
    *,
    nproc: int | None = None,
    steps: int = DEFAULT_STEPS,
    poison_step: int = 0,
    timeout_s: float = TIMEOUT_S,
) -> ProbeResult:
    """Run the probe. ``poison_step`` (tests) makes that step's loss NaN on every rank."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    missing = device_missing_reason(device)
    if missing:
        return skip(PROBE, device, mode, missing)
    nproc = nproc or default_nproc(device)
    if device != "cpu":
        visible = _visible(device)
        if nproc > visible:
            reason = f"--nproc {nproc} needs {nproc} {device} devices, {visible} visible"
            return skip(PROBE, device, mode, reason, TOO_FEW_DEVICES)

    with tempfile.TemporaryDirectory(prefix="magistral-train-smoke-") as tmp:
        out = Path(tmp)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            # torchrun's per-rank log directories; without it, one torchelastic_* per run stays in /tmp
            f"--log-dir={out / 'torchrun'}",
            "-m",
            "magistral_cli.probes.train_smoke_worker",
            f"--device={device}",
            f"--mode={mode}",
            f"--steps={steps}",
            f"--out={out}",
            f"--poison-step={poison_step}",
        ]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        env["PYTHONUNBUFFERED"] = "1"
        # The ranks must import this very package (a checkout may shadow an installed one).
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        start = time.monotonic()
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
            returncode, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:
            returncode, tail = None, f"timed out after {timeout_s:.0f} s: {str(exc.stderr or '')[-1000:]}"
        wall_s = time.monotonic() - start
        cases = check_records(read_records(out, nproc), nproc, steps)

    processes: dict[str, Any] = {"name": "processes", "returncode": returncode, "wall_s": round(wall_s, 1)}
    if returncode == 0:
        processes["result"] = PASS
    else:
        processes["result"] = FAIL
        processes["error"] = f"torchrun exited {returncode}"
        processes["output_tail"] = tail
    cases.insert(0, processes)
    failed = [c for c in cases if c["result"] == FAIL]
    if failed:
        reason = (
            f"{len(failed)} of {len(cases)} cases failed; first: {failed[0]['name']}: {failed[0]['error']}"
        )
        return ProbeResult(PROBE, device, mode, FAIL, reason, cases)
    images = "one image" if mode == "default" else "two images"
    reason = (
        f"{nproc} ranks trained {steps} steps under FSDP2 ({images}), finite loss and gradients on every step"
    )
    return ProbeResult(PROBE, device, mode, PASS, reason, cases)


def _visible(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else torch.npu.device_count()
