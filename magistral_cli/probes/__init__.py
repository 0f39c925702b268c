"""Device and numerics checks with JSON results (``magistral probe``).

Each probe returns a :class:`~magistral_cli.probes.common.ProbeResult`; :func:`run_probe`
runs one by name and turns a crash into a FAIL with its cause, :func:`run_all` runs every
probe in its default mode.
"""

from __future__ import annotations

from typing import Any

from .common import FAIL, PASS, SKIP, ProbeResult, resolve_probe_device

#: Probe name -> the modes it accepts (the first is its default).
PROBE_MODES: dict[str, tuple[str, ...]] = {
    "vision-attention": ("default", "ulysses", "ring", "hybrid"),
    "split-copy": ("default",),
    "train-smoke": ("default", "multi"),
}

__all__ = [
    "FAIL",
    "PASS",
    "PROBE_MODES",
    "SKIP",
    "ProbeResult",
    "resolve_probe_device",
    "run_all",
    "run_probe",
]


def run_probe(name: str, device: str, mode: str = "default", **options: Any) -> ProbeResult:
    """Run probe ``name`` on ``device`` (already resolved, not "auto").

    ``options``: ``nproc`` and ``steps`` for train-smoke. An exception inside a probe is that
    probe's FAIL, with the exception as the reason.
    """
    if name not in PROBE_MODES:
        raise ValueError(f"unknown probe {name!r}")
    try:
        if name == "vision-attention":
            from .vision_attention import run_vision_attention_probe

            return run_vision_attention_probe(device, mode)
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
    """Every probe in its default mode on ``device``; those the device cannot run say SKIP."""
    return [run_probe(name, device, modes[0], **options) for name, modes in PROBE_MODES.items()]
