"""Where the trainer's micro-batches come from.

A data source is an iterable of micro-batch dicts with ``state_dict()`` / ``load_state_dict()``
(``torchdata``'s ``StatefulDataLoader`` or ``SyntheticBatches``). Keys: ``input_ids``,
``labels`` (aligned with ``input_ids``, not shifted, -100 ignored), ``attention_mask`` (right
padding), ``position_ids``, and ``pixel_values`` / ``image_sizes`` when the micro-batch has images.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from magistral_cli.config.schema import Recipe

SYNTHETIC = "synthetic"


class DataSource(Protocol):
    def __iter__(self): ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def build_data(recipe: Recipe, *, dp_rank: int, dp_size: int, vocab_size: int) -> DataSource:
    """The training data source of data-parallel rank ``dp_rank`` of ``dp_size``."""
    params = recipe.data.dataset_param
    training = recipe.training
    if params.dataset_type == SYNTHETIC:
        from .synthetic import SyntheticBatches

        return SyntheticBatches(
            vocab_size=vocab_size,
            seq_len=params.basic_parameters.cutoff_len,
            micro_batch_size=training.micro_batch_size,
            grad_accumulation=training.gradient_accumulation_steps,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=training.seed,
        )
    from magistral_cli.data.loader import build_train_dataloader, prepare_dataset

    # Rank 0 encodes (or finds the cache); the others then read the cache it wrote.
    rank = dist.get_rank() if dist.is_initialized() else 0
    dataset = None
    if rank == 0:
        dataset = prepare_dataset(recipe, show_progress=True)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        dataset = prepare_dataset(recipe, show_progress=False)
    return build_train_dataloader(recipe, dataset, dp_rank=dp_rank, dp_size=dp_size)
