"""Device and numerics checks with JSON results (``magistral probe``).

Each probe returns a :class:`~magistral_cli.probes.common.ProbeResult`; :func:`run_probe`
runs one by name and turns a crash into a FAIL with its cause, :func:`run_all` runs every
probe in its default mode, and cp-equivalence in each of its modes (see :data:`ALL_CP_EQUIVALENCE`).
"""

from __future__ import annotations

from typing import Any

from .common import FAIL, PASS, SKIP, ProbeResult, resolve_probe_device

#: Probe name -> the modes it accepts (the first is its default).
PROBE_MODES: dict[str, tuple[str, ...]] = {
    "vision-attention": ("default", "ulysses", "ring", "hybrid"),
    "packed-attention": ("default",),
    "split-copy": ("default",),
    "train-smoke": ("default", "multi"),
    "cp-equivalence": ("ulysses", "ring", "hybrid"),
}
#: What ``probe all`` runs of cp-equivalence: every mode on its default process count (2, 2, 4),
#: in these dtypes. The two 2-process modes share one process group.
ALL_CP_EQUIVALENCE: tuple[str, ...] = ("fp32", "bf16")

__all__ = [
    "FAIL",
    "PASS",
    "ALL_CP_EQUIVALENCE",
    "PROBE_MODES",
    "SKIP",
    "ProbeResult",
    "resolve_probe_device",
    "run_all",
    "run_probe",
]


def run_probe(name: str, device: str, mode: str = "default", **options: Any) -> ProbeResult:
    """Run probe ``name`` on ``device`` (already resolved, not "auto").

    ``options``: ``nproc`` and ``steps`` for train-smoke; ``nproc``, ``dtypes`` and
    ``chunk_loss`` for cp-equivalence; ``nproc`` for vision-attention's context-parallel
    modes. An exception inside a probe is that probe's FAIL, with the exception as the reason.
    """
    if name not in PROBE_MODES:
        raise ValueError(f"unknown probe {name!r}")
    try:
        if name == "vision-attention":
            from .vision_attention import CONTEXT_PARALLEL_MODES, run_vision_attention_probe

            if mode in CONTEXT_PARALLEL_MODES:
                return run_vision_attention_probe(device, mode, nproc=options.get("nproc"))
            return run_vision_attention_probe(device, mode)
        if name == "cp-equivalence":
            from .cp_equivalence import run_cp_equivalence_probe

            return run_cp_equivalence_probe(
                device,
                mode,
                nproc=options.get("nproc"),
                dtypes=options.get("dtypes"),
                chunk_loss=bool(options.get("chunk_loss")),
            )
        if name == "packed-attention":
            from .packed_attention import run_packed_attention_probe

            return run_packed_attention_probe(device)
        if name == "split-copy":
            from .split_copy import run_split_copy_probe

            return run_split_copy_probe(device)
        from .train_smoke import DEFAULT_STEPS, run_train_smoke_probe

        return run_train_smoke_probe(
            device, mode, nproc=options.get("nproc"), steps=options.get("steps") or DEFAULT_STEPS
        )
    except Exception as exc:  # the report must say which probe broke and why, and go on with the others
        return ProbeResult(name, device, mode, FAIL, f"the probe crashed: {type(exc).__name__}: {exc}", [])


def run_all(device: str, **options: Any) -> list[ProbeResult]:
    """Every probe in its default mode on ``device``, then cp-equivalence in every mode;
    those the device cannot run say SKIP. ``options`` go to train-smoke."""
    results = [
        run_probe(name, device, modes[0], **options)
        for name, modes in PROBE_MODES.items()
        if name != "cp-equivalence"
    ]
    return results + _run_all_cp_equivalence(device)


def _run_all_cp_equivalence(device: str) -> list[ProbeResult]:
    from .cp_equivalence import cp_equivalence_request
    from .cp_workers import run_cp_requests

    modes = PROBE_MODES["cp-equivalence"]
    try:
        requests = [cp_equivalence_request(mode, dtypes=ALL_CP_EQUIVALENCE) for mode in modes]
        return run_cp_requests(device, requests)
    except Exception as exc:  # as in run_probe: a crash is a FAIL of each mode, with its cause
        reason = f"the probe crashed: {type(exc).__name__}: {exc}"
        return [ProbeResult("cp-equivalence", device, mode, FAIL, reason, []) for mode in modes]
