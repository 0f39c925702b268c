"""Why a probe skipped, in one word (``skip_kind``), and what ``--require-device`` makes of it."""

from __future__ import annotations

import pytest
import torch

from magistral_cli.probes import cp_workers
from magistral_cli.probes.common import (
    MISSING_SOFTWARE,
    NO_DEVICE,
    SKIP_KINDS,
    TOO_FEW_DEVICES,
    ProbeResult,
    fails_require_device,
    skip,
)
from magistral_cli.probes.cp_equivalence import cp_equivalence_request, run_cp_equivalence_probe
from magistral_cli.probes.vision_attention import vision_cp_request


def test_a_skip_says_its_kind_in_json_and_other_results_do_not():
    result = skip("split-copy", "cuda", "default", "triton is not installed", MISSING_SOFTWARE).to_json()
    assert (result["result"], result["skip_kind"]) == ("SKIP", "missing_software")
    assert skip("split-copy", "cuda", "default", "no CUDA device is visible here").skip_kind == NO_DEVICE
    passed = ProbeResult("split-copy", "cpu", "default", "PASS", "ok", [{"name": "x", "result": "PASS"}])
    assert "skip_kind" not in passed.to_json()
    with pytest.raises(ValueError, match="skip kind 'busy'"):
        skip("split-copy", "cuda", "default", "busy", "busy")
    assert set(SKIP_KINDS) == {"no_device", "too_few_devices", "missing_software"}


@pytest.mark.parametrize(
    ("result", "kind", "fails"),
    [
        ("SKIP", NO_DEVICE, True),  # --device cuda on a machine without CUDA
        ("SKIP", MISSING_SOFTWARE, True),  # the device is here, the probe could run with triton
        ("SKIP", TOO_FEW_DEVICES, False),  # 2 processes on a one-GPU machine: nothing to fix there
        ("SKIP", None, True),  # a skip that does not say why is not excused
        ("PASS", None, False),
        ("FAIL", None, False),  # already a failure
    ],
)
def test_require_device_fails_every_skip_but_too_few_devices(result, kind, fails):
    payload = {"result": result, **({"skip_kind": kind} if kind else {})}
    assert fails_require_device(payload) is fails


def test_context_parallel_probes_on_too_few_devices_skip_and_say_so(monkeypatch):
    """The count of visible devices is the one thing simulated: the probes' own count says 1."""
    counted = []

    def one_visible(device):
        counted.append(device)
        return 1

    monkeypatch.setattr(cp_workers, "_visible", one_visible)
    requests = [
        cp_equivalence_request("ring"),
        cp_equivalence_request("hybrid"),
        vision_cp_request("ulysses"),
    ]
    results = [r.to_json() for r in cp_workers.run_cp_requests("cpu", requests)]
    assert [(r["probe"], r["mode"], r["result"], r["skip_kind"]) for r in results] == [
        ("cp-equivalence", "ring", "SKIP", "too_few_devices"),
        ("cp-equivalence", "hybrid", "SKIP", "too_few_devices"),
        ("vision-attention", "ulysses", "SKIP", "too_few_devices"),
    ]
    assert [r["reason"] for r in results] == [
        "2 processes need 2 cpu devices, 1 visible",
        "4 processes need 4 cpu devices, 1 visible",
        "2 processes need 2 cpu devices, 1 visible",
    ]
    assert counted == ["cpu"] * 3 and not any(fails_require_device(r) for r in results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_missing_device_kind_is_no_device_before_any_count(monkeypatch):
    monkeypatch.setattr(cp_workers, "_visible", lambda device: pytest.fail("counted a missing device"))
    result = run_cp_equivalence_probe("cuda", "ring").to_json()
    assert (result["result"], result["skip_kind"]) == ("SKIP", "no_device")
    assert "no CUDA device" in result["reason"] and fails_require_device(result)
