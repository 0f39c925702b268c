"""train-smoke: the log checks on hand-made records, and real FSDP2 runs on CPU processes."""

from __future__ import annotations

import math

import pytest

from magistral_cli.probes.train_smoke import check_records, run_train_smoke_probe


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
    ],
)
def test_each_broken_log_fails_its_rank(damage, message):
    records = _good()
    damage(records)
    errors = _errors(records)
    assert errors[0] is None
    assert message in errors[1]


@pytest.mark.slow
def test_two_cpu_ranks_train_thirty_steps():
    result = run_train_smoke_probe("cpu", "default", nproc=2, steps=30).to_json()
    assert result["result"] == "PASS", result
    ranks = [c for c in result["cases"] if c["name"].startswith("rank")]
    assert [c["steps_logged"] for c in ranks] == [30, 30]
    assert all(c["last_loss"] < c["first_loss"] for c in ranks)  # it trains


@pytest.mark.slow
def test_a_nan_loss_is_reported_as_fail():
    result = run_train_smoke_probe("cpu", "multi", nproc=2, steps=3, poison_step=2).to_json()
    assert result["result"] == "FAIL"
    assert "non-finite loss at steps [2, 3]" in result["reason"]
