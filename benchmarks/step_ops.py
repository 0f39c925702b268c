"""Operators dispatched per training step, with and without the blank vision forward.

    python benchmarks/step_ops.py                       # vision layers 2 and 6 (the tiny model's widths)
    python benchmarks/step_ops.py --vision-layers 2 24

On an accelerator every dispatched operator costs host time (a few microseconds each, far more
for a collective), so a step's operator count is a device-free measure of the host work that
keeps a GPU waiting. This counts, on the CPU with a ``TorchDispatchMode``, every ATen operator of
one text-only training step (forward, backward, optimizer; FSDP2 over one process, the vision tower
and projector frozen as in the seed's recipes) of the engine's ``Trainer``, twice in one run: with
the frozen tower's blank forward on text-only micro-batches (``blank_vision_forward`` forced on, as
before it was skipped where nothing needs it) and without. With two tower depths the per-layer cost
follows, and from it the cost at Magistral's 24 vision layers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

FROZEN_TEXT_ONLY = [
    "model.freeze=[model.vision_tower,model.multi_modal_projector]",
    "data.dataset_param.synthetic.image_every=0",
    "parallel.fsdp_plan.apply_modules=[model.vision_tower.transformer.layers.{*},model.multi_modal_projector,"
    "model.language_model.embed_tokens,model.language_model.layers.{*}]",
]


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def step_ops(work: Path, vision_layers: int) -> dict[str, int]:
    from engine.helpers import VOCAB, make_recipe

    from magistral_cli.engine.parallelize import apply_prefetch
    from magistral_cli.engine.trainer import Trainer
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    model_dir = work / f"model-{vision_layers}"
    config = tiny_mistral3_config(vocab_size=VOCAB, vision_layers=vision_layers)
    save_official_checkpoint(build_tiny_model(config), model_dir, num_shards=2, dtype="float32")
    counts = {}
    for blank in (True, False):
        recipe = make_recipe(
            model_dir, work / f"run-{vision_layers}-{blank}", FROZEN_TEXT_ONLY, train_iters=4
        )
        trainer = Trainer(recipe)
        try:
            if blank:
                trainer.model.blank_vision_forward = True
                apply_prefetch(trainer.model, recipe.parallel.fsdp_plan)
            trainer.train_step([trainer._next_micro_batch()])  # the optimizer's state exists from here
            counter = OpCount()
            with counter:
                trainer.train_step([trainer._next_micro_batch()])
            counts["blank forward" if blank else "skipped"] = counter.count
        finally:
            trainer.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vision-layers", type=int, nargs=2, default=[2, 6], metavar=("A", "B"))
    parser.add_argument("--at", type=int, default=24, help="the depth to extrapolate to (Magistral: 24)")
    args = parser.parse_args()
    (a, b), rows = args.vision_layers, {}
    with tempfile.TemporaryDirectory(prefix="step-ops-") as tmp:
        for layers in (a, b):
            rows[layers] = step_ops(Path(tmp), layers)
    print(f"{'vision layers':>14} {'blank forward':>14} {'skipped':>8} {'difference':>11}")
    for layers, c in rows.items():
        print(
            f"{layers:>14} {c['blank forward']:>14} {c['skipped']:>8} {c['blank forward'] - c['skipped']:>11}"
        )
    cost = {layers: c["blank forward"] - c["skipped"] for layers, c in rows.items()}
    per_layer = (cost[b] - cost[a]) / (b - a)
    fixed = cost[a] - per_layer * a
    print(
        f"the blank forward: {fixed:.0f} + {per_layer:.0f} per vision layer operators per text-only "
        f"micro-batch; at {args.at} layers {fixed + per_layer * args.at:.0f}"
    )


if __name__ == "__main__":
    main()
