"""The forward's tail stays gathered from its forward to its backward (one CPU rank, gloo).

The backward starts with the last decoder layer, the final norm and the output head. Resharding
them after the forward would only buy an immediate second all-gather of the same values (on one
rank, a second cast and copy), so ``parallelize.keep_forward_tail_gathered`` keeps them, as FSDP2
keeps its root. A model that does not train keeps nothing: its units would stay gathered with no
backward to free them. The memory plan counts what is held (tests/engine/test_memory_plan.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import DTensor

from magistral_cli.config.schema import FSDPPlan
from magistral_cli.engine.model import output_capture_survives_wrapping
from magistral_cli.engine.parallelize import apply_fsdp
from magistral_cli.engine.synthetic import SyntheticBatches
from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

pytestmark = [pytest.mark.compat]

VOCAB = 512


def _sharded(mesh, trains: bool = True, param_dtype: str = "fp32", **plan):
    model = build_tiny_model(tiny_mistral3_config(vocab_size=VOCAB, num_hidden_layers=3))
    model.train()
    if not trains:
        model.requires_grad_(False)
    with output_capture_survives_wrapping(model):
        apply_fsdp(model, mesh, FSDPPlan(param_dtype=param_dtype, reduce_dtype="fp32", **plan))
    return model


def _batch():
    data = SyntheticBatches(
        vocab_size=VOCAB, seq_len=48, micro_batch_size=1, grad_accumulation=1, dp_rank=0, dp_size=1, seed=0
    )
    return next(data)


def _gathered(model) -> dict[str, bool]:
    """For each decoder layer and the head: whether its parameters are the unsharded ones now."""
    layers = model.model.language_model.layers
    out = {
        f"layer {i}": not isinstance(layer.self_attn.q_proj.weight, DTensor) for i, layer in enumerate(layers)
    }
    out["head"] = not isinstance(model.lm_head.weight, DTensor)
    out["embedding"] = not isinstance(model.get_input_embeddings().weight, DTensor)
    return out


def test_the_last_layer_and_the_head_stay_gathered_until_their_backward(mesh, caplog):
    with caplog.at_level(logging.INFO, logger="magistral_cli.engine.parallelize"):
        model = _sharded(mesh)
    assert "kept gathered from forward to backward: model.language_model.layers.2, lm_head" in caplog.text
    assert not any(_gathered(model).values())
    out = model(**_batch())
    assert _gathered(model) == {
        "layer 0": False,
        "layer 1": False,
        "layer 2": True,
        "head": True,
        "embedding": False,
    }
    out.loss.backward()
    assert not any(_gathered(model).values())  # the backward reshards them
    # The next forward gathers them again: every step computes with the weights of that step.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model(**_batch())
    weight = model.model.language_model.layers[2].self_attn.q_proj.weight
    sharded = model.model.language_model.layers[0].self_attn.q_proj.weight
    assert not isinstance(weight, DTensor) and isinstance(sharded, DTensor)


def test_reshard_after_forward_off_keeps_every_unit(mesh):
    model = _sharded(mesh, reshard_after_forward=False)
    model(**_batch())
    assert all(_gathered(model).values())


def test_a_model_that_does_not_train_keeps_nothing_gathered(mesh, caplog):
    """A preference run's reference model: its forwards have no backward. (Stored in fp32 and
    computed in bf16, so that FSDP2 manages its frozen weights on one rank.)"""
    with caplog.at_level(logging.INFO, logger="magistral_cli.engine.parallelize"):
        model = _sharded(mesh, trains=False, param_dtype="bf16")
    assert "kept gathered" not in caplog.text
    with torch.no_grad():
        model(**_batch())
    assert not any(_gathered(model).values())


def test_always_frees_the_tail_too(mesh, caplog):
    """``reshard_after_forward: always``: the least memory, for a second all-gather of the tail."""
    with caplog.at_level(logging.INFO, logger="magistral_cli.engine.parallelize"):
        model = _sharded(mesh, reshard_after_forward="always")
    assert "kept gathered" not in caplog.text
    model(**_batch())
    assert not any(_gathered(model).values())
