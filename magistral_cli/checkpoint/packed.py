"""Non-tensor state in a DCP checkpoint: an object packed as a uint8 tensor, and the sizes to read it back.

A training checkpoint keeps its RNG states, data-loader positions and settings (``lora.config``)
as ``torch.save`` bytes in uint8 tensors; they are read back with ``torch.load(weights_only=True)``
only, so a checkpoint can hold tensors, numbers, strings and containers of them, never code.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch


def pack(obj: Any) -> torch.Tensor:
    """``obj`` (tensors, numbers, strings, lists, tuples, dicts) as a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(tensor: torch.Tensor) -> Any:
    try:
        return torch.load(io.BytesIO(tensor.cpu().numpy().tobytes()), weights_only=True)
    except Exception as exc:  # an object weights_only refuses: say what, not a pickle traceback
        raise ValueError(
            f"a checkpoint entry holds an object torch.load(weights_only=True) refuses ({exc}); "
            "state saved in checkpoints must be tensors, numbers, strings and containers of them"
        ) from None


def checkpoint_sizes(path: Path, keys: list[str]) -> dict[str, torch.Size]:
    """Sizes of the tensors ``keys`` in a DCP (packed entries have a size only known from the file)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from magistral_cli.checkpoint.safe_dcp import SafeFileSystemReader

    metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: metadata[k].size for k in keys if isinstance(metadata.get(k), TensorStorageMetadata)}
