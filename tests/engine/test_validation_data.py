"""``engine.data.build_val_data``: None without ``val_size``; synthetic validation samples of their own
stream, the training batches bit-identical with or without them; the real loader's split."""

from __future__ import annotations

import random
from itertools import islice

import numpy as np
import torch

from magistral_cli.config import validate_recipe
from magistral_cli.engine.data import build_data, build_val_data

VOCAB = 512


def _synthetic(val_size=0, **training):
    return validate_recipe(
        {
            "data": {"dataset_param": {"dataset_type": "synthetic", "basic_parameters": {"cutoff_len": 32,
                                                                                          "val_size": val_size}}},
            "training": {"train_iters": 4, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "seed": 3,
                         **training},
        }
    )  # fmt: skip


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_validation_without_val_size():
    assert build_val_data(_synthetic(), dp_rank=0, dp_size=1, vocab_size=VOCAB) is None


def test_synthetic_validation_samples():
    recipe = _synthetic(5)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    ranks = [build_val_data(recipe, dp_rank=r, dp_size=2, vocab_size=VOCAB) for r in (0, 1)]
    batches = [list(vb) for vb in ranks]
    after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]
    assert [len(vb) for vb in ranks] == [2, 2] and ranks[0].num_samples == 5
    assert [b["input_ids"].shape[0] for b in batches[0]] == [2, 1]
    assert (batches[1][1]["labels"] == -100).all()  # rank 1: 2 samples, then a filler
    real = [batches[0][0], batches[0][1], batches[1][0]]
    assert sum(b["input_ids"].shape[0] for b in real) == 5
    assert all((b["labels"] != -100).any() for b in real)
    assert all(_equal(a, b) for a, b in zip(batches[0], list(ranks[0]), strict=True))  # repeatable
    # Drawn apart from the training batches: no validation sample is a training sample.
    train = list(islice(build_data(recipe, dp_rank=0, dp_size=1, vocab_size=VOCAB), 20))
    train_rows = {tuple(row.tolist()) for b in train for row in b["input_ids"]}
    assert not train_rows & {tuple(row.tolist()) for b in real for row in b["input_ids"]}


def test_synthetic_training_batches_are_bit_identical_with_validation():
    plain = build_data(_synthetic(), dp_rank=1, dp_size=2, vocab_size=VOCAB)
    with_val = build_data(_synthetic(8), dp_rank=1, dp_size=2, vocab_size=VOCAB)
    val = build_val_data(_synthetic(8), dp_rank=1, dp_size=2, vocab_size=VOCAB)
    first = list(islice(iter(with_val), 3))
    list(val)  # an evaluation between training steps shares no state with the training source
    rest = list(islice(iter(with_val), 3))
    expected = list(islice(iter(plain), 6))
    assert all(_equal(a, b) for a, b in zip(first + rest, expected, strict=True))
    assert with_val.state_dict() == plain.state_dict()
