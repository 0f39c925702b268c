"""Training with context parallelism: 2 CPU processes (gloo) with Ulysses or Ring, against CP=1.

With CP = 2 on 2 processes the data-parallel degree is 1, so the CP runs see the global batch
that 1 process with CP = 1 sees: the losses must agree to float rounding, step by step, and a
run resumed from a CP checkpoint must continue exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from magistral_cli.engine.parallelize import ParallelDims
from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import UserError
from magistral_cli.ops.context_parallel import check_cp_model, cp_communication_count
from magistral_cli.runtime import spawn_ranks

from .helpers import make_recipe, write_tiny_model

pytestmark = pytest.mark.compat

STEPS = 4
CP_ULYSSES = ["parallel.ulysses_parallel_size=2"]
# Ring with the trainer's chunked loss: the chunks split each rank's local sequence again.
CP_RING = [
    "parallel.ring_attention_size=2",
    "features.enable_chunk_loss=true",
    "features.chunkloss_plan.chunk_size=16",
]
CP_HYBRID = [
    "parallel.ulysses_parallel_size=2",
    "parallel.ring_attention_size=2",
    "features.recompute=true",
    "features.recompute_plan.apply_modules=['model.language_model.layers.{*}']",
]


def _train(model_dir: Path, run_dir: Path, overrides: list[str], max_steps: int | None = None, **training):
    recipe = make_recipe(model_dir, run_dir, overrides, train_iters=STEPS, lr=5.0e-3, **training)
    trainer = Trainer(recipe)
    try:
        calls = cp_communication_count()
        records = trainer.train(max_steps=max_steps)
        info = {
            "dp": trainer.dims.dp,
            "cp": trainer.dims.cp,
            "step": trainer.step,
            "cp_communication": cp_communication_count() > calls,
        }
    finally:
        trainer.close()
    # "tokens": each step's (non-padding tokens, model FLOPs), both counted once per dp replica.
    tokens = [[r["tokens"], r["model_flops"]] for r in records]  # lists: the ranks return JSON
    return [[r[k] for r in records] for k in ("loss", "grad_norm")] + [tokens, info]


def _worker(rank: int, model_dir: str, out_dir: str) -> dict:
    model, out = Path(model_dir), Path(out_dir)
    results = {}
    # Ulysses, checkpointing every 2 steps.
    results["ulysses"] = _train(model, out / "ulysses", CP_ULYSSES, save_interval=2)
    # The same run stopped after step 2 (its checkpoint), then resumed by a new trainer.
    first = _train(model, out / "resumed", CP_ULYSSES, max_steps=2, save_interval=2, resume="auto")
    second = _train(model, out / "resumed", CP_ULYSSES, save_interval=2, resume="auto")
    results["resumed"] = [a + b for a, b in zip(first[:3], second[:3], strict=True)] + [second[3]]
    # Micro-batch 1 x accumulation 2: the same global batch, and every other micro-batch is
    # text-only (the vision tower then runs on a blank image, on every CP rank alike).
    results["ring"] = _train(model, out / "ring", CP_RING, micro_batch_size=1, gradient_accumulation_steps=2)
    results["refused"] = _refused_batches(model, out / "refused")
    return results


def _refused_batches(model_dir: Path, run_dir: Path) -> list[str]:
    """A left-padded and a 3-D (custom) attention mask under CP: errors before any forward."""
    trainer = Trainer(make_recipe(model_dir, run_dir, CP_ULYSSES))
    errors = []
    try:
        good = next(iter(trainer.data))
        left = dict(good, attention_mask=good["attention_mask"].flip(-1))
        left["attention_mask"][:, -1] = 1
        custom = dict(good, attention_mask=good["attention_mask"][:, None, :].expand(-1, 4, -1))
        for batch in (left, custom):
            try:
                trainer.forward_backward([batch])
                errors.append("")
            except UserError as exc:
                errors.append(str(exc))
        assert trainer.step == 0
    finally:
        trainer.close()
    return errors


def _dp_worker(rank: int, model_dir: str, out_dir: str) -> dict:
    # dp 2 x Ulysses 2, micro-batch 1 per dp rank: the global batch of 2 of the reference.
    result = {"dp_cp": _train(Path(model_dir), Path(out_dir) / "dp_cp", CP_ULYSSES, micro_batch_size=1)}
    # Hybrid: Ulysses 2 x Ring 2 over the 4 ranks, with the decoder layers recomputed in backward.
    result["hybrid"] = _train(Path(model_dir), Path(out_dir) / "hybrid", CP_HYBRID)
    return result


@pytest.mark.slow
def test_ulysses_and_ring_training_equal_cp1_and_resume_exactly(tmp_path):
    model_dir = tmp_path / "model"
    write_tiny_model(model_dir)
    ranks = spawn_ranks(_worker, 2, (str(model_dir), str(tmp_path)), threads=1)

    # The CP=1 reference: 1 process, the same global batch (micro-batch 2, dp 1).
    reference, ref_norms, ref_tokens, ref_info = _train(model_dir, tmp_path / "cp1", [])
    assert ref_info == {"dp": 1, "cp": 1, "step": STEPS, "cp_communication": False}
    assert len(reference) == STEPS
    assert reference[-1] < reference[0] - 0.01  # it trains: wrong gradients would show

    for name in ("ulysses", "ring", "resumed"):
        losses, norms, tokens, info = ranks[0][name]
        assert info == {"dp": 1, "cp": 2, "step": STEPS, "cp_communication": True}, name
        assert losses == pytest.approx(reference, rel=1e-5), name
        # The gradient norm over the dp x cp shards is the CP=1 one (so clipping is too).
        assert norms == pytest.approx(ref_norms, rel=1e-4), name
        # Tokens and model FLOPs are counted once per data-parallel replica, not once per CP rank.
        assert tokens == ref_tokens, name
        assert ranks[1][name][3] == info
    # Resuming from the step-2 CP checkpoint continues exactly (same process layout, same numbers).
    assert ranks[0]["resumed"][0] == ranks[0]["ulysses"][0]
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
    for errors in (ranks[0]["refused"], ranks[1]["refused"]):
        left, custom = errors
        assert "context parallelism" in left and "right padding" in left
        assert "context parallelism" in custom and "2D" in custom
    # Only rank 0 writes metrics, one record per step.
    lines = (tmp_path / "ulysses" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in lines] == ranks[0]["ulysses"][0]


# --------------------------------------------------------------------------- limits (no processes)


def test_cp_limits_are_errors_before_the_first_step(tmp_path):
    make_recipe(tmp_path / "model", tmp_path / "run", CP_ULYSSES)  # the plain CP recipe passes the schema

    # neat_packing with CP is refused by the recipe schema itself (tests/config/test_recipes.py).
    with pytest.raises(UserError, match="neat_packing with context parallelism"):
        make_recipe(
            tmp_path / "model",
            tmp_path / "run",
            [*CP_ULYSSES, "data.dataset_param.basic_parameters.neat_packing=true"],
        )

    # So is scored padding with CP (a rule of the recipe alone: the dry run stops on it).
    with pytest.raises(UserError, match="ignore_pad_token_for_loss"):
        make_recipe(
            tmp_path / "model",
            tmp_path / "run",
            [*CP_RING, "data.dataloader_param.collate_param.ignore_pad_token_for_loss=false"],
        )

    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    text = tiny_mistral3_config(vocab_size=64).text_config
    check_cp_model(text, 2)
    with pytest.raises(UserError, match="heads do not divide"):
        check_cp_model(text, text.num_attention_heads + 1)


def test_cp_degree_must_divide_the_world(tmp_path):
    recipe = make_recipe(tmp_path / "model", tmp_path / "run", ["parallel.ulysses_parallel_size=2"])
    dims = ParallelDims.from_recipe(recipe, 4)
    assert (dims.dp, dims.cp, dims.ulysses, dims.ring) == (2, 2, 2, 1)
    with pytest.raises(UserError, match="does not divide the world size 3"):
        ParallelDims.from_recipe(recipe, 3)


@pytest.mark.slow
def test_four_processes_data_parallel_times_ulysses_and_hybrid_equal_cp1(tmp_path):
    """dp 2 x CP 2: the data is split over dp only, the loss and token counts once per dp replica,
    the gradient norm over the dp x cp shards; and one dp rank's micro-batch is text-only while
    the other's has an image (the FSDP units still run in the same order everywhere). Hybrid
    (Ulysses 2 x Ring 2) with activation checkpointing trains like CP=1 too."""
    model_dir = tmp_path / "model"
    write_tiny_model(model_dir)
    ranks = spawn_ranks(_dp_worker, 4, (str(model_dir), str(tmp_path)), threads=1)
    reference, ref_norms, ref_tokens, _ = _train(model_dir, tmp_path / "cp1", [])
    for name, (dp, cp) in {"dp_cp": (2, 2), "hybrid": (1, 4)}.items():
        losses, norms, tokens, info = ranks[0][name]
        assert info == {"dp": dp, "cp": cp, "step": STEPS, "cp_communication": True}, name
        assert losses == pytest.approx(reference, rel=1e-5), name
        assert norms == pytest.approx(ref_norms, rel=1e-4), name
        assert tokens == ref_tokens, name
