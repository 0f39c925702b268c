"""The loader contract the engine trains from: batches, a real Mistral3 forward, packing,
sampler order and exact resume."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
import torch

from magistral_cli.data import loader as loader_module
from magistral_cli.data.loader import TrainDataset, build_train_dataloader, prepare_dataset
from magistral_cli.data.pixtral import load_pixel_values
from magistral_cli.data.samplers import (
    SAMPLER_TYPES,
    BaseRandomBatchSampler,
    MagistralRandomBatchSampler,
    SeedRandomBatchSampler,
    build_sampler,
)
from magistral_cli.errors import UserError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loader_cache")


@pytest.fixture(scope="module")
def recipe_for(model_dir, broken_dataset, cache_dir, make_recipe):
    def build(**kwargs):
        # Small images keep the vision tower's forward quick on the CPU.
        return make_recipe(model_dir, broken_dataset, cache_dir, pre={"image_max_pixels": 50176}, **kwargs)

    return build


@pytest.fixture(scope="module")
def tiny_model():
    from magistral_cli.testing.tiny_model import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="module")
def encoded(recipe_for):
    return prepare_dataset(recipe_for())


def _image_blocks(ids: torch.Tensor, img=10, img_break=12, img_end=13) -> list[tuple[int, int]]:
    """(rows, cols) of every image block in the flattened ids, in order."""
    blocks, rows, cols = [], 0, 0
    for token in ids.flatten().tolist():
        if token == img:
            cols += 1
        elif token in (img_break, img_end):
            rows += 1
            if token == img_end:
                blocks.append((rows, cols // rows))
                rows, cols = 0, 0
    return blocks


def _check_batch(batch, micro_batch):
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape[0] == micro_batch
    for key in ("labels", "attention_mask", "position_ids"):
        assert batch[key].shape == batch["input_ids"].shape and batch[key].dtype == torch.long
    mask = batch["attention_mask"].bool()
    for row in mask:  # right padding only
        n = int(row.sum())
        assert row[:n].all() and not row[n:].any()
    assert (batch["labels"][~mask] == -100).all()
    blocks = _image_blocks(batch["input_ids"])
    if blocks:
        sizes = batch["image_sizes"]
        assert sizes.dtype == torch.long and batch["pixel_values"].dtype == torch.float32
        assert [(int(h) // 28, int(w) // 28) for h, w in sizes] == blocks
        assert batch["pixel_values"].shape[:2] == (len(blocks), 3)
        assert batch["pixel_values"].shape[2:] == (int(sizes[:, 0].max()), int(sizes[:, 1].max()))
    else:
        assert "pixel_values" not in batch and "image_sizes" not in batch


def test_prepare_dataset_is_idempotent(recipe_for, encoded):
    again = prepare_dataset(recipe_for())
    assert again.reused and again.path == encoded.path and len(again) == 40


def test_batches_run_through_a_real_mistral3(recipe_for, encoded, tiny_model):
    recipe = recipe_for(training={"micro_batch_size": 4})
    loader = build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1)
    model = tiny_model
    seen_images = 0
    for batch in islice(loader, 2):
        _check_batch(batch, 4)
        with torch.no_grad():
            out = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
                pixel_values=batch.get("pixel_values"),
                image_sizes=batch.get("image_sizes"),
                labels=batch["labels"],
            )
        assert torch.isfinite(out.loss)
        seen_images += len(batch.get("image_sizes", []))
    assert seen_images >= 2


def test_transformers_grid_runs_through_a_real_mistral3(
    model_dir, broken_dataset, cache_dir, make_recipe, tiny_model
):
    """image_grid: transformers (the seed's tokens): sides on the 14-px grid, floor(side / 28)
    [IMG] a side; the real vision tower + patch merger make exactly as many features. With the
    sizes of the 28-px grid (one more merged row for a 210-px side), transformers refuses it."""
    recipe = make_recipe(
        model_dir,
        broken_dataset,
        cache_dir,
        pre={"image_max_pixels": 50176, "image_grid": "transformers"},
        training={"micro_batch_size": 4},
        loader={"shuffle": False},
    )
    seed_grid = prepare_dataset(recipe)
    default = prepare_dataset(
        make_recipe(model_dir, broken_dataset, cache_dir, pre={"image_max_pixels": 50176})
    )
    assert seed_grid.path != default.path  # the grid is part of the fingerprint
    sizes = [tuple(int(v) for v in size) for i in range(len(seed_grid)) for size in seed_grid[i].image_sizes]
    assert any(h % 28 or w % 28 for h, w in sizes) and all(h % 14 == w % 14 == 0 for h, w in sizes)
    odd = None
    for batch in build_train_dataloader(recipe, seed_grid, dp_rank=0, dp_size=1):
        _check_batch(batch, 4)
        if "image_sizes" not in batch:
            continue
        with torch.no_grad():
            out = tiny_model(
                **{k: batch[k] for k in ("input_ids", "attention_mask", "labels")},
                pixel_values=batch["pixel_values"],
                image_sizes=batch["image_sizes"],
            )
        assert torch.isfinite(out.loss)
        if odd is None and ((batch["image_sizes"] % 28) != 0).any():
            odd = batch
    assert odd is not None
    rounded = -(-odd["image_sizes"] // 28) * 28
    pixels = torch.nn.functional.pad(odd["pixel_values"], (0, 28, 0, 28))
    with pytest.raises(ValueError, match="do not match"), torch.no_grad():
        tiny_model(input_ids=odd["input_ids"], pixel_values=pixels, image_sizes=rounded)


def test_pixel_values_follow_image_block_order(recipe_for, encoded):
    recipe = recipe_for(training={"micro_batch_size": 4}, loader={"shuffle": False})
    batches = list(islice(build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1), 3))
    settings = loader_module.build_train_dataset(recipe, encoded).settings
    paths = [p for i in range(12) for p in encoded[i].images]
    pixels = [img for b in batches for img in b.get("pixel_values", [])]
    sizes = [s for b in batches for s in b.get("image_sizes", [])]
    assert len(paths) == len(pixels) > 4
    for path, image, (h, w) in zip(paths, pixels, sizes, strict=True):
        expected = load_pixel_values(path, settings)
        assert expected.shape[1:] == (h, w)
        np.testing.assert_array_equal(image[:, :h, :w].numpy(), expected)
        assert not image[:, h:, :].any() and not image[:, :, w:].any()


def test_packing_restarts_positions_and_never_trains_across_samples(recipe_for, encoded, tiny_model):
    recipe = recipe_for(basic={"packing": True, "cutoff_len": 1024}, training={"micro_batch_size": 1})
    train = loader_module.build_train_dataset(recipe, encoded)
    assert len(train) < len(encoded)
    assert sorted(i for pack in train.packs for i in pack) == list(range(len(encoded)))
    loader = build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1)
    batch = next(iter(loader))
    _check_batch(batch, 1)
    positions, ids, labels = batch["position_ids"][0], batch["input_ids"][0], batch["labels"][0]
    starts = torch.nonzero(positions == 0).flatten().tolist()
    assert len(starts) >= 2 and all(ids[s] == 1 for s in starts)  # every packed sample starts with <s>
    assert all(labels[s] == -100 for s in starts)  # </s> of one sample never predicts the next <s>
    with torch.no_grad():
        out = tiny_model(
            **{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels")},
            pixel_values=batch.get("pixel_values"),
            image_sizes=batch.get("image_sizes"),
        )
    assert torch.isfinite(out.loss)


def test_unknown_options_are_refused(recipe_for, encoded):
    with pytest.raises(UserError, match="collator_id"):
        build_train_dataloader(
            recipe_for(loader={"collate_param": {"collator_id": "qwen2vl"}}), encoded, dp_rank=0, dp_size=1
        )


# ----------------------------------------------------------------------------- sampler


def _seed_expectation(perm: list[int], step: int, rank: int, batch: int, replicas: int) -> list[int]:
    """Step ``step`` of rank ``rank`` in the seed's split: every ``replicas``-th pick from the rank on."""
    base = step * batch * replicas + rank
    return [perm[base + j * replicas] for j in range(batch)]


@pytest.mark.parametrize("recipe_seed", [42, 7])
def test_base_sampler_first_epoch_is_torch_manual_seed_0(recipe_seed):
    """BaseRandomBatchSampler (the seed's default) shuffles epoch e with manual_seed(e): the
    recipe seed changes nothing. 50 samples, micro-batch 2, 4 ranks: the permutation covers
    50 // 2 * 2 = 50 indices, an epoch is the 6 whole global batches of 8."""
    torch.manual_seed(0)
    perm0 = torch.randperm(50).tolist()
    torch.manual_seed(1)
    perm1 = torch.randperm(50).tolist()
    for rank in range(4):
        sampler = BaseRandomBatchSampler(50, 2, num_replicas=4, rank=rank, seed=recipe_seed)
        epochs = list(sampler), list(sampler)
        assert epochs[0] == [_seed_expectation(perm0, k, rank, 2, 4) for k in range(6)]
        assert epochs[1] == [_seed_expectation(perm1, k, rank, 2, 4) for k in range(6)]


def test_seed_sampler_mixes_epoch_and_seed_with_seedsequence():
    def perm(epoch, seed):
        state = np.random.SeedSequence([epoch, seed]).generate_state(1, dtype=np.uint32)[0]
        torch.manual_seed(int(state))
        return torch.randperm(48).tolist()

    sampler = SeedRandomBatchSampler(48, 4, num_replicas=2, rank=1, seed=42)
    assert list(sampler) == [_seed_expectation(perm(0, 42), k, 1, 4, 2) for k in range(6)]
    assert list(sampler) == [_seed_expectation(perm(1, 42), k, 1, 4, 2) for k in range(6)]
    other = list(SeedRandomBatchSampler(48, 4, num_replicas=2, rank=1, seed=43))
    assert other != list(SeedRandomBatchSampler(48, 4, num_replicas=2, rank=1, seed=42))
    with pytest.raises(ValueError, match="seed >= 0"):
        SeedRandomBatchSampler(48, 4, seed=-1)


def test_magistral_sampler_shuffles_with_seed_plus_epoch():
    generator = torch.Generator().manual_seed(42 + 1)
    perm = torch.randperm(40, generator=generator)
    sampler = MagistralRandomBatchSampler(40, 4, num_replicas=2, rank=1, seed=42)
    list(sampler)
    assert list(sampler) == perm.view(5, 2, 4)[:, 1].tolist()


def test_seed_sampler_tail_goes_to_the_first_ranks():
    """7 samples, micro-batch 1, 3 ranks: an epoch is 6 samples (2 steps) but the permutation
    has 7, so rank 0 finds a third pick, perm[6]. The seed yields it as rank 0's next step,
    while ranks 1 and 2 start epoch 1; rank 0's consumed_samples is then one step ahead, so it
    skips its share of epoch 1's first step. Reproduced, across passes and when infinite."""
    perms = []
    for epoch in range(3):
        torch.manual_seed(epoch)
        perms.append(torch.randperm(7).tolist())
    p0, p1, p2 = perms
    expected = {
        0: [[p0[0]], [p0[3]], [p0[6]], [p1[3]], [p1[6]], [p2[3]], [p2[6]]],
        1: [[p0[1]], [p0[4]], [p1[1]], [p1[4]], [p2[1]], [p2[4]]],
        2: [[p0[2]], [p0[5]], [p1[2]], [p1[5]], [p2[2]], [p2[5]]],
    }
    for rank, want in expected.items():
        finite = BaseRandomBatchSampler(7, 1, num_replicas=3, rank=rank)
        passes = [batch for _ in range(3) for batch in finite]
        assert passes == want
        infinite = BaseRandomBatchSampler(7, 1, num_replicas=3, rank=rank, infinite=True)
        assert list(islice(infinite, len(want))) == want


@pytest.mark.parametrize("name", SAMPLER_TYPES)
@pytest.mark.parametrize(("total", "batch", "replicas"), [(7, 1, 3), (50, 2, 4), (51, 3, 2)])
def test_sampler_resumes_exactly_after_every_step(name, total, batch, replicas):
    """State after k steps, loaded into a fresh sampler, continues as the uninterrupted one,
    also right before the seed's extra tail step (where the seed's own resume loses it)."""
    for rank in range(replicas):
        options = dict(num_replicas=replicas, rank=rank, seed=17, infinite=True)
        want = list(islice(build_sampler(name, total, batch, **options), 24))
        for k in range(16):
            first = build_sampler(name, total, batch, **options)
            iterator = iter(first)
            list(islice(iterator, k))
            restored = build_sampler(name, total, batch, **options)
            restored.load_state_dict(first.state_dict())
            assert list(islice(iter(restored), 8)) == want[k : k + 8], (rank, k)


def test_sampler_state_of_another_order_is_refused():
    state = MagistralRandomBatchSampler(40, 4).state_dict()
    with pytest.raises(ValueError, match="sampler_type=MagistralRandomBatchSampler"):
        BaseRandomBatchSampler(40, 4).load_state_dict(state)
    legacy = {"epoch": 1, "position": 2, "seed": 0, "num_samples": 40}  # written before sampler_type existed
    sampler = MagistralRandomBatchSampler(40, 4)
    sampler.load_state_dict(legacy)
    assert (sampler.epoch, sampler.position) == (1, 2)
    with pytest.raises(ValueError, match="the dataset or seed changed"):
        SeedRandomBatchSampler(40, 4, seed=1).load_state_dict(SeedRandomBatchSampler(40, 4).state_dict())
    # BaseRandomBatchSampler ignores the seed, so another seed resumes the same order.
    BaseRandomBatchSampler(40, 4, seed=1).load_state_dict(BaseRandomBatchSampler(40, 4).state_dict())


@pytest.mark.parametrize("name", SAMPLER_TYPES)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize(("total", "batch"), [(50, 4), (96, 4), (50, 1)])
def test_infinite_order_equals_consecutive_finite_epochs(name, shuffle, rank, total, batch):
    options = dict(num_replicas=4, rank=rank, shuffle=shuffle, seed=17)
    finite = build_sampler(name, total, batch, **options)
    expected = [b for _ in range(4) for b in finite]
    infinite = build_sampler(name, total, batch, infinite=True, **options)
    assert list(islice(infinite, len(expected))) == expected


def test_ranks_split_each_global_batch_and_drop_the_tail():
    for cls in (MagistralRandomBatchSampler, BaseRandomBatchSampler):
        ranks = [cls(50, 4, num_replicas=3, rank=r, seed=5) for r in range(3)]
        epochs = [list(s) for s in ranks]
        assert all(len(e) == 50 // 12 for e in epochs)
        seen = [i for step in zip(*epochs, strict=True) for batch in step for i in batch]
        assert len(seen) == len(set(seen)) == 48
        # the same global batch as one rank with a 3x larger micro-batch
        single = list(cls(50, 12, num_replicas=1, rank=0, seed=5))
        if cls is MagistralRandomBatchSampler:  # (the seed's permutation length depends on the micro-batch)
            assert [sorted(sum(step, [])) for step in zip(*epochs, strict=True)] == [
                sorted(b) for b in single
            ]
    padded = list(MagistralRandomBatchSampler(50, 4, num_replicas=3, rank=2, seed=5, drop_last=False))
    assert len(padded) == 5
    with pytest.raises(ValueError, match="drop_last"):
        BaseRandomBatchSampler(50, 4, drop_last=False)


def test_loader_uses_the_named_sampler_and_refuses_others(recipe_for, encoded):
    """The seed's default sampler through the real loader: batch k holds encoded samples
    perm[4k : 4k + 4] of torch.manual_seed(0), whatever training.seed is."""
    recipe = recipe_for(training={"micro_batch_size": 4, "seed": 42})
    torch.manual_seed(0)
    perm = torch.randperm(len(encoded)).tolist()
    for k, batch in enumerate(islice(build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1), 3)):
        for row, index in enumerate(perm[4 * k : 4 * k + 4]):
            ids = encoded[index].input_ids
            assert batch["input_ids"][row, : len(ids)].tolist() == ids.tolist()
    with pytest.raises(
        UserError, match="BaseRandomBatchSampler, SeedRandomBatchSampler, MagistralRandomBatchSampler"
    ):
        build_train_dataloader(
            recipe_for(loader={"sampler_type": "RandomSampler"}), encoded, dp_rank=0, dp_size=1
        )
    with pytest.raises(UserError, match="drop_last"):
        build_train_dataloader(recipe_for(loader={"drop_last": False}), encoded, dp_rank=0, dp_size=1)
    magistral = recipe_for(loader={"sampler_type": "MagistralRandomBatchSampler", "drop_last": False})
    assert (
        len(build_train_dataloader(magistral, encoded, dp_rank=0, dp_size=3)) == 7
    )  # 40 / (2 x 3), rounded up


# ----------------------------------------------------------------------------- resume


class RecordingTrainDataset(TrainDataset):
    """The real dataset, also appending every index it reads to a file (works across workers)."""

    log_path = None

    def __getitem__(self, index):
        with open(self.log_path, "a") as handle:
            handle.write(f"{index}\n")
        return super().__getitem__(index)


def _reads(path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["mid_epoch", "epoch_boundary"])
def test_resume_exactly_without_replaying(workers, where, recipe_for, encoded, tmp_path, monkeypatch):
    monkeypatch.setattr(loader_module, "TrainDataset", RecordingTrainDataset)
    recipe = recipe_for(
        loader={"num_workers": workers, "infinite_sampler": True, "prefetch_factor": 1 if workers else None},
        training={"micro_batch_size": 2},
    )
    # 40 samples, 2 ranks x 2 per micro-batch: 10 batches per epoch on this rank.
    prefix, after = (3, 4) if where == "mid_epoch" else (8, 5)

    def build(log):
        RecordingTrainDataset.log_path = log
        return build_train_dataloader(recipe, encoded, dp_rank=1, dp_size=2)

    first = build(tmp_path / "first.log")
    iterator = iter(first)
    list(islice(iterator, prefix))
    state = first.state_dict()
    expected = list(islice(iterator, after))
    del iterator, first

    restored = build(tmp_path / "restored.log")
    restored.load_state_dict(state)
    actual = list(islice(iter(restored), after))
    for want, got in zip(expected, actual, strict=True):
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    # No replay: the restored loader reads what it yields plus at most its prefetch window.
    reads = _reads(tmp_path / "restored.log")
    window = workers * 1
    assert after * 2 <= reads <= (after + window) * 2
    assert reads < (prefix + after) * 2


def test_finite_epochs_roll_over_and_resume_after_the_last_batch(recipe_for, encoded):
    recipe = recipe_for(training={"micro_batch_size": 4})
    loader = build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1)
    epoch0 = [b["input_ids"] for b in loader]
    state = loader.state_dict()
    epoch1 = [b["input_ids"] for b in loader]
    assert len(epoch0) == len(epoch1) == 10
    assert any(not torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=True))  # reshuffled
    restored = build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1)
    restored.load_state_dict(state)
    again = [b["input_ids"] for b in restored]
    assert all(torch.equal(a, b) for a, b in zip(epoch1, again, strict=True)) and len(again) == 10


def test_too_few_samples_for_one_global_batch(recipe_for, encoded):
    recipe = recipe_for(training={"micro_batch_size": 16})
    with pytest.raises(UserError, match="do not fill one global batch of 48"):
        build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=3)


def test_an_entry_counts_its_images_for_the_engine(encoded, recipe_for):
    """The whole entry's image count decides whether text-only micro-batches may skip the vision tower."""
    from magistral_cli.engine.data import build_data, may_hold_images

    assert encoded.num_images == sum(len(encoded[i].images) for i in range(len(encoded))) > 0
    loader = build_data(recipe_for(), dp_rank=0, dp_size=1, vocab_size=512)
    assert may_hold_images(loader) is True
    assert may_hold_images(iter([])) is True  # a source that cannot say: the blank forward stays


def test_a_text_only_entry_has_no_images_for_the_engine(model_dir, make_recipe, tmp_path):
    import json

    from magistral_cli.engine.data import build_data, may_hold_images

    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ]
        }
        for i in range(4)
    ]
    dataset = tmp_path / "text.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    recipe = make_recipe(model_dir, dataset, tmp_path / "cache")
    assert prepare_dataset(recipe).num_images == 0
    assert may_hold_images(build_data(recipe, dp_rank=0, dp_size=1, vocab_size=512)) is False
