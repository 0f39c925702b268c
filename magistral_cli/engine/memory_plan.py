"""The memory plan: what one rank will allocate, estimated from the recipe before anything starts.

``magistral train RECIPE --dry-run`` builds the recipe's model on the meta device (no memory),
reads off the parameter shapes, the FSDP2 units, the frozen modules and the decoder's shape, and
:func:`estimate` turns them into per-rank byte counts. Everything below models what the engine
really allocates; each formula says where the bytes come from.

Notation: ``p`` bytes per element of ``fsdp_plan.param_dtype`` (the all-gathered compute copy;
fp32 when unset), ``r`` of ``reduce_dtype``, ``W`` the FSDP group size (dp x cp), ``T`` the
tokens of one micro-batch on one rank (``micro_batch_size x cutoff_len / cp``; ``training.stage:
dpo`` counts 2 sequences per pair), ``N = T - rows`` the tokens whose next token is predicted, ``V`` the vocabulary, ``H`` the hidden size.

Persistent, on the device (per rank, the largest rank: FSDP2 gives every rank
``ceil(dim0 / W)`` rows of each parameter, padded, so rank 0's shard is the largest):

- **parameter shards**: fp32 master weights (``build_model`` builds in fp32), frozen ones included:
  ``4 x sum ceil(dim0 / W) x rest``.
- **reference model shards** (``training.stage: dpo`` with a reference model beside the policy):
  every base parameter's shard in ``p`` bytes; none for the LoRA base (adapters off), orpo, simpo, or
  with ``training.dpo.precompute_ref`` (the pass before training holds it while no gradient, optimizer
  state or activation for the backward exists yet; training holds none).
- **gradient shards**: FSDP2 reduce-scatters into one flat buffer per unit in the parameters'
  dtype (fp32), trainable parameters only: ``4 x trainable shard``.
- **optimizer states**: AdamW's ``exp_avg`` and ``exp_avg_sq``, fp32: ``8 x trainable shard``.
  With ``adamw_swap`` they live in host memory; on the device only the chunk being updated
  (``AdamWSwap`` streams chunks of >= 256 MiB of parameters: 2 x the largest chunk, computed
  from the real parameter order).

Transient, on the device, in three phases (the peak is the largest phase):

1. **loss** (the start of the last micro-batch's backward): the saved activations of every
   layer and the loss head's logits are alive together.
2. **backward** (its end): every gradient shard exists, the activations are gone except one
   layer's, which is recomputed (recompute) or still saved, plus its gradient temporaries.
3. **optimizer step**: parameters, gradients, states and the optimizer's temporaries.

- **all-gather buffers**: each unit's parameters unsharded in ``p`` while it computes, plus the
  units already gathered ahead: ``max(1, num_to_backward_prefetch)`` (FSDP2 prefetches one unit
  implicitly in the backward). Sized by the largest unit: ``(1 + ahead) x padded numel x p``.
  On one rank the frozen parameters stored in ``p`` (a LoRA base; any frozen one when ``p`` is 4)
  are used in place and not counted (``parallelize.left_unsharded``).
- **units held from forward to backward** (the loss phase only): the root and the forward's tail
  (the last decoder layer, the final norm, the head: ``parallelize.keep_forward_tail_gathered``)
  stay gathered until their backward, and with ``reshard_after_forward: false`` every unit does.
  They are all gathered at the backward's start; where that is more than the all-gather buffers,
  the difference is this item. Each is resharded when its own backward ends.
- **unit gradients in flight**: the unit's unsharded gradients (``p``, autograd's output) and its
  reduce-scatter input (``r``, kept until the next unit's reduce-scatter):
  ``trainable numel x p + padded trainable numel x r`` of the largest trainable unit.
- **activations** (per token and decoder layer, what autograd saves in transformers' Mistral
  layer): each RMSNorm saves its fp32 input copy, its normalised ``p`` copy and its output
  (``(4 + 2p) H``, twice); attention saves the rotated q and k, v, the attention output, its
  log-sum-exp and the o_proj input (``p (3 nh d + 2 nkv d) + 4 nh``); the MLP saves gate, SiLU, up
  and their product (``4 p I``). With recompute a checkpointed layer keeps only its input
  (``p H``) and the backward recomputes one layer at a time. A layer's backward adds
  its gradient temporaries (``3 p I + 2 p H``: the MLP's, the largest). The final norm adds
  ``(4 + 2p) H``. Frozen vision towers save nothing (no input needs a gradient).
- **loss head logits**: plain (``chunk_size`` unset or ``N <= chunk_size``): ``F.linear`` gives
  ``N x V`` logits in ``p``, upcast to fp32, log-softmax's fp32 output is saved; in the backward
  the log-softmax output, its incoming gradient and the logits' gradient are fp32 at once:
  ``12 N V``. Chunked (``ops.chunked_loss``): the two gradients computed in the forward
  (``N H p`` and ``V H p``; none for a frozen head, as in LoRA) plus one chunk's fp32 logits and their ``p`` gradient
  (``c V (4 + p)``), or in the backward the two gradients twice (scaled copies).
- **gradient accumulation** (``gradient_accumulation_steps > 1``): the gradient shards of the
  earlier micro-batches are alive during the later ones. With ``defer_grad_sync`` FSDP2 keeps
  every trainable parameter's gradient *unsharded* instead, in ``r`` (FSDP2 accumulates in the
  reduce dtype) on every rank: ``trainable x r``, in the loss and backward phases.
- **optimizer temporaries**: ``foreach`` AdamW's ``sqrt(exp_avg_sq)`` is one fp32 copy of the
  trainable shard; the fused kernel has none.

LoRA (``model.lora``): the base is frozen and stored in ``param_dtype`` (``engine.lora``), so the
parameter shards are ``4 x trainable shard + p x frozen shard`` and the gradient shards, AdamW
states and optimizer temporaries count the adapters (and ``modules_to_save``) only: ``r x (in +
out)`` parameters per adapted Linear layer. The adapters' activations come on top of the layer's:
per token and decoder layer, ``lora_B`` saves ``lora_A``'s output (``p x sum r``) and, with
``dropout > 0``, each adapter saves its dropped-out input and mask (``(p + 1) x sum in``). The
base layers' own saves are kept in the count (``lora_A`` saves the same inputs when all seven
projections are adapted), so fewer targets give an upper bound.

QLoRA (``quantize_base: nf4``, ``engine.qlora``): the frozen Linear weights of the decoder are
NF4 (``Q`` elements, block ``b``, scaler block ``s``: ``Q / 2 + Q / b + 4 Q / (b s)`` bytes:
4 bits a value, an int8 scale a block, a quantisation factor a block of scales), in the parameter
shards and in the all-gather buffers (each unit gathers its NF4 weights 4-bit). One item comes on
top, in the loss and backward phases: the **dequantisation workspace** of the largest quantised
weight ``n`` (torchao dequantises one Linear at a time, in the forward and again for the input
gradient): its two int64 code indices (``8 x n / 2``, twice), the dequantised and scaled halves and
their stacked result in ``p``: ``(8 + 3p) x n``. The QLoRA base holds no bf16 copy beyond that.
Loading quantises one whole weight at a time on the device (``(2p + 1.5) x n`` and torchao's search
scratch, before the first step): a note, not a phase.

Host memory (per rank; the node holds ``nproc_per_node`` of them): the ``adamw_swap`` states.
On the CPU the device *is* the host: the host total adds the device peak to the host items,
plus the **CPU runtime** item (memory the allocator and kernels take at first use, measured on
the CPU runs of ``tests/engine/test_memory_plan.py``); there is no separate device to check.
glibc's heap can also keep freed blocks below its mmap threshold (at most 32 MiB each) resident:
the plan does not count that (about 0.3 GiB in the mid-size CPU run, none with
``MALLOC_MMAP_THRESHOLD_=131072``), so a CPU run's RSS can exceed the plan by that much.
Figures exclude the process's own baseline (interpreter, libraries, process group) and, on
accelerators, the runtime context and the allocator's cached-but-free blocks: they are the
allocator's *peak allocated*, the figure the trainer logs as ``peak_allocated_mib``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from magistral_cli.model_config import (
    forward_tail_modules,
    in_forward_tail,
    parameter_counts,
    unique_parameters,
)

GIB = 1 << 30
MIB = 1 << 20
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: AdamWSwap's default chunk (``engine/optim.py``).
SWAP_CHUNK_BYTES = 256 << 20
#: Warn when the peak passes this fraction of the device (or host) memory: the rest covers the
#: allocator's fragmentation and the runtime context, which the plan does not count.
WARN_FRACTION = 0.95
#: Memory a CPU rank takes at first use beyond its tensors (oneDNN/BLAS scratch, gloo buffers, code
#: paged in at the first forward and backward). Measured in tests/engine/test_memory_plan.py's runs:
#: the RSS left after training above the parameters and AdamW states, 52 MiB (tiny model) and 36 MiB
#: (mid-size, with glibc returning freed blocks); one constant, not scaled.
CPU_RUNTIME_BYTES = 64 * MIB
PHASES = ("loss", "backward", "optimizer step")


@dataclass(frozen=True)
class UnitShape:
    """One FSDP2 unit: the parameters it owns (unique), unsharded and on the largest rank."""

    name: str
    numel: int
    trainable_numel: int
    padded_numel: int  # sum of ceil(dim0 / W) x W x rest: the all-gather output
    trainable_padded_numel: int
    #: Of ``padded_numel``, the NF4 elements (QLoRA): gathered 4-bit, not in ``p``.
    quantized_numel: int = 0
    #: Of ``padded_numel``, the frozen elements that are not NF4.
    frozen_padded_numel: int = 0
    #: Held gathered from its forward to its backward even when the plan reshards after the
    #: forward: the root, and the forward's tail (``parallelize.keep_forward_tail_gathered``).
    kept: bool = False

    def gathered_bytes(
        self, p: int, quant: QuantShape | None, world: int = 2, frozen_left_alone: bool = False
    ) -> int:
        """The all-gather output: ``p`` bytes an element, NF4's for the quantised ones. On one rank
        FSDP2 leaves the NF4 weights alone, and the frozen ones when they are stored in the compute
        dtype (``frozen_left_alone``): ``parallelize.left_unsharded``; none of those is gathered."""
        gathered, nf4 = self.padded_numel, 0
        if quant is not None and self.quantized_numel:
            gathered -= self.quantized_numel
            nf4 = quant.nbytes(self.quantized_numel) if world > 1 else 0
        if world == 1 and frozen_left_alone:
            gathered -= self.frozen_padded_numel
        return p * gathered + nf4


@dataclass(frozen=True)
class TextShape:
    """The decoder's sizes (``text_config``) and how many of its layers are recomputed."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    recomputed_layers: int = 0


@dataclass(frozen=True)
class LoraShape:
    """The adapters of ``model.lora``, counted from the model they were injected into."""

    r: int
    targets: int  # adapted Linear layers, all parts
    adapter_numel: int
    #: Per decoder layer of the language model (its adapted layers): sum of r and of in_features.
    rank_per_layer: int
    inputs_per_layer: int
    dropout: bool = False


@dataclass(frozen=True)
class QuantShape:
    """QLoRA's NF4 weights (``engine.qlora``): how many, on the largest rank, the largest one."""

    numel: int
    shard_numel: int
    largest: int
    block: int = 64
    scaler_block: int = 256

    def nbytes(self, numel: int) -> int:
        from .qlora import nf4_bytes

        return nf4_bytes(numel, self.block, self.scaler_block)


@dataclass(frozen=True)
class ModelShape:
    """Everything the estimator needs from the model: plain numbers, no tensors."""

    total: int
    trainable: int
    frozen: int
    shard_numel: int  # on the largest rank, all parameters
    trainable_shard_numel: int
    #: The trainable parameters' local shard sizes (largest rank), in ``model.parameters()`` order.
    trainable_shards: tuple[int, ...]
    units: tuple[UnitShape, ...]
    text: TextShape
    vision_trainable: bool
    lora: LoraShape | None = None
    quant: QuantShape | None = None
    #: Whether the output head's weight trains (its gradient is part of the chunked loss's forward).
    head_trainable: bool = True


@dataclass(frozen=True)
class PlanSettings:
    """The recipe's settings that move memory, with the resolved world."""

    device: str
    world_size: int
    nproc_per_node: int = 1
    cp: int = 1
    param_dtype: str | None = "fp32"
    reduce_dtype: str | None = "fp32"
    micro_batch_size: int = 1
    #: Sequences per sample: 2 under ``training.stage: dpo`` (a pair's chosen and rejected rows).
    sequences_per_sample: int = 1
    #: Preference training's reference: "model" (a frozen copy held beside the policy), "adapters off"
    #: (the LoRA base itself), "precomputed" (stored log-probabilities), or None (none: sft, orpo, simpo).
    reference: str | None = None
    cutoff_len: int = 2048
    gradient_accumulation_steps: int = 1
    chunk_size: int | None = None
    optimizer: str = "adamw"
    fused_adam: bool = False
    num_to_forward_prefetch: int = 0
    num_to_backward_prefetch: int = 0
    defer_grad_sync: bool = False
    #: ``parallel.fsdp_plan.reshard_after_forward``: true, the root and the forward's tail stay
    #: gathered from their forward to their backward; false, every unit; "always", none.
    reshard_after_forward: bool | str = True
    #: Dtype the frozen parameters are stored in (LoRA: ``param_dtype``); None = fp32 like the rest.
    frozen_param_dtype: str | None = None
    device_memory_bytes: int | None = None
    device_memory_source: str | None = None
    host_memory_bytes: int | None = None

    @property
    def p(self) -> int:
        return DTYPE_BYTES[self.param_dtype] if self.param_dtype else 4

    @property
    def r(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype] if self.reduce_dtype else self.p

    @property
    def frozen_bytes(self) -> int:
        return DTYPE_BYTES[self.frozen_param_dtype] if self.frozen_param_dtype else 4


@dataclass(frozen=True)
class MemoryItem:
    key: str
    name: str
    where: str  # "device" or "host"
    bytes: int
    phases: tuple[str, ...]
    formula: str

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class MemoryPlan:
    settings: PlanSettings
    parameters: dict[str, int]
    items: list[MemoryItem]
    phases: dict[str, int]  # device bytes per phase
    peak_phase: str
    device_peak: int
    host_peak: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def on_cpu(self) -> bool:
        return self.settings.device == "cpu"

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "parameters": dict(self.parameters),
            "memory": {
                "per_rank_device_gib": _gib(self.device_peak),
                "per_rank_host_gib": _gib(self.host_peak),
                "per_node_host_gib": _gib(self.host_peak * s.nproc_per_node),
                "peak_phase": self.peak_phase,
                "phases_gib": {k: _gib(v) for k, v in self.phases.items()},
                "items": {i.key: _gib(i.bytes) for i in self.items},
                "details": [
                    {
                        "key": i.key,
                        "name": i.name,
                        "where": i.where,
                        "gib": _gib(i.bytes),
                        "phases": list(i.phases),
                        "formula": i.formula,
                    }
                    for i in self.items
                ],
                "device_memory_gib": _gib(s.device_memory_bytes) if s.device_memory_bytes else None,
                "device_memory_source": s.device_memory_source,
                "host_memory_gib": _gib(s.host_memory_bytes) if s.host_memory_bytes else None,
                "device_is_host": self.on_cpu,
            },
            "settings": {k: v for k, v in asdict(s).items() if not k.endswith("_bytes")},
            "warnings": list(self.warnings),
            "notes": list(self.notes),
        }


def _gib(n: int) -> float:
    return round(n / GIB, 3)


# --------------------------------------------------------------------------- the estimate


def layer_activation_bytes_per_token(text: TextShape, p: int) -> int:
    """Bytes autograd saves per token in one decoder layer without recompute (see the module doc)."""
    h, nh, nkv, d = text.hidden, text.heads, text.kv_heads, text.head_dim
    norms = 2 * (4 + 2 * p) * h
    attention = p * (3 * nh * d + 2 * nkv * d) + 4 * nh
    mlp = 4 * p * text.intermediate
    return norms + attention + mlp


def lora_activation_bytes_per_token(lora: LoraShape | None, p: int) -> int:
    """What the adapters of one decoder layer add per token: ``lora_A``'s outputs, and with dropout
    each dropped-out input and its mask (see the module doc)."""
    if lora is None:
        return 0
    return p * lora.rank_per_layer + ((p + 1) * lora.inputs_per_layer if lora.dropout else 0)


def layer_backward_temp_bytes_per_token(text: TextShape, p: int) -> int:
    """Gradient temporaries of one layer's backward (the MLP's: three intermediate-sized tensors)."""
    return 3 * p * text.intermediate + 2 * p * text.hidden


def loss_head_bytes(
    tokens: int, text: TextShape, p: int, chunk_size: int | None, head_trainable: bool = True
) -> tuple[int, str]:
    """(peak bytes of the loss head, formula) for ``tokens`` predicted tokens; a frozen head (LoRA
    without ``modules_to_save: [lm_head]``) gets no weight gradient (``ops.chunked_loss`` skips it)."""
    v, h = text.vocab, text.hidden
    if chunk_size is None or tokens <= chunk_size:
        return 12 * tokens * v, f"plain: 12 B x {tokens:,} tokens x {v:,} vocab"
    grads = p * (tokens * h + (v * h if head_trainable else 0))
    forward = grads + chunk_size * v * (4 + p)
    backward = 2 * grads
    what = "grads of hidden and head" if head_trainable else "grad of hidden (frozen head)"
    return max(forward, backward), f"chunks of {chunk_size}: {what} + one chunk"


def swap_chunk_bytes(trainable_shards: tuple[int, ...], chunk_bytes: int = SWAP_CHUNK_BYTES) -> int:
    """The largest chunk ``AdamWSwap._chunks`` forms (fp32 shards, closed once >= chunk_bytes)."""
    largest = size = 0
    for numel in trainable_shards:
        size += 4 * numel
        if size >= chunk_bytes:
            largest, size = max(largest, size), 0
    return max(largest, size)


def _item(key: str, name: str, nbytes, phases, formula: str, where: str = "device") -> MemoryItem:
    return MemoryItem(key, name, where, int(nbytes), tuple(phases), formula)


def micro_batch_tokens(s: PlanSettings) -> tuple[int, int]:
    """(``T``, ``N``): one micro-batch's tokens on one rank and those whose next token is predicted."""
    rows = s.micro_batch_size * s.sequences_per_sample
    tokens = rows * math.ceil(s.cutoff_len / s.cp)
    return tokens, max(1, tokens - rows)


def parameter_shards(shape: ModelShape, s: PlanSettings) -> MemoryItem:
    """The fp32 master weights' shards, frozen ones included; a LoRA base is held in its own dtype."""
    fb = s.frozen_bytes
    if fb == 4:
        return _item(
            "parameter_shards",
            "parameter shards (fp32)",
            4 * shape.shard_numel,
            PHASES,
            f"4 B x {shape.shard_numel:,} (frozen too)",
        )
    frozen_shard = shape.shard_numel - shape.trainable_shard_numel
    quant = shape.quant
    if quant is not None:
        frozen_shard -= quant.shard_numel
        return _item(
            "parameter_shards",
            f"parameter shards (fp32 trainable, {s.frozen_param_dtype} frozen, NF4 base)",
            4 * shape.trainable_shard_numel + fb * frozen_shard + quant.nbytes(quant.shard_numel),
            PHASES,
            f"4 B x {shape.trainable_shard_numel:,} trainable + {fb} B x {frozen_shard:,} frozen"
            f" + NF4 {quant.shard_numel:,} ({quant.nbytes(quant.shard_numel) / quant.shard_numel:.3f} B each)",
        )
    return _item(
        "parameter_shards",
        f"parameter shards (fp32 trainable, {s.frozen_param_dtype} frozen)",
        4 * shape.trainable_shard_numel + fb * frozen_shard,
        PHASES,
        f"4 B x {shape.trainable_shard_numel:,} trainable + {fb} B x {frozen_shard:,} frozen",
    )


def reference_shards(shape: ModelShape, s: PlanSettings) -> list[MemoryItem]:
    """Preference training's frozen reference model: every base parameter's shard in the compute
    dtype (``param_dtype``; the trainer casts it, FSDP2 would cast to it anyway). Its no-grad
    forward runs before the policy's and frees what it made, so it adds no activations at the peak."""
    if s.reference != "model":
        return []
    numel = shape.shard_numel - (shape.trainable_shard_numel if shape.lora is not None else 0)
    if shape.quant is not None:  # never built beside a QLoRA policy; counted as the plain base if it were
        numel = shape.shard_numel
    return [
        _item(
            "reference_shards",
            f"reference model shards ({s.param_dtype or 'fp32'}, frozen)",
            s.p * numel,
            PHASES,
            f"{s.p} B x {numel:,}",
        )
    ]


def gradient_shards(shape: ModelShape, s: PlanSettings) -> MemoryItem:
    """FSDP2's reduce-scattered gradients (fp32, trainable only); alive in the loss phase too when
    earlier micro-batches' gradients wait for the later ones (gradient accumulation)."""
    return _item(
        "gradient_shards",
        "gradient shards (fp32)",
        4 * shape.trainable_shard_numel,
        ("backward", "optimizer step") + (("loss",) if s.gradient_accumulation_steps > 1 else ()),
        f"4 B x {shape.trainable_shard_numel:,} trainable",
    )


def optimizer_items(shape: ModelShape, s: PlanSettings) -> list[MemoryItem]:
    """AdamW's two fp32 moments and the step's temporaries: on the device, or with ``adamw_swap``
    the moments on the host and the chunk being updated on the device."""
    states = 8 * shape.trainable_shard_numel
    fused = s.fused_adam
    if s.optimizer == "adamw_swap":
        chunk = swap_chunk_bytes(shape.trainable_shards)
        # On the CPU the moments are used in place (``.to("cpu")`` is a no-op): only foreach's sqrt.
        copies = (0 if s.device == "cpu" else 2) + (0 if fused else 1)
        return [
            _item(
                "optimizer_states",
                "AdamW states (fp32, host)",
                states,
                PHASES,
                "2 x 4 B x trainable shard",
                "host",
            ),
            _item(
                "optimizer_work",
                "AdamWSwap chunk on the device",
                copies * chunk,
                ("optimizer step",),
                f"{copies} x largest chunk ({chunk / MIB:,.0f} MiB)",
            ),
        ]
    return [
        _item("optimizer_states", "AdamW states (fp32)", states, PHASES, "2 x 4 B x trainable shard"),
        _item(
            "optimizer_work",
            "AdamW temporaries",
            0 if fused else 4 * shape.trainable_shard_numel,
            ("optimizer step",),
            "fused: none" if fused else "foreach sqrt(exp_avg_sq): 4 B x trainable shard",
        ),
    ]


def all_gather_buffers(shape: ModelShape, s: PlanSettings) -> list[MemoryItem]:
    """The largest unit unsharded in ``p``, once computing and once per unit gathered ahead; and
    at the backward's start, the units held gathered since their forward when they are more (the
    root and the forward's tail; every unit without ``reshard_after_forward``)."""
    p, quant = s.p, shape.quant
    # Frozen weights stored in the compute dtype (any, when FSDP2 does not cast): not gathered on one rank.
    left_alone = s.param_dtype is None or (s.frozen_param_dtype or "fp32") == s.param_dtype

    def gathered_bytes(unit: UnitShape) -> int:
        return unit.gathered_bytes(p, quant, s.world_size, left_alone)

    largest = max(shape.units, key=gathered_bytes)
    ahead = max(1, s.num_to_backward_prefetch)
    gathered = gathered_bytes(largest)
    detail = (
        f", {largest.quantized_numel:,} of them NF4" if quant is not None and largest.quantized_numel else ""
    )
    if s.world_size == 1 and left_alone and largest.frozen_padded_numel:
        detail += f", {largest.frozen_padded_numel:,} frozen ones used in place"
    streaming = (1 + ahead) * gathered
    items = [
        _item(
            "all_gather",
            f"all-gather buffers ({p}-byte params{', NF4 base' if quant is not None else ''})",
            streaming,
            ("loss", "backward"),
            f"(1 + {ahead} ahead) x {gathered:,} B ({largest.padded_numel:,} elements{detail}; {_short(largest.name)})",
        )
    ]
    # Held from forward to backward: together at the backward's start (the loss phase); each is
    # resharded once its own backward ends, so none of it is left at the backward's end.
    held_units = {
        True: [u for u in shape.units if u.kept],
        False: list(shape.units),
        "always": [],
    }[s.reshard_after_forward]
    held = sum(gathered_bytes(u) for u in held_units)
    if held > streaming:
        which = (
            "every unit (reshard_after_forward off)"
            if not s.reshard_after_forward
            else "the root and the forward's tail ("
            + ", ".join(u.name.removeprefix("model.") for u in held_units)
            + ")"
        )
        items.append(
            _item(
                "held_gathered",
                "units held gathered from forward to backward",
                held - streaming,
                ("loss",),
                f"{which}: {held:,} B, less the all-gather buffers",
            )
        )
    return items


def dequant_workspace(shape: ModelShape, s: PlanSettings) -> list[MemoryItem]:
    """QLoRA: torchao's dequantisation of the largest NF4 weight, one Linear at a time (module doc)."""
    quant = shape.quant
    if quant is None:
        return []
    per = 8 + 3 * s.p
    return [
        _item(
            "dequant_workspace",
            "NF4 dequantisation workspace (one Linear)",
            per * quant.largest,
            ("loss", "backward"),
            f"(8 + 3 x {s.p}) B x {quant.largest:,} (the largest NF4 weight)",
        )
    ]


def unit_gradients(shape: ModelShape, s: PlanSettings) -> MemoryItem:
    """The largest trainable unit's unsharded gradients (``p``) and its reduce-scatter input (``r``)."""
    p, r = s.p, s.r
    trainable_units = [u for u in shape.units if u.trainable_numel] or list(shape.units)
    largest = max(trainable_units, key=lambda u: u.padded_numel)
    return _item(
        "unit_grads",
        "unit gradients in flight",
        largest.trainable_numel * p + largest.trainable_padded_numel * r,
        ("backward",),
        f"({p} + {r}) B x {largest.trainable_numel:,} ({_short(largest.name)})",
    )


def activation_items(shape: ModelShape, s: PlanSettings) -> list[MemoryItem]:
    """What autograd saves over the decoder's layers and the final norm (the loss phase), and one
    layer's saves and gradient temporaries during its backward (recomputed or still saved)."""
    p, text = s.p, shape.text
    tokens, _ = micro_batch_tokens(s)
    per_layer = layer_activation_bytes_per_token(text, p) + lora_activation_bytes_per_token(shape.lora, p)
    checkpointed = text.recomputed_layers
    saved = checkpointed * p * text.hidden + (text.layers - checkpointed) * per_layer
    final_norm = (4 + 2 * p) * text.hidden
    backward_temp = layer_backward_temp_bytes_per_token(text, p)
    return [
        _item(
            "activations",
            "activations (saved for backward)",
            tokens * (saved + final_norm),
            ("loss",),
            f"{tokens:,} tokens x ({checkpointed} checkpoints x {p * text.hidden:,} B"
            f" + {text.layers - checkpointed} layers x {per_layer:,} B + norm)",
        ),
        _item(
            "layer_backward",
            "one layer's backward" + (" (recomputed)" if checkpointed else ""),
            tokens * (per_layer + backward_temp),
            ("backward",),
            f"{tokens:,} tokens x ({per_layer:,} saved + {backward_temp:,} grad) B",
        ),
    ]


def loss_logits(shape: ModelShape, s: PlanSettings) -> MemoryItem:
    """The loss head's logits and their gradients over the ``N`` predicted tokens (plain or chunked)."""
    _, predicted = micro_batch_tokens(s)
    head, head_formula = loss_head_bytes(predicted, shape.text, s.p, s.chunk_size, shape.head_trainable)
    return _item(
        "loss_logits",
        "loss head logits" + (" (chunked)" if s.chunk_size else ""),
        head,
        ("loss",),
        head_formula,
    )


def defers_grad_sync(s: PlanSettings) -> bool:
    """FSDP2 keeps the gradients unsharded between micro-batches (``defer_grad_sync`` with accumulation)."""
    return s.gradient_accumulation_steps > 1 and s.defer_grad_sync


def deferred_gradients(shape: ModelShape, s: PlanSettings) -> list[MemoryItem]:
    """With ``defer_grad_sync`` every trainable parameter's gradient unsharded in ``r`` on every rank."""
    if not defers_grad_sync(s):
        return []
    return [
        _item(
            "deferred_grads",
            "unsharded gradients (defer_grad_sync)",
            shape.trainable * s.r,
            ("loss", "backward"),
            f"{s.r} B x {shape.trainable:,} trainable, on every rank",
        )
    ]


def phase_bytes(items: list[MemoryItem], shape: ModelShape, s: PlanSettings) -> dict[str, int]:
    """The device bytes alive in each phase: its items' sum."""
    phases = {ph: sum(i.bytes for i in items if i.where == "device" and ph in i.phases) for ph in PHASES}
    if defers_grad_sync(s):
        # The unsharded gradients are reduce-scattered unit by unit in the last backward: the
        # shards replace them, the two are never both complete.
        grads = next(i.bytes for i in items if i.key == "gradient_shards")
        phases["backward"] -= min(grads, shape.trainable * s.r)
        phases["loss"] -= grads
    return phases


def cpu_runtime() -> MemoryItem:
    """What a CPU rank takes at first use beyond its tensors (``CPU_RUNTIME_BYTES``, measured)."""
    return _item(
        "cpu_runtime",
        "CPU runtime (allocator, kernels)",
        CPU_RUNTIME_BYTES,
        PHASES,
        "measured constant (first-use allocations)",
        "host",
    )


def plan_notes(shape: ModelShape, s: PlanSettings) -> list[str]:
    """What the figures assume or leave out, for the reader of the plan."""
    notes: list[str] = []
    if s.device == "cpu":
        notes.append("on the CPU the device is the host: the host total includes the device peak")
    if s.fused_adam and s.device != "cpu" and s.optimizer == "adamw":
        notes.append(
            "assumes the fused AdamW kernel runs on the device; where it does not, the trainer falls back to "
            f"foreach (run_identity.json: resolved.adamw) and the optimizer step takes "
            f"{4 * shape.trainable_shard_numel / GIB:.2f} GiB more"
        )
    if shape.lora is not None:
        lo = shape.lora
        notes.append(
            f"LoRA r={lo.r} on {lo.targets} Linear layers: {lo.adapter_numel:,} adapter parameters trained "
            f"(fp32 masters, gradients, AdamW states); the {shape.frozen:,} frozen parameters are held in "
            f"{s.frozen_param_dtype or 'fp32'}{' or NF4' if shape.quant is not None else ''} with no master copy, "
            "gradient or optimizer state"
        )
    if shape.quant is not None:
        q = shape.quant
        notes.append(
            f"QLoRA: {q.numel:,} frozen Linear weights in NF4 (blocks {q.block} x {q.scaler_block}, "
            f"{q.nbytes(q.numel) / GIB:.2f} GiB in all), dequantised one Linear at a time; the rest of the "
            f"frozen base in {s.frozen_param_dtype or 'fp32'}"
        )
        # Loading (before the first step): the largest weight whole in p, its scaled copy, its 4-bit
        # codes (a byte each, then packed) and torchao's nearest-code search over 1M-element chunks.
        load = (2 * s.p + 1.5) * q.largest + 2 * 16 * s.p * (1 << 20)
        notes.append(
            f"QLoRA loading quantises one weight at a time on the device: about {load / GIB:.2f} GiB above "
            "the parameter shards while it loads, before the first step (not a phase of the plan)"
        )
    if s.sequences_per_sample == 2:
        where = {
            "model": "a frozen reference model is held beside the policy (its forward runs under no_grad first)",
            "adapters off": "the reference is the LoRA base with its adapters off: no second model",
            "precomputed": "the reference's log-probabilities are computed once before training and stored "
            "beside the cache (training.dpo.precompute_ref): no reference while training",
            None: "the loss uses no reference model",
        }[s.reference]
        notes.append(f"training.stage: dpo: each pair is 2 sequences of up to cutoff_len tokens; {where}")
    if shape.vision_trainable:
        notes.append(
            "the vision tower is trainable: its activations depend on the images and are not counted"
        )
    return notes


def plan_warnings(s: PlanSettings, device_peak: int, host_peak: int) -> list[str]:
    """The peaks above ``WARN_FRACTION`` of the device's (not the CPU's) or the node's memory."""
    warnings: list[str] = []
    if s.device_memory_bytes and s.device != "cpu" and device_peak > WARN_FRACTION * s.device_memory_bytes:
        warnings.append(
            f"estimated peak {device_peak / GIB:.1f} GiB per rank is above {WARN_FRACTION:.0%} of the "
            f"{s.device_memory_bytes / GIB:.1f} GiB device memory ({s.device_memory_source}); " + _advice(s)
        )
    node_host = host_peak * s.nproc_per_node
    if s.host_memory_bytes and node_host > WARN_FRACTION * s.host_memory_bytes:
        warnings.append(
            f"estimated host memory {node_host / GIB:.1f} GiB per node ({s.nproc_per_node} ranks) is above "
            f"{WARN_FRACTION:.0%} of the {s.host_memory_bytes / GIB:.1f} GiB here"
        )
    return warnings


def plan_parameters(shape: ModelShape) -> dict[str, int]:
    """The plan's parameter counts; with LoRA, the adapters and what a checkpoint holds."""
    parameters = {"total": shape.total, "trainable": shape.trainable, "frozen": shape.frozen}
    if shape.lora is not None:
        # A LoRA checkpoint holds the trainable tensors only (engine.lora.adapter_state_dict).
        parameters["adapters"] = shape.lora.adapter_numel
        parameters["checkpointed"] = shape.trainable
    if shape.quant is not None:
        parameters["quantized"] = shape.quant.numel
    return parameters


def estimate(shape: ModelShape, s: PlanSettings) -> MemoryPlan:
    """The per-rank memory plan of ``shape`` trained with ``s`` (pure arithmetic): the items, in the
    module doc's order, summed per phase; the device peak is the largest phase."""
    items = [
        parameter_shards(shape, s),
        *reference_shards(shape, s),
        gradient_shards(shape, s),
        *optimizer_items(shape, s),
        *all_gather_buffers(shape, s),
        *dequant_workspace(shape, s),
        unit_gradients(shape, s),
        *activation_items(shape, s),
        loss_logits(shape, s),
        *deferred_gradients(shape, s),
    ]
    phases = phase_bytes(items, shape, s)
    peak_phase = max(phases, key=phases.get)
    device_peak = phases[peak_phase]
    host_peak = sum(i.bytes for i in items if i.where == "host")
    if s.device == "cpu":
        # On the CPU the device is the host: its peak and the runtime count there.
        items.append(cpu_runtime())
        host_peak += CPU_RUNTIME_BYTES + device_peak
    return MemoryPlan(
        settings=s,
        parameters=plan_parameters(shape),
        items=items,
        phases=phases,
        peak_phase=peak_phase,
        device_peak=device_peak,
        host_peak=host_peak,
        warnings=plan_warnings(s, device_peak, host_peak),
        notes=plan_notes(shape, s),
    )


def _short(name: str) -> str:
    """``model.language_model.layers.{*}`` style names, shortened for the table."""
    return re.sub(r"\.(\d+)$", ".N", name.removeprefix("model."))


def _advice(s: PlanSettings) -> str:
    hints = []
    if s.defer_grad_sync and s.gradient_accumulation_steps > 1:
        hints.append("parallel.fsdp_plan.defer_grad_sync=false")
    if s.chunk_size is None:
        hints.append("features.enable_chunk_loss=true")
    if s.optimizer != "adamw_swap":
        hints.append("training.optimizer=adamw_swap")
    hints.append("more ranks or a smaller micro-batch / cutoff_len")
    return "try " + ", ".join(hints)


# --------------------------------------------------------------------------- from a model / recipe


def _shard_rows(numel: int, dim0: int, world: int) -> tuple[int, int]:
    """(local numel on the largest rank, padded numel) of one parameter sharded on dim 0."""
    rest = numel // dim0 if dim0 else 0
    rows = -(-dim0 // world)
    return rows * rest, rows * world * rest


_LAYER = re.compile(r"^(.*\.layers)\.(\d+)$")


def model_shape(
    model,
    *,
    frozen: list[str],
    units: list[str],
    recomputed: list[str],
    world: int,
    lora=None,
    quantized: tuple[set[str], int, int] | None = None,
) -> ModelShape:
    """The :class:`ModelShape` of ``model`` (meta is fine) sharded over ``world`` ranks.

    ``frozen``, ``units`` and ``recomputed`` are module names (``select_modules`` resolved the
    recipe's patterns); units are in the order ``apply_fsdp`` shards them, the root comes last.
    A parameter is trainable unless it is under ``frozen`` or has ``requires_grad`` off (the base
    of a LoRA model); ``lora`` is ``engine.lora.apply_lora``'s result for such a model;
    ``quantized`` is QLoRA's (parameter names in NF4, block, scaler block).
    """
    owners = [(u, f"{u}.") for u in units]
    unit_acc: dict[str, list[int]] = {u: [0, 0, 0, 0, 0, 0] for u in [*units, "(root)"]}
    nf4_names = quantized[0] if quantized else set()
    nf4 = [0, 0, 0]  # numel, shard numel, largest
    counts = parameter_counts(model, frozen)
    shard = trainable_shard = 0
    shards: list[int] = []
    vision_trainable = False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_trainable = True
    for name, param, is_trainable in unique_parameters(model, frozen):
        if head is not None and param is head.weight:
            head_trainable = is_trainable
        n = param.numel()
        dim0 = param.shape[0] if param.dim() else 1
        local, padded = _shard_rows(n, dim0, world)
        shard += local
        owner = next((u for u, prefix in owners if name.startswith(prefix)), "(root)")
        acc = unit_acc[owner]
        acc[0] += n
        acc[2] += padded
        if name in nf4_names:
            acc[4] += padded
            nf4 = [nf4[0] + n, nf4[1] + local, max(nf4[2], n)]
        if is_trainable:
            trainable_shard += local
            shards.append(local)
            acc[1] += n
            acc[3] += padded
            vision_trainable |= name.startswith("model.vision_tower.")
        elif name not in nf4_names:
            acc[5] += padded
    # Held from forward to backward whatever the plan: the root, and with a trainable model the
    # forward's tail (``parallelize.keep_forward_tail_gathered``).
    tail = forward_tail_modules(model.config) if counts["trainable"] else ()
    unit_shapes = tuple(
        UnitShape(u, *acc, kept=u == "(root)" or in_forward_tail(u, tail))
        for u, acc in unit_acc.items()
        if acc[0]
    )
    text = model.config.text_config
    layer_names = [n for n, _ in model.named_modules() if _LAYER.match(n) and "language_model" in n]
    recomputed_set = tuple(recomputed)
    recomputed_layers = sum(
        1 for n in layer_names if any(n == r or n.startswith(f"{r}.") for r in recomputed_set)
    )
    return ModelShape(
        total=counts["total"],
        trainable=counts["trainable"],
        frozen=counts["frozen"],
        shard_numel=shard,
        trainable_shard_numel=trainable_shard,
        trainable_shards=tuple(shards),
        units=unit_shapes,
        text=TextShape(
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            layers=text.num_hidden_layers,
            heads=text.num_attention_heads,
            kv_heads=text.num_key_value_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            vocab=text.vocab_size,
            recomputed_layers=recomputed_layers,
        ),
        vision_trainable=vision_trainable,
        lora=_lora_shape(model, lora, text.num_hidden_layers) if lora is not None else None,
        quant=QuantShape(*nf4, block=quantized[1], scaler_block=quantized[2]) if quantized else None,
        head_trainable=head_trainable,
    )


def _lora_shape(model, applied, layers: int) -> LoraShape:
    """The :class:`LoraShape` of a model with ``applied`` adapters (``engine.lora.LoraApplied``)."""
    modules = dict(model.named_modules())
    rank = inputs = numel = 0
    for name in applied.targets.modules:
        layer = modules[name]
        r, fan_in = layer.r["default"], layer.in_features
        numel += r * (fan_in + layer.out_features)
        if name.startswith("model.language_model.layers."):
            rank, inputs = rank + r, inputs + fan_in
    return LoraShape(
        r=applied.spec.r,
        targets=len(applied.targets.modules),
        adapter_numel=numel,
        rank_per_layer=rank // max(layers, 1),
        inputs_per_layer=inputs // max(layers, 1),
        dropout=applied.spec.dropout > 0,
    )


def _device_memory(device: str, requested_gib: float | None, detected: bool) -> tuple[int | None, str | None]:
    if requested_gib:
        return int(requested_gib * GIB), "parallel.device_memory_gib"
    if not detected or device not in ("cuda", "npu"):
        return None, None
    try:
        import torch

        mod = torch.cuda if device == "cuda" else torch.npu  # type: ignore[attr-defined]
        return int(mod.get_device_properties(0).total_memory), f"detected {device}:0"
    except Exception:  # a device that cannot be queried only loses the check
        return None, None


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def settings_from_recipe(
    recipe, *, device: str, world_size: int, nproc_per_node: int, detected: bool
) -> PlanSettings:
    """:class:`PlanSettings` of a resolved recipe (``detected``: the device is visible here)."""
    from .preference import reference_kind

    par, plan, feat, train = recipe.parallel, recipe.parallel.fsdp_plan, recipe.features, recipe.training
    cp = par.ulysses_parallel_size * par.ring_attention_size
    fused = train.adam_fused and device in ("cpu", "cuda", "npu")
    memory, source = _device_memory(device, getattr(par, "device_memory_gib", None), detected)
    return PlanSettings(
        device=device,
        world_size=world_size,
        nproc_per_node=nproc_per_node,
        cp=cp,
        param_dtype=plan.param_dtype,
        reduce_dtype=plan.reduce_dtype,
        micro_batch_size=train.micro_batch_size,
        sequences_per_sample=2 if train.stage == "dpo" else 1,
        reference=reference_kind(recipe),
        cutoff_len=recipe.data.dataset_param.basic_parameters.cutoff_len,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        chunk_size=feat.chunkloss_plan.chunk_size if feat.enable_chunk_loss else None,
        optimizer=train.optimizer,
        fused_adam=fused,
        num_to_forward_prefetch=plan.num_to_forward_prefetch,
        num_to_backward_prefetch=plan.num_to_backward_prefetch,
        defer_grad_sync=plan.defer_grad_sync,
        reshard_after_forward=plan.reshard_after_forward,
        # LoRA keeps the frozen base in the compute dtype (engine.lora.apply_lora_from_recipe).
        frozen_param_dtype=(plan.param_dtype or "fp32") if recipe.model.lora is not None else None,
        device_memory_bytes=memory,
        device_memory_source=source,
        host_memory_bytes=host_memory_bytes() if detected else None,
    )


def plan_recipe(recipe, *, device: str, world_size: int, nproc_per_node: int, detected: bool) -> MemoryPlan:
    """Build the recipe's model on the meta device and estimate its per-rank memory.

    Raises UserError for an unreadable config or a module pattern that matches nothing.
    """
    import torch

    from magistral_cli.config.patterns import select_modules
    from magistral_cli.model_config import read_model_config

    from .model import build_model

    config = read_model_config(
        recipe.model.model_name_or_path,
        trust_remote_code=recipe.model.trust_remote_code,
        what="model.model_name_or_path",
    )
    with torch.device("meta"):
        model = build_model(config, meta=True, attn_implementation="sdpa")
    lora = None
    if recipe.model.lora is not None:
        from .lora import apply_lora

        lora = apply_lora(model, recipe.model.lora, freeze=recipe.model.freeze)
    quantized = None
    spec = recipe.model.lora
    if spec is not None and spec.quantize_base != "none":
        from .qlora import checked_targets

        # The weights the trainer quantises, checked against the FSDP group (the world) here, before any
        # rank starts; torchao itself is not needed for the plan.
        targets = checked_targets(model, spec, world_size)
        quantized = (
            {f"{n}.weight" for n, _ in targets},
            spec.quantize_block_size,
            spec.quantize_scaler_block_size,
        )

    def names(patterns: list[str], what: str) -> list[str]:
        return [n for n, _ in select_modules(model, patterns, what=what)] if patterns else []

    frozen = names(recipe.model.freeze, "model.freeze pattern")
    units = names(recipe.parallel.fsdp_plan.apply_modules, "parallel.fsdp_plan.apply_modules pattern")
    feat = recipe.features
    recomputed = (
        names(feat.recompute_plan.apply_modules, "features.recompute_plan pattern") if feat.recompute else []
    )
    shape = model_shape(
        model,
        frozen=frozen,
        units=units,
        recomputed=recomputed,
        world=world_size,
        lora=lora,
        quantized=quantized,
    )
    settings = settings_from_recipe(
        recipe, device=device, world_size=world_size, nproc_per_node=nproc_per_node, detected=detected
    )
    return estimate(shape, settings)
