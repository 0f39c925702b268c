"""`magistral fetch` end to end: the real huggingface_hub client against a local Hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from typer.testing import CliRunner

from magistral_cli.assets.fetch import QUARANTINE_DIR
from magistral_cli.assets.manifest import MANIFEST_NAME
from magistral_cli.cli.main import app
from magistral_cli.testing.local_hub import SYNTHETIC_OFFICIAL

runner = CliRunner()
TOKEN = "hf_SyntheticSecretToken0123456789"


def fetch(*args):
    return runner.invoke(app, ["fetch", *map(str, args)])


def test_fetch_json_then_verify_only_offline(tmp_path, hub, lock):
    model = tmp_path / "model"
    result = fetch("--model-dir", model, "--lock", lock, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["verify_only"] is False
    assert report["manifest"] == str(model / MANIFEST_NAME)
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    assert {e["name"]: e["sha256"] for e in manifest["files"]} == {
        f["name"]: f["sha256"] for f in report["files"]
    }
    for entry in manifest["files"]:
        assert entry["sha256"] == hashlib.sha256((model / entry["name"]).read_bytes()).hexdigest()

    hub.stop()
    result = fetch("--model-dir", model, "--lock", lock, "--verify-only")
    assert result.exit_code == 0, result.output
    assert "all 5 files verified" in result.output


def test_tampered_file_exits_1_naming_both_sums(tmp_path, hub, lock):
    model = tmp_path / "model"
    assert fetch("--model-dir", model, "--lock", lock).exit_code == 0
    good = (model / "tekken.json").read_bytes()
    bad = good.replace(b"synthetic", b"tampered!")
    (model / "tekken.json").write_bytes(bad)

    result = fetch("--model-dir", model, "--lock", lock, "--no-weights", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    (failure,) = [f for f in report["files"] if f["status"] != "ok"]
    assert failure["name"] == "tekken.json" and failure["status"] == "mismatch"
    assert hashlib.sha256(good).hexdigest() in result.output
    assert hashlib.sha256(bad).hexdigest() in result.output
    assert "tekken.json" in result.stderr and "Traceback" not in result.output
    assert not (model / "tekken.json").exists()
    assert len(list((model / QUARANTINE_DIR).glob("tekken.json.*"))) == 1

    # The next run downloads it again and passes.
    result = fetch("--model-dir", model, "--lock", lock, "--no-weights")
    assert result.exit_code == 0, result.output
    assert (model / "tekken.json").read_bytes() == good


def test_lock_entry_escaping_the_directory_exits_2(tmp_path, hub, lock):
    data = json.loads(lock.read_text())
    data["files"][0]["name"] = "../outside.json"
    lock.write_text(json.dumps(data))
    model = tmp_path / "model"
    result = fetch("--model-dir", model, "--lock", lock)
    assert result.exit_code == 2
    assert "escape the model directory" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "outside.json").exists()
    assert not [r for r in hub.requests if "/resolve/" in r.path]


def test_token_is_sent_but_never_printed_or_written(tmp_path, hub, lock, monkeypatch):
    hub.token = TOKEN
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = tmp_path / "model"
    result = fetch("--model-dir", model, "--lock", lock, "--json")
    assert result.exit_code == 0, result.output
    resolves = [r for r in hub.requests if "/resolve/" in r.path]
    assert resolves and all(r.authorized for r in resolves)
    assert TOKEN not in result.output
    for path in model.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path

    # A refused token: the error names the problem, not the token.
    hub.token = TOKEN + "-other"
    result = fetch("--model-dir", tmp_path / "model2", "--lock", lock, "--no-weights")
    assert result.exit_code == 2, result.output
    assert "HF_TOKEN" in result.output and TOKEN not in result.output


def test_default_lock_is_found_and_verify_only_reports_missing_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = fetch("--model-dir", empty, "--verify-only", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["lock"].endswith("magistral-small-2509.assets.lock.json")
    assert {f["name"]: f["status"] for f in report["files"]} == {
        "config.json": "missing",
        "model.safetensors.index.json": "missing",
        "tekken.json": "missing",
        "model-*.safetensors": "error",
    }


def test_bad_tokenizer_source_is_refused():
    result = fetch("--model-dir", "x", "--tokenizer-source", "bpe")
    assert result.exit_code == 2


def test_console_script_runs_a_fetch(tmp_path, hub, lock):
    """The command as a user runs it: a separate process that reads HF_ENDPOINT at start."""
    model = tmp_path / "model"
    env = {**__import__("os").environ, "HF_ENDPOINT": hub.endpoint}
    code = "from magistral_cli.cli.main import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "fetch", "--model-dir", str(model), "--lock", str(lock), "--no-weights"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "all 3 files verified" in out.stderr
    repo, rev = SYNTHETIC_OFFICIAL
    assert (model / "config.json").read_bytes() == (hub.root / repo / rev / "config.json").read_bytes()


def test_native_fetches_mistrals_own_layout_too(tmp_path, hub, lock):
    model = tmp_path / "model"
    result = fetch("--model-dir", model, "--lock", lock, "--no-weights", "--native")
    assert result.exit_code == 0, result.output
    assert "all 5 files verified" in result.output  # config, index, tekken + params, consolidated
    for name in ("params.json", "consolidated.safetensors"):
        assert (model / name).read_bytes() == (
            hub.root / SYNTHETIC_OFFICIAL[0] / SYNTHETIC_OFFICIAL[1] / name
        ).read_bytes()
    data = json.loads(lock.read_text())
    del data["native"]
    lock.write_text(json.dumps(data))
    result = fetch("--model-dir", model, "--lock", lock, "--native")
    assert result.exit_code == 2 and "lists no native-layout files" in result.output
