"""Chat template ``mistral``: Magistral's instruct format, as mistral-common encodes it.

``<s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user[/INST]assistant</s>[INST]user[/INST]assistant</s>``

- The system block holds the record's own system prompt, else the recipe's ``default_system``,
  which is, unless the recipe sets it, the seed template's default: Magistral's thinking prompt
  (as LLaMA-Factory's ``system or default_system``). So a sample without a system message gets
  the ~119-token thinking block, whatever ``enable_thinking`` says (the seed's template is not
  a reasoning template; that flag changes nothing there). ``default_system: ""`` removes it.
- A tool result (``observation`` role) is ``[TOOL_RESULTS]content[/TOOL_RESULTS]``, the
  layout of tokenizer v13 (Magistral-Small-2509's); the seed's LLaMA-Factory template wrapped
  it as ``{"content": ...}``, which mistral-common never produces.
- Every assistant turn ends with ``</s>``, which is trained on (it is part of the response).
- An assistant turn's reasoning is ``[THINK]reasoning[/THINK]`` before its text, with both markers
  as control tokens: mistral-common's ``ThinkChunk`` under tokenizer v13 (Magistral-Small-2509's),
  ``<s>[INST]user[/INST][THINK]reasoning[/THINK]answer</s>``. Whether it is trained on is the
  recipe's ``train_on_reasoning`` (the encoder masks the span's labels, markers included).

The template works on token ids: text pieces are tokenized on their own and special ids are
inserted directly, which is what mistral-common does and avoids building and re-parsing
strings of thousands of ``[IMG]`` tokens. Control tokens come from the template alone: a
control-token string in the data (``[INST]``) is plain text, as mistral-common encodes it,
unless the recipe sets ``split_special_tokens: false`` (the seed's setting; the encoder counts
such tokens for the report and drops a sample whose text would make an image token).
"""

from __future__ import annotations

import re

from .tokenizer import THINK_TOKENS, SpecialIds, TekkenTokenizer

#: The seed template's ``default_system`` (Magistral's reasoning instructions, as its model card
#: recommends them), character for character, trailing space included. Its ``[THINK]`` and
#: ``[/THINK]`` become their control tokens (``default_system_ids``), as in the seed's encoding and
#: in mistral-common's ``ThinkChunk``.
MAGISTRAL_THINKING_PROMPT = (
    "First draft your thinking process (inner monologue) until you arrive at a response. Format your "
    "response using Markdown, and use LaTeX for any mathematical equations. Write both your thoughts and "
    "the response in the same language as the input.\n"
    "Your thinking process must follow the template below:[THINK]Your thoughts or/and draft, like working "
    "through an exercise on scratch paper. Be as casual and as long as you want until you are confident to "
    "generate the response. Use the same language as the input.[/THINK]Here, provide a self-contained "
    "response. "
)


def resolve_default_system(recipe_value: str | None) -> str:
    """The default system prompt a recipe asks for: unset (None) means the seed template's."""
    return MAGISTRAL_THINKING_PROMPT if recipe_value is None else recipe_value


_THINK_SPLIT = re.compile(r"(\[/?THINK\])")


def default_system_ids(tokenizer: TekkenTokenizer, default_system: str) -> list[int] | None:
    """Ids of the default system prompt (a sample without a system message gets it); None for "".

    It is the recipe's text, not the data's: its text is plain text (mistral-common's
    ``TextChunk``) whatever ``split_special_tokens`` says, and ``[THINK]`` ... ``[/THINK]`` are
    the control tokens of a ``ThinkChunk`` when the vocabulary has them (tokenizer v13,
    Magistral-Small-2509's). With an older vocabulary the markers are text like the rest.
    """
    if not default_system:
        return None
    if tokenizer.think_ids is None:
        return tokenizer.encode_as_text(default_system)
    markers = dict(zip(THINK_TOKENS, tokenizer.think_ids, strict=True))
    ids: list[int] = []
    for piece in _THINK_SPLIT.split(default_system):
        if piece in markers:
            ids.append(markers[piece])
        elif piece:
            ids += tokenizer.encode_as_text(piece)
    return ids


def prefix_ids(special: SpecialIds, system_ids: list[int] | None) -> list[int]:
    """``<s>`` and the system block: the start of the first turn's prompt."""
    ids = [special.bos]
    if system_ids is not None:
        ids += [special.system, *system_ids, special.system_end]
    return ids


def prompt_ids(special: SpecialIds, role: str, content_ids: list[int]) -> list[int]:
    """A user turn ``[INST]...[/INST]`` or a tool result ``[TOOL_RESULTS]...[/TOOL_RESULTS]``."""
    if role == "observation":
        return [special.tool_results, *content_ids, special.tool_results_end]
    return [special.inst, *content_ids, special.inst_end]


def reasoning_ids(think_ids: tuple[int, int], content_ids: list[int]) -> list[int]:
    """An assistant turn's reasoning: ``[THINK]reasoning[/THINK]`` (a closed ``ThinkChunk``)."""
    begin, end = think_ids
    return [begin, *content_ids, end]


def response_ids(special: SpecialIds, content_ids: list[int]) -> list[int]:
    """An assistant turn: its reasoning and text, and ``</s>``."""
    return [*content_ids, special.eos]
