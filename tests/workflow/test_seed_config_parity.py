"""The seed's 8-card v1 config on the tiny model, as a user would run it: only paths (and this
machine's sizing) changed.

``magistral train tests/fixtures/seed_configs/magistral_2509_config_v1.yaml`` on 2 CPU processes
with the model, dataset and cache paths overridden, ``parallel.device=cpu``, fp32 compute (so the
loss can be checked to float rounding: the seed's bf16 is the only numeric change), 0 loader
workers and ``train_iters: 20`` (warm-up 2 steps) for 2 steps of the schedule. Then:

- the logged lr of steps 1 and 2 is MindSpeed-MM's (0, then lr x 1/2: read before the step);
- the encoded samples carry the seed template's thinking system prompt;
- the step-1 loss is the mean over the two ranks of each micro-batch's token mean, computed
  independently with transformers on the batches the seed's sampler deals each rank;
- no checkpoint is written (the seed's config leaves ``training.save`` unset) and the launch says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.cli_process import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SEED_V1 = REPO / "tests" / "fixtures" / "seed_configs" / "magistral_2509_config_v1.yaml"
STEPS = 20


def _overrides(root: Path) -> list[str]:
    model, data = root / "model", root / "data"
    return [
        f"model.model_name_or_path={model}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"training.load={model}",
        f"data.dataset_param.basic_parameters.dataset_dir={data}",
        f"data.dataset_param.basic_parameters.dataset={data / 'data.jsonl'}",
        f"data.dataset_param.basic_parameters.cache_dir={root / 'cache'}",
        "data.dataset_param.basic_parameters.preprocessing_num_workers=2",
        "data.dataloader_param.num_workers=0",
        "data.dataloader_param.pin_memory=false",
        "parallel.device=cpu",
        "parallel.fsdp_plan.param_dtype=fp32",
        "parallel.fsdp_plan.reduce_dtype=fp32",
        f"training.train_iters={STEPS}",
        f"training.output_dir={root / 'run'}",
    ]


def test_the_seed_v1_config_gives_the_seeds_run(tmp_path):
    from magistral_cli.config import load_recipe
    from magistral_cli.data.loader import build_train_dataloader, prepare_dataset
    from magistral_cli.data.template import MAGISTRAL_THINKING_PROMPT
    from magistral_cli.data.tokenizer import load_tokenizer
    from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset, write_tiny_tokenizer_files
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    model = build_tiny_model(tiny_mistral3_config(), seed=0)
    save_official_checkpoint(model, tmp_path / "model", num_shards=2, dtype="float32")
    write_tiny_tokenizer_files(tmp_path / "model")
    write_synthetic_llava_dataset(tmp_path / "data", 16, seed=0)

    overrides = _overrides(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = run_cli(
        ["train", str(SEED_V1), "--nproc-per-node", "2", *overrides], env=env, cwd=tmp_path, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "no checkpoint will be written" in done.stderr
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # The seed's lr 1e-5, warm-up 0.1 x 20 = 2 steps, read before the scheduler steps.
    assert records[0]["lr"] == 0.0
    assert records[1]["lr"] == pytest.approx(1.0e-5 / 2, rel=1e-9)

    # The same recipe in this process: the encoded samples and each rank's first micro-batch.
    recipe = load_recipe(SEED_V1, overrides)
    dataset = prepare_dataset(recipe)
    tokenizer = load_tokenizer(tmp_path / "model")
    prompt_ids = tokenizer.encode(MAGISTRAL_THINKING_PROMPT)
    batches = [next(iter(build_train_dataloader(recipe, dataset, dp_rank=r, dp_size=2))) for r in range(2)]
    for batch in batches:
        ids = batch["input_ids"][0].tolist()
        # <s>[SYSTEM_PROMPT] then the prompt's tokens (the tiny records carry no system message).
        assert ids[2 : 2 + len(prompt_ids)] == prompt_ids, "no thinking system prompt"

    # Step 1's loss, independently: transformers' logits, each micro-batch's token mean, averaged.
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.model_config import read_model_config

    reference = Mistral3ForConditionalGeneration.from_pretrained(
        str(tmp_path / "model"), config=read_model_config(tmp_path / "model"), dtype=torch.float32
    ).eval()
    means = []
    with torch.no_grad():
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = reference(**inputs).logits.float()
            targets = batch["labels"][:, 1:]
            ce = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )
            means.append(float(ce) / int((targets != -100).sum()))
    assert records[0]["loss"] == pytest.approx(sum(means) / 2, rel=1e-4)
