"""What the trainer calls: ``prepare_dataset`` and ``build_train_dataloader``.

::

    dataset = prepare_dataset(recipe)                     # encodes into the cache, or reuses it
    loader = build_train_dataloader(recipe, dataset, dp_rank=r, dp_size=n)
    for batch in loader: ...                              # micro-batches of this rank
    state = loader.state_dict(); loader.load_state_dict(state)   # exact resume

Images are read and turned into pixel values in the loader's workers; the cache holds token
ids and image paths and sizes only.
"""

from __future__ import annotations

import numpy as np

from magistral_cli.errors import UserError

from .cache import EncodedDataset
from .collator import COLLATORS, PixtralCollator
from .packing import plan_packs
from .pixtral import ImageSettings, load_pixel_values
from .samplers import SAMPLER_TYPES, build_sampler


def prepare_dataset(recipe, *, show_progress: bool = True) -> EncodedDataset:
    """Encode the recipe's dataset into its fingerprinted cache entry, or reuse it (idempotent).

    Safe to call from every rank: concurrent callers on one machine wait for the first (a
    lock file), and a cache entry appears atomically.
    """
    from .pipeline import run_preprocess

    return run_preprocess(recipe, show_progress=show_progress).dataset


class TrainDataset:
    """Map-style dataset over cached samples (or packs of them) that loads their images.

    Item ``i`` is a dict of numpy arrays (``input_ids``, ``labels``, ``position_ids``) and
    ``pixel_values``, a list of [3, H, W] float32 arrays in ``[IMG]``-block order.
    """

    def __init__(
        self, encoded: EncodedDataset, settings: ImageSettings, packs: list[list[int]] | None = None
    ):
        self.encoded = encoded
        self.settings = settings
        self.packs = packs

    def __len__(self) -> int:
        return len(self.packs) if self.packs is not None else len(self.encoded)

    def __getitem__(self, index: int) -> dict:
        members = self.packs[index] if self.packs is not None else [index]
        ids, labels, positions, pixels = [], [], [], []
        for member in members:
            sample = self.encoded[member]
            ids.append(sample.input_ids)
            labels.append(sample.labels)
            positions.append(np.arange(len(sample.input_ids), dtype=np.int64))
            for path, size in zip(sample.images, sample.image_sizes, strict=True):
                pixels.append(
                    load_pixel_values(path, self.settings, expected_hw=(int(size[0]), int(size[1])))
                )
        return {
            "input_ids": np.concatenate(ids).astype(np.int64),
            "labels": np.concatenate(labels).astype(np.int64),
            "position_ids": np.concatenate(positions),
            "pixel_values": pixels,
        }


def _check_loader_options(recipe) -> None:
    dl = recipe.data.dataloader_param
    if dl.dataloader_mode != "sampler":
        raise UserError(f"dataloader_mode {dl.dataloader_mode!r} is not supported; use 'sampler'")
    if dl.sampler_type not in SAMPLER_TYPES:
        raise UserError(
            f"sampler_type {dl.sampler_type!r} is not supported; use one of {', '.join(SAMPLER_TYPES)} "
            "(data.dataloader_param.sampler_type)"
        )
    if dl.collate_param.collator_id not in COLLATORS:
        raise UserError(f"collator_id {dl.collate_param.collator_id!r} is not supported; use 'pixtral'")
    if recipe.data.dataset_param.basic_parameters.neat_packing:
        raise UserError(
            "neat_packing is not supported; set it to false (packing: true packs without isolation)"
        )


def build_train_dataset(recipe, dataset: EncodedDataset) -> TrainDataset:
    """The map-style dataset the loader reads: samples, or packs of them with ``packing: true``."""
    from .pipeline import image_settings_of

    basic = recipe.data.dataset_param.basic_parameters
    packs = plan_packs(dataset.lengths, basic.cutoff_len) if basic.packing else None
    return TrainDataset(dataset, image_settings_of(dataset), packs)


def build_train_dataloader(recipe, dataset: EncodedDataset, *, dp_rank: int, dp_size: int):
    """A ``StatefulDataLoader`` of this rank's micro-batches (``training.micro_batch_size`` samples).

    In the order of ``sampler_type`` (see :mod:`magistral_cli.data.samplers`: the seed's
    ``BaseRandomBatchSampler`` ignores ``training.seed``), sharded over ``dp_size`` ranks,
    ``drop_last`` and ``infinite_sampler`` as the recipe says; ``state_dict()`` /
    ``load_state_dict()`` resume exactly where the run stopped without reading the consumed
    samples again.
    """
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    _check_loader_options(recipe)
    dl = recipe.data.dataloader_param
    train = build_train_dataset(recipe, dataset)
    try:
        sampler = build_sampler(
            dl.sampler_type,
            len(train),
            batch_size=recipe.training.micro_batch_size,
            num_replicas=dp_size,
            rank=dp_rank,
            shuffle=dl.shuffle,
            seed=recipe.training.seed,
            drop_last=dl.drop_last,
            infinite=dl.infinite_sampler,
        )
    except ValueError as exc:
        raise UserError(f"cannot batch the dataset {dataset.path}: {exc}") from None
    pad = int(dataset.meta["pad_token_id"])
    collator = PixtralCollator(pad, ignore_pad_token_for_loss=dl.collate_param.ignore_pad_token_for_loss)
    workers = dl.num_workers
    options = {}
    if workers:
        options["persistent_workers"] = dl.persistent_workers
        if dl.prefetch_factor is not None:
            options["prefetch_factor"] = dl.prefetch_factor
    pin = dl.pin_memory and (torch.cuda.is_available() or hasattr(torch, "npu"))
    return StatefulDataLoader(
        train,
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=workers,
        pin_memory=pin,
        **options,
    )
