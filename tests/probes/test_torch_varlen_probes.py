"""The packed-attention and vision-attention probes on torch's varlen path (CUDA without flash-attn).

That path needs a GPU, so here the CUDA choice is forced on the CPU and torch's ``varlen_attn`` is
the strict stand-in of ``tests/ops/test_torch_varlen.py``: the probes must report the kernel, see it
run, pass with a right kernel and fail with one that lets segments / images see each other.
"""

from __future__ import annotations

import torch

from magistral_cli.ops import attention_kernels as kernels
from magistral_cli.ops import packed_attention as pa
from magistral_cli.ops import vision_attention as va
from magistral_cli.ops.attention_kernels import TORCH_VARLEN, read_varlen_signature
from magistral_cli.probes.packed_attention import run_packed_attention_probe
from magistral_cli.probes.vision_attention import run_vision_attention_probe
from tests.ops.test_torch_varlen import StandIn

NAME = "torch.nn.attention.varlen.varlen_attn"


def _torch_varlen(monkeypatch, *, mixes_segments: bool = False) -> StandIn:
    fake = StandIn("2.13", mixes_segments=mixes_segments)
    api = read_varlen_signature(fake.function)
    monkeypatch.setattr(kernels, "torch_varlen_api", lambda: api)

    def pick(device, dtype, head_dim, dropout=0.0, *, first="flash_attention_3"):
        return TORCH_VARLEN if dtype in (torch.float16, torch.bfloat16) and dropout == 0.0 else None

    monkeypatch.setattr(pa, "varlen_kernel", pick)
    monkeypatch.setattr(va, "varlen_kernel", pick)
    return fake


def test_packed_probe_reports_and_runs_torch_varlen_in_bf16(monkeypatch):
    fake = _torch_varlen(monkeypatch)
    result = run_packed_attention_probe("cpu").to_json()
    assert result["result"] == "PASS", result
    cases = {c["name"]: c for c in result["cases"]}
    for name in ("bf16 neat", "bf16 plain"):
        assert cases[name]["path"] == TORCH_VARLEN and cases[name]["backend"] == NAME
    for name in ("fp32 neat", "fp32 plain"):
        assert cases[name]["path"] == "sdpa"
    assert cases["isolation"]["path"] == {"fp32": "sdpa", "bf16": TORCH_VARLEN}
    assert f"bf16: {NAME}" in result["reason"]
    assert len(fake.calls) == 2 + 2  # the two bf16 cases, the bf16 isolation's two runs
    assert all(c["causal"] and c["kv_heads"] == 2 for c in fake.calls)  # causal, grouped-query heads


def test_packed_probe_fails_when_torch_varlen_mixes_segments(monkeypatch):
    _torch_varlen(monkeypatch, mixes_segments=True)
    result = run_packed_attention_probe("cpu").to_json()
    assert result["result"] == "FAIL"
    failed = {c["name"] for c in result["cases"] if c["result"] == "FAIL"}
    assert failed == {"bf16 neat", "bf16 plain", "isolation"}, result["cases"]


def test_packed_probe_fails_when_the_reported_kernel_did_not_run(monkeypatch):
    _torch_varlen(monkeypatch)
    # the report says torch_varlen, but the forward takes the dense-mask SDPA
    monkeypatch.setattr(pa, "VARLEN_KERNELS", ())
    result = run_packed_attention_probe("cpu").to_json()
    assert result["result"] == "FAIL"
    bf16 = [c for c in result["cases"] if c["name"].startswith("bf16")]
    assert all("the varlen kernels that ran, []" in c["error"] for c in bf16), bf16


def test_vision_probe_reports_and_runs_torch_varlen(monkeypatch):
    fake = _torch_varlen(monkeypatch)
    result = run_vision_attention_probe("cpu").to_json()
    assert result["result"] == "PASS", result
    assert f"passed: {NAME} matches per-image eager attention" in result["reason"]
    assert all(c["backend"] == NAME for c in result["cases"])
    numerics = [c for c in result["cases"] if c["name"].startswith("numerics")]
    assert [c["varlen_calls"] for c in numerics] == [2, 2, 2]  # once per layer of the tiny tower
    assert fake.calls and not any(c["causal"] for c in fake.calls)


def test_vision_probe_fails_when_torch_varlen_mixes_images(monkeypatch):
    _torch_varlen(monkeypatch, mixes_segments=True)
    result = run_vision_attention_probe("cpu").to_json()
    assert result["result"] == "FAIL"
    failed = [c["name"] for c in result["cases"] if c["result"] == "FAIL"]
    assert any(n.startswith("isolation") for n in failed) and any("[16, 24]" in n for n in failed), failed
