"""Probe ``cp-equivalence``: one context-parallel training step against the CP=1 reference.

On ``nproc`` processes (2 for ulysses and ring, 4 = 2 x 2 for hybrid), every rank runs one
full training step of a small Mistral3 (the tiny model, vocabulary 512) with two images of
different aspect, fixed weights, labels and position ids: first the CP=1 reference (the
unmodified transformers forward and loss), then the same step with the decoder split over
the CP group (:func:`magistral_cli.probes.cp_harness.run_cp_equivalence`).
Per dtype it checks, on every rank:

- loss relative error, gradient relative L2 over every trainable parameter and SGD-update
  relative L2: < 2% / 0.05 / 0.05 in bf16 (the seed's thresholds), all < 1e-4 in fp32;
- the combined CP loss is the same number on every rank;
- the vision tower and projector ran (once each) and made no CP communication, while the
  decoder did communicate (so the CP path really ran).

``chunk_loss`` uses the trainer's chunked loss head (``ops.chunked_loss``, as
``features.enable_chunk_loss`` installs it) in both runs.
"""

from __future__ import annotations

from typing import Any

from .common import Cases, ProbeResult
from .cp_workers import CpRequest, default_cp_nproc, run_cp_requests

PROBE = "cp-equivalence"
MODES = ("ulysses", "ring", "hybrid")
DTYPES = ("fp32", "bf16")
#: Upper bounds (strict) of loss relative error, gradient and SGD-update relative L2.
THRESHOLDS: dict[str, dict[str, float]] = {
    "fp32": {"loss_relative_error": 1e-4, "gradient_relative_l2": 1e-4, "update_relative_l2": 1e-4},
    "bf16": {"loss_relative_error": 0.02, "gradient_relative_l2": 0.05, "update_relative_l2": 0.05},
}
_MEASURES = (
    ("loss_relative_error", "loss relative error"),
    ("gradient_relative_l2", "gradient relative L2"),
    ("update_relative_l2", "SGD update relative L2"),
)


def cp_equivalence_request(
    mode: str = "ulysses",
    *,
    nproc: int | None = None,
    dtypes: tuple[str, ...] | list[str] | None = None,
    chunk_loss: bool = False,
    thresholds: dict[str, dict[str, float]] | None = None,
) -> CpRequest:
    """The request :func:`run_cp_requests` runs. ``thresholds`` replaces :data:`THRESHOLDS`
    per dtype (tests use zero thresholds to see a FAIL)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    dtypes = tuple(dtypes or DTYPES)
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"dtype {unknown[0]!r} is not one of {', '.join(DTYPES)}")
    options: dict[str, Any] = {"dtypes": dtypes, "chunk_loss": chunk_loss}
    if thresholds is not None:
        options["thresholds"] = thresholds
    return CpRequest(
        PROBE, mode, nproc or default_cp_nproc(mode), options, rank_job=rank_job, evaluate=evaluate
    )


def run_cp_equivalence_probe(
    device: str = "cpu",
    mode: str = "ulysses",
    *,
    nproc: int | None = None,
    dtypes: tuple[str, ...] | list[str] | None = None,
    chunk_loss: bool = False,
    thresholds: dict[str, dict[str, float]] | None = None,
) -> ProbeResult:
    """Run the probe (its own process group). ``dtypes``: fp32 and bf16 unless given."""
    request = cp_equivalence_request(
        mode, nproc=nproc, dtypes=dtypes, chunk_loss=chunk_loss, thresholds=thresholds
    )
    return run_cp_requests(device, [request])[0]


# --------------------------------------------------------------------------- on every rank


def rank_job(request: CpRequest) -> dict[str, Any]:
    return {
        "run": run_rank_job,
        "mode": request.mode,
        "dtypes": list(request.options["dtypes"]),
        "chunk_loss": request.options["chunk_loss"],
    }


def run_rank_job(mode: str, dtypes: list[str], chunk_loss: bool) -> dict[str, Any]:
    """One reference step and one CP step per dtype on this rank (inside the process group)."""
    import traceback

    from .cp_harness import run_cp_equivalence

    runs = []
    for dtype in dtypes:
        try:
            runs.append(run_cp_equivalence(mode, dtype=dtype, chunk_loss=chunk_loss))
        except Exception as error:  # this dtype's step failed; the other dtype still reports
            where = traceback.format_exc(limit=-3).strip().splitlines()[-3:]
            runs.append({"error": f"{type(error).__name__}: {error}", "where": where})
    return {"runs": runs}


# --------------------------------------------------------------------------- in the parent


def evaluate(request: CpRequest, device: str, per_rank: list[dict[str, Any]]) -> ProbeResult:
    """Apply the thresholds to every rank's measurements."""
    thresholds = request.options.get("thresholds") or THRESHOLDS
    dtypes = request.options["dtypes"]
    cases = Cases()
    rank_errors = [(rank, r["error"]) for rank, r in enumerate(per_rank) if "error" in r]
    if rank_errors:
        rank, error = rank_errors[0]
        cases.run("training steps", lambda: _raise(f"rank {rank}: {error}"))
        return cases.result(PROBE, device, request.mode, "")
    for index, dtype in enumerate(dtypes):
        runs = [r["runs"][index] for r in per_rank]
        failed = [(rank, run) for rank, run in enumerate(runs) if "error" in run]
        if failed:
            rank, run = failed[0]
            cases.run(
                f"{dtype} training step", lambda rank=rank, run=run: _raise(f"rank {rank}: {run['error']}")
            )
            continue
        limits = thresholds[dtype]
        for key, label in _MEASURES:
            cases.run(
                f"{dtype} {label}",
                lambda key=key, label=label, limit=limits[key], runs=runs: _check_measure(
                    runs, key, label, limit
                ),
                dtype=dtype,
                threshold=limits[key],
            )
        cases.run(
            f"{dtype} vision tower makes no CP communication",
            lambda runs=runs: _check_vision(runs),
            dtype=dtype,
        )
    result = cases.result(PROBE, device, request.mode, "")
    if result.result == "PASS":
        first = per_rank[0]["runs"]
        sizes = f"ulysses {first[0]['ulysses_size']} x ring {first[0]['ring_size']}"
        measured = "; ".join(
            f"{dtype}: loss {run['loss_relative_error']:.2g}, gradients {run['gradient_relative_l2']:.2g}, "
            f"update {run['update_relative_l2']:.2g}"
            for dtype, run in zip(dtypes, first, strict=True)
        )
        loss = " with chunked loss" if request.options["chunk_loss"] else ""
        result.reason = (
            f"{len(result.cases)} cases passed: a {request.mode} training step on {request.nproc} "
            f"processes ({sizes}){loss} matches CP=1 ({measured}); the vision tower made no CP communication"
        )
    return result


def _raise(message: str) -> None:
    raise AssertionError(message)


def _check_measure(runs: list[dict[str, Any]], key: str, label: str, limit: float) -> dict[str, Any]:
    import math

    values = [run[key] for run in runs]
    worst = max(values, key=lambda v: math.inf if not math.isfinite(v) else v)
    assert math.isfinite(worst) and worst < limit, f"{label} {worst:.4g} >= {limit:g}"
    details: dict[str, Any] = {"value": worst}
    if key == "loss_relative_error":
        losses = {run["loss"] for run in runs}
        assert len(losses) == 1, f"the ranks report different combined losses {sorted(losses)}"
        details.update(reference_loss=runs[0]["reference_loss"], loss=runs[0]["loss"])
    return details


def _check_vision(runs: list[dict[str, Any]]) -> dict[str, Any]:
    for rank, run in enumerate(runs):
        assert run["vision_runs"] == 2, (
            f"rank {rank}: the vision tower and projector ran {run['vision_runs']} times, expected once each"
        )
        assert run["vision_cp_communications"] == 0, (
            f"rank {rank}: the vision tower made {run['vision_cp_communications']} CP communications"
        )
        assert run["cp_communications"] > 0, f"rank {rank}: the decoder made no CP communication"
    return {
        "vision_cp_communications": max(run["vision_cp_communications"] for run in runs),
        "decoder_cp_communications": min(run["cp_communications"] for run in runs),
        "vision_gradient_relative_l2": max(run["vision_gradient_relative_l2"] or 0.0 for run in runs),
    }
