"""The vision-attention probe passes with our backend and provably fails with a wrong one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from magistral_cli.probes import run_probe
from magistral_cli.probes.vision_attention import run_vision_attention_probe


def test_passes_on_the_cpu_with_every_case_checked():
    result = run_vision_attention_probe("cpu").to_json()
    assert result["result"] == "PASS", result
    names = [c["name"] for c in result["cases"]]
    assert len(names) == 5 and sum(n.startswith("isolation") for n in names) == 2
    unequal = next(
        c for c in result["cases"] if c["name"].startswith("numerics") and c["sizes"] == [[16, 16], [16, 24]]
    )
    assert unequal["boundaries"] == [64, 160]
    assert 0 < unequal["forward_relative_l2"] <= 0.015
    assert unequal["max_gradient_relative_l2"] <= 0.04


def attention_across_images(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Wrong on purpose: one attention over all patches, ignoring image boundaries."""
    return F.scaled_dot_product_attention(query, key, value, scale=scaling).transpose(1, 2), None


def test_a_backend_that_mixes_images_fails_numerics_and_isolation():
    result = run_vision_attention_probe("cpu", backend=attention_across_images).to_json()
    assert result["result"] == "FAIL"
    by_name = {c["name"]: c for c in result["cases"]}
    assert by_name["numerics 1 image(s) [[16, 16]]"]["result"] == "PASS"  # one image: nothing to mix
    assert by_name["isolation [[16, 16], [16, 24]]"]["result"] == "FAIL"
    assert "depend on other images" in by_name["isolation [[16, 16], [16, 24]]"]["error"]


def test_a_zero_threshold_fails_the_numerics():
    result = run_vision_attention_probe("cpu", forward_limit=0.0).to_json()
    assert result["result"] == "FAIL"
    assert "forward relative L2" in result["reason"]


def test_context_parallel_options_are_refused_in_the_default_mode():
    # The context-parallel modes themselves run in tests/probes/test_cp_probes.py.
    with pytest.raises(ValueError, match="context-parallel modes only"):
        run_vision_attention_probe("cpu", nproc=2)
    with pytest.raises(ValueError, match="use inject"):
        run_vision_attention_probe("cpu", "ring", backend=attention_across_images)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_missing_device_skips_with_the_reason():
    result = run_probe("vision-attention", "cuda").to_json()
    assert result["result"] == "SKIP" and "no CUDA device" in result["reason"]
