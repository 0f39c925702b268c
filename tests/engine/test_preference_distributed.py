"""Preference training under `magistral train` on 2 CPU processes: the step mean over all pairs
whatever the split (2 ranks x 1 pair = 1 rank x 2 pairs = 1 pair x accumulation 2), trl's metrics
in metrics.jsonl, and an exact resume after a rank is killed mid-save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from magistral_cli.engine.checkpoint import FAULT_ENV
from magistral_cli.engine.trainer import Trainer
from magistral_cli.ops.preference_loss import METRIC_NAMES

from .helpers import make_recipe, recipe_dict, run_train, write_tiny_model
from .test_preference import BETA, pair_batches

STEPS = 4
DPO = ["training.stage=dpo", "features.loss_cfg.loss_type=default", f"training.dpo.beta={BETA}"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_split_invariance_in_one_process(tmp_path):
    """Micro-batch 2 x accumulation 1 and 1 x 2 see the same pairs: equal loss and gradients."""
    write_tiny_model(tmp_path / "model")
    results = []
    for mb, acc in ((2, 1), (1, 2)):
        recipe = make_recipe(
            tmp_path / "model",
            tmp_path / f"run{mb}",
            [*DPO, "training.dpo.loss=simpo"],
            micro_batch_size=mb,
            gradient_accumulation_steps=acc,
        )
        trainer = Trainer(recipe)
        try:
            out = trainer.forward_backward(pair_batches(micro_batch_size=mb, accumulation=acc))
            grads = {
                n: p.grad.full_tensor().clone()
                for n, p in trainer.model.named_parameters()
                if p.grad is not None
            }
            results.append((out["objective"].tolist(), grads))
        finally:
            trainer.close()
    (sums_a, grads_a), (sums_b, grads_b) = results
    assert sums_a == pytest.approx(sums_b, rel=1e-5, abs=1e-6)
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_exactly(tmp_path):
    write_tiny_model(tmp_path / "model", seed=0)
    write_tiny_model(tmp_path / "reference", seed=5)
    data = recipe_dict(
        tmp_path / "model",
        tmp_path / "unused",
        micro_batch_size=1,
        train_iters=STEPS,
        save_interval=2,
        resume="auto",
    )
    del data["training"]["output_dir"]
    data["features"]["loss_cfg"]["loss_type"] = "default"
    data["training"].update(stage="dpo", dpo={"beta": BETA, "ref_model": str(tmp_path / "reference")})
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(yaml.safe_dump(data))

    whole = tmp_path / "whole"
    done = run_train(recipe, whole)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(whole)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert set(METRIC_NAMES) <= r.keys()
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
    assert "reference model:" in done.stderr

    # 1 process with micro-batch 2: the same pairs each step, the same means.
    single = Trainer(
        make_recipe(
            tmp_path / "model",
            tmp_path / "single",
            [*DPO, f"training.dpo.ref_model={tmp_path / 'reference'}"],
            micro_batch_size=2,
            train_iters=STEPS,
        )
    )
    try:
        single_records = single.train()
    finally:
        single.close()
    for key in ("loss", *METRIC_NAMES):
        assert [r[key] for r in records] == pytest.approx(
            [r[key] for r in single_records], rel=1e-5, abs=2e-5
        ), key

    # Rank 0 killed while step 4 is saved; launched again, it resumes from step 2 and matches.
    broken = tmp_path / "broken"
    killed = run_train(recipe, broken, env={FAULT_ENV: "kill-during-save:4:0"})
    assert killed.returncode != 0
    resumed = run_train(recipe, broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    again = _records(broken)
    for key in ("loss", *METRIC_NAMES):
        assert [r[key] for r in again] == [r[key] for r in records], key
