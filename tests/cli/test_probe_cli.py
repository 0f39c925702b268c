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
        ("split-copy", "PASS"),
        ("train-smoke", "PASS"),
    ]


def test_context_parallel_mode_skips_and_require_device_fails_it():
    result = _invoke("vision-attention", "--mode", "ring", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["result"] == "SKIP"
    result = _invoke("vision-attention", "--mode", "ring", "--device", "cpu", "--json", "--require-device")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["result"] == "FAIL" and "context parallel is not available yet" in payload["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_missing_device_skips_and_require_device_fails():
    result = _invoke("split-copy", "--device", "cuda", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["result"] == "SKIP"
    assert _invoke("split-copy", "--device", "cuda", "--require-device").exit_code == 1


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
        (["split-copy", "--nproc", "2"], "--nproc applies to train-smoke only"),
        (["split-copy", "--device", "tpu"], "--device 'tpu'"),
    ],
)
def test_bad_arguments_exit_2_with_the_fix(args, message):
    result = _invoke(*args)
    assert result.exit_code == 2
    assert message in result.output
