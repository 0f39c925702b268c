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

The template works on token ids: text pieces are tokenized on their own and special ids are
inserted directly, which is what mistral-common does and avoids building and re-parsing
strings of thousands of ``[IMG]`` tokens.
"""

from __future__ import annotations

from .tokenizer import SpecialIds

#: The seed template's ``default_system`` (Magistral's reasoning instructions, as its model card
#: recommends them), character for character, trailing space included. ``[THINK]`` and
#: ``[/THINK]`` are written as text: the tokenizer maps them to their special ids, as the seed's
#: Hugging Face tokenizer does (unless ``split_special_tokens``).
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


def resolve_default_system(recipe_value: str | None) -> str:
    """The default system prompt a recipe asks for: unset (None) means the seed template's."""
    return MAGISTRAL_THINKING_PROMPT if recipe_value is None else recipe_value


def system_prompt(record_system: str | None, default_system: str) -> str | None:
    """The system prompt of a sample: its own, else the default; None (no block) when both are empty."""
    return record_system or default_system or None


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
