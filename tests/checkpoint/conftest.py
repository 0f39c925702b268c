"""A tiny Mistral3 saved in the official layout (two shards and an index), shared by the tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from magistral_cli.testing.tiny_model import build_tiny_model, save_official_checkpoint, tiny_mistral3_config

#: A small vocabulary keeps the embedding small; nothing here needs the real tokenizer.
VOCAB = 512


@dataclass
class TinyCheckpoint:
    hf_dir: Path
    #: transformers key -> the bf16 tensor stored in the checkpoint
    state: dict[str, torch.Tensor]
    config: object


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> TinyCheckpoint:
    config = tiny_mistral3_config(vocab_size=VOCAB)
    model = build_tiny_model(config)
    hf_dir = save_official_checkpoint(model, tmp_path_factory.mktemp("tiny") / "hf", num_shards=2)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    return TinyCheckpoint(hf_dir, state, config)


def record_integrity(checkpoint: Path, step: int) -> Path:
    """Write ``integrity.json`` for a checkpoint saved with ``dcp.save``, as the trainer's save records its
    files (``checkpoint.integrity.write_integrity`` over every data file's size and xxh3-64)."""
    from magistral_cli.checkpoint.integrity import describe_file, write_integrity

    write_integrity(checkpoint, {p.name: describe_file(p) for p in sorted(checkpoint.glob("*.distcp"))}, step)
    return checkpoint


@pytest.fixture(scope="session")
def recorded():
    """``recorded(checkpoint, step)``: ``record_integrity`` (a training checkpoint needs its record)."""
    return record_integrity
