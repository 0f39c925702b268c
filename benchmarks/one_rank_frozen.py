"""One rank, LoRA: FSDP2 gathering the frozen base every step, against the base used in place.

    python benchmarks/one_rank_frozen.py                 # hidden 1024, 4 layers, vocab 65536, fp32
    python benchmarks/one_rank_frozen.py --steps 8 --seq 512

On one rank there is nothing to shard, yet FSDP2's one-rank shortcut copies each unit's parameters
into a second, unsharded buffer at every forward and again in the backward, and keeps the root's
(the output head) for the whole step. The engine now leaves the frozen parameters stored in the
compute dtype alone there (``parallelize.left_unsharded``): a LoRA or QLoRA base, a preference
reference. This runs the tiny LoRA recipe's settings on a mid-size model (synthetic batches, the
adapters on the seven projections, the vision tower frozen) on one CPU process per side, in one
run, both sides with the same weights and data:

- ``gathered``: the frozen base managed by FSDP2, as before (``left_unsharded`` patched to leave
  nothing alone);
- ``in place``: the engine as it is.

Per side: the median step time, the ATen operators of one step and the bytes their ``copy_``
calls write (device-free measures of the host work and of the memory traffic a GPU would pay),
the peak resident memory above the process's baseline (glibc's mmap threshold fixed at 128 KiB so
freed tensors leave, as device allocations do), and the losses, which must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
TINY_LORA = REPO / "recipes" / "tiny" / "tiny_cpu_lora.yaml"


class OpCount(TorchDispatchMode):
    """ATen operators dispatched, and the bytes written by ``copy_``."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.copied = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith("copy_"):
            self.copied += args[0].numel() * args[0].element_size()
        return out


def _side(rank: int, mode: str, overrides: list[str], steps: int) -> dict:
    """One side, on a fresh process in a one-rank group."""
    from magistral_cli.config import load_recipe
    from magistral_cli.engine import parallelize
    from magistral_cli.engine.qlora import is_nf4
    from magistral_cli.engine.trainer import Trainer
    from magistral_cli.testing.memory import reset_peak, status_bytes

    if mode == "gathered":
        parallelize.left_unsharded = lambda model, group_size, dtype: {
            p for p in model.parameters() if is_nf4(p)
        }
    recipe = load_recipe(TINY_LORA, overrides)
    baseline = status_bytes("VmRSS")
    reset_peak()
    trainer = Trainer(recipe)
    try:
        losses, times = [], []
        for _ in range(steps):
            start = time.perf_counter()
            out = trainer.train_step([trainer._next_micro_batch()])
            losses.append(float(out["host"]["loss_sum"]))
            times.append(time.perf_counter() - start)
        counter = OpCount()
        with counter:
            trainer.train_step([trainer._next_micro_batch()])
        managed = sum(p.numel() for p in trainer.model.parameters() if type(p).__name__ == "DTensor")
    finally:
        trainer.close()
    return {
        "step_ms": statistics.median(times[1:]) * 1000,
        "ops": counter.count,
        "copied_mib": counter.copied / 2**20,
        "peak_mib": (status_bytes("VmHWM") - baseline) / 2**20,
        "losses": losses,
        "fsdp_managed": managed,
    }


def _plan(overrides: list[str]) -> int:
    """The dry run's peak per rank for the engine as it is (on the CPU: host bytes)."""
    from magistral_cli.config import load_recipe
    from magistral_cli.engine.memory_plan import plan_recipe

    recipe = load_recipe(TINY_LORA, overrides)
    return plan_recipe(recipe, device="cpu", world_size=1, nproc_per_node=1, detected=False).host_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side (the first is warm-up)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned sides

    from magistral_cli.runtime import spawn_ranks
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    with tempfile.TemporaryDirectory(prefix="one-rank-frozen-") as tmp:
        model_dir = Path(tmp) / "model"
        config = tiny_mistral3_config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
        )
        save_official_checkpoint(build_tiny_model(config), model_dir, num_shards=2, dtype="float32")
        rows = {}
        for mode in ("gathered", "in place"):
            overrides = [
                f"model.model_name_or_path={model_dir}",
                f"training.load={model_dir}",
                "data.dataset_param.dataset_type=synthetic",
                "data.dataset_param.synthetic.image_every=0",
                f"data.dataset_param.basic_parameters.cutoff_len={args.seq}",
                "training.micro_batch_size=1",
                f"training.train_iters={args.steps + 1}",
                f"training.output_dir={Path(tmp) / mode.replace(' ', '-')}",
                "training.save_interval=0",
                "training.resume=never",
                "parallel.nproc_per_node=1",
            ]
            rows[mode] = spawn_ranks(_side, 1, (mode, overrides, args.steps), timeout_s=1800, threads=2)[0]
        plan = _plan(overrides)
    print(
        f"shape: hidden {args.hidden}, {args.layers} decoder layers, vocab {args.vocab}, 1 x {args.seq} "
        "tokens, fp32, LoRA r 8 on the seven projections, one CPU process"
    )
    print(
        f"{'':>10} {'step ms':>9} {'ops/step':>9} {'copy_ MiB/step':>15} {'peak MiB':>9} {'FSDP-managed':>13}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:>10} {r['step_ms']:>9.1f} {r['ops']:>9} {r['copied_mib']:>15.1f} {r['peak_mib']:>9.0f} "
            f"{r['fsdp_managed']:>13,}"
        )
    print(f"the memory plan (--dry-run) of this run: {plan / 2**20:.0f} MiB")
    old, new = rows["gathered"], rows["in place"]
    same = old["losses"] == new["losses"]
    print(
        f"in place / gathered: step time {new['step_ms'] / old['step_ms']:.3f}, operators "
        f"{new['ops'] / old['ops']:.3f}, copy_ bytes {new['copied_mib'] / max(old['copied_mib'], 1e-9):.3f}, "
        f"peak memory {new['peak_mib'] / old['peak_mib']:.3f}; losses {'equal' if same else 'DIFFER'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
