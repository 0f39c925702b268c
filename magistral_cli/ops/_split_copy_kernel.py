"""The Triton kernel behind ``split_copy`` (imported only when triton is installed).

Kept without ``from __future__ import annotations``: Triton reads ``tl.constexpr`` from the
real annotation object.
"""

import triton
import triton.language as tl


def copy_parameter(source, destination, N, STRIDE, OFFSET, BLOCK: tl.constexpr):
    """One program copies BLOCK columns of one rank: source[rank, OFFSET:OFFSET+N] -> destination[rank]."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rank = tl.program_id(1)
    mask = index < N
    values = tl.load(source + rank * STRIDE + OFFSET + index, mask, other=0)
    tl.store(destination + rank * N + index, values, mask)


def build(interpret: bool):
    """The kernel compiled for the device, or run by Triton's interpreter with ``interpret``.

    ``triton.jit`` picks compiler or interpreter when it wraps the function, from
    TRITON_INTERPRET at that moment; building here lets one process use either.
    """
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(copy_parameter)
    return triton.jit(copy_parameter)
