"""The whole workflow on a tiny model on the CPU: the main job of a machine without accelerators.

Steps, each with the real component (no network, no accelerator):

1. assets    a tiny Mistral3 in the official HF layout (two shards and an index), the real Tekken
             tokenizer from mistral-common's package data as v13 (Magistral's version, [THINK] /
             [/THINK] among its control tokens), a synthetic LLaVA dataset (PIL images; every
             fourth row with a ``reasoning_content``)
2. convert   HF -> DCP (fsdp2 layout) and key/shape validation against config.json
3. preprocess  the dataset into the fingerprinted cache (a second quickstart reuses it); the
             reasoning is encoded between the [THINK] / [/THINK] control ids and trained on
4. train     ``magistral train recipes/tiny/tiny_cpu.yaml`` with 2 CPU processes under torchrun,
             checkpointing half-way and at the end
5. resume    a second launch continues from the half-way checkpoint; its losses must equal the
             first run's step for step (fp32 on the CPU)
6. optimized the same steps with the optimization recipe (chunked loss, recompute, prefetch, GC freeze)
7. export    the final checkpoint -> HF safetensors, loaded back with transformers
8. native    the final checkpoint -> Mistral's native layout (consolidated.safetensors, params.json,
             tekken.json), read back through ``training.load``'s reader: the HF export's logits
9. lora      ``recipes/tiny/tiny_cpu_lora.yaml``: PEFT LoRA adapters on the frozen base, a resumed
             second launch with the same losses, the adapters exported as PEFT files and as merged
             HF weights, both loaded back (peft, transformers) with the same logits
10. compare / probe  ``magistral compare`` of the plain and optimized runs, ``magistral probe all``

Each step is a function (``step_assets`` ... ``step_probe``) of one ``QuickstartContext`` that
returns its ``StepRecord``; ``run_quickstart`` runs ``STEPS`` in order.

Shared inputs (model, data, cache) live in ``WORKDIR``; each quickstart's outputs go to
``WORKDIR/<timestamp>/`` so a second quickstart never overwrites the first.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from magistral_cli.checkpoint.layout import LATEST, step_dir_name
from magistral_cli.errors import CheckFailed, UserError

REPO_RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "tiny"
PLAIN_RECIPE = "tiny_cpu.yaml"
OPTIMIZED_RECIPE = "tiny_cpu_optimized.yaml"
LORA_RECIPE = "tiny_cpu_lora.yaml"

#: Validation samples split from the dataset (``val_size``).
QUICKSTART_VAL_SIZE = 8
#: Small images keep the quickstart fast: 2x2 to 5x4 image tokens each.
QUICKSTART_IMAGE_SIZES = [(56, 56), (84, 112), (112, 84), (140, 112), (56, 140)]
#: Magistral's tokenizer version: the first with [THINK] / [/THINK] control tokens.
QUICKSTART_TEKKEN_VERSION = "v13"
#: Every fourth synthetic row carries its reasoning in ``reasoning_content``.
QUICKSTART_REASONING_EVERY = 4
#: The largest logit difference allowed between the native export read back and the HF export (fp32).
NATIVE_LOGIT_TOLERANCE = 1e-5


@dataclass
class QuickstartOptions:
    workdir: Path = Path("quickstart")
    steps: int = 10
    nproc: int = 2
    samples: int = 64
    probes: bool = True


@dataclass
class StepRecord:
    name: str
    seconds: float
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def recipe_path(name: str) -> Path:
    """A tiny recipe shipped with the source tree."""
    path = REPO_RECIPES / name
    if not path.is_file():
        raise UserError(
            f"the tiny recipe {path} is missing; run the quickstart from a source checkout of magistral-cli "
            "(pip install -e .)"
        )
    return path


def _launch(recipe: Path, overrides: list[str], nproc: int, console) -> Path:
    from magistral_cli.launch.launcher import LaunchOptions, plan_launch, run_launch

    plan = plan_launch(recipe, overrides, LaunchOptions(nproc_per_node=nproc))
    console.print(f"  [dim]{plan.command_line}[/]", soft_wrap=True)
    code = run_launch(plan, console)
    if code != 0:
        raise CheckFailed(
            f"training failed with exit status {code}; per-rank logs in {plan.run_dir / 'logs'}"
        )
    return plan.run_dir


def _losses(run_dir: Path, split: str = "train") -> dict[int, float]:
    """step -> loss of ``split``'s records in metrics.jsonl (training records carry no split)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("split", "train") == split:
                out[int(record["step"])] = float(record["loss"])
    return out


#: Preference pairs written beside the dataset for the tiny DPO recipes.
QUICKSTART_PAIRS = 64


def write_assets(workdir: Path, samples: int) -> dict[str, Path]:
    """The tiny model (official layout), its tokenizer files, the synthetic dataset and, for the tiny
    DPO recipes, ``QUICKSTART_PAIRS`` preference pairs in ``pairs/``.

    A workdir of a quickstart from before reasoning traces (a dataset without ``reasoning_content``)
    gets the v13 tokenizer and the dataset again; the weights are kept.
    """
    from magistral_cli.checkpoint.hf import WEIGHT_INDEX
    from magistral_cli.testing.tiny_data import (
        write_synthetic_llava_dataset,
        write_synthetic_pair_dataset,
        write_tiny_tokenizer_files,
    )
    from magistral_cli.testing.tiny_model import build_tiny_model, save_official_checkpoint

    model_dir, data_dir = workdir / "model", workdir / "data"
    if not (model_dir / WEIGHT_INDEX).is_file():
        staging = workdir / "model.partial"
        if staging.exists():
            import shutil

            shutil.rmtree(staging)
        save_official_checkpoint(build_tiny_model(seed=0), staging, num_shards=2)
        write_tiny_tokenizer_files(staging, version=QUICKSTART_TEKKEN_VERSION)
        staging.rename(model_dir)
    dataset = data_dir / "data.jsonl"
    stale = dataset.is_file() and '"reasoning_content"' not in dataset.read_text(encoding="utf-8")
    if stale:  # reasoning needs v13's [THINK] / [/THINK]: the tokenizer goes with the dataset
        write_tiny_tokenizer_files(model_dir, version=QUICKSTART_TEKKEN_VERSION)
    if stale or not dataset.is_file():
        write_synthetic_llava_dataset(
            data_dir,
            samples,
            seed=0,
            image_sizes=QUICKSTART_IMAGE_SIZES,
            reasoning_every=QUICKSTART_REASONING_EVERY,
        )
    # Preference pairs for the DPO recipes (recipes/tiny/tiny_cpu_dpo*.yaml): not used by the quickstart's steps.
    pairs = workdir / "pairs" / "data.jsonl"
    if not pairs.is_file():
        write_synthetic_pair_dataset(
            workdir / "pairs", QUICKSTART_PAIRS, seed=0, image_sizes=QUICKSTART_IMAGE_SIZES
        )
    return {
        "model": model_dir,
        "data_dir": data_dir,
        "dataset": dataset,
        "cache": workdir / "cache",
        "pairs": pairs,
    }


@dataclass
class QuickstartContext:
    """What the steps share: the inputs, and each step's outputs as the later steps need them."""

    options: QuickstartOptions
    console: Any
    workdir: Path
    #: This quickstart's own outputs, ``WORKDIR/<timestamp>/``.
    out: Path
    #: ``write_assets``'s paths (assets).
    assets: dict[str, Path] = field(default_factory=dict)
    #: The overrides every launch shares (preprocess).
    base: list[str] = field(default_factory=list)
    #: The run directories by name, in the summary's order (train, resume, optimized, lora).
    runs: dict[str, Path] = field(default_factory=dict)
    #: The first run's training losses by step (train).
    losses: dict[int, float] = field(default_factory=dict)
    #: The HF export of the first run's final checkpoint (export).
    export: Path | None = None
    #: The HF export's fp32 logits on ``_logit_inputs()`` (export), what the native export must give.
    export_logits: Any = None
    #: The same checkpoint in Mistral's native layout (native).
    native: Path | None = None
    #: compare_runs of the plain and optimized runs (compare).
    comparison: Any = None
    #: ``magistral probe all``'s results as JSON (probe).
    probe_results: list[dict] = field(default_factory=list)

    @property
    def half(self) -> int:
        """The step of the half-way checkpoint that the resumed runs start from."""
        return self.options.steps // 2

    @property
    def final_checkpoint(self) -> Path:
        """The first run's last checkpoint, the one the exports write out."""
        return self.runs["train"] / "checkpoints" / step_dir_name(self.options.steps)


def _record(name: str, t0: float, detail: str, **data: Any) -> StepRecord:
    return StepRecord(name, round(time.monotonic() - t0, 1), detail, data)


def _check_every_step(losses: dict[int, float], steps: int, run: str) -> None:
    """A run logged steps 1..steps, each with a finite loss."""
    if sorted(losses) != list(range(1, steps + 1)) or not all(map(math.isfinite, losses.values())):
        raise CheckFailed(f"{run} logged steps {sorted(losses)} with losses {losses}")


def step_assets(ctx: QuickstartContext) -> StepRecord:
    """1. The tiny model, its tokenizer and the synthetic dataset (reused from an earlier quickstart)."""
    t0 = time.monotonic()
    ctx.assets = write_assets(ctx.workdir, ctx.options.samples)
    return _record(
        "assets",
        t0,
        f"tiny Mistral3 in {ctx.assets['model']}, {ctx.options.samples} samples in {ctx.assets['data_dir']}",
    )


def step_convert(ctx: QuickstartContext) -> StepRecord:
    """2. HF -> DCP (fsdp2 layout), validated against config.json."""
    from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
    from magistral_cli.checkpoint.validate import require_valid, validate_dcp

    t0 = time.monotonic()
    dcp_dir = ctx.out / "dcp"
    convert_hf_to_dcp(ctx.assets["model"], dcp_dir, layout="fsdp2")
    validation = require_valid(validate_dcp(ctx.assets["model"], dcp_dir, "fsdp2"))
    return _record("convert", t0, f"HF -> DCP {dcp_dir}, validated: {validation.message().splitlines()[0]}")


def step_preprocess(ctx: QuickstartContext) -> StepRecord:
    """3. The dataset into the fingerprinted cache; sets the overrides every launch shares."""
    from magistral_cli.config import load_recipe
    from magistral_cli.data.pipeline import run_preprocess

    assets = ctx.assets
    ctx.base = [
        f"data.dataset_param.preprocess_parameters.model_name_or_path={assets['model']}",
        f"model.model_name_or_path={assets['model']}",
        f"data.dataset_param.basic_parameters.dataset_dir={assets['data_dir']}",
        f"data.dataset_param.basic_parameters.dataset={assets['dataset']}",
        f"data.dataset_param.basic_parameters.cache_dir={assets['cache']}",
        f"training.train_iters={ctx.options.steps}",
        f"training.save_interval={ctx.half}",
        # A validation split of 8 samples, evaluated half-way and at the end.
        f"data.dataset_param.basic_parameters.val_size={QUICKSTART_VAL_SIZE}",
        f"training.eval_interval={ctx.half}",
    ]
    t0 = time.monotonic()
    result = run_preprocess(load_recipe(recipe_path(PLAIN_RECIPE), ctx.base))
    reasoning = result.report["reasoning"]
    row = _check_reasoning_sample(ctx.assets, result.dataset)
    return _record(
        "preprocess",
        t0,
        f"{result.report['kept']} samples kept, {result.report['dropped']} dropped, "
        f"{reasoning['samples']} with reasoning (row {row}: [THINK] ... [/THINK] as control ids, "
        f"trained on), cache {'reused' if result.reused else 'written'}: {result.dataset.path}",
        kept=result.report["kept"],
        reasoning_samples=reasoning["samples"],
        cache_reused=result.reused,
    )


def step_train(ctx: QuickstartContext) -> StepRecord:
    """4. Train (weights from the HF checkpoint; checkpoints half-way and at the end)."""
    t0 = time.monotonic()
    options = ctx.options
    run = _launch(
        recipe_path(PLAIN_RECIPE),
        [*ctx.base, f"training.load={ctx.assets['model']}", f"training.output_dir={ctx.out / 'run'}"],
        options.nproc,
        ctx.console,
    )
    ctx.runs["train"] = run
    ctx.losses = losses = _losses(run)
    _check_every_step(losses, options.steps, "the run")
    return _record(
        "train",
        t0,
        f"{options.steps} steps on {options.nproc} CPU processes, loss {losses[1]:.4f} -> {losses[options.steps]:.4f}",
        run=str(run),
    )


def step_resume(ctx: QuickstartContext) -> StepRecord:
    """5. Resume from the half-way checkpoint in a second launch: the same losses, step for step."""
    t0 = time.monotonic()
    half, steps = ctx.half, ctx.options.steps
    checkpoint = ctx.runs["train"] / "checkpoints" / step_dir_name(half)
    run = _launch(
        recipe_path(PLAIN_RECIPE),
        [*ctx.base, f"training.load={checkpoint}", f"training.output_dir={ctx.out / 'resumed'}"],
        ctx.options.nproc,
        ctx.console,
    )
    ctx.runs["resumed"] = run
    losses = _losses(run)
    expected = {s: ctx.losses[s] for s in range(half + 1, steps + 1)}
    if losses != expected:
        raise CheckFailed(f"the resumed run's losses {losses} differ from the uninterrupted run's {expected}")
    return _record(
        "resume",
        t0,
        f"continued from {checkpoint}: steps {half + 1}-{steps} equal the first run's exactly",
        run=str(run),
    )


def step_optimized(ctx: QuickstartContext) -> StepRecord:
    """6. The optimization recipe on the same data and weights."""
    t0 = time.monotonic()
    run = _launch(
        recipe_path(OPTIMIZED_RECIPE),
        [*ctx.base, f"training.load={ctx.assets['model']}", f"training.output_dir={ctx.out / 'optimized'}"],
        ctx.options.nproc,
        ctx.console,
    )
    ctx.runs["optimized"] = run
    return _record(
        "optimized",
        t0,
        f"{ctx.options.steps} steps with chunked loss, recompute, prefetch and GC freeze",
        run=str(run),
    )


def step_export(ctx: QuickstartContext) -> StepRecord:
    """7. Export the first run's final checkpoint to HF and load it back with transformers."""
    t0 = time.monotonic()
    ctx.export = export = ctx.out / "export"
    from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf

    export_dcp_to_hf(ctx.final_checkpoint, ctx.assets["model"], export, layout="official")
    changed, ctx.export_logits = _check_export(ctx.assets["model"], export)
    return _record("export", t0, f"HF checkpoint {export} loads with transformers; {changed}")


def step_native(ctx: QuickstartContext) -> StepRecord:
    """8. The same checkpoint in Mistral's native layout, read back through ``training.load``'s reader."""
    from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf

    t0 = time.monotonic()
    ctx.native = native = ctx.out / "native"
    export_dcp_to_hf(ctx.final_checkpoint, ctx.assets["model"], native, format="mistral")
    files = _check_native_files(ctx.assets["model"], native)
    diff = _check_native_export(native, ctx.export_logits)
    return _record(
        "native",
        t0,
        f"Mistral's native layout in {native} ({', '.join(files)}), read back through training.load: "
        f"logits within {diff:.1e} of the HF export's (fp32)",
        native=str(native),
        files=files,
        max_logit_diff=diff,
    )


def step_lora(ctx: QuickstartContext) -> StepRecord:
    """9. LoRA: train, resume in a second launch, export both ways, load both back."""
    t0 = time.monotonic()
    steps, half = ctx.options.steps, ctx.half
    run, losses = _lora_train(ctx)
    ctx.runs["lora"] = run
    resumed = _lora_resume(ctx, run, losses)
    adapters, merged, diff = _lora_export(ctx, run)
    return _record(
        "lora",
        t0,
        f"{steps} steps, loss {losses[1]:.4f} -> {losses[steps]:.4f}; resumed steps "
        f"{half + 1}-{steps} equal; adapters ({adapters.tensors} tensors) load with peft; merged "
        f"weights load with transformers and equal peft's merge_and_unload in the base's dtype "
        f"(logits within {diff:.1e} of the adapters')",
        run=str(run),
        resumed=str(resumed),
        adapters=str(adapters.out_dir),
        merged=str(merged.out_dir),
        max_logit_diff=diff,
    )


def step_compare(ctx: QuickstartContext) -> StepRecord:
    """10. ``magistral compare`` of the plain and optimized runs (its verdict is checked at the end)."""
    from magistral_cli.analysis.logs import read_run
    from magistral_cli.analysis.metrics import compare_runs

    t0 = time.monotonic()
    ctx.comparison = comparison = compare_runs(read_run(ctx.runs["train"]), read_run(ctx.runs["optimized"]))
    report = comparison.report
    verdict = "PASS" if comparison.passed else "FAIL"
    val = report.get("validation") or {}
    val_text = (
        f"; validation losses at steps {val.get('steps')}: difference "
        f"{val['loss']['normalized_mean_abs_diff']:.2e}"
        if val.get("loss")
        else ""
    )
    plot = _plot(comparison, ctx.out / "compare.png")
    return _record(
        "compare",
        t0,
        f"plain vs optimized: normalized loss difference {report['loss']['normalized_mean_abs_diff']:.2e} "
        f"(threshold {report['loss']['threshold']}){val_text}: {verdict}"
        + (f"; curves in {plot}" if plot else ""),
        verdict=verdict,
        normalized_mean_abs_diff=report["loss"]["normalized_mean_abs_diff"],
        validation_steps=val.get("steps"),
        plot=str(plot) if plot else None,
    )


def step_probe(ctx: QuickstartContext) -> StepRecord:
    """11. ``magistral probe all`` on the CPU (its verdicts are checked at the end)."""
    from magistral_cli.probes import run_all

    t0 = time.monotonic()
    ctx.probe_results = probe_results = [r.to_json() for r in run_all("cpu")]
    verdicts = ", ".join(
        f"{r['probe']}{'' if r['mode'] == 'default' else ' ' + r['mode']}: {r['result']}"
        for r in probe_results
    )
    return _record(
        "probe",
        t0,
        verdicts,
        results=[{k: r[k] for k in ("probe", "mode", "result")} for r in probe_results],
    )


#: The quickstart's steps, in order; ``step_probe`` follows them unless ``--no-probes``.
STEPS: list[Callable[[QuickstartContext], StepRecord]] = [
    step_assets,
    step_convert,
    step_preprocess,
    step_train,
    step_resume,
    step_optimized,
    step_export,
    step_native,
    step_lora,
    step_compare,
]


def run_quickstart(
    options: QuickstartOptions, console, progress: Callable[[StepRecord], None]
) -> dict[str, Any]:
    """Run every step; return the summary. Raises CheckFailed when a step's check fails."""
    if options.steps < 2:
        raise UserError("--steps must be at least 2 (the run checkpoints half-way and resumes from there)")
    workdir = options.workdir.absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / datetime.now().strftime("%Y%m%d-%H%M%S")
    if out.exists():
        raise UserError(f"{out} exists already; wait a second and run the quickstart again")
    out.mkdir()
    summary: dict[str, Any] = {"workdir": str(workdir), "outputs": str(out), "steps": []}
    started = time.monotonic()
    ctx = QuickstartContext(options=options, console=console, workdir=workdir, out=out)
    for step in [*STEPS, step_probe] if options.probes else STEPS:
        record = step(ctx)
        summary["steps"].append(
            {"name": record.name, "seconds": record.seconds, "detail": record.detail, **record.data}
        )
        progress(record)

    summary["wall_s"] = round(time.monotonic() - started, 1)
    comparison = ctx.comparison
    failed = [r for r in ctx.probe_results if r["result"] == "FAIL"]
    summary["pass"] = comparison.passed and not failed
    summary["runs"] = {name: str(run) for name, run in ctx.runs.items()}
    summary["export"] = str(ctx.export)
    summary["native"] = str(ctx.native)
    if not comparison.passed:
        raise CheckFailed(
            f"magistral compare of the plain and optimized runs failed: {comparison.report['failures']}"
        )
    if failed:
        raise CheckFailed("probes failed: " + "; ".join(f"{r['probe']} ({r['reason']})" for r in failed))
    return summary


def _plot(comparison, path: Path) -> Path | None:
    """``magistral compare --plot``'s figure of the plain and optimized runs (None without matplotlib)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return None
    from magistral_cli.analysis.plot import plot_comparison

    return plot_comparison(
        comparison, path, labels=("plain (tiny_cpu.yaml)", "optimized (tiny_cpu_optimized.yaml)")
    )


def _lora_train(ctx: QuickstartContext) -> tuple[Path, dict[int, float]]:
    """The LoRA recipe's first run on the base weights: its directory and its losses."""
    run = _launch(
        recipe_path(LORA_RECIPE),
        [*ctx.base, f"training.load={ctx.assets['model']}", f"training.output_dir={ctx.out / 'lora'}"],
        ctx.options.nproc,
        ctx.console,
    )
    losses = _losses(run)
    _check_every_step(losses, ctx.options.steps, "the LoRA run")
    return run, losses


def _lora_resume(ctx: QuickstartContext, run: Path, losses: dict[int, float]) -> Path:
    """A second LoRA run resumed from the first's half-way checkpoint: the same losses, step for step."""
    import shutil

    half = ctx.half
    # A LoRA checkpoint holds the adapters only: a second run resumes it from its own checkpoint
    # directory, on the base weights of training.load.
    resumed_dir = ctx.out / "lora_resumed"
    shutil.copytree(
        run / "checkpoints" / step_dir_name(half), resumed_dir / "checkpoints" / step_dir_name(half)
    )
    (resumed_dir / "checkpoints" / LATEST).write_text(step_dir_name(half) + "\n", encoding="utf-8")
    resumed = _launch(
        recipe_path(LORA_RECIPE),
        [*ctx.base, f"training.load={ctx.assets['model']}", f"training.output_dir={resumed_dir}"],
        ctx.options.nproc,
        ctx.console,
    )
    losses_b = _losses(resumed)
    expected = {s: losses[s] for s in range(half + 1, ctx.options.steps + 1)}
    if losses_b != expected:
        raise CheckFailed(f"the resumed LoRA run's losses {losses_b} differ from the first run's {expected}")
    return resumed


def _lora_export(ctx: QuickstartContext, run: Path):
    """The final LoRA checkpoint exported as PEFT adapters and as merged weights, both loaded back:
    the two exports and the largest logit difference between them."""
    from magistral_cli.checkpoint.lora_export import export_lora

    model_dir = ctx.assets["model"]
    final = run / "checkpoints" / step_dir_name(ctx.options.steps)
    adapters = export_lora(final, model_dir, ctx.out / "lora_adapters", "adapters")
    merged = export_lora(final, model_dir, ctx.out / "lora_merged", "merged")
    return adapters, merged, _check_lora_exports(model_dir, adapters.out_dir, merged.out_dir)


def _check_lora_exports(model_dir: Path, adapters: Path, merged: Path) -> float:
    """The adapters load on the base with peft and change its logits; the merged export loads with
    transformers and holds, tensor for tensor, peft's ``merge_and_unload()`` rounded to the base's
    dtype. Returns the largest logit difference between the merged export and the adapters on the
    base (the rounding of the merged weights to the base's dtype)."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers import Mistral3ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from magistral_cli.model_config import read_model_config

    hf_logging.disable_progress_bar()
    ids = torch.tensor([[1, 3, 1010, 1042, 4, 1050, 1077, 1100, 2]])

    def load(path: Path, dtype=torch.float32):
        return Mistral3ForConditionalGeneration.from_pretrained(
            str(path), config=read_model_config(path), dtype=dtype
        ).eval()

    base_dtype = load(model_dir, dtype="auto").dtype
    with torch.no_grad():
        base_logits = load(model_dir)(input_ids=ids).logits
        with warnings.catch_warnings():  # peft asks transformers a deprecated question
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            peft_model = PeftModel.from_pretrained(load(model_dir), str(adapters)).eval()
        peft_logits = peft_model(input_ids=ids).logits
        reference = peft_model.merge_and_unload().state_dict()
        exported = load(merged)
        merged_logits = exported(input_ids=ids).logits
    if torch.equal(peft_logits, base_logits):
        raise CheckFailed("the exported adapters do not change the base model's logits: nothing was trained")
    for key, value in exported.state_dict().items():
        if not torch.equal(value, reference[key].to(base_dtype).to(value.dtype)):
            raise CheckFailed(
                f"the merged export's {key} differs from peft's merge_and_unload() rounded to {base_dtype}"
            )
    if not torch.isfinite(merged_logits).all():
        raise CheckFailed("the merged export gives non-finite logits")
    return float((peft_logits - merged_logits).abs().max())


def _logit_inputs() -> dict:
    """A small sample with an image, whose logits the exports must agree on (the image makes the
    vision tower's weights count): 56x56 pixels are 2x2 image tokens (patch 14, spatial merge 2)."""
    import torch

    from magistral_cli.testing.tiny_model import IMAGE_TOKEN_ID

    return {
        "input_ids": torch.tensor([[1, 3, *[IMAGE_TOKEN_ID] * 4, 1010, 1042, 4, 1050, 2]]),
        "pixel_values": torch.rand(1, 3, 56, 56, generator=torch.Generator().manual_seed(0)),
        "image_sizes": torch.tensor([[56, 56]]),
    }


def _check_export(model_dir: Path, export: Path):
    """Load the export with transformers; the trained weights changed and the frozen ones did not.
    Returns what it found, and the export's fp32 logits on ``_logit_inputs()``."""
    import torch
    from transformers import Mistral3ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from magistral_cli.model_config import EMBED_KEY, HEAD_KEY, read_model_config, text_ties

    hf_logging.disable_progress_bar()
    # The tying rule, not transformers' top-level default, decides whether the head is its own tensor.
    before = Mistral3ForConditionalGeneration.from_pretrained(
        str(model_dir), config=read_model_config(model_dir), dtype=torch.float32
    )
    config = read_model_config(export)
    after = Mistral3ForConditionalGeneration.from_pretrained(str(export), config=config, dtype=torch.float32)
    sd_before, sd_after = before.state_dict(), after.state_dict()
    if sd_before.keys() != sd_after.keys():
        raise CheckFailed(f"the export {export} has other keys than {model_dir}")
    if not text_ties(config) and torch.equal(sd_after[HEAD_KEY], sd_after[EMBED_KEY]):
        raise CheckFailed(f"the export's {HEAD_KEY} equals its embedding: the trained head was lost")
    frozen = [k for k in sd_before if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))]
    trained = [k for k in sd_before if k not in frozen]
    moved_frozen = [k for k in frozen if not torch.equal(sd_before[k], sd_after[k])]
    moved_trained = [k for k in trained if not torch.equal(sd_before[k], sd_after[k])]
    if moved_frozen:
        raise CheckFailed(f"frozen weights changed in training: {moved_frozen[:5]}")
    if not moved_trained:
        raise CheckFailed("no trained weight changed: the export does not hold the trained model")
    with torch.no_grad():
        logits = after.eval()(**_logit_inputs()).logits
    if not torch.isfinite(logits).all():
        raise CheckFailed("the exported model gives non-finite logits")
    return (
        f"{len(moved_trained)}/{len(trained)} trained tensors changed, {len(frozen)} frozen tensors unchanged",
        logits,
    )


def _check_reasoning_sample(assets: dict[str, Path], dataset) -> int:
    """The first dataset row with ``reasoning_content`` is encoded in the cache with its reply's
    reasoning between the [THINK] and [/THINK] ids that tekken.json lists as control tokens, trained
    on (the tiny recipe keeps ``train_on_reasoning``'s default). Returns the row."""
    from magistral_cli.data.tokenizer import THINK_TOKENS

    rows = [json.loads(line) for line in assets["dataset"].read_text(encoding="utf-8").splitlines() if line]
    row = next(
        (i for i, record in enumerate(rows) if any("reasoning_content" in m for m in record["messages"])),
        None,
    )
    if row is None:
        raise CheckFailed(f"no row of {assets['dataset']} has a reasoning_content")
    tekken = json.loads((assets["model"] / "tekken.json").read_text(encoding="utf-8"))
    control = {t["token_str"]: t["rank"] for t in tekken.get("special_tokens", []) if t.get("is_control")}
    if any(token not in control for token in THINK_TOKENS):
        raise CheckFailed(
            f"{assets['model'] / 'tekken.json'} has no {' / '.join(THINK_TOKENS)} control tokens"
        )
    begin, end = (control[token] for token in THINK_TOKENS)
    sample = next((s for s in map(dataset.__getitem__, range(len(dataset))) if s.source_index == row), None)
    if sample is None:
        raise CheckFailed(
            f"row {row} of {assets['dataset']} (with reasoning) is not in the cache {dataset.path}"
        )
    # The default system prompt (Magistral's reasoning instructions) holds the two control tokens
    # too, untrained; the reply's reasoning is the one trained [THINK] ... [/THINK] pair.
    trained = [
        t for t, label in zip(sample.input_ids.tolist(), sample.labels.tolist(), strict=True) if label == t
    ]
    if [t for t in trained if t in (begin, end)] != [begin, end]:
        raise CheckFailed(
            f"row {row}'s reply is not encoded as [THINK] ({begin}) reasoning [/THINK] ({end}), trained on: "
            f"its trained ids are {trained}"
        )
    return row


def _check_native_files(model_dir: Path, native: Path) -> list[str]:
    """The native export holds its weights, params.json and the base's tekken.json; returns their names."""
    from magistral_cli.checkpoint.hf import TEKKEN
    from magistral_cli.model_config import PARAMS_FILE

    weights = sorted(p.name for p in native.glob("consolidated*.safetensors"))
    missing = [name for name in (PARAMS_FILE, TEKKEN) if not (native / name).is_file()]
    if not weights or missing:
        raise CheckFailed(
            f"the native export {native} lacks {', '.join(missing or ['consolidated*.safetensors'])}"
        )
    if (native / TEKKEN).read_bytes() != (model_dir / TEKKEN).read_bytes():
        raise CheckFailed(f"the native export's {TEKKEN} is not the base's")
    return [*weights, PARAMS_FILE, TEKKEN]


def _check_native_export(native: Path, expected) -> float:
    """A model built from the native export's params.json and loaded through ``training.load``'s
    reader (the rotary rows put back) gives ``expected``, the HF export's fp32 logits on
    ``_logit_inputs()``. Returns the largest logit difference."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.engine.weights import load_weights
    from magistral_cli.model_config import read_model_config

    # Random weights of its own: a tensor the import left alone would show in the logits.
    imported = Mistral3ForConditionalGeneration(read_model_config(native)).to(torch.float32).eval()
    report = load_weights(imported, native, "auto", strict=True)
    tensors = len(imported.state_dict())
    if report.fmt != "mistral" or report.loaded != tensors:
        raise CheckFailed(
            f"training.load read {native} as {report.fmt} with {report.loaded} tensors, "
            f"not as the native layout with {tensors}"
        )
    with torch.no_grad():
        diff = float((imported(**_logit_inputs()).logits - expected).abs().max())
    if not diff <= NATIVE_LOGIT_TOLERANCE:
        raise CheckFailed(
            f"the native export read back gives logits {diff:.2e} from the HF export's "
            f"(tolerance {NATIVE_LOGIT_TOLERANCE:.0e}): the native names or rotary rows are wrong"
        )
    return diff
