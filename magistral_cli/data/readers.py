"""Reading LLaVA / ShareGPT records into conversations, and the reasons a row is dropped.

A dataset file is a JSON array of records or JSON Lines (one record per line). LLaVA/COCO
records (the seed's data) look like::

    {"images": ["coco/train2017/000000033471.jpg"],
     "messages": [{"role": "user", "content": "<image>\\nWhat are the colors of the bus?"},
                  {"role": "assistant", "content": "The bus is white and red."}]}

ShareGPT records use ``conversations`` with ``from`` / ``value`` (``human``, ``gpt``, ...);
``data.dataset_param.attr`` maps the column and role names. Every ``<image>`` placeholder
takes the next image of the record, in order.

An assistant message may carry its reasoning in one of three layouts, all read into the same
:class:`ReplyPart` list (and encoded as mistral-common's ``ThinkChunk``):

- a ``reasoning_content`` field beside ``content`` (``attr.reasoning_tag``; empty or null = none);
- content chunks ``[{"type": "thinking", "thinking": "..."}, {"type": "text", "text": "..."}]``
  (mistral-common's; ``thinking`` may also be a list of text chunks, as Mistral's API writes it);
- literal ``[THINK]...[/THINK]`` in the text, read as reasoning only where the tokenizer has them
  as control tokens (tokenizer v13); with an older one they stay text, as mistral-common keeps them.

Nothing here raises on a bad row: :func:`normalize_record` returns a :class:`Drop` naming
the reason, so that the report can count them and ``--strict`` can name the row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magistral_cli.errors import UserError

from .tokenizer import THINK_TOKENS

IMAGE_PLACEHOLDER = "<image>"

#: Why a row was dropped (the keys of the report's "dropped" table).
DROP_REASONS = {
    "invalid_json": "the line is not valid JSON",
    "invalid_utf8": "the line is not valid UTF-8 (or its text holds an unpaired \\ud800-style surrogate escape)",
    "invalid_record": "the record does not have the expected columns or types",
    "unknown_role": "a message has a role that the attr mapping does not know",
    "unsupported_role": "a message role the mistral template cannot encode (tool calls)",
    "bad_turn_order": "messages do not alternate user/assistant (after an optional system message)",
    "missing_assistant": "the conversation does not end with an assistant turn",
    "empty_assistant": "an assistant turn is empty",
    "malformed_reasoning": "an assistant turn's reasoning is not closed [THINK] ... [/THINK] blocks (a marker "
    "unpaired or nested, or inside the reasoning text; a thinking chunk with closed: false; reasoning_content "
    "beside thinking in the content)",
    "image_count_mismatch": "the number of <image> placeholders differs from the number of images",
    "image_in_assistant_turn": "an <image> placeholder is inside an assistant turn",
    "missing_image": "an image file does not exist",
    "image_outside_dataset_dir": "an image path leads outside dataset_dir (allow_outside_dataset_dir: false)",
    "image_token_in_text": "the text holds [IMG], [IMG_BREAK] or [IMG_END], which split_special_tokens: false "
    "would turn into image tokens with no image",
    "unreadable_image": "an image path is a directory or a file that cannot be decoded as an image",
    "unusable_image_size": "an image's size gives no image token on a side",
    "unsupported_video": "the record has videos (not supported for Magistral)",
    "image_tokens_truncated": "cutoff_len would cut the sample inside image tokens",
    "no_label_tokens": "after truncation no token is left to train on",
    # Preference pairs (training.stage: dpo; see data/pairs.py)
    "missing_chosen": "the chosen column (attr.chosen) is absent or empty",
    "missing_rejected": "the rejected column (attr.rejected) is absent or empty",
    "chosen_equals_rejected": "the chosen and rejected answers are the same",
    "answer_not_assistant": "a chosen or rejected answer is not one assistant message (another role, or several "
    "messages)",
    "prompt_not_ending_with_user": "the prompt messages do not end with a user turn",
    "answer_truncated": "cutoff_len leaves no token of the answers (the prompt fills it)",
}


@dataclass(frozen=True)
class Drop:
    """A row that is not encoded, and why."""

    reason: str
    detail: str


@dataclass(frozen=True)
class ReplyPart:
    """A piece of an assistant turn: text, or reasoning (``[THINK]`` ... ``[/THINK]``)."""

    text: str
    thinking: bool = False


@dataclass
class Conversation:
    """A record in the template's terms: system prompt, (prompt, response) turns, image paths."""

    system: str | None
    # (prompt role: user|observation, prompt text, the response's parts in order)
    turns: list[tuple[str, str, tuple[ReplyPart, ...]]]
    images: list[str] = field(default_factory=list)  # resolved paths, in placeholder order
    # A preference pair's rejected answer: the last turn's response is the chosen one (data/pairs.py).
    rejected: tuple[ReplyPart, ...] | None = None

    @property
    def has_reasoning(self) -> bool:
        replies = [reply for _, _, reply in self.turns] + [self.rejected or ()]
        return any(part.thinking for reply in replies for part in reply)


@dataclass(frozen=True)
class RowSource:
    """One row of the dataset file: a parsed record, or the raw line that failed to parse."""

    index: int
    record: Any = None
    error: str | None = None
    error_reason: str = "invalid_json"  # the drop reason of ``error`` (a DROP_REASONS key)


_BOM = b"\xef\xbb\xbf"
#: JSON nested deeper than Python's parser recurses (RecursionError, not a JSONDecodeError).
_TOO_DEEP = (
    "the JSON is nested too deeply to parse (arrays or objects inside each other, about a thousand levels)"
)
#: The deepest record kept: a record is a few levels deep (record, messages, message, text); one
#: nested deeper could still not be copied to the preprocessing workers (pickle recurses too).
MAX_RECORD_DEPTH = 32


def _too_deep(record: Any) -> bool:
    """Whether ``record`` nests lists and objects more than ``MAX_RECORD_DEPTH`` levels (no recursion)."""
    stack = [(record, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            if depth > MAX_RECORD_DEPTH:
                return True
            stack.extend((item, depth + 1) for item in value)
    return False


def _row(index: int, record: Any, where: str) -> RowSource:
    """A parsed record as a row, or, when it is nested too deeply to use, a row to drop."""
    if _too_deep(record):
        detail = f"{where}: the record nests lists and objects more than {MAX_RECORD_DEPTH} levels deep"
        return RowSource(index, None, detail, "invalid_record")
    return RowSource(index, record)


def _utf8_error(exc: UnicodeDecodeError, base: int) -> str:
    """Where the undecodable bytes are: the byte offset in the file and the bytes themselves."""
    return f"byte offset {base + exc.start} is not valid UTF-8 ({exc.object[exc.start : exc.start + 4]!r})"


def read_rows(path: str | Path, max_samples: int | None = None) -> list[RowSource]:
    """Rows of a JSON array or JSON Lines file (the format is sniffed from the first character).

    A JSON array that does not parse (or decode as UTF-8) is an error for the whole file:
    there are no rows to keep. In JSON Lines each bad line becomes a row that is dropped as
    ``invalid_json`` or ``invalid_utf8``. Lines are split on bytes, before decoding, so that
    one undecodable line costs only that line; splitting on ``\\n``/``\\r`` only (not str's
    ``splitlines``) keeps a raw U+2028 inside a JSON string from cutting a record in two.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset not found: {path} (set data.dataset_param.basic_parameters.dataset)")
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(f"{path} is UTF-16 text; convert it to UTF-8 (for example: iconv -f UTF-16 -t UTF-8)")
    base = len(_BOM) if data.startswith(_BOM) else 0
    rows: list[RowSource] = []
    if data[base:].lstrip().startswith(b"["):
        try:
            text = data[base:].decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, base + exc.start) + 1
            raise UserError(
                f"{path}: {_utf8_error(exc, base)} (line {line}); a JSON array is read as a whole, so fix or "
                "remove those bytes, or write one record per line (JSON Lines) so that bad lines are skipped"
            ) from None
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                "fix it, or write one record per line (JSON Lines) so that bad lines are skipped"
            ) from None
        except RecursionError:
            raise UserError(
                f"{path}: {_TOO_DEEP}; fix the records, or write one record per line (JSON Lines) so that "
                "such lines are skipped"
            ) from None
        for index, record in enumerate(records[:max_samples] if max_samples else records):
            rows.append(_row(index, record, f"record {index}"))
        return rows
    index = 0
    offset = base
    for lineno, raw in enumerate(data[base:].splitlines(keepends=True), start=1):
        line_offset, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        if max_samples is not None and index >= max_samples:
            break
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            rows.append(
                RowSource(index, None, f"line {lineno}: {_utf8_error(exc, line_offset)}", "invalid_utf8")
            )
            index += 1
            continue
        try:
            rows.append(_row(index, json.loads(line), f"line {lineno}"))
        except json.JSONDecodeError as exc:
            rows.append(RowSource(index, None, f"line {lineno}: {exc.msg} at column {exc.colno}"))
        except RecursionError:
            rows.append(RowSource(index, None, f"line {lineno}: {_TOO_DEEP}"))
        index += 1
    if not rows:
        raise UserError(f"{path} holds no records")
    return rows


@dataclass(frozen=True)
class RecordFormat:
    """Resolved column and role names (from ``data.dataset_param.attr``)."""

    messages: str
    images: str | None
    videos: str | None
    system: str | None
    role_tag: str
    content_tag: str
    user: str
    assistant: str
    observation: str
    function: str
    system_role: str
    reasoning: str | None  # the assistant message's reasoning field (reasoning_content)
    sharegpt_fallback: bool  # auto: use ``conversations`` with from/value when ``messages`` is absent
    # (chosen, rejected) columns when rows are preference pairs (training.stage: dpo), else None
    pair_columns: tuple[str, str] | None = None

    @classmethod
    def from_attr(cls, attr, *, pairs: bool = False) -> RecordFormat:
        """The attr mapping; ``pairs``: rows are preference pairs (``attr.chosen`` / ``attr.rejected``)."""
        if attr.formatting == "alpaca":
            raise UserError(
                "data.dataset_param.attr.formatting 'alpaca' is not supported; use LLaVA 'messages' or "
                "ShareGPT 'conversations' records"
            )
        return cls(
            messages=attr.messages,
            images=attr.images,
            videos=attr.videos,
            system=attr.system,
            role_tag=attr.role_tag,
            content_tag=attr.content_tag,
            user=attr.user_tag,
            assistant=attr.assistant_tag,
            observation=attr.observation_tag or "observation",
            function=attr.function_tag or "function_call",
            system_role=attr.system_tag or "system",
            reasoning=attr.reasoning_tag,
            sharegpt_fallback=attr.formatting == "auto" and "messages" not in attr.model_fields_set,
            pair_columns=(attr.chosen, attr.rejected) if pairs else None,
        )

    def fingerprint_fields(self) -> dict:
        fields = self.__dict__.copy()
        if fields["pair_columns"] is None:  # SFT entries keep the fingerprint they had before pairs
            del fields["pair_columns"]
        return fields

    def message_layout(self, record: dict) -> tuple[str, dict[str, str]]:
        """The column holding ``record``'s messages, and the role/content tags they use (ShareGPT's
        ``from`` / ``value`` when ``formatting: auto`` falls back to ``conversations``)."""
        tags = {
            "role_tag": self.role_tag,
            "content_tag": self.content_tag,
            "user": self.user,
            "assistant": self.assistant,
        }
        if record.get(self.messages) is None and self.sharegpt_fallback and "conversations" in record:
            return "conversations", dict(_SHAREGPT)
        return self.messages, tags


_SHAREGPT = {"role_tag": "from", "content_tag": "value", "user": "human", "assistant": "gpt"}


def _resolve_image(path: Any, dataset_dir: Path) -> str | Drop:
    if isinstance(path, dict):  # {"path": ...} as some exports write
        path = path.get("path")
    if not isinstance(path, str) or not path:
        return Drop("invalid_record", f"image entry {path!r} is not a path")
    resolved = Path(path) if Path(path).is_absolute() else dataset_dir / path
    return str(resolved)


_THINK_SPLIT = re.compile("(" + "|".join(re.escape(token) for token in THINK_TOKENS) + ")")
_MALFORMED_FIX = "close every [THINK] with a [/THINK], one block at a time"


def _split_think_markers(text: str, where: str) -> list[ReplyPart] | Drop:
    """``text`` with literal ``[THINK]...[/THINK]`` blocks read as reasoning parts."""
    begin, end = THINK_TOKENS
    parts: list[ReplyPart] = []
    thinking: str | None = None  # the open block's text
    for piece in _THINK_SPLIT.split(text):
        if piece == begin:
            if thinking is not None:
                return Drop(
                    "malformed_reasoning",
                    f"{where} opens {begin} inside {begin}; {_MALFORMED_FIX}",
                )
            thinking = ""
        elif piece == end:
            if thinking is None:
                return Drop("malformed_reasoning", f"{where} has {end} without {begin}; {_MALFORMED_FIX}")
            parts.append(ReplyPart(thinking, thinking=True))
            thinking = None
        elif thinking is not None:
            thinking += piece
        elif piece:
            parts.append(ReplyPart(piece))
    if thinking is not None:
        return Drop("malformed_reasoning", f"{where} has {begin} without {end}; {_MALFORMED_FIX}")
    return parts


def _chunk_text(chunk: Any, key: str) -> str | None:
    """The text of a chunk's ``key``: a string, or a list of text chunks (Mistral's API)."""
    value = chunk.get(key)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in value
    ):
        return "".join(c["text"] for c in value)
    return None


def reply_parts(
    message: dict, where: str, content_tag: str, reasoning_key: str | None, think_markers: bool
) -> tuple[ReplyPart, ...] | Drop:
    """An assistant message's parts (reasoning and text, in order), or why it cannot be used
    (``where`` names the message in a drop's detail: "message 3")."""
    content = message.get(content_tag)
    raw: list[ReplyPart] = []
    if isinstance(content, str):
        raw.append(ReplyPart(content))
    elif isinstance(content, list) and content:
        for n, chunk in enumerate(content):
            kind = chunk.get("type") if isinstance(chunk, dict) else None
            text = _chunk_text(chunk, kind) if kind in ("text", "thinking") else None
            if text is None:
                return Drop(
                    "invalid_record",
                    f"{where}: content chunk {n} is not a text chunk {{'type': 'text', 'text': ...}} or a "
                    "thinking chunk {'type': 'thinking', 'thinking': ...}",
                )
            if kind == "thinking" and chunk.get("closed", True) is not True:
                return Drop(
                    "malformed_reasoning",
                    f"{where}: thinking chunk {n} has closed: false; an answer to train on closes its reasoning",
                )
            raw.append(ReplyPart(text, thinking=kind == "thinking"))
    else:
        return Drop("invalid_record", f"{where} has no text {content_tag!r} (a string or a list of chunks)")
    reasoning = message.get(reasoning_key) if reasoning_key else None
    if reasoning is not None and not isinstance(reasoning, str):
        return Drop("invalid_record", f"{where}: {reasoning_key!r} is not a string")
    parts: list[ReplyPart] = []
    for part in raw:
        if part.thinking:
            parts.append(part)
        elif think_markers:
            split = _split_think_markers(part.text, where)
            if isinstance(split, Drop):
                return split
            parts += split
        elif part.text:
            parts.append(part)
    if reasoning:
        if any(part.thinking for part in parts):
            return Drop(
                "malformed_reasoning",
                f"{where} has {reasoning_key!r} and reasoning in its content too; keep one of them",
            )
        parts.insert(0, ReplyPart(reasoning, thinking=True))
    for part in parts:
        if part.thinking and any(token in part.text for token in THINK_TOKENS):
            return Drop(
                "malformed_reasoning",
                f"{where}'s reasoning text holds {' or '.join(THINK_TOKENS)}; the template writes the markers "
                "around it: remove them from the reasoning",
            )
    return tuple(parts)


def row_record(row: RowSource) -> dict | Drop:
    """A row's JSON object, or why it is none (the reader's error, or another JSON value)."""
    if row.error is not None:
        return Drop(row.error_reason, row.error)
    if not isinstance(row.record, dict):
        return Drop("invalid_record", f"record is a {type(row.record).__name__}, not an object")
    return row.record


def normalize_record(
    row: RowSource, fmt: RecordFormat, dataset_dir: Path, *, think_markers: bool = False
) -> Conversation | Drop:
    """Turn one record into a :class:`Conversation`, or say why it cannot be used.

    ``think_markers``: the tokenizer has ``[THINK]`` / ``[/THINK]`` as control tokens (v13), so
    literal markers in an assistant's text are its reasoning; otherwise they are text.
    """
    record = row_record(row)
    if isinstance(record, Drop):
        return record

    column, tags = fmt.message_layout(record)
    messages = record.get(column)
    if not isinstance(messages, list) or not messages:
        return Drop("invalid_record", f"column {fmt.messages!r} is missing or not a non-empty list")

    if fmt.videos and record.get(fmt.videos):
        return Drop("unsupported_video", f"{len(record[fmt.videos])} video(s)")

    system = record.get(fmt.system) if fmt.system else None
    if system is not None and not isinstance(system, str):
        return Drop("invalid_record", f"column {fmt.system!r} is not a string")

    prompt_roles = {tags["user"]: "user", fmt.observation: "observation"}
    parsed: list[tuple[str, Any]] = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            return Drop("invalid_record", f"message {position} is not an object")
        role, content = message.get(tags["role_tag"]), message.get(tags["content_tag"])
        if role == tags["assistant"]:
            reply = reply_parts(
                message, f"message {position}", tags["content_tag"], fmt.reasoning, think_markers
            )
            if isinstance(reply, Drop):
                return reply
            parsed.append(("assistant", reply))
            continue
        if not isinstance(content, str):
            return Drop("invalid_record", f"message {position} has no text {tags['content_tag']!r}")
        if role == fmt.system_role and position == 0:
            system = content
            continue
        if role in prompt_roles:
            parsed.append((prompt_roles[role], content))
        elif role == fmt.function:
            return Drop("unsupported_role", f"message {position} is a tool call ({role!r})")
        else:
            known = sorted({tags["user"], tags["assistant"], fmt.observation, fmt.system_role})
            return Drop("unknown_role", f"message {position} has role {role!r} (known: {', '.join(known)})")

    turns: list[tuple[str, str, tuple[ReplyPart, ...]]] = []
    for i in range(0, len(parsed), 2):
        prompt_role, prompt = parsed[i]
        if prompt_role == "assistant":
            return Drop("bad_turn_order", f"message {i} is an assistant turn where a user turn was expected")
        if i + 1 >= len(parsed):
            return Drop("missing_assistant", f"the last turn ({prompt_role}) has no assistant reply")
        response_role, response = parsed[i + 1]
        if response_role != "assistant":
            return Drop(
                "bad_turn_order",
                f"message {i + 1} is a {response_role} turn where an assistant turn was expected",
            )
        if not any(part.text.strip() for part in response):
            return Drop("empty_assistant", f"assistant turn {i // 2} is empty")
        if any(IMAGE_PLACEHOLDER in part.text for part in response):
            return Drop("image_in_assistant_turn", f"assistant turn {i // 2} contains {IMAGE_PLACEHOLDER}")
        turns.append((prompt_role, prompt, response))
    if not turns:
        return Drop("missing_assistant", "the conversation has no user/assistant turn")

    raw_images = record.get(fmt.images) if fmt.images else None
    if raw_images is None:
        raw_images = []
    elif isinstance(raw_images, str):
        raw_images = [raw_images]
    elif not isinstance(raw_images, list):
        return Drop("invalid_record", f"column {fmt.images!r} is not a list of paths")
    placeholders = sum(prompt.count(IMAGE_PLACEHOLDER) for _, prompt, _ in turns)
    if system and IMAGE_PLACEHOLDER in system:
        return Drop("image_count_mismatch", "the system prompt contains an <image> placeholder")
    if placeholders != len(raw_images):
        return Drop(
            "image_count_mismatch", f"{placeholders} <image> placeholder(s) but {len(raw_images)} image(s)"
        )
    surrogate = _unencodable_text(system, turns)
    if surrogate is not None:
        return Drop("invalid_utf8", surrogate)
    images: list[str] = []
    for raw in raw_images:
        resolved = _resolve_image(raw, dataset_dir)
        if isinstance(resolved, Drop):
            return resolved
        images.append(resolved)
    return Conversation(system=system, turns=turns, images=images)


def _unencodable_text(system: str | None, turns: list[tuple[str, str, tuple[ReplyPart, ...]]]) -> str | None:
    """Which text of the conversation UTF-8 cannot encode, if any.

    Valid JSON may escape half of a surrogate pair (``"\\ud800"``); Python keeps it as a lone
    surrogate, which the tokenizer refuses with a TypeError that would stop the whole batch.
    Only the texts that get tokenized are checked: other columns are never read.
    """
    texts = [("the system prompt", system)] if system else []
    for n, (_, prompt, response) in enumerate(turns):
        texts += [(f"prompt {n}", prompt), *((f"assistant turn {n}", part.text) for part in response)]
    for where, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{where} holds an unpaired surrogate {text[exc.start]!r} (a \\u escape of half a pair)"
    return None


def iter_segments(text: str) -> Iterator[str | None]:
    """Split ``text`` at ``<image>``: yields text pieces, and None where an image goes."""
    parts = text.split(IMAGE_PLACEHOLDER)
    for i, part in enumerate(parts):
        if i:
            yield None
        if part:
            yield part
