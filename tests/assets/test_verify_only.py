"""`magistral fetch --verify-only` checks and changes nothing: a folder holding another model's files
is reported (exit 1) with every file left where it was; moving them aside takes --quarantine."""

from __future__ import annotations

import hashlib
import json

from typer.testing import CliRunner

from magistral_cli.assets.fetch import QUARANTINE_DIR
from magistral_cli.cli.main import app

runner = CliRunner()


def _tree(directory):
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_verify_only_reports_another_models_files_and_moves_nothing(tmp_path, hub, lock):
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    (other / "tekken.json").write_text('{"not": "this tokenizer"}')
    (other / "notes.txt").write_text("mine\n")
    before = _tree(other)
    hub.stop()  # a check touches no network

    result = runner.invoke(
        app,
        ["fetch", "--model-dir", str(other), "--lock", str(lock), "--no-weights", "--verify-only", "--json"],
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    statuses = {f["name"]: f["status"] for f in report["files"]}
    assert statuses["config.json"] == statuses["tekken.json"] == "mismatch"
    assert statuses["model.safetensors.index.json"] == "missing"
    assert all(f["quarantined_to"] is None for f in report["files"])
    assert (
        "left in place (--verify-only changes nothing)" in result.stderr and "Traceback" not in result.output
    )
    assert _tree(other) == before and not (other / QUARANTINE_DIR).exists()

    # Moving them aside is asked for explicitly.
    result = runner.invoke(
        app,
        [
            "fetch",
            "--model-dir",
            str(other),
            "--lock",
            str(lock),
            "--no-weights",
            "--verify-only",
            "--quarantine",
        ],
    )
    assert result.exit_code == 1, result.output
    assert not (other / "config.json").exists() and not (other / "tekken.json").exists()
    assert len(list((other / QUARANTINE_DIR).iterdir())) == 2 and (other / "notes.txt").is_file()


def test_quarantine_without_verify_only_is_refused(tmp_path, lock):
    result = runner.invoke(
        app, ["fetch", "--model-dir", str(tmp_path / "m"), "--lock", str(lock), "--quarantine"]
    )
    assert result.exit_code == 2, result.output
    assert "--quarantine applies to --verify-only" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m").exists()
