"""Validation during training (``val_size``, ``training.eval_interval``), fp32 on the CPU.

The validation loss is checked against plain transformers on the same samples, the same on 1
and 2 data-parallel ranks, and the training losses of a run with evaluation equal, bit for bit,
those of a run without.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from magistral_cli.engine.trainer import Trainer
from magistral_cli.runtime import spawn_ranks

from .helpers import make_recipe, write_tiny_model

pytestmark = pytest.mark.slow

VAL = ["data.dataset_param.basic_parameters.val_size=5"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_evaluation_leaves_the_training_unchanged_and_is_logged(tiny, tmp_path):
    plain = Trainer(make_recipe(tiny, tmp_path / "plain", train_iters=4))
    try:
        without = [r["loss"] for r in plain.train()]
    finally:
        plain.close()
    run_dir = tmp_path / "val"
    trainer = Trainer(make_recipe(tiny, run_dir, [*VAL, "training.eval_interval=3"], train_iters=4))
    try:
        with_val = [r["loss"] for r in trainer.train()]
    finally:
        trainer.close()
    assert with_val == without  # bit-identical: evaluation restores the RNG and reads its own data
    lines = _lines(run_dir)
    train = [x for x in lines if "split" not in x]
    val = [x for x in lines if x.get("split") == "val"]
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    assert [x["step"] for x in val] == [3, 4]  # every eval_interval steps and at the end
    assert all(x["samples"] == 5 and x["targets"] > 0 for x in val)
    assert val[0]["loss"] != val[1]["loss"]  # the model trained in between


class JumpingClock:
    """``time.perf_counter`` plus an offset that a slow evaluation or save moves forward.

    The step times are then checked against a jump no real tiny step comes near, instead of a
    wall-clock bound that a loaded machine could cross.
    """

    JUMP_S = 1000.0

    def __init__(self):
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset


class SlowEvaluation(Trainer):
    """An evaluation and a save that each take ``JumpingClock.JUMP_S`` on the step log's clock."""

    clock: JumpingClock

    def evaluate(self):
        self.clock.offset += JumpingClock.JUMP_S
        return super().evaluate()

    def save(self):
        self.clock.offset += JumpingClock.JUMP_S
        return super().save()


def test_step_times_leave_out_evaluations_and_checkpoint_writes(tiny, tmp_path, monkeypatch):
    from magistral_cli.engine import step_log

    clock = JumpingClock()
    monkeypatch.setattr(step_log, "time", clock)
    run_dir = tmp_path / "slow"
    overrides = [*VAL, "training.eval_interval=2", "training.save_interval=2"]
    trainer = SlowEvaluation(make_recipe(tiny, run_dir, overrides, train_iters=4))
    trainer.clock = clock
    try:
        trainer.train()
    finally:
        trainer.close()
    train = [x for x in _lines(run_dir) if "split" not in x]
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    # Steps 2 and 4 end with an evaluation and a save (a jump each) on the step log's clock:
    # were either counted, that interval's mean step time would be at least a jump.
    assert clock.offset >= 4 * JumpingClock.JUMP_S
    assert all(x["step_time_ms"] < JumpingClock.JUMP_S * 1000 / 4 for x in train), [
        x["step_time_ms"] for x in train
    ]
    assert (run_dir / "checkpoints" / "step_2").is_dir()


def _reference_loss(model_dir, batches) -> float:
    """Plain transformers: the summed token losses of the validation samples over their targets."""
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.model_config import read_model_config

    model = Mistral3ForConditionalGeneration.from_pretrained(
        str(model_dir), config=read_model_config(model_dir), dtype=torch.float32
    ).eval()
    total, targets = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            count = int((mb["labels"][:, 1:] != -100).sum())
            if not count:
                continue
            inputs = {k: v for k, v in mb.items() if k != "position_ids"}
            total += float(model(**inputs).loss) * count
            targets += count
    return total / targets


def test_the_validation_loss_is_plain_transformers_over_the_split(tiny, tmp_path):
    trainer = Trainer(make_recipe(tiny, tmp_path / "run", VAL, train_iters=1))
    try:
        record = trainer.evaluate()
        batches = list(trainer.val_data)
    finally:
        trainer.close()
    assert record["step"] == 0 and record["split"] == "val" and record["samples"] == 5
    assert record["loss"] == pytest.approx(_reference_loss(tiny, batches), rel=1e-5)


def _rank_eval(rank: int, model_dir: str, run_dir: str) -> float:
    from pathlib import Path

    trainer = Trainer(make_recipe(Path(model_dir), Path(run_dir), VAL, train_iters=1))
    try:
        return trainer.evaluate()["loss"]
    finally:
        trainer.close()


def test_two_data_parallel_ranks_give_the_one_process_loss(tiny, tmp_path):
    one = Trainer(make_recipe(tiny, tmp_path / "one", VAL, train_iters=1))
    try:
        expected = one.evaluate()["loss"]
    finally:
        one.close()
    # 5 samples over 2 ranks: the shares differ, so one rank runs a filler micro-batch too.
    losses = spawn_ranks(_rank_eval, 2, (str(tiny), str(tmp_path / "two")), timeout_s=600)
    assert losses[0] == losses[1] == pytest.approx(expected, rel=1e-5)
