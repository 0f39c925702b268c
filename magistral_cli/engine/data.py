"""Where the trainer's micro-batches come from.

A data source is an iterable of micro-batch dicts with ``state_dict()`` / ``load_state_dict()``
(``torchdata``'s ``StatefulDataLoader`` or ``SyntheticBatches``). Keys: ``input_ids``,
``labels`` (aligned with ``input_ids``, not shifted, -100 ignored), ``attention_mask`` (right
padding), ``position_ids``, and ``pixel_values`` / ``image_sizes`` when the micro-batch has images.

The validation source (``build_val_data``, with ``data.dataset_param.basic_parameters.val_size``)
is a ``ValBatches``: the same keys, a finite and repeatable pass over this rank's share of the
validation split, the same number of micro-batches on every data-parallel rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from magistral_cli.config.schema import Recipe

if TYPE_CHECKING:
    from magistral_cli.data.cache import EncodedDataset
    from magistral_cli.data.loader import ValBatches

#: Added to ``training.seed`` for the synthetic validation samples: a stream of their own, apart
#: from the training batches' (sample k's generator is seeded ``seed * 1_000_003 + k``, so the two
#: streams could meet only after 10**12 training samples).
SYNTHETIC_VAL_SEED_OFFSET = 1_000_000


class DataSource(Protocol):
    def __iter__(self): ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def build_data(recipe: Recipe, *, dp_rank: int, dp_size: int, vocab_size: int) -> DataSource:
    """The training data source of data-parallel rank ``dp_rank`` of ``dp_size``."""
    params = recipe.data.dataset_param
    training = recipe.training
    if params.is_synthetic:
        from .synthetic import SyntheticBatches

        return SyntheticBatches(
            vocab_size=vocab_size,
            seq_len=params.basic_parameters.cutoff_len,
            micro_batch_size=training.micro_batch_size,
            grad_accumulation=training.gradient_accumulation_steps,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=training.seed,
            image_every=params.synthetic.image_every,
            full_length=params.synthetic.full_length,
            pairs=training.stage == "dpo",
        )
    from magistral_cli.data.loader import build_train_dataloader, prepare_dataset

    # Rank 0 encodes (or finds the cache); the others then read the cache it wrote.
    rank = dist.get_rank() if dist.is_initialized() else 0
    dataset = None
    if rank == 0:
        dataset = prepare_dataset(recipe)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        dataset = prepare_dataset(recipe)
    loader = build_train_dataloader(recipe, dataset, dp_rank=dp_rank, dp_size=dp_size)
    # The whole entry's images (the training and the validation split): the same on every rank.
    loader.may_hold_images = dataset.num_images > 0
    return loader


def may_hold_images(source: DataSource) -> bool:
    """Whether any micro-batch of ``source`` can hold an image, answered alike on every rank
    (synthetic batches from ``image_every``, a loader from its cache entry); True when unknown."""
    return bool(getattr(source, "may_hold_images", True))


def build_val_data(
    recipe: Recipe,
    *,
    dp_rank: int,
    dp_size: int,
    vocab_size: int,
    dataset: EncodedDataset | None = None,
) -> ValBatches | None:
    """The validation micro-batches of data-parallel rank ``dp_rank`` of ``dp_size``; None when
    ``val_size`` is 0.

    Every rank gets the same number of micro-batches (fillers without targets where its share is
    shorter, see ``ValBatches``). ``dataset``: the encoded dataset the training source was built
    from; without it the cache entry is looked up again (a cache hit, never a second encoding).
    Nothing here touches the global RNGs or the training source.
    """
    params = recipe.data.dataset_param
    val_size = params.basic_parameters.val_size
    if not val_size:
        return None
    from magistral_cli.data.loader import ValBatches, build_val_batches

    training = recipe.training
    if params.is_synthetic:  # val_size is a count here: the schema refuses a fraction of synthetic data
        from .synthetic import SyntheticBatches, collate

        samples = SyntheticBatches(
            vocab_size=vocab_size,
            seq_len=params.basic_parameters.cutoff_len,
            micro_batch_size=training.micro_batch_size,
            grad_accumulation=1,
            dp_rank=0,
            dp_size=1,
            seed=training.seed + SYNTHETIC_VAL_SEED_OFFSET,
            image_every=params.synthetic.image_every,
            full_length=params.synthetic.full_length,
        )
        return ValBatches.over(
            _SyntheticSamples(samples),
            list(range(val_size)),
            collate,
            micro_batch_size=training.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
    if dataset is None:
        dataset = _prepared(recipe)
    return build_val_batches(recipe, dataset, dp_rank=dp_rank, dp_size=dp_size)


class _SyntheticSamples:
    """Map-style view of synthetic samples: item k is ``SyntheticBatches.sample(k)``."""

    def __init__(self, batches):
        self.batches = batches

    def __getitem__(self, index: int) -> dict:
        return self.batches.sample(index)


def build_sources(
    recipe: Recipe, *, data: DataSource | None, val_data, dp_rank: int, dp_size: int, vocab_size: int
) -> tuple[DataSource, ValBatches | None]:
    """The trainer's training source and validation split: ``data`` / ``val_data`` when given (tests
    pass ``SyntheticBatches``), else ``build_data`` / ``build_val_data`` of the recipe."""
    if data is None:
        data = build_data(recipe, dp_rank=dp_rank, dp_size=dp_size, vocab_size=vocab_size)
    if val_data is None:
        val_data = build_val_data(
            recipe,
            dp_rank=dp_rank,
            dp_size=dp_size,
            vocab_size=vocab_size,
            # the encoded dataset the training loader reads (no second cache lookup)
            dataset=getattr(getattr(data, "dataset", None), "encoded", None),
        )
    return data, val_data


def _prepared(recipe: Recipe) -> EncodedDataset:
    """The cache entry the training source was built from (rank 0 first, as in ``build_data``),
    never encoded again: ``overwrite_cache`` is for the first lookup only."""
    from magistral_cli.data.pipeline import run_preprocess

    rank = dist.get_rank() if dist.is_initialized() else 0
    dataset = None
    if rank == 0:
        dataset = run_preprocess(recipe, overwrite=False).dataset
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        dataset = run_preprocess(recipe, overwrite=False).dataset
    return dataset
