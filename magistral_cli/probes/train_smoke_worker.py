"""One rank of the ``train-smoke`` probe (started by torchrun; see probes/train_smoke.py).

Runs the real trainer, :class:`magistral_cli.engine.trainer.Trainer`, from a recipe: the tiny
Mistral3 of :mod:`magistral_cli.testing.tiny_model`, written by rank 0 in the official layout
(config.json, safetensors shards in the official key layout, index) and loaded through
``training.load``; the recipe's default FSDP2 plan with bf16 compute and fp32 gradient
reduction; ``parallel.device`` = the probe's device. The data is the engine's
:class:`~magistral_cli.engine.synthetic.SyntheticBatches` with one image per sample
(``default``) or two (``multi``); every step replays the first step's micro-batches, so a
trainer that trains lowers the loss.

Each rank appends one JSON line per step to ``<out>/rank<N>.jsonl``: step, the trainer's loss
and gradient norm (all-reduced: the values it logs), whether this rank's gradient shards are
finite and their norm, whether the trainer skipped the update. It checks nothing itself: the
parent reads the lines and decides, so a rank that dies or skips a step is caught there. The
trainer runs with ``training.skip_nonfinite_steps``, so a non-finite step is logged and the
run goes on instead of stopping at it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from magistral_cli.config.loader import validate_recipe
from magistral_cli.config.schema import SYNTHETIC
from magistral_cli.engine.synthetic import YIELDED, MicroBatchCounter, SyntheticBatches
from magistral_cli.engine.trainer import Trainer
from magistral_cli.model_config import parameter_counts
from magistral_cli.runtime import BACKENDS, init_distributed
from magistral_cli.testing.tiny_model import build_tiny_model, save_official_checkpoint, tiny_mistral3_config

#: The tiny model's vocabulary: small logits; the ids keep Magistral's layout (image token 10).
VOCAB_SIZE = 512
SEQUENCE_LENGTH = 256
SEED = 42
LR = 1.0e-4


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    parser.add_argument("--mode", choices=("default", "multi"), default="default")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--poison-step", type=int, default=0, help="Tests: make this step's loss NaN.")
    return parser.parse_args()


def probe_recipe(model_dir: Path, run_dir: Path, device: str, steps: int) -> dict[str, Any]:
    """The recipe every rank trains (before validation): recipe defaults unless named here."""
    return {
        "parallel": {"device": device, "fsdp_plan": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
        "data": {
            "dataset_param": {
                "dataset_type": SYNTHETIC,
                "basic_parameters": {"cutoff_len": SEQUENCE_LENGTH},
            }
        },
        "model": {"model_name_or_path": str(model_dir)},
        "training": {
            "micro_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "train_iters": steps,
            "lr": LR,
            "lr_decay_style": "constant",
            "seed": SEED,
            "load": str(model_dir),
            "output_dir": str(run_dir),
            "save_interval": 0,
            "skip_nonfinite_steps": True,
        },
    }


class ReplayedBatches(MicroBatchCounter):
    """A data source that replays ``source``'s first global batch every step.

    The micro-batches of step ``poison_step`` (1-based) get NaN pixel values: the (frozen)
    vision tower passes them into the decoder, so that step's loss and gradients are NaN (the
    probe gives every sample an image).
    """

    def __init__(self, source, grad_accumulation: int, poison_step: int = 0):
        self.source = source
        self.grad_accumulation = grad_accumulation
        self.poison_step = poison_step
        self.yielded = 0

    def __next__(self):
        step, micro = divmod(self.yielded, self.grad_accumulation)
        self.source.load_state_dict({YIELDED: micro})
        batch = next(self.source)
        self.yielded += 1
        if step + 1 == self.poison_step and "pixel_values" in batch:
            batch["pixel_values"] = batch["pixel_values"] * float("nan")
        return batch


def local_grad_stats(parameters) -> tuple[bool, float]:
    """(every local gradient shard finite, their L2 norm) of this rank, in one device sync."""
    grads = [p.grad for p in parameters if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not grads:
        return True, 0.0
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    squares = torch.stack([g.float().square().sum() for g in grads]).sum()
    finite_flag, total = torch.stack([finite.float(), squares.float()]).tolist()
    return bool(finite_flag), math.sqrt(total) if math.isfinite(total) else total


class ProbeTrainer(Trainer):
    """The trainer, plus one JSON line per step (its public step methods, extended)."""

    def __init__(self, recipe, *, data, emit: Callable[[dict], None]):
        self.emit = emit
        self.local_grads = (True, 0.0)
        super().__init__(recipe, data=data)

    def optimizer_step(self, loss_sum=None, counts=None):
        # The gradients are this step's until the optimizer step zeroes them.
        self.local_grads = local_grad_stats(self.trainable)
        return super().optimizer_step(loss_sum, counts)

    def train_step(self, micro_batches):
        start = time.perf_counter()
        out = super().train_step(micro_batches)
        host = out["host"]  # what the step's one synchronisation read back
        targets = host["counts"][0]
        finite, local_norm = self.local_grads
        self.emit(
            {
                "step": self.step,
                "loss": self.logged_loss(host["loss_sum"], targets),
                "grad_norm": host["grad_norm"],
                "grads_finite": finite,
                "local_grad_norm": local_norm,
                "skipped": bool(out["skipped"]),
                "step_time_ms": (time.perf_counter() - start) * 1000.0,
            }
        )
        return out


def main() -> None:
    args = _parse()
    init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir, run_dir = args.out / "model", args.out / "run"
    log = (args.out / f"rank{rank}.jsonl").open("a", encoding="utf-8")

    def emit(record: dict) -> None:
        line = json.dumps({"probe": "train-smoke", "rank": rank, **record})
        log.write(line + "\n")
        log.flush()

    trainer, exit_status = None, 1
    try:
        if rank == 0:  # one copy of the weights, as a model directory on shared storage is
            model = build_tiny_model(tiny_mistral3_config(vocab_size=VOCAB_SIZE), seed=SEED)
            save_official_checkpoint(model, model_dir, num_shards=2)
            del model
        dist.barrier()
        recipe = validate_recipe(probe_recipe(model_dir, run_dir, args.device, args.steps))
        training = recipe.training
        images = 1 if args.mode == "default" else 2
        source = SyntheticBatches(
            vocab_size=VOCAB_SIZE,
            seq_len=SEQUENCE_LENGTH,
            micro_batch_size=training.micro_batch_size,
            grad_accumulation=training.gradient_accumulation_steps,
            dp_rank=rank,  # no context parallelism: one data-parallel rank per process
            dp_size=world,
            seed=training.seed,
            image_every=1,
            images_per_sample=images,
        )
        data = ReplayedBatches(source, training.gradient_accumulation_steps, args.poison_step)
        trainer = ProbeTrainer(recipe, data=data, emit=emit)
        trainer.train()
        emit(
            {
                "done": True,
                "steps": trainer.step,
                "mode": args.mode,
                "world_size": world,
                "parameters": parameter_counts(trainer.model)["total"],
                "skipped_steps": getattr(trainer, "skipped_steps", 0),
            }
        )
        dist.barrier()
        exit_status = 0
    except BaseException as error:
        emit({"error": f"{type(error).__name__}: {error}"})
        raise
    finally:
        if trainer is not None:
            trainer.close(exit_status)  # summary.json in the run directory, as after `magistral train`
        log.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from magistral_cli.runtime import finish_rank_process

    main()
    finish_rank_process(0)
