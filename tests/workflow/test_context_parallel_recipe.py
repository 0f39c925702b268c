"""The shipped tiny recipes as a new user runs them: CP = 1 and Ulysses CP = 2 on 2 CPU processes.

``magistral train recipes/tiny/tiny_cpu.yaml`` (dp 2) and ``recipes/tiny/tiny_cpu_cp.yaml``
(dp 1 x Ulysses 2, accumulation 2: the same global batches in the same order) on the real data
pipeline (the tiny Tekken tokenizer, synthetic LLaVA records with images), then
``magistral compare`` between the two runs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_process import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(args, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=cwd, timeout=600)


def _build_quickstart(root: Path) -> None:
    """What the tiny recipes read: ./quickstart/model (with tekken.json) and ./quickstart/data."""
    from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset, write_tiny_tokenizer_files
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    model = build_tiny_model(tiny_mistral3_config(), seed=0)
    save_official_checkpoint(model, root / "quickstart" / "model", num_shards=2)
    write_tiny_tokenizer_files(root / "quickstart" / "model")
    write_synthetic_llava_dataset(root / "quickstart" / "data", 32)


def test_tiny_recipe_with_ulysses_matches_cp1_under_magistral_compare(tmp_path):
    _build_quickstart(tmp_path)
    runs = {}
    for name in ("tiny_cpu", "tiny_cpu_cp"):
        run_dir = tmp_path / f"run_{name}"
        done = _cli(
            "train",
            str(REPO / "recipes" / "tiny" / f"{name}.yaml"),
            "--nproc-per-node",
            "2",
            f"training.output_dir={run_dir}",
            f"training.train_iters={STEPS}",
            "training.save_interval=0",
            # The loss whose value does not depend on how the global batch is split into
            # micro-batches and ranks (the recipes' default, the micro-batch mean, differs by ~0.1%).
            "features.loss_cfg.loss_type=per_token_loss",
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in runs[name]] == list(range(1, STEPS + 1))
    assert "dp 1 x cp 2" in done.stderr and "context parallel: ulysses" in done.stderr

    # Tokens are counted once per data-parallel replica: the same global batches, the same counts.
    assert [r["tokens"] for r in runs["tiny_cpu"]] == [r["tokens"] for r in runs["tiny_cpu_cp"]]
    losses = [r["loss"] for r in runs["tiny_cpu"]]
    assert losses[-1] < losses[0]  # it trains

    compared = _cli("compare", "run_tiny_cpu", "run_tiny_cpu_cp", "--json", cwd=tmp_path)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    report = json.loads(compared.stdout)
    assert report["pass"] is True and report["steps_compared"] == STEPS
    assert report["loss"]["threshold"] == 0.02
    # fp32: far inside the 2% threshold, at float rounding.
    assert report["loss"]["normalized_mean_abs_diff"] < 1e-5
