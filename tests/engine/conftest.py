"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from .helpers import REAL_CONFIG


@pytest.fixture(scope="module")
def mesh():
    """A one-rank CPU device mesh (gloo), for applying FSDP2 in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from magistral_cli.runtime import init_distributed

    _, created = init_distributed("cpu")
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


@pytest.fixture
def real_model_dir(tmp_path):
    """A model directory holding only the published config.json (no weights: the memory plan needs none)."""
    model = tmp_path / "Magistral-Small-2509"
    model.mkdir()
    (model / "config.json").write_text(REAL_CONFIG.read_text())
    return model
