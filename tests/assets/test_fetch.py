"""fetch_assets against a local Hub on 127.0.0.1 with the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from magistral_cli.assets.fetch import QUARANTINE_DIR, fetch_assets, verify_model_dir
from magistral_cli.assets.manifest import MANIFEST_NAME, read_manifest
from magistral_cli.errors import CheckFailed, UserError
from magistral_cli.testing.local_hub import (
    SYNTHETIC_OFFICIAL,
    SYNTHETIC_THIRD_PARTY,
)

pytestmark = pytest.mark.compat  # the huggingface_hub client: 1.x does not resume inside its own call

REPO, REV = SYNTHETIC_OFFICIAL
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def served(hub, repo, rev, name) -> bytes:
    return (hub.root / repo / rev / name).read_bytes()


def resolve_gets(hub):
    return [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]


def test_full_fetch_writes_a_manifest_that_matches(tmp_path, hub, lock):
    model = tmp_path / "model"
    report = fetch_assets(model, lock)
    assert report.ok, report.to_json()
    names = [f.name for f in report.files]
    assert names == ["config.json", "model.safetensors.index.json", "tekken.json", SHARD1, SHARD2]
    assert all(f.downloaded for f in report.files)
    by_name = {f.name: f for f in report.files}
    assert by_name["config.json"].expected_from == "lock"
    # First download of a shard: checked against the SHA-256 the Hub serves as its ETag.
    assert by_name[SHARD1].expected_from == "hub" and by_name[SHARD1].status == "ok"

    manifest = json.loads((model / MANIFEST_NAME).read_text())
    assert manifest["format"] == 1
    assert {e["name"] for e in manifest["files"]} == set(names)
    for entry in manifest["files"]:
        data = (model / entry["name"]).read_bytes()
        assert data == served(hub, REPO, REV, entry["name"])
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["bytes"] == len(data)
        assert (entry["repo"], entry["revision"]) == (REPO, REV)
        assert entry["verified_at"].endswith("Z")
    # The third-party tokenizer files are not fetched with the official tokenizer source.
    assert not (model / "tokenizer.json").exists()

    # A second run downloads nothing and checks the shards against the recorded sums.
    n_gets = len(resolve_gets(hub))
    again = fetch_assets(model, lock)
    assert again.ok and not any(f.downloaded for f in again.files)
    assert len(resolve_gets(hub)) == n_gets
    assert {f.expected_from for f in again.files if f.name.startswith("model-")} == {"manifest"}


def test_unsloth_source_adds_the_third_party_files_and_no_weights_skips_shards(tmp_path, hub, lock):
    model = tmp_path / "model"
    report = fetch_assets(model, lock, weights=False, tokenizer_source="unsloth")
    assert report.ok
    assert {f.name for f in report.files} == {
        "config.json",
        "model.safetensors.index.json",
        "tekken.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    repo3, rev3 = SYNTHETIC_THIRD_PARTY
    assert (model / "tokenizer.json").read_bytes() == served(hub, repo3, rev3, "tokenizer.json")
    assert not (model / SHARD1).exists()


def test_corrupted_local_file_is_moved_aside_and_fetched_again(tmp_path, hub, lock):
    model = tmp_path / "model"
    assert fetch_assets(model, lock).ok
    good = (model / SHARD1).read_bytes()
    # Same size, different content: the first byte flipped (a safetensors file starts with its header's
    # length, whose low byte may already be 0).
    corrupted = bytes([good[0] ^ 0xFF]) + good[1:]
    (model / SHARD1).write_bytes(corrupted)

    report = fetch_assets(model, lock)
    assert not report.ok
    (bad,) = report.failures
    actual = hashlib.sha256(corrupted).hexdigest()
    expected = hashlib.sha256(good).hexdigest()
    assert (bad.name, bad.status, bad.expected_from) == (SHARD1, "mismatch", "manifest")
    assert (bad.sha256, bad.expected_sha256) == (actual, expected)
    assert expected in bad.message and actual in bad.message
    assert not (model / SHARD1).exists()
    quarantined = list((model / QUARANTINE_DIR).glob(f"{SHARD1}.*"))
    assert [p.read_bytes() == corrupted for p in quarantined] == [True]
    with pytest.raises(CheckFailed, match=SHARD1):
        report.raise_for_failures()
    # The recorded sum survives, so the fresh download is checked against it.
    assert read_manifest(model)[SHARD1].sha256 == expected

    again = fetch_assets(model, lock)
    assert again.ok
    assert (model / SHARD1).read_bytes() == good


def test_corrupt_download_fails_against_lock_and_hub_sums(tmp_path, hub, lock):
    hub.corrupt |= {f"{REPO}/{REV}/tekken.json", f"{REPO}/{REV}/{SHARD2}"}
    model = tmp_path / "model"
    report = fetch_assets(model, lock)
    failures = {f.name: f for f in report.failures}
    assert set(failures) == {"tekken.json", SHARD2}
    assert failures["tekken.json"].expected_from == "lock"
    assert failures[SHARD2].expected_from == "hub"
    for f in failures.values():
        assert f.quarantined_to and not (model / f.name).exists()
    # Nothing that failed is in the manifest as verified.
    assert set(read_manifest(model)) == {"config.json", "model.safetensors.index.json", SHARD1}


def test_interrupted_download_resumes_with_a_range_request(tmp_path, hub, lock):
    hub.cut_once.add(f"{REPO}/{REV}/{SHARD2}")
    model = tmp_path / "model"
    report = fetch_assets(model, lock)
    assert report.ok, report.to_json()
    ranges = hub.ranges_seen(SHARD2)
    assert len(ranges) == 1 and ranges[0].startswith("bytes=") and ranges[0] != "bytes=0-"
    assert (model / SHARD2).read_bytes() == served(hub, REPO, REV, SHARD2)


def test_verify_only_is_offline_and_detects_tampering(tmp_path, hub, lock):
    model = tmp_path / "model"
    assert fetch_assets(model, lock).ok
    hub.stop()  # no network from here on: a request would fail to connect

    report = verify_model_dir(model, lock)
    assert report.ok and not any(f.downloaded for f in report.files)

    with open(model / "config.json", "ab") as f:
        f.write(b" ")
    tampered = (model / "config.json").read_bytes()
    report = fetch_assets(model, lock, verify_only=True)
    (bad,) = report.failures
    assert bad.name == "config.json" and bad.status == "mismatch"
    assert "bytes" in bad.message  # the size differs too
    # A check moves nothing: the file stays where it is, and the message says how to move it.
    assert (model / "config.json").read_bytes() == tampered and not (model / QUARANTINE_DIR).exists()
    assert bad.quarantined_to is None and "left in place" in bad.message and "--quarantine" in bad.message
    report = fetch_assets(model, lock, verify_only=True, quarantine=True)
    (bad,) = report.failures
    assert bad.quarantined_to and not (model / "config.json").exists()
    report = fetch_assets(model, lock, verify_only=True)
    (missing,) = report.failures
    assert (missing.name, missing.status) == ("config.json", "missing")


def test_verify_only_without_a_recorded_shard_sum_fails(tmp_path, hub, lock):
    model = tmp_path / "model"
    assert fetch_assets(model, lock).ok
    (model / MANIFEST_NAME).unlink()
    hub.stop()
    report = fetch_assets(model, lock, verify_only=True)
    # Files with a sum in the lock still verify; shards have nothing to be checked against, except the
    # Hub record huggingface_hub kept for them next to the download.
    statuses = {f.name: (f.status, f.expected_from) for f in report.files}
    assert statuses["config.json"] == ("ok", "lock")
    assert statuses[SHARD1] == ("ok", "hub")
    (model / ".cache").rename(tmp_path / "hf-metadata-moved")
    report = fetch_assets(model, lock, verify_only=True)
    statuses = {f.name: f.status for f in report.files}
    assert statuses[SHARD1] == statuses[SHARD2] == "unverified"
    assert not report.ok


def test_offline_env_refuses_to_download(tmp_path, hub, lock, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = fetch_assets(tmp_path / "model", lock, weights=False)
    assert {f.status for f in report.files} == {"missing"}
    assert not resolve_gets(hub)


def test_unknown_repository_is_a_user_error(tmp_path, hub, lock):
    data = json.loads(lock.read_text())
    data["files"][0]["repo"] = "nobody/nothing"
    data["files"] = data["files"][:1]
    data.pop("weights")
    lock.write_text(json.dumps(data))
    report = fetch_assets(tmp_path / "model", lock)
    (bad,) = report.failures
    assert bad.status == "error" and "not found" in bad.message
    with pytest.raises(UserError):
        report.raise_for_failures()


def test_verify_only_needs_an_existing_directory(tmp_path, lock):
    with pytest.raises(UserError, match="does not exist"):
        fetch_assets(tmp_path / "absent", lock, verify_only=True)


def test_a_connection_that_keeps_dropping_fails_that_file_after_the_attempts(tmp_path, hub, lock, caplog):
    from magistral_cli.assets.download import ATTEMPTS

    hub.cut_always.add(f"{REPO}/{REV}/{SHARD2}")
    model = tmp_path / "model"
    with caplog.at_level(logging.WARNING, logger="magistral_cli.assets.download"):
        report = fetch_assets(model, lock)
    (bad,) = report.failures
    assert bad.name == SHARD2 and "run the same command again" in bad.message
    assert not (model / SHARD2).exists()
    assert (model / SHARD1).read_bytes() == served(hub, REPO, REV, SHARD1)  # the others complete
    # huggingface_hub 1.x gives up at once and is called ATTEMPTS times; 2.x retries five times itself
    # (a second apart) and its error is final.
    import huggingface_hub

    client_retries = int(huggingface_hub.__version__.split(".")[0]) >= 2
    resumes = [r for r in caplog.records if "the connection dropped" in r.getMessage()]
    assert len(resumes) == (0 if client_retries else ATTEMPTS - 1), [r.getMessage() for r in resumes]
    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith("/" + SHARD2)]
    assert len(gets) == (6 if client_retries else ATTEMPTS)


def test_interrupt_midway_leaves_no_partial_file_and_the_next_run_completes(tmp_path, hub, lock):
    from magistral_cli.assets.fetch import FetchProgress

    class InterruptOnShard(FetchProgress):
        def download_bar(self, name, total, initial):
            outer = self

            class Bar:
                def update(self, n):
                    if name == SHARD2:
                        outer.interrupted = True
                        raise KeyboardInterrupt  # as Ctrl-C would, in the middle of the shard

                def close(self):
                    pass

            return Bar()

    model = tmp_path / "model"
    progress = InterruptOnShard()
    with pytest.raises(KeyboardInterrupt):
        fetch_assets(model, lock, progress=progress)
    assert progress.interrupted
    assert not (model / SHARD2).exists()  # nothing partial at the destination
    # huggingface_hub 2.x removes its partial file; 1.x keeps it in .cache/huggingface/download
    kept = list(model.rglob("*.incomplete"))
    assert len(kept) <= 1 and all(".cache" in p.parts for p in kept), kept
    received = sum(p.stat().st_size for p in kept)
    report = fetch_assets(model, lock)
    assert report.ok
    assert (model / SHARD2).read_bytes() == served(hub, REPO, REV, SHARD2)
    assert not list(model.rglob("*.incomplete"))
    # ... and the next fetch resumes from what it holds (here nothing: Ctrl-C came at the first chunk)
    assert hub.ranges_seen(SHARD2) == ([f"bytes={received}-"] if received else [])


def test_unreadable_file_is_reported_not_a_crash(tmp_path, hub, lock):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    model = tmp_path / "model"
    assert fetch_assets(model, lock, weights=False).ok
    (model / "tekken.json").chmod(0)
    report = fetch_assets(model, lock, weights=False, verify_only=True)
    (bad,) = report.failures
    assert bad.name == "tekken.json" and "could not read" in bad.message


NATIVE = ["params.json", "consolidated.safetensors"]


def test_native_adds_mistrals_own_files_checked_against_the_hub_and_kept_checked(tmp_path, hub, lock):
    model = tmp_path / "model"
    plain = fetch_assets(model, lock, weights=False)
    assert plain.ok and not any((model / name).exists() for name in NATIVE)  # only when asked

    report = fetch_assets(model, lock, weights=False, native=True)
    assert report.ok, report.to_json()
    by_name = {f.name: f for f in report.files}
    # The LFS file is checked against the SHA-256 the Hub serves; the small git file has none.
    assert (
        by_name["consolidated.safetensors"].expected_from,
        by_name["consolidated.safetensors"].status,
    ) == (
        "hub",
        "ok",
    )
    assert by_name["params.json"].status == "recorded"
    manifest = read_manifest(model)
    for name in NATIVE:
        data = (model / name).read_bytes()
        assert data == served(hub, REPO, REV, name)
        assert manifest[name].sha256 == hashlib.sha256(data).hexdigest()

    # Recorded once, checked on every later run, --native or not; a changed byte is caught offline.
    hub.stop()
    again = fetch_assets(model, lock, weights=False, verify_only=True)
    assert again.ok and {f.name: f.expected_from for f in again.files if f.name in NATIVE} == {
        "params.json": "manifest",
        "consolidated.safetensors": "manifest",
    }
    with open(model / "consolidated.safetensors", "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 1]))
    tampered = fetch_assets(model, lock, weights=False, verify_only=True)
    (failure,) = tampered.failures
    assert failure.name == "consolidated.safetensors" and failure.status == "mismatch"
    assert (model / "consolidated.safetensors").exists()  # --verify-only moves nothing


def test_native_with_a_lock_that_lists_none_is_refused(tmp_path, hub, lock):
    data = json.loads(lock.read_text())
    del data["native"]
    lock.write_text(json.dumps(data))
    with pytest.raises(UserError, match="lists no native-layout files.*drop --native"):
        fetch_assets(tmp_path / "model", lock, weights=False, native=True)
