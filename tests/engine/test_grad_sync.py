"""Gradient accumulation and memory: what each rank holds after a non-final micro-batch.

FSDP2 with ``set_requires_gradient_sync(False)`` keeps every parameter's gradient unsharded
until the sync; at 24B that is param_dtype bytes per trainable parameter on every rank (43.9 GiB
in bf16), which is why the 4-card recipe (accumulation 2) ran out of memory in step 1. The
default reduce-scatters after every micro-batch; ``parallel.fsdp_plan.defer_grad_sync`` opts in
to the deferred sync. Measured on 2 CPU processes (gloo) with bf16 compute and reduction, as in
the seed's recipes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule

from magistral_cli.engine.trainer import Trainer
from magistral_cli.runtime import spawn_ranks

from .helpers import make_recipe, write_tiny_model

pytestmark = pytest.mark.slow
BF16 = ["parallel.fsdp_plan.param_dtype=bf16", "parallel.fsdp_plan.reduce_dtype=bf16"]


def held_gradient_bytes(model: nn.Module) -> dict[str, int]:
    """The gradient bytes this rank holds now, read from FSDP2's parameters.

    ``sharded``: the local gradient shards (what the optimizer steps on). ``unsharded``: full
    gradients FSDP2 keeps between backwards when the reduce-scatter is deferred
    (``set_requires_gradient_sync(False)``): the unsharded parameters' ``.grad`` and the
    accumulated unsharded gradients.
    """
    sharded = unsharded = 0
    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and all(group is not g for g in groups):
                groups.append(group)
    for group in groups:
        for fsdp_param in group.fsdp_params:
            grad = fsdp_param.sharded_param.grad
            if grad is not None:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                sharded += local.numel() * local.element_size()
            full = getattr(fsdp_param, "_unsharded_param", None)
            for held in (full.grad if full is not None else None, fsdp_param.unsharded_accumulated_grad):
                if held is not None:
                    unsharded += held.numel() * held.element_size()
    return {"sharded": sharded, "unsharded": unsharded}


class MeasuringTrainer(Trainer):
    """The trainer, recording the gradient bytes held after each micro-batch's backward."""

    def after_micro_batch(self, index: int, *, last: bool) -> None:
        self.held = getattr(self, "held", [])
        self.held.append({"index": index, "last": last, **held_gradient_bytes(self.model)})


def _measure(model_dir: Path, run_dir: Path, defer: bool) -> dict:
    overrides = [*BF16, f"parallel.fsdp_plan.defer_grad_sync={str(defer).lower()}"]
    recipe = make_recipe(
        model_dir, run_dir, overrides, micro_batch_size=1, gradient_accumulation_steps=2, train_iters=2
    )
    trainer = MeasuringTrainer(recipe)
    try:
        losses = [r["loss"] for r in trainer.train()]
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        return {
            "held": trainer.held,
            "losses": losses,
            "trainable_params": sum(p.numel() for p in trainable),
            "local_shard_params": sum(p.to_local().numel() for p in trainable),
        }
    finally:
        trainer.close()


def _worker(rank: int, model_dir: str, out_dir: str) -> dict:
    out = Path(out_dir)
    return {
        mode: _measure(Path(model_dir), out / mode, mode == "deferred") for mode in ("default", "deferred")
    }


def test_default_reduce_scatters_every_micro_batch_and_deferred_holds_full_gradients(tmp_path):
    model_dir = tmp_path / "model"
    write_tiny_model(model_dir)
    results = spawn_ranks(_worker, 2, (str(model_dir), str(tmp_path)), threads=1)
    for rank, result in enumerate(results):
        default, deferred = result["default"], result["deferred"]
        trainable = default["trainable_params"]
        shard = default["local_shard_params"]
        # Two steps of two micro-batches: indices 0 (non-final) and 1 (final), twice.
        non_final = [h for h in default["held"] if not h["last"]]
        non_final_deferred = [h for h in deferred["held"] if not h["last"]]
        assert len(non_final) == len(non_final_deferred) == 2
        figures = (
            f"rank {rank}, {trainable:,} trainable parameters ({shard:,} in this rank's shards): after a "
            f"non-final micro-batch the default holds {non_final[0]['sharded']:,} B of gradient shards and "
            f"{non_final[0]['unsharded']:,} B unsharded ({non_final[0]['sharded'] / trainable:.2f} B per "
            f"trainable parameter); defer_grad_sync holds {non_final_deferred[0]['unsharded']:,} B unsharded "
            f"and {non_final_deferred[0]['sharded']:,} B of shards "
            f"({non_final_deferred[0]['unsharded'] / trainable:.2f} B per trainable parameter)"
        )
        print(figures)
        for held in non_final:
            # Reduce-scattered: only this rank's fp32 gradient shards, nothing unsharded.
            assert held["unsharded"] == 0, figures
            assert held["sharded"] == 4 * shard, figures
        for held in non_final_deferred:
            # Deferred: every trainable parameter's full bf16 gradient, on every rank, no shard yet.
            assert held["unsharded"] == 2 * trainable, figures
            assert held["sharded"] == 0, figures
        # After the final micro-batch both modes hold the same shards and nothing unsharded.
        for held in (default["held"][-1], deferred["held"][-1]):
            assert held["unsharded"] == 0 and held["sharded"] == 4 * shard, figures
        # The same training either way (bf16 reductions round differently: 2% as the seed allows).
        assert deferred["losses"] == pytest.approx(default["losses"], rel=2e-2)
