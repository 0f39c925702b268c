"""Synthetic micro-batches: the loader's layout, one or two images per sample, the split rule."""

from __future__ import annotations

import pytest
import torch

from magistral_cli.engine.synthetic import IMAGE_TOKEN_ID, PAD_TOKEN_ID, SyntheticBatches, collate


def _batches(**options) -> SyntheticBatches:
    settings = dict(
        vocab_size=512, seq_len=64, micro_batch_size=2, grad_accumulation=1, dp_rank=0, dp_size=1, seed=5
    )
    settings.update(options)
    return SyntheticBatches(**settings)


def _image_runs(ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of image tokens in one row, in order."""
    runs, current = [], 0
    for is_image in (ids == IMAGE_TOKEN_ID).tolist():
        if is_image:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs + ([current] if current else [])


@pytest.mark.parametrize("images", [1, 2])
def test_each_image_has_its_tokens_in_order_and_no_image_token_trains(images):
    data = _batches(image_every=1, images_per_sample=images)
    for _ in range(5):
        batch = next(data)
        sizes = batch["image_sizes"].tolist()
        assert batch["pixel_values"].shape[0] == len(sizes) == 2 * images
        tokens = [(h // 28) * (w // 28) for h, w in sizes]  # one token per 28 x 28 pixels
        runs = [run for row in batch["input_ids"] for run in _image_runs(row)]
        assert runs == tokens
        assert not ((batch["input_ids"] == IMAGE_TOKEN_ID) & (batch["labels"] != -100)).any()
        assert (batch["labels"][:, 1:] != -100).sum(dim=1).min() > 0  # every sample trains something
        padding = batch["attention_mask"] == 0
        assert (batch["input_ids"][padding] == PAD_TOKEN_ID).all()
        assert (batch["labels"][padding] == -100).all()


def test_image_every_and_no_images():
    sample_images = [len(s["images"]) for s in (_batches(image_every=2).sample(i) for i in range(4))]
    assert sample_images == [1, 0, 1, 0]
    batch = next(_batches(image_every=0))
    assert "pixel_values" not in batch and "image_sizes" not in batch
    assert not (batch["input_ids"] == IMAGE_TOKEN_ID).any()


def test_two_ranks_see_what_one_rank_with_twice_the_micro_batch_sees():
    whole = next(_batches(micro_batch_size=2, image_every=1, images_per_sample=2))
    halves = [
        next(_batches(micro_batch_size=1, dp_rank=r, dp_size=2, image_every=1, images_per_sample=2))
        for r in (0, 1)
    ]
    for row, half in enumerate(halves):
        length = int(half["attention_mask"].sum())
        assert torch.equal(whole["input_ids"][row, :length], half["input_ids"][0, :length])
        assert torch.equal(whole["labels"][row, :length], half["labels"][0, :length])
    assert torch.equal(whole["image_sizes"], torch.cat([h["image_sizes"] for h in halves]))


def test_collate_takes_a_single_image_key_as_well():
    image = torch.randn(3, 28, 56)
    ids = torch.tensor([1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 20])
    batch = collate(
        [
            {"input_ids": ids, "labels": ids, "image": image},
            {"input_ids": ids[:1], "labels": ids[:1], "image": None},
        ]
    )
    assert batch["image_sizes"].tolist() == [[28, 56]]
    assert torch.equal(batch["pixel_values"][0], image)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]


def test_too_short_for_the_images_is_refused():
    with pytest.raises(ValueError, match="cutoff_len >= 32"):
        _batches(seq_len=24, images_per_sample=2)
    with pytest.raises(ValueError, match="images_per_sample"):
        _batches(images_per_sample=0)
