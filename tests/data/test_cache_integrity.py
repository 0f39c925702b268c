"""A cache entry's files are checked against the sizes and xxh3-64 digests meta.json records.

Each test encodes the broken fixture dataset (40 kept rows) into its own cache, keeps the samples,
then damages the entry on disk as a user, a script or a failing disk would (an array overwritten
in place, two arrays swapped, a file truncated or deleted, the record removed) and uses it again.
A damaged entry is never served: preprocessing encodes it again, with a warning naming the file
and what differs, and the samples are the original ones; opening one directly is one
``CheckFailed`` naming the file, not numpy's ``mmap length is greater than file size``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from magistral_cli.data.cache import FILES_KEY, EncodedDataset, entry_problems
from magistral_cli.data.pipeline import run_preprocess
from magistral_cli.errors import CheckFailed

from .helpers import write_recipe

ARRAYS = ("input_ids", "labels", "offsets", "source_index", "image_offsets", "image_sizes")


def _samples(dataset: EncodedDataset) -> list[dict]:
    out = []
    for i in range(len(dataset)):
        s = dataset[i]
        out.append(
            {
                "input_ids": s.input_ids.tolist(),
                "labels": s.labels.tolist(),
                "images": list(s.images),
                "image_sizes": s.image_sizes.tolist(),
                "source_index": s.source_index,
            }
        )
    return out


@pytest.fixture
def encoded(model_dir, broken_dataset, make_recipe, tmp_path):
    recipe = make_recipe(model_dir, broken_dataset, tmp_path / "cache")
    first = run_preprocess(recipe)
    assert not first.reused and len(first.dataset) == 40
    return recipe, first.dataset.path, _samples(first.dataset)


def _overwrite_in_place(path: Path) -> None:
    """Change one value of a .npy array in its data section: same size, other bytes."""
    array = np.load(path, mmap_mode="r+", allow_pickle=False)
    index = len(array) // 2
    array[index] = array[index] + 7
    array.flush()
    del array


def _damage(entry: Path, how: str) -> tuple[str, str]:
    """Damage ``entry``; returns (the file named in the message, what the message says about it)."""
    if how == "tokens overwritten in place":
        size = (entry / "input_ids.npy").stat().st_size
        _overwrite_in_place(entry / "input_ids.npy")
        assert (entry / "input_ids.npy").stat().st_size == size
        return "input_ids.npy", "does not match its xxh3_64 checksum"
    if how == "offsets overwritten in place":
        _overwrite_in_place(entry / "offsets.npy")
        return "offsets.npy", "does not match its xxh3_64 checksum"
    if how == "tokens and labels swapped":
        ids, labels = entry / "input_ids.npy", entry / "labels.npy"
        assert ids.stat().st_size == labels.stat().st_size  # aligned arrays: a swap keeps every size
        os.replace(ids, entry / "swap.tmp")
        os.replace(labels, ids)
        os.replace(entry / "swap.tmp", labels)
        return "input_ids.npy", "does not match its xxh3_64 checksum"
    if how == "labels truncated":
        path = entry / "labels.npy"
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        return "labels.npy", "were written"
    if how == "drops deleted":
        (entry / "drops.jsonl").unlink()
        return "drops.jsonl", "is missing"
    if how == "record removed":
        meta = json.loads((entry / "meta.json").read_text())
        del meta[FILES_KEY]
        (entry / "meta.json").write_text(json.dumps(meta))
        return "meta.json", "holds no record of the entry's files"
    raise AssertionError(how)


DAMAGE = [
    "tokens overwritten in place",
    "offsets overwritten in place",
    "tokens and labels swapped",
    "labels truncated",
    "drops deleted",
    "record removed",
]


def test_meta_records_every_file_with_its_size_and_digest(encoded):
    _, entry, _ = encoded
    record = json.loads((entry / "meta.json").read_text())[FILES_KEY]
    assert set(record) == {p.name for p in entry.iterdir()} - {"meta.json"}
    assert {f"{name}.npy" for name in ARRAYS} <= set(record)
    for name, want in record.items():
        assert want["size"] == (entry / name).stat().st_size
        assert len(want["xxh3_64"]) == 16
    assert entry_problems(entry) == []


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_entry_is_encoded_again_with_a_warning(encoded, how, caplog):
    recipe, entry, samples = encoded
    name, what = _damage(entry, how)
    result = run_preprocess(recipe)
    assert not result.reused  # not served: encoded again
    assert result.dataset.path == entry
    assert _samples(result.dataset) == samples  # the intended samples, not the altered ones
    assert entry_problems(entry) == []
    warning = next(r.getMessage() for r in caplog.records if "is damaged" in r.getMessage())
    assert str(entry / name) in warning and what in warning
    assert run_preprocess(recipe).reused  # the new entry is reused as any other


@pytest.mark.parametrize("how", ["labels truncated", "drops deleted", "record removed"])
def test_opening_a_damaged_entry_names_the_file(encoded, how):
    """Sizes are checked whenever an entry is opened (a stat per file), digests when it is reused."""
    _, entry, _ = encoded
    name, what = _damage(entry, how)
    with pytest.raises(CheckFailed, match="is damaged") as info:
        EncodedDataset(entry)
    assert str(entry / name) in str(info.value) and what in str(info.value)
    assert "mmap" not in str(info.value)


def test_the_cli_warns_and_encodes_a_damaged_entry_again(model_dir, broken_dataset, tmp_path, caplog):
    from magistral_cli.cli.main import app

    recipe = write_recipe(tmp_path / "r.yaml", model_dir, broken_dataset, tmp_path / "cache")
    runner = CliRunner()
    first = runner.invoke(app, ["preprocess", str(recipe), "--json"])
    assert first.exit_code == 0, first.output
    (entry,) = (tmp_path / "cache").glob("magistral-*")
    _overwrite_in_place(entry / "input_ids.npy")

    again = runner.invoke(app, ["preprocess", str(recipe), "--json"])
    assert again.exit_code == 0, again.output
    payload = json.loads(again.stdout)
    assert payload["reused"] is False and payload["report"]["kept"] == 40
    # The warning is a log record (the command line shows it on stderr through logging's last resort).
    assert f"{entry / 'input_ids.npy'} does not match its xxh3_64 checksum" in caplog.text
    assert json.loads(runner.invoke(app, ["preprocess", str(recipe), "--json"]).stdout)["reused"] is True


def test_an_entry_follows_the_umask(model_dir, broken_dataset, make_recipe, tmp_path):
    """The entry directory was private (mkdtemp's 0700) whatever the umask; now it follows it."""
    old = os.umask(0o022)
    try:
        shared = run_preprocess(make_recipe(model_dir, broken_dataset, tmp_path / "shared")).dataset.path
        os.umask(0o077)
        private = run_preprocess(make_recipe(model_dir, broken_dataset, tmp_path / "private")).dataset.path
    finally:
        os.umask(old)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in shared.iterdir()} == {0o644}
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in private.iterdir()} == {0o600}
