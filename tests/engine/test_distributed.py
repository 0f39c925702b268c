"""`magistral train` with 2 CPU processes under torchrun (gloo): sharding, crash-safe saves, exact resume."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from magistral_cli.engine.checkpoint import FAULT_ENV
from magistral_cli.engine.trainer import Trainer

from .helpers import make_recipe, recipe_dict, run_train, train_command, write_tiny_model

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 5


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, len(lines) + 1))
    return [x["loss"] for x in lines]


def test_two_processes_checkpoint_kill_and_exact_resume(tmp_path):
    model_dir = tmp_path / "model"
    write_tiny_model(model_dir)
    recipe = tmp_path / "tiny.yaml"
    # Micro-batch 1 on each of 2 ranks: the global batch of 2 that 1 process sees with micro-batch 2.
    data = recipe_dict(
        model_dir, tmp_path / "unused", micro_batch_size=1, train_iters=STEPS, save_interval=2, resume="auto"
    )
    del data["training"]["output_dir"]
    recipe.write_text(yaml.safe_dump(data))

    # Uninterrupted, 2 processes.
    whole = tmp_path / "whole"
    done = run_train(recipe, whole)
    assert done.returncode == 0, done.stderr[-3000:]
    whole_losses = _losses(whole)
    # Not a terminal: rank 0's progress degrades to one plain line per logged step.
    assert f"step {STEPS}/{STEPS}  loss " in done.stdout + done.stderr
    assert len(whole_losses) == STEPS
    assert (whole / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
    # Sharded, not replicated: each rank wrote its own half of every 2D weight.
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(whole / "checkpoints" / f"step_{STEPS}")).read_metadata().state_dict_metadata
    for key in ("model.lm_head.weight", "model.model.language_model.layers.0.mlp.up_proj.weight"):
        assert [c.offsets[0] for c in meta[key].chunks] == [0, meta[key].size[0] // 2], key
    assert "optimizer.state.lm_head.weight.exp_avg" in meta

    # 1 process, the same global batches.
    single = Trainer(make_recipe(model_dir, tmp_path / "single", micro_batch_size=2, train_iters=STEPS))
    try:
        single_losses = [r["loss"] for r in single.train()]
    finally:
        single.close()
    assert whole_losses == pytest.approx(single_losses, rel=1e-5)

    # Rank 0 is killed while the step-4 checkpoint is being written: latest stays on step 2.
    broken = tmp_path / "broken"
    killed = run_train(recipe, broken, env={FAULT_ENV: "kill-during-save:4:0"})
    assert killed.returncode != 0
    checkpoints = broken / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    assert (checkpoints / ".tmp_step_4").is_dir()  # the half-committed save
    assert not (checkpoints / "step_4").exists()
    assert (checkpoints / "step_2" / ".metadata").is_file()

    # Launched again, it resumes from step 2 (resume: auto) and matches the uninterrupted run exactly.
    resumed = run_train(recipe, broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
    assert _losses(broken) == whole_losses
    assert not (checkpoints / ".tmp_step_4").exists()
    assert (checkpoints / "latest").read_text().strip() == f"step_{STEPS}"
    summary = json.loads((broken / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["exit_status"] == 0


def test_sigterm_to_the_command_stops_every_rank(tmp_path):
    """`kill <magistral train>` reaches torchrun: no rank outlives the command, the summary says how it ended."""
    import signal
    import time

    model_dir = tmp_path / "model"
    write_tiny_model(model_dir)
    recipe = tmp_path / "tiny.yaml"
    data = recipe_dict(model_dir, tmp_path / "unused", micro_batch_size=1, train_iters=10_000, resume="auto")
    del data["training"]["output_dir"]
    recipe.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        train_command(recipe, run_dir),
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, "training ended before it was signalled"
        assert time.monotonic() < deadline, "no training step within 240 s"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    ranks = subprocess.run(
        ["pgrep", "-f", str(run_dir / "resolved_config.yaml")], capture_output=True, text=True
    )
    assert ranks.stdout.strip() == "", f"ranks still running: {ranks.stdout}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_status"] != 0
