"""QLoRA as a new user tries it: the tiny QLoRA recipe on 2 CPU processes through `magistral train`.

The recipe's dry run plans the NF4 base; the run trains on the quickstart's assets (images included),
its checkpoints hold only the adapters, and the adapters export as PEFT files that peft loads on the
original bf16 base. That the numbers are right (QLoRA equals LoRA on the dequantised base step for
step, exact resume) is proven in tests/engine/test_qlora.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from magistral_cli.checkpoint.lora_format import read_checkpoint_record
from magistral_cli.cli.main import app
from magistral_cli.quickstart import write_assets
from tests.engine.helpers import REPO, adapters_change, quickstart_overrides, run_train

pytestmark = [pytest.mark.slow, pytest.mark.compat]
runner = CliRunner()
RECIPE = REPO / "recipes" / "tiny" / "tiny_cpu_qlora.yaml"


def test_tiny_qlora_recipe_trains_and_exports_adapters_peft_loads(tmp_path):
    pytest.importorskip("torchao", reason="QLoRA needs torchao (the test extra installs it)")
    quick = tmp_path / "quickstart"
    write_assets(quick, 16)
    common = quickstart_overrides(quick, "data", tmp_path / "cache")

    plan = runner.invoke(app, ["train", str(RECIPE), *common, "--dry-run", "--json"])
    assert plan.exit_code == 0, plan.output
    items = json.loads(plan.stdout)["memory_plan"]["memory"]["items"]
    assert "dequant_workspace" in items  # the NF4 base's per-Linear dequantisation (LoRA has none)

    run = tmp_path / "run"
    done = run_train(RECIPE, run, *common, "training.train_iters=4", "training.save_interval=2")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "split" not in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    settings = read_checkpoint_record(run / "checkpoints" / "step_4")
    assert settings is not None and settings.get("quantize_base") == "nf4", settings

    out = tmp_path / "adapters"
    exported = runner.invoke(
        app, ["convert", "dcp-to-hf", "--lora", "adapters", "--dcp-dir", str(run / "checkpoints"), "--out-dir", str(out)]
    )  # fmt: skip
    assert exported.exit_code == 0, exported.output
    assert adapters_change(quick / "model", out) > 1e-5, "the trained adapters change the base's output"
