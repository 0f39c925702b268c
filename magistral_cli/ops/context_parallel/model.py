"""Mistral3 forward and loss under context parallelism.

The order matters and is the seed's:

1. token embeddings for the FULL sequence;
2. the vision tower and projector on every image, on every CP rank, whole, with CP
   communication forbidden (a replicated module must never join the sequence split);
3. image features merged into the embeddings (the merge indexes the whole sequence);
4. labels shifted on the full sequence (so a rank's last token is scored against the next
   rank's first), padding to the layout's multiple with ignored labels;
5. embeddings, global position ids (rotary embeddings need them) and shifted labels split;
6. the language model on the local part with the CP attention, no attention mask;
7. the local cross-entropy SUM divided by the GLOBAL count of non-ignored labels, summed over
   the CP group: exactly the CP=1 mean.

Gradients: a CP rank's parameter gradients come from that rank's tokens only (including the
embeddings and vision tower, whose full-sequence output is split by an ``index_select``);
the full gradient is their sum over the CP group. The loss reduction scales each rank's
backward by the CP degree, so the plain data-parallel AVERAGE over ``dp x cp`` (FSDP2's
default over the ``dp_cp`` mesh) gives exactly the CP=1 gradient: nothing to configure.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from magistral_cli.ops.attention import right_padding_problem
from magistral_cli.ops.context_parallel.attention import (
    bind_cp_groups,
    cp_attention_enabled,
    enable_cp_attention,
)
from magistral_cli.ops.context_parallel.comm import sum_across_ranks
from magistral_cli.ops.context_parallel.groups import (
    ContextParallelError,
    ContextParallelGroups,
    context_parallel,
    forbid_cp_communication,
)
from magistral_cli.ops.context_parallel.layout import (
    pad_position_ids,
    pad_sequence,
    padded_length,
    split_for_cp,
)

IGNORE_INDEX = -100

#: ``loss_fn(hidden [B, S_local, hidden], lm_head, labels [B, S_local] (already shifted),
#: num_items) -> sum of the local token losses / num_items``.
LossFn = Callable[[torch.Tensor, torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(hidden, lm_head, labels, num_items):
    """Plain cross entropy: fp32 logits of every local token, summed, over ``num_items``."""
    logits = lm_head(hidden).float()
    total = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / num_items


def shift_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``labels[:, 1:]`` with an ignored last position (the target of token ``t`` is ``t+1``)."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if attention_mask is not None:
        # Right padding: a target that is a padding token is not scored.
        shifted = shifted.masked_fill(F.pad(attention_mask[:, 1:], (0, 1), value=0) == 0, IGNORE_INDEX)
    return shifted


def validate_cp_batch(attention_mask: torch.Tensor | None) -> None:
    """Refuse what CP cannot keep exact: custom masks, packed-sample masks, left padding.

    The rule is ``ops.attention.right_padding_problem``, the one the trainer applies. The values
    of a mask on the CPU are checked here; a mask already on an accelerator gets the shape check
    only, since reading its values back would synchronise with the device on every micro-batch:
    its host copy must have been checked, as the trainer checks every micro-batch on the host
    (``validate_right_padding``) before moving it to the device.
    """
    problem = right_padding_problem(
        attention_mask, read_values=attention_mask is not None and attention_mask.device.type == "cpu"
    )
    if problem == "shape":
        raise ContextParallelError(
            f"context parallelism got a {attention_mask.ndim}-D attention mask; only a 2-D right-padding "
            "mask (or none) is supported, custom masks are not"
        )
    if problem == "values":
        raise ContextParallelError(
            "context parallelism got an attention mask with values other than 0 and 1 (packed-sample ids); "
            "it supports right-padding 0/1 masks (or none) only"
        )
    if problem == "left_padding":
        raise ContextParallelError(
            "context parallelism supports right padding only; the attention mask has padding before tokens"
        )


def check_cp_model(text_config, ulysses_size: int) -> None:
    """Errors before the first step for a model that Ulysses cannot split (a ``UserError``)."""
    heads = text_config.num_attention_heads
    if ulysses_size > 1 and heads % ulysses_size:
        raise ContextParallelError(
            f"Ulysses splits the attention heads over ulysses_parallel_size: {heads} heads do not divide "
            f"over {ulysses_size}; use a ulysses_parallel_size that divides {heads} (or ring_attention_size)"
        )


@dataclass
class ContextParallelOutput:
    loss: torch.Tensor  # summed over the CP group: equals the CP=1 loss
    local_loss: torch.Tensor  # this rank's share
    num_items: torch.Tensor  # the normaliser (non-ignored labels of the whole sequence)
    hidden_states: torch.Tensor  # this rank's last hidden states [B, S_local, hidden]
    seq_len: int
    padded_len: int


def context_parallel_forward(
    model,
    groups: ContextParallelGroups,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_sizes: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    loss_fn: LossFn | None = None,
) -> ContextParallelOutput:
    """Forward and loss of a ``Mistral3ForConditionalGeneration`` with the decoder split over CP.

    Every CP rank passes the same FULL batch. ``num_items_in_batch`` overrides the normaliser
    (e.g. a count over data parallelism and gradient accumulation); by default it is this
    batch's count of non-ignored shifted labels, identical on every CP rank.
    """
    if not cp_attention_enabled(model):
        raise ContextParallelError(
            "the language model does not use the context-parallel attention; call apply_context_parallel(model, "
            "groups) (or enable_cp_attention(model)) first"
        )
    validate_cp_batch(attention_mask)
    inner = model.model
    if hasattr(model, "embed_inputs"):
        # The trainer's model places the image features itself (and runs the tower on a blank
        # image for a text-only micro-batch, so every rank runs the same FSDP units in order).
        with forbid_cp_communication("the vision tower"):
            embeds = model.embed_inputs(input_ids, pixel_values, image_sizes)
    else:
        embeds = inner.get_input_embeddings()(input_ids)
    if pixel_values is not None and not hasattr(model, "embed_inputs"):
        with forbid_cp_communication("the vision tower"):
            image_outputs = inner.get_image_features(
                pixel_values=pixel_values,
                image_sizes=image_sizes,
                vision_feature_layer=model.config.vision_feature_layer,
                return_dict=True,
            )
        features = torch.cat(image_outputs.pooler_output, dim=0).to(embeds.device, embeds.dtype)
        mask = inner.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=features)
        embeds = embeds.masked_scatter(mask, features)

    batch, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=embeds.device).unsqueeze(0).expand(batch, -1)
    targets = shift_labels(labels, attention_mask)
    if num_items_in_batch is None:
        num_items = (targets != IGNORE_INDEX).sum().clamp_min(1)
    else:
        num_items = torch.as_tensor(num_items_in_batch, device=embeds.device)

    length = padded_length(seq_len, groups.ulysses_size, groups.ring_size)
    embeds = pad_sequence(embeds, length, dim=1)
    position_ids = pad_position_ids(position_ids, length)
    targets = pad_sequence(targets, length, dim=1, value=IGNORE_INDEX)

    local_embeds = split_for_cp(embeds, groups, dim=1)
    local_positions = split_for_cp(position_ids, groups, dim=position_ids.dim() - 1)
    local_targets = split_for_cp(targets, groups, dim=1)

    bind_cp_groups(model, groups)  # also for recomputation in backward (activation checkpointing)
    with context_parallel(groups):
        outputs = inner.language_model(
            inputs_embeds=local_embeds,
            position_ids=local_positions,
            attention_mask=None,
            use_cache=False,
        )
    hidden = outputs.last_hidden_state
    local_loss = (loss_fn or cross_entropy_loss)(hidden, model.lm_head, local_targets, num_items)
    loss = sum_across_ranks(local_loss, groups.cp_group)
    return ContextParallelOutput(
        loss=loss,
        local_loss=local_loss,
        num_items=num_items,
        hidden_states=hidden,
        seq_len=seq_len,
        padded_len=length,
    )


def apply_context_parallel(model, groups: ContextParallelGroups, loss_fn: LossFn | None = None):
    """Make ``model(...)`` run under CP: the CP attention for the language model, and the root
    ``forward`` replaced (on this instance) by :func:`context_parallel_forward`.

    Calling the root module keeps FSDP2's root hooks (lazy init, root unshard, post-backward)
    in play. The returned output has ``loss`` (equal to the CP=1 loss) and no logits.
    Call after ``fully_shard`` or before, either works. Returns ``model``.
    """
    from transformers.models.mistral3.modeling_mistral3 import Mistral3CausalLMOutputWithPast

    if groups.cp_size == 1:
        return model
    enable_cp_attention(model)

    def forward(
        self,
        input_ids=None,
        pixel_values=None,
        attention_mask=None,
        position_ids=None,
        labels=None,
        image_sizes=None,
        num_items_in_batch=None,
        use_cache=None,
        **kwargs,
    ):
        if input_ids is None or labels is None:
            raise ContextParallelError("a context-parallel forward needs input_ids and labels")
        if kwargs.get("inputs_embeds") is not None:
            raise ContextParallelError("a context-parallel forward takes input_ids, not inputs_embeds")
        out = context_parallel_forward(
            self,
            groups,
            input_ids=input_ids,
            labels=labels,
            pixel_values=pixel_values,
            image_sizes=image_sizes,
            attention_mask=attention_mask,
            position_ids=position_ids,
            num_items_in_batch=num_items_in_batch,
            loss_fn=loss_fn,
        )
        return Mistral3CausalLMOutputWithPast(loss=out.loss, logits=None)

    model._cp_original_forward = model.forward
    model.forward = types.MethodType(forward, model)
    return model


def remove_context_parallel(model, implementation: str = "sdpa"):
    """Undo :func:`apply_context_parallel`: the original ``forward`` and attention come back."""
    from magistral_cli.ops.context_parallel.attention import disable_cp_attention

    original = model.__dict__.pop("_cp_original_forward", None)
    if original is not None:
        model.__dict__.pop("forward", None)
    bind_cp_groups(model, None)
    disable_cp_attention(model, implementation)
    return model
