"""The split-copy probe passes with our kernel (interpreted) and fails with a wrong one."""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def native_without_version_bump():
    """The CPU's ``aten::split_with_sizes_copy.out`` (which FSDP2's native op calls) replaced by a
    copy that bumps no version counter, as CUDA's fast path did on the H200 with torch 2.11."""

    def split_with_sizes_copy_out(source, split_sizes, dim=0, *, out):
        for t, part in zip(out, source.split(list(split_sizes), dim), strict=True):
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.copy_(part)

    library = torch.library.Library("aten", "IMPL")
    library.impl("split_with_sizes_copy.out", split_with_sizes_copy_out, "CPU")
    try:
        yield
    finally:
        library._destroy()


def always_bump_once(all_gather_output, sizes, dim=0, *, out):
    """Wrong against a native that bumps nothing: the kernel, then one bump per output, whatever
    native does (what our implementation did before it learnt native's bump)."""
    assert split_copy._copy_with_kernel(all_gather_output, list(sizes), out)
    split_copy.calls["kernel"] += 1
    torch.autograd.graph.increment_version(out)


def test_passes_against_a_native_that_bumps_no_version_and_catches_one_that_does():
    with native_without_version_bump():
        result = run_split_copy_probe("cpu", split_sizes=([0, 5, 3],)).to_json()
        wrong = run_split_copy_probe("cpu", implementation=always_bump_once, split_sizes=([0, 5, 3],))
    assert result["result"] == "PASS", result["reason"]
    assert "native version bumps (0)" in result["reason"]
    checked = [c for c in result["cases"] if "dtype" in c]
    assert {(c["version_delta"], c["native_version_delta"]) for c in checked} == {(0, 0)}
    assert wrong.result == "FAIL" and "version bumps [1, 1, 1], native [0, 0, 0]" in wrong.reason


def test_the_native_op_is_back_after_the_probe():
    run_split_copy_probe("cpu", split_sizes=([3, 5],))
    calls = dict(split_copy.calls)
    out = [torch.empty(2, 3), torch.empty(2, 5)]
    with split_copy.triton_interpreter():
        torch.ops.fsdp.split_with_sizes_copy(torch.randn(2, 8), [3, 5], dim=1, out=out)
    assert split_copy.calls == calls
