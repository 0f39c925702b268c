"""Chatting with a checkpoint: ``magistral generate``.

One job per module: :mod:`.source` finds what ``--model`` names (an HF directory, a run or
training checkpoint, adapters) and loads it, :mod:`.prompt` encodes a conversation and its images
into the ids training would have seen before the answer, :mod:`.run` generates (one conversation,
or a batch from ``--input`` into ``--output``) and holds the result records.
"""

from magistral_cli.generate.prompt import EncodedPrompt, PromptEncoder
from magistral_cli.generate.run import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    Completion,
    Generator,
    SamplingOptions,
    generate_batch,
    load_generator,
    read_conversations,
)
from magistral_cli.generate.source import (
    DEVICES,
    DTYPE_CHOICES,
    ModelSource,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_source,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "DEVICES",
    "DTYPE_CHOICES",
    "Completion",
    "EncodedPrompt",
    "Generator",
    "ModelSource",
    "PromptEncoder",
    "SamplingOptions",
    "generate_batch",
    "load_generator",
    "load_model",
    "read_conversations",
    "resolve_device",
    "resolve_dtype",
    "resolve_source",
]
