"""Synthetic micro-batches in the data loader's exact format, for tests and benchmarks.

Selected with ``data.dataset_param.dataset_type: synthetic``. Not a dataset: random tokens
from the model's vocabulary with Magistral's layout (image placeholder tokens for the images of
a sample, a prompt masked with -100, right padding), so that the engine's numerics can be
compared between process counts, micro-batch splits and resumed runs without the data
pipeline.

Sample ``k`` depends only on ``(seed, k)``. Step ``s`` uses global samples
``[s * G, (s + 1) * G)`` (G = micro_batch x accumulation x data-parallel ranks); data-parallel
rank ``r`` takes the contiguous slice starting at ``s * G + r * micro_batch * accumulation`` and
splits it into its micro-batches. So 1 process with micro-batch 2 sees exactly what 2 processes
with micro-batch 1 see together, and micro-batch 2 x accumulation 1 what 1 x 2 sees.

The one builder of synthetic micro-batches: the trainer (``dataset_type: synthetic``), the
engine tests and benchmarks, and the ``train-smoke`` probe (``images_per_sample=2`` for its
``multi`` mode) use it. Its stateful protocol, :class:`MicroBatchCounter` (the state is the count
of micro-batches yielded), is the probe's replaying source's too.
"""

from __future__ import annotations

import torch

IMAGE_TOKEN_ID = 10
PAD_TOKEN_ID = 11
BOS_TOKEN_ID = 1
FIRST_TEXT_ID = 16  # below: control tokens
#: The state of a micro-batch counter (``MicroBatchCounter.state_dict``).
YIELDED = "micro_batches_yielded"


class MicroBatchCounter:
    """The stateful protocol of an endless iterator of micro-batches whose whole state is how many it
    has yielded (``self.yielded``): what the trainer checkpoints and a resume restores."""

    yielded: int = 0

    def state_dict(self) -> dict:
        return {YIELDED: self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.yielded = int(state[YIELDED])

    def __iter__(self):
        return self


class SyntheticBatches(MicroBatchCounter):
    """An endless, stateful iterator of micro-batch dicts (the loader's keys and dtypes)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        micro_batch_size: int,
        grad_accumulation: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        image_every: int = 2,
        images_per_sample: int = 1,
        pixels_per_token: int = 28,
        full_length: bool = False,
        pairs: bool = False,
    ):
        """``pairs`` (preference training): each micro-batch holds ``micro_batch_size`` pairs as
        that many chosen rows (the samples above) then their rejected rows (``rejected``);
        ``image_every``: every that many samples (by index) has images, 0 = none;
        ``images_per_sample``: how many such a sample has (each 2 or 4 image tokens);
        ``full_length``: every sample is ``seq_len`` tokens (default: random, from half of it)."""
        if images_per_sample < 1:
            raise ValueError("images_per_sample must be >= 1")
        if seq_len < 16 * images_per_sample:
            raise ValueError(
                f"synthetic batches with {images_per_sample} image(s) need cutoff_len >= {16 * images_per_sample}"
            )
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.grad_accumulation = grad_accumulation
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.image_every = image_every
        self.images_per_sample = images_per_sample
        self.pixels_per_token = pixels_per_token
        self.full_length = full_length
        self.pairs = pairs
        self.yielded = 0

    @property
    def may_hold_images(self) -> bool:
        """Whether any micro-batch can hold an image (``engine.data.may_hold_images``)."""
        return self.image_every > 0

    def __next__(self) -> dict[str, torch.Tensor]:
        step, micro = divmod(self.yielded, self.grad_accumulation)
        per_rank = self.micro_batch_size * self.grad_accumulation
        first = step * per_rank * self.dp_size + self.dp_rank * per_rank + micro * self.micro_batch_size
        self.yielded += 1
        samples = [self.sample(first + j) for j in range(self.micro_batch_size)]
        if self.pairs:
            samples += [self.rejected(first + j, chosen) for j, chosen in enumerate(samples)]
        return collate(samples)

    def rejected(self, index: int, chosen: dict) -> dict:
        """Pair ``index``'s rejected sequence: the chosen one's prompt (and images) with another
        random answer of its own length (1 token up to ``seq_len``); depends only on ``(seed, index)``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 2**40)
        prompt = int((chosen["labels"] == -100).sum())
        length = int(torch.randint(1, self.seq_len - prompt + 1, (1,), generator=g))
        answer = torch.randint(FIRST_TEXT_ID, self.vocab_size, (length,), generator=g)
        ids = torch.cat([chosen["input_ids"][:prompt], answer])
        labels = ids.clone()
        labels[:prompt] = -100
        return {"input_ids": ids, "labels": labels, "images": chosen["images"]}

    # ------------------------------------------------------------------ samples
    def sample(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        length = int(torch.randint(self.seq_len // 2, self.seq_len + 1, (1,), generator=g))
        if self.full_length:
            length = self.seq_len
        ids = torch.randint(FIRST_TEXT_ID, self.vocab_size, (length,), generator=g)
        ids[0] = BOS_TOKEN_ID
        images = []
        end = 1  # the images' tokens follow BOS, one text token between two images
        if self.image_every and index % self.image_every == 0:
            for k in range(self.images_per_sample):
                # At least two image tokens: transformers squeezes a batch holding a single one to 1D.
                rows, cols = int(torch.randint(1, 3, (1,), generator=g)), 2
                start = end + (1 if k else 0)
                end = start + rows * cols
                ids[start:end] = IMAGE_TOKEN_ID
                side = self.pixels_per_token
                images.append(torch.randn(3, rows * side, cols * side, generator=g))
        prompt = end + int(torch.randint(1, max(2, length // 3), (1,), generator=g))
        labels = ids.clone()
        labels[:prompt] = -100
        return {"input_ids": ids, "labels": labels, "images": images}


def _images(sample: dict) -> list[torch.Tensor]:
    """A sample's images: its ``images`` list, or its one ``image`` (None: none)."""
    if "images" in sample:
        return list(sample["images"])
    return [] if sample.get("image") is None else [sample["image"]]


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; batch the images in sample order, zero-padded to the largest."""
    longest = max(s["input_ids"].numel() for s in samples)
    n = len(samples)
    input_ids = torch.full((n, longest), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((n, longest), -100, dtype=torch.long)
    attention_mask = torch.zeros((n, longest), dtype=torch.long)
    for i, s in enumerate(samples):
        k = s["input_ids"].numel()
        input_ids[i, :k] = s["input_ids"]
        labels[i, :k] = s["labels"]
        attention_mask[i, :k] = 1
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(longest).unsqueeze(0).expand(n, -1).clone(),
    }
    images = [image for s in samples for image in _images(s)]
    if images:
        h = max(im.shape[1] for im in images)
        w = max(im.shape[2] for im in images)
        pixel_values = torch.zeros(len(images), 3, h, w)
        for i, im in enumerate(images):
            pixel_values[i, :, : im.shape[1], : im.shape[2]] = im
        batch["pixel_values"] = pixel_values
        batch["image_sizes"] = torch.tensor([[im.shape[1], im.shape[2]] for im in images], dtype=torch.long)
    return batch
