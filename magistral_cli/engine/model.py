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
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import Mistral3ForConditionalGeneration

from magistral_cli.errors import UserError
from magistral_cli.model_config import apply_tying_rule, parameter_counts, read_model_config
from magistral_cli.ops.causal_attention import causal_attention_name
from magistral_cli.ops.chunked_loss import cross_entropy_sum
from magistral_cli.ops.packed_attention import is_packed_attention
from magistral_cli.ops.preference_loss import token_logps

log = logging.getLogger("magistral_cli.engine")


class LossHead(nn.Linear):
    """``nn.Linear`` that returns the cross-entropy sum when given labels (chunked when ``chunk_size`` is set)."""

    chunk_size: int | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        token_weights: torch.Tensor | None = None,
        logps: bool = False,
        sequence_ids: torch.Tensor | None = None,
        num_sequences: int | None = None,
    ) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        if self.bias is not None:
            raise ValueError("the chunked loss head does not support a bias")
        if logps:
            # Preference training: each row's summed target log-probabilities, chunked the same way
            # (a new tensor, not a view: FSDP2 hooks the module's output for the backward); in a neat
            # pack each sequence's (``sequence_ids``: the sequence of every target, of ``num_sequences``).
            tokens = token_logps(hidden, self.weight, labels, self.chunk_size)
            if sequence_ids is None:
                return tokens.sum(dim=-1)
            out = torch.zeros(num_sequences, dtype=tokens.dtype, device=tokens.device)
            return out.index_add(0, sequence_ids.reshape(-1), tokens.reshape(-1))
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

    #: Whether a text-only micro-batch runs the vision tower on one blank image
    #: (``embed_inputs``); the trainer turns it off where nothing needs it
    #: (``blank_vision_forward_needed``).
    blank_vision_forward: bool = True

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
        sequence_logps: bool = False,
        sequence_ids: torch.Tensor | None = None,
        num_sequences: int | None = None,
    ) -> torch.Tensor:
        """The (weighted) sum of the token losses; with ``sequence_logps`` each row's summed target
        log-probabilities ``[B]`` instead (preference training), or in a neat pack each sequence's
        ``[num_sequences]``: ``sequence_ids`` ``[B, L - 1]`` names the sequence of every target
        (``data.collator.PairLayout``).

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
        # No padding mask reaches the decoder: the trainer checked on the host that every row is
        # right-padded (``validate_right_padding``), and under causal attention a real token only
        # attends to earlier real tokens, so the mask changes nothing that has a target. Without
        # it SDPA runs its causal flash kernel (a mask forces the slower masked kernels) and
        # transformers needn't read the mask back from the device to decide that it could skip it.
        attention_mask = None
        if cu_seqlens is None:
            # One sample per row: its positions are 0..L-1 (``sequential_positions``, checked on
            # the host), which is what the decoder uses without them. Given, transformers would
            # read them back from the device to look for packed samples.
            position_ids = None
        inputs_embeds = self.embed_inputs(input_ids, pixel_values, image_sizes)
        outputs = self.model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **packed,
        )
        hidden = outputs.last_hidden_state
        # Position i predicts token i + 1: labels arrive aligned with input_ids, unshifted.
        targets = labels[:, 1:]
        if sequence_logps:
            if sample_weights is not None or (cu_seqlens is not None) != (sequence_ids is not None):
                raise ValueError(
                    "sequence_logps needs an unweighted batch, and sequence_ids exactly when it is packed"
                )
            return self.lm_head(
                hidden[:, :-1], targets, logps=True, sequence_ids=sequence_ids, num_sequences=num_sequences
            )
        weights = None
        if sample_weights is not None:
            weights = sample_weights.to(torch.float32)
            weights = weights[:, None].expand(targets.shape) if weights.ndim == 1 else weights
        return self.lm_head(hidden[:, :-1], targets, weights)

    def embed_inputs(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_sizes: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder's input embeddings, with the projected image features at the image tokens.

        What ``Mistral3Model.forward`` does before its decoder, done here for three reasons:

        - transformers 5.17-5.22 read the tower's output through output-capture hooks that
          ``fully_shard`` (which renames the tower's class) disconnects; the tower's
          ``last_hidden_state`` is the same tensor as ``hidden_states[-1]`` (Pixtral has no final
          norm), so the default ``vision_feature_layer: -1`` needs no capture at all;
        - no host synchronisation: transformers reads ``image_sizes`` back from the device and
          checks the image-token count with a device value; here ``image_sizes`` stays a host
          tensor (the trainer keeps it on the CPU) and the count was checked on the host when the
          batch was built (``data.collator``; ``check_image_tokens`` in the trainer);
        - every rank runs the same FSDP units in the same order, or the all-gathers deadlock
          when only some ranks' micro-batches hold images: a text-only micro-batch runs the
          vision tower on one blank image where an image batch would (after the token
          embedding, before the decoder) and adds 0 x its output, unless
          ``blank_vision_forward`` is off (``blank_vision_forward_needed`` says when).
        """
        embeds = self.model.get_input_embeddings()(input_ids)
        if pixel_values is None:
            if not self.blank_vision_forward:
                return embeds
            blank = self._blank_image_features(embeds)
            return embeds + 0.0 * blank.to(embeds.dtype)
        features = self.image_features(pixel_values, image_sizes).to(embeds.device, embeds.dtype)
        mask = (input_ids == self.config.image_token_id).unsqueeze(-1)
        return embeds.masked_scatter(mask, features)

    def image_features(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None) -> torch.Tensor:
        """The projected features of every image, concatenated: ``[image tokens, hidden]``."""
        layer = self.config.vision_feature_layer
        if layer == -1:
            selected = self.model.vision_tower(pixel_values, image_sizes=image_sizes).last_hidden_state
            return self.model.multi_modal_projector(selected.squeeze(0), image_sizes)
        # Another layer (or several): transformers' own selection through its output capture.
        outputs = self.model.get_image_features(
            pixel_values=pixel_values, image_sizes=image_sizes, vision_feature_layer=layer, return_dict=True
        )
        return torch.cat(outputs.pooler_output, dim=0)

    def _blank_image_features(self, like: torch.Tensor) -> torch.Tensor:
        # Two image tokens, not one: transformers squeezes a single-token image batch to 1D.
        side = self.model.vision_tower.patch_size * self.config.spatial_merge_size
        pixels = torch.zeros(1, 3, side, 2 * side, device=like.device, dtype=torch.float32)
        sizes = torch.tensor([[side, 2 * side]])  # a host tensor: Pixtral only slices with it
        return self.image_features(pixels, sizes).float().sum()


def blank_vision_forward_needed(model: nn.Module, *, fsdp_world: int, images_possible: bool) -> bool:
    """Whether text-only micro-batches must still run the vision tower on a blank image.

    The blank forward does two things. It keeps FSDP's collectives in step across ranks when
    some ranks' micro-batches hold images and others' do not: not needed when the model is
    sharded over one rank (``fsdp_world`` 1: no collective), nor when no micro-batch of the
    run can hold an image (``images_possible``, which every rank decides from the same
    data). And it gives a trainable tower or projector a zero gradient on a text-only step,
    which AdamW's weight decay then acts on: so a tower or projector with any trainable
    parameter (unfrozen, or with LoRA adapters) keeps it, and training means what it did.
    Otherwise the frozen tower's blank forward is pure cost: a forward of every vision layer
    and, under FSDP2, an all-gather of its weights, every micro-batch.
    """
    inner = model.model
    vision = [inner.vision_tower, inner.multi_modal_projector]
    if any(p.requires_grad for module in vision for p in module.parameters()):
        return True
    return fsdp_world > 1 and images_possible


def check_image_tokens(config, input_ids: torch.Tensor, image_sizes: torch.Tensor | None) -> None:
    """A host micro-batch's image tokens match its images' feature count (no device value read).

    Each image of ``(height, width)`` pixels gives ``(height // patch // merge) x (width // patch
    // merge)`` features; placing them needs exactly that many image tokens in ``input_ids``.
    """
    tokens = int((input_ids == config.image_token_id).sum())
    features = 0
    if image_sizes is not None:
        step = config.vision_config.patch_size * config.spatial_merge_size
        features = sum((int(h) // step) * (int(w) // step) for h, w in image_sizes.tolist())
    if tokens != features:
        raise ValueError(
            f"the micro-batch has {tokens} image tokens for {features} image features; "
            "re-run magistral preprocess (image tokens must never be cut)"
        )


def sequential_positions(position_ids: torch.Tensor) -> bool:
    """Whether every row of a host ``position_ids`` is ``0..L-1`` (an unpacked micro-batch's)."""
    expected = torch.arange(position_ids.shape[-1], dtype=position_ids.dtype)
    return bool((position_ids == expected).all())


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
    # Unpacked batches: the same kernel without transformers' mask building (ops.causal_attention).
    text = (
        attn_implementation
        if is_packed_attention(attn_implementation)
        else causal_attention_name(attn_implementation)
    )
    model.set_attn_implementation({"text_config": text, "vision_config": "sdpa"})
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

    # The registry is keyed by str(class) in every transformers 5.x; 5.23 made it a dict subclass
    # whose get / [] take the model instead. The plain dict methods read and write the same
    # entries in both, so this works on every supported version.
    def flags_of(module):
        return dict.get(_CAN_RECORD_REGISTRY, str(type(module)))

    flags = {m: flags_of(m) for m in model.modules()}
    flags = {m: spec for m, spec in flags.items() if spec}
    # One installation from the root covers every sub-model; mark them so none installs twice.
    install_all_output_capturing_hooks(model)
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module._output_capturing_hooks_installed = True
    yield
    for module, spec in flags.items():
        dict.__setitem__(_CAN_RECORD_REGISTRY, str(type(module)), spec)


def log_parameter_counts(model: nn.Module, lora) -> None:
    """Log the trainable and total parameters (a tied head counted once), as the launch shows them;
    ``lora`` is ``engine.lora.LoraApplied`` or None (full fine-tuning)."""
    counts = parameter_counts(model)
    total, trainable = counts["total"], counts["trainable"]
    what = (
        f"LoRA r={lora.spec.r} on {len(lora.targets.modules)} Linear layers"
        if lora is not None
        else "full fine-tuning"
    )
    log.info(
        "trainable parameters: %s of %s (%.2f%%; %s)",
        f"{trainable:,}",
        f"{total:,}",
        100.0 * trainable / max(total, 1),
        what,
    )
