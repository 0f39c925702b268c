"""The process's random state: one seed for every generator, and its capture and restore
(a checkpoint's ``rng`` entry; an evaluation that leaves training's randomness untouched)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from magistral_cli.runtime import device_module


def seed_everything(seed: int, device_type: str) -> None:
    """The same seed on every rank for Python, NumPy, torch and the device."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    mod = device_module(device_type)
    if mod is not None:
        mod.manual_seed_all(seed)


def rng_state(device_type: str) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    mod = device_module(device_type)
    if mod is not None:
        state["device"] = mod.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device_type: str) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    mod = device_module(device_type)
    if mod is not None and "device" in state:
        mod.set_rng_state(state["device"])
