"""Batch samplers, sharded over data-parallel ranks, that resume exactly.

``data.dataloader_param.sampler_type`` names one of three orders:

``BaseRandomBatchSampler`` (the seed's default)
    MindSpeed-MM's sampler, index for index. Epoch ``e`` shuffles
    ``range(num_samples // micro_batch * micro_batch)`` with
    ``torch.randperm(n, generator=torch.Generator().manual_seed(e))``: the recipe seed is
    *ignored*, so every run over the same data sees the same order. Rank ``r`` takes every
    ``dp``-th index of the permutation from ``r`` on, in micro-batches of consecutive picks;
    the position in the data is ``consumed_samples`` (global samples, ``micro_batch x dp`` per
    step) and an epoch is ``num_samples - num_samples % (micro_batch x dp)`` of them.
``SeedRandomBatchSampler``
    The same, with the epoch's generator seeded by
    ``numpy.random.SeedSequence([epoch, seed]).generate_state(1, uint32)[0]`` (the recipe seed
    mixed in; it must be >= 0).
``MagistralRandomBatchSampler`` (an addition)
    The project's own order: epoch ``e`` shuffles all indices with ``seed + e``, each global batch
    is consecutive indices and rank ``r`` takes its ``r``-th micro-batch; ``drop_last: false``
    fills the last global batch by wrapping around (the seed's samplers refuse it).

The seed's samplers draw the permutation over whole *micro*-batches but an epoch ends at whole
*global* batches, so when ``micro_batch < dp`` a rank ``r < dp - micro_batch`` can find one more
micro-batch in the permutation's tail than the others: the seed yields it as that rank's next
step, while the other ranks already start the next epoch, and that rank then skips its share of
the next epoch's first step (its ``consumed_samples`` ran one step ahead). This is reproduced,
since it is the seed's order. The seed's own resume loses that extra step when a checkpoint
falls right before it; here the state records it (``tail_due``), so a resumed run continues as
the uninterrupted one did.

``infinite=True`` continues into the next epoch without stopping, in the same order as
consecutive finite passes. torchdata's ``StatefulDataLoader`` saves ``state_dict()`` with every
batch it hands out and restores it without touching the data already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

SEED_SAMPLERS = ("BaseRandomBatchSampler", "SeedRandomBatchSampler")
SAMPLER_TYPES = (*SEED_SAMPLERS, "MagistralRandomBatchSampler")


def _check_shape(num_samples: int, batch_size: int, num_replicas: int, rank: int) -> None:
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    if num_samples < batch_size * num_replicas:
        raise ValueError(
            f"{num_samples} samples do not fill one global batch of {batch_size * num_replicas} "
            f"(micro_batch_size {batch_size} x {num_replicas} data-parallel ranks)"
        )


class BaseRandomBatchSampler:
    """MindSpeed-MM's ``BaseRandomBatchSampler`` order: shuffled by the epoch number alone."""

    name = "BaseRandomBatchSampler"

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
        num_samples = int(num_samples)
        _check_shape(num_samples, batch_size, num_replicas, rank)
        if not drop_last:
            raise ValueError(
                f"{self.name} (the seed's) has no drop_last: false; use sampler_type "
                "MagistralRandomBatchSampler to keep the last global batch"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.infinite = infinite
        self.global_batch = batch_size * num_replicas
        #: Samples of one epoch (whole global batches): where ``consumed_samples`` wraps.
        self.epoch_samples = num_samples - num_samples % self.global_batch
        #: Length of the permutation: whole micro-batches, as the seed draws it.
        self.permuted = num_samples // batch_size * batch_size
        self.batches_per_epoch = self.epoch_samples // self.global_batch
        self.consumed_samples = 0
        #: True right after an epoch's last full step when this rank still has a tail micro-batch.
        self.tail_due = False

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (the seed's ``consumed_samples // epoch_samples``)."""
        return self.consumed_samples // self.epoch_samples - (1 if self.tail_due else 0)

    def epoch_seed(self, epoch: int) -> int:
        return epoch

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.permuted))
        generator = torch.Generator()
        generator.manual_seed(self.epoch_seed(epoch))
        return torch.randperm(self.permuted, generator=generator).tolist()

    def _one_pass(self) -> Iterator[list[int]]:
        """The seed's ``_iter_one_epoch`` from ``consumed_samples`` on."""
        size, replicas, step = self.batch_size, self.num_replicas, self.global_batch
        if self.tail_due:
            # Resumed right before this rank's extra micro-batch: the uninterrupted pass's last one.
            order = self._permutation(self.epoch)
            batch = order[self.epoch_samples + self.rank :: replicas][:size]
            self.consumed_samples += step
            self.tail_due = False
            yield batch
            return
        epoch, offset = divmod(self.consumed_samples, self.epoch_samples)
        picks = self._permutation(epoch)[offset:][self.rank :: replicas]
        count = len(picks) // size  # an incomplete last micro-batch is dropped
        for i in range(count):
            self.consumed_samples += step
            self.tail_due = i + 1 < count and self.consumed_samples % self.epoch_samples == 0
            yield picks[i * size : (i + 1) * size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from self._one_pass()
            if not self.infinite:
                return

    def __len__(self) -> int:
        """Steps of one epoch (the seed's own ``__len__`` returns the number of samples)."""
        if self.infinite:
            raise TypeError("an infinite sampler has no length")
        return self.batches_per_epoch

    def state_dict(self) -> dict:
        return {
            "sampler_type": self.name,
            "consumed_samples": self.consumed_samples,
            "tail_due": self.tail_due,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        _check_state(self, state, seeded=False)
        self.consumed_samples = int(state["consumed_samples"])
        self.tail_due = bool(state.get("tail_due", False))


class SeedRandomBatchSampler(BaseRandomBatchSampler):
    """MindSpeed-MM's ``SeedRandomBatchSampler`` order: the epoch and the recipe seed mixed."""

    name = "SeedRandomBatchSampler"

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
        if shuffle and seed < 0:
            raise ValueError(f"SeedRandomBatchSampler requires seed >= 0, got {seed}")
        super().__init__(num_samples, batch_size, num_replicas, rank, shuffle, seed, drop_last, infinite)

    def epoch_seed(self, epoch: int) -> int:
        # SeedSequence, not seed + epoch: (seed 1, epoch 1) and (seed 0, epoch 2) must differ.
        return int(np.random.SeedSequence([epoch, self.seed]).generate_state(1, dtype=np.uint32)[0])

    def load_state_dict(self, state: dict) -> None:
        _check_state(self, state, seeded=True)
        self.consumed_samples = int(state["consumed_samples"])
        self.tail_due = bool(state.get("tail_due", False))


class MagistralRandomBatchSampler:
    """The project's order: ``seed + epoch``, consecutive global batches, optional wrap-around tail."""

    name = "MagistralRandomBatchSampler"

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
        if needed > len(order):  # drop_last false: the last global batch wraps around
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
            "sampler_type": self.name,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        _check_state(self, state, seeded=True)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


SAMPLERS = {
    cls.name: cls for cls in (BaseRandomBatchSampler, SeedRandomBatchSampler, MagistralRandomBatchSampler)
}


def _check_state(sampler, state: dict, *, seeded: bool) -> None:
    """Refuse a checkpoint's position that would mean other samples in this run.

    A state without ``sampler_type`` was written before the seed's samplers existed here, when
    every name gave the ``MagistralRandomBatchSampler`` order.
    """
    kind = state.get("sampler_type", MagistralRandomBatchSampler.name)
    if kind != sampler.name:
        raise ValueError(
            f"the checkpoint's data position is in the {kind} order but this run uses {sampler.name}; "
            f"resume with data.dataloader_param.sampler_type={kind}"
        )
    changed = state.get("num_samples", sampler.num_samples) != sampler.num_samples
    if seeded and sampler.shuffle:
        changed = changed or state.get("seed", sampler.seed) != sampler.seed
    if changed:
        raise ValueError(
            f"the checkpoint's data order (seed {state.get('seed')}, {state.get('num_samples')} samples) does not "
            f"match this run's (seed {sampler.seed}, {sampler.num_samples} samples); the dataset or seed changed"
        )


def build_sampler(name: str, num_samples: int, batch_size: int, **options):
    """The sampler ``name`` (one of :data:`SAMPLER_TYPES`); ValueError for an unknown name."""
    if name not in SAMPLERS:
        raise ValueError(f"sampler_type {name!r} is not supported; use one of {', '.join(SAMPLER_TYPES)}")
    return SAMPLERS[name](num_samples, batch_size, **options)
