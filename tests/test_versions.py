"""Supported library versions: the declared bounds, the comparison, and the pre-flight stop."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from magistral_cli.errors import UserError
from magistral_cli.versions import (
    MINIMUM_VERSIONS,
    OPTIONAL_VERSIONS,
    check_supported_versions,
    installed_version,
    is_older,
    optional_problem,
)

pytestmark = pytest.mark.compat

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_same_lower_bounds():
    text = (REPO / "pyproject.toml").read_text()
    for name, minimum in MINIMUM_VERSIONS.items():
        declared = re.findall(rf'"{name}>=([^",]+)"', text)
        assert declared == [minimum], f"pyproject.toml declares {name}>={declared}, versions.py {minimum}"


def test_the_lowest_versions_leg_pins_every_declared_lower_bound():
    """CI's second leg installs under ``.ci/lowest_constraints.py``'s pins: every ``>=`` bound of the
    runtime dependencies and of the qlora extra, the pre-flight check's among them."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")
    out = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "lowest_constraints.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pins = dict(line.split("==") for line in out.split())
    for name, minimum in {**MINIMUM_VERSIONS, **{k: v[0] for k, v in OPTIONAL_VERSIONS.items()}}.items():
        assert pins[name] == minimum, (name, pins)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    bounded = [d for d in project["dependencies"] if ">=" in d]
    assert len(pins) == len(bounded) + len(OPTIONAL_VERSIONS)


def test_the_lowest_versions_leg_resolves_for_the_declared_python():
    """The leg dry-runs its pins for ``requires-python``'s bound, read by the same script."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")
    script = REPO / ".ci" / "lowest_constraints.py"
    out = subprocess.run(
        [sys.executable, str(script), "--python"], capture_output=True, text=True, check=True
    )
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert declared == f">={out.stdout.strip()}"
    assert '--python-version "$lowest_python"' in (REPO / ".ci" / "run").read_text()


def test_the_installed_versions_are_not_below_the_declared_bounds():
    """Whatever leg runs: the installed dependencies meet pyproject.toml (the lowest leg installs
    exactly the bounds)."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")
    for line in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        installed = Version(version(requirement.name))
        assert requirement.specifier.contains(installed.base_version, prereleases=True), (line, installed)


def test_reading_a_recipe_warns_nothing():
    """pydantic before 2.10 warned once per ``model_*`` field (``model_name_or_path``, ``model_id``:
    MindSpeed-MM's keys) on every command that read a recipe."""
    code = (
        "import warnings; warnings.simplefilter('error'); "
        "import magistral_cli.config.schema as s; s.Recipe.model_json_schema()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_package_needs_nothing_newer_than_the_python_it_declares():
    """``requires-python`` names a Python that no CI leg runs (there is no interpreter of it here), so
    vermin checks the package statically against it: syntax, and the standard library's modules,
    members and keyword arguments (``tomllib``, ``enum.StrEnum``, ``datetime.UTC``... need 3.11).
    The bound is read as CI's lowest leg reads it (``.ci/lowest_constraints.py --python``)."""
    target = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "lowest_constraints.py"), "--python"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = subprocess.run(
        [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", f"-t={target}-"]
        + ["--violations", "--eval-annotations", "--no-tips", "--no-parse-comments", "magistral_cli"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, f"the package needs a Python newer than {target}:\n{out.stdout[-3000:]}"
    assert "Minimum required versions:" in out.stdout, out.stdout[-2000:]


def test_optional_packages_are_declared_with_their_bound_and_named_when_missing_or_old():
    text = (REPO / "pyproject.toml").read_text()
    for name, (minimum, _, install) in OPTIONAL_VERSIONS.items():
        # The feature's extra (named in the install line) and the test extra, with the same bound.
        assert re.findall(rf'"{name}>=([^",]+)"', text) == [minimum, minimum], name
        extra = re.search(r"\[(\w+)\]", install).group(1)
        assert re.search(rf'^{extra} = \["{name}>={re.escape(minimum)}"\]', text, re.M), extra
    assert optional_problem("torchao", {"torchao": None}) == (
        "model.lora.quantize_base: nf4 needs torchao, which is not installed; run pip install 'magistral-cli[qlora]'"
    )
    assert "needs torchao>=0.17 and 0.16.0 is installed" in optional_problem("torchao", {"torchao": "0.16.0"})
    assert optional_problem("torchao", {"torchao": "0.17.0"}) is None


@pytest.mark.parametrize(
    ("installed", "minimum", "older"),
    [
        ("5.16.0", "5.17.0", True),
        ("5.17.0", "5.17.0", False),
        ("5.17.0.dev0", "5.17.0", False),
        ("5.25.0", "5.17.0", False),
        ("4.57.1", "5.17.0", True),
        ("5.0.0rc1", "5.17.0", True),
        ("2.11.0+cu130", "2.11", False),
        ("2.10.1", "2.11", True),
        ("2.13.0+cpu", "2.11", False),
        ("10.0", "5.17.0", False),
    ],
)
def test_version_comparison(installed, minimum, older):
    assert is_older(installed, minimum) is older


def test_this_environment_is_supported():
    check_supported_versions()  # what CI installs must pass its own check
    assert installed_version("transformers") is not None


def test_a_too_old_transformers_is_named_with_both_versions():
    installed = {"torch": "2.13.0+cpu", "transformers": "5.10.0"}
    with pytest.raises(UserError) as info:
        check_supported_versions(installed)
    message = str(info.value)
    assert "transformers 5.10.0 is installed" in message
    assert "transformers>=5.17.0" in message
    assert "torch" not in message.split(";")[0]


def test_a_missing_library_is_named():
    with pytest.raises(UserError, match="torch is not installed"):
        check_supported_versions({"transformers": "5.25.0"})


def _fake_distribution(root: Path, name: str, version: str) -> None:
    """A distribution record as pip writes it (dist-info with METADATA), found first on the path."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_train_stops_in_pre_flight_with_an_old_transformers(tmp_path):
    """`magistral train` (a dry run too) exits 2 naming both versions before any rank or model build."""
    shadow = tmp_path / "site"
    _fake_distribution(shadow, "transformers", "5.10.0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    recipe = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
    for extra in (["--dry-run"], []):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "magistral_cli",
                "train",
                str(recipe),
                f"training.output_dir={tmp_path / 'run'}",
                *extra,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "transformers 5.10.0 is installed" in proc.stderr + proc.stdout
        assert "transformers>=5.17.0" in proc.stderr + proc.stdout
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "run" / "logs").exists(), "torchrun must not have started"


def test_the_check_can_be_skipped_on_purpose(monkeypatch, caplog):
    monkeypatch.setenv("MAGISTRAL_SKIP_VERSION_CHECK", "1")
    check_supported_versions({"torch": "2.13.0", "transformers": "5.10.0"})  # no error
    assert "transformers 5.10.0 is installed" in caplog.text
