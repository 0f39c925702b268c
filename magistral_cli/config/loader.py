"""Loading recipes: YAML (safe_load only), ``key=value`` overrides, validation with clear errors."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from magistral_cli.errors import UserError

from .schema import Recipe


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load`` (anchors and aliases work, no object tags)."""
    path = Path(path)
    if not path.is_file():
        hint = " (it is a directory; pass the recipe's .yaml file)" if path.is_dir() else ""
        raise UserError(f"recipe not found: {path}{hint}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UserError(f"recipe {path} is not valid YAML: {exc}") from None
    if data is None:
        raise UserError(f"recipe {path} is empty")
    if not isinstance(data, dict):
        raise UserError(
            f"recipe {path} must be a mapping of sections (parallel, data, model, ...), got {type(data).__name__}"
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``training.lr=2e-5`` into (["training", "lr"], value).

    The value is read as YAML so lists (``[a, b]``), booleans and null work; the schema then
    types it (``2e-5`` arrives as a string and is coerced to the field's float).
    """
    if "=" not in text:
        raise UserError(f"override {text!r} is not of the form key=value (for example training.lr=2e-5)")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"override {text!r} has an empty key; write section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise UserError(f"override {text!r}: the value is not valid YAML ({exc.problem})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``a.b.c=value`` in the nested mapping (missing sections are created)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise UserError(f"override {text!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _unwrap(annotation: Any) -> Any:
    """The BaseModel class inside Optional[...] / list[...] annotations, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _unwrap(arg)
        if found is not None:
            return found
    return None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The schema class that owns the key at ``loc`` (for suggesting the nearest key)."""
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def describe_validation_error(exc: ValidationError) -> list[str]:
    """One line per problem, each naming the full key path."""
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        # Validators on a union report the branch name (``int``, ``literal['auto']``) in loc.
        loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("int", "str", "float"))))
        path = _dotted(loc) or "(recipe)"
        if err["type"] == "extra_forbidden":
            owner = _model_at(loc)
            valid = list(owner.model_fields) if owner is not None else []
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
            parent = _dotted(loc[:-1])
            if near:
                hint = f"did you mean {parent + '.' if parent else ''}{near[0]}?"
            else:
                hint = f"valid keys here: {', '.join(valid)}" if valid else "remove it"
            lines.append(f"unknown key {path} ({hint})")
        elif err["type"] == "missing":
            lines.append(f"{path}: required but missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = (
                ""
                if isinstance(got, dict | list) or err["type"].startswith("value_error")
                else f" (got {got!r})"
            )
            lines.append(f"{path}: {msg}{shown}")
    return lines


def validate_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a recipe mapping; errors become one UserError listing every problem."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = describe_validation_error(exc)
        raise UserError(f"invalid {source}:\n  " + "\n  ".join(problems)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file."""
    data = apply_overrides(read_yaml(path), list(overrides or []))
    return validate_recipe(data, source=f"recipe {path}")


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe, every default filled in, as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
