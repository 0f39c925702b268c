"""The split-copy kernel compiled ahead of time for CUDA, on a machine without a GPU.

The interpreter (tests/ops/test_split_copy.py) checks what the kernel computes, not that
Triton's compiler takes it: a kernel can run in the interpreter and still fail to lower. Here
every variant the engine can launch on CUDA (each supported dtype with the block and warps
``BLOCK_SIZES`` and ``LAUNCH_OPTIONS`` choose, in the argument specialisations Triton's JIT
makes at launch: none, every argument 16-aligned, and N == 1) goes through the whole
pipeline, ttir to cubin with the wheel's ptxas, for sm_80 and sm_90. About 7 s for the 30 compiles on 2 CPU cores (each about 0.2 s).

The register check reads the cubin's resource usage with the wheel's cuobjdump: a copy that
spills to the stack (as 32768 elements over 4 warps did) would be slow on every all-gather.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from magistral_cli.ops import split_copy  # noqa: E402
from magistral_cli.ops._split_copy_kernel import build  # noqa: E402

_POINTER = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.uint8: "*u8",
    torch.int8: "*i8",
}
_DIVISIBLE = [["tt.divisibility", 16]]  # what the JIT's "D" specialisation means (BaseBackend.parse_attr)
#: The specialisations a launch can produce for (source, destination, N, STRIDE, OFFSET): nothing
#: known, everything 16-aligned / divisible by 16, and N == 1 (the JIT makes an int 1 a constant).
_SPECIALISATIONS = {
    "generic": ({}, {}),
    "aligned": ({(i,): _DIVISIBLE for i in range(5)}, {}),
    "n_is_1": ({}, {"N": 1}),
}
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _compile(dtype: torch.dtype, specialisation: str, arch: int):
    attrs, constants = _SPECIALISATIONS[specialisation]
    kernel = build(interpret=False)
    signature = {
        "source": _POINTER[dtype],
        "destination": _POINTER[dtype],
        "N": "constexpr" if "N" in constants else "i32",
        "STRIDE": "i32",
        "OFFSET": "i32",
        "BLOCK": "constexpr",
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={**constants, "BLOCK": split_copy.BLOCK_SIZES["cuda", dtype]},
        attrs=attrs,
    )
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options=split_copy.LAUNCH_OPTIONS["cuda"]
    )


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """A cache of its own, so every variant is really compiled, not read back from ~/.triton."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # torch's default today, stated (silences a warning)


def test_the_wheel_has_the_cuda_toolchain():
    """ptxas and cuobjdump ship in the triton wheel; without them this file would prove nothing."""
    from triton.backends.nvidia.compiler import get_ptxas

    for arch in (80, 90):  # sm_90 and later use the wheel's second ptxas
        assert Path(get_ptxas(arch).path).is_file()
    assert _CUOBJDUMP.is_file()


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("specialisation", list(_SPECIALISATIONS))
@pytest.mark.parametrize("dtype", split_copy.SUPPORTED_DTYPES, ids=str)
def test_every_cuda_variant_compiles_to_a_cubin_without_spills(tmp_path, dtype, specialisation, arch):
    compiled = _compile(dtype, specialisation, arch)
    assert compiled.metadata.num_warps == split_copy.CUDA_NUM_WARPS
    ptx = compiled.asm["ptx"]
    assert f".target sm_{arch}" in ptx
    if specialisation == "aligned":  # the divisibility hints reached the compiler: 16-byte accesses
        assert re.search(r"ld\.global\S*\.v4", ptx) and re.search(r"st\.global\S*\.v4", ptx)
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run(
        [str(_CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    assert found, usage
    registers, stack, shared, local = map(int, found.groups())
    assert (stack, shared, local) == (0, 0, 0), usage
    assert registers <= 255


def test_a_block_that_is_not_a_power_of_two_fails_to_compile():
    """The compile-time failure split_copy falls back from, produced by the real compiler."""
    source = ASTSource(
        fn=build(interpret=False),
        signature={
            "source": "*fp32",
            "destination": "*fp32",
            "N": "i32",
            "STRIDE": "i32",
            "OFFSET": "i32",
            "BLOCK": "constexpr",
        },
        constexprs={"BLOCK": 1000},
    )
    with pytest.raises(triton.CompilationError, match="power of 2"):
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
