"""Explicit FSDP2 prefetch chains every unit in forward order, as the seed does (one CPU rank, gloo).

The seed (MindSpeed-MM ``set_modules_to_prefetch``) chains all wrapped modules in order; before
this, prefetch stayed inside each ``{*}`` pattern. Numerics are unchanged by prefetch
(tests/engine/test_trainer.py ``test_recompute_and_prefetch_change_nothing``); these tests check
what is prefetched.
"""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import FSDPModule

from magistral_cli.config.schema import FSDPPlan
from magistral_cli.engine.model import output_capture_survives_wrapping
from magistral_cli.engine.parallelize import (
    apply_fsdp,
    apply_prefetch,
    fsdp_units_in_order,
    prefetch_plan,
)
from magistral_cli.engine.synthetic import SyntheticBatches
from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

VOCAB = 512


def _sharded(mesh, tie=None, **plan):
    model = build_tiny_model(tiny_mistral3_config(vocab_size=VOCAB, tie=tie))
    plan = FSDPPlan(param_dtype="fp32", reduce_dtype="fp32", **plan)
    with output_capture_survives_wrapping(model):
        apply_fsdp(model, mesh, plan)
    return model, plan


def _forward_order(model, units) -> list[int]:
    """Indices into ``units`` in the order their pre-forward hooks fire on a real batch with an image."""
    order: list[int] = []
    handles = []
    for module in model.modules():
        for i, unit in enumerate(units):
            if isinstance(module, FSDPModule) and module._get_fsdp_state() is unit._get_fsdp_state():
                handles.append(module.register_forward_pre_hook(lambda *_, i=i: order.append(i)))
    data = SyntheticBatches(
        vocab_size=VOCAB, seq_len=48, micro_batch_size=1, grad_accumulation=1, dp_rank=0, dp_size=1, seed=0
    )
    batch = next(data)
    assert "pixel_values" in batch
    model(**batch)
    for handle in handles:
        handle.remove()
    seen: list[int] = []
    for i in order:  # a tied unit fires twice (embedding and head): its first time counts
        if i not in seen:
            seen.append(i)
    return seen


def test_prefetch_plan_is_the_seeds_rule():
    assert prefetch_plan(list("abcd"), 1, 1) == [
        ("a", ["b"], []),
        ("b", ["c"], ["a"]),
        ("c", ["d"], ["b"]),
        ("d", [], ["c"]),
    ]
    assert prefetch_plan(list("abcd"), 2, 0)[0] == ("a", ["b", "c"], [])
    assert prefetch_plan(list("abcd"), 0, 2)[3] == ("d", [], ["c", "b"])  # nearest first


@pytest.mark.parametrize("tie", [None, True], ids=["untied", "tied"])
def test_the_chain_is_every_unit_once_in_forward_order(mesh, tie):
    model, _ = _sharded(mesh, tie=tie)
    units = fsdp_units_in_order(model)
    states = [u._get_fsdp_state() for u in units]
    assert len({id(s) for s in states}) == len(units)
    every = {id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule) and m is not model}
    assert {id(s) for s in states} == every
    # 2 vision layers + tower + projector + decoder + 2 layers, + embedding and head (one unit if tied)
    assert len(units) == (8 if tie else 9)
    assert _forward_order(model, units) == list(range(len(units)))
    assert units[0] is model.get_input_embeddings()  # called first, though registered in the decoder


def test_prefetch_crosses_pattern_boundaries(mesh):
    model, plan = _sharded(mesh, num_to_forward_prefetch=1, num_to_backward_prefetch=1)
    units = fsdp_units_in_order(model)
    assert apply_prefetch(model, plan) == len(units)
    named = dict(model.named_modules())

    def forward_of(name):
        return named[name]._get_fsdp_state()._states_to_forward_prefetch

    def backward_of(name):
        return named[name]._get_fsdp_state()._states_to_backward_prefetch

    state = {name: named[name]._get_fsdp_state() for name in named if isinstance(named[name], FSDPModule)}
    # Within a {*} list, as before ...
    assert forward_of("model.language_model.layers.0") == [state["model.language_model.layers.1"]]
    # ... and across: the last vision layer to the projector, the last decoder layer to the head.
    assert forward_of("model.vision_tower.transformer.layers.1") == [state["model.multi_modal_projector"]]
    assert forward_of("model.language_model.layers.1") == [state["lm_head"]]
    assert backward_of("lm_head") == [state["model.language_model.layers.1"]]
    assert backward_of("model.multi_modal_projector") == [state["model.vision_tower.transformer.layers.1"]]
    # The embedding runs first: nothing prefetches it in forward, and the decoder does not.
    assert forward_of("model.language_model") == [state["model.language_model.layers.0"]]
    assert forward_of("model.language_model.embed_tokens") == [state["model.vision_tower"]]
    assert model._get_fsdp_state()._states_to_forward_prefetch == []  # the root is not chained


def test_tied_group_is_prefetched_as_one_unit(mesh):
    model, plan = _sharded(mesh, tie=True, num_to_forward_prefetch=2, num_to_backward_prefetch=2)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embed.weight is head.weight and embed._get_fsdp_state() is head._get_fsdp_state()
    assert apply_prefetch(model, plan) == 8
    group = embed._get_fsdp_state()
    named = dict(model.named_modules())
    assert group._states_to_forward_prefetch == [
        named["model.vision_tower"]._get_fsdp_state(),
        named["model.vision_tower.transformer.layers.0"]._get_fsdp_state(),
    ]
    for module in model.modules():
        if isinstance(module, FSDPModule) and module is not embed and module is not head:
            assert module._get_fsdp_state()._states_to_forward_prefetch.count(group) <= 1


def test_no_prefetch_by_default(mesh):
    model, plan = _sharded(mesh)
    assert apply_prefetch(model, plan) == 0
    assert all(
        not m._get_fsdp_state()._states_to_forward_prefetch
        for m in model.modules()
        if isinstance(m, FSDPModule)
    )
