"""A seeded random batch sampler, sharded over data-parallel ranks, that resumes exactly.

Epoch ``e`` shuffles all sample indices with ``torch.Generator().manual_seed(seed + e)``,
keeps a multiple of ``batch_size x num_replicas`` (``drop_last``; otherwise the last global
batch is filled by wrapping around) and cuts them into global batches of consecutive
indices; rank ``r`` takes the ``r``-th micro-batch of each. So the samples of one optimizer
micro-step across all ranks are the same whatever the number of ranks, which keeps runs
with different data-parallel sizes comparable.

``infinite=True`` continues into the next epoch without stopping, in the same order as
consecutive finite epochs. The state is (epoch, batches taken in the epoch): torchdata's
``StatefulDataLoader`` saves it with every batch it hands out and restores it without
touching the data already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: The seed's sampler class names; both give this order.
SAMPLER_TYPES = ("BaseRandomBatchSampler", "SeedRandomBatchSampler")


class RandomBatchSampler:
    """Yields lists of sample indices (one micro-batch of this rank) per step."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        infinite: bool = False,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.num_samples = int(num_samples)
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.infinite = infinite
        global_batch = batch_size * num_replicas
        if drop_last:
            self.batches_per_epoch = self.num_samples // global_batch
        else:
            self.batches_per_epoch = -(-self.num_samples // global_batch)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{self.num_samples} samples do not fill one global batch of {global_batch} "
                f"(micro_batch_size {batch_size} x {num_replicas} data-parallel ranks)"
            )
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out

    def _order(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        needed = self.batches_per_epoch * self.batch_size * self.num_replicas
        if needed > len(order):
            order = torch.cat([order, order[: needed - len(order)]])
        return order[:needed].view(self.batches_per_epoch, self.num_replicas, self.batch_size)[:, self.rank]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            if self.position >= self.batches_per_epoch:
                # The previous epoch was consumed to the end: this iteration starts the next one.
                self.epoch += 1
                self.position = 0
            batches = self._order(self.epoch)
            while self.position < self.batches_per_epoch:
                batch = batches[self.position].tolist()
                self.position += 1
                yield batch
            if not self.infinite:
                return

    def __len__(self) -> int:
        if self.infinite:
            raise TypeError("an infinite sampler has no length")
        return self.batches_per_epoch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        if (
            state.get("num_samples", self.num_samples) != self.num_samples
            or state.get("seed", self.seed) != self.seed
        ):
            raise ValueError(
                f"the checkpoint's data order (seed {state.get('seed')}, {state.get('num_samples')} samples) does not "
                f"match this run's (seed {self.seed}, {self.num_samples} samples); the dataset or seed changed"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
