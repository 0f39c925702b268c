"""LoRA and QLoRA vs full fine-tuning through the trainer on 2 CPU processes: per-rank memory and step time.

Side by side in one run, for the tiny model and a mid-size one (both Magistral's structure): each
case starts 2 gloo ranks (``runtime.spawn_ranks``), builds the engine's ``Trainer`` from a recipe
(fp32, the tiny recipe's FSDP2 units, synthetic batches) and trains ``--steps`` steps. Per rank:

- **held tensors**: the bytes of this rank's parameter shards, gradient shards and AdamW states
  after the last step (what the memory plan's first three items estimate; an NF4 weight counts its
  4-bit data, scales and quantisation factors);
- **peak RSS of the build**: the peak resident memory while the trainer was built and the base
  loaded (QLoRA: each weight read whole and quantised, one at a time), above the start;
- **peak RSS above the start**: the process's peak resident memory (``VmHWM``, reset just before the
  trainer is built) minus its resident memory at that point (imports and the process group excluded);
- **step time**: the median of the steps after the first two.

    python benchmarks/lora_vs_full.py [--steps 8] [--seq 256] [--r 8] [--modes full lora qlora]

QLoRA (``quantize_base: nf4``, blocks 64 x 256; needs torchao) dequantises into the fp32 compute
dtype here. The ratios (LoRA / full, QLoRA / LoRA) are what the README quotes; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS = {
    # name: tiny_mistral3_config keyword arguments
    "tiny": {"vocab_size": 8192, "hidden_size": 64, "num_hidden_layers": 2},
    "mid": {"vocab_size": 32768, "hidden_size": 512, "num_hidden_layers": 8},
    # decoder-heavy (75M of 84M parameters in the decoder's projections): where QLoRA's NF4 base shows
    "wide": {"vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 8},
}


def _rss_kib() -> int:
    from magistral_cli.testing.memory import status_bytes

    return status_bytes("VmRSS") // 1024


def _hwm_kib() -> int:
    from magistral_cli.testing.memory import status_bytes

    return status_bytes("VmHWM") // 1024


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if hasattr(local, "quantized_data"):  # NF4: what it stores, not its nominal dtype
            parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
            total += sum(x.numel() * x.element_size() for x in parts)
            continue
        total += local.numel() * local.element_size()
    return total


def _rank(rank: int, model_dir: str, run_dir: str, mode: str, steps: int, seq: int, r: int) -> dict:
    import torch

    from magistral_cli.config.loader import validate_recipe
    from magistral_cli.engine.trainer import Trainer
    from magistral_cli.testing.memory import reset_peak

    model_cfg: dict = {
        "model_name_or_path": model_dir,
        "freeze": ["model.vision_tower", "model.multi_modal_projector"],
    }
    if mode in ("lora", "qlora"):
        model_cfg["lora"] = {"r": r, "alpha": 2 * r, "target_modules": TARGETS}
    if mode == "qlora":
        model_cfg["lora"]["quantize_base"] = "nf4"
    recipe = validate_recipe(
        {
            "parallel": {"device": "cpu", "fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
            "data": {"dataset_param": {"dataset_type": "synthetic", "basic_parameters": {"cutoff_len": seq}}},
            "model": model_cfg,
            "training": {
                "micro_batch_size": 1,
                "train_iters": steps,
                "lr": 1.0e-4,
                "lr_decay_style": "constant",
                "load": model_dir,
                "output_dir": run_dir,
                "save_interval": 0,
                "init_model_with_meta_device": True,
                "seed": 0,
            },
        }
    )
    start_rss = _rss_kib()
    reset_peak()  # the high-water mark restarts here
    trainer = Trainer(recipe)
    build_peak = _hwm_kib() - start_rss
    try:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train(max_steps=1)
            times.append(time.perf_counter() - t0)
        params = list(trainer.model.parameters())
        grads_bytes = _local_bytes([p.grad for p in params if p.grad is not None])
        states = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {
            "params_mib": _local_bytes(params) / 2**20,
            "peak_build_mib": build_peak / 1024,
            "grads_mib": grads_bytes / 2**20,
            "optimizer_mib": _local_bytes(s for s in states if s.dim() > 0) / 2**20,
            # VmHWM since the reset before the build (ru_maxrss can keep an earlier high-water mark).
            "peak_rss_above_start_mib": (_hwm_kib() - start_rss) / 1024,
            "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
            "trainable": sum(p.numel() for p in params if p.requires_grad),
        }
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=["tiny", "mid"], choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora", "qlora"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from magistral_cli.runtime import spawn_ranks
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    rows = []
    with tempfile.TemporaryDirectory(prefix="magistral-lora-bench-") as tmp:
        for name in args.models:
            model_dir = Path(tmp) / name
            model = build_tiny_model(tiny_mistral3_config(**MODELS[name]), seed=0)
            total = sum(p.numel() for p in model.parameters())
            save_official_checkpoint(model, model_dir, num_shards=2, dtype="float32")
            del model
            for mode in args.modes:
                ranks = spawn_ranks(
                    _rank,
                    2,
                    (str(model_dir), str(Path(tmp) / f"{name}-{mode}"), mode, args.steps, args.seq, args.r),
                    timeout_s=1800,
                )
                rows.append({"model": name, "parameters": total, "mode": mode, "ranks": ranks})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"2 CPU ranks, fp32, sequence {args.seq}, LoRA r={args.r} on {len(TARGETS)} projections per layer")
    header = (
        "model  mode   trainable     params+grads+AdamW MiB/rank  build peak MiB/rank"
        "  peak RSS above start MiB/rank  step s"
    )
    print(header)
    by = {}
    for row in rows:
        ranks = row["ranks"]
        held = max(x["params_mib"] + x["grads_mib"] + x["optimizer_mib"] for x in ranks)
        rss = max(x["peak_rss_above_start_mib"] for x in ranks)
        step = max(x["step_s"] for x in ranks)
        build = max(x["peak_build_mib"] for x in ranks)
        by[(row["model"], row["mode"])] = (held, rss, step)
        print(
            f"{row['model']:<5}  {row['mode']:<5}  {ranks[0]['trainable']:>11,}  {held:>27.1f}  {build:>19.1f}"
            f"  {rss:>29.1f}  {step:>6.3f}"
        )
    for name in args.models:
        for new, old in (("lora", "full"), ("qlora", "lora")):
            if (name, new) in by and (name, old) in by:
                (oh, o_rss, os_), (nh, n_rss, ns) = by[(name, old)], by[(name, new)]
                print(
                    f"{name}: {new} / {old} = {nh / oh:.2f}x held tensors, {n_rss / o_rss:.2f}x peak RSS above "
                    f"start, {ns / os_:.2f}x step time"
                )


if __name__ == "__main__":
    main()
