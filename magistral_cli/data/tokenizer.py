"""The Tekken tokenizer from a model directory, as a plain ``tokenizers.Tokenizer``.

Two sources give the same vocabulary:

- ``tekken.json`` (official, the default): transformers >= 5 converts it into a fast
  tokenizer (``MistralConverter``), so no third-party file is needed;
- ``tokenizer.json`` (third-party conversions such as unsloth's): loaded as is, with the
  pre-tokenizer regex repaired when ``fix_mistral_regex`` is set (older conversions shipped a
  regex that splits text differently from Tekken).

The pipeline encodes text segments itself and inserts special ids directly, so all it needs is
the fast tokenizer and the ids of the special tokens, which are checked here: a tokenizer that
cannot resolve ``<s>`` or ``[IMG]`` would otherwise produce samples that are silently wrong.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from magistral_cli.assets.hashing import sha256_file
from magistral_cli.errors import UserError

#: Tekken's pre-tokenizer pattern (the value of ``config.pattern`` in every tekken.json).
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Special tokens the ``mistral`` template and the Pixtral plugin emit.
REQUIRED_SPECIAL_TOKENS = {
    "bos": "<s>",
    "eos": "</s>",
    "inst": "[INST]",
    "inst_end": "[/INST]",
    "system": "[SYSTEM_PROMPT]",
    "system_end": "[/SYSTEM_PROMPT]",
    "img": "[IMG]",
    "img_break": "[IMG_BREAK]",
    "img_end": "[IMG_END]",
    "tool_results": "[TOOL_RESULTS]",
    "tool_results_end": "[/TOOL_RESULTS]",
}

#: The first tekken version that encodes a system prompt as a ``[SYSTEM_PROMPT]`` block
#: (older versions prepend it to the last user message, which template ``mistral`` does not do).
MIN_TEKKEN_VERSION = 7

#: The control tokens around reasoning (mistral-common's ``ThinkChunk``), and the first tekken
#: version that encodes them (mistral-common's ``InstructTokenizerV13``; Magistral-Small-2509 ships v13).
THINK_TOKENS = ("[THINK]", "[/THINK]")
THINK_TEKKEN_VERSION = 13


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens used by the template and the image plugin."""

    bos: int
    eos: int
    inst: int
    inst_end: int
    system: int
    system_end: int
    img: int
    img_break: int
    img_end: int
    tool_results: int
    tool_results_end: int
    pad: int


@dataclass
class TekkenTokenizer:
    """A fast Tekken tokenizer plus the facts the pipeline needs about it."""

    backend: object  # tokenizers.Tokenizer
    special: SpecialIds
    source: Literal["official", "unsloth"]
    files: dict[str, str]  # file name -> SHA-256 (part of the cache fingerprint)
    split_special_tokens: bool = True
    version: str | None = None  # tekken.json's config.version ("v13"); None for a tokenizer.json

    @functools.cached_property
    def think_ids(self) -> tuple[int, int] | None:
        """The ids of ``[THINK]`` and ``[/THINK]`` when this tokenizer encodes reasoning, else None.

        As mistral-common: from tekken v13 on, and only when the vocabulary has both as control
        tokens (a tokenizer.json, which carries no version, is judged by its control tokens alone).
        """
        number = tekken_version_number(self.version)
        if number is not None and number < THINK_TEKKEN_VERSION:
            return None
        begin, end = (self.control_id(token) for token in THINK_TOKENS)
        return None if begin is None or end is None else (begin, end)

    def describe(self) -> str:
        """Which tokenizer this is, for messages: ``tekken.json v13`` or ``tokenizer.json``."""
        name = next((name for name in self.files if name.endswith(".json")), self.source)
        return f"{name} {self.version}" if self.version else name

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS (control-token strings as ``split_special_tokens`` says)."""
        return self.backend.encode(text, add_special_tokens=False, is_pretokenized=False).ids

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with every control-token string in it encoded as plain text
        (mistral-common's ``TextChunk``), whatever ``split_special_tokens`` says."""
        backend = self.backend
        if backend.encode_special_tokens:
            return self.encode(text)
        backend.encode_special_tokens = True
        try:
            return self.encode(text)
        finally:
            backend.encode_special_tokens = False

    @functools.cached_property
    def control_tokens(self) -> dict[int, str]:
        """Id -> string of every control token (the vocabulary's added tokens: Tekken's 1000 specials)."""
        return {int(i): token.content for i, token in self.backend.get_added_tokens_decoder().items()}

    def control_id(self, token: str) -> int | None:
        """The id of control token ``token``, or None when the vocabulary has no such control token."""
        token_id = self.backend.token_to_id(token)
        return token_id if token_id is not None and self.control_tokens.get(token_id) == token else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once (the Rust side handles the batch)."""
        if not texts:
            return []
        return [enc.ids for enc in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with every special token visible."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def to_str(self) -> str:
        """Serialized backend, to rebuild the same tokenizer in a worker process."""
        return self.backend.to_str()


def resolve_tokenizer_source(model_dir: Path, source: str) -> Literal["official", "unsloth"]:
    """Pick ``tekken.json`` (official) or ``tokenizer.json`` (unsloth) for ``source``."""
    has_tekken = (model_dir / "tekken.json").is_file()
    has_hf = (model_dir / "tokenizer.json").is_file()
    if source == "official" or (source == "auto" and has_tekken):
        if not has_tekken:
            raise UserError(
                f"{model_dir} has no tekken.json (tokenizer_source: official); run `magistral fetch` "
                "or set data.dataset_param.preprocess_parameters.tokenizer_source=unsloth to use tokenizer.json"
            )
        return "official"
    if source in ("unsloth", "auto"):
        if not has_hf:
            raise UserError(
                f"{model_dir} has neither tekken.json nor tokenizer.json; run `magistral fetch --model-dir {model_dir}`"
            )
        return "unsloth"
    raise UserError(f"unknown tokenizer_source {source!r}; use official, unsloth or auto")


_BACKENDS: dict[tuple, object] = {}


def _build_backend(path: str, digest: str, kind: str, fix_mistral_regex: bool, split_special_tokens: bool):
    """The ``tokenizers.Tokenizer`` of a file, cached by content: building one takes seconds."""
    key = (digest, kind, fix_mistral_regex, split_special_tokens)
    if key not in _BACKENDS:
        if len(_BACKENDS) >= 8:
            _BACKENDS.pop(next(iter(_BACKENDS)))
        sibling = _BACKENDS.get((digest, kind, fix_mistral_regex, not split_special_tokens))
        if sibling is not None:  # same vocabulary, other split flag: copying is cheaper than converting
            import tokenizers

            backend = tokenizers.Tokenizer.from_str(sibling.to_str())
        else:
            backend = _read_backend(path, kind, fix_mistral_regex)
        backend.encode_special_tokens = bool(split_special_tokens)
        _BACKENDS[key] = backend
    return _BACKENDS[key]


def _read_backend(path: str, kind: str, fix_mistral_regex: bool):
    import tokenizers

    if kind == "official":
        from transformers.integrations.mistral.tokenizer import MistralConverter

        try:
            backend = MistralConverter(path).converted()
        except Exception as exc:  # the converter raises many kinds on a malformed file
            raise UserError(f"cannot build a tokenizer from {path}: {exc}") from None
    else:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise UserError(f"{path} is not valid JSON ({exc})") from None
        if fix_mistral_regex:
            _fix_regex(data)
        elif (pattern := _split_pattern(data)) is not None and pattern != TEKKEN_PATTERN:
            raise UserError(
                f"{path} splits text with a pre-tokenizer regex that differs from Tekken's, so its token ids "
                "would not match the model's; set data.dataset_param.preprocess_parameters.fix_mistral_regex=true"
            )
        try:
            backend = tokenizers.Tokenizer.from_str(json.dumps(data))
        except Exception as exc:
            raise UserError(f"cannot load {path}: {exc}") from None
    return backend


def tekken_version_number(version: str | None) -> int | None:
    """13 for ``"v13"``; None for no version or one of another shape."""
    if version and version.startswith("v") and version[1:].isdigit():
        return int(version[1:])
    return None


def _check_tekken_version(path: Path) -> str | None:
    """tekken.json's version (``"v13"``), after refusing one older than ``MIN_TEKKEN_VERSION``."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path} is not a Tekken tokenizer file ({exc})") from None
    version = str(config.get("version", "")) or None
    number = tekken_version_number(version)
    if number is not None and number < MIN_TEKKEN_VERSION:
        raise UserError(
            f"{path} is Tekken {version}: template 'mistral' writes system prompts as [SYSTEM_PROMPT] blocks, "
            f"which needs tokenizer version v{MIN_TEKKEN_VERSION} or later (Magistral-Small-2509 ships v13); "
            "use the model's own tekken.json"
        )
    return version


def _fix_regex(tokenizer_json: dict) -> bool:
    """Replace the first Split pattern of the pre-tokenizer with Tekken's; True if changed."""
    split = {"type": "Split", "pattern": {"Regex": TEKKEN_PATTERN}, "behavior": "Isolated", "invert": False}
    pre = tokenizer_json.get("pre_tokenizer")
    if pre and pre.get("type") == "Sequence":
        items = pre["pretokenizers"]
        if items and items[0].get("type") == "Split":
            changed = items[0].get("pattern") != split["pattern"]
            items[0] = split
            return changed
        items.insert(0, split)
        return True
    if pre and pre.get("type") == "Metaspace":
        # Metaspace cannot follow a Split (spaces get lost); Tekken is byte-level.
        pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    tokenizer_json["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split] + ([pre] if pre else [])}
    return True


def _split_pattern(tokenizer_json: dict) -> str | None:
    pre = tokenizer_json.get("pre_tokenizer") or {}
    items = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for item in items:
        if item.get("type") == "Split":
            pattern = item.get("pattern", {})
            return pattern.get("Regex") or pattern.get("String")
    return None


def load_tokenizer(
    model_dir: str | Path,
    source: str = "auto",
    fix_mistral_regex: bool = False,
    split_special_tokens: bool = True,
) -> TekkenTokenizer:
    """Load and check the tokenizer of ``model_dir``.

    ``split_special_tokens`` True (the default) encodes control-token strings written in the
    data (``[INST]``, ``</s>``) as plain text, as mistral-common does; False (the seed's setting,
    LLaMA-Factory's) maps them to their control ids, as Hugging Face tokenizers do.
    """
    kind, path, files, version = _identify(model_dir, source, fix_mistral_regex, split_special_tokens)
    backend = _build_backend(
        str(path.resolve()), files[path.name], kind, fix_mistral_regex, split_special_tokens
    )
    special = check_special_tokens(backend, path)
    return TekkenTokenizer(backend, special, kind, files, split_special_tokens, version)


def tokenizer_files(
    model_dir: str | Path,
    source: str = "auto",
    fix_mistral_regex: bool = False,
    split_special_tokens: bool = True,
) -> tuple[Literal["official", "unsloth"], Path, dict[str, str]]:
    """Which file the tokenizer comes from and what identifies it (hashes and options), cheaply.

    This is what the cache fingerprint needs; building the tokenizer itself takes seconds and
    is only done when rows are encoded.
    """
    kind, path, files, _ = _identify(model_dir, source, fix_mistral_regex, split_special_tokens)
    return kind, path, files


def _identify(
    model_dir: str | Path, source: str, fix_mistral_regex: bool, split_special_tokens: bool
) -> tuple[Literal["official", "unsloth"], Path, dict[str, str], str | None]:
    """``tokenizer_files`` and tekken.json's version (read in the same pass; None for tokenizer.json)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(
            f"model directory not found: {model_dir} (set data.dataset_param.preprocess_parameters.model_name_or_path)"
        )
    kind = resolve_tokenizer_source(model_dir, source)
    path = model_dir / ("tekken.json" if kind == "official" else "tokenizer.json")
    version = _check_tekken_version(path) if kind == "official" else None
    files = {path.name: sha256_file(path)[0]}
    # split_special_tokens and fix_mistral_regex change the ids: both are part of the identity.
    files["options"] = f"split_special_tokens={split_special_tokens},fix_mistral_regex={fix_mistral_regex}"
    return kind, path, files, version


def check_special_tokens(backend, path: Path) -> SpecialIds:
    """Resolve every special token the pipeline emits; refuse a tokenizer that lacks one."""
    ids: dict[str, int] = {}
    missing = []
    for field, token in REQUIRED_SPECIAL_TOKENS.items():
        token_id = backend.token_to_id(token)
        if token_id is None or (token_id == backend.token_to_id("<unk>") and token != "<unk>"):
            missing.append(token)
        else:
            ids[field] = token_id
    if missing:
        raise UserError(
            f"{path} does not define the special token(s) {', '.join(missing)} that Magistral's template needs; "
            "use the tokenizer files of Magistral-Small-2509 (`magistral fetch`)"
        )
    if len(set(ids.values())) != len(ids):
        raise UserError(f"{path} maps several special tokens to the same id: {ids}")
    pad = backend.token_to_id("<pad>")
    return SpecialIds(**ids, pad=ids["eos"] if pad is None else pad)


def check_against_model_config(special: SpecialIds, config: dict, where: Path) -> None:
    """The tokenizer's ids must be the ones the model was trained with (config.json)."""
    expected = {
        "image_token_index": ("[IMG]", special.img),
        "image_token_id": ("[IMG]", special.img),
    }
    text = config.get("text_config") or {}
    for key, (token, actual) in expected.items():
        if key in config and config[key] is not None and int(config[key]) != actual:
            raise UserError(
                f"{where}: config.json has {key}={config[key]} but the tokenizer maps {token} to {actual}"
            )
    for key, token, actual in (("bos_token_id", "<s>", special.bos), ("eos_token_id", "</s>", special.eos)):
        value = text.get(key, config.get(key))
        if isinstance(value, int) and value != actual:
            raise UserError(
                f"{where}: config.json has {key}={value} but the tokenizer maps {token} to {actual}"
            )
