"""Process groups, the device mesh, and the ordered transformations that make the model trainable.

:func:`parallelize_model` applies them in their one correct order (its docstring says why each
step sits where it does); the ``apply_*`` functions are its steps, usable on their own in tests.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from magistral_cli.config.patterns import select_modules
from magistral_cli.config.schema import FSDPPlan, Recipe, check_world_size
from magistral_cli.runtime import DTYPES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of the (data parallel, context parallel) mesh, checked once."""

    world_size: int
    dp: int
    cp: int
    ulysses: int = 1
    ring: int = 1

    @classmethod
    def from_recipe(cls, recipe: Recipe, world_size: int) -> ParallelDims:
        dp = check_world_size(recipe, world_size)
        par = recipe.parallel
        return cls(
            world_size=world_size,
            dp=dp,
            cp=par.cp_size,
            ulysses=par.ulysses_parallel_size,
            ring=par.ring_attention_size,
        )

    def build_mesh(self, device_type: str):
        """The device meshes (a ``ContextParallelMesh``: ``.mesh``, ``.dp``, ``.cp``, ``.dp_cp``).

        With CP: ``("dp", "ring", "ulysses")`` (the layout the CP attention expects), FSDP over
        the flattened ``dp_cp``, as the seed does. Without: ``("dp", "cp")`` with cp = 1, and
        ``dp_cp`` is the dp mesh itself (1D: given a 2D mesh, fully_shard means HSDP).
        """
        from magistral_cli.ops.context_parallel import ContextParallelMesh, build_cp_mesh

        if self.cp > 1:
            return build_cp_mesh(device_type, self.ulysses, self.ring, self.world_size)
        mesh = init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
        return ContextParallelMesh(mesh=mesh, dp=mesh["dp"], cp=mesh["cp"], dp_cp=mesh["dp"])


def apply_freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Stop gradients for every module matched by ``patterns``; return the frozen module names.

    Before FSDP: fully_shard records each parameter's requires_grad when it builds its groups.
    """
    frozen = select_modules(model, patterns, what="model.freeze pattern") if patterns else []
    for _, module in frozen:
        module.requires_grad_(False)
    return [name for name, _ in frozen]


def apply_ac(model: nn.Module, patterns: list[str]) -> list[str]:
    """Recompute the activations of each matched module in the backward instead of keeping them.

    The module's own ``forward`` is wrapped (names and keys stay unchanged). Before FSDP, so
    that FSDP's hooks run around the checkpointed region: in the backward, FSDP's pre-backward
    hook gathers the parameters once and the recomputation reuses them.
    """
    matched = select_modules(model, patterns, what="features.recompute_plan pattern")
    for _, module in matched:
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
    return [name for name, _ in matched]


#: The blocks ``model.compile`` compiles: the decoder layers, where the step's time goes.
COMPILE_PATTERN = "model.language_model.layers.{*}"


def apply_compile(model: nn.Module) -> list[str]:
    """``torch.compile`` each decoder layer's forward (torchtitan's per-block compile).

    Per block, not the whole model: every layer has the same code, so one compiled graph serves
    them all, and the compile time does not grow with the depth. The forward is replaced in
    place (as recompute does), after recompute, so the compiled region holds the checkpointed
    computation, and before FSDP, whose hooks stay outside it.
    """
    matched = select_modules(model, [COMPILE_PATTERN], what="model.compile")
    for _, module in matched:
        module.forward = torch.compile(module.forward)
    return [name for name, _ in matched]


def mixed_precision(plan: FSDPPlan) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[plan.param_dtype] if plan.param_dtype else None,
        reduce_dtype=DTYPES[plan.reduce_dtype] if plan.reduce_dtype else None,
    )


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, plan: FSDPPlan, device: torch.device | None = None
) -> list[tuple[str, nn.Module]]:
    """``fully_shard`` each module matched by ``plan.apply_modules`` in the order given, then the root.

    Bottom-up: a module is sharded after the modules nested in it, so each FSDP unit owns only
    the parameters no inner unit took. Returns the (name, module) units in that order. On one
    rank the parameters of :func:`left_unsharded` stay plain, on ``device`` (FSDP2 moves only
    what it manages).
    """
    policy = mixed_precision(plan)
    units = select_modules(model, plan.apply_modules, what="parallel.fsdp_plan.apply_modules pattern")
    units = tied_units(model, units)
    kwargs = {"mesh": mesh, "mp_policy": policy}
    ignored = left_unsharded(model, mesh.size(), policy.param_dtype)
    if ignored:
        kwargs["ignored_params"] = ignored
        log.info(
            "one rank: %s frozen parameter elements used in place, not gathered by FSDP2",
            f"{sum(p.numel() for p in ignored):,}",
        )
        with torch.no_grad():
            for param in ignored:
                if device is not None and not param.is_meta and param.device != device:
                    param.data = param.data.to(device)
    reshard = plan.reshard_after_forward
    for _, module in units:
        fully_shard(module, reshard_after_forward=bool(reshard), **kwargs)
    # The root last: it owns what no unit took, lazy init and the backward's final callback.
    # By default FSDP keeps the root gathered after the forward (its heuristic for None): the
    # backward needs the root's parameters (the output head) first, so freeing them would only
    # buy an immediate second all-gather. "always" frees it too; false keeps every unit.
    fully_shard(model, reshard_after_forward={True: None, False: False, "always": True}[reshard], **kwargs)
    if reshard is True:
        kept = keep_forward_tail_gathered(model)
        if kept:
            log.info("kept gathered from forward to backward: %s", ", ".join(kept))
    return units


def keep_forward_tail_gathered(model: nn.Module) -> list[str]:
    """Leave the units of the forward's tail (the last decoder layer, the final norm, the output
    head, and any unit inside them: ``model_config.forward_tail_modules``) gathered from their
    forward to their backward; return their names, in forward order.

    The backward starts with exactly these units, so resharding them after the forward would only
    buy an immediate second all-gather of the same values (on one rank, a second cast and copy).
    FSDP2 already keeps the root so; torchtitan keeps its last block and its norm and head. The
    memory plan counts them held together at the start of the backward. Only for a model that
    trains: a unit whose forward has no backward (a preference run's separate reference model)
    would stay gathered until the next save.
    """
    from magistral_cli.model_config import forward_tail_modules, in_forward_tail

    config = getattr(model, "config", None)
    if config is None or not any(p.requires_grad for p in model.parameters()):
        return []
    tail = forward_tail_modules(config)
    names = {id(m): n for n, m in model.named_modules()}
    kept = []
    for unit in fsdp_units_in_order(model):
        name = names.get(id(unit), "")
        if in_forward_tail(name, tail):
            unit.set_reshard_after_forward(False, recurse=False)
            kept.append(name)
    return kept


def left_unsharded(model: nn.Module, group_size: int, param_dtype: torch.dtype | None) -> set[nn.Parameter]:
    """The parameters FSDP2 leaves alone (``ignored_params``) when its group is one rank: every
    frozen parameter stored in the compute dtype (``param_dtype``; any, when it is unset), and
    QLoRA's NF4 weights.

    With one rank there is nothing to shard or gather, yet FSDP2's one-rank shortcut (torch
    2.13's ``FSDPParamGroup.wait_for_unshard``) still copies each unit's parameters into a second,
    unsharded buffer at every forward and again in the backward, and keeps the root's for the
    whole step. A frozen parameter already in the compute dtype is used as it is: the same values,
    no copy, no second buffer. That is the whole base of a LoRA or QLoRA run and a preference
    run's reference (both stored in ``param_dtype``) and a frozen vision tower when the compute
    dtype is fp32. Trainable parameters stay FSDP2's, which casts them to ``param_dtype`` and
    reduces their gradients in ``reduce_dtype``. The shortcut also takes only the first of a
    tensor subclass's all-gather inputs, where ``NF4Tensor`` has three.
    """
    from .qlora import is_nf4

    if group_size != 1:
        return set()
    return {
        p
        for p in model.parameters()
        if is_nf4(p) or (not p.requires_grad and (param_dtype is None or p.dtype == param_dtype))
    }


TIED_UNIT = "model.language_model.embed_tokens+lm_head"


def tied_units(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, object]]:
    """The FSDP units with a tied embedding and head in one unit (unchanged when they are not tied).

    A tied model's head and embedding are one parameter, and FSDP2 refuses a parameter that two
    units manage ("shared with a parameter already managed by another FSDP group"). So the two
    modules are sharded together, ``fully_shard([embed_tokens, lm_head])``, in place of the
    first unit that holds either; the plan's own units for either one are dropped, and an outer
    unit (``model.language_model``) then leaves the shared parameter to the group.
    """
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embed is None or head is None or embed.weight is not head.weight:
        return units
    out: list[tuple[str, object]] = []
    placed = False
    for name, module in units:
        holds = any(m is embed or m is head for m in module.modules())
        if holds and not placed:
            out.append((TIED_UNIT, [embed, head]))
            placed = True
        if module is embed or module is head:
            continue
        out.append((name, module))
    if not placed:
        out.append((TIED_UNIT, [embed, head]))
    log.info("tied embedding and head: sharded as one FSDP unit (%s)", TIED_UNIT)
    return out


def fsdp_units_in_order(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit below the root, once each, in the order their forwards start.

    The seed's ``set_modules_to_prefetch`` (MindSpeed-MM ``fully_shard_parallel.py``) chains the
    wrapped modules as ``model.modules()`` visits them: a parent before its children, siblings in
    registration order. That is the forward order of Mistral3 but for one unit: the input
    embedding, which ``Mistral3Model.forward`` calls first (it embeds ``input_ids``, then merges
    the image features), while it is registered inside ``model.language_model``, after the vision
    tower. Left there, ``model.language_model`` would prefetch an embedding that already ran: a
    second all-gather of the largest unit, held gathered until its backward. So the unit holding
    ``get_input_embeddings()`` goes first, and the rest keep the seed's order
    (tests/engine/test_prefetch.py checks the chain against the order the forward hooks fire).

    Units are FSDP states, not modules: a grouped unit such as the tied ``[embed_tokens, lm_head]``
    (``tied_units``) makes both modules ``FSDPModule`` instances sharing one state, so it is
    listed once. The root is left out, as in the seed: its pre-forward runs before everything.
    """
    root_state = model._get_fsdp_state() if isinstance(model, FSDPModule) else None
    seen: set[int] = set()
    units = []
    for module in model.modules():
        if module is model or not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if state is root_state or id(state) in seen:
            continue
        seen.add(id(state))
        units.append(module)
    get_embed = getattr(model, "get_input_embeddings", None)
    embed = get_embed() if callable(get_embed) else None
    if isinstance(embed, FSDPModule):
        state = embed._get_fsdp_state()
        first = [u for u in units if u._get_fsdp_state() is state]
        units = first + [u for u in units if u._get_fsdp_state() is not state]
    return units


def prefetch_plan(units: list, forward: int, backward: int) -> list[tuple[object, list, list]]:
    """(unit, forward prefetch list, backward prefetch list) for every unit of a forward-ordered chain.

    The seed's rule: in forward each unit prefetches the next ``forward`` units; in backward (the
    reverse order) the next ``backward`` units of the reversed chain, nearest first.
    """
    plan = []
    for i, unit in enumerate(units):
        ahead = units[i + 1 : i + 1 + forward] if forward else []
        behind = units[max(0, i - backward) : i][::-1] if backward else []
        plan.append((unit, ahead, behind))
    return plan


def apply_prefetch(model: nn.Module, plan: FSDPPlan, leave_out: Sequence[nn.Module] = ()) -> int:
    """Explicit all-gather prefetch along every FSDP unit of the model, as the seed chains it.

    ``num_to_forward_prefetch`` / ``num_to_backward_prefetch`` units ahead, over the whole chain
    of ``fsdp_units_in_order`` (not only within one ``{*}`` pattern: the last vision layer
    prefetches the projector, the last decoder layer the head). Only ``FSDPModule`` instances
    are chained, each unit once (a tied group is one unit). FSDP2 overlaps one unit ahead
    implicitly; explicit prefetch issues the all-gathers earlier from the CPU and, above 1, holds
    more gathered units at once (the memory plan counts ``num_to_backward_prefetch``). Returns
    how many units got a prefetch list.

    ``leave_out``: modules whose units the forward will not run (the frozen vision tower and
    projector when text-only micro-batches skip them, ``Mistral3ForTraining.blank_vision_forward``
    off); calling again re-chains without them, since a unit prefetched but never run would stay
    gathered.
    """
    nf, nb = plan.num_to_forward_prefetch, plan.num_to_backward_prefetch
    if nf == 0 and nb == 0:
        return 0
    units = fsdp_units_in_order(model)
    if leave_out:
        inside = {id(m) for outer in leave_out for m in outer.modules()}
        left = [u for u in units if id(u) in inside]
        units = [u for u in units if id(u) not in inside]
        for unit in left:  # never run, so never asked to prefetch either
            unit.set_modules_to_forward_prefetch([])
            unit.set_modules_to_backward_prefetch([])
    count = 0
    for unit, ahead, behind in prefetch_plan(units, nf, nb):
        unit.set_modules_to_forward_prefetch(ahead)
        unit.set_modules_to_backward_prefetch(behind)
        count += bool(ahead or behind)
    return count


def skip_blank_vision_forward(
    model: nn.Module, plan: FSDPPlan, *, fsdp_world: int, images_possible: bool
) -> bool:
    """Turn off the blank vision forward of text-only micro-batches where nothing needs it
    (``model.blank_vision_forward_needed``), and chain the prefetch without the tower and the
    projector, which then run only for images. Returns whether it was turned off."""
    from .model import blank_vision_forward_needed

    if blank_vision_forward_needed(model, fsdp_world=fsdp_world, images_possible=images_possible):
        return False
    model.blank_vision_forward = False
    inner = model.model
    apply_prefetch(model, plan, leave_out=[inner.vision_tower, inner.multi_modal_projector])
    return True


@dataclass
class ParallelizedModel:
    """What :func:`parallelize_model` did, for the trainer's log and record."""

    frozen: list[str] = field(default_factory=list)
    contiguous_linear: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    compiled: list[str] = field(default_factory=list)
    units: list[tuple[str, object]] = field(default_factory=list)
    context_parallel: str | None = None


def parallelize_model(
    model: nn.Module,
    recipe: Recipe,
    *,
    device_type: str,
    device: torch.device,
    mesh: DeviceMesh,
    cp_groups=None,
    loss_fn=None,
    lora=None,
) -> ParallelizedModel:
    """Make a freshly built model trainable in place, in this order (each step needs the last):

    0. (Before this function, after the loss head) **LoRA** (``model.lora``, ``lora``: what
       ``engine.lora.apply_lora`` did): PEFT's layers replace the target Linear layers and the
       base is frozen, so every later step sees the final modules and ``requires_grad``. With
       ``quantize_base: nf4`` the frozen decoder Linear weights then become (meta) NF4 tensors
       (``engine.qlora.quantize_base_``), so FSDP2 shards and all-gathers them 4-bit.
    1. **Freeze** (``model.freeze``): ``fully_shard`` records ``requires_grad`` when it builds its
       parameter groups, so this comes before FSDP.
    2. **Module kernels**: the contiguous-Linear weight gradient
       (``features.contiguous_linear_grad_modules``) and the per-image vision attention (every
       device: no dense block mask over all images) replace forwards of plain modules, so they
       run before anything wraps those modules.
    3. **Recompute** (``features.recompute_plan``): activation checkpointing wraps forwards before
       FSDP, so FSDP's hooks run around the recomputed region and the backward gathers each unit's
       parameters once.
    3b. **Compile** (``model.compile``): each decoder layer's forward through ``torch.compile``,
       after recompute (the compiled region holds the checkpointed computation) and before FSDP
       (whose hooks stay outside it).
    4. **FSDP2** (``parallel.fsdp_plan``): ``fully_shard`` bottom-up over the units, then the root;
       the Triton split-copy kernel is registered before the first all-gather can run.
    5. **Prefetch**: explicit all-gather prefetch along the chain of units; needs the units.
    6. **Context parallelism** (``cp_groups``): the decoder runs on this rank's part of the
       sequence and the root forward returns the loss sum over the whole sequence (``loss_fn``
       computes it from the hidden states); it wraps the sharded model's forward.
    7. **Materialize** (``training.init_model_with_meta_device``): allocate the sharded storage on
       ``device`` (QLoRA's NF4 weights too: ``qlora.materialize_nf4_``); the weights are loaded
       afterwards (an NF4 weight is quantised as it loads).
    8. **LoRA init** (with ``lora``): PEFT's ``init_lora_weights`` re-run on the sharded adapters,
       each full tensor drawn from ``training.seed`` (a meta build leaves them uninitialised; the
       values do not depend on the sharding or on the meta build). The base loader skips them.
    """
    plan, features = recipe.parallel.fsdp_plan, recipe.features
    done = ParallelizedModel()
    done.frozen = apply_freeze(model, recipe.model.freeze)
    if features.contiguous_linear_grad_modules:
        from magistral_cli.ops.contiguous_linear import WHAT, apply_contiguous_linear_grad

        patterns = list(features.contiguous_linear_grad_modules)
        if lora is not None:
            from .lora import contiguous_linear_patterns

            # A LoRA target's kernel goes on PEFT's wrapped nn.Linear (``<name>.base_layer``).
            patterns = contiguous_linear_patterns(patterns, lora.targets, model)
        param_dtype = DTYPES[plan.param_dtype] if plan.param_dtype else torch.float32
        done.contiguous_linear = apply_contiguous_linear_grad(
            select_modules(model, patterns, what=WHAT), device=device_type, param_dtype=param_dtype
        )
        log.info("contiguous Linear weight gradients on %d modules", len(done.contiguous_linear))
    from magistral_cli.ops.vision_attention import apply_vision_attention

    apply_vision_attention(model, device_type)
    if features.recompute:
        done.recomputed = apply_ac(model, features.recompute_plan.apply_modules)
        log.info("activation checkpointing on %d modules", len(done.recomputed))
    if recipe.model.compile:
        done.compiled = apply_compile(model)
        log.info("torch.compile on %d decoder layers", len(done.compiled))
    if plan.use_triton_split_copy:
        from magistral_cli.ops.split_copy import enable_triton_split_copy

        enable_triton_split_copy()
    from .model import materialize, output_capture_survives_wrapping

    with output_capture_survives_wrapping(model):
        done.units = apply_fsdp(model, mesh, plan, device)
    apply_prefetch(model, plan)
    if cp_groups is not None:
        from magistral_cli.ops.context_parallel import apply_context_parallel

        apply_context_parallel(model, cp_groups, loss_fn=loss_fn)
        done.context_parallel = (
            f"{cp_groups.mode} (ulysses {cp_groups.ulysses_size} x ring {cp_groups.ring_size})"
        )
        log.info("context parallel: %s", done.context_parallel)
    if recipe.training.init_model_with_meta_device:
        materialize(model, device)
        from .qlora import materialize_nf4_

        materialize_nf4_(model, device)
    if lora is not None:
        from .lora import init_adapter_weights

        init_adapter_weights(model, lora.spec.init_lora_weights, recipe.training.seed)
    return done
