"""Damaged checkpoints are never read as good ones: export, validate, generate and resume.

A real training run (the tiny model, one process) saves ``step_2`` and ``step_4`` with their
``integrity.json``. Each test copies it and breaks the newest checkpoint on disk as a user, a
script or a failing disk would: a shard swapped in from the other step, bytes overwritten in
place, a shard truncated or deleted, ``integrity.json`` removed (with the bytes then changed, or
not), a step's files moved into another step's directory. Then it runs the command a user would
run (``magistral convert ...`` / ``magistral generate`` through the CLI, the trainer for resume)
and checks the exit code, that the message names the file and what differs, that nothing is
written, and, where a directory of checkpoints was given, that exactly the intact ``step_2`` is
served. A ``convert hf-to-dcp`` output (no integrity record) with a data file deleted or cut
short is checked against its own ``.metadata``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.errors import CheckFailed

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from engine.helpers import make_recipe, write_tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
runner = CliRunner()
SHARD = "__0_0.distcp"


def _train(model_dir: Path, run_dir: Path, train_iters: int) -> list[dict]:
    from magistral_cli.engine.trainer import Trainer

    trainer = Trainer(
        make_recipe(model_dir, run_dir, train_iters=train_iters, save_interval=2, resume="auto")
    )
    try:
        return trainer.train()
    finally:
        trainer.close()


def _export(checkpoint: Path, model_dir: Path, out: Path) -> Path:
    from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf

    export_dcp_to_hf(checkpoint, model_dir, out)
    return out


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """model/, run/ (checkpoints step_2 and step_4), and exports of both intact checkpoints."""
    root = tmp_path_factory.mktemp("damaged")
    write_tiny_model(root / "model")
    records = _train(root / "model", root / "run", 4)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    saves = root / "run" / "checkpoints"
    assert sorted(p.name for p in saves.iterdir()) == ["latest", "step_2", "step_4"]
    exports = {
        step: _export(saves / step, root / "model", root / f"{step}_export") for step in ("step_2", "step_4")
    }
    return root / "model", root / "run", exports


@pytest.fixture
def run(base_run, tmp_path):
    model_dir, base, exports = base_run
    shutil.copytree(base, tmp_path / "run")
    return model_dir, tmp_path / "run", exports


def _largest_model_item(checkpoint: Path) -> tuple[int, int]:
    """(offset, length) of the biggest model tensor's bytes in the shard, from the checkpoint's .metadata."""
    from magistral_cli.checkpoint.safe_dcp import read_metadata

    metadata = read_metadata(checkpoint)
    info = max(
        (i for k, i in metadata.storage_data.items() if k.fqn.startswith("model.")), key=lambda i: i.length
    )
    return int(info.offset), int(info.length)


def _damage(checkpoint: Path, how: str) -> tuple[Path, str]:
    """Break ``checkpoint`` (a copied step_4) as named; returns (the file the message must name, what it says)."""
    shard = checkpoint / SHARD
    other = checkpoint.parent / "step_2"
    if how == "shard swapped from step_2":
        assert (other / SHARD).stat().st_size == shard.stat().st_size  # same shapes: only the bytes differ
        shutil.copyfile(other / SHARD, shard)
        return shard, "does not match its xxh3_64 checksum"
    if how == "overwritten in place":
        offset, length = _largest_model_item(checkpoint)
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.seek(offset + length // 2)
            f.write(b"\x7f" * 64)  # inside the tensor's bytes: the model would load other weights
        assert shard.stat().st_size == size
        return shard, "does not match its xxh3_64 checksum"
    if how == "truncated":
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.truncate(size // 10)
        return shard, f"has {size // 10} bytes, {size} were written"
    if how == "shard deleted":
        shard.unlink()
        return shard, "is missing"
    if how == "record removed, bytes changed":
        (checkpoint / "integrity.json").unlink()
        _damage(checkpoint, "overwritten in place")
        return checkpoint, "without integrity.json"
    if how == "step_2's files moved in":
        for name in (SHARD, "integrity.json"):
            shutil.copyfile(other / name, checkpoint / name)
        return checkpoint / "integrity.json", "records step 2, but the directory is step_4"
    raise AssertionError(how)


DAMAGE = [
    "shard swapped from step_2",
    "overwritten in place",
    "truncated",
    "shard deleted",
    "record removed, bytes changed",
    "step_2's files moved in",
]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".partial-" in p.name]


# --------------------------------------------------------------------------- one named checkpoint


@pytest.mark.parametrize("how", DAMAGE)
def test_export_refuses_a_damaged_checkpoint_and_names_the_file(run, tmp_path, how):
    model_dir, run_dir, _ = run
    checkpoint = run_dir / "checkpoints" / "step_4"
    named, what = _damage(checkpoint, how)
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            str(checkpoint),
            "--model-dir",
            str(model_dir),
            "--out-dir",
            str(out),
        ],
    )
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert str(named) in text and what in text, text
    assert "Traceback" not in result.output
    if how.startswith("record removed"):
        assert "--allow-unverified" in text
    assert not out.exists()
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("how", ["overwritten in place", "truncated", "record removed, bytes changed"])
def test_validate_reports_the_damaged_file(run, how):
    model_dir, run_dir, _ = run
    checkpoint = run_dir / "checkpoints" / "step_4"
    named, what = _damage(checkpoint, how)
    args = ["convert", "validate", "--dcp-dir", str(checkpoint), "--model-dir", str(model_dir)]
    result = runner.invoke(app, [*args, "--layout", "engine", "--json"])
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and payload["missing_count"] == 0  # the keys are fine: the files are not
    assert payload["file_problem_count"] >= 1
    assert str(named) in payload["file_problems"][0] and what in payload["file_problems"][0]


@pytest.mark.parametrize("how", ["shard swapped from step_2", "truncated", "record removed, bytes changed"])
def test_generate_refuses_a_damaged_checkpoint(run, how):
    model_dir, run_dir, _ = run
    checkpoint = run_dir / "checkpoints" / "step_4"
    named, what = _damage(checkpoint, how)
    args = ["generate", "--model", str(checkpoint), "--base", str(model_dir), "--prompt", "Hello?"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert str(named) in text and what in text, text


# --------------------------------------------------------------------------- a directory of checkpoints


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("given", ["checkpoints/", "run directory"])
def test_from_a_directory_the_newest_intact_checkpoint_is_exported(run, tmp_path, how, given, caplog):
    model_dir, run_dir, exports = run
    named, what = _damage(run_dir / "checkpoints" / "step_4", how)
    source = run_dir / "checkpoints" if given == "checkpoints/" else run_dir
    out = tmp_path / "out"
    args = [
        "convert",
        "dcp-to-hf",
        "--dcp-dir",
        str(source),
        "--model-dir",
        str(model_dir),
        "--out-dir",
        str(out),
    ]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["checkpoint_dir"] == str(run_dir / "checkpoints" / "step_2")
    assert _files(out) == _files(exports["step_2"])  # exactly the intact step_2, not the damaged step_4
    log = " ".join(caplog.text.split())
    assert "skipped step_4" in log and str(named) in log and what in log
    assert "latest names step_4; taking step_2, the newest intact checkpoint" in log


def test_generate_takes_the_newest_intact_checkpoint_of_a_run(run, caplog):
    from magistral_cli.generate import resolve_source

    model_dir, run_dir, _ = run
    named, _ = _damage(run_dir / "checkpoints" / "step_4", "overwritten in place")
    source = resolve_source(run_dir, base=model_dir)
    assert source.kind == "checkpoint" and source.checkpoint == run_dir / "checkpoints" / "step_2"
    assert "skipped step_4" in caplog.text and str(named) in caplog.text


def test_no_intact_checkpoint_is_refused_with_each_problem(run, tmp_path):
    model_dir, run_dir, _ = run
    saves = run_dir / "checkpoints"
    first, _ = _damage(saves / "step_4", "truncated")
    second = saves / "step_2" / "integrity.json"
    second.unlink()
    out = tmp_path / "out"
    args = [
        "convert",
        "dcp-to-hf",
        "--dcp-dir",
        str(saves),
        "--model-dir",
        str(model_dir),
        "--out-dir",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert (
        "none is complete and intact" in text
        and str(first) in text
        and "step_2 is a training checkpoint" in text
    )
    assert not out.exists()


def test_the_command_line_prints_what_it_skipped(run, tmp_path):
    """Outside the test runner's log capture: the warning reaches the user's terminal (stderr)."""
    model_dir, run_dir, _ = run
    named, _ = _damage(run_dir / "checkpoints" / "step_4", "shard deleted")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "magistral_cli", "convert", "dcp-to-hf", "--dcp-dir", str(run_dir)]
        + ["--model-dir", str(model_dir), "--out-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    stderr = " ".join(done.stderr.split())
    assert f"skipped step_4: {named} is missing" in stderr and "taking step_2" in stderr


# --------------------------------------------------------------------------- no record


def test_allow_unverified_reads_a_checkpoint_without_its_record_and_nothing_else(run, tmp_path, caplog):
    model_dir, run_dir, exports = run
    checkpoint = run_dir / "checkpoints" / "step_4"
    (checkpoint / "integrity.json").unlink()  # bytes intact: as a save from before records would be
    args = ["convert", "dcp-to-hf", "--dcp-dir", str(checkpoint), "--model-dir", str(model_dir)]
    refused = runner.invoke(app, [*args, "--out-dir", str(tmp_path / "refused")])
    assert refused.exit_code == 1 and "--allow-unverified" in refused.output
    accepted = runner.invoke(app, [*args, "--out-dir", str(tmp_path / "out"), "--allow-unverified"])
    assert accepted.exit_code == 0, accepted.output
    assert _files(tmp_path / "out") == _files(exports["step_4"])
    assert "read without verification" in caplog.text
    # The option reads a checkpoint without a record; it never overrides a record that disagrees.
    named, what = _damage(run_dir / "checkpoints" / "step_2", "overwritten in place")
    args = ["convert", "dcp-to-hf", "--dcp-dir", str(named.parent), "--model-dir", str(model_dir)]
    damaged = runner.invoke(app, [*args, "--out-dir", str(tmp_path / "damaged"), "--allow-unverified"])
    assert damaged.exit_code == 1 and what in damaged.output
    assert not (tmp_path / "damaged").exists()


def test_resume_and_training_load_refuse_a_checkpoint_without_its_record(run, tmp_path, caplog):
    model_dir, run_dir, _ = run
    (run_dir / "checkpoints" / "step_4" / "integrity.json").unlink()
    records = _train(model_dir, run_dir, 6)
    assert [r["step"] for r in records] == [3, 4, 5, 6]  # from step_2, not from the unverifiable step_4
    assert "skipped checkpoint step_4" in caplog.text and "without integrity.json" in caplog.text

    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(run_dir / "checkpoints" / "step_4", unrecorded)  # step_4 of the resumed run: recorded
    (unrecorded / "integrity.json").unlink()
    from magistral_cli.engine.trainer import Trainer

    try:
        with pytest.raises(CheckFailed, match="without integrity.json"):
            Trainer(make_recipe(model_dir, tmp_path / "other", load=str(unrecorded)))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # the failed constructor left its group behind
            dist.destroy_process_group()


# --------------------------------------------------------------------------- conversions (no record)


@pytest.fixture
def conversion(base_run, tmp_path):
    from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp

    model_dir, _, _ = base_run
    convert_hf_to_dcp(model_dir, tmp_path / "dcp", "fsdp2")
    return model_dir, tmp_path / "dcp"


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_conversion_with_a_missing_or_short_data_file_fails_validate_and_export(conversion, tmp_path, how):
    model_dir, dcp_dir = conversion
    shard = max(dcp_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if how == "deleted":
        shard.unlink()
        what = "is missing (.metadata places"
    else:
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 1)
        what = "but .metadata places data up to byte"
    validate = runner.invoke(
        app, ["convert", "validate", "--model-dir", str(model_dir), "--dcp-dir", str(dcp_dir), "--json"]
    )
    assert validate.exit_code == 1, validate.output
    payload = json.loads(validate.stdout)
    assert payload["ok"] is False and str(shard) in payload["file_problems"][0]
    assert what in payload["file_problems"][0]

    out = tmp_path / "out"
    args = [
        "convert",
        "dcp-to-hf",
        "--dcp-dir",
        str(dcp_dir),
        "--model-dir",
        str(model_dir),
        "--out-dir",
        str(out),
    ]
    export = runner.invoke(app, args)
    assert export.exit_code == 1, export.output
    text = " ".join(export.output.split())
    assert str(shard) in text and what in text and "Traceback" not in export.output
    assert not out.exists()
    _no_leftovers(tmp_path)
