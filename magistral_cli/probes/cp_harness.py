"""Measure context parallelism against the CP=1 reference (what the cp-equivalence probe runs).

:func:`run_cp_equivalence` runs one full training step of a tiny Mistral3 with two images,
fixed weights, labels and position ids, twice on every rank of an initialised process group:
the CP=1 reference (the unmodified transformers forward, or the same loss function on the
unsplit sequence) and the CP step. It returns the measured loss relative error, the gradient
relative L2 over every trainable parameter and the SGD-update relative L2. It applies no
thresholds: the caller (probe, test) does. With ``chunk_loss`` both runs use the trainer's own
chunked loss (``engine.model.install_loss_head`` and ``loss_head_sum``, i.e.
``ops.chunked_loss``), as a CP training run with ``features.enable_chunk_loss`` does.

Mixed precision follows FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32)``:
fp32 master weights, a ``dtype`` compute copy, fp32 gradients and fp32 SGD updates.

:func:`run_attention_equivalence` checks the attention alone against full causal SDPA, and
:func:`run_vision_guard_check` that the communication guard bites. The tests run them on fresh
rank processes (tests/ops/test_context_parallel.py), the probe through ``probes.cp_workers``.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from magistral_cli.ops.context_parallel.attention import cp_attention
from magistral_cli.ops.context_parallel.groups import (
    ContextParallelGroups,
    ContextParallelMesh,
    build_cp_mesh,
    cp_communication_count,
    cp_groups_from_mesh,
    mode_sizes,
)
from magistral_cli.ops.context_parallel.layout import gather_from_cp, split_for_cp
from magistral_cli.ops.context_parallel.model import (
    IGNORE_INDEX,
    apply_context_parallel,
    remove_context_parallel,
    shift_labels,
)
from magistral_cli.runtime import DTYPES, device_module, device_type_of_backend, parse_dtype

from .common import relative_l2

_GROUPS: dict[tuple[int, int], tuple[ContextParallelMesh, ContextParallelGroups]] = {}


def _device() -> torch.device:
    """This rank's device, from the process group's backend (gloo: the CPU)."""
    device_type = device_type_of_backend(dist.get_backend())
    module = device_module(device_type)
    return torch.device("cpu") if module is None else torch.device(device_type, module.current_device())


def cp_meshes_for(mode: str, ulysses_size: int | None = None, ring_size: int | None = None):
    """``(meshes, groups)`` for ``mode`` over the whole world (DP = 1) unless the sizes are
    given; cached, since every rank must create the same groups in the same order."""
    if ulysses_size is None or ring_size is None:
        ulysses_size, ring_size = mode_sizes(mode, dist.get_world_size())
    key = (ulysses_size, ring_size)
    if key not in _GROUPS:
        meshes = build_cp_mesh(_device().type, ulysses_size, ring_size)
        _GROUPS[key] = (meshes, cp_groups_from_mesh(meshes))
    return _GROUPS[key]


def cp_groups_for(mode: str, ulysses_size: int | None = None, ring_size: int | None = None):
    return cp_meshes_for(mode, ulysses_size, ring_size)[1]


# --------------------------------------------------------------------------- attention alone


def run_attention_equivalence(
    mode: str,
    dtype=torch.float32,
    batch: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seq_len: int = 32,
    head_dim: int = 16,
    seed: int = 0,
    ulysses_size: int | None = None,
    ring_size: int | None = None,
    ring_kernel: str | None = None,
) -> dict:
    """CP attention vs full causal SDPA: output and query/key/value gradient relative L2.

    ``ring_kernel`` names a ring block kernel (``math``, ``cpu_flash``); default: the device's.
    """
    from magistral_cli.ops.context_parallel.attention import _BACKENDS
    from magistral_cli.ops.context_parallel.ring import BLOCK_KERNELS

    groups = cp_groups_for(mode, ulysses_size, ring_size)
    dtype, device = parse_dtype(dtype), _device()
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k = randn(batch, heads, seq_len, head_dim), randn(batch, kv_heads, seq_len, head_dim)
    v = randn(batch, kv_heads, seq_len, head_dim)
    dout = randn(batch, heads, seq_len, head_dim)
    scale = head_dim**-0.5

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(
        *full, is_causal=True, scale=scale, enable_gqa=kv_heads != heads
    )
    expected.backward(dout)

    local = [split_for_cp(t, groups, dim=2).detach().requires_grad_() for t in (q, k, v)]
    calls = cp_communication_count()
    saved = _BACKENDS["ring_kernel"]
    _BACKENDS["ring_kernel"] = BLOCK_KERNELS[ring_kernel]() if ring_kernel else saved
    try:
        out = cp_attention(*local, groups, scale)
        out.backward(split_for_cp(dout, groups, dim=2))
    finally:
        _BACKENDS["ring_kernel"] = saved
    result = {
        "mode": groups.mode,
        "ulysses_size": groups.ulysses_size,
        "ring_size": groups.ring_size,
        "heads": heads,
        "kv_heads": kv_heads,
        "ring_kernel": ring_kernel,
        "dtype": str(dtype).removeprefix("torch."),
        "output_relative_l2": relative_l2(gather_from_cp(out.detach(), groups, dim=2), expected),
    }
    for name, loc, ref in zip(("query", "key", "value"), local, full, strict=True):
        result[f"{name}_grad_relative_l2"] = relative_l2(gather_from_cp(loc.grad, groups, dim=2), ref.grad)
    result["cp_communications"] = cp_communication_count() - calls
    return result


# --------------------------------------------------------------------------- one training step


def equivalence_batch(
    vocab_size: int, seq_len: int = 61, seed: int = 123, device="cpu", right_padding: int = 0
) -> dict:
    """Fixed ids, two images (6 image tokens each, different aspect), labels and position ids;
    with ``right_padding``, that many trailing pad tokens, masked and ignored by the loss."""
    from magistral_cli.testing.tiny_model import IMAGE_TOKEN_ID

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, vocab_size, (1, seq_len), generator=gen)
    ids[0, 2:8] = IMAGE_TOKEN_ID  # image 1: 56 x 84 pixels -> 2 x 3 merged patches
    ids[0, 44:50] = IMAGE_TOKEN_ID  # image 2: 84 x 56 pixels -> 3 x 2 (crosses a ring chunk boundary)
    labels = ids.clone()
    labels[ids == IMAGE_TOKEN_ID] = IGNORE_INDEX
    labels[0, :2] = IGNORE_INDEX
    pixels = torch.randn(2, 3, 84, 84, generator=gen)
    pixels[0, :, 56:, :] = 0  # image 1 is 56 high, padded like the collator does
    pixels[1, :, :, 56:] = 0
    batch = {
        "input_ids": ids.to(device),
        "labels": labels.to(device),
        "pixel_values": pixels.to(device),
        "image_sizes": torch.tensor([[56, 84], [84, 56]], device=device),
        "position_ids": torch.arange(seq_len, device=device).unsqueeze(0),
    }
    if right_padding:
        mask = torch.ones_like(ids)
        mask[0, seq_len - right_padding :] = 0
        ids[0, seq_len - right_padding :] = 11  # a pad id
        labels[0, seq_len - right_padding :] = IGNORE_INDEX
        batch["attention_mask"] = mask.to(device)
        batch["input_ids"], batch["labels"] = ids.to(device), labels.to(device)
    return batch


def _reference_loss(model, batch, loss_fn):
    """The CP=1 loss through the root module (so FSDP2's root hooks run as in training)."""
    if loss_fn is None:  # the unmodified transformers forward and loss
        return model(**batch, use_cache=False).loss

    def forward(self, labels, **inputs):
        hidden = self.model(**inputs, use_cache=False).last_hidden_state
        targets = shift_labels(labels)
        return loss_fn(hidden, self.lm_head, targets, (targets != IGNORE_INDEX).sum())

    model.forward = types.MethodType(forward, model)
    try:
        return model(**batch)
    finally:
        del model.forward


def _count_vision_communication(model) -> tuple[list, dict]:
    """Hooks that count CP collectives issued while the vision tower and projector run."""
    counts = {"calls": 0, "runs": 0}
    handles = []
    for module in (model.model.vision_tower, model.model.multi_modal_projector):
        start = {}

        def pre(_module, _args, start=start):
            start["n"] = cp_communication_count()

        def post(_module, _args, _out, start=start):
            counts["calls"] += cp_communication_count() - start["n"]
            counts["runs"] += 1

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles, counts


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_like_the_trainer(model, meshes, dtype) -> list:
    """FSDP2 over ``dp x cp`` as the trainer shards: ``engine.parallelize.apply_fsdp`` with the
    recipe's default units (``parallel.fsdp_plan``), ``param_dtype=dtype``, fp32 reduction."""
    from magistral_cli.config.schema import FSDPPlan
    from magistral_cli.engine.model import output_capture_survives_wrapping
    from magistral_cli.engine.parallelize import apply_fsdp

    plan = FSDPPlan(param_dtype=next(name for name, d in DTYPES.items() if d == dtype), reduce_dtype="fp32")
    with output_capture_survives_wrapping(model):
        return apply_fsdp(model, meshes.dp_cp, plan)


def run_cp_equivalence(
    mode: str,
    dtype=torch.float32,
    chunk_loss: bool = False,
    ulysses_size: int | None = None,
    ring_size: int | None = None,
    seq_len: int = 61,
    chunk_size: int = 8,
    lr: float = 0.01,
    seed: int = 0,
    freeze_vision: bool = False,
    fsdp: bool = False,
    right_padding: int = 0,
    recompute: bool = False,
    loss_fn=None,
) -> dict:
    """One training step under CP against CP=1 on the same ranks; returns the measured errors.

    Runs inside an initialised process group; ``mode`` is ulysses, ring or hybrid over the whole
    world unless ``ulysses_size`` / ``ring_size`` are given (the rest is data parallel, whose
    replicas hold the same batch). Every rank returns the same numbers.

    The loss is the plain transformers one, or with ``chunk_loss`` the trainer's chunked loss
    (``lm_head`` turned into the trainer's ``LossHead``, ``chunk_size`` tokens a chunk, called
    through ``loss_head_sum`` as the trainer's CP forward calls it), or ``loss_fn`` (a
    ``ops.context_parallel.model.LossFn``) for both runs. ``recompute`` checkpoints every decoder
    layer; ``right_padding`` pads the batch on the right with a mask.

    ``fsdp=False``: fp32 master weights and a ``dtype`` compute copy; CP partial gradients are
    averaged over the CP group by hand. ``fsdp=True``: the model is sharded with
    FSDP2 over ``dp x cp`` (``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32)``) with
    its default gradient averaging, in both steps, as the trainer runs it.
    """
    from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

    meshes, groups = cp_meshes_for(mode, ulysses_size, ring_size)
    dtype, device = parse_dtype(dtype), _device()
    master = build_tiny_model(tiny_mistral3_config(vocab_size=512), seed=seed).to(device).train()
    master.config.text_config._attn_implementation = "sdpa"
    if recompute:  # activation checkpointing of every decoder layer: attention reruns in backward
        master.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if freeze_vision:
        master.model.vision_tower.requires_grad_(False)
        master.model.multi_modal_projector.requires_grad_(False)
    if loss_fn is None and chunk_loss:
        from magistral_cli.engine.model import install_loss_head, loss_head_sum

        # Before sharding and before the compute copy, as the trainer installs it.
        install_loss_head(master, "lm_head", chunk_size)
        loss_fn = loss_head_sum
    if fsdp:
        _shard_like_the_trainer(master, meshes, dtype)
        compute = master
    else:
        compute = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    trainable = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    compute_params = dict(compute.named_parameters())
    initial = {n: p.detach().clone() for n, p in trainable}
    initial_full = {n: _full(p) for n, p in initial.items()}
    optimizer = torch.optim.SGD([p for _, p in trainable], lr=lr)
    batch = equivalence_batch(
        master.config.text_config.vocab_size, seq_len, device=device, right_padding=right_padding
    )
    if not fsdp:
        batch["pixel_values"] = batch["pixel_values"].to(dtype)

    def step(forward, cp: bool):
        optimizer.zero_grad(set_to_none=True)
        for p in compute.parameters():
            p.grad = None
        loss = forward()
        loss.backward()
        if fsdp:
            grads = [_full(p.grad) for _, p in trainable]
        else:
            grads = [compute_params[n].grad.float() for n, _ in trainable]
        flat = torch.cat([g.flatten() for g in grads])
        if not fsdp:
            if cp:
                # What FSDP2 does over dp x cp: average (the DP replicas are identical here).
                dist.all_reduce(flat, group=groups.cp_group)
                flat /= groups.cp_size
            for (_, p), g in zip(trainable, flat.split([g.numel() for g in grads]), strict=True):
                p.grad = g.view_as(p)
        optimizer.step()
        updates = torch.cat([(_full(p.detach()) - initial_full[n]).flatten() for n, p in trainable])
        with torch.no_grad():  # back to the initial weights for the next run
            for n, p in trainable:
                p.copy_(initial[n])
                if compute is not master:
                    compute_params[n].copy_(initial[n])
        return loss.detach().float(), flat, updates

    world = dist.get_world_size()
    ref_loss, ref_grads, ref_updates = step(lambda: _reference_loss(compute, batch, loss_fn), cp=False)

    apply_context_parallel(compute, groups, loss_fn=loss_fn)
    handles, vision = _count_vision_communication(compute)
    calls = cp_communication_count()
    try:
        cp_loss, cp_grads, cp_updates = step(lambda: compute(**batch).loss, cp=True)
    finally:
        for handle in handles:
            handle.remove()
        remove_context_parallel(compute)
    # The replicated vision tower and projector separately: their small gradients would hide
    # in the total, and their split semantics differ from the decoder's.
    vision_mask = torch.cat(
        [
            torch.full((p.numel(),), n.startswith(("model.vision_tower.", "model.multi_modal_projector.")))
            for n, p in trainable
        ]
    ).to(cp_grads.device)
    return {
        "mode": groups.mode,
        "ulysses_size": groups.ulysses_size,
        "ring_size": groups.ring_size,
        "world_size": world,
        "dtype": str(dtype).removeprefix("torch."),
        "chunk_loss": chunk_loss,
        "fsdp": fsdp,
        "seq_len": seq_len,
        "right_padding": right_padding,
        "recompute": recompute,
        "trainable_parameters": int(ref_grads.numel()),
        "reference_loss": ref_loss.item(),
        "loss": cp_loss.item(),
        "loss_relative_error": abs(cp_loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "gradient_relative_l2": relative_l2(cp_grads, ref_grads),
        "update_relative_l2": relative_l2(cp_updates, ref_updates),
        "cp_communications": cp_communication_count() - calls,
        "vision_runs": vision["runs"],
        "vision_cp_communications": vision["calls"],
        "vision_gradient_relative_l2": (
            relative_l2(cp_grads[vision_mask], ref_grads[vision_mask]) if vision_mask.any() else None
        ),
        "decoder_gradient_relative_l2": relative_l2(cp_grads[~vision_mask], ref_grads[~vision_mask]),
    }


def run_vision_guard_check(mode: str = "ulysses") -> dict:
    """Show that the communication guard bites: a CP collective inside a forbidden block raises,
    and a model whose vision tower was given the CP attention is refused."""
    from magistral_cli.ops.context_parallel.attention import ATTENTION_NAME
    from magistral_cli.ops.context_parallel.groups import ContextParallelError, forbid_cp_communication
    from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

    groups = cp_groups_for(mode)
    result = {"mode": groups.mode}
    q = torch.randn(1, 4, 8, 16)
    try:
        with forbid_cp_communication("the guard check"):
            cp_attention(q, q, q, groups, 0.25)
        result["guard_error"] = None
    except ContextParallelError as error:
        result["guard_error"] = str(error)

    model = build_tiny_model(tiny_mistral3_config(vocab_size=512)).train()
    apply_context_parallel(model, groups)
    model.config.vision_config._attn_implementation = ATTENTION_NAME
    batch = equivalence_batch(512)
    try:
        model(**batch)
        result["vision_error"] = None
    except ContextParallelError as error:
        result["vision_error"] = str(error)
    return result
