"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from .helpers import REAL_CONFIG


@pytest.fixture
def real_model_dir(tmp_path):
    """A model directory holding only the published config.json (no weights: the memory plan needs none)."""
    model = tmp_path / "Magistral-Small-2509"
    model.mkdir()
    (model / "config.json").write_text(REAL_CONFIG.read_text())
    return model
