"""The model the engine trains: transformers' Mistral3, adapted for training, not forked.

Two adaptations, both small:

- ``Mistral3ForTraining`` keeps every module and key of ``Mistral3ForConditionalGeneration``
  and replaces only ``forward``: it returns the **sum** of the token cross entropies (the trainer
  normalises over the global batch), computed inside the output head so that, under FSDP2, the
  head's weight is gathered once and the chunked loss can use it without full logits.
- ``LossHead`` is the output ``nn.Linear`` with a second mode: called with labels it returns the
  loss sum (``ops.chunked_loss``). It is swapped in by class, so parameter names stay
  ``lm_head.weight``.

``build_model`` creates the model on the meta device (no memory, no init) when asked;
``materialize`` allocates the (sharded) parameters on the device and recomputes the rotary
buffers, which the meta build could not compute.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn
from transformers import Mistral3ForConditionalGeneration

from magistral_cli.errors import UserError
from magistral_cli.model_config import apply_tying_rule, read_model_config
from magistral_cli.ops.chunked_loss import cross_entropy_sum
from magistral_cli.ops.packed_attention import is_packed_attention


class LossHead(nn.Linear):
    """``nn.Linear`` that returns the cross-entropy sum when given labels (chunked when ``chunk_size`` is set)."""

    chunk_size: int | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        token_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        if self.bias is not None:
            raise ValueError("the chunked loss head does not support a bias")
        return cross_entropy_sum(hidden, self.weight, labels, self.chunk_size, token_weights)


def loss_head_sum(hidden, lm_head, labels, num_items):
    """The context-parallel loss function: the trainer's loss head (chunked when
    ``features.enable_chunk_loss``) on this rank's hidden states and shifted labels."""
    return lm_head(hidden, labels) / num_items


def install_loss_head(model: nn.Module, module_name: str, chunk_size: int | None) -> nn.Module:
    """Turn the output projection ``module_name`` into a ``LossHead`` (same parameters, same keys)."""
    modules = dict(model.named_modules())
    head = modules.get(module_name)
    if module_name != "lm_head" or not isinstance(head, nn.Linear):
        raise UserError(
            f"features.chunkloss_plan.apply_module {module_name!r} is not a Linear module of the model; "
            "use 'lm_head'"
        )
    head.__class__ = LossHead
    head.chunk_size = chunk_size
    return head


class Mistral3ForTraining(Mistral3ForConditionalGeneration):
    """``Mistral3ForConditionalGeneration`` whose forward returns the loss sum over target tokens."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        sample_weights: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        seq_ends: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """The (weighted) sum of the token losses.

        ``sample_weights`` ``[B]`` weighs every token of a row, ``[B, L - 1]`` every target.
        ``cu_seqlens`` / ``max_seqlen`` / ``seq_ends`` (``ops.packed_attention.packed_inputs``)
        are a packed batch's attention segments; they need the packed attention
        (``resolve_attention(..., packed=True)``), which is refused otherwise.
        """
        packed = {}
        if cu_seqlens is not None:
            if not is_packed_attention(self.config.text_config._attn_implementation):
                raise ValueError(
                    "a packed batch (cu_seqlens) needs the packed attention; build the model with "
                    "resolve_attention(..., packed=True)"
                )
            packed = {
                "cu_seq_lens_q": cu_seqlens,
                "cu_seq_lens_k": cu_seqlens,
                "max_length_q": max_seqlen,
                "max_length_k": max_seqlen,
                "packed_seq_ends": seq_ends,
            }
            # The segments say everything; a 2D padding mask would only be ignored.
            attention_mask = None
        inputs_embeds = None
        if pixel_values is None:
            # Every rank must run the same FSDP units in the same order, or the all-gathers
            # deadlock when only some ranks' micro-batches hold images. A text-only micro-batch
            # runs the vision tower on one blank image where an image batch would (after the
            # token embedding, before the decoder) and adds 0 x its output.
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
            blank = self._blank_image_features(inputs_embeds)
            inputs_embeds = inputs_embeds + 0.0 * blank.to(inputs_embeds.dtype)
        outputs = self.model(
            input_ids=input_ids if inputs_embeds is None else None,
            inputs_embeds=inputs_embeds,
            pixel_values=pixel_values,
            attention_mask=attention_mask,
            position_ids=position_ids,
            image_sizes=image_sizes,
            use_cache=False,
            **packed,
        )
        hidden = outputs.last_hidden_state
        # Position i predicts token i + 1: labels arrive aligned with input_ids, unshifted.
        targets = labels[:, 1:]
        weights = None
        if sample_weights is not None:
            weights = sample_weights.to(torch.float32)
            weights = weights[:, None].expand(targets.shape) if weights.ndim == 1 else weights
        return self.lm_head(hidden[:, :-1], targets, weights)

    def _blank_image_features(self, like: torch.Tensor) -> torch.Tensor:
        # Two image tokens, not one: transformers squeezes a single-token image batch to 1D.
        side = self.model.vision_tower.patch_size * self.config.spatial_merge_size
        pixels = torch.zeros(1, 3, side, 2 * side, device=like.device, dtype=torch.float32)
        sizes = torch.tensor([[side, 2 * side]], device=like.device)
        features = self.model.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True)
        return torch.cat(features.pooler_output, dim=0).float().sum()


def load_model_config(model_dir: str | Path, trust_remote_code: bool = False):
    """The ``Mistral3Config`` in ``model_dir/config.json`` (tying rule applied, KV cache off)."""
    config = read_model_config(
        model_dir, trust_remote_code=trust_remote_code, what="model.model_name_or_path"
    )
    config.use_cache = False
    config.text_config.use_cache = False
    return config


def build_model(config, *, meta: bool, attn_implementation: str) -> Mistral3ForTraining:
    """The fp32 model, on the meta device when ``meta`` (parameters get storage in ``materialize``)."""
    apply_tying_rule(config)
    device = torch.device("meta") if meta else contextlib.nullcontext()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # master weights are fp32; FSDP casts for compute
    try:
        with device:
            model = Mistral3ForTraining(config)
    finally:
        torch.set_default_dtype(default_dtype)
    # The vision tower keeps sdpa (block-diagonal per-image mask); ops.vision_attention adapts
    # it for the flash kernels on CUDA / NPU.
    model.set_attn_implementation({"text_config": attn_implementation, "vision_config": "sdpa"})
    model.train()
    return model


def buffer_owners(model: nn.Module) -> list[nn.Module]:
    """Modules that own buffers (the rotary embeddings of the decoder and of the vision tower)."""
    return [m for m in model.modules() if any(True for _ in m.buffers(recurse=False))]


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give the meta (sharded) parameters storage on ``device`` and recompute the buffers.

    Parameter values are left uninitialised: loading fills them. Buffers are not in checkpoints
    (the rotary inverse frequencies are non-persistent), so transformers' own initialiser
    recomputes them from the config.
    """
    model.to_empty(device=device)
    with torch.no_grad():
        for module in buffer_owners(model):
            model._init_weights(module)
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point() and not torch.isfinite(buf).all():
                    raise RuntimeError(f"buffer {name} of {type(module).__name__} was not initialised")


@contextlib.contextmanager
def output_capture_survives_wrapping(model: nn.Module):
    """Keep transformers' output capture working on modules whose class ``fully_shard`` replaces.

    transformers records hidden states (Mistral3 reads the vision tower's through them) with
    hooks it installs lazily, looked up by the *name of the module's class*; FSDP2 swaps each
    wrapped module's class for an ``FSDP<Name>`` subclass. Install the hooks before wrapping and
    register the same capture flags under the new class names after.
    """
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, install_all_output_capturing_hooks

    flags = {m: _CAN_RECORD_REGISTRY.get(m) for m in model.modules()}
    flags = {m: spec for m, spec in flags.items() if spec}
    # One installation from the root covers every sub-model; mark them so none installs twice.
    install_all_output_capturing_hooks(model)
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module._output_capturing_hooks_installed = True
    yield
    for module, spec in flags.items():
        _CAN_RECORD_REGISTRY[module] = spec
