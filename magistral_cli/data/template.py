"""Chat template ``mistral``: Magistral's instruct format, as mistral-common encodes it.

``<s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user[/INST]assistant</s>[INST]user[/INST]assistant</s>``

- The system block appears only when there is a system prompt (from the record, else
  ``default_system``, else Magistral's thinking prompt when ``enable_thinking`` is set).
- A tool result (``observation`` role) is ``[TOOL_RESULTS]content[/TOOL_RESULTS]``, the
  layout of tokenizer v13 (Magistral-Small-2509's); the seed's LLaMA-Factory template wrapped
  it as ``{"content": ...}``, which mistral-common never produces.
- Every assistant turn ends with ``</s>``, which is trained on (it is part of the response).

The template works on token ids: text pieces are tokenized on their own and special ids are
inserted directly, which is what mistral-common does and avoids building and re-parsing
strings of thousands of ``[IMG]`` tokens.
"""

from __future__ import annotations

from .tokenizer import SpecialIds

#: The seed template's default system prompt (Magistral's reasoning instructions).
MAGISTRAL_THINKING_PROMPT = (
    "First draft your thinking process (inner monologue) until you arrive at a response. Format your "
    "response using Markdown, and use LaTeX for any mathematical equations. Write both your thoughts and "
    "the response in the same language as the input.\n"
    "Your thinking process must follow the template below:[THINK]Your thoughts or/and draft, like working "
    "through an exercise on scratch paper. Be as casual and as long as you want until you are confident to "
    "generate the response. Use the same language as the input.[/THINK]Here, provide a self-contained "
    "response. "
)

TEMPLATES = ("mistral",)


def check_template(name: str) -> None:
    from magistral_cli.errors import UserError

    if name not in TEMPLATES:
        raise UserError(
            f"template {name!r} is not supported; Magistral uses 'mistral' "
            "(data.dataset_param.basic_parameters.template=mistral)"
        )


def system_prompt(record_system: str | None, default_system: str | None, enable_thinking: bool) -> str | None:
    """The system prompt of a sample: its own, else the recipe's default, else the thinking prompt."""
    if record_system:
        return record_system
    if default_system:
        return default_system
    return MAGISTRAL_THINKING_PROMPT if enable_thinking else None


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


def response_ids(special: SpecialIds, content_ids: list[int]) -> list[int]:
    """An assistant turn: its text and ``</s>``."""
    return [*content_ids, special.eos]
