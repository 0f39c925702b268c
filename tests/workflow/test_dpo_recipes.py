"""Preference training as a new user tries it: the tiny DPO recipes on 2 CPU processes.

The quickstart's assets (the tiny model and 64 preference pairs with images in LLaMA-Factory's
ranking layout) are preprocessed into pairs, the LoRA recipe trains 12 steps (its rewards rise on
the training pairs and are logged for the validation pairs), its adapters export as PEFT files that
peft loads on the base, and `generate` answers with the run. The full recipe trains against a frozen
copy of its starting weights, which its dry run counts, with its pairs neatly packed. That the numbers
are right is proven in tests/engine/test_preference.py (against transformers' forward), the exact resume
in tests/engine/test_preference_distributed.py, packing in tests/engine/test_preference_packing.py.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.config import load_recipe
from magistral_cli.data.loader import build_train_dataset, prepare_dataset
from magistral_cli.metric_names import PREFERENCE_METRICS
from magistral_cli.ops.packed_attention import packed_attention_name
from magistral_cli.quickstart import write_assets
from tests.engine.helpers import REPO, adapters_change, quickstart_overrides, run_train

pytestmark = pytest.mark.slow
runner = CliRunner()


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_dpo_recipes_train_log_rewards_and_export(tmp_path):
    quick = tmp_path / "quickstart"
    write_assets(quick, 16)
    common = quickstart_overrides(quick, "pairs", tmp_path / "cache")
    lora_recipe = REPO / "recipes" / "tiny" / "tiny_cpu_dpo_lora.yaml"
    full_recipe = REPO / "recipes" / "tiny" / "tiny_cpu_dpo.yaml"

    pre = runner.invoke(app, ["preprocess", str(lora_recipe), *common, "--json"])
    assert pre.exit_code == 0, pre.output
    report = json.loads(pre.stdout)["report"]
    assert (report["pairs"], report["kept"], report["sequences"], report["dropped"]) == (True, 64, 128, 0)

    plan = runner.invoke(app, ["train", str(full_recipe), *common, "--dry-run", "--json"])
    assert plan.exit_code == 0, plan.output
    items = json.loads(plan.stdout)["memory_plan"]["memory"]["items"]
    assert items["reference_shards"] > 0
    # The padding estimate: 2 rows a pair unpacked; packed, packs of whole pairs, exactly the packs the
    # training loader builds (over every pair: no validation split) and every token in them.
    modes = json.loads(plan.stdout)["padding"]["estimate"]["modes"]
    assert (modes["none"]["rows_per_micro_batch"], modes["packing"]["rows_per_micro_batch"]) == (4, 2)
    assert json.loads(plan.stdout)["padding"]["estimate"]["pairs_per_micro_batch"] == 2
    shown = runner.invoke(app, ["train", str(full_recipe), *common, "--dry-run"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "padding per micro-batch of 2 pairs (4 sequences) (128 sequences;" in shown.output
    basic = "data.dataset_param.basic_parameters"
    neat = load_recipe(
        full_recipe,
        [*common, f"{basic}.neat_packing=true", f"{basic}.val_size=0", "training.eval_interval=null"],
    )
    dataset = prepare_dataset(neat)
    packs = build_train_dataset(neat, dataset)
    assert modes["packing"]["rows"] == len(packs) and len(packs) < 64
    assert modes["packing"]["real_tokens_per_micro_batch"] == pytest.approx(
        2 * int(sum(dataset.lengths)) / len(packs), abs=0.1
    )
    lora_plan = runner.invoke(app, ["train", str(lora_recipe), *common, "--dry-run", "--json"])
    assert "reference_shards" not in json.loads(lora_plan.stdout)["memory_plan"]["memory"]["items"]

    lora_run = tmp_path / "lora"
    done = run_train(lora_recipe, lora_run, *common)
    assert done.returncode == 0, done.stderr[-3000:]
    train = [r for r in _records(lora_run) if "split" not in r]
    val = [r for r in _records(lora_run) if r.get("split") == "val"]
    assert [r["step"] for r in train] == list(range(1, 13)) and [r["step"] for r in val] == [6, 12]
    for r in train + val:
        assert set(PREFERENCE_METRICS) <= r.keys(), r
    # Steps 1-2 start from the base (adapters B = 0; step 1's lr is 0 in warm-up): no preference yet.
    assert train[0]["loss"] == pytest.approx(0.693147, abs=1e-5) and train[0]["rewards/margins"] == 0.0
    late = train[-6:]
    assert sum(r["rewards/accuracies"] for r in late) / len(late) > 0.7
    assert sum(r["rewards/margins"] for r in late) / len(late) > 0.02
    assert sum(r["loss"] for r in late) / len(late) < 0.69

    out = tmp_path / "adapters"
    exported = runner.invoke(
        app, ["convert", "dcp-to-hf", "--lora", "adapters", "--dcp-dir", str(lora_run / "checkpoints"),
              "--out-dir", str(out)]
    )  # fmt: skip
    assert exported.exit_code == 0, exported.output
    assert adapters_change(quick / "model", out) > 1e-4, "the trained adapters change the model"

    answer = runner.invoke(
        app,
        [
            "generate",
            "--model",
            str(lora_run),
            "--prompt",
            "What color?",
            "--greedy",
            "--max-new-tokens",
            "3",
        ],
    )
    assert answer.exit_code == 0, answer.output

    # The full recipe neatly packed: packs of whole pairs (tests/engine/test_preference_packing.py proves
    # a pack equal to its pairs unpacked).
    full_run = tmp_path / "full"
    neat = "data.dataset_param.basic_parameters.neat_packing=true"
    done = run_train(
        full_recipe, full_run, *common, "training.train_iters=3", "training.save_interval=0", neat
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = json.loads((full_run / "run_identity.json").read_text())["resolved"]
    assert resolved["attn_implementation"] == packed_attention_name("sdpa")
    assert "reference model:" in done.stderr
    records = _records(full_run)
    assert [r["step"] for r in records if "split" not in r] == [1, 2, 3]
    assert records[-1]["split"] == "val" and 0.0 <= records[-1]["rewards/accuracies"] <= 1.0
