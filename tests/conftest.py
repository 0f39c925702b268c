"""Shared test fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from magistral_cli.testing.local_hub import LocalHub, add_synthetic_model

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture
def repo_root() -> Path:
    return REPO


# The local Hub server on 127.0.0.1 and a lock for its synthetic model (fetch tests, core and CLI).
@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub(tmp_path / "hub") as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


@pytest.fixture
def push_hub(hub, tmp_path, monkeypatch):
    """The local Hub taking uploads: HF_TOKEN set to the token it expects (``hub.token``, never to be
    seen in any output), no stored token read, and the client's LFS transfer (the local Hub does not
    serve Xet storage)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
    hub.token = "hf_localtesttoken0123456789"
    monkeypatch.setenv("HF_TOKEN", hub.token)
    return hub


@pytest.fixture
def lock(tmp_path, hub):
    path = tmp_path / "lock.json"
    path.write_text(json.dumps(add_synthetic_model(hub)))
    return path
