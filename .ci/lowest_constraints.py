"""Pin each declared dependency to its lower bound (pyproject.toml), or check that an environment has them.

CI's second leg installs the package under these constraints, so every ``>=`` bound that
``pyproject.toml`` declares (the runtime dependencies and the ``qlora`` extra) is a version a test
ran on. A bound that cannot be installed beside the others fails the install: raise it.

    .venv/bin/python .ci/lowest_constraints.py > constraints.txt   # the pins, one per line
    .venv-min/bin/python .ci/lowest_constraints.py --check          # each installed at its pin
    .venv/bin/python .ci/lowest_constraints.py --python             # requires-python's lower bound

The leg also resolves the pins for that Python (``pip install --dry-run --python-version``), which no CI
machine runs: a bound whose releases all need a newer Python fails it.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: Optional extras whose bounds are part of the promise (the features the README documents).
EXTRAS = ("qlora",)


def lowest(project: dict) -> dict[str, str]:
    """Distribution -> its declared lower bound (``project``: pyproject.toml's ``[project]`` table)."""
    declared = list(project["dependencies"])
    for extra in EXTRAS:
        declared += project["optional-dependencies"][extra]
    pins = {}
    for line in declared:
        requirement = Requirement(line)
        bounds = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if len(bounds) > 1:
            sys.exit(f"{line!r}: more than one lower bound")
        if bounds:
            pins[requirement.name] = bounds[0]
    return pins


def lowest_python(project: dict) -> str:
    """The lower bound of ``requires-python``."""
    declared = project["requires-python"]
    bounds = [spec.version for spec in SpecifierSet(declared) if spec.operator == ">="]
    if len(bounds) != 1:
        sys.exit(f"requires-python {declared!r}: one lower bound expected")
    return bounds[0]


def check(pins: dict[str, str]) -> None:
    """Exit non-zero unless each pinned distribution is installed at its bound (a local tag such as
    torch's +cu130 aside): the leg tests what it says."""
    for name, wanted in pins.items():
        installed = version(name)
        if Version(Version(installed).base_version) != Version(wanted):
            sys.exit(f"{name} {installed} is installed where the lowest-versions leg needs {wanted}")
        print(name, installed)


if __name__ == "__main__":
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())[
        "project"
    ]
    if sys.argv[1:] == ["--check"]:
        check(lowest(project))
    elif sys.argv[1:] == ["--python"]:
        print(lowest_python(project))
    else:
        print("\n".join(f"{name}=={bound}" for name, bound in lowest(project).items()))
