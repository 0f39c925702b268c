"""Lock files: the packaged Magistral lock carries the seed's sums; unsafe names are refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from magistral_cli.assets.lock import (
    PACKAGED_LOCK,
    WeightsSpec,
    check_relative_name,
    default_lock_path,
    load_lock,
)
from magistral_cli.errors import UserError

REPO = Path(__file__).resolve().parents[2]
RECIPE_LOCK = REPO / "recipes" / "magistral-small-2509" / "assets.lock.json"
OFFICIAL = ("mistralai/Magistral-Small-2509", "a31cc96ab10cf19bc42c628fedf1e359e0853c49")
UNSLOTH = ("unsloth/Magistral-Small-2509", "dcfa8f675a2adaea5dad53b32c0c948b47c02f55")

# The seed's baseline/asset_manifest.json, copied here: name -> (repo, revision, sha256, bytes).
SEED_MANIFEST = {
    "config.json": (*OFFICIAL, "c1684445dc6f3d92415403e6790d909970da46059c6a90909466ad783d069182", 1166),
    "model.safetensors.index.json": (
        *OFFICIAL,
        "ddee03ee0188767bbd5b39bc64744b3441f1a8f8c503727980fe92e590917a51",
        57944,
    ),
    "tekken.json": (*OFFICIAL, "05e051a32ae9d6333459da0083d36507116334fc85378321cfb32dfff7187531", 19399765),
    "chat_template.jinja": (
        *UNSLOTH,
        "817cbd470e260e28e69015cc34b1abfb2a7ab76500839c743ed0fee3d1a32c9e",
        4690,
    ),
    "preprocessor_config.json": (
        *UNSLOTH,
        "e2281c57d4a9d3f5e43a1988a4b183792fa7172332ee33c7eba9583194b84cb4",
        662,
    ),
    "processor_config.json": (
        *UNSLOTH,
        "4ceef0d0cbf062ffd522d85fcbf5248c2db8659c589afcc47b2f26810e7d9a58",
        189,
    ),
    "special_tokens_map.json": (
        *UNSLOTH,
        "1864ac9a603857f894d6cb47ac270f50685b05359128b8b9e59edf5ad56cdb49",
        21431,
    ),
    "tokenizer.json": (
        *UNSLOTH,
        "158915c7c928301e0d32f1da363e45c294d907bd4c64a8e855f0bd1a47b9e870",
        17078001,
    ),
    "tokenizer_config.json": (
        *UNSLOTH,
        "bb0bbbbbe9fae009c439441a1c1a62c2759e930d97cf1a431a33d8ee81716881",
        202929,
    ),
}


def test_packaged_lock_is_the_recipe_lock():
    assert default_lock_path().name == PACKAGED_LOCK
    assert default_lock_path().read_bytes() == RECIPE_LOCK.read_bytes(), (
        "magistral_cli/assets/locks/ must hold an exact copy of recipes/magistral-small-2509/assets.lock.json"
    )


def test_packaged_lock_pins_the_seed_sums_and_sizes():
    lock = load_lock()
    got = {f.name: (f.repo, f.revision, f.sha256, f.bytes) for f in lock.files}
    assert got == SEED_MANIFEST
    assert lock.weights is not None
    assert (lock.weights.repo, lock.weights.revision) == OFFICIAL
    assert lock.weights.pattern == "model-*.safetensors"
    assert lock.weights.index == "model.safetensors.index.json"
    raw = json.loads(RECIPE_LOCK.read_text())
    assert raw["weights"]["sha256"] is None
    assert "does not record" in raw["weights"]["note"]
    # Mistral's native layout, optional (fetch --native), at the weights' revision.
    assert lock.native is not None
    assert (lock.native.repo, lock.native.revision) == OFFICIAL
    assert lock.native.names == ("params.json", "consolidated.safetensors")
    assert all(f.sha256 is None for f in lock.native.locked_files())


def test_tokenizer_sources_select_files():
    lock = load_lock()
    official = {f.name for f in lock.select("official")}
    assert official == {"config.json", "model.safetensors.index.json", "tekken.json"}
    unsloth = {f.name for f in lock.select("unsloth")}
    assert unsloth == set(SEED_MANIFEST)
    with pytest.raises(UserError, match="unknown tokenizer source"):
        lock.select("sentencepiece")


@pytest.mark.parametrize(
    "name",
    ["../evil.json", "/etc/passwd", "a/../../b", "a\\b", "", "./x", "a//b", "C:/x", "~/x", "sub/.."],
)
def test_names_escaping_the_model_dir_are_refused(name):
    with pytest.raises(UserError, match="escape the model directory|empty"):
        check_relative_name(name)


@pytest.mark.parametrize("name", ["config.json", "sub/dir/file.bin", "model-00001-of-00010.safetensors"])
def test_plain_relative_names_pass(name):
    assert check_relative_name(name) == name


def _write_lock(tmp_path, mutate):
    data = json.loads(RECIPE_LOCK.read_text())
    mutate(data)
    path = tmp_path / "lock.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["files"][0].update(name="../config.json"), "escape the model directory"),
        (lambda d: d["files"][0].update(revision="main"), "not a full 40-character commit"),
        (lambda d: d["files"][0].update(sha256="abc"), "not 64 lowercase hex"),
        (lambda d: d["files"][0].update(bytes=-1), "not a non-negative integer"),
        (lambda d: d["files"][0].update(repo="../x"), "not a Hub repository id"),
        (lambda d: d["files"][0].update(source="elsewhere"), "source 'elsewhere'"),
        (lambda d: d["files"][0].update(extra=1), "unknown keys"),
        (lambda d: d["files"].append(dict(d["files"][0])), "listed twice"),
        (lambda d: d["weights"].update(index="other.json"), "must also be listed in 'files'"),
        (lambda d: d["weights"].update(sha256="ab" * 32), "sha256 null"),
        (lambda d: d.update(format=2), "format 2 is not supported"),
        (lambda d: d["native"].update(files=["tekken.json"]), "'tekken.json' is listed twice"),
        (lambda d: d["native"].update(files=["params.json", "params.json"]), "listed twice"),
        (lambda d: d["native"].update(files=[]), "non-empty list"),
        (lambda d: d["native"].update(files=["../params.json"]), "escape the model directory"),
        (lambda d: d["native"].update(revision="main"), "not a full 40-character commit"),
        (lambda d: d["native"].update(sha256=None), "unknown keys"),
    ],
)
def test_bad_locks_name_the_problem(tmp_path, mutate, message):
    with pytest.raises(UserError, match=message):
        load_lock(_write_lock(tmp_path, mutate))


def test_missing_and_unreadable_locks(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_lock(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        load_lock(bad)


def test_shard_names_from_the_index_are_checked(tmp_path):
    spec = WeightsSpec("o/m", "a" * 40, "model.safetensors.index.json", "model-*.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}))
    assert [f.name for f in spec.shard_files(index)] == ["model-1.safetensors", "model-2.safetensors"]
    index.write_text(json.dumps({"weight_map": {"a": "../model-1.safetensors"}}))
    with pytest.raises(UserError, match="escape the model directory"):
        spec.shard_files(index)
    index.write_text(json.dumps({"weight_map": {"a": "other.bin"}}))
    with pytest.raises(UserError, match="does not match the lock's pattern"):
        spec.shard_files(index)
    index.write_text(json.dumps({"no_map": {}}))
    with pytest.raises(UserError, match="not a safetensors index"):
        spec.shard_files(index)


def test_package_data_declares_the_lock():
    """pyproject.toml's package data covers the lock (checked without building anything)."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    rel = default_lock_path().relative_to(REPO / "magistral_cli").as_posix()
    assert any(fnmatch.fnmatch(rel, g) for g in globs["magistral_cli"]), globs


def test_built_wheel_ships_the_lock(tmp_path):
    """An installed package finds its lock: the wheel must contain it (package data)."""
    # Offline (no build isolation) the installed setuptools is the build backend: it must meet the
    # build-system requirement (a venv's bundled setuptools 65 cannot build wheels).
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")
    (backend,) = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    try:
        installed = version("setuptools")
    except PackageNotFoundError:
        pytest.skip("building a wheel offline needs setuptools installed")
    if not Requirement(backend).specifier.contains(installed):
        pytest.skip(f"building a wheel offline needs {backend}; setuptools {installed} is installed")
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ and egg-info next to the sources
    shutil.copytree(
        REPO / "magistral_cli", src / "magistral_cli", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy(REPO / name, src / name)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 and "No module named pip" in out.stderr:
        pytest.skip("pip is not available to build a wheel")
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("magistral_cli-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        data = zf.read(f"magistral_cli/assets/locks/{PACKAGED_LOCK}")
    assert data == RECIPE_LOCK.read_bytes()
