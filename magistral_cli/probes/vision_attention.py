"""Probe ``vision-attention``: our Pixtral attention backend against per-image eager attention.

For one image, two equal images and two images of different sizes, in bf16:

- forward relative L2 <= 0.015 and every input / parameter gradient <= 0.04 against running
  each image alone through transformers' eager attention (the seed's thresholds);
- the backend really ran, once per layer, with exactly the per-image boundaries;
- isolation: the first image's outputs have zero gradient with respect to the other images'
  pixels and stay bit-identical when those pixels change.

The context-parallel modes need the context-parallel engine; until then they SKIP.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any

from magistral_cli.ops.vision_attention import set_attention_implementation

from .common import Cases, ProbeResult, device_missing_reason, relative_l2, skip

PROBE = "vision-attention"
MODES = ("default", "ulysses", "ring", "hybrid")
CONTEXT_PARALLEL_MODES = ("ulysses", "ring", "hybrid")
FORWARD_LIMIT = 0.015
GRADIENT_LIMIT = 0.04
#: Image sizes per case (height, width); pixels are allocated 16x24 and cropped per image.
SIZE_CASES = ([[16, 16]], [[16, 16], [16, 16]], [[16, 16], [16, 24]])


def _build_tower(device: str):
    import torch
    from transformers import Mistral3ForConditionalGeneration

    from .synthetic import probe_mistral3_config

    torch.manual_seed(42)
    model = Mistral3ForConditionalGeneration(probe_mistral3_config())
    return model.model.vision_tower.to(device=device, dtype=torch.bfloat16).eval()


def _check_case(tower, sizes, attention_name, calls, forward_limit, gradient_limit) -> dict[str, Any]:
    import torch

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
    actual = tower(pixel_values, image_sizes=image_sizes).last_hidden_state
    actual_grads = torch.autograd.grad((actual.float() * weights.float()).sum(), (pixel_values, *parameters))

    lengths = [(h // tower.patch_size) * (w // tower.patch_size) for h, w in sizes]
    ends = list(accumulate(lengths))
    layers = tower.config.num_hidden_layers
    assert len(calls) == layers, f"the backend ran {len(calls)} times, expected once per layer ({layers})"
    assert all(c == ends for c in calls), f"attention boundaries {calls} are not the per-image ends {ends}"
    assert actual.shape == expected.shape, f"output shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), "non-finite outputs"
    forward = relative_l2(actual, expected)
    assert forward <= forward_limit, f"forward relative L2 {forward:.4g} > {forward_limit}"
    grad_errors = [relative_l2(a, e) for a, e in zip(actual_grads, expected_grads, strict=True)]
    assert all(torch.isfinite(g).all() for g in actual_grads), "non-finite gradients"
    worst = max(grad_errors)
    assert worst <= gradient_limit, f"gradient relative L2 {worst:.4g} > {gradient_limit}"
    return {"boundaries": ends, "forward_relative_l2": forward, "max_gradient_relative_l2": worst}


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
) -> ProbeResult:
    """Run the probe on ``device``. ``backend`` replaces our attention function (tests use a wrong one)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if mode in CONTEXT_PARALLEL_MODES:
        return skip(PROBE, device, mode, "context parallel is not available yet")
    missing = device_missing_reason(device)
    if missing:
        return skip(PROBE, device, mode, missing)

    import torch
    from transformers import AttentionInterface

    from magistral_cli.ops.vision_attention import (
        ATTENTION_NAME,
        apply_vision_attention,
        vision_attention_backend,
        vision_attention_forward,
    )

    if device == "npu":
        import torch_npu  # noqa: F401

    tower = _build_tower(device)
    apply_vision_attention(tower, device)
    implementation = backend or vision_attention_forward
    calls: list[list[int]] = []

    def traced(module, query, key, value, attention_mask, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        ends = [int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else (cu or []))]
        calls.append(ends[1:] if ends[:1] == [0] else ends)
        return implementation(module, query, key, value, attention_mask, **kwargs)

    cases = Cases()
    AttentionInterface.register(ATTENTION_NAME, traced)
    try:
        torch.manual_seed(0)
        for sizes in SIZE_CASES:
            cases.run(
                f"numerics {len(sizes)} image(s) {sizes}",
                lambda sizes=sizes: _check_case(
                    tower, sizes, ATTENTION_NAME, calls, forward_limit, gradient_limit
                ),
                sizes=sizes,
            )
            if len(sizes) > 1:
                set_attention_implementation(tower, ATTENTION_NAME)
                cases.run(
                    f"isolation {sizes}", lambda sizes=sizes: _check_isolation(tower, sizes), sizes=sizes
                )
    finally:
        AttentionInterface.register(ATTENTION_NAME, vision_attention_forward)
    backend_name = (
        vision_attention_backend(device) if backend is None else getattr(backend, "__name__", "custom")
    )
    for case in cases.cases:
        case["backend"] = backend_name
    return cases.result(
        PROBE,
        device,
        mode,
        f"{backend_name} matches per-image eager attention (forward <= {forward_limit}, "
        f"gradients <= {gradient_limit}) and keeps images isolated",
    )
