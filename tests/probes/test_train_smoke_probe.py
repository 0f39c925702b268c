"""train-smoke: the log checks on hand-made records, and real Trainer runs on CPU processes."""

from __future__ import annotations

import math
import tempfile

import pytest

from magistral_cli.probes.train_smoke import check_records, run_train_smoke_probe

pytestmark = pytest.mark.compat


def _good(nproc=2, steps=3):
    return {
        rank: [
            {"rank": rank, "step": s, "loss": 5.0 - s / 10, "grads_finite": True} for s in range(1, steps + 1)
        ]
        + [{"rank": rank, "done": True, "steps": steps}]
        for rank in range(nproc)
    }


def _errors(records, nproc=2, steps=3):
    return [c.get("error") for c in check_records(records, nproc, steps)]


def test_complete_records_pass():
    assert [c["result"] for c in check_records(_good(), 2, 3)] == ["PASS", "PASS"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: r[1].pop(1), "logged steps [1, 3]"),
        (lambda r: r[1].insert(0, r[1].pop(1)), "logged steps [2, 1, 3]"),
        (lambda r: r[1][0].update(loss=math.nan), "non-finite loss at steps [1]"),
        (lambda r: r[1][2].update(loss=None), "non-finite loss at steps [3]"),
        (lambda r: r[1][1].update(grads_finite=False), "non-finite gradients at steps [2]"),
        (lambda r: r[1].pop(), "no completion record"),
        (lambda r: r.pop(1), "logged steps [], expected 1..3"),
        (lambda r: r[1][0].update(rank=0), "lines from another rank"),
        (lambda r: r[1].append({"unparsable": "{trunc"}), "unparsable"),
        (lambda r: r[1][1].update(skipped=True), "the trainer skipped the update at steps [2]"),
        (lambda r: r[1].insert(1, {"rank": 1, "error": "CheckFailed: boom"}), "error: CheckFailed: boom"),
    ],
)
def test_each_broken_log_fails_its_rank(damage, message):
    records = _good()
    damage(records)
    errors = _errors(records)
    assert errors[0] is None
    assert message in errors[1]


def test_replayed_batches_repeat_the_first_step_and_poison_one():
    import torch

    from magistral_cli.engine.synthetic import SyntheticBatches
    from magistral_cli.probes.train_smoke_worker import ReplayedBatches

    source = SyntheticBatches(
        vocab_size=512, seq_len=64, micro_batch_size=1, grad_accumulation=2, dp_rank=0, dp_size=1, seed=1
    )
    expected = [next(source), next(source)]  # step 1's two micro-batches
    assert not torch.equal(expected[0]["input_ids"], expected[1]["input_ids"])
    data = ReplayedBatches(source, grad_accumulation=2, poison_step=3)
    batches = [next(data) for _ in range(6)]  # steps 1, 2, 3
    for i, batch in enumerate(batches):
        assert batch.keys() == expected[i % 2].keys()
        assert torch.equal(batch["input_ids"], expected[i % 2]["input_ids"])
        if "pixel_values" in batch:
            assert torch.isnan(batch["pixel_values"]).all() == (i >= 4)
    assert "pixel_values" in batches[4]  # the poisoned step has an image to poison
    assert data.state_dict() == {"micro_batches_yielded": 6}


@pytest.mark.slow
def test_two_cpu_ranks_train_thirty_steps():
    result = run_train_smoke_probe("cpu", "default", nproc=2, steps=30).to_json()
    assert result["result"] == "PASS", result
    ranks = [c for c in result["cases"] if c["name"].startswith("rank")]
    assert [c["steps_logged"] for c in ranks] == [30, 30]
    assert all(c["last_loss"] < c["first_loss"] for c in ranks)  # it trains
    # The trainer's logged loss is all-reduced over the data-parallel ranks: one value for all.
    assert ranks[0]["first_loss"] == ranks[1]["first_loss"]
    assert ranks[0]["last_loss"] == ranks[1]["last_loss"]


@pytest.mark.slow
def test_one_cpu_rank_trains_two_images_per_sample_and_leaves_no_files_behind(tmp_path, monkeypatch):
    # The temporary directory of this process and of the launcher it starts: the probe's own files,
    # and torchrun's per-rank log directories (which it makes there when not given --log-dir), must go.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    result = run_train_smoke_probe("cpu", "multi", nproc=1, steps=4).to_json()
    assert result["result"] == "PASS", result
    assert [c["name"] for c in result["cases"]] == ["processes", "rank 0"]
    assert result["cases"][1]["steps_logged"] == 4
    assert result["cases"][1]["last_loss"] < result["cases"][1]["first_loss"]
    # torch's compile cache lives there too, on purpose (one per user, shared by later runs)
    assert sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")) == []


@pytest.mark.slow
def test_a_nan_loss_is_reported_as_fail():
    result = run_train_smoke_probe("cpu", "multi", nproc=2, steps=3, poison_step=2).to_json()
    assert result["result"] == "FAIL"
    # The trainer refuses the non-finite update (skip_nonfinite_steps): step 3 is finite again.
    assert "non-finite loss at steps [2];" in result["reason"]
    for case in result["cases"][1:]:
        assert case["steps_logged"] == 3
        assert case["error"] == (
            "non-finite loss at steps [2]; non-finite gradients at steps [2]; "
            "the trainer skipped the update at steps [2]"
        )
