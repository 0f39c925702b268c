"""``training.skip_nonfinite_steps``: a run whose updates stopped ends with exit 1 and no checkpoint
of the unchanged model; an isolated skipped step holds its checkpoint until the next applied update.

The trainer runs in one process (a one-rank FSDP2 group on gloo); a step is made non-finite by
filling a real gradient with NaN after its backward (``Trainer.after_micro_batch``), so the
step's own finiteness read sees it as it would a diverged model's.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from magistral_cli.engine import checkpoint as ckpt
from magistral_cli.engine.nonfinite import SKIP_LIMIT
from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import CheckFailed

from .helpers import make_recipe, write_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


class NonFiniteAt(Trainer):
    """A trainer whose gradient is NaN at the steps in ``bad``."""

    bad: frozenset[int] = frozenset()

    def after_micro_batch(self, index: int, *, last: bool) -> None:
        if last and self.step + 1 in self.bad:
            with torch.no_grad():
                next(p for p in self.trainable if p.grad is not None).grad.fill_(float("nan"))


def _trainer(model_dir, run_dir, bad, **training) -> NonFiniteAt:
    recipe = make_recipe(model_dir, run_dir, skip_nonfinite_steps=True, lr_warmup_ratio=0.0, **training)
    trainer = NonFiniteAt(recipe)
    trainer.bad = frozenset(bad)
    return trainer


def _checkpoints(run_dir) -> list[str]:
    return sorted(p.name for _, p in ckpt.list_checkpoints(run_dir / "checkpoints"))


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_an_isolated_skip_holds_its_checkpoint_until_the_next_applied_update(model_dir, tmp_path, caplog):
    run = tmp_path / "run"
    trainer = _trainer(model_dir, run, {2}, train_iters=6, save_interval=2)
    try:
        with caplog.at_level(logging.WARNING, logger="magistral_cli.engine"):
            records = trainer.train()
    finally:
        trainer.close()
    assert [r.get("skipped", False) for r in records] == [False, True, False, False, False, False]
    assert "step 2 was skipped: its checkpoint waits for the next applied update" in caplog.text
    # step 2's checkpoint is written at step 3, the next applied update; then the cadence goes on
    assert _checkpoints(run) == ["step_3", "step_4", "step_6"]
    summary = _summary(run)
    assert (summary["exit_status"], summary["skipped_steps"], summary["last_applied_step"]) == (0, 1, 6)


def test_skip_limit_steps_in_a_row_stop_the_run_without_a_checkpoint_of_them(model_dir, tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(model_dir, run, range(2, 100), train_iters=30, save_interval=5)
    try:
        with pytest.raises(CheckFailed) as info:
            trainer.train()
    finally:
        trainer.close(1, str(info.value))
    message = str(info.value)
    assert f"steps 2-{SKIP_LIMIT + 1}: {SKIP_LIMIT} steps in a row had a non-finite loss" in message
    assert "the model has not changed since step 1 (its last applied update)" in message
    assert "no checkpoint was written after that step" in message
    assert _checkpoints(run) == []  # steps 5 and 10 fell inside the run of skipped steps
    summary = _summary(run)
    assert summary["exit_status"] == 1 and summary["error"] == message
    assert (summary["skipped_steps"], summary["last_applied_step"]) == (SKIP_LIMIT, 1)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, SKIP_LIMIT + 1))  # the stopping step: no line


def test_a_run_shorter_than_the_limit_that_skipped_every_step_exits_1(model_dir, tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(model_dir, run, range(1, 100), train_iters=4, save_interval=2)
    try:
        with pytest.raises(
            CheckFailed, match=r"steps 1-4: 4 steps in a row .* since step 0 \(the weights it started"
        ):
            trainer.train()
    finally:
        trainer.close(1)
    assert _checkpoints(run) == []
    assert (_summary(run)["skipped_steps"], _summary(run)["last_applied_step"]) == (4, 0)


def test_a_run_that_ends_in_a_few_skipped_steps_still_ends_with_its_checkpoint(model_dir, tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(model_dir, run, {5, 6}, train_iters=6, save_interval=2)
    try:
        trainer.train()
    finally:
        trainer.close()
    # Below the limit the run did not stop: the end of training writes its checkpoint as always.
    assert _checkpoints(run) == ["step_2", "step_4", "step_6"]
    summary = _summary(run)
    assert (summary["exit_status"], summary["skipped_steps"], summary["last_applied_step"]) == (0, 2, 4)
