"""Model FLOPs (``model_config.training_flops_per_token`` / ``training_flops``) on the real config,
against a hand computation from the published config.json and against the weights a model built
from it holds (``parameter_counts``); and on a tiny model, against what torch's ``FlopCounterMode``
counts in a real forward and backward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from magistral_cli.model_config import (
    matmul_parameters,
    parameter_counts,
    training_flops,
    training_flops_per_token,
)

REAL_CONFIG = Path(__file__).resolve().parent / "fixtures" / "magistral-small-2509" / "config.json"


@pytest.fixture(scope="module")
def real_config(tmp_path_factory):
    from magistral_cli.engine.model import load_model_config

    directory = tmp_path_factory.mktemp("magistral-small-2509")
    shutil.copy(REAL_CONFIG, directory / "config.json")
    return load_model_config(directory)


def test_real_config_flops_per_token_by_hand(real_config):
    raw = json.loads(REAL_CONFIG.read_text(encoding="utf-8"))["text_config"]
    # The published sizes, written out: GQA with 32 query and 8 KV heads of 128, an untied head.
    assert (raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (
        5120,
        32,
        8,
        128,
    )
    assert (raw["num_hidden_layers"], raw["intermediate_size"], raw["vocab_size"]) == (40, 32768, 131072)
    q = o = 5120 * 32 * 128  # 20,971,520 each
    k = v = 5120 * 8 * 128  # 5,242,880 each
    gate = up = down = 5120 * 32768  # 167,772,160 each
    per_layer = q + k + v + o + gate + up + down  # 555,745,280
    head = 131072 * 5120  # 671,088,640 (lm_head; the embedding is a lookup)
    n = 40 * per_layer + head
    assert n == 22_900_899_840
    attention_4096 = 6 * 40 * 32 * 128 * 4096  # causal QK^T and AV, forward and backward
    assert 6 * n + attention_4096 == 141_431_930_880

    assert matmul_parameters(real_config) == n
    assert training_flops_per_token(real_config, 4096) == 141_431_930_880  # 1.414e11 FLOPs per token
    assert training_flops_per_token(real_config.text_config, 4096) == 141_431_930_880
    assert training_flops_per_token(real_config, 0) == 6 * n
    # A sequence's FLOPs are its length times the per-token figure at that length; a batch sums them.
    assert training_flops(real_config, [4096]) == 4096 * 141_431_930_880
    assert training_flops(real_config, [4096, 100, 1]) == sum(
        s * training_flops_per_token(real_config, s) for s in (4096, 100, 1)
    )
    assert training_flops(real_config, []) == 0


def test_matmul_parameters_are_the_built_models_weights_less_embedding_norms_and_vision(real_config):
    from magistral_cli.engine.model import build_model

    model = build_model(real_config, meta=True, attn_implementation="sdpa")
    total = parameter_counts(model)["total"]
    assert total == 24_011_361_280
    language = model.model.language_model
    embedding = parameter_counts(language.embed_tokens)["total"]
    norms = sum(
        parameter_counts(module)["total"]
        for name, module in language.named_modules()
        if name.endswith("norm")
    )
    vision = parameter_counts(model.model.vision_tower)["total"]
    projector = parameter_counts(model.model.multi_modal_projector)["total"]
    assert norms == 40 * 2 * 5120 + 5120
    assert total - embedding - norms - vision - projector == matmul_parameters(real_config)


@pytest.mark.compat  # transformers' rotary embedding differs between 5.17 and 5.25
@pytest.mark.parametrize("length", [48, 17])
def test_torch_counts_the_same_matmuls_plus_the_masked_half_of_the_scores(length):
    """Eager attention computes the whole score matrix, so torch counts 6 x L x H x hd x n^2 more
    than the causal count; every other matmul (q, k, v, o, MLP, head; forward, input and weight
    gradients) is the same 6 x matmul_parameters x n."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

    config = tiny_mistral3_config(vocab_size=512)
    model = build_tiny_model(config).train()
    model.set_attn_implementation("eager")
    model.model.vision_tower.requires_grad_(False)  # frozen, as in the recipes (a text batch skips it)
    model.model.multi_modal_projector.requires_grad_(False)
    ids = torch.randint(16, 512, (1, length), generator=torch.Generator().manual_seed(length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    text = config.text_config
    masked_half = 6 * text.num_hidden_layers * text.num_attention_heads * text.head_dim * length**2
    per_module = counter.get_flop_counts()
    counts = {str(op): n for op, n in per_module["Global"].items()}
    assert counts["aten.mm"] == 6 * matmul_parameters(config) * length
    # transformers 5.17-5.22 compute the rotary angles as a product (inv_freq @ positions: head_dim x
    # n FLOPs, no model FLOP); later releases do not. Counted apart, so the rest is exact on both.
    rotary = sum(per_module.get(f"{type(model).__name__}.model.language_model.rotary_emb", {}).values())
    assert rotary in (0, text.head_dim * length)
    assert counter.get_total_flops() - rotary == training_flops(config, [length]) + masked_half
