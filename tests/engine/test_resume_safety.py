"""Resume never restarts a run from scratch, never trusts a damaged checkpoint, never trains on NaN.

One process (gloo) with the tiny model: a run saves step_2, step_4 and step_6, then each test
breaks that run directory as a user or a crash would and launches the same recipe again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from magistral_cli.engine import checkpoint as ckpt
from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import CheckFailed, UserError

from .helpers import full_params, make_recipe, write_tiny_model

STEPS = 6


def _train(model_dir: Path, run_dir: Path, train_iters: int, **training) -> list[dict]:
    training = {"save_interval": 2, "resume": "auto", **training}
    trainer = Trainer(make_recipe(model_dir, run_dir, train_iters=train_iters, **training))
    try:
        return trainer.train()
    finally:
        trainer.close()


def _metric_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    write_tiny_model(root / "model")
    records = _train(root / "model", root / "run", STEPS)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return root, [r["loss"] for r in records]


def _copy(base_run, tmp_path) -> tuple[Path, Path]:
    root, _ = base_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    return root / "model", run


def _data_file(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_every_checkpoint_records_sizes_and_checksums(base_run):
    root, _ = base_run
    saves = root / "run" / "checkpoints"
    assert [p.name for _, p in ckpt.list_checkpoints(saves)] == ["step_6", "step_4", "step_2"]
    for _, path in ckpt.list_checkpoints(saves):
        record = json.loads((path / ckpt.INTEGRITY).read_text())
        on_disk = {p.name for p in path.iterdir() if p.name != ckpt.INTEGRITY}
        assert set(record["files"]) == on_disk and ".metadata" in on_disk
        for name, entry in record["files"].items():
            assert entry["size"] == (path / name).stat().st_size
            assert entry["xxh3_64"] == ckpt.file_digest(path / name)
        assert ckpt.verify_checkpoint(path).ok


@pytest.mark.parametrize(
    "damage",
    ["latest deleted", "latest names step_99", "latest points outside", "latest is garbage"],
)
def test_a_bad_latest_resumes_from_the_newest_intact_checkpoint(base_run, tmp_path, damage, caplog):
    model_dir, run = _copy(base_run, tmp_path)
    latest = run / "checkpoints" / "latest"
    other = tmp_path / "other_run" / "checkpoints" / "step_1"
    if damage == "latest deleted":
        latest.unlink()
    elif damage == "latest names step_99":
        latest.write_text("step_99\n")
    elif damage == "latest points outside":
        shutil.copytree(run / "checkpoints" / "step_2", other)
        latest.write_text("../../other_run/checkpoints/step_1\n")
    else:
        latest.write_bytes(b"\xff\xfe\x00garbage\x80")
    records = _train(model_dir, run, STEPS + 2)
    # Resumed from step 6 (not step 1, not the other run's checkpoint), and nothing overwritten.
    assert [r["step"] for r in records] == [7, 8]
    assert _metric_steps(run / "metrics.jsonl") == list(range(1, STEPS + 3))
    assert "taking step_6, the newest intact checkpoint" in caplog.text
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_8"


@pytest.mark.parametrize("damage", ["truncated", "overwritten in place", "metadata deleted"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(base_run, tmp_path, damage, caplog):
    _, losses = base_run
    model_dir, run = _copy(base_run, tmp_path)
    newest = run / "checkpoints" / "step_6"
    victim = _data_file(newest)
    if damage == "truncated":
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
    elif damage == "overwritten in place":
        size = victim.stat().st_size
        with open(victim, "r+b") as f:
            f.seek(size // 3)
            f.write(b"\x7f" * 4096)  # same size, other bytes: only the checksum sees it
        assert victim.stat().st_size == size
    else:
        (newest / ".metadata").unlink()
    records = _train(model_dir, run, STEPS + 2)
    # From step 4: steps 5..8 again. Step 5's loss is the first run's (the same weights after step
    # 4); later ones differ because train_iters, and so the cosine schedule, changed.
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert records[0]["loss"] == pytest.approx(losses[4], rel=1e-6)
    assert "skipped checkpoint step_6" in caplog.text
    if damage != "metadata deleted":
        assert victim.name in caplog.text
    # The old lines of steps 5 and 6 are moved aside, never deleted.
    assert _metric_steps(run / "metrics.jsonl") == list(range(1, STEPS + 3))
    assert _metric_steps(run / "metrics.after_step_4.jsonl") == [5, 6]


def test_no_intact_checkpoint_exits_1_with_the_list(base_run, tmp_path):
    model_dir, run = _copy(base_run, tmp_path)
    for _, path in ckpt.list_checkpoints(run / "checkpoints"):
        with open(_data_file(path), "r+b") as f:
            f.truncate(10)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(CheckFailed, match="none is complete and intact") as info:
        _train(model_dir, run, STEPS + 2)
    for name in ("step_6", "step_4", "step_2"):
        assert name in str(info.value)
    assert (run / "metrics.jsonl").read_text() == before


def test_a_fresh_start_never_overwrites_checkpoints(base_run, tmp_path):
    model_dir, run = _copy(base_run, tmp_path)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(UserError, match="training.resume=never.*new training.output_dir"):
        _train(model_dir, run, STEPS + 2, resume="never")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_non_finite_step_stops_before_its_update_and_writes_no_checkpoint(base_run, tmp_path):
    root, _ = base_run
    run = tmp_path / "nan"
    trainer = Trainer(
        make_recipe(root / "model", run, train_iters=4, save_interval=1, lr=1e30, resume="auto")
    )
    try:
        # Step 1 runs at lr 0 (the warm-up's first value), step 2 at 1e30 blows the weights up, and
        # step 3's loss is not finite.
        with pytest.raises(
            CheckFailed, match=r"step 3: .* is not finite; the update was not applied"
        ) as info:
            trainer.train()
        params_finite = all(p.isfinite().all() for p in full_params(trainer.model).values())
    finally:
        trainer.close()
    assert "skip_nonfinite_steps" in str(info.value)
    assert params_finite, "the non-finite update reached the weights"
    assert [p.name for _, p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_2", "step_1"]
    # Strict JSON: every line parses with a parser that refuses NaN.
    lines = (run / "metrics.jsonl").read_text().splitlines()
    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in metrics.jsonl"))
    assert _metric_steps(run / "metrics.jsonl") == [1, 2]


def test_skip_nonfinite_steps_skips_and_logs(base_run, tmp_path):
    root, _ = base_run
    run = tmp_path / "skip"
    records = _train(root / "model", run, 4, lr=1e30, skip_nonfinite_steps=True)
    assert [r.get("skipped", False) for r in records] == [False, False, True, True]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("skipped", False) for line in lines] == [False, False, True, True]
    assert lines[2]["loss"] is None  # NaN is written as null


def _lora_base(model_dir: Path, run_dir: Path, load: Path) -> dict:
    """A LoRA trainer whose base comes from ``load``: its frozen base weights, by base name."""
    from magistral_cli.engine import lora

    overrides = [
        f"training.load={load}",
        "model.lora.r=4",
        "model.lora.alpha=8",
        "model.lora.target_modules=[q_proj,v_proj]",
        "training.init_model_with_meta_device=true",
    ]
    trainer = Trainer(make_recipe(model_dir, run_dir, overrides, train_iters=1))
    try:
        return {
            lora.base_key(n): p for n, p in full_params(trainer.model).items() if not lora.is_adapter_key(n)
        }
    finally:
        trainer.close()


def test_a_lora_base_from_training_checkpoints_is_verified_like_a_resume(base_run, tmp_path, caplog):
    """training.load naming a full run's checkpoint, or its directory, as a LoRA base: a damaged one is
    refused or passed over, never loaded as good; a LoRA checkpoint is never a base."""
    import torch
    import torch.distributed as dist

    model_dir, run = _copy(base_run, tmp_path)
    step_4 = _lora_base(model_dir, tmp_path / "lora4", run / "checkpoints" / "step_4")
    with open(_data_file(run / "checkpoints" / "step_6"), "r+b") as f:
        f.seek(f.seek(0, 2) // 3)
        f.write(b"\x7f" * 4096)  # same size, other bytes: only the checksum sees it
    try:
        with pytest.raises(CheckFailed, match=r"training.load .*step_6 is a damaged checkpoint"):
            _lora_base(model_dir, tmp_path / "lora6", run / "checkpoints" / "step_6")
    finally:
        if dist.is_initialized():  # the failed constructor left its group behind
            dist.destroy_process_group()
    # The run directory: its newest intact checkpoint, step_4, with a warning for step_6.
    chosen = _lora_base(model_dir, tmp_path / "lora-dir", run)
    assert "training.load: skipped checkpoint step_6" in caplog.text
    assert chosen.keys() == step_4.keys() and chosen
    for name, value in chosen.items():
        assert torch.equal(value, step_4[name]), name
    # ... which is step_4's model, not the model directory's weights.
    original = _model_dir_weights(model_dir)
    assert any(not torch.equal(v, original[k]) for k, v in step_4.items())

    # A directory whose newest checkpoint is a LoRA one (adapters only) is no base.
    lora_run = tmp_path / "lora-run"
    trainer = Trainer(
        make_recipe(
            model_dir,
            lora_run,
            ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"],
            train_iters=2,
            save_interval=2,
        )
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    try:
        with pytest.raises(UserError, match="is a LoRA training checkpoint .*not base weights"):
            _lora_base(model_dir, tmp_path / "lora-on-lora", lora_run)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _model_dir_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    from magistral_cli.checkpoint.keys import to_transformers_key

    out = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out.update({to_transformers_key(k): v for k, v in load_file(shard).items()})
    return out
