"""The Triton split-copy kernel, run by Triton's interpreter on the CPU, against the native op."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from torch.distributed.fsdp._fully_shard import _fsdp_collectives

from magistral_cli.ops import split_copy

op = torch.ops.fsdp.split_with_sizes_copy


@contextlib.contextmanager
def native_that_bumps(bumps):
    """Replace the CPU's ``aten::split_with_sizes_copy.out`` (which FSDP2's native op calls) by a
    copy that bumps output i ``bumps(i)`` times: 0 is what CUDA's fast path did on the H200."""

    def split_with_sizes_copy_out(source, split_sizes, dim=0, *, out):
        for i, (t, part) in enumerate(zip(out, source.split(list(split_sizes), dim), strict=True)):
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.copy_(part)
            for _ in range(bumps(i)):
                torch.autograd.graph.increment_version(t)

    library = torch.library.Library("aten", "IMPL")
    library.impl("split_with_sizes_copy.out", split_with_sizes_copy_out, "CPU")
    try:
        yield
    finally:
        library._destroy()


def _learn(source, sizes):
    """The first call of a shape goes to the native op, which shows its version bump; after it
    calls of that shape go to the kernel."""
    learnt = split_copy.calls["learnt"]
    op(source, sizes, dim=1, out=[torch.empty(source.shape[0], n, dtype=source.dtype) for n in sizes])
    assert split_copy.calls["learnt"] == learnt + 1


def _native_error(fn) -> str | None:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


@pytest.fixture(scope="module")
def native_negative_errors():
    """What the native op does with negative views, captured before our kernel is registered."""
    errors = {}
    for neg_source, neg_output in ((True, False), (False, True)):
        source = torch.randn(2, 15)
        source = source._neg_view() if neg_source else source
        outputs = [torch.empty(2, n) for n in (3, 5, 7)]
        outputs = [t._neg_view() for t in outputs] if neg_output else outputs
        errors[neg_source, neg_output] = _native_error(
            lambda s=source, o=outputs: op(s, [3, 5, 7], dim=1, out=o)
        )
    return errors


@pytest.fixture
def kernel():
    """Our implementation registered for CPU tensors, under the interpreter, for one test."""
    with split_copy.triton_interpreter(), split_copy.registered("CPU"):
        yield split_copy.calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8])
@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("sizes", [[1, 7, 33, 65539], [0, 5, 3], [4, 0, 0, 9]])
def test_kernel_matches_native_bitwise_and_bumps_versions_like_native(kernel, dtype, world, sizes):
    torch.manual_seed(world)
    source = torch.randint(-63, 64, (world, sum(sizes))).to(dtype)
    expected = list(torch.split_with_sizes_copy(source, sizes, dim=1))
    native = [torch.empty_like(t) for t in expected]
    before = [t._version for t in native]
    torch.split_with_sizes_copy(source, sizes, dim=1, out=native)
    native_delta = [t._version - v for t, v in zip(native, before, strict=True)]
    assert native_delta == [1] * len(sizes)  # the CPU's composite kernel: one copy_ per output

    for path in ("native", "kernel"):  # the first call of the shape learns, the next is the kernel's
        actual = [torch.full_like(t, 5) for t in expected]
        versions = [t._version for t in actual]
        ran = kernel[path]
        op(source, sizes, dim=1, out=actual)
        assert kernel[path] == ran + 1, path
        for a, e in zip(actual, expected, strict=True):
            assert torch.equal(a, e)
        assert [t._version - v for t, v in zip(actual, versions, strict=True)] == native_delta, path

    for t in actual:
        t.zero_()
    versions = [t._version for t in actual]
    ran = kernel["kernel"]
    with torch.autograd._unsafe_preserve_version_counter(tuple(actual)):
        op(source, sizes, dim=1, out=actual)
    assert kernel["kernel"] == ran + 1
    assert [t._version for t in actual] == versions
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("bumps", [0, 1, 2])
def test_kernel_bumps_versions_exactly_as_often_as_the_native_op(kernel, bumps):
    """Against a native that bumps nothing (CUDA's fast path on the H200), once (the CPU) or twice."""
    source = torch.randint(-63, 64, (2, 16)).to(torch.bfloat16)
    sizes = [3, 0, 13]
    with native_that_bumps(lambda i: bumps):
        reference = [torch.empty(2, n, dtype=source.dtype) for n in sizes]
        torch.split_with_sizes_copy(source, sizes, dim=1, out=reference)
        assert [t._version for t in reference] == [bumps] * 3  # the stand-in is the native op
        for path in ("native", "kernel", "kernel"):
            actual = [torch.full((2, n), 5, dtype=source.dtype) for n in sizes]
            ran = kernel[path]
            op(source, sizes, dim=1, out=actual)
            assert kernel[path] == ran + 1, path
            assert [t._version for t in actual] == [bumps] * 3, path
            assert torch.equal(torch.cat(actual, dim=1), source)
    key = split_copy._shape_key(source, sizes)
    assert split_copy.native_bumps[key] == bumps


def test_each_shape_and_dispatch_state_is_learnt_on_its_own(kernel):
    """What the native op bumped for one shape is not assumed for another."""
    with native_that_bumps(lambda i: 0):
        _learn(torch.randn(2, 8), [3, 5])
    _learn(torch.randn(4, 8), [3, 5])  # another world size
    _learn(torch.randn(2, 8), [3, 4, 1])  # another number of parts
    _learn(torch.randn(2, 8).half(), [3, 5])  # another dtype
    source = torch.randn(2, 8)
    with torch._C._AutoDispatchBelowADInplaceOrView():  # copy_ bumps nothing here
        _learn(source, [3, 5])
        outputs = [torch.full((2, n), 5.0) for n in (3, 5)]
        ran = kernel["kernel"]
        op(source, [3, 5], dim=1, out=outputs)
        assert kernel["kernel"] == ran + 1
        assert [t._version for t in outputs] == [0, 0]
    bumps = split_copy.native_bumps
    assert sorted(bumps.values()) == [0, 0, 1, 1, 1] and len(bumps) == 5


def test_a_native_that_bumps_unevenly_keeps_the_shape(kernel):
    source = torch.randn(2, 8)
    with native_that_bumps(lambda i: i), pytest.warns(RuntimeWarning, match="unevenly"):
        op(source, [3, 5], dim=1, out=[torch.empty(2, 3), torch.empty(2, 5)])
    assert split_copy.native_bumps[split_copy._shape_key(source, [3, 5])] is None
    outputs = [torch.empty(2, 3), torch.empty(2, 5)]
    native, ran = kernel["native"], kernel["kernel"]
    op(source, [3, 5], dim=1, out=outputs)
    assert (kernel["native"], kernel["kernel"]) == (native + 1, ran)
    assert torch.equal(torch.cat(outputs, dim=1), source)


def test_registered_forgets_what_it_learnt():
    with split_copy.triton_interpreter(), split_copy.registered("CPU"):
        _learn(torch.randn(2, 8), [3, 5])
        assert split_copy.native_bumps
    with split_copy.registered("CPU"):
        assert not split_copy.native_bumps


def test_kernel_in_inference_mode(kernel):
    with torch.inference_mode():
        source = torch.randn(2, 15)
        actual = [torch.empty(2, n) for n in (3, 5, 7)]
        ran = kernel["kernel"]
        op(source, [3, 5, 7], dim=1, out=actual)
        assert kernel["kernel"] == ran + 1
    for a, e in zip(actual, source.split([3, 5, 7], dim=1), strict=True):
        assert torch.equal(a, e)


def test_non_contiguous_tensors_take_the_native_op(kernel):
    source = torch.randn(8, 30)[:, ::2]
    sizes = [3, 5, 7]
    expected = list(torch.split_with_sizes_copy(source, sizes, dim=1))
    actual = [torch.empty(n, 8).t() for n in sizes]
    fallbacks, ran = kernel["native"], kernel["kernel"]
    op(source, sizes, dim=1, out=actual)
    assert (kernel["native"], kernel["kernel"]) == (fallbacks + 1, ran)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize(("neg_source", "neg_output"), [(True, False), (False, True)])
def test_negative_views_behave_exactly_like_native(kernel, native_negative_errors, neg_source, neg_output):
    native_error = native_negative_errors[neg_source, neg_output]
    source = torch.randn(2, 15)
    original = source._neg_view() if neg_source else source
    expected = [torch.empty(2, n) for n in (3, 5, 7)]
    actual = [torch.empty(2, n) for n in (3, 5, 7)]
    if neg_output:
        expected = [t._neg_view() for t in expected]
        actual = [t._neg_view() for t in actual]
    if native_error is None:
        torch.split_with_sizes_copy(original, [3, 5, 7], dim=1, out=expected)
        op(original, [3, 5, 7], dim=1, out=actual)
        for a, e in zip(actual, expected, strict=True):
            assert torch.equal(a, e)
    else:
        with pytest.raises(RuntimeError) as info:
            op(original, [3, 5, 7], dim=1, out=actual)
        assert str(info.value).splitlines()[0] == native_error
    # torch 2.13 rejects negative mutable outputs before any kernel; a negative source is copied.
    assert (native_error is None) == neg_source


def test_unsupported_calls_say_why():
    with split_copy.triton_interpreter():
        source = torch.randn(2, 8)
        outs = [torch.empty(2, 3), torch.empty(2, 5)]
        assert split_copy.unsupported_reason(source, [3, 5], 1, outs) is None
        assert "dtype" in split_copy.unsupported_reason(
            source.double(), [3, 5], 1, [o.double() for o in outs]
        )
        assert "require grad" in split_copy.unsupported_reason(source.requires_grad_(), [3, 5], 1, outs)
        source = torch.randn(2, 8)
        shared = torch.empty(2, 8)
        aliased = [shared.view(-1)[:6].view(2, 3), shared.view(-1)[6:16].view(2, 5)]
        assert "share storage" in split_copy.unsupported_reason(source, [3, 5], 1, aliased)
        assert "dim 1" in split_copy.unsupported_reason(source, [3, 5], 0, outs)
        assert "split sizes" in split_copy.unsupported_reason(source, [3, 4], 1, outs)
    assert "TRITON_INTERPRET" in split_copy.unsupported_reason(source, [3, 5], 1, outs)


def test_without_the_interpreter_cpu_calls_use_the_native_op():
    with split_copy.registered("CPU"):
        source = torch.randn(2, 8)
        outs = [torch.empty(2, 3), torch.empty(2, 5)]
        fallbacks = split_copy.calls["native"]
        op(source, [3, 5], dim=1, out=outs)
        assert split_copy.calls["native"] == fallbacks + 1
        assert torch.equal(torch.cat(outs, dim=1), source)


def test_registration_is_removed_after_the_block():
    with split_copy.triton_interpreter(), split_copy.registered("CPU"):
        pass
    ran = dict(split_copy.calls)
    outs = [torch.empty(2, 3), torch.empty(2, 5)]
    with split_copy.triton_interpreter():
        op(torch.randn(2, 8), [3, 5], dim=1, out=outs)
    assert split_copy.calls == ran


def test_enable_registers_for_npu_and_cuda_once():
    assert split_copy._registration is None
    try:
        split_copy.enable_triton_split_copy()
        first = split_copy._registration
        split_copy.enable_triton_split_copy()  # idempotent
        assert split_copy._registration is first
        dump = torch._C._dispatch_dump("fsdp::split_with_sizes_copy")
        for key in ("CUDA", "PrivateUse1"):
            active = [line for line in dump.splitlines() if line.startswith(f"{key}:")]
            assert active and "magistral_cli/ops/split_copy.py" in active[0], dump
        cpu = [line for line in dump.splitlines() if line.startswith("CPU:")]
        assert "split_copy.py" not in cpu[0]  # the CPU keeps FSDP2's native implementation
    finally:  # leave this test process as it was
        if split_copy._registration is not None:
            split_copy._registration._destroy()
            split_copy._registration = None


def test_another_fsdp_signature_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(split_copy, "EXPECTED_SCHEMA", "fsdp::split_with_sizes_copy(Tensor x) -> ()")
    with pytest.raises(
        split_copy.SplitCopyUnavailable, match="not the fsdp::split_with_sizes_copy\\(Tensor x\\)"
    ):
        split_copy.check_fsdp_op()
    assert issubclass(split_copy.SplitCopyUnavailable, split_copy.UserError)


def test_an_fsdp_that_no_longer_calls_the_op_is_a_clear_error(monkeypatch):
    def foreach_all_gather_copy_out(*args, **kwargs):
        return None

    monkeypatch.setattr(_fsdp_collectives, "foreach_all_gather_copy_out", foreach_all_gather_copy_out)
    with pytest.raises(split_copy.SplitCopyUnavailable, match="no longer copies out"):
        split_copy.check_fsdp_op()


def test_block_sizes_fit_the_ascend_unified_buffer_and_keep_cuda_large():
    """triton-ascend #302: a 32768-element fp32 tile (128 KiB, twice for multibuffer) overflows the UB."""
    for dtype in split_copy.SUPPORTED_DTYPES:
        npu = split_copy.BLOCK_SIZES["npu", dtype]
        assert npu & (npu - 1) == 0  # tl.arange takes powers of two only
        # data tile + int32 offsets + i8 mask, twice for multibuffer, within the UB less the reserve
        footprint = npu * (dtype.itemsize + 4 + 1) * split_copy.NPU_MULTIBUFFER
        assert footprint <= split_copy.NPU_UB_BYTES - split_copy.NPU_UB_RESERVE
        assert footprint * 2 > split_copy.NPU_UB_BYTES - split_copy.NPU_UB_RESERVE  # the largest that fits
        assert split_copy.BLOCK_SIZES["cuda", dtype] == split_copy.BLOCK_SIZES["cpu", dtype] == 16384
    assert {split_copy.BLOCK_SIZES["npu", d] for d in split_copy.SUPPORTED_DTYPES} == {8192}
    assert 32768 * 4 * split_copy.NPU_MULTIBUFFER > split_copy.NPU_UB_BYTES  # the old block, as in #302


@pytest.mark.parametrize("block", [8192, 16384])
def test_every_block_size_copies_like_native(kernel, block, monkeypatch):
    """The NPU and CUDA blocks, run by the interpreter, on parts that span several programs."""
    monkeypatch.setitem(split_copy.BLOCK_SIZES, ("cpu", torch.bfloat16), block)
    sizes = [block - 1, 1, 2 * block + 3]
    source = torch.randint(-63, 64, (2, sum(sizes))).to(torch.bfloat16)
    _learn(source, sizes)
    actual = [torch.empty(2, n, dtype=torch.bfloat16) for n in sizes]
    ran = kernel["kernel"]
    op(source, sizes, dim=1, out=actual)
    assert kernel["kernel"] == ran + 1
    for a, e in zip(actual, source.split(sizes, dim=1), strict=True):
        assert torch.equal(a, e)


def test_a_kernel_that_fails_to_compile_falls_back_to_native_with_one_warning(kernel, monkeypatch):
    """A real Triton failure: tl.arange rejects a block that is not a power of two.

    The one thing injected is the table entry (the block the engine would choose); the error is
    Triton's own, raised while the first program is built.
    """
    monkeypatch.setitem(split_copy.BLOCK_SIZES, ("cpu", torch.float32), 1000)
    monkeypatch.setattr(split_copy, "failed", {})
    source = torch.randn(2, 15)
    _learn(source, [3, 5, 7])
    _learn(source.half(), [3, 5, 7])
    before = dict(kernel)
    with pytest.warns(RuntimeWarning, match="split-copy kernel failed for torch.float32 on cpu") as caught:
        for _ in range(3):
            actual = [torch.full((2, n), 5.0) for n in (3, 5, 7)]
            versions = [t._version for t in actual]
            op(source, [3, 5, 7], dim=1, out=actual)
            for a, e in zip(actual, source.split([3, 5, 7], dim=1), strict=True):
                assert torch.equal(a, e)
            assert [t._version - v for t, v in zip(actual, versions, strict=True)] == [1, 1, 1]
    assert len([w for w in caught if "split-copy" in str(w.message)]) == 1
    assert "power of 2" in split_copy.failed["cpu", torch.float32, 1000]
    assert kernel == {**before, "native": before["native"] + 3, "failed": before["failed"] + 1}
    # Other dtypes keep the kernel.
    halves = [torch.empty(2, n, dtype=torch.float16) for n in (3, 5, 7)]
    op(source.half(), [3, 5, 7], dim=1, out=halves)
    assert kernel["kernel"] == before["kernel"] + 1
