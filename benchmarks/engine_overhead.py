"""Engine overhead: the trainer's step time against a bare FSDP2 loop on the same model and batches.

    python benchmarks/engine_overhead.py                 # 2 CPU processes (gloo), fp32
    python benchmarks/engine_overhead.py --nproc 1 --steps 30

Both sides run in the same torchrun job, one step of each in turn (so load from other processes
hits both alike), on the same data (the synthetic source in the loader's format), the same FSDP2
wrapping (decoder layers, then the root), freezing, AdamW and per-step loss read-back (the trainer
side is the body of ``Trainer.train`` for a logged step: it also computes the global token count
and the gradient norm). Reported: the median step time of each after the warm-up steps, and
trainer / bare. The goal is <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _recipe(model_dir: Path, run_dir: Path, steps: int, seq: int):
    from magistral_cli.config.loader import validate_recipe

    return validate_recipe(
        {
            "parallel": {
                "device": "cpu",
                "fsdp_plan": {
                    "apply_modules": ["model.language_model.layers.{*}"],
                    "param_dtype": "fp32",
                    "reduce_dtype": "fp32",
                },
            },
            "data": {"dataset_param": {"dataset_type": "synthetic", "basic_parameters": {"cutoff_len": seq}}},
            "model": {"model_name_or_path": str(model_dir)},
            "training": {
                "micro_batch_size": 2,
                "train_iters": steps,
                "lr": 1e-4,
                "lr_decay_style": "constant",
                "load": str(model_dir),
                "output_dir": str(run_dir),
                "save_interval": 0,
                "resume": "never",
                "log_interval": 1,
            },
        }
    )


class BareLoop:
    """forward, backward, optimizer step: the minimum any FSDP2 trainer does."""

    def __init__(self, model_dir: Path, recipe):
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import Mistral3ForConditionalGeneration

        from magistral_cli.engine.synthetic import SyntheticBatches
        from magistral_cli.model_config import read_model_config

        model = Mistral3ForConditionalGeneration.from_pretrained(
            str(model_dir), config=read_model_config(model_dir), dtype=torch.float32
        )
        model.train()
        model.model.vision_tower.requires_grad_(False)
        model.model.multi_modal_projector.requires_grad_(False)
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for layer in model.model.language_model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        self.model = model
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True
        )
        self.data = SyntheticBatches(
            vocab_size=model.config.text_config.vocab_size,
            seq_len=recipe.data.dataset_param.basic_parameters.cutoff_len,
            micro_batch_size=recipe.training.micro_batch_size,
            grad_accumulation=1,
            dp_rank=dist.get_rank(),
            dp_size=dist.get_world_size(),
            seed=recipe.training.seed,
        )

    def step(self) -> float:
        start = time.perf_counter()
        loss = self.model(**next(self.data)).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - start


def trainer_step(trainer) -> float:
    """The body of ``Trainer.train`` for a logged step: fetch, train_step, read back the metrics."""
    start = time.perf_counter()
    out = trainer.train_step([trainer._next_micro_batch()])
    trainer._record(out)
    return time.perf_counter() - start


def worker(model_dir: Path, steps: int, warmup: int, seq: int) -> None:
    import torch.distributed as dist

    from magistral_cli.engine.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        recipe = _recipe(model_dir, Path(tmp) / "run", steps, seq)
        trainer = Trainer(recipe)  # joins torchrun's process group
        bare = BareLoop(model_dir, recipe)
        # Alternate one step of each, so that load from other processes on the machine hits both alike.
        times: dict[str, list[float]] = {"bare": [], "trainer": []}
        for i in range(steps):
            t_bare, t_trainer = bare.step(), trainer_step(trainer)
            if i >= warmup:
                times["bare"].append(t_bare)
                times["trainer"].append(t_trainer)
        trainer.close()
    if dist.get_rank() == 0:
        b, t = statistics.median(times["bare"]), statistics.median(times["trainer"])
        print(f"bare FSDP2 loop   median step {b * 1000:8.1f} ms  ({len(times['bare'])} steps)")
        print(f"magistral trainer median step {t * 1000:8.1f} ms  ({len(times['trainer'])} steps)")
        print(f"ratio trainer / bare: {t / b:.3f}  (goal <= 1.05)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        worker(args.worker, args.steps, args.warmup, args.seq)
        return

    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_mistral3_config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
        )
        model_dir = Path(tmp) / "model"
        save_official_checkpoint(build_tiny_model(config), model_dir, dtype="float32")
        threads = max(1, (os.cpu_count() or 1) // args.nproc)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.nproc),
            "--log-dir",  # not a torchelastic_* left in /tmp
            str(Path(tmp) / "torchrun"),
        ]
        command += [
            __file__,
            "--worker",
            str(model_dir),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        command += ["--seq", str(args.seq)]
        sys.exit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
