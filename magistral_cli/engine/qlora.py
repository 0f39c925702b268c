"""QLoRA (``model.lora.quantize_base: nf4``): the frozen Linear weights of the decoder in 4-bit NF4.

**Library.** torchao's ``NF4Tensor`` (``to_nf4``): the QLoRA paper's 4-bit NormalFloat with per-block
absmax scales (``quantize_block_size``, 64) that are themselves quantised to 8 bits per block of
scales (``quantize_scaler_block_size``, 256) around their mean. It is a tensor subclass, so the
model stays transformers' own: ``nn.Linear.forward`` calls ``F.linear``, which ``NF4Tensor``
routes to its autograd function (dequantise, matmul; in the backward dequantise again for the
input gradient, no weight gradient). PEFT's ``lora.Linear`` wraps the Linear as for LoRA: only its
``base_layer.weight`` changes type. ``NF4Tensor`` implements FSDP2's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, so ``fully_shard`` shards it on dim 0 and all-gathers the 4-bit data
(torchtune does the same); no full bf16 copy of the base exists at any time.

**What is quantised.** Every ``nn.Linear`` of the ``quantize_apply_to`` parts (default the language
model: its decoder layers' projections) whose weight is frozen after :func:`engine.lora.apply_lora`
(the adapted layers' ``base_layer`` and any projection left without adapters); the adapters, the
norms, the embeddings, the lm_head and the other parts stay in ``param_dtype``. A weight is quantisable only when its element count
divides by ``block x scaler_block x shards`` (the FSDP group size: each rank's shard must hold
whole blocks of scales) and its rows by ``shards`` (no padding): :func:`layout_problem`. The rule
is checked for every weight before anything is built, and a weight that breaks it is an error
naming the sizes that would fit, never a silent bf16 fallback (that would change the model with
the world size). Magistral-Small-2509's widths (5120, 4096, 1024, 32768) fit 64 x 256 on any group
size dividing 64 (its k/v projections hold 320 scale blocks); the tiny test model needs
``quantize_scaler_block_size: 16``.

**Loading** (:func:`load_nf4_`). The model is built on the meta device, quantised (meta
``NF4Tensor``), sharded and materialised; the loader then reads each quantised weight whole from
the HF files or the DCP checkpoint (one parameter at a time: host memory never holds more than one
bf16 weight), quantises it on the rank's device and keeps this rank's dim-0 chunk. The whole
tensor is quantised, not the shard: NF4's scale mean is the tensor's, so the values do not depend
on the world size, and a resume on another world size dequantises to the same base.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from magistral_cli.errors import UserError

log = logging.getLogger(__name__)

#: torchao's NF4 module: its home from 0.18, then its path in 0.17 (the lowest supported; both tested).
NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")
#: The NF4 tensor's parts (``NF4Tensor.__tensor_flatten__``): the first three are dim-0 chunks that
#: FSDP2 shards and all-gathers; the scale mean and the 16-value code book are per tensor and every
#: shard carries them whole.
SHARDED_PARTS = ("quantized_scalers", "quantization_factor", "quantized_data")
WHOLE_PARTS = ("scaler_mean", "nf4")


def nf4_module():
    """torchao's NF4 module (``to_nf4``, ``NF4Tensor``), imported on first use (its import-time log lines
    are quieted when this package is imported); a UserError naming the install line when torchao is
    missing or too old."""
    import importlib

    from magistral_cli.versions import OPTIONAL_VERSIONS, optional_problem

    problem = optional_problem("torchao")
    if problem:
        raise UserError(problem)
    for name in NF4_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    install = OPTIONAL_VERSIONS["torchao"][2]
    raise UserError(f"this torchao has no NF4 tensor ({' or '.join(NF4_MODULES)}); run {install}")


def is_nf4(tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) is an NF4 tensor; never imports torchao."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


# --------------------------------------------------------------------------- which weights


def layout_problem(shape: tuple[int, ...], block: int, scaler_block: int, shards: int) -> str | None:
    """Why a weight of ``shape`` cannot be NF4 under ``shards``-way FSDP2, or None when it can."""
    numel = math.prod(shape)
    unit = block * scaler_block * shards
    if len(shape) != 2:
        return f"is {len(shape)}-D (NF4 weights are 2-D)"
    if numel % unit:
        return (
            f"has {numel:,} elements, not a multiple of quantize_block_size x quantize_scaler_block_size x "
            f"{shards} FSDP ranks = {block} x {scaler_block} x {shards}"
        )
    if shape[0] % shards:
        return f"has {shape[0]} rows, not a multiple of the {shards} FSDP ranks"
    return None


def fitting_scaler_blocks(shapes: list[tuple[int, ...]], block: int, shards: int) -> list[int]:
    """The scaler block sizes (powers of two up to 256) with which every shape is quantisable."""
    sizes = [2**i for i in range(9)]
    return [s for s in sizes if all(layout_problem(shape, block, s, shards) is None for shape in shapes)]


def quantize_targets(model: nn.Module, parts=("language_model",)) -> list[tuple[str, nn.Linear]]:
    """The Linear layers with a frozen weight in the ``parts`` (``quantize_apply_to``; their modules are
    ``config.schema.LORA_SCOPES``'), in model order; run after ``apply_lora`` (which froze the base).
    The language model's only Linear layers are its decoder layers' projections (the lm_head is outside)."""
    from magistral_cli.config.schema import LORA_SCOPES

    scopes = tuple(LORA_SCOPES[part] + "." for part in parts)
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith(scopes) and not module.weight.requires_grad
    ]


@dataclass
class QuantizedBase:
    """What :func:`quantize_base_` did, for the log, the memory plan and the tests."""

    modules: list[str]
    numel: int
    block: int
    scaler_block: int

    @property
    def nbytes(self) -> int:
        """The NF4 storage: 4 bits a value, an int8 scale a block, a quantisation factor (the
        weight's dtype, 2 or 4 bytes: counted as 4) a block of scales."""
        return nf4_bytes(self.numel, self.block, self.scaler_block)


def nf4_bytes(numel: int, block: int = 64, scaler_block: int = 256) -> int:
    """Bytes of ``numel`` NF4 values: ``numel / 2 + numel / block + 4 numel / (block x scaler_block)``."""
    return numel // 2 + numel // block + 4 * (numel // (block * scaler_block))


def check_layout(
    targets: list[tuple[str, tuple[int, ...]]], block: int, scaler_block: int, shards: int
) -> None:
    """A UserError naming the first weight ``layout_problem`` refuses and the block sizes that would fit."""
    for name, shape in targets:
        problem = layout_problem(shape, block, scaler_block, shards)
        if problem is None:
            continue
        fits = fitting_scaler_blocks([s for _, s in targets], block, shards)
        fix = (
            f"set model.lora.quantize_scaler_block_size to {fits[-1]} (it fits every quantised weight)"
            if fits
            else "change the FSDP group size or quantize_block_size"
        )
        raise UserError(
            f"model.lora.quantize_base: nf4: {name}.weight {tuple(shape)} {problem}; {fix}, or set "
            "model.lora.quantize_base: none"
        )


def checked_targets(model: nn.Module, spec, shards: int) -> list[tuple[str, nn.Linear]]:
    """``quantize_targets`` of ``spec`` (``model.lora``), each weight checked against the layout rule
    for ``shards`` FSDP ranks (``check_layout``); the trainer and the memory plan share it."""
    targets = quantize_targets(model, spec.quantize_apply_to)
    check_layout(
        [(n, tuple(m.weight.shape)) for n, m in targets],
        spec.quantize_block_size,
        spec.quantize_scaler_block_size,
        shards,
    )
    return targets


def quantize_base_(model: nn.Module, spec, shards: int) -> QuantizedBase | None:
    """Replace the frozen Linear weights of the quantised parts by NF4 tensors (in place, meta or real), before FSDP2.

    ``spec`` is ``model.lora`` (None or ``quantize_base: none``: nothing done); ``shards`` the FSDP
    group size. On the meta device the NF4 tensors are meta too: the loader fills them.
    """
    if spec is None or spec.quantize_base == "none":
        return None
    targets = checked_targets(model, spec, shards)
    if not targets:
        raise UserError(
            f"model.lora.quantize_base: nf4 found no frozen Linear layer in {', '.join(spec.quantize_apply_to)} "
            "(model.lora.quantize_apply_to); set model.lora.quantize_base: none"
        )
    block, scaler_block = spec.quantize_block_size, spec.quantize_scaler_block_size
    nf4 = nf4_module()
    numel = 0
    with torch.no_grad():
        for _, module in targets:
            weight = module.weight
            numel += weight.numel()
            module.weight = nn.Parameter(
                nf4.to_nf4(weight.detach(), block, scaler_block), requires_grad=False
            )
    done = QuantizedBase([n for n, _ in targets], numel, block, scaler_block)
    log.info(
        "QLoRA: %d frozen Linear weights in NF4 (%d parameters, %.2f GiB; blocks %d x %d)",
        len(targets),
        numel,
        done.nbytes / (1 << 30),
        block,
        scaler_block,
    )
    return done


# --------------------------------------------------------------------------- loading


@torch.no_grad()
def load_nf4_(local: torch.Tensor, rows: slice, full: torch.Tensor) -> None:
    """Quantise the whole weight ``full`` and put the dim-0 chunk ``rows`` into ``local`` (an NF4
    parameter or a DTensor's NF4 shard: ``weights.local_slices``), on ``local``'s device.

    ``full`` is cast to the NF4 tensor's dtype (the frozen dtype) on the device first; every part is
    copied in place (``local`` may belong to a state dict's detached alias of the parameter).
    """
    nf4 = nf4_module()
    quantized = nf4.to_nf4(
        full.to(device=local.device, dtype=local.dtype).contiguous(),
        local.block_size,
        local.scaler_block_size,
    )
    count = local.shape[0]
    if count == 0:
        return
    chunk = torch.chunk(quantized, full.shape[0] // count, dim=0)[rows.start // count]
    for part in SHARDED_PARTS + WHOLE_PARTS:
        getattr(local, part).copy_(getattr(chunk, part))


def materialize_nf4_(model: nn.Module, device: torch.device) -> int:
    """Give the meta NF4 weights' per-tensor parts storage on ``device`` (after ``materialize``).

    ``to_empty`` allocates the sharded parts (``NF4Tensor``'s ``empty_like``) but leaves the scale
    mean and the code book on the meta device; the loader copies into all five in place (a state
    dict's detached tensors share them). Returns the weights done; a model without NF4 is untouched.
    """
    count = 0
    for param in model.parameters():
        if not is_nf4(param):
            continue
        local = getattr(param, "_local_tensor", param)
        for part in WHOLE_PARTS:
            value = getattr(local, part)
            if value.is_meta:
                setattr(local, part, torch.empty_like(value, device=device))
        count += 1
    return count
