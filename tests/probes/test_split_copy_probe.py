"""The split-copy probe passes with our kernel (interpreted) and fails with a wrong one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from magistral_cli.ops import split_copy
from magistral_cli.probes.split_copy import run_split_copy_probe

SMALL = ([7, 0, 70001], [0, 5, 3])  # a zero and a part over 65536 elements, fewer cases than the CLI


def test_passes_on_the_cpu_under_the_interpreter():
    result = run_split_copy_probe("cpu", split_sizes=SMALL).to_json()
    assert result["result"] == "PASS", result["reason"]
    assert "TRITON_INTERPRET=1" in result["reason"]
    checked = [c for c in result["cases"] if c.get("result") == "PASS"]
    assert len(checked) == 5 * 3 * 2 + 4
    assert {c["dtype"] for c in checked if "dtype" in c} == {
        "bfloat16",
        "float16",
        "float32",
        "uint8",
        "int8",
    }


def off_by_one(all_gather_output, sizes, dim=0, *, out):
    """Wrong on purpose: our kernel, then the last element of every output changed."""
    split_copy.split_with_sizes_copy(all_gather_output, sizes, dim, out=out)
    for t in out:
        if t.numel():
            t.view(-1)[-1] += 1


def no_version_bump(all_gather_output, sizes, dim=0, *, out):
    """Wrong on purpose: right values, but the version counters are not bumped like native."""
    for t, part in zip(out, all_gather_output.split(list(sizes), dim=dim), strict=True):
        with torch.autograd._unsafe_preserve_version_counter(t):
            t.copy_(part)
    split_copy.calls["kernel"] += 1


@pytest.mark.parametrize(
    ("implementation", "message"), [(off_by_one, "values differ"), (no_version_bump, "version bumps")]
)
def test_a_wrong_implementation_fails(implementation, message):
    result = run_split_copy_probe("cpu", implementation=implementation, split_sizes=SMALL).to_json()
    assert result["result"] == "FAIL"
    assert message in result["reason"]


def test_the_native_op_is_back_after_the_probe():
    run_split_copy_probe("cpu", split_sizes=([3, 5],))
    calls = dict(split_copy.calls)
    out = [torch.empty(2, 3), torch.empty(2, 5)]
    with split_copy.triton_interpreter():
        torch.ops.fsdp.split_with_sizes_copy(torch.randn(2, 8), [3, 5], dim=1, out=out)
    assert split_copy.calls == calls
