"""The package's layering rule (DESIGN.md, "Layers"), checked on every import of every module.

::

    cli -> quickstart / launch / analysis / probes (and generate/) -> engine
        -> data, checkpoint, ops, config, assets -> runtime, errors and the root modules

Nothing imports up the chain; a module may import its own layer's siblings and anything below.
``testing/`` is imported only by tests, the quickstart and the probes, and ``ops/`` knows nothing of
recipes (``config/``; the package table). Every ``import`` and ``from ... import`` is read from the
source with ``ast`` (relative ones resolved), wherever it is: module level, inside functions,
under ``if TYPE_CHECKING:``. A new top-level module or package fails here until ``LAYERS`` places it.

Within one package the modules import each other one way only: an import cycle among siblings
(``data/loader -> data/pipeline -> data/report -> data/loader``), counted over the same imports,
fails too; the shared piece belongs in the lower module or a small module of its own.

That importing the CLI loads neither torch nor transformers (``magistral --help``) is checked in
tests/cli/test_main.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "magistral_cli"

#: Top-level module or package of magistral_cli -> its layer (higher imports lower, never the reverse).
LAYERS = {
    # runtime, errors and the root modules
    "": 0,  # magistral_cli/__init__.py (__version__)
    "runtime": 0,
    "errors": 0,
    "model_config": 0,
    "run_lock": 0,
    "run_record": 0,
    "metric_names": 0,
    "versions": 0,
    # what the engine builds on
    "data": 1,
    "checkpoint": 1,
    "ops": 1,
    "config": 1,
    "assets": 1,
    # what torchrun runs
    "engine": 2,
    # the cores the subcommands call
    "quickstart": 3,
    "launch": 3,
    "analysis": 3,
    "probes": 3,
    "generate": 3,
    "testing": 3,  # imports like a core; who may import it is TESTING_USERS
    # the Typer app
    "cli": 4,
    "__main__": 4,
}
LAYER_NAMES = {
    0: "runtime/errors/root modules",
    1: "data/checkpoint/ops/config/assets",
    2: "engine",
    3: "quickstart/launch/analysis/probes/generate",
    4: "cli",
}
#: The only importers of testing/ inside the package (tests import it too; they are not walked).
TESTING_USERS = {"testing", "quickstart", "probes"}
#: Siblings a package must not import although they share its layer (DESIGN.md's package table).
NOT_KNOWN = {"ops": {"config"}}

#: (importing module, imported module) -> why it is still allowed. Each one is an arrow still to
#: remove: delete its line once the import is gone (a stale entry fails the test).
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, package: Path = PACKAGE) -> bool:
    """Whether ``name`` (``magistral_cli.x.y``) is a module or package of the source tree."""
    path = package.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, imported magistral_cli module) for every import in ``path``, relative ones resolved.

    ``from pkg import name`` imports the module ``pkg.name`` when there is one, else ``pkg``.
    """
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub, root) else source))
    ours = [
        (line, name) for line, name in found if name == "magistral_cli" or name.startswith("magistral_cli.")
    ]
    return list(dict.fromkeys(ours))  # `from x import a, b` is one import of x


def _top(module: str) -> str:
    """The top-level module or package of ``magistral_cli.<top>...`` ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules(root: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _violations(root: Path = PACKAGE) -> tuple[list[str], set[tuple[str, str]]]:
    """(one line per forbidden import, the ALLOWED entries that were used) for the tree at ``root``."""
    problems, used = [], set()
    for path in _modules(root):
        importer = _module_name(path, root)
        source = _top(importer)
        where = path.relative_to(root.parent)
        if source not in LAYERS:
            problems.append(f"{where}: {importer} has no layer; add {source!r} to LAYERS")
            continue
        for line, imported in _imports(path, root):
            target = _top(imported)
            if target not in LAYERS:
                problems.append(
                    f"{where}:{line}: imports {imported}, which has no layer; add {target!r} to LAYERS"
                )
                continue
            if (importer, imported) in ALLOWED:
                used.add((importer, imported))
                continue
            if LAYERS[target] > LAYERS[source]:
                problems.append(
                    f"{where}:{line}: {importer} ({LAYER_NAMES[LAYERS[source]]}) imports {imported} "
                    f"({LAYER_NAMES[LAYERS[target]]}): an import up the chain"
                )
            elif target == "testing" and source not in TESTING_USERS:
                problems.append(
                    f"{where}:{line}: {importer} imports {imported}; testing/ is for tests, the quickstart "
                    "and the probes only"
                )
            elif target in NOT_KNOWN.get(source, ()):
                problems.append(
                    f"{where}:{line}: {importer} imports {imported}; {source}/ knows nothing of {target}/"
                )
    return problems, used


def _sibling_imports(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {sibling it imports (same package): first line}, for every module under ``root``."""
    graph: dict[str, dict[str, int]] = {}
    for path in _modules(root):
        importer = _module_name(path, root)
        package = importer.rpartition(".")[0]
        edges = graph.setdefault(importer, {})
        for line, imported in _imports(path, root):
            if imported != importer and imported.rpartition(".")[0] == package:
                edges.setdefault(imported, line)
    return graph


def _sibling_cycles(root: Path = PACKAGE) -> list[str]:
    """One line per import cycle among the modules of one package: each group of siblings that
    reach each other by imports (a strongly connected component), with its imports and lines."""
    graph = _sibling_imports(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm; the graphs are small
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    lines = []
    for group in sorted(groups):
        arrows = [
            f"{importer.rpartition('.')[2]}:{line} -> {imported.rpartition('.')[2]}"
            for importer in group
            for imported, line in sorted(graph[importer].items())
            if imported in group
        ]
        lines.append(f"{group[0].rpartition('.')[0]}: " + ", ".join(arrows))
    return lines


def test_no_module_imports_up_the_chain():
    problems, used = _violations()
    assert not problems, "layering violations (DESIGN.md, Layers):\n  " + "\n  ".join(problems)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, (
        f"ALLOWED entries whose import is gone (remove them from tests/test_layering.py): {stale}"
    )


def test_no_import_cycle_among_sibling_modules():
    cycles = _sibling_cycles()
    assert not cycles, (
        "import cycles among the modules of one package (move the shared piece into the lower "
        "module or a small module of its own):\n  " + "\n  ".join(cycles)
    )


def test_the_cycle_checker_sees_lazy_and_relative_imports(tmp_path):
    """A synthetic package: a cycle closed by an import inside a function is found; a one-way
    chain, and imports of the package itself or of another package, are not cycles."""
    root = tmp_path / "magistral_cli"
    files = {
        "__init__.py": "",
        "errors.py": "from magistral_cli.data import a\n",
        "data/__init__.py": "from . import a\n",
        "data/a.py": "from .b import f\nfrom magistral_cli import errors\n",
        "data/b.py": "def f():\n    from magistral_cli.data.c import g\n",
        "data/c.py": "from . import a\n",
        "data/d.py": "from .a import x\nfrom magistral_cli import data\n",
        "ops/__init__.py": "",
        "ops/x.py": "from . import y\n",
        "ops/y.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    assert _sibling_cycles(root) == ["magistral_cli.data: a:1 -> b, b:2 -> c, c:1 -> a"]


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    """A synthetic package: lazy, relative and TYPE_CHECKING imports are all seen and judged."""
    root = tmp_path / "magistral_cli"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "cli/__init__.py": "",
        "cli/output.py": "",
        "config/__init__.py": "",
        "config/patterns.py": "",
        "data/__init__.py": "",
        "data/pipeline.py": "def bar():\n    from ..cli.output import console\n",
        "ops/__init__.py": "",
        "ops/kernel.py": "from magistral_cli.config import patterns\nfrom magistral_cli import errors\n",
        "engine/__init__.py": "",
        "engine/run.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import magistral_cli.launch.x\n",
        "launch/__init__.py": "",
        "launch/x.py": "from . import y\nfrom magistral_cli.testing import tiny\n",
        "launch/y.py": "from ..engine import run\n",
        "testing/__init__.py": "",
        "testing/tiny.py": "",
        "probes/__init__.py": "",
        "probes/p.py": "import magistral_cli.testing.tiny\n",
        "newpkg/__init__.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    problems, _ = _violations(root)
    text = "\n".join(problems)
    assert (
        "data/pipeline.py:2: magistral_cli.data.pipeline" in text
        and "imports magistral_cli.cli.output" in text
    )
    assert "ops/kernel.py:1:" in text and "ops/ knows nothing of config/" in text
    assert "engine/run.py:3:" in text and "imports magistral_cli.launch.x" in text
    assert "launch/x.py:2:" in text and "testing/ is for tests" in text
    assert "newpkg" in text and "has no layer" in text
    assert "probes/p.py" not in text and "launch/y.py" not in text and "ops/kernel.py:2" not in text
    assert len(problems) == 5, text


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    """The checker itself: a lazy import in a function body and a relative import are both found."""
    imports = dict((name, line) for line, name in _imports(PACKAGE / "checkpoint" / "validate.py"))
    assert "magistral_cli.checkpoint.layout" in imports  # from .layout import ... (relative)
    assert "magistral_cli.checkpoint.safe_dcp" in imports  # from .safe_dcp import ... inside a function
    assert "magistral_cli.errors" in imports
    assert _top("magistral_cli") == "" and _top("magistral_cli.engine.trainer") == "engine"
    assert len(_modules()) > 50
