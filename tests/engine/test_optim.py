"""Learning-rate schedule, AdamW with host-held state, checkpoint packing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from magistral_cli.config.schema import Training
from magistral_cli.engine.checkpoint import pack, unpack
from magistral_cli.engine.optim import AdamWSwap, lr_at


def _training(**kw):
    return Training(train_iters=10, lr=1.0, min_lr=0.1, lr_warmup_ratio=0.2, **kw)


def test_warmup_then_cosine():
    t = _training(lr_decay_style="cosine")
    assert [lr_at(s, t) for s in (1, 2)] == [0.5, 1.0]
    assert lr_at(10, t) == pytest.approx(0.1)
    assert lr_at(6, t) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_linear_and_constant():
    assert lr_at(6, _training(lr_decay_style="linear")) == pytest.approx(1.0 - 0.9 * 0.5)
    assert [lr_at(s, _training(lr_decay_style="constant")) for s in (1, 3, 10)] == [0.5, 1.0, 1.0]


def test_no_warmup():
    t = Training(train_iters=4, lr=2.0, lr_warmup_ratio=0.0, lr_decay_style="linear")
    assert lr_at(1, t) == pytest.approx(1.5)


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_swap_equals_adamw(fused):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g)]
    grads = [[torch.randn_like(p) for p in init] for _ in range(4)]
    results = []
    for cls in (torch.optim.AdamW, AdamWSwap):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        kwargs = {"lr": 1e-2, "weight_decay": 0.1, "foreach": not fused, "fused": fused}
        opt = cls(params, chunk_bytes=64, **kwargs) if cls is AdamWSwap else cls(params, **kwargs)
        for step_grads in grads:
            for p, gr in zip(params, step_grads, strict=True):
                p.grad = gr.clone()
            opt.step()
        results.append([p.detach().clone() for p in params])
        if cls is AdamWSwap:
            assert all(s["exp_avg"].device.type == "cpu" for s in opt.state.values())
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_pack_round_trip_without_pickle():
    state = {"python": (3, tuple(range(5)), None), "torch": torch.arange(4, dtype=torch.uint8), "n": 12}
    packed = pack(state)
    assert packed.dtype == torch.uint8
    out = unpack(packed)
    assert out["python"] == state["python"] and out["n"] == 12 and torch.equal(out["torch"], state["torch"])


def test_fused_adamw_is_chosen_only_where_a_fused_step_really_runs(tmp_path, caplog):
    """CPU fp32 has torch's fused kernel; CPU float8 reaches the kernel, which really rejects it.

    The float8 case is the failure a torch_npu build without ``_fused_adamw_`` produces: the
    constructor accepts the parameters and the kernel raises NotImplementedError on the step.
    """
    from magistral_cli.engine.optim import adamw_implementation, build_optimizer, fused_unavailable_reason
    from magistral_cli.run_record import record_resolved

    fused = Training(train_iters=2, adam_fused=True)
    assert adamw_implementation(fused, "cpu") == (
        "fused",
        "training.adam_fused is true and a fused AdamW step ran on cpu (float32)",
    )
    assert adamw_implementation(Training(train_iters=2), "cpu") == ("foreach", "training.adam_fused is false")
    assert "not implemented for 'Float8_e4m3fn'" in fused_unavailable_reason("cpu", torch.float8_e4m3fn)

    with caplog.at_level("INFO", logger="magistral_cli.engine"):
        opt = build_optimizer(torch.nn.Linear(3, 2), fused, "cpu")
    assert opt.defaults["fused"] and not opt.defaults["foreach"]
    assert opt.adamw_choice["implementation"] == "fused"
    assert "fused AdamW" in caplog.text

    caplog.clear()
    float8 = torch.nn.Linear(3, 2).to(torch.float8_e4m3fn)
    with caplog.at_level("INFO", logger="magistral_cli.engine"):
        swap = build_optimizer(float8, fused.model_copy(update={"optimizer": "adamw_swap"}), "cpu")
    assert isinstance(swap, AdamWSwap) and swap.defaults["foreach"] and not swap.defaults["fused"]
    assert swap.adamw_choice["implementation"] == "foreach"
    assert "kernel failed on cpu for float8_e4m3fn" in swap.adamw_choice["reason"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]

    record_resolved(tmp_path / "run", adamw=swap.adamw_choice)  # started without the launcher
    written = json.loads((tmp_path / "run" / "run_identity.json").read_text())
    assert written == {"resolved": {"adamw": swap.adamw_choice}}


def test_step_k_uses_the_schedule_before_its_scheduler_step_as_mindspeed_mm():
    """The seed's 2000-step baseline (lr 1e-5, warm-up 0.1, cosine to 0): MindSpeed-MM reads the lr
    before ``scheduler.step()``, so optimizer step k uses the value after k - 1 scheduler steps.
    The expected values are MindSpeed-MM's, computed from its formula for those steps."""
    t = Training(lr=1.0e-5, lr_warmup_ratio=0.1, train_iters=2000, min_lr=0.0, lr_decay_style="cosine")
    used = {k: lr_at(k - 1, t) for k in (1, 2, 250, 500, 2000)}
    assert used[1] == 0.0
    assert used[2] == pytest.approx(5.0e-8, rel=1e-9)
    assert used[250] == pytest.approx(9.981726e-6, rel=1e-6)
    assert used[500] == pytest.approx(9.334484e-6, rel=1e-6)
    assert used[2000] == pytest.approx(7.6e-12, rel=1e-2)
