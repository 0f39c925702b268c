"""`magistral probe`: real probes end to end, exit codes, --require-device, argument errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.probes.common import ProbeResult

runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, ["probe", *args])


def test_split_copy_json_passes_on_the_cpu():
    result = _invoke("split-copy", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert set(payload) == {"probe", "device", "mode", "result", "reason", "cases"}
    assert (payload["probe"], payload["device"], payload["result"]) == ("split-copy", "cpu", "PASS")


@pytest.mark.slow
def test_all_json_passes_every_probe_on_the_cpu():
    result = _invoke("all", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [(p["probe"], p["result"]) for p in payload] == [
        ("vision-attention", "PASS"),
        ("packed-attention", "PASS"),
        ("split-copy", "PASS"),
        ("train-smoke", "PASS"),
        ("cp-equivalence", "PASS"),
        ("cp-equivalence", "PASS"),
        ("cp-equivalence", "PASS"),
    ]
    equivalence = payload[4:]
    assert [p["mode"] for p in equivalence] == ["ulysses", "ring", "hybrid"]
    for p in equivalence:
        assert {c["name"].split()[0] for c in p["cases"]} == {"fp32", "bf16"}
        assert [c["processes"] for c in p["cases"]] == [4 if p["mode"] == "hybrid" else 2] * 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_context_parallel_modes_skip_without_the_device_and_require_device_fails_them():
    for args in (["vision-attention", "--mode", "ring"], ["cp-equivalence", "--mode", "hybrid"]):
        result = _invoke(*args, "--device", "cuda", "--json")
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        assert payload["result"] == "SKIP" and "no CUDA device" in payload["reason"]
        result = _invoke(*args, "--device", "cuda", "--json", "--require-device")
        assert result.exit_code == 1
        assert json.loads(result.stdout)["result"] == "FAIL"


def test_cp_equivalence_options_reach_the_probe(monkeypatch):
    import magistral_cli.probes as probes

    calls = []

    def record(name, device, mode, **options):
        calls.append((name, device, mode, options))
        return ProbeResult(name, device, mode, "PASS", "recorded", [{"name": "x", "result": "PASS"}])

    monkeypatch.setattr(probes, "run_probe", record)
    args = ("cp-equivalence", "--device", "cpu", "--json")
    assert _invoke(*args).exit_code == 0
    assert (
        _invoke(*args, "--mode", "hybrid", "--nproc", "8", "--dtype", "bf16", "--chunk-loss").exit_code == 0
    )
    assert _invoke("vision-attention", "--mode", "ring", "--nproc", "3", "--device", "cpu").exit_code == 0
    assert [(c[2], c[3].get("nproc"), c[3].get("dtypes"), c[3].get("chunk_loss")) for c in calls] == [
        ("ulysses", None, None, False),
        ("hybrid", 8, ("bf16",), True),
        ("ring", 3, None, None),
    ]


def test_a_failing_cp_equivalence_exits_1_with_the_failed_case(monkeypatch):
    import magistral_cli.probes as probes

    def failing(name, device, mode, **options):
        case = {
            "name": "bf16 gradient relative L2",
            "result": "FAIL",
            "error": "gradient relative L2 0.2 >= 0.05",
        }
        return ProbeResult(name, device, mode, "FAIL", "1 of 8 cases failed", [case])

    monkeypatch.setattr(probes, "run_probe", failing)
    result = _invoke("cp-equivalence", "--mode", "ring", "--device", "cpu")
    assert result.exit_code == 1
    assert "probe failed: cp-equivalence (ring)" in result.output
    assert "gradient relative L2 0.2 >= 0.05" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_missing_device_skips_and_require_device_fails():
    result = _invoke("split-copy", "--device", "cuda", "--json")
    assert result.exit_code == 0
    payload = json.loads(result.stdout)
    assert (payload["result"], payload["skip_kind"]) == ("SKIP", "no_device")
    assert _invoke("split-copy", "--device", "cuda", "--require-device").exit_code == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_all_with_require_device_fails_every_probe_where_the_device_kind_is_missing():
    result = _invoke("all", "--device", "cuda", "--require-device", "--json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert len(payload) == 7
    for p in payload:
        assert (p["result"], p["skip_kind"]) == ("FAIL", "no_device"), p
        assert p["reason"].startswith("skipped (no_device), which --require-device does not allow: ")


def _one_device_visible(monkeypatch):
    """This machine as one with a single device: the CP probes' own count of visible devices says
    1 (on the CPU, whose processes need none, it says None), the rest of the probe code is real."""
    from magistral_cli.probes import cp_workers

    monkeypatch.setattr(cp_workers, "_visible", lambda device: 1)


def test_require_device_lets_a_probe_skip_for_too_few_devices(monkeypatch):
    _one_device_visible(monkeypatch)
    result = _invoke("cp-equivalence", "--mode", "hybrid", "--device", "cpu", "--require-device", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert (payload["result"], payload["skip_kind"]) == ("SKIP", "too_few_devices")
    assert payload["reason"] == "4 processes need 4 cpu devices, 1 visible"


def test_all_with_require_device_passes_on_a_one_device_machine(monkeypatch):
    """`probe all --device cuda --require-device` on one GPU: the CP probes SKIP, exit 0.

    The four single-process probes are stubbed to PASS (they run for real elsewhere); the three
    cp-equivalence modes go through the real request path with one device visible.
    """
    import magistral_cli.probes as probes

    def passing(name, device, mode, **options):
        return ProbeResult(name, device, mode, "PASS", "stub", [{"name": "x", "result": "PASS"}])

    monkeypatch.setattr(probes, "run_probe", passing)
    _one_device_visible(monkeypatch)
    result = _invoke("all", "--device", "cpu", "--require-device", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [(p["probe"], p["mode"], p["result"], p.get("skip_kind")) for p in payload] == [
        ("vision-attention", "default", "PASS", None),
        ("packed-attention", "default", "PASS", None),
        ("split-copy", "default", "PASS", None),
        ("train-smoke", "default", "PASS", None),
        ("cp-equivalence", "ulysses", "SKIP", "too_few_devices"),
        ("cp-equivalence", "ring", "SKIP", "too_few_devices"),
        ("cp-equivalence", "hybrid", "SKIP", "too_few_devices"),
    ]
    assert payload[4]["reason"] == "2 processes need 2 cpu devices, 1 visible"
    table = _invoke("all", "--device", "cpu", "--require-device")
    assert table.exit_code == 0 and "1 visible" in table.output


def test_a_failing_probe_exits_1_and_says_which(monkeypatch):
    import magistral_cli.probes as probes

    def failing(name, device, mode, **options):
        return ProbeResult(name, device, mode, "FAIL", "forward relative L2 0.5 > 0.015", [])

    monkeypatch.setattr(probes, "run_probe", failing)
    result = _invoke("vision-attention", "--device", "cpu")
    assert result.exit_code == 1
    assert "probe failed: vision-attention (default)" in result.output
    assert "Traceback" not in result.output


def test_a_crashing_probe_is_a_fail_not_a_traceback(monkeypatch):
    from magistral_cli.probes import vision_attention

    def crash(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(vision_attention, "run_vision_attention_probe", crash)
    result = _invoke("vision-attention", "--device", "cpu", "--json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["result"] == "FAIL" and "kernel exploded" in payload["reason"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["vision"], "unknown probe 'vision'"),
        (["train-smoke", "--mode", "ring"], "not a mode of train-smoke"),
        (["all", "--mode", "multi"], "runs each probe in its default mode"),
        (["split-copy", "--nproc", "2"], "--nproc applies to train-smoke, cp-equivalence"),
        (["vision-attention", "--nproc", "2"], "--nproc applies to train-smoke, cp-equivalence"),
        (["cp-equivalence", "--mode", "hybrid", "--nproc", "2"], "hybrid needs an even number"),
        (["cp-equivalence", "--nproc", "1"], "at least 2 processes"),
        (["vision-attention", "--mode", "ulysses", "--nproc", "1"], "at least 2 processes"),
        (["cp-equivalence", "--mode", "default"], "not a mode of cp-equivalence"),
        (["cp-equivalence", "--dtype", "fp16"], "--dtype 'fp16' is not one of fp32, bf16"),
        (["split-copy", "--chunk-loss"], "--dtype and --chunk-loss apply to cp-equivalence only"),
        (["train-smoke", "--dtype", "bf16"], "--dtype and --chunk-loss apply to cp-equivalence only"),
        (["split-copy", "--device", "tpu"], "--device 'tpu'"),
    ],
)
def test_bad_arguments_exit_2_with_the_fix(args, message):
    result = _invoke(*args)
    assert result.exit_code == 2
    assert message in result.output
