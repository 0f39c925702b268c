"""Contiguous Linear weight gradients: forced on the CPU, equal to native Linear; errors for bad patterns."""

from __future__ import annotations

import copy

import pytest
import torch

from magistral_cli.config.patterns import select_modules
from magistral_cli.errors import UserError
from magistral_cli.ops.contiguous_linear import WHAT, ContiguousLinear, apply_contiguous_linear_grad
from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

DOWN = "model.language_model.layers.{*}.mlp.down_proj"
Q = "model.language_model.layers.{*}.self_attn.q_proj"


@pytest.fixture(scope="module")
def base_model():
    return build_tiny_model(tiny_mistral3_config(vocab_size=256)).train()


def _run(model, dtype):
    torch.manual_seed(0)
    input_ids = torch.randint(20, 250, (2, 12))
    output = model.to(dtype)(input_ids=input_ids, labels=input_ids)
    output.loss.backward()
    return output.loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_path_equals_native_linear_and_keeps_identity_and_names(base_model, dtype):
    native, patched = copy.deepcopy(base_model), copy.deepcopy(base_model)
    names_before = list(patched.state_dict())
    params_before = {n: p for n, p in patched.named_parameters()}
    changed = apply_contiguous_linear_grad(
        select_modules(patched, [DOWN, Q], what=WHAT), device="cpu", param_dtype=dtype, force=True
    )
    assert changed == [
        "model.language_model.layers.0.mlp.down_proj",
        "model.language_model.layers.1.mlp.down_proj",
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.1.self_attn.q_proj",
    ]
    assert list(patched.state_dict()) == names_before
    assert all(p is params_before[n] for n, p in patched.named_parameters())
    assert all(type(patched.get_submodule(n)) is torch.nn.Linear for n in changed)

    loss_native, grads_native = _run(native, dtype)
    loss_patched, grads_patched = _run(patched, dtype)
    torch.testing.assert_close(loss_patched, loss_native, rtol=0, atol=0)
    assert grads_patched.keys() == grads_native.keys()
    for name, grad in grads_patched.items():
        torch.testing.assert_close(grad, grads_native[name], rtol=1e-6, atol=1e-7, msg=name)
        if any(name.startswith(n) for n in changed):
            assert grad.is_contiguous()


def test_forced_path_really_uses_the_custom_function():
    linear = torch.nn.Linear(8, 4, bias=False)
    model = torch.nn.Sequential(linear)
    apply_contiguous_linear_grad(
        select_modules(model, ["0"], what=WHAT), device="cpu", param_dtype=torch.float32, force=True
    )
    x = torch.randn(3, 5, 8, requires_grad=True)
    y = model(x)
    assert "ContiguousLinear" in type(y.grad_fn).__name__
    with torch.no_grad():
        assert model(x).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "ContiguousLinear" not in type(model(x).grad_fn).__name__  # autocast keeps native Linear
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, linear.weight), dy)
    ref_dx, ref_dw = torch.autograd.grad(torch.nn.functional.linear(x, linear.weight), (x, linear.weight), dy)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-6, atol=1e-6)
    assert dw.is_contiguous()


def test_custom_function_under_vmap():
    weight = torch.randn(4, 8)
    xs = torch.randn(3, 2, 8)
    out = torch.vmap(lambda x: ContiguousLinear.apply(x, weight))(xs)
    torch.testing.assert_close(out, xs @ weight.t())


def test_cpu_and_fp32_keep_native_linear(base_model):
    model = copy.deepcopy(base_model)
    assert (
        apply_contiguous_linear_grad(
            select_modules(model, [DOWN], what=WHAT), device="cpu", param_dtype="bf16"
        )
        == []
    )
    assert (
        apply_contiguous_linear_grad(
            select_modules(model, [DOWN], what=WHAT), device="cuda", param_dtype="fp32"
        )
        == []
    )
    assert (
        apply_contiguous_linear_grad(select_modules(model, [], what=WHAT), device="cuda", param_dtype="bf16")
        == []
    )
    assert "forward" not in vars(model.get_submodule("model.language_model.layers.0.mlp.down_proj"))


def test_installed_for_cuda_bf16_but_cpu_inputs_stay_native(base_model):
    model = copy.deepcopy(base_model)
    changed = apply_contiguous_linear_grad(
        select_modules(model, [DOWN], what=WHAT), device="cuda", param_dtype=torch.bfloat16
    )
    assert len(changed) == 2
    module = model.get_submodule(changed[0])
    x = torch.randn(2, 3, module.in_features, dtype=torch.bfloat16, requires_grad=True)
    module.to(torch.bfloat16)
    assert "ContiguousLinear" not in type(module(x).grad_fn).__name__


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("model.language_model.layers.{*}.mlp", "not a torch.nn.Linear"),
        ("model.multi_modal_projector.linear_1", None),
        ("model.language_model.layers.{*}.mlp.down_prj", "matches no module"),
    ],
)
def test_bad_patterns_are_user_errors(base_model, pattern, message):
    model = copy.deepcopy(base_model)
    if message is None:
        model.model.multi_modal_projector.linear_1.bias = torch.nn.Parameter(torch.zeros(1))
        message = "with a bias"
    with pytest.raises(UserError, match=message):
        apply_contiguous_linear_grad(
            select_modules(model, [pattern], what=WHAT), device="npu", param_dtype="bf16"
        )


def test_unknown_param_dtype_is_a_user_error(base_model):
    with pytest.raises(UserError, match="param_dtype"):
        apply_contiguous_linear_grad(
            select_modules(copy.deepcopy(base_model), [DOWN], what=WHAT), device="npu", param_dtype="bf17"
        )
