"""``training.dpo.precompute_ref``: the reference's log-probabilities computed once before training.

On the tiny DPO recipe's data (12 pairs with images in the quickstart's layout, preprocessed into a real
cache entry): 2 processes under `magistral train` give the same losses and metrics with the stored values
as with the live frozen reference, a resume after a rank was killed mid-save reads the stored file
(no second pass) and repeats the losses exactly; a stored file that does not match is recomputed,
with the reason in the log, and the reference model is freed; the LoRA base is scored with its
adapters off.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import weakref

import pytest
import torch

from magistral_cli.config import load_recipe
from magistral_cli.engine.checkpoint import FAULT_ENV
from magistral_cli.engine.preference import adapters_off, model_inputs
from magistral_cli.engine.reference_logps import read_stored, reference_identity, store_path, write_stored
from magistral_cli.engine.trainer import Trainer
from magistral_cli.metric_names import PREFERENCE_METRICS

from .helpers import DPO_RECIPE, pair_overrides, run_train, write_pair_assets

PRECOMPUTE = "training.dpo.precompute_ref=true"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return write_pair_assets(tmp_path_factory.mktemp("dpo-precompute"))


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_precomputed_equals_live_reference_and_resume_reads_the_file(quick):
    # One pair per micro-batch (pair_overrides): training's batches are the pass's, padding included.
    common = pair_overrides(quick)
    live = run_train(DPO_RECIPE, quick / "live", *common)
    assert live.returncode == 0, live.stderr[-3000:]
    assert "reference model:" in live.stderr and "reference log-probabilities" not in live.stderr

    run = quick / "pre"
    killed = run_train(DPO_RECIPE, run, *common, PRECOMPUTE, env={FAULT_ENV: "kill-during-save:3:0"})
    assert killed.returncode != 0
    assert "computing them before training: none stored for this reference" in killed.stderr
    stored = sorted((quick / "cache").glob("magistral-*.ref-logps-*.safetensors"))
    assert len(stored) == 1
    resumed = run_train(DPO_RECIPE, run, *common, PRECOMPUTE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert f"reference log-probabilities: read from {stored[0]}" in resumed.stderr
    assert "computing them" not in resumed.stderr and "reference model:" not in resumed.stderr

    want, got = _records(quick / "live"), _records(run)
    assert [(r["step"], r.get("split")) for r in got] == [(1, None), (2, None), (3, None), (3, "val")]
    assert [(r["step"], r.get("split")) for r in want] == [(r["step"], r.get("split")) for r in got]
    for a, b in zip(want, got, strict=True):
        for key in ("loss", *PREFERENCE_METRICS):
            assert b[key] == pytest.approx(a[key], rel=0, abs=1e-6), (a["step"], a.get("split"), key)


def test_a_stale_file_is_recomputed_and_replaced(quick, tmp_path, caplog):
    from magistral_cli.data.loader import prepare_dataset

    overrides = [
        *pair_overrides(quick),
        PRECOMPUTE,
        f"training.output_dir={tmp_path / 'run'}",
        "training.save_interval=0",
    ]
    recipe = load_recipe(DPO_RECIPE, overrides)
    dataset = prepare_dataset(recipe)
    identity = reference_identity(recipe, dataset)
    path = store_path(dataset, identity)
    # The right name, but computed for another dtype (as a file copied in from elsewhere would be).
    write_stored(path, torch.zeros(len(dataset)), {**identity, "dtype": "bf16"})
    assert read_stored(path, identity)[1] == f"{path} is stale: it was computed for another dtype"

    built = []

    class Watched(Trainer):
        def _build_reference(self):
            reference = super()._build_reference()
            built.append(weakref.ref(reference))
            return reference

    caplog.set_level(logging.INFO, logger="magistral_cli.engine")
    trainer = Watched(recipe)
    try:
        assert trainer.preference.reference is None
        gc.collect()
        assert len(built) == 1 and built[0]() is None, "the reference model is freed after the pass"
        values = trainer.preference.stored
    finally:
        trainer.close()
    assert f"computing them before training: {path} is stale" in caplog.text
    again, problem = read_stored(path, identity)
    assert problem is None and torch.equal(again, values)
    assert bool((values < 0).all()), "every answer's log-probability sum is negative"

    # Rewritten weights (same path): another identity, so another file; the old one is named.
    weights = sorted((quick / "quickstart" / "model").glob("*.safetensors"))[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        changed = reference_identity(recipe, dataset)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert store_path(dataset, changed) != path
    found, why = read_stored(store_path(dataset, changed), changed)
    assert found is None and path.name in why


def test_the_lora_base_is_precomputed_with_its_adapters_off(quick, tmp_path):
    recipe = load_recipe(
        DPO_RECIPE.with_name("tiny_cpu_dpo_lora.yaml"),
        [
            *pair_overrides(quick),
            PRECOMPUTE,
            "model.lora.init_lora_weights=false",  # random adapters: the policy is not its base
            f"training.output_dir={tmp_path / 'run'}",
            "training.save_interval=0",
        ],
    )
    trainer = Trainer(recipe)
    try:
        step = trainer.preference
        assert step.reference is None and step.precomputed and not step.uses_adapters_off
        mb = next(iter(trainer.data))
        stored = step.reference_logps({}, mb)
        inputs = model_inputs(mb, torch.device("cpu"))
        with torch.no_grad():
            policy = trainer.model(**inputs, sequence_logps=True)
            with adapters_off(trainer.model):
                base = trainer.model(**inputs, sequence_logps=True)
    finally:
        trainer.close()
    assert torch.equal(stored, base)
    assert (policy - base).abs().max() > 1e-3, "the adapters change the policy"


def test_a_reference_from_training_checkpoints_is_verified_first(quick, tmp_path):
    """training.dpo.ref_model (or training.load) naming a run's checkpoints: a damaged checkpoint is
    refused with its name, as the policy's own start is, never scored against."""
    import torch.distributed as dist

    from magistral_cli.errors import CheckFailed

    base = [*pair_overrides(quick), "training.save_interval=1"]
    first = Trainer(load_recipe(DPO_RECIPE, [*base, f"training.output_dir={tmp_path / 'first'}"]))
    try:
        first.train(max_steps=1)
    finally:
        first.close()
    step_1 = tmp_path / "first" / "checkpoints" / "step_1"
    victim = max(step_1.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 3)
        f.write(b"\x7f" * 4096)  # same size, other bytes: only the checksum sees it
    for ref in (step_1, tmp_path / "first"):
        overrides = [*base, f"training.output_dir={tmp_path / 'second'}", f"training.dpo.ref_model={ref}"]
        try:
            with pytest.raises(CheckFailed) as info:
                Trainer(load_recipe(DPO_RECIPE, overrides))
        finally:
            if dist.is_initialized():  # the failed constructor left its group behind
                dist.destroy_process_group()
        what = "training.dpo.ref_model" if ref == step_1 else "none is complete and intact"
        assert what in str(info.value) and victim.name in str(info.value)
