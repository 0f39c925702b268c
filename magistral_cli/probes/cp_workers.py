"""Context-parallel probe runs: one process group per world size, shared by several probes.

A :class:`CpRequest` names a probe (``cp-equivalence`` or ``vision-attention``), a CP mode and
a process count. :func:`run_cp_requests` spawns one group of rank processes per process count
(``runtime.spawn_ranks``: gloo on the CPU, NCCL on CUDA, HCCL on NPU, one device per rank),
runs every request of that size in it, and turns each request's per-rank results into a
:class:`ProbeResult`: spawning and importing torch dominate on a small machine, so ``probe all``
and the tests pay them once per world size, not once per check.

Each request carries its probe's two functions: ``rank_job(request)`` (the job every rank runs:
a plain dict, pickled across the process boundary, whose ``"run"`` is the probe module's
rank function and whose other items are its arguments) and ``evaluate(request, device,
per_rank)`` (run in the parent, returns the ProbeResult). This module knows no probe module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from magistral_cli.runtime import spawn_ranks
from magistral_cli.runtime.distributed import run_jobs

from .common import FAIL, TOO_FEW_DEVICES, ProbeResult, device_missing_reason, skip

#: The whole process group (start-up included) must be done within this. A rank that waits on
#: a collective longer than ``runtime.distributed.COLLECTIVE_TIMEOUT_S`` fails instead of hanging.
SPAWN_TIMEOUT_S = 900


@dataclass(frozen=True)
class CpRequest:
    probe: str  # "cp-equivalence" or "vision-attention"
    mode: str  # "ulysses", "ring" or "hybrid"
    nproc: int
    options: dict[str, Any] = field(default_factory=dict)
    #: The probe's job for every rank and its verdict over every rank's result (see the module).
    rank_job: Callable[[CpRequest], dict[str, Any]] = field(kw_only=True, compare=False, repr=False)
    evaluate: Callable[[CpRequest, str, list[dict[str, Any]]], ProbeResult] = field(
        kw_only=True, compare=False, repr=False
    )


def default_cp_nproc(mode: str) -> int:
    """2 processes for ulysses and ring, 4 (2 x 2) for hybrid."""
    return 4 if mode == "hybrid" else 2


def check_cp_nproc(mode: str, nproc: int) -> str | None:
    """None when ``mode`` can run on ``nproc`` processes, otherwise why not (and the fix)."""
    if nproc < 2:
        return f"--nproc {nproc}: context parallelism needs at least 2 processes"
    if mode == "hybrid" and (nproc < 4 or nproc % 2):
        return f"--nproc {nproc}: hybrid needs an even number of processes, at least 4 (2 Ulysses x ring)"
    return None


def run_cp_requests(device: str, requests: list[CpRequest]) -> list[ProbeResult]:
    """Run ``requests`` on ``device`` (one spawn per distinct ``nproc``); results in request order.

    A device that is missing, or has fewer devices than a request's ``nproc``, makes those
    requests SKIP with the reason. A process group that fails as a whole makes its requests FAIL.
    """
    results: dict[int, ProbeResult] = {}
    missing = device_missing_reason(device)
    runnable: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        bad = check_cp_nproc(request.mode, request.nproc)
        if bad:
            raise ValueError(bad)
        if missing:
            results[i] = skip(request.probe, device, request.mode, missing)
            continue
        visible = _visible(device)
        if visible is not None and visible < request.nproc:
            results[i] = skip(
                request.probe,
                device,
                request.mode,
                f"{request.nproc} processes need {request.nproc} {device} devices, {visible} visible",
                TOO_FEW_DEVICES,
            )
            continue
        runnable.setdefault(request.nproc, []).append(i)

    for nproc, indices in runnable.items():
        jobs = [requests[i].rank_job(requests[i]) for i in indices]
        start = time.monotonic()
        try:
            per_rank = spawn_rank_jobs(device, nproc, jobs)
        except Exception as exc:  # the group died (start-up, a killed rank, a timeout): every request fails
            reason = f"the {nproc} rank processes failed: {type(exc).__name__}: {exc}"
            for i in indices:
                results[i] = ProbeResult(requests[i].probe, device, requests[i].mode, FAIL, reason, [])
            continue
        wall_s = round(time.monotonic() - start, 1)
        for j, i in enumerate(indices):
            request = requests[i]
            ranks = [rank_results[j] for rank_results in per_rank]
            result = request.evaluate(request, device, ranks)
            for case in result.cases:
                case.setdefault("processes", nproc)
                case.setdefault("group_wall_s", wall_s)
            results[i] = result
    return [results[i] for i in range(len(requests))]


# --------------------------------------------------------------------------- the rank processes


def _visible(device: str) -> int | None:
    """How many ``device`` devices this machine has (None on the CPU: processes need no device)."""
    from magistral_cli.runtime.device import device_count

    return device_count(device)


def _run_job(job: dict) -> dict:
    job = dict(job)
    run = job.pop("run")
    return run(**job)


def _rank_jobs(_rank: int, jobs: list[dict]) -> list[dict]:
    return run_jobs(_run_job, jobs)


def spawn_rank_jobs(device: str, world_size: int, jobs: list[dict], timeout_s: float = SPAWN_TIMEOUT_S):
    """Run ``jobs`` on ``world_size`` fresh processes in one process group; every rank's results.

    A job that raises gives ``{"error", "where"}`` in its place; a rank that dies raises
    ``RankFailure``, a group still running after ``timeout_s`` ``RankTimeout`` (a
    ``TimeoutError``); the remaining processes are terminated (``runtime.spawn_ranks``).
    """
    return spawn_ranks(_rank_jobs, world_size, (jobs,), device=device, timeout_s=timeout_s)


# --------------------------------------------------------------------------- combining the ranks


def merge_rank_cases(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One case per name from every rank's cases (same names, same order on every rank).

    PASS only if it passed on every rank; numbers are the worst (largest) over the ranks,
    other values the first rank's; the error names the first failing rank.
    """
    merged = []
    names = [c["name"] for c in per_rank[0]]
    for rank, cases in enumerate(per_rank):
        if [c["name"] for c in cases] != names:
            raise ValueError(f"rank {rank} ran cases {[c['name'] for c in cases]}, rank 0 ran {names}")
    for index, name in enumerate(names):
        ranks = [cases[index] for cases in per_rank]
        case: dict[str, Any] = {"name": name}
        for key, value in ranks[0].items():
            if key in ("name", "result", "error", "where"):
                continue
            values = [r.get(key) for r in ranks]
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            case[key] = max(values) if numeric else value
        failing = [(rank, r) for rank, r in enumerate(ranks) if r.get("result") != "PASS"]
        case["ranks"] = len(ranks)
        if failing:
            rank, first = failing[0]
            case["result"] = FAIL
            case["error"] = f"rank {rank}: {first.get('error', 'failed')}"
            case["failed_ranks"] = [r for r, _ in failing]
        else:
            case["result"] = "PASS"
        merged.append(case)
    return merged
