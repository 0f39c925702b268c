"""LoRA under FSDP2: PEFT's LoRA layers sharded per decoder layer on 2 gloo ranks, against one process.

Each rank builds the tiny Mistral3 on the meta device, injects the adapters (``engine.lora``),
recomputes the decoder layers, runs the chunked loss, shards it as ``apply_fsdp`` does, materializes,
loads the base weights through ``lora.base_state_dict`` (plain checkpoint names) and re-runs PEFT's
init. The same steps on an unsharded PEFT model in one process must give the same losses, adapter
gradients and adapter weights (fp32, 1e-5); the base must not move and only adapters may hold
gradients and AdamW state. The contiguous-Linear kernel runs on the wrapped layers' ``base_layer``
and on an adapter's own Linear; a checkpoint of the adapters (real DCP) resumes exactly; Ulysses CP
on 2 ranks gives the 1-process loss and gradients; a frozen bf16 base shares FSDP2 units with fp32
adapters.
"""

from __future__ import annotations

import math

import pytest
import torch

from magistral_cli.runtime import spawn_ranks

pytestmark = [pytest.mark.compat, pytest.mark.slow]

VOCAB = 512
SEQ = 24
STEPS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS = "model.language_model.layers.{*}"
KERNEL = [f"{LAYERS}.mlp.down_proj", f"{LAYERS}.mlp.down_proj.lora_B.default"]


def _spec(**kwargs):
    from magistral_cli.config.schema import LoraConfig

    return LoraConfig(r=4, alpha=8, target_modules=TARGETS, **kwargs)


def _config():
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    return tiny_mistral3_config(vocab_size=VOCAB)


def _base_state() -> dict[str, torch.Tensor]:
    """The base weights under their checkpoint names (what an HF or DCP checkpoint holds)."""
    from magistral_cli.engine.model import build_model

    torch.manual_seed(0)
    return {
        k: v.clone()
        for k, v in build_model(_config(), meta=False, attn_implementation="sdpa").state_dict().items()
    }


def _batches(world: int) -> list[dict[str, torch.Tensor]]:
    """One micro-batch (one sample) per rank and step; some targets ignored."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * world):
        ids = torch.randint(20, VOCAB, (1, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :5] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return out


def _targets_count(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def _reference(spec, base, batches, world: int, cp_batches=False) -> dict:
    """The unsharded PEFT model in this process: losses, first-step grads, final adapters."""
    from magistral_cli.engine import lora
    from magistral_cli.engine.model import build_model, install_loss_head

    model = build_model(_config(), meta=False, attn_implementation="sdpa")
    install_loss_head(model, "lm_head", 16)
    lora.apply_lora(model, spec)
    for key, tensor in lora.base_state_dict(model.state_dict()).items():
        tensor.data.copy_(base[key])
    lora.init_adapter_weights(model, spec.init_lora_weights, seed=7)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    losses, grads = [], None
    for step in range(STEPS):
        if cp_batches:
            group = [batches[step]]
        else:
            group = batches[step * world : (step + 1) * world]
        count = sum(_targets_count(b) for b in group)
        total = sum(model(**b) for b in group) / count
        total.backward()
        losses.append(float(total.detach()))
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "grads": grads, "adapters": adapters}


def _sharded_model(spec, base, mesh, plan, *, kernel: bool, cp_groups=None):
    """The trainer's build order: meta build, loss head, LoRA, kernels, recompute, FSDP2, materialize, load."""
    from magistral_cli.config.patterns import select_modules
    from magistral_cli.engine import lora
    from magistral_cli.engine.model import (
        build_model,
        install_loss_head,
        loss_head_sum,
        materialize,
        output_capture_survives_wrapping,
    )
    from magistral_cli.engine.parallelize import apply_ac, apply_fsdp
    from magistral_cli.ops.contiguous_linear import WHAT, apply_contiguous_linear_grad
    from magistral_cli.runtime import DTYPES

    model = build_model(_config(), meta=True, attn_implementation="sdpa")
    install_loss_head(model, "lm_head", 16)
    dtype = DTYPES[plan.param_dtype] if plan.param_dtype else None
    applied = lora.apply_lora(model, spec, freeze=["model.vision_tower"], frozen_dtype=dtype)
    if kernel:
        patterns = lora.contiguous_linear_patterns(KERNEL, applied.targets, model)
        apply_contiguous_linear_grad(
            select_modules(model, patterns, what=WHAT), device="cpu", param_dtype=torch.float32, force=True
        )
    apply_ac(model, [LAYERS])
    with output_capture_survives_wrapping(model):
        apply_fsdp(model, mesh, plan)
    if cp_groups is not None:
        from magistral_cli.ops.context_parallel import apply_context_parallel

        apply_context_parallel(model, cp_groups, loss_fn=loss_head_sum)
    materialize(model, torch.device("cpu"))
    with torch.no_grad():
        for key, tensor in lora.base_state_dict(model.state_dict()).items():
            lora._set_full(tensor, base[key].to(tensor.dtype))
    lora.init_adapter_weights(model, spec.init_lora_weights, seed=7)
    return model, applied


def _full(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _train_sharded(model, batches, rank, world, optimizer, steps, first_step=0, cp=False):
    import torch.distributed as dist

    losses, grads = [], None
    for step in range(first_step, first_step + steps):
        if cp:
            mine = batches[step]
            count = _targets_count(mine)
            loss_sum = model(**mine, num_items_in_batch=1).loss
            # The CP loss is the whole sequence's sum on every rank; FSDP averages over the 2 ranks.
            (loss_sum / count).backward()
            loss = float(loss_sum.detach()) / count
        else:
            group = batches[step * world : (step + 1) * world]
            count = sum(_targets_count(b) for b in group)
            loss_sum = model(**group[rank])
            (loss_sum * world / count).backward()  # FSDP averages over the ranks: undo it
            total = loss_sum.detach().clone()
            dist.all_reduce(total)
            loss = float(total) / count
        losses.append(loss)
        if grads is None:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.requires_grad}
            frozen_grads = [
                n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
            ]
            assert not frozen_grads, frozen_grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def _fp32_worker(rank: int, tmp: str) -> dict:
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from magistral_cli.config.patterns import select_modules
    from magistral_cli.config.schema import FSDPPlan
    from magistral_cli.engine import checkpoint as ckpt
    from magistral_cli.engine import lora
    from magistral_cli.errors import UserError
    from magistral_cli.ops.contiguous_linear import WHAT, apply_contiguous_linear_grad

    world = dist.get_world_size()
    spec, base, batches = _spec(), _base_state(), _batches(world)
    reference = _reference(spec, base, batches, world)
    plan = FSDPPlan(param_dtype="fp32", reduce_dtype="fp32")
    mesh = init_device_mesh("cpu", (world,))
    model, applied = _sharded_model(spec, base, mesh, plan, kernel=True)
    result: dict = {}

    # The kernel refuses PEFT's wrapper itself (not a torch.nn.Linear) with a message naming it.
    try:
        apply_contiguous_linear_grad(
            select_modules(model, [f"{LAYERS}.mlp.up_proj"], what=WHAT),
            device="cpu",
            param_dtype="fp32",
            force=True,
        )
        result["kernel_refused"] = ""
    except UserError as exc:
        result["kernel_refused"] = str(exc)
    result["kernel_on"] = sorted(
        n for n, m in model.named_modules() if getattr(m, "_magistral_contiguous_linear", None) is not None
    )

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, foreach=True)
    base_before = {k: _full(v) for k, v in lora.base_state_dict(model.state_dict()).items()}
    losses, grads = _train_sharded(model, batches, rank, world, optimizer, steps=2)

    # An adapters-only checkpoint (real DCP through the engine's save), then a fresh model resumes.
    state = {
        "model": lora.adapter_state_dict(model),
        "optimizer": {"state": get_optimizer_state_dict(model, optimizer)["state"]},
        "step": torch.tensor(2),
        **lora.checkpoint_entry(applied, "tiny"),
    }
    result["checkpoint_model_keys"] = sorted(state["model"])
    result["optimizer_params"] = sorted(
        {k.split(".", 1)[1].rsplit(".", 1)[0] for k in _flat(state["optimizer"])}
    )
    path = ckpt.save_checkpoint(state, Path(tmp) / "checkpoints", 2)
    more, _ = _train_sharded(model, batches, rank, world, optimizer, steps=1, first_step=2)
    losses += more
    adapters = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
    base_after = {k: _full(v) for k, v in lora.base_state_dict(model.state_dict()).items()}

    resumed, _ = _sharded_model(spec, base, mesh, plan, kernel=True)
    opt2 = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    import torch.distributed.checkpoint as dcp

    from magistral_cli.checkpoint.safe_dcp import SafeFileSystemReader

    empty = get_optimizer_state_dict(resumed, opt2)
    load = {"model": lora.adapter_state_dict(resumed), "optimizer": {"state": empty["state"]}}
    dcp.load(load, storage_reader=SafeFileSystemReader(str(path)))
    lora.load_adapter_state_dict(resumed, load["model"])
    set_optimizer_state_dict(
        resumed, opt2, {"state": load["optimizer"]["state"], "param_groups": empty["param_groups"]}
    )
    resumed_losses, _ = _train_sharded(resumed, batches, rank, world, opt2, steps=1, first_step=2)
    resumed_adapters = {n: _full(p) for n, p in resumed.named_parameters() if p.requires_grad}

    if rank == 0:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        result["checkpoint_tensor_numel"] = sum(
            m.size.numel()
            for k, m in metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
        )
        result["record"] = lora.read_checkpoint_record(path)
    result.update(
        losses=losses,
        reference_losses=reference["losses"],
        loss_diff=max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True)),
        grad_diff=_max_diff(grads, reference["grads"]),
        grad_norm=max(float(g.abs().max()) for g in grads.values()),
        adapter_diff=_max_diff(adapters, reference["adapters"]),
        base_moved=_max_diff(base_before, base_after),
        base_matches_checkpoint=_max_diff(base_after, {k: base[k] for k in base_after}),
        resumed_loss_diff=abs(resumed_losses[0] - losses[2]),
        resumed_adapter_diff=_max_diff(resumed_adapters, adapters),
        trainable=len(trainable),
        adapter_numel=lora.adapter_numel(model),
        b_zero_at_init=bool(
            all(float(v.abs().max()) == 0 for k, v in _init_b(spec, base, mesh, plan).items())
        ),
    )
    return result


def _flat(state: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in state.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out += _flat(value, name) if isinstance(value, dict) else [name]
    return out


def _init_b(spec, base, mesh, plan) -> dict:
    """The B matrices of a freshly materialized and initialised sharded model (PEFT's default: zero)."""
    model, _ = _sharded_model(spec, base, mesh, plan, kernel=False)
    return {n: _full(p) for n, p in model.named_parameters() if ".lora_B." in n}


def _cp_worker(rank: int) -> dict:
    """Ulysses 2 (dp 1): both ranks see the same sequence; the loss and gradients are the 1-process ones."""
    from magistral_cli.config.schema import FSDPPlan
    from magistral_cli.engine.parallelize import ParallelDims
    from magistral_cli.ops.context_parallel import cp_groups_from_mesh

    spec, base, batches = _spec(), _base_state(), _batches(1)
    reference = _reference(spec, base, batches, 1, cp_batches=True)
    dims = ParallelDims(world_size=2, dp=1, cp=2, ulysses=2, ring=1)
    meshes = dims.build_mesh("cpu")
    groups = cp_groups_from_mesh(meshes)
    plan = FSDPPlan(param_dtype="fp32", reduce_dtype="fp32")
    model, _ = _sharded_model(spec, base, meshes.dp_cp, plan, kernel=False, cp_groups=groups)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    losses, grads = _train_sharded(model, batches, rank, 2, optimizer, steps=STEPS, cp=True)
    adapters = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True)),
        "grad_diff": _max_diff(grads, reference["grads"]),
        "adapter_diff": _max_diff(adapters, reference["adapters"]),
        "losses": losses,
    }


def _bf16_worker(rank: int) -> dict:
    """A frozen bf16 base and fp32 adapters in the same FSDP2 units, bf16 all-gathers, fp32 reduction."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from magistral_cli.config.schema import FSDPPlan

    world = dist.get_world_size()
    spec, base, batches = _spec(), _base_state(), _batches(world)
    mesh = init_device_mesh("cpu", (world,))
    plan = FSDPPlan(param_dtype="bf16", reduce_dtype="fp32")
    model, _ = _sharded_model(spec, base, mesh, plan, kernel=False)
    local = {"frozen": {}, "trainable": {}}
    for _, p in model.named_parameters():
        kind = "trainable" if p.requires_grad else "frozen"
        dtype = str(p.to_local().dtype)
        local[kind][dtype] = local[kind].get(dtype, 0) + p.to_local().numel() * p.to_local().element_size()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    losses, grads = _train_sharded(model, batches, rank, world, optimizer, steps=2)
    grad_dtypes = sorted({str(g.dtype) for g in grads.values()})
    reference = _reference(spec, base, batches, world)["losses"][:2]

    # FSDP2's rule: one dtype among the trainable parameters of a unit (frozen ones may differ).
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mixed[1].to(torch.bfloat16)
    fully_shard(mixed, mesh=mesh)
    try:
        mixed(torch.randn(2, 4))
        mixed_trainable = ""
    except AssertionError as exc:
        mixed_trainable = str(exc)
    return {
        "local_bytes": local,
        "losses": losses,
        "reference_losses": reference,
        "grad_dtypes": grad_dtypes,
        "mixed_trainable": mixed_trainable,
    }


def test_lora_under_fsdp2_matches_one_process_and_resumes_exactly(tmp_path):
    results = spawn_ranks(_fp32_worker, 2, (str(tmp_path),), timeout_s=300)
    for r in results:
        assert r["loss_diff"] < 1e-5, (r["losses"], r["reference_losses"])
        assert r["grad_norm"] > 1e-4  # the gradients compared are not all zero
        assert r["grad_diff"] < 1e-5 and r["adapter_diff"] < 1e-5, r
        assert r["base_moved"] == 0.0 and r["base_matches_checkpoint"] == 0.0
        assert r["resumed_loss_diff"] < 1e-6 and r["resumed_adapter_diff"] < 1e-6, r
        assert r["b_zero_at_init"]
        # PEFT's wrapper is refused by the kernel, with the reason; its base_layer and adapters take it.
        assert "mlp.up_proj' is a Linear, not a torch.nn.Linear" in r["kernel_refused"]
        assert len(r["kernel_on"]) == 4
        assert all(n.endswith(("down_proj.base_layer", "down_proj.lora_B.default")) for n in r["kernel_on"])
    r0 = results[0]
    # 2 decoder layers x 7 targets x (A + B); nothing else is trainable or saved.
    assert r0["trainable"] == 28
    assert all(".lora_A.default." in k or ".lora_B.default." in k for k in r0["checkpoint_model_keys"])
    assert len(r0["checkpoint_model_keys"]) == 28
    assert r0["optimizer_params"] == r0["checkpoint_model_keys"]
    assert r0["checkpoint_tensor_numel"] == r0["adapter_numel"]
    # 2 layers x r 4 x (in + out) over q, k, v, o (64 -> 64, 64 -> 32 twice, 64 -> 64) and the MLP (64 <-> 128).
    assert r0["adapter_numel"] == 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))
    assert r0["record"]["r"] == 4 and r0["record"]["alpha"] == 8 and len(r0["record"]["target_modules"]) == 14


def test_lora_under_ulysses_context_parallel_matches_one_process():
    results = spawn_ranks(_cp_worker, 2, timeout_s=300)
    for r in results:
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r
        assert r["adapter_diff"] < 5e-5, r  # after 3 AdamW steps, which normalise tiny gradients


def test_frozen_bf16_base_shares_fsdp2_units_with_fp32_adapters():
    results = spawn_ranks(_bf16_worker, 2, timeout_s=300)
    for r in results:
        local = r["local_bytes"]
        assert set(local["frozen"]) == {"torch.bfloat16"} and set(local["trainable"]) == {"torch.float32"}, (
            local
        )
        assert r["grad_dtypes"] == ["torch.float32"]  # the adapters' gradient shards, in their own dtype
        # bf16 compute against the fp32 reference: close, not equal.
        for got, want in zip(r["losses"], r["reference_losses"], strict=True):
            assert math.isfinite(got) and abs(got - want) < 0.05 * abs(want)
        assert "FSDP expects uniform original parameter dtype" in r["mixed_trainable"]
