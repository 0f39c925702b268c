"""What the trainer calls: ``prepare_dataset``, ``build_train_dataloader`` and ``build_val_batches``.

::

    dataset = prepare_dataset(recipe)                     # encodes into the cache, or reuses it
    loader = build_train_dataloader(recipe, dataset, dp_rank=r, dp_size=n)
    for batch in loader: ...                              # micro-batches of this rank
    state = loader.state_dict(); loader.load_state_dict(state)   # exact resume
    val = build_val_batches(recipe, dataset, dp_rank=r, dp_size=n)   # with val_size
    for batch in val: ...                                 # this rank's validation micro-batches

Images are read and turned into pixel values in the loader's workers; the cache holds token
ids and image paths and sizes only.

With ``data.dataset_param.basic_parameters.val_size`` the encoded samples are split once
(``split_indices``: LLaMA-Factory's seeded shuffle split, seeded by ``training.seed``) before the
sampler shuffles or packing plans anything: the training loader reads only the training samples,
the validation batches only the validation samples. Without ``val_size`` the training loader is
what it was (the same sampler length, samples and order).

Preference pairs (``training.stage: dpo``, a pair cache entry): the split, the samplers and the
validation share count pairs, and a micro-batch of ``B = training.micro_batch_size`` pairs is an
ordinary unpacked SFT batch of ``2B`` rows, the chosen sequences of the B pairs first, then their
rejected sequences in the same order (``collator.PairCollator``; ``collator.pair_rows``). With
``neat_packing`` the training loader packs whole pairs instead (up to ``2 x cutoff_len`` tokens a
pack, ``micro_batch_size`` packs a micro-batch); validation stays unpacked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from magistral_cli.errors import PATH_ERRNOS, UserError

from .cache import EncodedDataset
from .collator import COLLATORS, IGNORE_INDEX, SAMPLE_INDEX, PairCollator, PixtralCollator
from .packing import packing_units, plan_packs, segment_mode
from .pixtral import ImageChangedError, ImageSettings, ImageSizeError, load_pixel_values
from .samplers import SAMPLER_TYPES, build_sampler


def prepare_dataset(recipe, *, progress=None) -> EncodedDataset:
    """Encode the recipe's dataset into its fingerprinted cache entry, or reuse it (idempotent).

    Safe to call from every rank: concurrent callers on one machine wait for the first (a
    lock file), and a cache entry appears atomically. ``progress(done_rows, total_rows)`` is
    ``pipeline.ProgressFn`` (the CLI passes a rich bar).
    """
    from .pipeline import run_preprocess

    return run_preprocess(recipe, progress=progress).dataset


VAL_SIZE_KEY = "data.dataset_param.basic_parameters.val_size"


def validation_count(n: int, val_size: float | int) -> int:
    """How many of ``n`` encoded samples ``val_size`` takes for validation.

    A fraction in (0, 1): ``round(n * val_size)``, at least 1; an int (or integral float) >= 1:
    that count; 0: none. ``UserError`` when that leaves no training sample, or for a value the
    schema refuses (negative, a non-integral float >= 1).
    """
    if val_size < 0 or (val_size >= 1 and not float(val_size).is_integer()):
        raise UserError(
            f"{VAL_SIZE_KEY} is {val_size}: it must be 0 (no validation), a fraction in (0, 1) or a whole count "
            ">= 1 of samples"
        )
    if val_size == 0:
        return 0
    k = max(1, round(n * val_size)) if val_size < 1 else int(val_size)
    if k >= n:
        raise UserError(
            f"{VAL_SIZE_KEY} {val_size} takes {k} of the {n} encoded samples for validation and leaves no "
            f"training sample: lower val_size (a fraction such as 0.05, or a count below {n})"
        )
    return k


def with_split(report: dict, recipe, kept: int) -> dict:
    """The report with ``split`` (train / validation counts of the ``kept`` samples, or pairs of a
    pair entry: ``EncodedDataset.num_units``) when the recipe has ``val_size``.

    The split is decided when the loaders are built, from ``val_size`` and ``training.seed``, so
    it is not part of the cache entry (nor of its report.json): one entry serves every val_size.
    """
    val_size = recipe.data.dataset_param.basic_parameters.val_size
    if not val_size:
        return report
    val = validation_count(kept, val_size)
    split = {"train": kept - val, "val": val, "val_size": val_size, "seed": recipe.training.seed}
    return {**report, "split": split}


def split_indices(n: int, val_size: float | int, seed: int) -> tuple[list[int], list[int]]:
    """The training and validation sample indices of an encoded dataset of ``n`` samples, both sorted.

    LLaMA-Factory's split: a seeded shuffle (``numpy.random.default_rng(seed).permutation(n)``)
    whose first k indices (``validation_count``) are the validation samples. Deterministic in
    ``(n, val_size, seed)`` and independent of the global RNGs; ``val_size`` 0 keeps every sample
    for training.
    """
    k = validation_count(n, val_size)
    if k == 0:
        return list(range(n)), []
    order = np.random.default_rng(seed).permutation(n)
    return sorted(int(i) for i in order[k:]), sorted(int(i) for i in order[:k])


def dataset_split(recipe, dataset: EncodedDataset) -> tuple[list[int], list[int]] | None:
    """``split_indices`` of the recipe's ``val_size`` and ``training.seed``; None without val_size.
    A pair entry is split by pairs (the indices are pair indices)."""
    val_size = recipe.data.dataset_param.basic_parameters.val_size
    if not val_size:
        return None
    return split_indices(dataset.num_units, val_size, recipe.training.seed)


class TrainDataset:
    """Map-style dataset over cached samples (or packs of them) that loads their images.

    Item ``i`` is a dict of numpy arrays (``input_ids``, ``labels``, ``position_ids``,
    ``sample_lengths``: the token count of each sample in it) and ``pixel_values``, a list of
    [3, H, W] float32 arrays in ``[IMG]``-block order. A sample's first label is always ignored
    (in a pack, the previous sample's last token must not predict it). ``packs``
    hold cache indices; ``indices`` (without packs) makes item ``i`` the cached sample
    ``indices[i]`` (the training samples of a validation split); neither: item ``i`` is sample ``i``.

    In a pair entry (``encoded.pairs``) indices count pairs, and item ``i`` is
    ``{"chosen": item, "rejected": item}`` of pair ``i`` (or ``indices[i]``), each such a dict with
    its ``sample_index`` in the entry (``collator.PairCollator`` batches them). Packs of pairs
    (neat_packing) hold whole pairs, ``[2k, 2k + 1, 2j, 2j + 1, ...]``; their item adds
    ``sample_index``, the entry's index of each sample in the pack.
    """

    def __init__(
        self,
        encoded: EncodedDataset,
        settings: ImageSettings,
        packs: list[list[int]] | None = None,
        indices: list[int] | None = None,
    ):
        if packs is not None and encoded.pairs:
            for pack in packs:
                chosen, rejected = pack[0::2], pack[1::2]
                if len(chosen) != len(rejected) or any(
                    c % 2 or r != c + 1 for c, r in zip(chosen, rejected, strict=True)
                ):
                    raise ValueError(f"a pack of pairs holds whole pairs (2k, 2k + 1, ...), not {pack}")
        self.encoded = encoded
        self.settings = settings
        self.packs = packs
        self.indices = indices

    def __len__(self) -> int:
        if self.packs is not None:
            return len(self.packs)
        return len(self.indices) if self.indices is not None else self.encoded.num_units

    def __getitem__(self, index: int) -> dict:
        if self.packs is not None:
            item = self._item(self.packs[index])
            if self.encoded.pairs:
                item[SAMPLE_INDEX] = np.asarray(self.packs[index], dtype=np.int64)
            return item
        unit = self.indices[index] if self.indices is not None else index
        if self.encoded.pairs:
            chosen, rejected = self._item([2 * unit]), self._item([2 * unit + 1])
            chosen[SAMPLE_INDEX], rejected[SAMPLE_INDEX] = 2 * unit, 2 * unit + 1
            return {"chosen": chosen, "rejected": rejected}
        return self._item([unit])

    def _item(self, members: list[int]) -> dict:
        ids, labels, positions, pixels = [], [], [], []
        for member in members:
            sample = self.encoded[member]
            ids.append(sample.input_ids)
            target = np.array(sample.labels, dtype=np.int64)
            target[:1] = IGNORE_INDEX
            labels.append(target)
            positions.append(np.arange(len(sample.input_ids), dtype=np.int64))
            for path, size in zip(sample.images, sample.image_sizes, strict=True):
                pixels.append(self._pixels(path, (int(size[0]), int(size[1])), sample.source_index))
        return {
            "input_ids": np.concatenate(ids).astype(np.int64),
            "labels": np.concatenate(labels).astype(np.int64),
            "position_ids": np.concatenate(positions),
            "sample_lengths": np.array([len(x) for x in ids], dtype=np.int64),
            "pixel_values": pixels,
        }

    def _pixels(self, path: str, size: tuple[int, int], row: int) -> np.ndarray:
        """The pixel values of one image; an image that preprocessing read but that is now missing,
        unreadable, undecodable or of another size is one ``UserError`` naming it and its sample
        (the dataset row); a disk that fails to read (an I/O error) stays the machine's ``OSError``."""
        import errno

        from PIL import Image

        try:
            return load_pixel_values(path, self.settings, expected_hw=size)
        except OSError as exc:
            if isinstance(exc.errno, int) and errno.errorcode.get(exc.errno) not in PATH_ERRNOS:
                raise
            reason = exc.strerror or str(exc)
        except (ImageChangedError, ImageSizeError, SyntaxError, Image.DecompressionBombError) as exc:
            reason = str(exc)
        raise UserError(
            f"image {path} of sample {row} changed since preprocessing: re-run magistral preprocess with "
            f"data.dataset_param.basic_parameters.overwrite_cache=true ({reason})"
        )


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


def _check_stage(recipe, dataset: EncodedDataset) -> None:
    """The entry holds what the recipe's stage trains on (pairs for dpo, samples for sft)."""
    dpo = recipe.training.stage == "dpo"
    if dpo != dataset.pairs:
        holds = "preference pairs" if dataset.pairs else "SFT samples"
        raise UserError(
            f"the cache entry {dataset.path} holds {holds} but training.stage is {recipe.training.stage!r}: "
            "use the entry that `magistral preprocess` makes for this recipe"
        )


def _collator(recipe, dataset: EncodedDataset, segments: str | None = None):
    """The recipe's collator; for pairs, ``PairCollator`` (2B rows: chosen first, then rejected)."""
    pad = int(dataset.meta["pad_token_id"])
    ignore_pad = recipe.data.dataloader_param.collate_param.ignore_pad_token_for_loss
    collator = PixtralCollator(pad, ignore_pad_token_for_loss=ignore_pad, segments=segments)
    return PairCollator(collator) if dataset.pairs else collator


def build_train_dataset(recipe, dataset: EncodedDataset) -> TrainDataset:
    """The map-style dataset the loader reads: samples, or packs of them with ``packing: true``;
    the training samples only when the recipe has a validation split (``val_size``). Pairs are
    packed whole (neat_packing), up to ``2 x cutoff_len`` tokens a pack."""
    from .pipeline import image_settings_of

    basic = recipe.data.dataset_param.basic_parameters
    _check_stage(recipe, dataset)
    split = dataset_split(recipe, dataset)
    packing = basic.packing or basic.neat_packing
    train = split[0] if split is not None else None
    if not packing:
        return TrainDataset(dataset, image_settings_of(dataset), indices=train)
    units = list(range(dataset.num_units)) if train is None else train
    # A pack of a pair entry holds whole pairs: a pair's two sequences, up to cutoff_len each.
    lengths, capacity = packing_units(dataset.lengths, basic.cutoff_len, pairs=dataset.pairs)
    planned = plan_packs(lengths[units], capacity)
    packs = [[units[position] for position in pack] for pack in planned]
    if dataset.pairs:
        packs = [[sample for pair in pack for sample in (2 * pair, 2 * pair + 1)] for pack in packs]
    return TrainDataset(dataset, image_settings_of(dataset), packs)


def build_train_dataloader(recipe, dataset: EncodedDataset, *, dp_rank: int, dp_size: int):
    """A ``StatefulDataLoader`` of this rank's micro-batches (``training.micro_batch_size`` samples;
    for pairs, that many pairs as ``2 * micro_batch_size`` rows, chosen rows first).

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
    collator = _collator(recipe, dataset, segment_mode(recipe))
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


# ----------------------------------------------------------------------------- validation


def _without_targets(batch: dict) -> dict:
    """A copy of a micro-batch whose labels are all ignored: it adds no target to the loss."""
    import torch

    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    return out


class ValBatches:
    """One data-parallel rank's validation micro-batches: finite, deterministic, repeatable.

    The validation samples (``indices`` into ``items``, sorted) go to the ranks in turn (rank
    ``r`` takes ``indices[r::dp_size]``) and are cut into micro-batches of ``micro_batch_size``
    in that order; the last one of a rank may be shorter: no sample is dropped, none is read
    twice. Every rank yields ``len(self)`` micro-batches (FSDP's collectives run once per forward
    on every rank): a rank with fewer real ones yields after them ``num_fillers`` copies of its
    last real one (or, with none, of the split's first micro-batch) whose labels are all -100.

    Each ``iter()`` starts from the beginning. No shuffling, no packing; nothing here touches the
    global RNGs (a loader with workers gets a generator of its own) or the training loader.
    """

    def __init__(
        self,
        items,
        batches: list[list[int]],
        collate: Callable[[list[Any]], dict],
        *,
        length: int,
        num_samples: int,
        filler: list[int],
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        if length < len(batches) or length < 1:
            raise ValueError(
                f"length {length} is below this rank's {len(batches)} micro-batches (or below 1)"
            )
        self.items = items
        self.batches = batches
        self.collate = collate
        self.length = length
        self.num_samples = num_samples
        self.filler = filler
        self.num_workers = num_workers
        self.pin_memory = pin_memory

    @classmethod
    def over(
        cls,
        items,
        indices: Sequence[int],
        collate: Callable[[list[Any]], dict],
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> ValBatches:
        """Rank ``dp_rank``'s share of the validation samples ``indices`` of map-style ``items``."""
        indices = list(indices)
        if not indices:
            raise ValueError("no validation samples")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in 0..{dp_size - 1}")
        share = indices[dp_rank::dp_size]
        batches = [share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
        # Rank 0 has the longest share: ceil(n / dp_size) samples.
        length = math.ceil(math.ceil(len(indices) / dp_size) / micro_batch_size)
        return cls(
            items,
            batches,
            collate,
            length=length,
            num_samples=len(indices),
            filler=indices[:micro_batch_size],
            num_workers=num_workers,
            pin_memory=pin_memory,
        )

    def __len__(self) -> int:
        return self.length

    @property
    def num_fillers(self) -> int:
        """Micro-batches without targets this rank yields after its real ones."""
        return self.length - len(self.batches)

    def __iter__(self):
        filler = None
        for batch in self._real():
            if self.num_fillers:  # copied before the caller sees it, whatever it does with it
                filler = _without_targets(batch)
            yield batch
        for _ in range(self.num_fillers):
            if filler is None:
                filler = _without_targets(self.collate([self.items[i] for i in self.filler]))
            yield _without_targets(filler)

    def _real(self):
        if not self.batches:
            return
        if not self.num_workers:
            for batch in self.batches:
                yield self.collate([self.items[i] for i in batch])
            return
        import torch
        from torch.utils.data import DataLoader

        # A generator of its own: the DataLoader would otherwise draw its base seed from torch's
        # global RNG, and training must not see whether an evaluation ran.
        loader = DataLoader(
            self.items,
            batch_sampler=self.batches,
            collate_fn=self.collate,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(0),
        )
        yield from loader


def build_val_batches(recipe, dataset: EncodedDataset, *, dp_rank: int, dp_size: int) -> ValBatches:
    """Rank ``dp_rank``'s validation micro-batches of the recipe's split (``val_size``).

    ``training.micro_batch_size`` samples (or pairs: ``2 * micro_batch_size`` rows, as in training)
    each, the training collator and image loading, no packing and no shuffle, ``data.dataloader_param.num_workers`` workers (see ``ValBatches``).
    ``UserError`` when the recipe has no validation split or the split leaves no training sample.
    """
    import torch

    from .pipeline import image_settings_of

    _check_loader_options(recipe)
    _check_stage(recipe, dataset)
    split = dataset_split(recipe, dataset)
    if split is None:
        raise UserError(f"no validation split: set {VAL_SIZE_KEY} (a fraction such as 0.05 or a count)")
    dl = recipe.data.dataloader_param
    collator = _collator(recipe, dataset)
    return ValBatches.over(
        TrainDataset(dataset, image_settings_of(dataset)),
        split[1],
        collator,
        micro_batch_size=recipe.training.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=dl.num_workers,
        pin_memory=dl.pin_memory and (torch.cuda.is_available() or hasattr(torch, "npu")),
    )


def build_all_pairs_batches(recipe, dataset: EncodedDataset, *, dp_rank: int, dp_size: int) -> ValBatches:
    """Rank ``dp_rank``'s share of every pair of a pair entry (training and validation pairs alike),
    in micro-batches of ``training.micro_batch_size`` pairs as training collates them (``SAMPLE_INDEX``
    included), the same count on every rank (fillers without targets, see ``ValBatches``): the one
    pass that precomputes the reference's log-probabilities (``training.dpo.precompute_ref``)."""
    from .pipeline import image_settings_of

    _check_loader_options(recipe)
    _check_stage(recipe, dataset)
    return ValBatches.over(
        TrainDataset(dataset, image_settings_of(dataset)),
        range(dataset.num_units),
        _collator(recipe, dataset),
        micro_batch_size=recipe.training.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=recipe.data.dataloader_param.num_workers,
    )
