"""The padding estimate of `magistral train --dry-run`: the report's length histogram, the packs,
and the expected real-token fraction of padded micro-batches."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import numpy as np
import pytest

from magistral_cli.data.packing import (
    LENGTH_BINS,
    estimate_padding,
    expected_padding,
    histogram_lengths,
    length_histogram,
    pack_lengths,
    plan_packs,
)
from magistral_cli.data.pipeline import run_preprocess


@pytest.fixture(scope="module")
def encoded(model_dir, broken_dataset, make_recipe, tmp_path_factory):
    """The fixture dataset encoded at cutoff_len 1024: 40 kept samples of real lengths."""
    recipe = make_recipe(model_dir, broken_dataset, tmp_path_factory.mktemp("cache"))
    return run_preprocess(recipe)


def test_the_report_holds_a_fixed_size_histogram_of_the_kept_lengths(encoded):
    report, lengths = encoded.report, encoded.dataset.lengths
    histogram = report["length_histogram"]
    assert histogram["bin_width"] == 1024 // LENGTH_BINS
    assert len(histogram["counts"]) == len(histogram["tokens"]) == LENGTH_BINS
    assert sum(histogram["counts"]) == report["kept"] == len(lengths)
    assert sum(histogram["tokens"]) == report["tokens"] == int(lengths.sum())
    # each sample in its bin (lengths in (i * width, (i + 1) * width])
    width = histogram["bin_width"]
    expected = np.bincount((lengths - 1) // width, minlength=LENGTH_BINS)
    assert histogram["counts"] == expected.tolist()
    on_disk = json.loads((encoded.dataset.path / "report.json").read_text())
    assert on_disk["length_histogram"] == histogram


def test_the_histogram_does_not_grow_with_the_dataset():
    lengths = np.random.default_rng(0).integers(1, 4097, 1_000_000)
    histogram = length_histogram(lengths, 4096)
    assert len(histogram["counts"]) == LENGTH_BINS and len(json.dumps(histogram)) < 8192
    assert sum(histogram["counts"]) == 1_000_000 and sum(histogram["tokens"]) == int(lengths.sum())


def test_histogram_lengths_keep_each_bins_count_and_tokens():
    histogram = {"bin_width": 4, "counts": [3, 0, 2], "tokens": [7, 0, 21]}
    # bin 0: 7 tokens over 3 samples -> 2, 2, 3; bin 2 (9..12): 21 over 2 -> 10, 11
    assert histogram_lengths(histogram).tolist() == [2, 2, 3, 10, 11]
    with pytest.raises(ValueError, match="inside their bin"):
        histogram_lengths({"bin_width": 4, "counts": [1], "tokens": [5]})


def test_a_small_histogram_by_hand():
    """Lengths 3, 3, 7, 7 (a histogram of 4-token bins), micro-batch 2, cutoff_len 8.

    No packing: of the 6 pairs one is (3, 3), so the longest row has 3 tokens with probability
    1/6 and 7 otherwise: 2 x (3/6 + 35/6) = 38/3 tokens padded for 10 real, 15/19 real.
    Packing: the greedy knapsack makes [7], [7], [3, 3]; every pair of the 3 packs holds a 7:
    2 x 7 = 14 padded for 2 x 20/3 real, 20/21; one full micro-batch an epoch.
    """
    estimate = estimate_padding(8, 2, histogram={"bin_width": 4, "counts": [2, 2], "tokens": [6, 14]})
    none, packing = estimate["none"], estimate["packing"]
    assert (none.rows, none.micro_batches) == (4, 2)
    assert none.padded_tokens == pytest.approx(38 / 3) and none.real_tokens == 10
    assert none.real_fraction == pytest.approx(float(Fraction(15, 19)))
    assert (packing.rows, packing.micro_batches) == (3, 1)
    assert packing.padded_tokens == pytest.approx(14) and packing.real_tokens == pytest.approx(40 / 3)
    assert packing.real_fraction == pytest.approx(float(Fraction(20, 21)))


def test_fewer_rows_than_a_micro_batch_give_no_estimate():
    assert (
        expected_padding([5, 6], 4).micro_batches == 0 and expected_padding([5, 6], 4).real_fraction is None
    )


@pytest.mark.parametrize("capacity", [1024, 2048, 4096])
def test_packs_are_plan_packs_packs_on_the_real_lengths(encoded, capacity):
    lengths = encoded.dataset.lengths
    planned = sorted(int(lengths[pack].sum()) for pack in map(np.asarray, plan_packs(lengths, capacity)))
    assert pack_lengths(lengths, capacity).tolist() == planned


def test_packs_are_plan_packs_packs_on_many_random_lengths():
    rng = np.random.default_rng(1)
    for _ in range(200):
        capacity = int(rng.integers(8, 256))
        lengths = rng.choice([1, 2, 3, 5, capacity // 3, capacity // 2, capacity], int(rng.integers(1, 120)))
        lengths = np.maximum(lengths, 1)
        planned = sorted(int(lengths[pack].sum()) for pack in map(np.asarray, plan_packs(lengths, capacity)))
        assert pack_lengths(lengths, capacity).tolist() == planned


@pytest.mark.parametrize("micro_batch", [2, 3])
def test_the_expectation_is_the_mean_over_every_micro_batch(encoded, micro_batch):
    """Every set of micro_batch rows is equally likely in a random order: average over all of them."""
    lengths = encoded.dataset.lengths
    for rows in (lengths, pack_lengths(lengths, 2048)):
        groups = list(itertools.combinations(rows.tolist(), micro_batch))
        padded = micro_batch * sum(max(g) for g in groups) / len(groups)
        estimate = expected_padding(rows, micro_batch)
        assert estimate.padded_tokens == pytest.approx(padded, rel=1e-9)
        assert estimate.real_fraction == pytest.approx(micro_batch * rows.mean() / padded, rel=1e-9)
        assert estimate.micro_batches == len(rows) // micro_batch


def test_the_histogram_estimate_is_close_to_the_exact_one(encoded):
    exact = estimate_padding(1024, 2, lengths=encoded.dataset.lengths)
    binned = estimate_padding(1024, 2, histogram=encoded.report["length_histogram"])
    for mode in ("none", "packing"):
        assert binned[mode].real_fraction == pytest.approx(exact[mode].real_fraction, abs=0.01)
        assert binned[mode].rows == pytest.approx(exact[mode].rows, abs=1)
