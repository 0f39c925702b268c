"""One training step at real widths: the engine (`magistral train`) against a bare PyTorch loop.

    python benchmarks/gpu_step.py --device cuda                       # real widths, 2 layers, 2 x 4096, bf16
    python benchmarks/gpu_step.py --device cuda --layers 4 --compile  # per-block torch.compile on the engine side
    python benchmarks/gpu_step.py --device cpu                        # tiny widths, 2 x 256, fp32 (CI keeps it working)
    python benchmarks/gpu_step.py --device cuda --lora 16             # LoRA r 16 on both sides (the one-GPU case)
    python benchmarks/gpu_step.py --device cuda --no-reshard          # the engine with reshard_after_forward: false
    python benchmarks/gpu_step.py --device cuda --also-no-reshard     # the engine both ways, and the bare loop

Both sides train the same shape in one run, one after the other on the same device:

- **engine**: `magistral train` on a recipe it writes (synthetic text-only batches of exactly
  micro-batch x sequence tokens, random weights, `init_model_with_meta_device: false`, FSDP2 over
  one process, bf16 compute with fp32 master weights and fp32 gradient reduction on an accelerator,
  sdpa, fused AdamW where it runs, the vision tower frozen as in the seed's recipes). Its step
  times, TFLOP/s and peak memory come from the run's metrics.jsonl, its memory plan from
  `magistral train --dry-run --json`.
- **bare**: transformers' `MistralForCausalLM` at the same text widths in this process, fp32
  weights, autocast bf16 on an accelerator, fused AdamW where it runs, `loss.item()` every step.

With `--lora R` both sides train LoRA adapters (rank R, alpha 2R, the seven projections of every
decoder layer) on a frozen base: the engine through `model.lora` (base stored in bf16 on an
accelerator), the bare loop through PEFT's `get_peft_model` on a bf16 base (PEFT keeps the adapters
in fp32) under autocast. The FLOPs keep the 6N convention on both sides (a frozen weight has no
weight-gradient product, so the device does about 2/3 of it): the ratio compares like with like.
- **inside** (`--inside`, on by default): the engine's `Trainer` in this process for a few steps,
  to count host synchronisations per step (`torch.cuda.set_sync_debug_mode` on CUDA, value lineage
  on the CPU: `magistral_cli.testing.host_sync`) and, with `--profile`, the top kernels of two
  steps of each side (torch.profiler).

With `--profile DIR` each side also reports its device time over two more steps after the timed
ones (`magistral_cli.engine.trace_gaps`): busy and idle time, the idle gaps, how much of them the
device spent waiting for the host to launch work, and where the host was for the longest ones. The
engine's comes from its own `tools.profile` trace of the real training loop (data, logging and the
step's one read included), the bare loop's from the same profiler in this process.

Widths: `real` reads the published config.json (hidden 5120, 32 heads, 8 KV heads, intermediate
32768, vocab 131072, untied head) and keeps `--layers` decoder layers; `tiny` is the test model's
widths. MFU = model FLOPs per token (`magistral_cli.model_config.training_flops_per_token`:
6 x decoder and head matmul parameters + 6 x layers x heads x head_dim x sequence) x tokens/s /
the device's bf16 peak (`--peak-tflops` overrides; none on the CPU). Prints one table and the
engine / bare ratios; `--json FILE` writes the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PUBLISHED_CONFIG = REPO / "tests" / "fixtures" / "magistral-small-2509" / "config.json"


# ---------------------------------------------------------------------------------- model and recipe
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Steps profiled on each side with --profile: two, so that a step boundary (the loop's own host work
#: between one step's last kernel and the next one's first) is in the trace.
PROFILED_STEPS = 2
#: The row of ``--also-no-reshard``: the engine again with ``reshard_after_forward: false``.
NO_RESHARD = "engine_no_reshard"


def profiled_steps(args) -> tuple[int, int]:
    """The engine's first and last profiled step with --profile: the ``PROFILED_STEPS`` after the timed ones."""
    first = args.warmup + args.steps + 1
    return first, first + PROFILED_STEPS - 1


def write_model_dir(directory: Path, widths: str, layers: int) -> dict:
    """config.json for the benchmark's model (no weights: both sides start from random ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    if widths == "real":
        config = json.loads(PUBLISHED_CONFIG.read_text())
        config["text_config"]["num_hidden_layers"] = layers
    else:
        from magistral_cli.testing.tiny_model import official_config_dict, tiny_mistral3_config

        config = official_config_dict(
            tiny_mistral3_config(
                vocab_size=8192, hidden_size=256, num_hidden_layers=layers, num_attention_heads=8
            )
        )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return config


def engine_recipe(args, model_dir: Path, run_dir: Path) -> dict:
    accel = args.device != "cpu"
    return {
        "parallel": {
            "device": args.device,
            "nproc_per_node": 1,
            "fsdp_plan": {
                "apply_modules": [
                    "model.vision_tower",
                    "model.multi_modal_projector",
                    "model.language_model.embed_tokens",
                    "model.language_model.layers.{*}",
                ],
                "param_dtype": "bf16" if accel else "fp32",
                "reduce_dtype": "fp32",
                "reshard_after_forward": args.reshard_after_forward,
            },
        },
        "data": {
            "dataset_param": {
                "dataset_type": "synthetic",
                "basic_parameters": {"cutoff_len": args.seq},
                "synthetic": {"image_every": 0, "full_length": True},
            }
        },
        "model": {
            "model_name_or_path": str(model_dir),
            "attn_implementation": "sdpa",
            "freeze": ["model.vision_tower", "model.multi_modal_projector"],
            "compile": args.compile,
            **(
                {"lora": {"r": args.lora, "alpha": 2 * args.lora, "target_modules": LORA_TARGETS}}
                if args.lora
                else {}
            ),
        },
        "features": {"loss_cfg": {"loss_type": "per_token_loss"}},
        "training": {
            "micro_batch_size": args.micro_batch,
            "gradient_accumulation_steps": 1,
            # With --profile, two more steps under tools.profile (not timed): the trace of the real loop.
            "train_iters": args.warmup + args.steps + (PROFILED_STEPS if args.profile else 0),
            "lr": 1.0e-5,
            "lr_decay_style": "constant",
            "init_model_with_meta_device": False,
            "adam_fused": accel,
            "log_interval": 1,
            "save_interval": 0,
            "resume": "never",
            "output_dir": str(run_dir),
        },
        "tools": {
            "peak_tflops": args.peak_tflops,
            **(
                {
                    "profile": {
                        "enable": True,
                        "static_param": {
                            "start_step": profiled_steps(args)[0],
                            "end_step": profiled_steps(args)[1] + 1,
                        },
                    }
                }
                if args.profile
                else {}
            ),
        },
    }


# ---------------------------------------------------------------------------------- the engine
def _magistral(*argv: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "magistral_cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_engine(args, work: Path, model_dir: Path, name: str = "engine") -> dict:
    import yaml

    run_dir = work / f"{name}-run"
    recipe_path = work / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(engine_recipe(args, model_dir, run_dir)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    plan = _magistral("train", str(recipe_path), "--dry-run", "--json", env=env, timeout=600)
    if plan.returncode != 0:
        raise SystemExit(f"magistral train --dry-run failed ({plan.returncode}):\n{plan.stderr[-4000:]}")
    planned = json.loads(plan.stdout)["memory_plan"]
    shutil_rmtree(run_dir)
    start = time.perf_counter()
    proc = _magistral("train", str(recipe_path), env=env, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"magistral train failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [
        r for r in lines if r.get("split") is None and args.warmup < r["step"] <= args.warmup + args.steps
    ]
    if not steps:
        raise SystemExit("the engine logged no step after the warm-up")
    step_ms = statistics.median(r["step_time_ms"] for r in steps)
    peak = max((r.get("peak_allocated_mib") or 0) for r in lines)
    return {
        "step_ms": step_ms,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "tokens_per_step": steps[-1]["tokens"],
        "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in steps)
        if steps[-1].get("tflops_per_gpu") is not None
        else None,
        "mfu": statistics.median(r["mfu"] for r in steps) if steps[-1].get("mfu") is not None else None,
        "peak_gib": peak / 1024 if peak else None,
        # On the CPU the device is host memory: the plan's host figure is the comparable one.
        "planned_gib": ((planned or {}).get("memory") or {}).get(
            "per_rank_device_gib" if args.device != "cpu" else "per_rank_host_gib"
        ),
        "losses": [r["loss"] for r in lines if r.get("split") is None],
        "wall_s": wall,
        "device_time": _engine_device_time(args, run_dir),
    }


def _engine_device_time(args, run_dir: Path) -> list[str] | None:
    """The device-time report of the engine run's profiled steps (``tools.profile``'s trace)."""
    if not args.profile:
        return None
    first, last = profiled_steps(args)
    trace = run_dir / "profiling" / f"rank0_steps{first}-{last}.json"
    if not trace.is_file():
        return [f"no trace at {trace}"]
    return _device_time_lines(trace)


def _device_time_lines(trace: Path) -> list[str]:
    from magistral_cli.engine.trace_gaps import device_time

    report = device_time(trace)
    return ["no device work in the trace"] if report is None else report.lines(steps=PROFILED_STEPS)


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------- the bare loop
def _device(args):
    import torch

    return torch.device(args.device, 0) if args.device != "cpu" else torch.device("cpu")


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class BareLoop:
    """forward (autocast bf16 on an accelerator), backward, AdamW, loss.item(): what people write by hand."""

    def __init__(self, args, config: dict):
        import torch
        from transformers import MistralConfig, MistralForCausalLM

        self.device = _device(args)
        text = dict(config["text_config"])
        text.pop("model_type", None)
        cfg = MistralConfig(**text)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with self.device:
            self.model = MistralForCausalLM(cfg).float().train()
        if args.lora:
            from peft import LoraConfig, get_peft_model

            if self.device.type != "cpu":
                self.model = self.model.to(torch.bfloat16)  # the frozen base in bf16; PEFT's adapters fp32
            lora = LoraConfig(
                r=args.lora, lora_alpha=2 * args.lora, target_modules=LORA_TARGETS, lora_dropout=0.0
            )
            self.model = get_peft_model(self.model, lora).train()
        fused = self.device.type != "cpu"
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-5, fused=fused, foreach=not fused)
        self.autocast = self.device.type != "cpu"
        g = torch.Generator().manual_seed(1)
        self.batch = torch.randint(1000, cfg.vocab_size, (args.micro_batch, args.seq), generator=g).to(
            self.device
        )

    def step(self) -> float:
        import torch

        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - start

    def close(self) -> None:
        del self.model, self.opt, self.batch
        gc.collect()


def run_bare(args, config: dict) -> dict:
    device = _device(args)
    _reset_peak(device)
    bare = BareLoop(args, config)
    times = [bare.step() for _ in range(args.warmup + args.steps)][args.warmup :]
    peak = _peak_gib(device)
    profile, device_time = _profile(args, "bare", bare.step) if args.profile else (None, None)
    bare.close()
    _reset_peak(device)  # hand the cached blocks back before the next side builds its model
    step = statistics.median(times)
    tokens = args.micro_batch * args.seq
    return {
        "step_ms": step * 1000,
        "tokens_per_s": tokens / step,
        "tokens_per_step": tokens,
        "peak_gib": peak,
        "profile": profile,
        "device_time": device_time,
    }


# ---------------------------------------------------------------------------------- inside the engine
def _profile(args, name: str, step) -> tuple[str, list[str]]:
    """The top kernels of ``PROFILED_STEPS`` profiled steps (after the timed ones), as torch.profiler's
    table, after their device-time report (``engine.trace_gaps``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = _device(args)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        _synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        device_time = _device_time_lines(trace)
    averages = prof.key_averages()
    tables = [f"{name}, {PROFILED_STEPS} steps:", *device_time, ""]
    # By device time (what the kernels cost) and by host time (what launching them costs: a step
    # whose host time exceeds its device time leaves the device idle).
    for sort in (["cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        tables.append(f"sorted by {sort}\n")
        tables.append(averages.table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=70))
    out = Path(args.profile) / f"{name}_top_kernels.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(tables))
    del torch
    return str(out), device_time


def run_inside(args, work: Path, model_dir: Path) -> dict:
    """The Trainer in this process: host synchronisations per step (and a profile of one step)."""
    import warnings

    import torch

    from magistral_cli.config.loader import validate_recipe
    from magistral_cli.engine.trainer import Trainer
    from magistral_cli.testing.host_sync import HostSyncCounter

    recipe = engine_recipe(args, model_dir, work / "inside-run")
    recipe["training"]["train_iters"] = 100
    trainer = Trainer(validate_recipe(recipe))
    device = trainer.device
    per_step: list[int] = []
    sites: dict[str, int] = {}
    try:
        trainer.train_step([trainer._next_micro_batch()])  # warm-up: optimizer state, allocator
        for _ in range(3):
            batches = [trainer._next_micro_batch()]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        trainer.train_step(batches)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                found = [w for w in caught if "synchroniz" in str(w.message)]
                per_step.append(len(found))
                for w in found:
                    key = f"{Path(w.filename).name}:{w.lineno}"
                    sites[key] = sites.get(key, 0) + 1
            else:
                with HostSyncCounter() as counter:
                    counter.mark_host(v for b in batches for v in b.values() if isinstance(v, torch.Tensor))
                    trainer.train_step(batches)
                per_step.append(counter.count)
                for key, n in counter.sites.items():
                    sites[key] = sites.get(key, 0) + n
        profile = None
        if args.profile:
            profile, _ = _profile(args, "engine", lambda: trainer.train_step([trainer._next_micro_batch()]))
    finally:
        trainer.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"syncs_per_step": per_step, "sync_sites": sites, "profile": profile}


# ---------------------------------------------------------------------------------- report
def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda", "npu"])
    parser.add_argument(
        "--widths", choices=["real", "tiny"], help="default: real on an accelerator, tiny on the CPU"
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 4096; 256 on the CPU)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--compile", action="store_true", help="the engine compiles each block (model.compile)"
    )
    parser.add_argument("--lora", type=int, metavar="R", help="train LoRA adapters of rank R on both sides")
    parser.add_argument(
        "--no-reshard",
        dest="reshard_after_forward",
        action="store_false",
        help="the engine with reshard_after_forward: false (every unit gathered from its forward to its "
        "backward: no second cast and copy in the backward, for 2 more bytes per trainable parameter)",
    )
    parser.add_argument(
        "--also-no-reshard",
        action="store_true",
        help="time the engine a second time with reshard_after_forward: false (a third row, its own ratio)",
    )
    parser.add_argument("--peak-tflops", type=float, help="bf16 peak per device (default: the known table)")
    parser.add_argument("--no-inside", dest="inside", action="store_false", help="skip the sync count")
    parser.add_argument(
        "--profile", metavar="DIR", help="write each side's top kernels and device time of two steps here"
    )
    parser.add_argument("--profile-rows", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for the engine's run")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args()
    if args.also_no_reshard and not args.reshard_after_forward:
        parser.error("--also-no-reshard times the engine with and without resharding; drop --no-reshard")
    args.widths = args.widths or ("tiny" if args.device == "cpu" else "real")
    args.seq = args.seq or (256 if args.device == "cpu" else 4096)

    from magistral_cli.model_config import training_flops_per_token
    from magistral_cli.runtime import peak_tflops_of

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        config = write_model_dir(model_dir, args.widths, args.layers)
        from transformers import MistralConfig

        text = dict(config["text_config"])
        text.pop("model_type", None)
        flops_per_token = training_flops_per_token(MistralConfig(**text), args.seq)
        peak = args.peak_tflops
        if peak is None and args.device == "cuda":
            import torch

            peak = peak_tflops_of(torch.cuda.get_device_name(0))
        print(
            f"shape: {args.widths} widths, {args.layers} decoder layers, {args.micro_batch} x {args.seq} tokens, "
            + (f"LoRA r {args.lora}, " if args.lora else "")
            + ("engine without reshard_after_forward, " if not args.reshard_after_forward else "")
            + f"{'bf16' if args.device != 'cpu' else 'fp32'} on {args.device}; "
            f"{flops_per_token / 1e9:.2f} GFLOP per token; peak {_fmt(peak)} TFLOP/s",
            flush=True,
        )
        results = {"args": vars(args), "flops_per_token": flops_per_token, "peak_tflops": peak}
        results["engine"] = run_engine(args, work, model_dir)
        print(f"engine: median step {results['engine']['step_ms']:.1f} ms", flush=True)
        if args.also_no_reshard:
            variant = argparse.Namespace(**{**vars(args), "reshard_after_forward": False, "profile": None})
            results[NO_RESHARD] = run_engine(variant, work, model_dir, name="engine-no-reshard")
            print(f"{NO_RESHARD}: median step {results[NO_RESHARD]['step_ms']:.1f} ms", flush=True)
        results["bare"] = run_bare(args, config)
        print(f"bare:   median step {results['bare']['step_ms']:.1f} ms", flush=True)
        if args.inside:
            results["inside"] = run_inside(args, work, model_dir)

    sides = [s for s in ("engine", NO_RESHARD, "bare") if s in results]
    for side in sides:
        r = results[side]
        tflops = flops_per_token * r["tokens_per_s"] / 1e12
        r["model_tflops"] = tflops
        r["mfu_computed"] = tflops / peak if peak else None
    e, b = results["engine"], results["bare"]
    results["ratio_speed"] = b["step_ms"] / e["step_ms"]  # engine speed / bare speed (>= 0.95 is the goal)
    if NO_RESHARD in results:
        results["ratio_speed_no_reshard"] = b["step_ms"] / results[NO_RESHARD]["step_ms"]
    print()
    print(
        f"{'':18} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {'plan GiB':>9}"
    )
    for side in sides:
        r = results[side]
        mfu = r["mfu_computed"]
        print(
            f"{side:18} {r['step_ms']:9.1f} {r['tokens_per_s']:10.0f} {r['model_tflops']:9.1f} "
            f"{_fmt(None if mfu is None else 100 * mfu):>6}% {_fmt(r.get('peak_gib'), '.2f'):>9} "
            f"{_fmt(r.get('planned_gib'), '.2f'):>9}"
        )
    if e.get("tflops_per_gpu") is not None:
        print(
            f"engine's own metrics.jsonl: {e['tflops_per_gpu']:.1f} TFLOP/s per device, mfu {_fmt(e.get('mfu'), '.3f')}"
        )
    print(f"engine / bare speed: {results['ratio_speed']:.3f}  (goal >= 0.95)")
    if NO_RESHARD in results:
        print(f"{NO_RESHARD} / bare speed: {results['ratio_speed_no_reshard']:.3f}")
    if "inside" in results:
        inside = results["inside"]
        print(
            f"host synchronisations per engine step: {inside['syncs_per_step']}  sites: {inside['sync_sites']}"
        )
    if args.profile:
        print(f"top kernels: {b.get('profile')}, {results.get('inside', {}).get('profile')}")
        for side, what in (("engine", "magistral train"), ("bare", "bare loop")):
            print(f"device time, {side} ({what}), {PROFILED_STEPS} profiled steps after the timed ones:")
            print("\n".join(f"  {x}" for x in results[side].get("device_time") or []))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
