"""Loading recipes: YAML (safe_load only), ``key=value`` overrides, validation with clear errors."""

from __future__ import annotations

import difflib
import logging
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from magistral_cli.errors import UserError

from .patterns import WILDCARD
from .schema import Recipe, compatibility_notes

log = logging.getLogger(__name__)

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping sets the same key twice (YAML itself lets the last one silently win)."""

    def __init__(self, path: str, line: int, first_line: int):
        self.path, self.line, self.first_line = path, line, first_line
        super().__init__(None, None, f"duplicate key {path} at line {line} (first set at line {first_line})")


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys.

    Seen: ``lr: 1.0e-3`` then ``lr: 7.0`` trained at 7.0, and a second ``training:`` section
    replaced the first, without a word. The check walks the composed node tree before
    construction, so that it sees each mapping as written: merge keys (``<<: *base``) are
    expanded only later, by the constructor, and a key that overrides a merged one is not
    a duplicate. Anchors and aliases keep working; an aliased mapping is checked once.
    """

    def construct_document(self, node):
        self._check_duplicates(node, "", set())
        return super().construct_document(node)

    def _check_duplicates(self, node, path: str, seen: set[int]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_duplicates(item, f"{path}[{i}]", seen)
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    self._check_duplicates(value_node, path, seen)
                    continue
                key = self.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else None
                child = f"{path}.{key}" if path else str(key)
                line = key_node.start_mark.line + 1
                if key is not None:
                    try:
                        if key in first:
                            raise DuplicateKeyError(child, line, first[key])
                        first[key] = line
                    except TypeError:  # an unhashable key: the constructor reports it
                        pass
                self._check_duplicates(value_node, child, seen)


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused (:class:`RecipeLoader`)."""
    try:
        return yaml.load(text, Loader=RecipeLoader)  # a SafeLoader subclass: no object tags
    except RecursionError:  # the parser recurses per level: a YAML error like any other
        raise yaml.MarkedYAMLError(problem="lists or mappings nested too deeply to read") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with a safe loader (anchors and aliases work, no object tags, no duplicate keys)."""
    path = Path(path)
    if not path.is_file():
        hint = " (it is a directory; pass the recipe's .yaml file)" if path.is_dir() else ""
        raise UserError(f"recipe not found: {path}{hint}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(
            f"recipe {path}: byte offset {exc.start} (line {line}) is not valid UTF-8 "
            f"({raw[exc.start : exc.start + 4]!r}); save the file as UTF-8"
        ) from None
    try:
        data = safe_load(text)
    except DuplicateKeyError as exc:
        raise UserError(
            f"recipe {path}: duplicate key {exc.path} at line {exc.line} (first set at line {exc.first_line}); "
            "YAML would keep only the last one: delete one of them (or merge the two sections)"
        ) from None
    except yaml.YAMLError as exc:
        hint = ""
        if WILDCARD in text and "alias" in str(exc):
            hint = (
                f"\n  a module pattern with {WILDCARD} inside a [...] list must be quoted: "
                f"['model.language_model.layers.{WILDCARD}'], or written as a '- ' list item"
            )
        raise UserError(f"recipe {path} is not valid YAML: {exc}{hint}") from None
    if data is None:
        raise UserError(f"recipe {path} is empty")
    if not isinstance(data, dict):
        raise UserError(
            f"recipe {path} must be a mapping of sections (parallel, data, model, ...), got {type(data).__name__}"
        )
    return data


#: Stands in for ``{*}`` while an override's value is parsed: in YAML, ``{`` opens a flow mapping
#: and ``*`` an alias, so ``[model.layers.{*}]`` would not parse unquoted.
_WILDCARD_STAND_IN = "__magistral_wildcard__"

_QUOTE_HINT = (
    "quote the whole override as one shell argument, e.g. 'model.freeze=[model.vision_tower, "
    "model.language_model.layers.{*}]', or write the list without spaces: model.freeze=[a,b]"
)


def _restore_wildcards(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(_WILDCARD_STAND_IN, WILDCARD)
    if isinstance(value, list):
        return [_restore_wildcards(v) for v in value]
    if isinstance(value, dict):
        return {_restore_wildcards(k): _restore_wildcards(v) for k, v in value.items()}
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``training.lr=2e-5`` into (["training", "lr"], value).

    The value is read as YAML so lists (``[a, b]``), booleans and null work; the schema then
    types it (``2e-5`` arrives as a string and is coerced to the field's float). Module
    patterns need no quoting: ``model.freeze=[model.vision_tower.{*}]`` is a list of one pattern.
    """
    if "=" not in text:
        raise UserError(
            f"override {text!r} is not of the form key=value (for example training.lr=2e-5); "
            f"if it is the rest of a list that the shell split at a space, {_QUOTE_HINT}"
        )
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"override {text!r} has an empty key; write section.field=value")
    try:
        value = safe_load(raw.replace(WILDCARD, _WILDCARD_STAND_IN)) if raw.strip() else None
    except DuplicateKeyError as exc:
        raise UserError(f"override {text!r}: the value sets key {exc.path} twice") from None
    except yaml.YAMLError as exc:
        hint = f"; {_QUOTE_HINT}" if raw.lstrip().startswith(("[", "{")) else ""
        raise UserError(f"override {text!r}: the value is not valid YAML ({exc.problem}){hint}") from None
    return key.split("."), _restore_wildcards(value)


def _open_brackets(text: str) -> int:
    return text.count("[") + text.count("{") - text.count("]") - text.count("}")


def join_split_overrides(overrides: list[str]) -> list[str]:
    """Join the pieces of a list value that the shell split at spaces.

    ``magistral train R model.freeze=[a, b]`` arrives as ``model.freeze=[a,`` and ``b]``:
    a piece with an unclosed bracket takes the following pieces (those without ``=``) until
    the bracket closes, joined by a space as they were typed.
    """
    out: list[str] = []
    pending: str | None = None
    for text in overrides:
        if pending is not None and "=" not in text:
            pending += " " + text
            if _open_brackets(pending.partition("=")[2]) <= 0:
                out.append(pending)
                pending = None
            continue
        if pending is not None:
            out.append(pending)
            pending = None
        if "=" in text and _open_brackets(text.partition("=")[2]) > 0:
            pending = text
        else:
            out.append(text)
    if pending is not None:
        out.append(pending)
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``a.b.c=value`` in the nested mapping (missing sections are created)."""
    for text in join_split_overrides(list(overrides)):
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
        elif err["type"] == "finite_number":
            lines.append(
                f"{path}: must be a finite number, got {err.get('input')!r}; infinity and NaN are refused "
                "in every number of the recipe"
            )
        elif err["type"] == "list_type" and isinstance(err.get("input"), str):
            lines.append(
                f"{path}: expected a list, got the string {err['input']!r}; write a list: {path}=[a, b] "
                "on the command line (quoted as one argument if it has spaces), or '- a' items in YAML"
            )
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = (
                ""
                if isinstance(got, dict | list) or err["type"].startswith("value_error")
                else f" (got {got!r})"
            )
            lines.append(f"{path}: {msg}{shown}")
    return list(dict.fromkeys(lines))  # a union field reports one problem once per member


def validate_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a recipe mapping; errors become one UserError listing every problem."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = describe_validation_error(exc)
        raise UserError(f"invalid {source}:\n  " + "\n  ".join(problems)) from None


#: Compatibility notes already logged by this process (``log_compatibility_notes``).
_NOTED: set[str] = set()


def log_compatibility_notes(recipe: Recipe) -> list[str]:
    """Log, once per process, each seed key that is accepted because it changes nothing here.

    Once: the launcher and every rank load the recipe, and a note repeated per load would bury the
    log. Returns the notes logged by this call.
    """
    fresh = [note for note in compatibility_notes(recipe) if note not in _NOTED]
    for note in fresh:
        _NOTED.add(note)
        log.info("%s", note)
    return fresh


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file; log its compatibility notes once."""
    data = apply_overrides(read_yaml(path), list(overrides or []))
    recipe = validate_recipe(data, source=f"recipe {path}")
    log_compatibility_notes(recipe)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe, every default filled in, as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
