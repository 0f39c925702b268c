"""Probe ``split-copy``: our Triton kernel for ``torch.ops.fsdp.split_with_sizes_copy`` against native.

Everything goes through the registered op, as FSDP2 calls it. Checks (the seed's
``check_npu_split_copy.py``):

- dtypes bf16, fp16, fp32, uint8, int8 x world sizes 1, 2, 8 x split sizes with a zero and
  with a part over 65536 elements: bitwise equal to the native op and the same version-counter
  bump of every output as the native op made in the same case (measured on this device before
  our implementation is registered: CUDA's fast path bumps nothing in torch 2.11, the CPU's
  composite once), on the first call of the shape and on the next, which the kernel (not the
  fallback) must do; none under ``_unsafe_preserve_version_counter``;
- inference mode;
- the native fallback for non-contiguous outputs, logical negative views (and blocked NPU
  formats on NPU): the same values, or exactly the native error.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1); without triton
the probe is a SKIP.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from typing import Any

from .common import MISSING_SOFTWARE, Cases, ProbeResult, device_missing_reason, skip

PROBE = "split-copy"
DTYPE_NAMES = ("bfloat16", "float16", "float32", "uint8", "int8")
WORLD_SIZES = (1, 2, 8)
SPLIT_SIZES = ([1, 7, 33, 65539], [0, 5, 3])


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _native_outcome(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except RuntimeError as exc:
        return _first_line(exc)
    return None


def _dispatch_key(device: str) -> str:
    return {"cpu": "CPU", "cuda": "CUDA", "npu": "PrivateUse1"}[device]


def run_split_copy_probe(
    device: str = "cpu",
    *,
    implementation: Callable[..., None] | None = None,
    split_sizes: tuple[list[int], ...] = SPLIT_SIZES,
) -> ProbeResult:
    """Run the probe; ``implementation`` replaces our op implementation (tests pass a wrong one)."""
    mode = "default"
    how = "Triton interpreter (TRITON_INTERPRET=1)" if device == "cpu" else "compiled Triton kernel"
    missing = device_missing_reason(device)
    if missing:
        return skip(PROBE, device, mode, missing)
    if importlib.util.find_spec("triton") is None:
        return skip(PROBE, device, mode, "triton is not installed (triton-ascend on NPU)", MISSING_SOFTWARE)

    import torch

    from magistral_cli.ops import split_copy

    if device == "npu":
        import torch_npu  # noqa: F401

    split_copy.check_fsdp_op()  # imports FSDP2's op definition; raises a clear error on another torch
    op = torch.ops.fsdp.split_with_sizes_copy

    # Native references, captured before our implementation is registered.
    native_cases = _native_cases(torch, op, device, split_sizes)
    native_negative = {}
    for neg_source, neg_output in ((True, False), (False, True)):
        source = torch.randn(2, 15, device=device)
        source = source._neg_view() if neg_source else source
        outputs = [torch.empty(2, n, device=device) for n in (3, 5, 7)]
        outputs = [t._neg_view() for t in outputs] if neg_output else outputs
        native_negative[neg_source, neg_output] = _native_outcome(
            lambda s=source, o=outputs: op(s, [3, 5, 7], dim=1, out=o)
        )

    interpreter = split_copy.triton_interpreter() if device == "cpu" else contextlib.nullcontext()
    cases = Cases()
    with interpreter, split_copy.registered(_dispatch_key(device)):
        if implementation is not None:
            # Tests: replace the registered implementation for this probe only.
            library = torch.library.Library("fsdp", "IMPL")
            library.impl("split_with_sizes_copy", implementation, _dispatch_key(device), allow_override=True)
        try:
            _run_cases(cases, torch, op, split_copy, device, native_cases, native_negative)
        finally:
            if implementation is not None:
                library._destroy()
    bumps = sorted({d for _, _, deltas in native_cases.values() for d in deltas})
    return cases.result(
        PROBE,
        device,
        mode,
        f"{how} bitwise equal to native, native version bumps ({', '.join(map(str, bumps))}), "
        "native fallbacks",
    )


def _native_cases(torch, op, device, split_sizes) -> dict[tuple, tuple]:
    """Per case (dtype, world, sizes): the source, the native op's outputs and its bump of each."""
    torch.manual_seed(43)
    native = {}
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for world in WORLD_SIZES:
            for sizes in split_sizes:
                source = torch.randint(-63, 64, (world, sum(sizes)), device=device).to(dtype)
                outputs = [torch.full((world, n), 7, device=device, dtype=dtype) for n in sizes]
                versions = [t._version for t in outputs]
                op(source, sizes, dim=1, out=outputs)
                deltas = [t._version - v for t, v in zip(outputs, versions, strict=True)]
                native[dtype_name, world, tuple(sizes)] = (source, outputs, deltas)
    return native


def _run_cases(cases: Cases, torch, op, split_copy, device, native_cases, native_negative) -> None:
    for (dtype_name, world, sizes), (source, expected, native_delta) in native_cases.items():

        def check(source=source, expected=expected, native_delta=native_delta, sizes=sizes):
            # The first call of a shape may go to the native op (ours learns its version bump
            # there); the next must be the kernel's. Both must leave what native leaves.
            sizes = list(sizes)
            for call in ("first", "second"):
                actual = [torch.full_like(t, 7) for t in expected]
                versions = [t._version for t in actual]
                kernel_calls = split_copy.calls["kernel"]
                op(source, sizes, dim=1, out=actual)
                for a, e in zip(actual, expected, strict=True):
                    assert torch.equal(a, e), f"{call} call: values differ from native split_with_sizes_copy"
                delta = [t._version - v for t, v in zip(actual, versions, strict=True)]
                assert delta == native_delta, f"{call} call: version bumps {delta}, native {native_delta}"
            assert split_copy.calls["kernel"] == kernel_calls + 1, (
                "the kernel did not run (native fallback)"
                + (f"; kernel failures: {split_copy.failed}" if split_copy.failed else "")
            )
            for t in actual:
                t.fill_(7)
            versions = [t._version for t in actual]
            with torch.autograd._unsafe_preserve_version_counter(tuple(actual)):
                op(source, sizes, dim=1, out=actual)
            assert [t._version for t in actual] == versions, "version counters moved under preservation"
            for a, e in zip(actual, expected, strict=True):
                assert torch.equal(a, e), "values differ on the version-preserving call"
            return {
                "version_delta": delta[0] if delta else None,
                "native_version_delta": native_delta[0] if native_delta else None,
            }

        cases.run(
            f"{dtype_name} world={world} sizes={list(sizes)}",
            check,
            dtype=dtype_name,
            world=world,
            sizes=list(sizes),
        )

    def inference_mode():
        with torch.inference_mode():
            source = torch.randn(2, 15, device=device)
            actual = [torch.empty(2, n, device=device) for n in (3, 5, 7)]
            kernel_calls = split_copy.calls["kernel"]
            op(source, [3, 5, 7], dim=1, out=actual)
            assert split_copy.calls["kernel"] == kernel_calls + 1, "the kernel did not run in inference mode"
            for a, e in zip(actual, source.split([3, 5, 7], dim=1), strict=True):
                assert torch.equal(a, e), "values differ in inference mode"

    cases.run("inference mode", inference_mode)

    def noncontiguous():
        source = torch.randn(8, 30, device=device)[:, ::2]
        sizes = [3, 5, 7]
        expected = list(torch.split_with_sizes_copy(source, sizes, dim=1))
        actual = [torch.empty(n, 8, device=device).t() for n in sizes]
        native_calls = split_copy.calls["native"]
        op(source, sizes, dim=1, out=actual)
        assert split_copy.calls["native"] == native_calls + 1, (
            "non-contiguous tensors did not take the native op"
        )
        for a, e in zip(actual, expected, strict=True):
            assert torch.equal(a, e), "fallback values differ from native"

    cases.run("fallback: non-contiguous source and outputs", noncontiguous)

    for (neg_source, neg_output), native_error in native_negative.items():

        def negative(neg_source=neg_source, neg_output=neg_output, native_error=native_error):
            source = torch.randn(2, 15, device=device)
            original = source._neg_view() if neg_source else source
            expected = [torch.empty(2, n, device=device) for n in (3, 5, 7)]
            actual = [torch.empty_like(t) for t in expected]
            if neg_output:
                expected = [t._neg_view() for t in expected]
                actual = [t._neg_view() for t in actual]
            if native_error is None:
                torch.split_with_sizes_copy(original, [3, 5, 7], dim=1, out=expected)
                op(original, [3, 5, 7], dim=1, out=actual)
                for a, e in zip(actual, expected, strict=True):
                    assert torch.equal(a, e), "negative-view fallback values differ from native"
                return {"native_error": None}
            got = _native_outcome(lambda: op(original, [3, 5, 7], dim=1, out=actual))
            assert got == native_error, f"raised {got!r}, native raises {native_error!r}"
            return {"native_error": native_error}

        cases.run(
            f"fallback: logical negative view (source={neg_source}, outputs={neg_output})",
            negative,
        )

    if device == "npu":
        _blocked_format_cases(cases, torch, op)


def _blocked_format_cases(cases: Cases, torch, op) -> None:
    import torch_npu

    torch.npu.config.allow_internal_format = True
    for cast_source, cast_output in ((True, False), (False, True)):

        def blocked(cast_source=cast_source, cast_output=cast_output):
            source = torch.randn(8, 96, device="npu", dtype=torch.bfloat16)
            if cast_source:
                source = torch_npu.npu_format_cast(source, 29)
            expected = [torch.empty(8, n, device="npu", dtype=source.dtype) for n in (32, 64)]
            actual = [torch.empty_like(t) for t in expected]
            if cast_output:
                expected = [torch_npu.npu_format_cast(t, 29) for t in expected]
                actual = [torch_npu.npu_format_cast(t, 29) for t in actual]
            formats = [torch_npu.get_npu_format(t) for t in (source, *actual)]
            assert 29 in formats, f"a blocked format was not constructed: {formats}"
            native_error = _native_outcome(
                lambda: torch.split_with_sizes_copy(source, [32, 64], dim=1, out=expected)
            )
            if native_error is None:
                op(source, [32, 64], dim=1, out=actual)
                for a, e in zip(actual, expected, strict=True):
                    assert torch.equal(a.cpu(), e.cpu()), "blocked-format fallback values differ"
            else:
                got = _native_outcome(lambda: op(source, [32, 64], dim=1, out=actual))
                assert got == native_error, f"raised {got!r}, native raises {native_error!r}"
            return {"formats": formats, "native_error": native_error}

        cases.run(f"fallback: blocked NPU format (source={cast_source}, outputs={cast_output})", blocked)
