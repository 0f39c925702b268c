"""LoRA adapters (``model.lora``): PEFT's LoRA layers in the transformers model, before parallelisation.

**PEFT API.** :func:`apply_lora` calls ``peft.inject_adapter_in_model`` (not ``get_peft_model``):
it replaces each target ``nn.Linear`` by ``peft.tuners.lora.Linear`` *in place* and returns the
same ``Mistral3ForTraining`` instance. ``get_peft_model`` would wrap the model in a ``PeftModel``
(root class, ``forward``, ``get_input_embeddings`` and every key prefixed ``base_model.model.``),
which the loss head, the blank-image forward, FSDP2's root unit, the context-parallel forward and
our checkpoints all rely on not happening. The layers are PEFT's own, so the adapters are exactly
PEFT's (scaling ``alpha / r``, dropout, ``init_lora_weights``) and the exported files are standard.

``modules_to_save`` is *not* handed to PEFT for training: PEFT's ``ModulesToSaveWrapper`` keeps a
frozen original and a trainable copy of the module (twice its memory: 671M parameters for the
24B head) and changes its keys. Here the module itself is made trainable; the export writes it
under PEFT's file key (``base_model.model.lm_head.weight``, the key PEFT saves from the copy) and
lists it in ``adapter_config.json``, so ``PeftModel.from_pretrained`` loads it into its wrapper.

**Key names.** PEFT moves the wrapped Linear's weight to ``<module>.base_layer.weight`` and adds
``<module>.lora_A.default.weight`` ``[r, in]`` and ``<module>.lora_B.default.weight`` ``[out, r]``.
Our HF and DCP weights use the plain names: :func:`base_key` / :func:`wrapped_key` map between
them and :func:`base_state_dict` is the model's state dict keyed as the base checkpoint is (adapter
tensors left out), which is what the weight loaders fill. PEFT's adapter files drop the adapter
name and prefix ``base_model.model.`` (:func:`peft_file_key`).

**Frozen base.** PEFT marks only the adapters trainable; :func:`apply_lora` adds the
``modules_to_save`` and casts every frozen parameter to ``frozen_dtype`` (the recipe's
``fsdp_plan.param_dtype``): the base needs no fp32 master copy, gradient or optimizer state.
FSDP2 requires one dtype among the *trainable* parameters of a unit only
(``FSDPParamGroup._init_mp_dtypes``); frozen bf16 base weights and fp32 adapters share a unit, and
with ``param_dtype: bf16`` every all-gather input is bf16.

**Meta-device init.** On a meta model PEFT creates the adapters on the meta device
(``low_cpu_mem_usage``) and cannot initialise them; ``materialize`` then allocates them
uninitialised. :func:`init_adapter_weights` re-runs PEFT's init after materialization (A
kaiming-uniform with ``a = sqrt(5)``, B zero, or PEFT's 'gaussian' / false): each full tensor is drawn
on the CPU from a generator seeded with ``training.seed`` (the same on every rank) and each rank
keeps its shard, so the values do not depend on the sharding.

**Checkpoints.** :func:`adapter_state_dict` is ``get_model_state_dict`` with
``ignore_frozen_params``: the adapters and ``modules_to_save`` only; the optimizer holds only those
parameters, so ``get_optimizer_state_dict`` is adapter-only already. :func:`checkpoint_entry` records
the LoRA settings in the checkpoint (``lora.config``), which ``magistral convert dcp-to-hf --lora``
reads.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from magistral_cli.checkpoint.lora_format import (
    ADAPTER,
    ADAPTER_PARTS,
    BASE_LAYER,
    CHECKPOINT_ENTRY,
    CHECKPOINT_FORMAT,
    PEFT_FILE_PREFIX,  # noqa: F401 (re-exported: engine.lora is the trainer's LoRA API)
    LoraTargets,
    base_key,  # noqa: F401 (re-exported: engine.lora is the trainer's LoRA API)
    base_state_dict,  # noqa: F401 (re-exported: engine.lora is the trainer's LoRA API)
    is_adapter_key,
    peft_config,
    peft_file_key,  # noqa: F401 (re-exported: engine.lora is the trainer's LoRA API)
    read_checkpoint_record,
    wrapped_key,  # noqa: F401 (re-exported: engine.lora is the trainer's LoRA API)
)
from magistral_cli.config.patterns import WILDCARD, compile_pattern, match_names, select_modules
from magistral_cli.config.schema import LORA_SCOPES
from magistral_cli.config.schema import LoraConfig as LoraSpec
from magistral_cli.errors import UserError

from .weights import local_slices

log = logging.getLogger(__name__)

WHAT = "model.lora.target_modules"


# --------------------------------------------------------------------------- targets


def _linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _head_name(model: nn.Module) -> str | None:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def _in_scopes(name: str, scopes: list[str]) -> bool:
    return any(name.startswith(scope + ".") for scope in scopes)


def resolve_targets(
    model: nn.Module, spec: LoraSpec, freeze: list[str] | tuple[str, ...] = ()
) -> LoraTargets:
    """The Linear layers ``spec.target_modules`` names and the modules of ``spec.modules_to_save``.

    A bare name (``q_proj``) matches the Linear layers of that name in the ``apply_to`` parts; a
    dotted pattern (``{*}`` = one component) matches module names anywhere and every match must be a
    Linear layer. Anything that matches nothing, a non-Linear match, the output head (the chunked
    loss runs inside it: train it with ``modules_to_save``), an adapter inside a ``model.freeze``
    module, or a module both adapted and saved is a UserError naming the entry and the fix.
    """
    modules = dict(model.named_modules())
    linears = _linear_layers(model)
    head = _head_name(model)
    scopes = [LORA_SCOPES[part] for part in spec.apply_to]
    chosen: set[str] = set()
    for entry in spec.target_modules:
        if entry == head:
            raise UserError(
                f"{WHAT}: {entry!r} is the output head, which computes the loss (chunked) and cannot be "
                f"wrapped by LoRA; train it in full with model.lora.modules_to_save: [{entry}]"
            )
        if "." not in entry and WILDCARD not in entry:
            hits = [n for n in linears if n.rsplit(".", 1)[-1] == entry and _in_scopes(n, scopes)]
            if not hits:
                names = sorted({n.rsplit(".", 1)[-1] for n in linears if _in_scopes(n, scopes) and n != head})
                elsewhere = sorted(
                    {
                        part
                        for part, scope in LORA_SCOPES.items()
                        for n in linears
                        if n.startswith(scope + ".") and n.rsplit(".", 1)[-1] == entry
                    }
                    - set(spec.apply_to)
                )
                hint = (
                    f"; it exists in {', '.join(elsewhere)}: add that to model.lora.apply_to"
                    if elsewhere
                    else ""
                )
                raise UserError(
                    f"{WHAT}: {entry!r} is not the name of a Linear layer in {', '.join(spec.apply_to)} "
                    f"(model.lora.apply_to); the Linear layers there are: {', '.join(names)}{hint}"
                )
        else:
            hits = match_names(modules, [entry], what=f"{WHAT} pattern")[entry]
            wrong = [n for n in hits if n not in linears or n == head]
            if wrong:
                kind = "the output head" if wrong[0] == head else f"a {type(modules[wrong[0]]).__name__}"
                example = next((n for n in linears if n.startswith(wrong[0] + ".")), None)
                hint = f", e.g. {example}" if example else ""
                raise UserError(
                    f"{WHAT}: {entry!r} matches {wrong[0]!r}, {kind}, not a Linear layer that LoRA can adapt; "
                    f"name the Linear layers themselves{hint}"
                )
        chosen.update(hits)
    saved_names: set[str] = set()
    if spec.modules_to_save:
        for name, module in select_modules(
            model, spec.modules_to_save, what="model.lora.modules_to_save pattern"
        ):
            if not any(True for _ in module.parameters()):
                raise UserError(
                    f"model.lora.modules_to_save: {name!r} has no parameters; name a module with weights"
                )
            saved_names.add(name)
    both = sorted(
        t
        for t in chosen
        if any(t == s or t.startswith(s + ".") or s.startswith(t + ".") for s in saved_names)
    )
    if both:
        raise UserError(
            f"model.lora: {both[0]!r} is both a LoRA target and (inside) a module of modules_to_save; "
            "adapt it or train it in full, not both"
        )
    frozen = (
        [n for n, _ in select_modules(model, list(freeze), what="model.freeze pattern")] if freeze else []
    )
    for name in sorted(chosen | saved_names):
        inside = next((f for f in frozen if name == f or name.startswith(f + ".")), None)
        if inside is not None:
            raise UserError(
                f"model.lora: {name!r} is inside {inside!r}, which model.freeze freezes (its adapters would be "
                f"frozen too); remove that pattern from model.freeze (LoRA freezes the base weights anyway)"
            )
    order = list(modules)
    return LoraTargets(
        modules=tuple(n for n in order if n in chosen),
        modules_to_save=tuple(n for n in order if n in saved_names),
    )


# --------------------------------------------------------------------------- PEFT config


# --------------------------------------------------------------------------- applying


@dataclass
class LoraApplied:
    """What :func:`apply_lora` did, for the trainer, the checkpoints and the memory plan."""

    spec: LoraSpec
    targets: LoraTargets
    config: Any  # peft.LoraConfig used for injection
    frozen_dtype: torch.dtype | None
    meta: bool
    trainable: list[str] = field(default_factory=list)

    def to_record(self, base_model_name_or_path: str | None = None) -> dict[str, Any]:
        """The JSON-ready settings stored in training checkpoints (``lora.config``)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "r": self.spec.r,
            "alpha": self.spec.alpha,
            "dropout": self.spec.dropout,
            "init_lora_weights": self.spec.init_lora_weights,
            "target_modules": list(self.targets.modules),
            "modules_to_save": list(self.targets.modules_to_save),
            # QLoRA trained against the NF4 base; the adapters still apply to (and merge into) the bf16 one.
            "quantize_base": self.spec.quantize_base,
            "base_model_name_or_path": base_model_name_or_path,
        }


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def cast_frozen_(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen floating-point parameter in ``dtype`` (in place: tied parameters stay tied).

    Returns the count of parameters cast. Buffers (the rotary frequencies) are left alone.
    """
    count = 0
    seen: set[int] = set()
    with torch.no_grad():
        for param in model.parameters():
            if id(param) in seen or param.requires_grad or not param.is_floating_point():
                continue
            seen.add(id(param))
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
                count += 1
    return count


def apply_lora(
    model: nn.Module,
    spec: LoraSpec,
    *,
    freeze: list[str] | tuple[str, ...] = (),
    frozen_dtype: torch.dtype | None = None,
) -> LoraApplied:
    """Inject PEFT's LoRA layers into ``model`` (in place), freeze everything else, return what was done.

    Call before parallelisation (``parallelize_model``: freeze, kernels, recompute, FSDP2) and after
    ``install_loss_head``. ``freeze`` is ``model.freeze`` (checked: no target inside a frozen module).
    ``frozen_dtype`` (e.g. bf16): the frozen base is stored in it; None keeps the build's dtype. On a
    meta model the adapters are created on the meta device: call :func:`init_adapter_weights` after
    ``materialize``.
    """
    from peft import inject_adapter_in_model

    targets = resolve_targets(model, spec, freeze)
    config = peft_config(spec, targets)
    meta = _is_meta(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    # PEFT left only the adapters trainable; the modules to save are trained in full.
    modules = dict(model.named_modules())
    for name in targets.modules_to_save:
        modules[name].requires_grad_(True)
    if frozen_dtype is not None:
        cast_frozen_(model, frozen_dtype)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    expected = {f"{m}.{part}.{ADAPTER}.weight" for m in targets.modules for part in ADAPTER_PARTS}
    saved = tuple(f"{m}." for m in targets.modules_to_save)
    stray = [n for n in trainable if n not in expected and not n.startswith(saved)]
    if stray or not expected <= set(trainable):
        raise RuntimeError(f"LoRA left unexpected trainable parameters {stray[:5]} (or adapters missing)")
    applied = LoraApplied(spec, targets, config, frozen_dtype, meta, trainable)
    log.info(
        "LoRA r=%d alpha=%d on %d Linear layers (%d adapter parameters)%s",
        spec.r,
        spec.alpha,
        len(targets.modules),
        adapter_numel(model),
        f", modules to save: {', '.join(targets.modules_to_save)}" if targets.modules_to_save else "",
    )
    return applied


def apply_lora_from_recipe(model: nn.Module, recipe) -> LoraApplied | None:
    """:func:`apply_lora` with the recipe's ``model.lora`` (None when unset), ``model.freeze`` and the
    frozen base in ``parallel.fsdp_plan.param_dtype`` (fp32 when unset)."""
    spec = recipe.model.lora
    if spec is None:
        return None
    from magistral_cli.runtime import DTYPES

    param_dtype = recipe.parallel.fsdp_plan.param_dtype
    return apply_lora(
        model, spec, freeze=recipe.model.freeze, frozen_dtype=DTYPES[param_dtype] if param_dtype else None
    )


def adapter_numel(model: nn.Module) -> int:
    """Parameters of the LoRA adapters (not counting ``modules_to_save``)."""
    return sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))


# --------------------------------------------------------------------------- init after materialize


def _set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    local, slices = local_slices(param)
    if local.numel():
        local.copy_(full[slices])


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, PEFT LoRA layer) pairs holding this module's adapter, in the model's order."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]


@torch.no_grad()
def init_adapter_weights(model: nn.Module, init: bool | str = True, seed: int = 0) -> int:
    """PEFT's ``init_lora_weights`` on the (materialized, possibly sharded) adapters; returns layers done.

    ``True``: A ``kaiming_uniform_(a=sqrt(5))`` (``nn.Linear``'s own init, as PEFT does), B zero.
    ``'gaussian'``: A normal with std ``1 / r``, B zero. ``False``: A and B both ``nn.Linear``'s init
    (PEFT's "no init"). Each full tensor is drawn on the CPU in fp32 from one generator seeded with
    ``seed``, layer by layer in the model's order, and each rank copies its shard.
    """
    generator = torch.Generator().manual_seed(seed)
    layers = lora_layers(model)
    for _, layer in layers:
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        full_a = torch.empty(a.shape, dtype=torch.float32)
        full_b = torch.zeros(b.shape, dtype=torch.float32)
        if init == "gaussian":
            nn.init.normal_(full_a, std=1 / layer.r[ADAPTER], generator=generator)
        else:
            nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
            if init is False:
                nn.init.kaiming_uniform_(full_b, a=math.sqrt(5), generator=generator)
        _set_full(a, full_a.to(a.dtype))
        _set_full(b, full_b.to(b.dtype))
    return len(layers)


# --------------------------------------------------------------------------- key names


# --------------------------------------------------------------------------- checkpoints


def state_dict_options(**kwargs):
    """``StateDictOptions`` of a LoRA run's model state: the trainable tensors only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def adapter_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model part of a LoRA training checkpoint: adapters and modules to save (sharded), no base."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=state_dict_options())


def load_adapter_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Load :func:`adapter_state_dict`'s tensors back; refuses unknown keys or a missing trainable one."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing_trainable = sorted(trainable - set(state))
    unexpected = sorted(set(state) - trainable)
    if missing_trainable or unexpected:
        raise UserError(
            "the LoRA checkpoint does not fit this model.lora: "
            + (f"missing {', '.join(missing_trainable[:5])}; " if missing_trainable else "")
            + (f"unexpected {', '.join(unexpected[:5])}; " if unexpected else "")
            + "resume with the model.lora settings the checkpoint was trained with"
        )
    set_model_state_dict(model, state, options=state_dict_options(strict=False))


def checkpoint_entry(applied: LoraApplied, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """``{"lora": {"config": <packed settings>}}``, added to the training state dict."""
    from .checkpoint import pack

    record = json.dumps(applied.to_record(base_model_name_or_path), sort_keys=True)
    return {CHECKPOINT_ENTRY: {"config": pack(record)}}


# --------------------------------------------------------------------------- kernels


def contiguous_linear_patterns(
    patterns: list[str], targets: LoraTargets, model: nn.Module | None = None
) -> list[str]:
    """``features.contiguous_linear_grad_modules`` for a LoRA model: a pattern that matches LoRA targets
    names the wrapped ``nn.Linear`` instead (``<pattern>.base_layer``).

    ``apply_contiguous_linear_grad`` accepts only plain ``torch.nn.Linear`` modules and PEFT's
    ``lora.Linear`` is not one (its message reads "is a Linear, not a torch.nn.Linear"). The base
    layer's weight is frozen, so there the kernel computes only the input gradient (``dW`` is
    skipped): it runs, and saves nothing; the adapters' own Linear layers (``...lora_B.default``) can
    be named explicitly. With ``model``, a pattern matching both adapted and plain layers is a
    UserError (one pattern cannot name both kinds).
    """
    out = []
    chosen = set(targets.modules)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)] if model is not None else []
    for pattern in patterns:
        regex = compile_pattern(pattern)
        hits = [m for m in chosen if regex.match(m)]
        plain = [n for n in names if regex.match(n) and n not in chosen and f".{BASE_LAYER}" not in n]
        if hits and plain:
            raise UserError(
                f"features.contiguous_linear_grad_modules: {pattern!r} matches LoRA targets ({hits[0]}) and plain "
                f"Linear layers ({plain[0]}); list them in separate patterns"
            )
        out.append(f"{pattern}.{BASE_LAYER}" if hits else pattern)
    return out


def refuse_lora_checkpoint_as_load(
    load: str | None, load_format: str = "auto", *, what: str = "training.load"
) -> None:
    """``training.load`` must hold base weights: a LoRA training checkpoint holds adapters only.

    A ``UserError`` naming the way to resume it or to export it; the launcher calls this in its
    pre-flight and the trainer again before it loads anything.
    """
    from pathlib import Path

    from .checkpoint import is_training_checkpoint

    if not load or load_format == "hf":
        return
    path = Path(load)
    if is_training_checkpoint(path) and read_checkpoint_record(path) is not None:
        raise UserError(
            f"{what} {path} is a LoRA training checkpoint (adapters only), not base weights; "
            "set training.load to the base model and training.save to that run's checkpoint "
            "directory to resume it (training.resume: auto), or export it first with "
            "`magistral convert dcp-to-hf --lora merged`"
        )
