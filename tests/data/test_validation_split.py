"""The validation split (``val_size``) and the validation micro-batches (``build_val_batches``).

The split is decided on the encoded dataset before any shuffling; the training loader reads only
the training samples (and is what it was without ``val_size``); every validation sample is read
exactly once over the data-parallel ranks, and every rank yields the same number of micro-batches.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from magistral_cli.data.collator import PixtralCollator
from magistral_cli.data.loader import (
    TrainDataset,
    ValBatches,
    build_train_dataloader,
    build_train_dataset,
    build_val_batches,
    prepare_dataset,
    split_indices,
)
from magistral_cli.data.pipeline import image_settings_of
from magistral_cli.data.samplers import build_sampler
from magistral_cli.errors import UserError

from .helpers import write_recipe

VAL_SIZE = "data.dataset_param.basic_parameters.val_size"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("val_cache")


@pytest.fixture(scope="module")
def recipe_for(model_dir, broken_dataset, cache_dir, make_recipe):
    def build(val_size=0, *, training=None, loader=None, **basic):
        return make_recipe(
            model_dir,
            broken_dataset,
            cache_dir,
            pre={"image_max_pixels": 50176},
            basic={"val_size": val_size, **basic},
            training=training or {},
            loader=loader or {},
        )

    return build


@pytest.fixture(scope="module")
def encoded(recipe_for):
    return prepare_dataset(recipe_for())  # 40 samples


def _rows(batch) -> list[tuple[int, ...]]:
    """The unpadded input ids of every row of a micro-batch."""
    out = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
        out.append(tuple(ids[mask.bool()].tolist()))
    return out


def _sample_ids(encoded, indices) -> Counter:
    return Counter(tuple(int(t) for t in encoded[i].input_ids) for i in indices)


def _rng_states():
    return (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())


def _same_rng(before, after) -> bool:
    return torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]


# ----------------------------------------------------------------------------- split_indices


def test_split_is_llamafactorys_seeded_shuffle():
    train, val = split_indices(40, 0.1, seed=7)
    expected = sorted(np.random.default_rng(7).permutation(40)[:4].tolist())
    assert val == expected and len(train) == 36
    assert train == sorted(set(range(40)) - set(val))  # disjoint and complete
    assert val == sorted(val) and train == sorted(train)
    assert split_indices(40, 0.1, seed=7) == (train, val)  # deterministic
    assert split_indices(40, 0.1, seed=8)[1] != val  # seeded by training.seed
    assert all(isinstance(i, int) for i in train + val)


@pytest.mark.parametrize(
    ("n", "val_size", "k"),
    [(40, 0.1, 4), (40, 0.5, 20), (40, 0.01, 1), (40, 0.02, 1), (1000, 0.05, 50), (40, 7, 7), (40, 39, 39),
     (3, 0.34, 1), (40, 0.9, 36)],
)  # fmt: skip
def test_split_sizes(n, val_size, k):
    train, val = split_indices(n, val_size, seed=0)
    assert len(val) == k and len(train) == n - k
    assert sorted(train + val) == list(range(n))


def test_no_validation_keeps_everything():
    assert split_indices(12, 0, seed=3) == (list(range(12)), [])
    assert split_indices(12, 0.0, seed=3) == (list(range(12)), [])


def test_a_count_is_the_same_split_as_its_fraction():
    """LLaMA-Factory's reading: 0.25 of 40 and a count of 10 pick the same samples for one seed."""
    assert split_indices(40, 0.25, seed=5) == split_indices(40, 10, seed=5)


@pytest.mark.parametrize(
    ("n", "val_size", "message"),
    [
        (10, 10, "takes 10 of the 10 encoded samples"),
        (10, 12, "takes 12 of the 10 encoded samples"),
        (10, 0.96, "takes 10 of the 10 encoded samples"),
        (1, 0.5, "takes 1 of the 1 encoded samples"),
        (0, 0.5, "takes 1 of the 0 encoded samples"),
    ],
)
def test_a_split_without_training_samples_is_refused(n, val_size, message):
    with pytest.raises(UserError) as err:
        split_indices(n, val_size, seed=0)
    text = str(err.value)
    assert message in text and VAL_SIZE in text and "no training sample" in text and "lower" in text


def test_bad_val_size_values_are_refused():
    for bad in (-1, -0.5, 1.5):
        with pytest.raises(UserError, match="val_size"):
            split_indices(10, bad, seed=0)


# ----------------------------------------------------------------------------- the training loader


def test_without_val_size_the_training_loader_is_unchanged(recipe_for, encoded):
    """Same sampler input length, same samples, same order as the loader built over the whole dataset."""
    recipe = recipe_for(training={"micro_batch_size": 4})
    loader = build_train_dataloader(recipe, encoded, dp_rank=1, dp_size=2)
    assert len(loader.dataset) == len(encoded) == 40
    assert loader.dataset.indices is None and loader.dataset.packs is None
    dl = recipe.data.dataloader_param
    sampler = build_sampler(dl.sampler_type, 40, batch_size=4, num_replicas=2, rank=1, shuffle=dl.shuffle,
                            seed=recipe.training.seed, drop_last=dl.drop_last, infinite=False)  # fmt: skip
    whole = TrainDataset(encoded, image_settings_of(encoded))
    collate = PixtralCollator(int(encoded.meta["pad_token_id"]))
    expected = [collate([whole[i] for i in batch]) for batch in sampler]
    got = list(loader)
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    packed = build_train_dataset(recipe_for(packing=True), encoded)
    assert sorted(i for pack in packed.packs for i in pack) == list(range(40))


def test_with_val_size_training_reads_only_the_training_samples(recipe_for, encoded):
    recipe = recipe_for(0.1, training={"micro_batch_size": 2})
    train_idx, val_idx = split_indices(40, 0.1, seed=recipe.training.seed)
    dataset = build_train_dataset(recipe, encoded)
    assert len(dataset) == 36 and dataset.indices == train_idx
    seen = Counter(row for batch in build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1)
                   for row in _rows(batch))  # fmt: skip
    assert seen == _sample_ids(encoded, train_idx)  # 36 samples, 18 micro-batches, none held out
    # (Rows are compared by token ids: two samples with the same text and image size look alike.)
    assert seen + _sample_ids(encoded, val_idx) == _sample_ids(encoded, range(40))
    # Packing plans over the training samples only.
    packed = build_train_dataset(recipe_for(0.1, packing=True), encoded)
    members = [i for pack in packed.packs for i in pack]
    assert sorted(members) == train_idx and all(pack == sorted(pack) for pack in packed.packs)


# ----------------------------------------------------------------------------- the validation batches


def test_validation_batches_over_two_ranks(recipe_for, encoded):
    """5 validation samples, micro-batch 2, 2 ranks: rank 0 reads 3 (2 micro-batches), rank 1 reads 2
    (1 micro-batch) plus a filler without targets; each sample once over both ranks."""
    recipe = recipe_for(5, training={"micro_batch_size": 2})
    _, val_idx = split_indices(40, 5, seed=recipe.training.seed)
    before = _rng_states()
    ranks = [build_val_batches(recipe, encoded, dp_rank=r, dp_size=2) for r in (0, 1)]
    batches = [list(vb) for vb in ranks]
    assert _same_rng(before, _rng_states())  # the global RNGs are untouched
    assert [len(vb) for vb in ranks] == [len(b) for b in batches] == [2, 2]
    assert [vb.num_samples for vb in ranks] == [5, 5]
    assert [vb.num_fillers for vb in ranks] == [0, 1]
    real = [batches[0][0], batches[0][1], batches[1][0]]
    assert [b["input_ids"].shape[0] for b in real] == [2, 1, 2]  # the last short micro-batch is kept
    assert Counter(row for b in real for row in _rows(b)) == _sample_ids(encoded, val_idx)
    assert all((b["labels"] != -100).any() for b in real)
    filler = batches[1][1]
    assert (filler["labels"] == -100).all()
    assert filler.keys() == real[2].keys()
    assert all(torch.equal(filler[k], real[2][k]) for k in filler if k != "labels")
    # The same collator and images as training: the micro-batch equals the collated training items.
    whole = TrainDataset(encoded, image_settings_of(encoded))
    expected = PixtralCollator(int(encoded.meta["pad_token_id"]))([whole[i] for i in val_idx[1::2][:2]])
    assert all(torch.equal(expected[k], batches[1][0][k]) for k in expected)
    # Repeatable: every evaluation iterates from the start and gets the same micro-batches.
    again = list(ranks[1])
    assert all(torch.equal(a[k], b[k]) for a, b in zip(again, batches[1], strict=True) for k in a)


def test_a_rank_without_validation_samples_yields_fillers_only(recipe_for, encoded):
    recipe = recipe_for(1, training={"micro_batch_size": 2})
    first, second = (build_val_batches(recipe, encoded, dp_rank=r, dp_size=2) for r in (0, 1))
    assert len(first) == len(second) == 1 and second.num_fillers == 1
    (real,), (filler,) = list(first), list(second)
    assert (real["labels"] != -100).any() and (filler["labels"] == -100).all()
    assert torch.equal(real["input_ids"], filler["input_ids"])  # a copy of the split's first micro-batch


@pytest.mark.parametrize("dp_size", [1, 3, 4])
def test_every_sample_once_and_equal_lengths(recipe_for, encoded, dp_size):
    recipe = recipe_for(0.25, training={"micro_batch_size": 3})  # 10 validation samples
    _, val_idx = split_indices(40, 0.25, seed=recipe.training.seed)
    ranks = [build_val_batches(recipe, encoded, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    assert len({len(vb) for vb in ranks}) == 1
    rows, targets = Counter(), 0
    for vb in ranks:
        for batch in vb:
            has_targets = bool((batch["labels"] != -100).any())
            targets += has_targets
            if has_targets:
                rows.update(_rows(batch))
    assert rows == _sample_ids(encoded, val_idx)
    assert sum(len(vb) - vb.num_fillers for vb in ranks) == targets


def test_loader_workers_give_the_same_batches(recipe_for, encoded):
    recipe = recipe_for(4, training={"micro_batch_size": 2})
    plain = list(build_val_batches(recipe, encoded, dp_rank=0, dp_size=1))
    with_workers = recipe_for(4, training={"micro_batch_size": 2}, loader={"num_workers": 2})
    before = _rng_states()
    got = list(build_val_batches(with_workers, encoded, dp_rank=0, dp_size=1))
    assert _same_rng(before, _rng_states())
    assert len(got) == len(plain) == 2
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, plain, strict=True) for k in a)


def test_validation_batches_need_a_split(recipe_for, encoded):
    with pytest.raises(UserError, match="val_size"):
        build_val_batches(recipe_for(), encoded, dp_rank=0, dp_size=1)
    with pytest.raises(UserError, match="no training sample"):
        build_val_batches(recipe_for(40), encoded, dp_rank=0, dp_size=1)
    with pytest.raises(UserError, match="no training sample"):
        build_train_dataloader(recipe_for(0.99), encoded, dp_rank=0, dp_size=1)


def test_val_batches_is_a_plain_iterable():
    items = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([-100, 2, 3]), "images": []}
             for _ in range(3)]  # fmt: skip
    from magistral_cli.engine.synthetic import collate

    vb = ValBatches.over(items, [0, 1, 2], collate, micro_batch_size=2, dp_rank=1, dp_size=2)
    assert len(vb) == 1 and vb.num_samples == 3 and vb.num_fillers == 0
    with pytest.raises(ValueError):
        ValBatches.over(items, [], collate, micro_batch_size=2, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError):
        ValBatches.over(items, [0], collate, micro_batch_size=2, dp_rank=2, dp_size=2)


# ----------------------------------------------------------------------------- the preprocess report


def test_preprocess_prints_the_split(tmp_path, model_dir, broken_dataset):
    from magistral_cli.cli.main import app

    recipe = write_recipe(
        tmp_path / "r.yaml", model_dir, broken_dataset, tmp_path / "cache", basic={"val_size": 0.1}
    )
    runner = CliRunner()
    result = runner.invoke(app, ["preprocess", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["report"]
    assert report["kept"] == 40 and report["split"] == {"train": 36, "val": 4, "val_size": 0.1, "seed": 42}
    assert "train / validation" in result.stderr and "36 / 4" in result.stderr
    # The split is not part of the cache entry: without val_size the same entry, no split shown.
    plain = runner.invoke(app, ["preprocess", str(recipe), "--json", f"{VAL_SIZE}=0"])
    payload = json.loads(plain.stdout)
    assert payload["reused"] is True and "split" not in payload["report"]
    assert "train / validation" not in plain.stderr
    # A split that leaves nothing to train on is refused here already.
    bad = runner.invoke(app, ["preprocess", str(recipe), f"{VAL_SIZE}=40"])
    assert bad.exit_code == 2 and "no training sample" in bad.output


def test_engine_build_val_data_reuses_the_training_cache_entry(recipe_for, encoded, monkeypatch):
    """Without ``dataset`` it looks the cache entry up again, never encoding a second time (not
    even with overwrite_cache, which is for the training loader's lookup)."""
    from magistral_cli.data import pipeline
    from magistral_cli.engine.data import build_val_data

    def no_encoding(*args, **kwargs):
        raise AssertionError("encoded again")

    monkeypatch.setattr(pipeline, "read_rows", no_encoding)
    recipe = recipe_for(4, overwrite_cache=True, training={"micro_batch_size": 2})
    val = build_val_data(recipe, dp_rank=0, dp_size=1, vocab_size=131072)
    assert isinstance(val, ValBatches) and val.num_samples == 4 and len(val) == 2
    assert val.items.encoded.path == encoded.path
    given = build_val_data(recipe, dp_rank=0, dp_size=1, vocab_size=131072, dataset=encoded)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(val, given, strict=True) for k in a)
    assert build_val_data(recipe_for(), dp_rank=0, dp_size=1, vocab_size=131072) is None
