"""A Triton kernel for FSDP2's all-gather copy-out (``torch.ops.fsdp.split_with_sizes_copy``).

After each all-gather, FSDP2 splits the rank-major buffer ``(world_size, sum(sizes))`` into
one ``(world_size, n)`` tensor per parameter. On Ascend the native ``split_with_sizes_copy``
issues many small strided copies; this kernel copies each parameter's columns for all ranks in
one launch. It is opt-in (``parallel.fsdp_plan.use_triton_split_copy``) and registered for
this process only.

Anything the kernel was not written for (other dtypes, non-contiguous or aliased tensors,
logical negative / conjugate views, tensors that require grad, blocked NPU formats such as
FRACTAL_NZ) goes to the native op, so the result and the errors are exactly native's.

The block (elements per program) is sized per device and dtype (``BLOCK_SIZES``): an Ascend
tile must fit the AI core's unified buffer, a CUDA one the registers. Should the kernel still
fail to compile or launch on a device, that call and every later one of the same variant go to
the native op, with one warning per variant: an exception inside FSDP2's all-gather would stop
the run for an optimisation.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how
its logic is tested on machines without an accelerator; there it uses the CUDA block.

Version counters. The kernel leaves every output's version counter as the native op would in
the same call. ``aten::split_with_sizes_copy.out`` returns ``()``, so it has no ADInplaceOrView
kernel and bumps nothing itself: the bumps native makes come from whatever its backend kernel
calls. The composite kernel (CPU, CUDA's general path, NPU's default) runs ``out[i].copy_`` per
output, one bump each; CUDA's fast path for contiguous operands of one dtype (which every call
the kernel takes is) launches one fused kernel and, in the torch 2.11 on our H200, bumps
nothing, while an earlier version of that path bumped each output explicitly; torch_npu's
fused ``aclnnSplitWithSize`` path depends on the shapes, the CANN version and the SoC. No rule
written here would hold across these, so the bump is learnt: the first call of each shape
(device, dtype, source shape, number of parts, and whether ADInplaceOrView is excluded or
inference mode is on) goes to the native op, which shows what it bumps (:data:`native_bumps`),
and the kernel repeats that on every later call of the shape.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import warnings
from collections.abc import Iterator, Sequence
from functools import cache

import torch

from magistral_cli.errors import UserError

#: The schema this kernel implements; another one means another FSDP2 and a silent no-op.
EXPECTED_SCHEMA = (
    "fsdp::split_with_sizes_copy(Tensor all_gather_output, SymInt[] all_gather_input_split_sizes, "
    "int dim=0, *, Tensor(a!)[] out) -> ()"
)
#: dtypes the kernel copies (bitwise; anything else goes to the native op).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8)

#: The unified buffer (UB) of an Ascend A2 / A3 AI core: 1572864 bits, triton-ascend's "ub overflow" limit.
NPU_UB_BYTES = 192 << 10
#: triton-ascend's default multibuffer allocates every UB buffer twice (triton-ascend #302: a
#: 32768-element fp32 tile, 128 KiB, needs 256 KiB and does not compile).
NPU_MULTIBUFFER = 2
#: UB left to the compiler's own scratch (vllm-ascend reserves 6 KiB for the same reason).
NPU_UB_RESERVE = 8 << 10
#: Bytes per element the compiler may hold beside the data tile: int32 offsets and an i8 mask.
_NPU_INDEX_BYTES = 4 + 1
#: On CUDA: 64 elements a thread (16384 over 8 warps). 32768 over Triton's default 4 warps
#: spills registers to the stack on sm_90 for every dtype; this does not (test_split_copy_aot).
CUDA_BLOCK = 16384
CUDA_NUM_WARPS = 8


def _npu_block(dtype: torch.dtype) -> int:
    """The largest power of two whose tile, offsets and mask, times multibuffer, fit the UB."""
    fitting = (NPU_UB_BYTES - NPU_UB_RESERVE) // NPU_MULTIBUFFER // (dtype.itemsize + _NPU_INDEX_BYTES)
    return 1 << (fitting.bit_length() - 1)


#: Elements per program, per (device type, dtype); larger parts use several programs along grid
#: axis 0. ``tl.arange`` needs a power of two. "cpu" is the interpreter, which checks CUDA's logic.
BLOCK_SIZES: dict[tuple[str, torch.dtype], int] = {
    **{("cuda", d): CUDA_BLOCK for d in SUPPORTED_DTYPES},
    **{("cpu", d): CUDA_BLOCK for d in SUPPORTED_DTYPES},
    **{("npu", d): _npu_block(d) for d in SUPPORTED_DTYPES},
}
#: Launch options per device type (triton-ascend has no warps; the interpreter ignores them).
LAUNCH_OPTIONS: dict[str, dict[str, int]] = {"cuda": {"num_warps": CUDA_NUM_WARPS}}
#: NPU formats whose logical strides describe the storage (ND and NCHW); others are blocked.
_PLAIN_NPU_FORMATS = (0, 2)

#: How many calls took each path in this process (the probe checks the kernel really ran):
#: "kernel" counts copies the kernel did, "native" those the native op did, "failed" the
#: kernel failures and "learnt" the first calls of a shape (:data:`native_bumps`) among the latter.
calls = {"kernel": 0, "native": 0, "failed": 0, "learnt": 0}
#: Variants (device type, dtype, block) whose kernel failed in this process, with the error.
failed: dict[tuple[str, torch.dtype, int], str] = {}
#: Per call shape (:func:`_shape_key`), the version bump the native op gave each output, learnt
#: from the first call of that shape; None where it bumped outputs unevenly, which the kernel
#: does not imitate (the native op keeps that shape). Emptied by :func:`registered`.
native_bumps: dict[tuple, int | None] = {}

_registration: torch.library.Library | None = None


class SplitCopyUnavailable(UserError):
    """This torch / triton cannot take the kernel: says why and how to turn the option off."""


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@cache
def _kernel(interpret: bool):
    from ._split_copy_kernel import build

    return build(interpret)


def unsupported_reason(
    source: torch.Tensor, sizes: Sequence[int], dim: int, out: Sequence[torch.Tensor]
) -> str | None:
    """Why the kernel cannot take this call (the native op then does), or None when it can."""
    device = source.device.type
    if device == "cpu" and not _interpreting():
        return "CPU tensors need TRITON_INTERPRET=1"
    if device not in ("cpu", "cuda", "npu"):
        return f"device {device}"
    if source.layout != torch.strided or source.ndim != 2 or dim != 1:
        return "only a 2-D strided source split along dim 1"
    if not source.is_contiguous():
        return "non-contiguous source"
    if source.is_neg() or source.is_conj():
        return "logical negative or conjugate source view"
    if source.dtype not in SUPPORTED_DTYPES:
        return f"dtype {source.dtype}"
    if source.numel() > 2**31 - 1:
        return "more than 2**31 - 1 elements"
    if source.requires_grad or any(t.requires_grad for t in out):
        return "tensors that require grad"
    if (
        len(sizes) != len(out)
        or any(int(n) < 0 for n in sizes)
        or sum(int(n) for n in sizes) != source.shape[1]
    ):
        return "split sizes that do not match the outputs"
    for t, n in zip(out, sizes, strict=True):
        if (
            t.device != source.device
            or t.dtype != source.dtype
            or t.layout != torch.strided
            or t.is_neg()
            or t.is_conj()
            or tuple(t.shape) != (source.shape[0], int(n))
            or not t.is_contiguous()
        ):
            return "an output that is not a contiguous (world_size, n) tensor like the source"
    if device == "npu":
        import torch_npu

        # Logical strides do not describe blocked NPU storage such as FRACTAL_NZ.
        if any(torch_npu.get_npu_format(t) not in _PLAIN_NPU_FORMATS for t in (source, *out)):
            return "blocked NPU format"
    # Empty tensors are never written (and may all have a null data pointer).
    storages = [t.untyped_storage().data_ptr() for t in (source, *out) if t.numel()]
    if len(set(storages)) != len(storages):
        return "tensors that share storage"
    return None


def _copy_with_kernel(source: torch.Tensor, sizes: Sequence[int], out: Sequence[torch.Tensor]) -> bool:
    """Copy with the kernel; False (after one warning per variant) when it fails to compile or launch.

    A failure leaves the outputs partly written at most; the native op then rewrites them all.
    """
    device = source.device.type
    block = BLOCK_SIZES[device, source.dtype]
    variant = (device, source.dtype, block)
    if variant in failed:
        return False
    kernel = _kernel(_interpreting())
    options = LAUNCH_OPTIONS.get(device, {})
    world, stride = source.shape[0], source.shape[1]
    offset = 0
    try:
        for n, output in zip(sizes, out, strict=True):
            if n:
                kernel[(-(-n // block), world)](source, output, n, stride, offset, block, **options)
            offset += n
    except Exception as exc:  # triton's, the backend compiler's or the driver's: never out of the all-gather
        first = str(exc).strip().splitlines()
        failed[variant] = f"{type(exc).__name__}: {first[0] if first else ''}"
        calls["failed"] += 1
        warnings.warn(
            f"the Triton split-copy kernel failed for {source.dtype} on {device} (BLOCK={block}): "
            f"{failed[variant]}; FSDP2's native copy does these all-gathers from now on "
            "(parallel.fsdp_plan.use_triton_split_copy: false avoids the attempt)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def _shape_key(source: torch.Tensor, sizes: Sequence[int]) -> tuple:
    """What decides which path native takes, and so what it bumps, for a call the kernel can take.

    Backends choose by device, dtype and shapes (torch_npu's fused path by the number of parts
    and both dimensions); whether ``copy_`` bumps at all depends on ADInplaceOrView being
    dispatched, which a guard excludes and inference mode changes.
    """
    return (
        source.device,
        source.dtype,
        tuple(source.shape),
        len(sizes),
        torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView),
        torch.is_inference_mode_enabled(),
    )


def _copy_with_native_and_learn(
    key: tuple, source: torch.Tensor, sizes: Sequence[int], dim: int, out: Sequence[torch.Tensor]
) -> None:
    """The native op does this call; its bump of the outputs is kept for ``key``.

    Only non-empty outputs are read: they have distinct storages (``unsupported_reason``), so
    none shares a version counter with another. With none, nothing is learnt.
    """
    measured = [t for t in out if t.numel() and not t.is_inference()]
    before = [t._version for t in measured]
    calls["native"] += 1
    torch.split_with_sizes_copy(source, sizes, dim=dim, out=out)
    if not measured:
        return
    calls["learnt"] += 1
    bumps = {t._version - v for t, v in zip(measured, before, strict=True)}
    native_bumps[key] = bumps.pop() if len(bumps) == 1 else None
    if native_bumps[key] is None:
        warnings.warn(
            f"FSDP2's native split_with_sizes_copy bumped the version counters of the outputs "
            f"unevenly for {source.dtype} {tuple(source.shape)} on {source.device}; the Triton "
            "kernel would not match that, so the native op keeps calls of this shape",
            RuntimeWarning,
            stacklevel=3,
        )


def split_with_sizes_copy(
    all_gather_output: torch.Tensor,
    all_gather_input_split_sizes: Sequence[int],
    dim: int = 0,
    *,
    out: list[torch.Tensor],
) -> None:
    """Our implementation of ``fsdp::split_with_sizes_copy``: the kernel, or the native op.

    Version counters end as native leaves them (see the module's docstring). FSDP2 hides the
    copy from autograd anyway (``_unsafe_preserve_version_counter`` around the call): the
    unsharded parameters are saved for backward, and refilling them by a later all-gather must
    not read as an in-place change, or backward would raise "modified by an inplace operation".
    """
    source, sizes = all_gather_output, [int(n) for n in all_gather_input_split_sizes]
    if unsupported_reason(source, sizes, dim, out) is None:
        tracked = [t for t in out if not t.is_inference()]  # inference tensors have no counter
        bump = 0
        if tracked:
            key = _shape_key(source, sizes)
            if key not in native_bumps:
                _copy_with_native_and_learn(key, source, all_gather_input_split_sizes, dim, out)
                return
            bump = native_bumps[key]
        if bump is not None and _copy_with_kernel(source, sizes, out):
            calls["kernel"] += 1
            for _ in range(bump):  # a Triton store bumps nothing: bump as native did
                torch.autograd.graph.increment_version(tracked)
            return
    calls["native"] += 1
    torch.split_with_sizes_copy(source, all_gather_input_split_sizes, dim=dim, out=out)


def check_fsdp_op() -> None:
    """Raise SplitCopyUnavailable unless this torch's FSDP2 calls the op we implement, with our schema."""
    fix = "set parallel.fsdp_plan.use_triton_split_copy: false"
    if importlib.util.find_spec("triton") is None:
        raise SplitCopyUnavailable(
            f"use_triton_split_copy needs triton (triton-ascend on NPU), which is not installed: install it or {fix}"
        )
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    except ImportError as exc:
        raise SplitCopyUnavailable(
            f"use_triton_split_copy: torch {torch.__version__} has no FSDP2 collectives module ({exc}); {fix}"
        ) from None
    try:
        schema = str(torch.ops.fsdp.split_with_sizes_copy.default._schema)
    except (AttributeError, RuntimeError):
        schema = None
    if schema != EXPECTED_SCHEMA:
        raise SplitCopyUnavailable(
            f"use_triton_split_copy: torch {torch.__version__}'s FSDP2 "
            + ("has no fsdp::split_with_sizes_copy op" if schema is None else f"defines {schema}")
            + f", not the {EXPECTED_SCHEMA} this kernel implements; {fix}"
        )
    source = inspect.getsource(_fsdp_collectives.foreach_all_gather_copy_out)
    if "torch.ops.fsdp.split_with_sizes_copy" not in source:
        raise SplitCopyUnavailable(
            f"use_triton_split_copy: torch {torch.__version__}'s FSDP2 no longer copies out through "
            f"torch.ops.fsdp.split_with_sizes_copy, so the kernel would never run; {fix}"
        )


def _register(dispatch_keys: Sequence[str]) -> torch.library.Library:
    library = torch.library.Library("fsdp", "IMPL")
    with warnings.catch_warnings():
        # Overriding FSDP2's own registration is the point; torch warns about any override.
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        for key in dispatch_keys:
            library.impl("split_with_sizes_copy", split_with_sizes_copy, key, allow_override=True)
    return library


def enable_triton_split_copy() -> None:
    """Register the kernel for FSDP2's copy-out on NPU (PrivateUse1) and CUDA for this process.

    Idempotent. Raises SplitCopyUnavailable (a UserError) at start-up when triton is missing or
    when this torch's FSDP2 lacks the op or defines it with another signature.
    """
    global _registration
    if _registration is not None:
        return
    check_fsdp_op()
    _registration = _register(("PrivateUse1", "CUDA"))


@contextlib.contextmanager
def registered(dispatch_key: str = "CPU") -> Iterator[None]:
    """Register the kernel for one dispatch key inside the block only (the probe and tests use "CPU").

    On exit the registration is removed and FSDP2's native implementation is back. The bumps
    learnt before (:data:`native_bumps`) are forgotten on entry: each block learns its own.
    """
    check_fsdp_op()
    native_bumps.clear()
    library = _register((dispatch_key,))
    try:
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def triton_interpreter() -> Iterator[None]:
    """Run the kernel under Triton's interpreter inside the block (sets TRITON_INTERPRET=1)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
