"""Training throughput without packing, with packing and with neat packing, on 2 CPU processes.

Side by side in one run, on the quickstart's tiny model and synthetic LLaVA data (``quickstart.
write_assets``: the same model, tokenizer, images and length distribution, ``--samples`` of them)
at ``cutoff_len`` ``--cutoff`` (2048): the data is preprocessed once, then each mode starts 2 gloo
ranks (``runtime.spawn_ranks``), builds the engine's ``Trainer`` from ``recipes/tiny/tiny_cpu.yaml``
with overrides (micro-batch 2, chunked loss so that a 2 x 2048-token micro-batch's logits stay
small, no checkpoints) and trains ``--steps`` steps. The modes differ in one override only:

- ``none``: one sample per row, rows padded to the longest of their micro-batch;
- ``packing``: ``basic_parameters.packing=true`` (packs up to cutoff_len, causal across samples);
- ``neat``: ``basic_parameters.neat_packing=true`` (each sample attends to itself only).

Per mode, over the steps after the first ``--warmup``:

- **tokens/s**: non-padding tokens per second, from the run's metrics.jsonl (``tokens``, the global
  batch's non-padding tokens, over ``step_time_ms``);
- **real fraction**: non-padding tokens / all tokens of the micro-batches the ranks trained on (the
  same loader replayed here: ``data.loader.build_train_dataloader`` for each rank), next to the
  dry run's estimate (``data.packing.estimate_padding`` on the preprocess report's histogram);
- **padded tokens/s**: all tokens, padding included, per second: tokens/s = real fraction x this;
- **step time**: the mean over those steps.

    python benchmarks/packing.py [--steps 6] [--warmup 2] [--samples 512] [--cutoff 2048]

What the ratios mean here: the tiny model's attention is cheap (hidden 64, 4 heads) next to its
131,072-token vocabulary, and on the CPU the packed attention is SDPA with a block mask, which
computes every query-key pair of a row whatever its segments: neat packing costs what plain
packing costs, and a gap between the two is the machine's noise. What packing gains is then
(1) the padding it removes (the real-fraction ratio) and (2) the per-step costs that do not grow
with the tokens (the AdamW step, FSDP's all-gathers and reduce-scatters, Python), spread over the
many more tokens of a packed step (the padded-tokens/s ratio); tokens/s is their product. A larger
micro-batch without packing would also get (2). On accelerators with the varlen kernels neat
packing also skips the attention between samples, which this benchmark cannot show.
The ratios (plain / none, neat / none) are what the README quotes; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
MODES = {
    "none": [],
    "packing": ["data.dataset_param.basic_parameters.packing=true"],
    "neat": ["data.dataset_param.basic_parameters.neat_packing=true"],
}


def _overrides(assets: dict, args, mode: str, run_dir: Path) -> list[str]:
    return [
        f"data.dataset_param.preprocess_parameters.model_name_or_path={assets['model']}",
        f"model.model_name_or_path={assets['model']}",
        f"training.load={assets['model']}",
        f"data.dataset_param.basic_parameters.dataset_dir={assets['data_dir']}",
        f"data.dataset_param.basic_parameters.dataset={assets['dataset']}",
        f"data.dataset_param.basic_parameters.cache_dir={assets['cache']}",
        f"data.dataset_param.basic_parameters.cutoff_len={args.cutoff}",
        f"training.micro_batch_size={args.micro_batch}",
        "features.enable_chunk_loss=true",
        f"features.chunkloss_plan.chunk_size={args.chunk_size}",
        f"training.train_iters={args.steps}",
        "training.save_interval=0",
        "training.log_interval=1",
        f"training.output_dir={run_dir}",
        *MODES[mode],
    ]


def _rank(rank: int, overrides: list[str]) -> dict:
    from magistral_cli.config import load_recipe
    from magistral_cli.engine.trainer import Trainer

    trainer = Trainer(load_recipe(RECIPE, overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"rank": rank}


def _replayed_padding(overrides: list[str], steps: int, world: int) -> list[tuple[int, int]]:
    """(real, all) tokens of each step's micro-batches over the ranks, as the ranks' loaders give them."""
    from magistral_cli.config import load_recipe
    from magistral_cli.data.loader import build_train_dataloader, prepare_dataset

    recipe = load_recipe(RECIPE, overrides)
    dataset = prepare_dataset(recipe)
    per_step = [[0, 0] for _ in range(steps)]
    for rank in range(world):
        loader = iter(build_train_dataloader(recipe, dataset, dp_rank=rank, dp_size=world))
        for step in range(steps):
            mask = next(loader)["attention_mask"]
            per_step[step][0] += int(mask.sum())
            per_step[step][1] += mask.numel()
    return [(real, total) for real, total in per_step]


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if "split" not in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--cutoff", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")

    from magistral_cli.config import load_recipe
    from magistral_cli.data.packing import estimate_padding
    from magistral_cli.data.pipeline import run_preprocess
    from magistral_cli.quickstart import write_assets
    from magistral_cli.runtime import spawn_ranks

    world = 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="magistral-packing-bench-") as tmp:
        assets = write_assets(Path(tmp), args.samples)
        prepared = run_preprocess(load_recipe(RECIPE, _overrides(assets, args, "none", Path(tmp) / "x")))
        report = prepared.report
        estimate = estimate_padding(args.cutoff, args.micro_batch, histogram=report["length_histogram"])
        for mode in args.modes:
            run_dir = Path(tmp) / f"run-{mode}"
            overrides = _overrides(assets, args, mode, run_dir)
            spawn_ranks(_rank, world, (overrides,), timeout_s=3600)
            records = _metrics(run_dir)[args.warmup :]
            padding = _replayed_padding(overrides, args.steps, world)[args.warmup :]
            seconds = sum(r["step_time_ms"] for r in records) / 1000
            tokens = sum(r["tokens"] for r in records)
            real, total = (sum(x) for x in zip(*padding, strict=True))
            rows.append(
                {
                    "mode": mode,
                    "steps": len(records),
                    "tokens_per_s": tokens / seconds,
                    "padded_tokens_per_s": total / seconds,
                    "real_fraction": real / total,
                    "estimated_real_fraction": estimate[
                        "none" if mode == "none" else "packing"
                    ].real_fraction,
                    "step_s": seconds / len(records),
                    "tokens_per_step": tokens / len(records),
                    # The replayed loader must be what the ranks trained on.
                    "replay_matches_metrics": real == tokens,
                }
            )
    if args.json:
        print(json.dumps({"samples": report["kept"], "cutoff_len": args.cutoff, "rows": rows}, indent=2))
        return
    print(
        f"2 CPU ranks, fp32, {report['kept']} quickstart samples (lengths {report['length_percentiles']['p0']}"
        f"-{report['length_percentiles']['p100']}), cutoff_len {args.cutoff}, micro-batch {args.micro_batch}, "
        f"steps {args.warmup + 1}-{args.steps} of {args.steps}"
    )
    print("mode     tokens/s  real fraction (est.)  padded tokens/s  tokens/step  step s")
    by = {}
    for row in rows:
        by[row["mode"]] = row
        print(
            f"{row['mode']:<7}  {row['tokens_per_s']:>8.0f}  {row['real_fraction']:>13.3f} ({row['estimated_real_fraction']:.3f})"
            f"  {row['padded_tokens_per_s']:>15.0f}  {row['tokens_per_step']:>11.0f}  {row['step_s']:>6.2f}"
        )
        if not row["replay_matches_metrics"]:
            print(f"  note: the replayed loader's tokens differ from {row['mode']}'s metrics.jsonl")
    base = by.get("none")
    for mode in ("packing", "neat"):
        if base is not None and mode in by:
            row = by[mode]
            print(
                f"{'plain' if mode == 'packing' else 'neat'} / none = {row['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                f"tokens/s ({row['real_fraction'] / base['real_fraction']:.2f}x real fraction, "
                f"{row['padded_tokens_per_s'] / base['padded_tokens_per_s']:.2f}x padded tokens/s)"
            )


if __name__ == "__main__":
    main()
