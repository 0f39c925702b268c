"""`--push-to-hub`: exports uploaded by the real ``huggingface_hub`` client to the local Hub on 127.0.0.1.

The Hub is ``testing.local_hub`` with its upload endpoints (create, preupload, LFS batch and PUT, commit);
the client goes through its legacy LFS transfer (Xet storage off), the files that arrive are compared
byte for byte with the export, and the model card is read back from the Hub's copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

runner = CliRunner()
BASE_REPO, BASE_REV = "mistralai/Magistral-Small-2509", "a31cc96ab10cf19bc42c628fedf1e359e0853c49"


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """The tiny model as `magistral fetch` leaves it (a manifest naming its Hub repository), and its
    fsdp2 conversion."""
    from magistral_cli.assets.manifest import ManifestEntry, utc_now, write_manifest
    from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    root = tmp_path_factory.mktemp("publish")
    model_dir = save_official_checkpoint(
        build_tiny_model(tiny_mistral3_config(vocab_size=512)), root / "hf", 2
    )
    entries = {
        p.name: ManifestEntry(p.name, BASE_REPO, BASE_REV, "0" * 64, p.stat().st_size, utc_now())
        for p in sorted(model_dir.iterdir())
    }
    write_manifest(model_dir, entries)
    convert_hf_to_dcp(model_dir, root / "dcp", "fsdp2")
    return model_dir, root / "dcp"


def _export(fetched, out: Path, *extra: str):
    model_dir, dcp_dir = fetched
    args = ["convert", "dcp-to-hf", "--dcp-dir", str(dcp_dir), "--model-dir", str(model_dir)]
    return runner.invoke(app, [*args, "--out-dir", str(out), *extra])


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_push_uploads_every_file_and_the_card(push_hub, fetched, tmp_path):
    hub = push_hub
    token = hub.token
    out = tmp_path / "out"
    result = _export(fetched, out, "--push-to-hub", "me/tiny-ft", "--private", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["hub"]["repo_id"] == "me/tiny-ft" and report["hub"]["revision"] == "main"
    assert report["hub"]["private"] is True and hub.repos == {"me/tiny-ft": {"private": True}}

    arrived = _tree(hub.root / "me" / "tiny-ft" / "main")
    assert arrived == _tree(out)  # every file, the card included, byte for byte
    assert {"README.md", "config.json", "model.safetensors.index.json"} <= set(arrived)
    # The shards went through LFS (batch + PUT to the upload address the batch gave, which takes no
    # token, like the Hub's storage URLs), the small files inline in the commit.
    puts = [r.path for r in hub.requests if r.method == "PUT"]
    assert len(puts) == 2 and all(r.authorized for r in hub.requests if r.method == "POST")
    assert [(c.repo, c.revision) for c in hub.commits] == [("me/tiny-ft", "main")]

    card = arrived["README.md"].decode()
    from magistral_cli import __version__

    assert card.startswith("---\nbase_model: mistralai/Magistral-Small-2509\nlibrary_name: transformers\n")
    assert f"magistral-cli {__version__}" in card and BASE_REV in card
    assert "| `model-00001-of-00002.safetensors` |" in card
    assert "no run records beside the checkpoint" in card  # a conversion, not a run's checkpoint
    # The token is sent, never shown or stored.
    assert token not in result.output
    assert all(token.encode() not in data for data in [*_tree(out).values(), *_tree(hub.root).values()])

    # The real client reads the upload back (as `magistral fetch` downloads).
    from magistral_cli.assets.download import download_file

    name = "model-00002-of-00002.safetensors"
    got = download_file(tmp_path / "back", "me/tiny-ft", "main", name)
    assert got.read_bytes() == (out / name).read_bytes()

    # A second export goes to a new branch of the same repository; main keeps its commit.
    again = _export(fetched, tmp_path / "out2", "--push-to-hub", "me/tiny-ft", "--revision", "exp/lr-1e-4")
    assert again.exit_code == 0, again.output
    assert _tree(hub.root / "me" / "tiny-ft" / "exp" / "lr-1e-4") == _tree(tmp_path / "out2")
    assert [c.revision for c in hub.commits] == ["main", "exp/lr-1e-4"]
    assert hub.repos["me/tiny-ft"] == {"private": True}  # created once


def test_what_is_known_at_the_start_is_refused_before_the_export(push_hub, fetched, tmp_path, monkeypatch):
    token = push_hub.token
    cases = [
        ([], "HF_TOKEN", "no token"),
        (["--push-to-hub", "me/bad..name"], "not a Hub repository id", None),
        (["--push-to-hub", "me/x", "--revision", "../main"], "not a branch name", None),
        (["--private"], "go with --push-to-hub", None),
    ]
    for extra, message, no_token in cases:
        if no_token:
            monkeypatch.delenv("HF_TOKEN")
            extra = ["--push-to-hub", "me/x"]
        result = _export(fetched, tmp_path / "out", *extra)
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output
        assert not (tmp_path / "out").exists()  # refused before anything was written
        monkeypatch.setenv("HF_TOKEN", token)
    assert not [r for r in push_hub.requests if r.method in ("POST", "PUT")]


def test_a_refused_repository_is_exit_2_and_the_export_can_be_pushed_again(push_hub, fetched, tmp_path):
    hub = push_hub
    hub.refused_namespaces.add("someone-else")
    out = tmp_path / "out"
    result = _export(fetched, out, "--push-to-hub", "someone-else/model")
    assert result.exit_code == 2, result.output
    assert "refused to write to someone-else/model (403" in result.output and "Traceback" not in result.output
    assert "magistral convert push --dir" in result.output  # the export is kept, with its card
    assert (out / "README.md").is_file() and not hub.commits

    pushed = runner.invoke(app, ["convert", "push", "--dir", str(out), "--repo-id", "me/model", "--json"])
    assert pushed.exit_code == 0, pushed.output
    assert json.loads(pushed.stdout)["repo_id"] == "me/model"
    assert _tree(hub.root / "me" / "model" / "main") == _tree(out)

    ours, hub.token = hub.token, "hf_anothertoken"  # the Hub does not know ours: 401, the user's to fix
    wrong = runner.invoke(app, ["convert", "push", "--dir", str(out), "--repo-id", "me/model"])
    assert wrong.exit_code == 2 and "refused the token (401" in wrong.output, wrong.output
    assert ours not in wrong.output


def test_an_unreachable_hub_is_exit_1(push_hub, fetched, tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    result = _export(fetched, tmp_path / "out", "--push-to-hub", "me/model")
    assert result.exit_code == 1, result.output
    assert "check the network and HF_ENDPOINT" in result.output and "Traceback" not in result.output
    assert (tmp_path / "out" / "README.md").is_file()


def test_the_card_summarises_the_run_up_to_the_exported_step(tmp_path):
    """A run directory as the launcher and trainer leave it: the card reads the recipe, the identity
    (dataset SHA-256, run id) and the metrics of steps up to the checkpoint's, validation included."""
    import yaml

    from magistral_cli.checkpoint.publish import model_card

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    recipe = {
        "data": {
            "dataset_param": {"basic_parameters": {"dataset": "data/train.jsonl", "template": "mistral"}}
        },
        "model": {
            "model_id": "mistral3",
            "model_name_or_path": "/models/base",
            "lora": {"r": 16, "alpha": 32},
        },
        "training": {"train_iters": 4, "lr": 2.0e-5, "micro_batch_size": 1},
    }
    (run / "resolved_config.yaml").write_text(yaml.safe_dump(recipe))
    identity = {
        "run_id": "run-42",
        "package_version": "0.1.0",
        "world_size": 2,
        "dataset": {"sha256": "ab" * 32},
    }
    (run / "run_identity.json").write_text(json.dumps(identity))
    lines = [
        {"step": 1, "loss": 2.5, "tokens": 100, "tokens_per_s": 50.0},
        {"step": 2, "loss": 2.25, "tokens": 120, "tokens_per_s": 60.0},
        {"step": 2, "split": "val", "loss": 2.4, "samples": 8, "targets": 80},
        {"step": 3, "loss": 1.0, "tokens": 130, "tokens_per_s": 70.0},  # after the exported checkpoint
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "lo')
    (tmp_path / "export").mkdir()
    shutil.copyfile(__file__, tmp_path / "export" / "adapter_model.safetensors")

    card = model_card(
        tmp_path / "export", repo_id="me/ft", kind="adapters", checkpoint=checkpoint, base_dir=None
    )
    assert card.startswith("---\nlibrary_name: peft\n")  # no manifest: no base_model claim
    assert "step 2 of a fine-tuning run" in card and "LoRA adapters" in card
    assert "`/models/base` (a local model directory" in card
    assert "dataset: `data/train.jsonl`" in card and "ab" * 32 in card
    assert "| training loss | 2.5 (step 1) -> 2.25 (step 2) |" in card
    assert "| validation loss | 2.4 (step 2, 8 samples) |" in card
    assert "| tokens trained | 220 |" in card and "| LoRA r / alpha | 16 / 32 |" in card
    assert "run id: `run-42`" in card and "train_iters: 4" in card  # the recipe itself, folded
