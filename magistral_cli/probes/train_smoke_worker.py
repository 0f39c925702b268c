"""One rank of the ``train-smoke`` probe (started by torchrun; see probes/train_smoke.py).

Trains the small synthetic Mistral3 under FSDP2 (each decoder layer, then the root) with our
per-image vision attention, for ``--steps`` steps on one image per sample (``default``) or two
(``multi``). Each rank appends one JSON line per step to ``<out>/rank<N>.jsonl``: step, loss,
whether its local gradient shards are finite, and their norm. It checks nothing itself: the
parent reads the lines and decides, so a rank that dies or skips a step is caught there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
SEQUENCE_LENGTH = 256


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    parser.add_argument("--mode", choices=("default", "multi"), default="default")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--poison-step", type=int, default=0, help="Tests: make this step's loss NaN.")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.ops.vision_attention import apply_vision_attention

    from .synthetic import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, probe_mistral3_config

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "npu":
        import torch_npu  # noqa: F401

        torch.npu.set_device(local_rank)
    elif args.device == "cuda":
        torch.cuda.set_device(local_rank)
    device = torch.device(args.device, local_rank) if args.device != "cpu" else torch.device("cpu")
    dist.init_process_group(BACKENDS[args.device])
    log = (args.out / f"rank{rank}.jsonl").open("a", encoding="utf-8")

    def emit(record: dict) -> None:
        line = json.dumps({"probe": "train-smoke", "rank": rank, **record})
        log.write(line + "\n")
        log.flush()

    try:
        torch.manual_seed(42)  # the same initial weights on every rank
        model = Mistral3ForConditionalGeneration(probe_mistral3_config())
        apply_vision_attention(model, args.device)
        model.to(device).train()
        # As in the seed's smoke: the tower and projector are frozen, the decoder trains.
        model.model.vision_tower.requires_grad_(False)
        model.model.multi_modal_projector.requires_grad_(False)

        mesh = init_device_mesh(args.device, (world,))
        # bf16 compute with fp32 gradients reduced: the engine's default mixed precision.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.language_model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        images = 1 if args.mode == "default" else 2
        generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own sample
        input_ids = torch.randint(3, IMAGE_TOKEN_ID - 1, (1, SEQUENCE_LENGTH), generator=generator)
        input_ids[:, 1 : 1 + TOKENS_PER_IMAGE * images] = IMAGE_TOKEN_ID
        labels = input_ids.clone()
        labels[labels == IMAGE_TOKEN_ID] = -100
        pixel_values = torch.randn(images, 3, 16, 16, generator=generator)
        image_sizes = torch.tensor([[16, 16]] * images)
        input_ids, labels, pixel_values, image_sizes = (
            t.to(device) for t in (input_ids, labels, pixel_values, image_sizes)
        )

        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            output = model(
                input_ids=input_ids,
                pixel_values=pixel_values,
                image_sizes=image_sizes,
                labels=labels,
                use_cache=False,
            )
            loss = output.loss
            if step == args.poison_step:
                loss = loss * float("nan")
            loss.backward()
            squares, finite = 0.0, True
            for parameter in model.parameters():
                if parameter.grad is None:
                    continue
                grad = parameter.grad.to_local() if hasattr(parameter.grad, "to_local") else parameter.grad
                finite = finite and bool(torch.isfinite(grad).all())
                squares += float(grad.float().square().sum())
            optimizer.step()
            emit(
                {
                    "step": step,
                    "loss": float(loss.detach().float()),
                    "grads_finite": finite,
                    "local_grad_norm": math.sqrt(squares) if math.isfinite(squares) else squares,
                    "step_time_ms": (time.perf_counter() - start) * 1000.0,
                }
            )
        emit(
            {
                "done": True,
                "steps": args.steps,
                "mode": args.mode,
                "world_size": world,
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )
        dist.barrier()
    finally:
        log.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    from magistral_cli.runtime import finish_rank_process

    main()
    finish_rank_process(0)
