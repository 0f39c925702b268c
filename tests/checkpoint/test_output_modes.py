"""What the conversions write follows the user's umask: file modes are never copied from the source.

The model directory's own files (config.json, tekken.json, ...) are copied into every export by
contents; under ``umask 077`` an export used to hold a world-readable config.json and tekken.json
(``shutil.copy2`` kept the source's 0644), and under ``umask 022`` a 0640 source file stayed 0640.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
runner = CliRunner()


def _modes(directory: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(directory.stat().st_mode)}
    out.update({p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()})
    return out


@pytest.fixture
def model_dir(tiny_hf, tmp_path) -> Path:
    """The tiny model with a tokenizer file beside config.json, both world-readable (0644) as fetched."""
    path = tmp_path / "model"
    shutil.copytree(tiny_hf.hf_dir, path)
    (path / "tekken.json").write_text('{"vocab": []}\n', encoding="utf-8")
    for name in ("config.json", "tekken.json"):
        os.chmod(path / name, 0o644)
    return path


def _convert_and_export(model_dir: Path, root: Path) -> tuple[Path, Path]:
    dcp_dir, out = root / "dcp", root / "out"
    done = runner.invoke(
        app, ["convert", "hf-to-dcp", "--model-dir", str(model_dir), "--dcp-dir", str(dcp_dir)]
    )
    assert done.exit_code == 0, done.output
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
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    return dcp_dir, out


@pytest.mark.parametrize(("umask", "directory", "file"), [(0o077, 0o700, 0o600), (0o027, 0o750, 0o640)])
def test_every_written_file_follows_the_umask(model_dir, tmp_path, umask, directory, file):
    old = os.umask(umask)
    try:
        dcp_dir, out = _convert_and_export(model_dir, tmp_path)
    finally:
        os.umask(old)
    assert {"config.json", "tekken.json"} <= set(_modes(out))
    for path in (dcp_dir, out):
        modes = _modes(path)
        assert modes.pop(".") == directory, path
        assert set(modes.values()) == {file}, (path, {k: oct(v) for k, v in modes.items()})
    assert (out / "tekken.json").read_bytes() == (model_dir / "tekken.json").read_bytes()


def test_a_private_source_file_does_not_make_a_private_copy(model_dir, tmp_path):
    """Contents are copied, not modes: a 0640 (or 0600) source file is 0644 in the export under umask 022."""
    os.chmod(model_dir / "config.json", 0o640)
    os.chmod(model_dir / "tekken.json", 0o600)
    old = os.umask(0o022)
    try:
        _, out = _convert_and_export(model_dir, tmp_path)
    finally:
        os.umask(old)
    modes = _modes(out)
    assert modes.pop(".") == 0o755
    assert set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o022, 0o644)])
def test_the_fetch_manifest_follows_the_umask(tmp_path, umask, mode):
    """The manifest was set to 0644 whatever the umask (its temporary file is mkstemp's 0600)."""
    from magistral_cli.assets.manifest import write_manifest

    old = os.umask(umask)
    try:
        path = write_manifest(tmp_path, {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode
