"""``neat_packing: true`` as a new user turns it on: the tiny recipe on 2 CPU processes.

The recipe's data (synthetic LLaVA records with images, the real Tekken tokenizer) packed neatly:
the run trains, says so, records the packed attention it used, and feeds more real tokens per
step than the same run without packing. That a neat pack trains exactly like its samples one by
one is proven in tests/engine/test_packing.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.engine.helpers import REPO, quickstart_overrides, run_train
from tests.workflow.test_context_parallel_recipe import _build_quickstart

pytestmark = pytest.mark.slow
STEPS = 3


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_neat_packing_trains_the_tiny_recipe_on_two_processes(tmp_path):
    _build_quickstart(tmp_path)
    quick = tmp_path / "quickstart"
    recipe = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
    common = (
        *quickstart_overrides(quick, "data", tmp_path / "cache"),
        f"training.train_iters={STEPS}",
        "training.save_interval=0",
    )
    runs = {}
    for name, extra in (
        ("neat", ("data.dataset_param.basic_parameters.neat_packing=true",)),
        ("unpacked", ()),
    ):
        run_dir = tmp_path / name
        done = run_train(recipe, run_dir, *common, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = _metrics(run_dir)
        assert [r["step"] for r in runs[name]] == list(range(1, STEPS + 1))
        assert all(math.isfinite(r["loss"]) for r in runs[name])
        # model FLOPs counted per packed sample (neat) or per row: logged, no MFU without a CPU peak
        assert all(
            r["flops_per_token"] > 0 and r["tflops_per_gpu"] > 0 and r["mfu"] is None for r in runs[name]
        )
        identity = json.loads((run_dir / "run_identity.json").read_text())
        resolved = identity["resolved"]["attn_implementation"]
        assert resolved == ("magistral_packed_sdpa" if name == "neat" else "sdpa"), resolved
    resolved = (tmp_path / "neat" / "resolved_config.yaml").read_text()
    assert "neat_packing: true" in resolved and "packing: true" in resolved
    # A pack holds several samples: far more real tokens per step than one sample a row.
    neat_tokens = sum(r["tokens"] for r in runs["neat"])
    plain_tokens = sum(r["tokens"] for r in runs["unpacked"])
    assert neat_tokens > 2 * plain_tokens, (neat_tokens, plain_tokens)
