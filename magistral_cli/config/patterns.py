"""Module patterns: ``model.language_model.layers.{*}`` matches every index.

One matcher serves ``parallel.fsdp_plan.apply_modules``, ``features.recompute_plan``,
``model.freeze`` and ``features.contiguous_linear_grad_modules``. ``{*}`` stands for exactly
one dotted component (a layer index, usually); everything else matches literally. A
pattern that matches nothing is an error: a typo must not silently train the wrong thing.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

from magistral_cli.errors import UserError

WILDCARD = "{*}"


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """The regular expression for one module pattern."""
    if not pattern or pattern != pattern.strip():
        raise UserError(f"module pattern {pattern!r} is empty or has surrounding spaces")
    parts = [r"[^.]+" if part == WILDCARD else re.escape(part) for part in pattern.split(".")]
    return re.compile("^" + r"\.".join(parts) + "$")


def match_names(names: Iterable[str], patterns: Iterable[str], what: str = "pattern") -> dict[str, list[str]]:
    """Map each pattern to the names it matches, in the order of ``names``.

    Raises UserError naming the first pattern that matches nothing, with the closest names.
    """
    names = list(names)
    result: dict[str, list[str]] = {}
    for pattern in patterns:
        regex = compile_pattern(pattern)
        hits = [n for n in names if regex.match(n)]
        if not hits:
            probe = pattern.replace(WILDCARD, "0")
            near = difflib.get_close_matches(probe, names, n=3, cutoff=0.5)
            hint = f"; closest module names: {', '.join(near)}" if near else ""
            raise UserError(f"{what} {pattern!r} matches no module of the model{hint}")
        result[pattern] = hits
    return result


def select_modules(model: Any, patterns: Iterable[str], what: str = "pattern") -> list[tuple[str, Any]]:
    """(name, module) pairs of ``model`` matched by any pattern, in the order patterns are given.

    A module matched by two patterns appears once, at its first match.
    """
    modules = dict(model.named_modules())
    matched = match_names(modules.keys(), patterns, what=what)
    seen: set[str] = set()
    out = []
    for hits in matched.values():
        for name in hits:
            if name not in seen:
                seen.add(name)
                out.append((name, modules[name]))
    return out
