"""Shared pieces of the engine tests: a tiny model on disk and recipes for it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: A small vocabulary keeps the logits (and the tests) cheap; the structure is Magistral's.
VOCAB = 512


def write_tiny_model(directory: Path, seed: int = 0):
    """The tiny Mistral3 (fp32) in the official layout, two shards plus an index; returns the model."""
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    model = build_tiny_model(tiny_mistral3_config(vocab_size=VOCAB), seed=seed)
    save_official_checkpoint(model, directory, num_shards=2, dtype="float32")
    return model


def recipe_dict(model_dir: Path, output_dir: Path, **training) -> dict:
    """A fp32 CPU recipe over synthetic batches (the loader's format) for the tiny model."""
    train = {
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "train_iters": 3,
        "lr": 1.0e-3,
        "lr_warmup_ratio": 0.34,
        "lr_decay_style": "cosine",
        "weight_decay": 0.01,
        "clip_grad": 1.0,
        "load": str(model_dir),
        "output_dir": str(output_dir),
        "save_interval": 0,
        "save": "checkpoints",  # inside the run directory
        "resume": "never",
        "seed": 7,
    }
    train.update(training)
    return {
        # per_token_loss: the loss whose gradient does not depend on how the batch is split, which
        # is what the 1-vs-2-process, micro-batch and CP equivalence tests compare.
        "features": {"loss_cfg": {"loss_type": "per_token_loss"}},
        "parallel": {"device": "cpu", "fsdp_plan": {"param_dtype": "fp32", "reduce_dtype": "fp32"}},
        "data": {"dataset_param": {"dataset_type": "synthetic", "basic_parameters": {"cutoff_len": 48}}},
        "model": {"model_name_or_path": str(model_dir)},
        "training": train,
    }


def make_recipe(model_dir: Path, output_dir: Path, overrides: list[str] = (), **training):
    from magistral_cli.config.loader import apply_overrides, validate_recipe

    return validate_recipe(apply_overrides(recipe_dict(model_dir, output_dir, **training), list(overrides)))


def full_params(model) -> dict:
    """Every parameter gathered to a plain CPU tensor, by name."""
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().clone().cpu()
    return out


REPO = Path(__file__).resolve().parents[2]
#: The published config.json of Magistral-Small-2509 (the real widths and head).
REAL_CONFIG = REPO / "tests" / "fixtures" / "magistral-small-2509" / "config.json"


def has_onednn_bf16_gemm() -> bool:
    """Whether torch's bf16 matmul on this CPU runs through oneDNN rather than a scalar loop.

    oneDNN has two bf16 paths: native instructions (AVX512-BF16, AMX) and, on AVX512 CPUs without
    them, a conversion to fp32 inside the kernel. The second is slow but bounded: a 1024 x 5120
    by 5120 x 32768 product measured 30 GFLOP/s in bf16 against 126 in fp32 on one core of an
    AVX512 Xeon without BF16, where the real-width test took 456 s (131 s on a host with native
    bf16). Without either (an AVX2-only CPU), torch falls back to a scalar reference loop, about
    200x slower than fp32 (a 2048^2 bf16 product measured 57 s against 0.28 s in fp32 on an AVX2
    AMD EPYC): a bf16 test at real widths then takes hours instead of minutes.
    """
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def skip_without_onednn_bf16(what: str):
    """A ``pytest.mark.skipif`` for a bf16 test that torch's scalar fallback would make take hours."""
    import pytest
    import torch

    return pytest.mark.skipif(
        not has_onednn_bf16_gemm(),
        reason=f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no oneDNN bf16 GEMM; torch's "
        f"fallback makes {what} take hours",
    )


def train_args(recipe: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`magistral train RECIPE --nproc-per-node 2` into ``run_dir``: the arguments after ``magistral``."""
    return ["train", str(recipe), "--nproc-per-node", "2", f"training.output_dir={run_dir}", *overrides]


def train_command(recipe: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`magistral train RECIPE --nproc-per-node 2` into ``run_dir``, from this source tree."""
    from tests.cli_process import cli_command

    return cli_command(train_args(recipe, run_dir, *overrides))


def train_env(**extra: str) -> dict[str, str]:
    """This process's environment, less any fault injection, with the source tree importable."""
    import os

    from magistral_cli.engine.checkpoint import FAULT_ENV

    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


def run_train(recipe: Path, run_dir: Path, *overrides: str, env: dict | None = None):
    """Run `magistral train` on 2 CPU processes to its end; the CompletedProcess (output captured).
    The command's process is forked with the engine imported when its environment allows
    (``tests/cli_process.py``); torchrun and the ranks are fresh interpreters as always."""
    from tests.cli_process import run_cli

    return run_cli(
        train_args(recipe, run_dir, *overrides), env=train_env(**(env or {})), cwd=REPO, timeout=600
    )


def trained_four_steps(root: Path, run_name: str = "run") -> tuple[Path, Path]:
    """(recipe, run directory) of a finished 2-process run of 4 steps that saved step_2 and step_4
    (``training.save: checkpoints`` inside the run directory, ``resume: auto``)."""
    import yaml

    write_tiny_model(root / "model")
    data = recipe_dict(root / "model", root / "unused", micro_batch_size=1, train_iters=4, save_interval=2)
    del data["training"]["output_dir"]
    data["training"]["resume"] = "auto"
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    done = run_train(recipe, root / run_name)
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, root / run_name


def file_digests(directory: Path, *, skip_prefix: str | None = None) -> dict[str, str]:
    """Every file under ``directory`` with its SHA-256 (names starting with ``skip_prefix`` left out):
    a tree compared before and after a command shows that nothing in it changed."""
    import hashlib

    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not (skip_prefix and p.name.startswith(skip_prefix))
    }


@contextlib.contextmanager
def mounted_tmpfs(disk: Path, *options: str):
    """A tmpfs with mount ``options`` (``size=1m``, ``ro``) at ``disk`` for the block: a real small
    or read-only disk. Skips the test where it cannot mount (root only)."""
    import subprocess

    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


#: The tiny DPO recipe (2 processes, a frozen copy of the starting weights as the reference).
DPO_RECIPE = REPO / "recipes" / "tiny" / "tiny_cpu_dpo.yaml"


def write_pair_assets(root: Path, pairs: int = 12) -> Path:
    """The quickstart's tiny model (with its tokenizer) in ``root/quickstart/model`` and ``pairs``
    preference pairs with small images in ``root/pairs``, for short runs of ``DPO_RECIPE``."""
    from magistral_cli.quickstart import write_assets
    from magistral_cli.testing.tiny_data import write_synthetic_pair_dataset

    write_assets(root / "quickstart", 16)
    write_synthetic_pair_dataset(root / "pairs", pairs, seed=1, image_sizes=[(56, 56), (28, 56)])
    return root


def pair_overrides(root: Path) -> list[str]:
    """``DPO_RECIPE`` on ``write_pair_assets(root)``: its cache in ``root/cache``, 2 validation pairs,
    cutoff_len 256, one pair per micro-batch, 3 steps, a checkpoint at step 2 and an evaluation at 3."""
    model, basic = root / "quickstart" / "model", "data.dataset_param.basic_parameters"
    return [
        f"model.model_name_or_path={model}",
        f"training.load={model}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"{basic}.dataset={root / 'pairs' / 'data.jsonl'}",
        f"{basic}.dataset_dir={root / 'pairs'}",
        f"{basic}.cache_dir={root / 'cache'}",
        f"{basic}.val_size=2",
        f"{basic}.cutoff_len=256",
        "training.micro_batch_size=1",
        "training.train_iters=3",
        "training.eval_interval=3",
        "training.save_interval=2",
        "training.resume=auto",
    ]


def quickstart_overrides(quick: Path, data: str, cache_dir: Path) -> list[str]:
    """Overrides pointing a tiny recipe at the quickstart's assets in ``quick`` (``write_assets``):
    its model, the dataset in ``quick / data`` (``data`` or ``pairs``) and a cache in ``cache_dir``."""
    basic = "data.dataset_param.basic_parameters"
    return [
        f"model.model_name_or_path={quick / 'model'}",
        f"training.load={quick / 'model'}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={quick / 'model'}",
        f"{basic}.dataset={quick / data / 'data.jsonl'}",
        f"{basic}.dataset_dir={quick / data}",
        f"{basic}.cache_dir={cache_dir}",
    ]


def adapters_change(base_dir: Path, adapters: Path) -> float:
    """The largest change PEFT adapters in ``adapters`` make to the fp32 base's logits (peft loads them)."""
    import torch
    from peft import PeftModel
    from transformers import Mistral3ForConditionalGeneration

    base = Mistral3ForConditionalGeneration.from_pretrained(base_dir, torch_dtype=torch.float32)
    ids = torch.tensor([[1, 100, 200, 300, 400]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, adapters)(input_ids=ids).logits
    return float((after - before).abs().max())
