"""Shared pieces of the data tests: a recipe file for `magistral preprocess`."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_recipe(
    path: Path,
    model_dir: Path,
    dataset: Path,
    cache_dir: Path,
    *,
    pre: dict | None = None,
    basic: dict | None = None,
    training: dict | None = None,
) -> Path:
    """A one-step recipe file whose data section reads ``dataset`` with the tiny model's tokenizer.

    ``pre`` and ``basic`` add keys to ``preprocess_parameters`` and ``basic_parameters``, as the
    ``make_recipe`` fixture's do for a validated recipe; ``training`` adds keys to ``training``.
    """
    recipe = {
        "data": {
            "dataset_param": {
                "preprocess_parameters": {"model_name_or_path": str(model_dir), **(pre or {})},
                "basic_parameters": {
                    "dataset": str(dataset),
                    "cache_dir": str(cache_dir),
                    "cutoff_len": 1024,
                    **(basic or {}),
                },
            }
        },
        "training": {"train_iters": 1, **(training or {})},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path
