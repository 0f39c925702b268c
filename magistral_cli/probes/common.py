"""What every probe shares: the result object, case bookkeeping and device availability.

A probe result is ``{"probe", "device", "mode", "result", "reason", "cases"}`` with result
PASS, FAIL or SKIP. PASS needs at least one case and every case passed; a probe that did not
run its checks says SKIP with the reason, never PASS, and with why in one word: ``skip_kind``
(in the JSON of a skipped result only), one of :data:`SKIP_KINDS`.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
DEVICES = ("cpu", "cuda", "npu")

#: Why a probe skipped. The device kind is not here (no CUDA, no torch_npu, an unknown device):
NO_DEVICE = "no_device"
#: The device kind is here, but fewer devices than the probe's processes need (one per rank):
TOO_FEW_DEVICES = "too_few_devices"
#: A package the probe needs is not installed (triton for split-copy):
MISSING_SOFTWARE = "missing_software"
SKIP_KINDS = (NO_DEVICE, TOO_FEW_DEVICES, MISSING_SOFTWARE)


@dataclass
class ProbeResult:
    probe: str
    device: str
    mode: str
    result: str
    reason: str
    cases: list[dict[str, Any]] = field(default_factory=list)
    skip_kind: str | None = None  # one of SKIP_KINDS when result is SKIP (see skip())

    def to_json(self) -> dict[str, Any]:
        payload = {
            "probe": self.probe,
            "device": self.device,
            "mode": self.mode,
            "result": self.result,
            "reason": self.reason,
            "cases": _json_safe(self.cases),
        }
        if self.skip_kind is not None:
            payload["skip_kind"] = self.skip_kind
        return payload


def _json_safe(value: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"): strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def skip(probe: str, device: str, mode: str, reason: str, kind: str = NO_DEVICE) -> ProbeResult:
    """A SKIP with its reason and kind; the default kind goes with :func:`device_missing_reason`."""
    if kind not in SKIP_KINDS:
        raise ValueError(f"skip kind {kind!r} is not one of {', '.join(SKIP_KINDS)}")
    return ProbeResult(probe, device, mode, SKIP, reason, [], skip_kind=kind)


def fails_require_device(result: dict[str, Any]) -> bool:
    """Whether ``--require-device`` turns this result (JSON) into a FAIL: every SKIP does, but
    one for fewer devices than the probe's processes need, which the machine cannot change
    (``probe all --device cuda`` on one GPU runs the rest and skips the 2-process probes)."""
    return result["result"] == SKIP and result.get("skip_kind") != TOO_FEW_DEVICES


class Cases:
    """Runs named checks; a check fails by raising (AssertionError or anything else)."""

    def __init__(self) -> None:
        self.cases: list[dict[str, Any]] = []

    def run(self, name: str, check: Callable[[], dict[str, Any] | None], **info: Any) -> bool:
        case: dict[str, Any] = {"name": name, **info}
        try:
            details = check() or {}
            case.update(details)
            case["result"] = PASS
        except AssertionError as exc:
            case["result"] = FAIL
            case["error"] = str(exc) or "assertion failed"
        except Exception as exc:  # a crash in a check is that check's failure, reported with its cause
            case["result"] = FAIL
            case["error"] = f"{type(exc).__name__}: {exc}"
            case["where"] = traceback.format_exc(limit=-3).strip().splitlines()[-3:]
        self.cases.append(case)
        return case["result"] == PASS

    def result(self, probe: str, device: str, mode: str, passed_reason: str) -> ProbeResult:
        failed = [c for c in self.cases if c["result"] == FAIL]
        if not self.cases:
            return ProbeResult(probe, device, mode, FAIL, "no case ran", [])
        if failed:
            first = failed[0]
            reason = f"{len(failed)} of {len(self.cases)} cases failed; first: {first['name']}: {first.get('error')}"
            return ProbeResult(probe, device, mode, FAIL, reason, self.cases)
        return ProbeResult(
            probe, device, mode, PASS, f"{len(self.cases)} cases passed: {passed_reason}", self.cases
        )


def device_missing_reason(device: str) -> str | None:
    """None when ``device`` can run here, otherwise why not."""
    if device == "cpu":
        return None
    if device == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
        return "no CUDA device is visible here"
    if device == "npu":
        import importlib.util

        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed, so no NPU is visible here"
        try:
            import torch
            import torch_npu  # noqa: F401

            if torch.npu.is_available() and torch.npu.device_count() > 0:
                return None
        except Exception as exc:  # a broken torch_npu is a missing device, with the cause
            return f"torch_npu failed to load: {exc}"
        return "no NPU is visible here"
    return f"unknown device {device!r}"


def resolve_probe_device(requested: str) -> str:
    """``auto`` picks npu, then cuda, then cpu; an explicit device is kept (a probe may then SKIP)."""
    if requested != "auto":
        return requested
    from magistral_cli.runtime import resolve_device

    return resolve_device("auto").type


def relative_l2(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float32 (0 when both are zero, inf when only
    ``expected`` is); both norms are read back together (one device synchronisation)."""
    import torch

    a, e = actual.detach().float(), expected.detach().float()
    num, denom = torch.stack(((a - e).norm(), e.norm())).tolist()
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom
