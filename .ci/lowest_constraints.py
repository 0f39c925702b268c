"""Print pip constraints that pin each declared dependency to its lower bound (pyproject.toml).

CI's second leg installs the package under these constraints, so every ``>=`` bound that
``pyproject.toml`` declares (the runtime dependencies and the ``qlora`` extra) is a version a test
ran on. A bound that cannot be installed beside the others fails the install: raise it.

    .venv/bin/python .ci/lowest_constraints.py > constraints.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

#: Optional extras whose bounds are part of the promise (the features the README documents).
EXTRAS = ("qlora",)


def lowest(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    declared = list(project["dependencies"])
    for extra in EXTRAS:
        declared += project["optional-dependencies"][extra]
    pins = []
    for line in declared:
        requirement = Requirement(line)
        bounds = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if len(bounds) > 1:
            sys.exit(f"{line!r}: more than one lower bound")
        if bounds:
            pins.append(f"{requirement.name}=={bounds[0]}")
    return pins


if __name__ == "__main__":
    print("\n".join(lowest(Path(__file__).resolve().parent.parent / "pyproject.toml")))
