"""Probe ``vision-attention``: our Pixtral attention backend against per-image eager attention.

For one image, two equal images and two images of different sizes, in bf16:

- forward relative L2 <= 0.015 and every input / parameter gradient <= 0.04 against running
  each image alone through transformers' eager attention (the seed's thresholds);
- the backend really ran, once per layer, with exactly the per-image boundaries, and the kernel
  the probe reports (``vision_attention_kernel`` for the tower's dtype, head dim and dropout: on
  CUDA FlashAttention-3, flash-attn or torch's ``varlen_attn``, else sdpa per image) is the one that
  ran: every layer's varlen call is recorded (``ops.attention_kernels.record_varlen_kernels``);
- isolation: the first image's outputs have zero gradient with respect to the other images'
  pixels and stay bit-identical when those pixels change.

The context-parallel modes (ulysses, ring: 2 processes; hybrid: 4 = 2 x 2) run the same checks
on every rank of a live CP group, with the language model of the small Mistral3 switched to
the context-parallel attention, and every vision forward and backward inside
``forbid_cp_communication``: a CP collective there fails the case, and so does any change of
the rank's CP communication counter. Two more cases: the CP group works (a CP all-reduce runs
and is counted, so the counter is live) and every rank computes bit-identical vision outputs
(the tower is replicated, not split).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any

from magistral_cli.ops.vision_attention import set_attention_implementation

from .common import Cases, ProbeResult, device_missing_reason, relative_l2, skip
from .cp_workers import CpRequest, default_cp_nproc, merge_rank_cases, run_cp_requests

PROBE = "vision-attention"
MODES = ("default", "ulysses", "ring", "hybrid")
CONTEXT_PARALLEL_MODES = ("ulysses", "ring", "hybrid")
FORWARD_LIMIT = 0.015
GRADIENT_LIMIT = 0.04
#: Test-only faults for the context-parallel modes: the tower's attention makes a CP collective.
INJECTIONS = ("vision-uses-cp-attention",)
#: Image sizes per case (height, width); pixels are allocated 16x24 and cropped per image.
SIZE_CASES = ([[16, 16]], [[16, 16], [16, 16]], [[16, 16], [16, 24]])


def _build_model():
    import torch
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    torch.manual_seed(42)
    # Patch size 2: the 16x24-pixel test images are 8x12 patches each.
    return Mistral3ForConditionalGeneration(tiny_mistral3_config(vocab_size=512, patch_size=2))


def _tower(model, device: str):
    import torch

    return model.model.vision_tower.to(device=device, dtype=torch.bfloat16).eval()


def _tower_inputs(tower) -> tuple[Any, Any, int, float]:
    """(device, dtype, head dim, dropout) of the (bf16) tower's attention: what picks its kernel."""
    import torch

    config = tower.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device = next(tower.parameters()).device
    return device, torch.bfloat16, head_dim, getattr(config, "attention_dropout", 0.0)


def _tower_kernel(tower) -> str:
    """The kernel our attention runs in this tower (``vision_attention_kernel``, as the forward asks)."""
    from magistral_cli.ops.vision_attention import vision_attention_kernel

    return vision_attention_kernel(*_tower_inputs(tower))


def _backend_name(tower) -> str:
    from magistral_cli.ops.vision_attention import vision_attention_backend

    return vision_attention_backend(*_tower_inputs(tower))


def _check_case(
    tower, sizes, attention_name, calls, forward_limit, gradient_limit, expected_kernel=None
) -> dict[str, Any]:
    import torch

    from magistral_cli.ops.attention_kernels import VARLEN_KERNELS, record_varlen_kernels

    device = next(tower.parameters()).device
    parameters = tuple(tower.parameters())
    pixel_values = torch.randn(len(sizes), 3, 16, 24, device=device, dtype=torch.bfloat16, requires_grad=True)
    image_sizes = torch.tensor(sizes, device=device)

    set_attention_implementation(tower, "eager")
    expected = torch.cat(
        [
            tower(pixel_values[i : i + 1], image_sizes=image_sizes[i : i + 1]).last_hidden_state
            for i in range(len(sizes))
        ],
        dim=1,
    )
    weights = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(
        (expected.float() * weights.float()).sum(), (pixel_values, *parameters)
    )

    set_attention_implementation(tower, attention_name)
    calls.clear()
    with record_varlen_kernels() as ran:
        actual = tower(pixel_values, image_sizes=image_sizes).last_hidden_state
    actual_grads = torch.autograd.grad((actual.float() * weights.float()).sum(), (pixel_values, *parameters))

    lengths = [(h // tower.patch_size) * (w // tower.patch_size) for h, w in sizes]
    ends = list(accumulate(lengths))
    layers = tower.config.num_hidden_layers
    assert len(calls) == layers, f"the backend ran {len(calls)} times, expected once per layer ({layers})"
    assert all(c == ends for c in calls), f"attention boundaries {calls} are not the per-image ends {ends}"
    if expected_kernel is not None:  # our backend: the kernel reported is the kernel that ran
        expected_ran = [expected_kernel] * layers if expected_kernel in VARLEN_KERNELS else []
        assert ran == expected_ran, f"the varlen kernels that ran, {ran}, are not {expected_ran}"
    assert actual.shape == expected.shape, f"output shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), "non-finite outputs"
    forward = relative_l2(actual, expected)
    assert forward <= forward_limit, f"forward relative L2 {forward:.4g} > {forward_limit}"
    grad_errors = [relative_l2(a, e) for a, e in zip(actual_grads, expected_grads, strict=True)]
    assert all(torch.isfinite(g).all() for g in actual_grads), "non-finite gradients"
    worst = max(grad_errors)
    assert worst <= gradient_limit, f"gradient relative L2 {worst:.4g} > {gradient_limit}"
    return {
        "boundaries": ends,
        "forward_relative_l2": forward,
        "max_gradient_relative_l2": worst,
        "varlen_calls": len(ran),
    }


def _check_isolation(tower, sizes) -> dict[str, Any]:
    import torch

    device = next(tower.parameters()).device
    pixel_values = torch.randn(len(sizes), 3, 16, 24, device=device, dtype=torch.bfloat16, requires_grad=True)
    image_sizes = torch.tensor(sizes, device=device)
    first_end = (sizes[0][0] // tower.patch_size) * (sizes[0][1] // tower.patch_size)
    output = tower(pixel_values, image_sizes=image_sizes).last_hidden_state
    cross = torch.autograd.grad(output[:, :first_end].float().square().sum(), pixel_values)[0][1:]
    nonzero = cross.count_nonzero().item()
    assert nonzero == 0, (
        f"the first image's outputs depend on other images' pixels ({nonzero} nonzero gradients)"
    )
    changed = pixel_values.detach().clone()
    changed[1:].mul_(4).add_(2)
    with torch.no_grad():
        changed_output = tower(changed, image_sizes=image_sizes).last_hidden_state
    assert torch.equal(output[:, :first_end].detach(), changed_output[:, :first_end]), (
        "the first image's outputs changed when only other images' pixels changed"
    )
    return {"cross_image_nonzero_gradients": 0, "first_image_outputs_unchanged": True}


def run_vision_attention_probe(
    device: str = "cpu",
    mode: str = "default",
    *,
    backend: Callable[..., Any] | None = None,
    forward_limit: float = FORWARD_LIMIT,
    gradient_limit: float = GRADIENT_LIMIT,
    nproc: int | None = None,
    inject: str | None = None,
) -> ProbeResult:
    """Run the probe on ``device``.

    ``backend`` replaces our attention function in the default mode (tests use a wrong one);
    ``nproc`` sets the processes of a context-parallel mode; ``inject`` (tests) plants a fault
    from :data:`INJECTIONS` in a context-parallel mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if mode in CONTEXT_PARALLEL_MODES:
        if backend is not None:
            raise ValueError("a custom backend cannot be sent to the rank processes; use inject")
        request = vision_cp_request(
            mode, nproc=nproc, forward_limit=forward_limit, gradient_limit=gradient_limit, inject=inject
        )
        return run_cp_requests(device, [request])[0]
    if inject is not None or nproc is not None:
        raise ValueError("nproc and inject apply to the context-parallel modes only")
    missing = device_missing_reason(device)
    if missing:
        return skip(PROBE, device, mode, missing)

    from magistral_cli.ops.vision_attention import apply_vision_attention

    if device == "npu":
        import torch_npu  # noqa: F401

    tower = _tower(_build_model(), device)
    apply_vision_attention(tower, device)
    cases = Cases()
    _run_checks(cases, tower, backend, forward_limit, gradient_limit)
    backend_name = _backend_name(tower) if backend is None else getattr(backend, "__name__", "custom")
    for case in cases.cases:
        case["backend"] = backend_name
    return cases.result(
        PROBE,
        device,
        mode,
        f"{backend_name} matches per-image eager attention (forward <= {forward_limit}, "
        f"gradients <= {gradient_limit}) and keeps images isolated",
    )


def _run_checks(
    cases: Cases,
    tower,
    backend: Callable[..., Any] | None,
    forward_limit: float,
    gradient_limit: float,
    guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """The numerics and isolation cases, each inside ``guard()`` (the CP modes' communication guard)."""
    import torch
    from transformers import AttentionInterface

    from magistral_cli.ops.vision_attention import ATTENTION_NAME, vision_attention_forward

    implementation = backend or vision_attention_forward
    expected_kernel = _tower_kernel(tower) if backend is None else None
    calls: list[list[int]] = []

    def traced(module, query, key, value, attention_mask, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        ends = [int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else (cu or []))]
        calls.append(ends[1:] if ends[:1] == [0] else ends)
        return implementation(module, query, key, value, attention_mask, **kwargs)

    def guarded(check: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            with guard() as details:
                result = check()
            return {**result, **(details or {})}

        return run

    AttentionInterface.register(ATTENTION_NAME, traced)
    try:
        torch.manual_seed(0)
        for sizes in SIZE_CASES:
            cases.run(
                f"numerics {len(sizes)} image(s) {sizes}",
                guarded(
                    lambda sizes=sizes: _check_case(
                        tower, sizes, ATTENTION_NAME, calls, forward_limit, gradient_limit, expected_kernel
                    )
                ),
                sizes=sizes,
            )
            if len(sizes) > 1:
                set_attention_implementation(tower, ATTENTION_NAME)
                cases.run(
                    f"isolation {sizes}",
                    guarded(lambda sizes=sizes: _check_isolation(tower, sizes)),
                    sizes=sizes,
                )
    finally:
        AttentionInterface.register(ATTENTION_NAME, vision_attention_forward)
        set_attention_implementation(tower, ATTENTION_NAME)


# --------------------------------------------------------------------------- context-parallel modes


def vision_cp_request(
    mode: str,
    *,
    nproc: int | None = None,
    forward_limit: float = FORWARD_LIMIT,
    gradient_limit: float = GRADIENT_LIMIT,
    inject: str | None = None,
) -> CpRequest:
    """The request that :func:`run_cp_requests` runs for a context-parallel mode."""
    if mode not in CONTEXT_PARALLEL_MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(CONTEXT_PARALLEL_MODES)}")
    if inject is not None and inject not in INJECTIONS:
        raise ValueError(f"inject {inject!r} is not one of {', '.join(INJECTIONS)}")
    options = {"forward_limit": forward_limit, "gradient_limit": gradient_limit, "inject": inject}
    return CpRequest(
        PROBE, mode, nproc or default_cp_nproc(mode), options, rank_job=rank_job, evaluate=evaluate
    )


def rank_job(request: CpRequest) -> dict[str, Any]:
    return {"run": run_rank_job, "mode": request.mode, **request.options}


def run_rank_job(
    mode: str, forward_limit: float, gradient_limit: float, inject: str | None
) -> dict[str, Any]:
    """The checks on this rank of an initialised process group (the whole world is the CP group)."""
    import torch.distributed as dist

    from magistral_cli.ops.context_parallel import apply_context_parallel
    from magistral_cli.ops.vision_attention import apply_vision_attention
    from magistral_cli.runtime import device_type_of_backend

    from .cp_harness import cp_meshes_for

    _, groups = cp_meshes_for(mode)
    device = device_type_of_backend(dist.get_backend())
    model = _build_model()
    # The language model runs the CP attention, as in a CP training run; the tower must not.
    apply_context_parallel(model, groups)
    tower = _tower(model, device)
    apply_vision_attention(tower, device)

    cases = Cases()
    cases.run("context-parallel group", lambda: _check_group(model, groups, mode, device))
    backend = _cp_attention_in_the_tower if inject == "vision-uses-cp-attention" else None
    _run_checks(
        cases, tower, backend, forward_limit, gradient_limit, guard=lambda: _no_cp_communication(groups)
    )
    cases.run("replicated outputs", lambda: _check_replicated(tower, groups))
    name = _backend_name(tower) if backend is None else backend.__name__
    return {"cases": cases.cases, "backend": name}


@contextlib.contextmanager
def _no_cp_communication(groups) -> Iterator[dict[str, Any]]:
    """The vision tower's CP state during a check: the CP group active, every CP collective
    forbidden (it raises), and the rank's CP communication count unchanged afterwards."""
    from magistral_cli.ops.context_parallel import (
        context_parallel,
        cp_communication_count,
        forbid_cp_communication,
    )

    details: dict[str, Any] = {}
    before = cp_communication_count()
    with context_parallel(groups), forbid_cp_communication("the vision tower"):
        yield details
    made = cp_communication_count() - before
    assert made == 0, f"the vision tower made {made} context-parallel communications"
    details["vision_cp_communications"] = made


def _check_group(model, groups, mode: str, device: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from magistral_cli.ops.context_parallel import ATTENTION_NAME as CP_ATTENTION
    from magistral_cli.ops.context_parallel import cp_communication_count
    from magistral_cli.ops.context_parallel.comm import sum_across_ranks

    world = dist.get_world_size()
    assert (groups.mode, groups.cp_size) == (mode, world), (
        f"CP group {groups.mode} of {groups.cp_size} ranks, expected {mode} of {world}"
    )
    text, vision = model.config.text_config, model.config.vision_config
    assert text._attn_implementation == CP_ATTENTION, "the language model does not use the CP attention"
    assert vision._attn_implementation != CP_ATTENTION, "the vision tower uses the CP attention"
    before = cp_communication_count()
    total = sum_across_ranks(torch.ones((), device=device), groups.cp_group)
    assert total.item() == world, f"a CP all-reduce of ones gave {total.item()}, expected {world}"
    assert cp_communication_count() - before == 1, "the CP communication counter did not see an all-reduce"
    return {"ulysses_size": groups.ulysses_size, "ring_size": groups.ring_size}


def _check_replicated(tower, groups) -> dict[str, Any]:
    import hashlib

    import torch
    import torch.distributed as dist

    device = next(tower.parameters()).device
    gen = torch.Generator().manual_seed(7)
    pixels = torch.randn(2, 3, 16, 24, generator=gen).to(device=device, dtype=torch.bfloat16)
    sizes = torch.tensor([[16, 16], [16, 24]], device=device)
    with _no_cp_communication(groups), torch.no_grad():
        output = tower(pixels, image_sizes=sizes).last_hidden_state
    digest = hashlib.sha256(output.float().cpu().numpy().tobytes()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size(groups.cp_group)
    dist.all_gather_object(digests, digest, group=groups.cp_group)
    assert len(set(digests)) == 1, (
        f"the CP ranks computed different vision outputs ({len(set(digests))} distinct)"
    )
    return {"identical_on_ranks": len(digests)}


def _cp_attention_in_the_tower(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Wrong on purpose (``inject``): the tower's attention goes through the CP attention,
    which communicates over the CP group."""
    from magistral_cli.ops.attention_kernels import softmax_scale
    from magistral_cli.ops.context_parallel import active_cp_groups, cp_attention

    scale = softmax_scale(scaling, query.shape[-1])
    return cp_attention(query, key, value, active_cp_groups(), scale).transpose(1, 2), None


def evaluate(request: CpRequest, device: str, per_rank: list[dict[str, Any]]) -> ProbeResult:
    """Merge every rank's cases: a case passes only if it passed on every rank."""
    errors = [(rank, r) for rank, r in enumerate(per_rank) if "error" in r]
    if errors:
        rank, first = errors[0]
        return ProbeResult(PROBE, device, request.mode, "FAIL", f"rank {rank} failed: {first['error']}", [])
    merged = merge_rank_cases([r["cases"] for r in per_rank])
    backend = per_rank[0]["backend"]
    for case in merged:
        case["backend"] = backend
    cases = Cases()
    cases.cases = merged
    opts = request.options
    return cases.result(
        PROBE,
        device,
        request.mode,
        f"on every rank of a {request.mode} CP group of {request.nproc} processes, {backend} matches "
        f"per-image eager attention (forward <= {opts['forward_limit']}, gradients <= "
        f"{opts['gradient_limit']}), keeps images isolated, gives identical outputs on every rank "
        "and makes no CP communication",
    )
