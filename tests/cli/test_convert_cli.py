"""`magistral convert` end to end through the command line (the real conversion, no patches)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.testing.tiny_model import build_tiny_model, save_official_checkpoint, tiny_mistral3_config

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = build_tiny_model(tiny_mistral3_config(vocab_size=512))
    return save_official_checkpoint(model, tmp_path_factory.mktemp("cli") / "hf", num_shards=2)


def _validate(hf_dir, dcp_dir, layout: str) -> list[str]:
    """`magistral convert validate` of ``dcp_dir`` against ``hf_dir`` as ``layout``."""
    return ["convert", "validate", "--model-dir", str(hf_dir), "--dcp-dir", str(dcp_dir), "--layout", layout]


def _json(result):
    assert result.stdout.strip().startswith("{"), result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("layout", ["fsdp2", "megatron"])
def test_hf_to_dcp_validate_dcp_to_hf_reproduce_the_checkpoint(hf_dir, tmp_path, layout):
    dcp_dir, out = tmp_path / "dcp", tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "convert",
            "hf-to-dcp",
            "--model-dir",
            str(hf_dir),
            "--dcp-dir",
            str(dcp_dir),
            "--layout",
            layout,
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    converted = _json(result)
    assert converted["layout"] == layout and converted["validated_keys"] == converted["tensors"] == 45

    result = runner.invoke(app, [*_validate(hf_dir, dcp_dir, layout), "--json"])
    assert result.exit_code == 0, result.output
    assert _json(result)["ok"] is True

    result = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            str(dcp_dir),
            "--model-dir",
            str(hf_dir),
            "--out-dir",
            str(out),
            "--json",
            *(["--fsync"] if layout == "megatron" else []),
        ],
    )
    assert result.exit_code == 0, result.output
    exported = _json(result)
    assert exported["dcp_layout"] == layout and exported["layout"] == "official"
    # This model directory has no tokenizer, so the export has none: said, not silent.
    assert len(exported["warnings"]) == 1 and "has no tokenizer" in exported["warnings"][0]
    assert "warning:" in result.stderr and "has no tokenizer" in " ".join(result.stderr.split())
    for path in hf_dir.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_fsdp2_conversion_fails_megatron_validation_with_exit_1(hf_dir, tmp_path):
    dcp_dir = tmp_path / "dcp"
    assert (
        runner.invoke(
            app, ["convert", "hf-to-dcp", "--model-dir", str(hf_dir), "--dcp-dir", str(dcp_dir)]
        ).exit_code
        == 0
    )
    validate = _validate(hf_dir, dcp_dir, "megatron")
    result = runner.invoke(app, [*validate, "--json"])
    assert result.exit_code == 1
    report = _json(result)
    assert report["ok"] is False and report["missing_count"] == 45 and report["unexpected_count"] == 44
    assert report["matching_layout"] == "fsdp2" and len(report["missing"]) == 5
    assert "model keys do not match" in result.output and "Traceback" not in result.output
    human = runner.invoke(app, validate)
    assert human.exit_code == 1
    assert "pass --layout fsdp2 to check it as one" in " ".join(human.output.split())


def test_existing_target_and_bad_input_exit_2(hf_dir, tmp_path):
    (tmp_path / "dcp").mkdir()
    result = runner.invoke(
        app, ["convert", "hf-to-dcp", "--model-dir", str(hf_dir), "--dcp-dir", str(tmp_path / "dcp")]
    )
    assert result.exit_code == 2 and "already exists" in result.output
    result = runner.invoke(
        app, ["convert", "hf-to-dcp", "--model-dir", str(tmp_path / "nope"), "--dcp-dir", str(tmp_path / "x")]
    )
    assert result.exit_code == 2 and "does not exist" in result.output
    (tmp_path / "a-file").write_text("not a model\n")
    result = runner.invoke(
        app,
        ["convert", "hf-to-dcp", "--model-dir", str(tmp_path / "a-file"), "--dcp-dir", str(tmp_path / "x")],
    )
    assert result.exit_code == 2 and "is a file, not a directory" in result.output
    (tmp_path / "a-file").unlink()
    result = runner.invoke(
        app,
        [
            "convert",
            "hf-to-dcp",
            "--model-dir",
            str(hf_dir),
            "--dcp-dir",
            str(tmp_path / "y"),
            "--layout",
            "nope",
        ],
    )
    assert result.exit_code == 2
    result = runner.invoke(
        app,
        [
            "convert",
            "dcp-to-hf",
            "--dcp-dir",
            str(tmp_path),
            "--model-dir",
            str(hf_dir),
            "--out-dir",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2 and "holds no DCP checkpoint" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


@pytest.mark.parametrize("sub", ["hf-to-dcp", "validate", "dcp-to-hf"])
def test_subcommand_help_imports_neither_torch_nor_transformers(sub):
    code = textwrap.dedent(
        f"""
        import sys
        from typer.testing import CliRunner
        from magistral_cli.cli.main import app
        result = CliRunner().invoke(app, ["convert", {sub!r}, "--help"])
        assert result.exit_code == 0 and "--layout" in result.output, result.output
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_export_with_a_tokenizer_carries_no_warning():
    from magistral_cli.checkpoint.dcp_to_hf import missing_tokenizer

    assert missing_tokenizer(Path("m"), ["config.json", "tekken.json"]) == []
    assert missing_tokenizer(Path("m"), ["config.json", "tokenizer.json", "tokenizer_config.json"]) == []
    assert "has no tokenizer" in missing_tokenizer(Path("m"), ["config.json", "generation_config.json"])[0]
