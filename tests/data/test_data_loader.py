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
from magistral_cli.data.samplers import RandomBatchSampler
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
    return prepare_dataset(recipe_for(), show_progress=False)


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
    again = prepare_dataset(recipe_for(), show_progress=False)
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


def test_neat_packing_and_unknown_options_are_refused(recipe_for, encoded):
    with pytest.raises(UserError, match="neat_packing"):
        build_train_dataloader(recipe_for(basic={"neat_packing": True}), encoded, dp_rank=0, dp_size=1)
    with pytest.raises(UserError, match="collator_id"):
        build_train_dataloader(
            recipe_for(loader={"collate_param": {"collator_id": "qwen2vl"}}), encoded, dp_rank=0, dp_size=1
        )


# ----------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("total", [50, 96])
def test_infinite_order_equals_consecutive_finite_epochs(shuffle, rank, total):
    options = dict(batch_size=4, num_replicas=4, rank=rank, shuffle=shuffle, seed=17)
    finite = RandomBatchSampler(total, **options)
    expected = [batch for _ in range(4) for batch in finite]
    infinite = RandomBatchSampler(total, infinite=True, **options)
    assert list(islice(infinite, len(expected))) == expected
    assert finite.epoch == 3


def test_ranks_split_each_global_batch_and_drop_the_tail():
    ranks = [RandomBatchSampler(50, 4, num_replicas=3, rank=r, seed=5) for r in range(3)]
    epochs = [list(s) for s in ranks]
    assert all(len(e) == 50 // 12 for e in epochs)
    seen = [i for step in zip(*epochs, strict=True) for batch in step for i in batch]
    assert len(seen) == len(set(seen)) == 48
    # the same global batch as one rank with a 3x larger micro-batch
    single = list(RandomBatchSampler(50, 12, num_replicas=1, rank=0, seed=5))
    assert [sorted(sum(step, [])) for step in zip(*epochs, strict=True)] == [sorted(b) for b in single]
    padded = list(RandomBatchSampler(50, 4, num_replicas=3, rank=2, seed=5, drop_last=False))
    assert len(padded) == 5


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
