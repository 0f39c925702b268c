"""Reading preference pairs (``training.stage: dpo``): a prompt and two answers, chosen and rejected.

A row is LLaMA-Factory's ranking layout, with the columns ``data.dataset_param.attr`` names::

    {"messages": [{"role": "user", "content": "<image>\\nWhat is in the picture?"}],
     "chosen": {"role": "assistant", "content": "Two red squares."},
     "rejected": {"role": "assistant", "content": "A dog."},
     "images": ["images/0001.png"]}

``messages`` (``attr.messages``) is the prompt: it may open with a system message and hold earlier
turns, and must end with a user turn. ``chosen`` / ``rejected`` (``attr.chosen`` / ``attr.rejected``)
each hold one assistant message (or a one-element list of it), read as an SFT answer is (string or
chunk content, reasoning as ``attr.reasoning_tag`` says). ``images`` are the prompt's, one per
``<image>`` placeholder of its user turns. A pair is read into one :class:`Conversation` whose last
turn's response is the chosen answer, with the rejected one beside it (``Conversation.rejected``);
the encoder makes the two sequences from it. Nothing here raises on a bad row: a :class:`Drop`
names the reason (``readers.DROP_REASONS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .readers import (
    IMAGE_PLACEHOLDER,
    Conversation,
    Drop,
    RecordFormat,
    ReplyPart,
    RowSource,
    normalize_record,
    reply_parts,
    row_record,
)

SIDES = ("chosen", "rejected")


def _answer_message(value: Any, side: str, column: str, tags: dict[str, str]) -> dict | Drop:
    """The one assistant message a ``chosen`` / ``rejected`` column holds, or why it is not one."""
    if value is None or value == "" or value == [] or value == {}:
        return Drop(f"missing_{side}", f"column {column!r} is absent or empty")
    if isinstance(value, list):
        if len(value) != 1:
            return Drop(
                "answer_not_assistant",
                f"column {column!r} holds {len(value)} messages; write one assistant message "
                f"{{{tags['role_tag']!r}: {tags['assistant']!r}, {tags['content_tag']!r}: ...}}",
            )
        value = value[0]
    if not isinstance(value, dict):
        return Drop(
            "answer_not_assistant",
            f"column {column!r} is a {type(value).__name__}, not an assistant message "
            f"{{{tags['role_tag']!r}: {tags['assistant']!r}, {tags['content_tag']!r}: ...}}",
        )
    role = value.get(tags["role_tag"])
    if role != tags["assistant"]:
        return Drop("answer_not_assistant", f"the {side} answer has role {role!r}, not {tags['assistant']!r}")
    return value


def _check_answer(parts: tuple[ReplyPart, ...], side: str) -> Drop | None:
    if not any(part.text.strip() for part in parts):
        return Drop("empty_assistant", f"the {side} answer is empty")
    if any(IMAGE_PLACEHOLDER in part.text for part in parts):
        return Drop(
            "image_in_assistant_turn",
            f"the {side} answer contains {IMAGE_PLACEHOLDER}; images belong in the prompt's user turns",
        )
    for part in parts:
        try:
            part.text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return Drop(
                "invalid_utf8",
                f"the {side} answer holds an unpaired surrogate {part.text[exc.start]!r} (a \\u escape of half a pair)",
            )
    return None


def normalize_pair(
    row: RowSource, fmt: RecordFormat, dataset_dir: Path, *, think_markers: bool = False
) -> Conversation | Drop:
    """A preference row as a :class:`Conversation` (prompt + chosen answer, ``rejected`` beside it),
    or the reason it cannot be used. ``fmt.pair_columns`` names the chosen and rejected columns."""
    if fmt.pair_columns is None:
        raise ValueError("normalize_pair needs a RecordFormat with pair_columns (training.stage: dpo)")
    record = row_record(row)
    if isinstance(record, Drop):
        return record
    column, tags = fmt.message_layout(record)

    messages: dict[str, dict] = {}
    answers: dict[str, tuple[ReplyPart, ...]] = {}
    for side, side_column in zip(SIDES, fmt.pair_columns, strict=True):
        message = _answer_message(record.get(side_column), side, side_column, tags)
        if isinstance(message, Drop):
            return message
        parts = reply_parts(message, f"the {side} answer", tags["content_tag"], fmt.reasoning, think_markers)
        if isinstance(parts, Drop):
            return parts
        problem = _check_answer(parts, side)
        if problem is not None:
            return problem
        messages[side], answers[side] = message, parts

    prompt = record.get(column)
    if not isinstance(prompt, list) or not prompt:
        return Drop("invalid_record", f"column {column!r} (the prompt) is missing or not a non-empty list")
    if isinstance(prompt[-1], dict):
        role = prompt[-1].get(tags["role_tag"])
        if role not in (tags["user"], fmt.observation):
            return Drop(
                "prompt_not_ending_with_user",
                f"the last message of {column!r} has role {role!r}; the prompt ends with the "
                f"{tags['user']!r} turn the answers reply to (the answers go in {fmt.pair_columns[0]!r} and "
                f"{fmt.pair_columns[1]!r})",
            )
    # The prompt with the chosen answer is an SFT conversation: read by the SFT reader, so that the
    # prompt's rules (roles, turn order, images) are the same; the rejected answer was read above.
    chosen_row = RowSource(row.index, {**record, column: [*prompt, messages["chosen"]]})
    conversation = normalize_record(chosen_row, fmt, dataset_dir, think_markers=think_markers)
    if isinstance(conversation, Drop):
        return conversation
    if answers["chosen"] == answers["rejected"]:
        return Drop("chosen_equals_rejected", "the chosen and rejected answers are the same text")
    conversation.rejected = answers["rejected"]
    return conversation
