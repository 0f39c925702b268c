"""The packed-attention probe passes with the packed attention and provably fails without it."""

from __future__ import annotations

import pytest
import torch

from magistral_cli.ops import packed_attention as pa
from magistral_cli.probes import run_probe
from magistral_cli.probes.packed_attention import run_packed_attention_probe


def test_passes_on_the_cpu_with_every_case():
    result = run_probe("packed-attention", "cpu").to_json()
    assert result["result"] == "PASS", result
    names = [c["name"] for c in result["cases"]]
    assert names == ["fp32 neat", "fp32 plain", "bf16 neat", "bf16 plain", "isolation"]
    assert all(c["path"] == "sdpa" for c in result["cases"][:4])
    assert max(result["cases"][0]["grad_rel_l2"].values()) < 1e-5


def _ignores_segments(module, q, k, v, mask, packed_seq_ends=None, **kwargs):
    # one causal sequence a row: the samples of a neat pack see each other (and a row's padding
    # sees its real tokens, so even the plain layout differs where the padding is)
    return pa.packed_attention_forward(module, q, k, v, mask, kernel="sdpa", scaling=kwargs.get("scaling"))


def _ignores_causality(module, q, k, v, mask, scaling=None, **kwargs):
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    )
    return out.transpose(1, 2), None


@pytest.mark.parametrize("backend", [_ignores_segments, _ignores_causality])
def test_fails_with_an_attention_that_crosses_segments(backend):
    result = run_packed_attention_probe("cpu", backend=backend).to_json()
    assert result["result"] == "FAIL"
    assert all(c["result"] == "FAIL" for c in result["cases"]), result["cases"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_skips_without_the_device():
    result = run_probe("packed-attention", "cuda").to_json()
    assert result["result"] == "SKIP" and "no CUDA device" in result["reason"]
