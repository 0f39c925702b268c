"""The top-level command: help, version, error handling, cheap start-up."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from magistral_cli import __version__
from magistral_cli.cli.main import app

pytestmark = pytest.mark.compat  # typer and click: typer before 0.16 fails every --help with click >= 8.2

runner = CliRunner()
SUBCOMMANDS = ["fetch", "convert", "preprocess", "train", "compare", "generate", "probe", "quickstart"]


def test_help_lists_the_subcommands_in_workflow_order():
    """The Commands panel itself (the description above it names the workflow too), convert (a
    sub-app, which Typer would list after the plain commands) in its place."""
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    panel = result.output.split("Commands", 1)[1].splitlines()[1:]
    listed = [line.split()[1] for line in panel if line.startswith("│ ") and not line[2:3].isspace()]
    assert listed == SUBCOMMANDS, result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"magistral-cli {__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], *[[name, "--help"] for name in SUBCOMMANDS]])
def test_help_and_version_do_not_import_torch_or_transformers(argv):
    code = textwrap.dedent(
        f"""
        import sys
        from typer.testing import CliRunner
        from magistral_cli.cli.main import app
        result = CliRunner().invoke(app, {argv!r})
        assert result.exit_code == 0, result.output
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "magistral_cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout


def test_bad_flag_exits_2():
    result = runner.invoke(app, ["train", "--no-such-flag"])
    assert result.exit_code == 2


def test_user_error_is_one_message_without_traceback(tmp_path):
    result = runner.invoke(app, ["train", str(tmp_path / "missing.yaml"), "--dry-run"])
    assert result.exit_code == 2
    assert "recipe not found" in result.output
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback(tmp_path):
    code = "from magistral_cli.cli.main import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "--debug", "train", str(tmp_path / "missing.yaml"), "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "UserError" in out.stderr


def test_env_debug_shows_the_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "magistral_cli", "train", str(tmp_path / "missing.yaml"), "--dry-run"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "MAGISTRAL_DEBUG": "1"},
    )
    assert out.returncode != 0 and "Traceback" in out.stderr
