"""Context parallelism, single process: sequence layout, batch and recipe checks, guards."""

from __future__ import annotations

import pytest
import torch

from magistral_cli.ops.context_parallel import (
    ContextParallelError,
    ContextParallelGroups,
    active_cp_groups,
    context_parallel_forward,
    enable_cp_attention,
    mode_sizes,
    pad_multiple,
    padded_length,
    shard_indices,
    validate_cp_batch,
)
from magistral_cli.ops.context_parallel.layout import pad_position_ids
from magistral_cli.ops.context_parallel.model import shift_labels


@pytest.mark.parametrize(("ulysses", "ring"), [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (2, 3)])
def test_shards_cover_the_sequence_once(ulysses, ring):
    seq = padded_length(45, ulysses, ring)
    assert seq % pad_multiple(ulysses, ring) == 0 and seq >= 45
    parts = [shard_indices(seq, ulysses, ring, r) for r in range(ulysses * ring)]
    assert all(p.numel() == seq // (ulysses * ring) for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))


def test_ring_layout_is_zigzag_and_ulysses_pieces_are_contiguous():
    # 2 ring ranks: 4 chunks of 4; ring rank 0 holds chunks 0 and 3, ring rank 1 chunks 1 and 2.
    assert shard_indices(16, 1, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_indices(16, 1, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # Hybrid 2 x 2: the Ulysses ranks of ring rank 0 split its zigzag part contiguously.
    assert shard_indices(16, 2, 2, 0).tolist() == [0, 1, 2, 3]
    assert shard_indices(16, 2, 2, 1).tolist() == [12, 13, 14, 15]
    assert shard_indices(16, 2, 1, 1).tolist() == list(range(8, 16))
    with pytest.raises(ValueError, match="not a multiple of 8"):
        shard_indices(12, 2, 2, 0)


def test_padding_continues_positions_and_ignores_labels():
    pos = torch.arange(5).unsqueeze(0)
    assert pad_position_ids(pos, 8).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    labels = torch.tensor([[1, 2, 3, 4, 5]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, 5, -100]]
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    assert shift_labels(labels, mask).tolist() == [[2, 3, -100, -100, -100]]


def test_batch_checks_reject_what_cp_cannot_keep_exact():
    validate_cp_batch(None)
    validate_cp_batch(torch.tensor([[1, 1, 1, 0]]))  # right padding
    with pytest.raises(ContextParallelError, match="values other than 0 and 1"):
        validate_cp_batch(torch.tensor([[1, 1, 2, 2]]))
    with pytest.raises(ContextParallelError, match="right padding only"):
        validate_cp_batch(torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(ContextParallelError, match="custom masks"):
        validate_cp_batch(torch.ones(1, 1, 4, 4))


def test_batch_check_of_a_device_mask_does_not_read_it_back():
    # A mask already on a device gets the shape check only (its host copy is checked, as the
    # trainer checks every micro-batch): reading values back would synchronise every step. The
    # meta device stands for it here: it holds no values, so any read-back would fail.
    validate_cp_batch(torch.tensor([[0, 1, 1, 1]], device="meta"))
    with pytest.raises(ContextParallelError, match="custom masks"):
        validate_cp_batch(torch.ones(1, 1, 4, 4, device="meta"))


def test_mode_sizes():
    assert mode_sizes("ulysses", 4) == (4, 1)
    assert mode_sizes("ring", 2) == (1, 2)
    assert mode_sizes("hybrid", 4) == (2, 2)
    with pytest.raises(ContextParallelError, match="hybrid"):
        mode_sizes("hybrid", 2)
    with pytest.raises(ContextParallelError, match="unknown"):
        mode_sizes("tensor", 2)


def test_cp_attention_refuses_to_run_outside_a_cp_forward():
    with pytest.raises(ContextParallelError, match="outside a CP forward"):
        active_cp_groups()


def test_cp_forward_rejects_masks_before_running_and_needs_the_cp_attention():
    from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

    model = build_tiny_model(tiny_mistral3_config(vocab_size=512, num_hidden_layers=1, vision_layers=1))
    single = ContextParallelGroups(1, 1, None, None, None, 0, 0, (0,))
    ids = torch.randint(20, 512, (1, 8))
    with pytest.raises(ContextParallelError, match="does not use the context-parallel attention"):
        context_parallel_forward(model, single, ids, ids)
    previous = enable_cp_attention(model)
    assert previous == "sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"  # the vision tower keeps its own
    with pytest.raises(ContextParallelError, match="right padding only"):
        context_parallel_forward(model, single, ids, ids, attention_mask=torch.tensor([[0] + [1] * 7]))
    # CP degree 1 through the CP path equals the transformers loss.
    out = context_parallel_forward(model, single, ids, ids)
    model.config.text_config._attn_implementation = "sdpa"
    torch.testing.assert_close(out.loss, model(input_ids=ids, labels=ids).loss)


def test_ulysses_repeats_kv_heads_or_explains_the_head_limit():
    from magistral_cli.ops.context_parallel.attention import _kv_for_ulysses

    k = torch.randn(1, 2, 4, 8)
    same, _ = _kv_for_ulysses(k, k, num_heads=8, size=2)
    assert same is k  # 2 key/value heads divide over 2 ranks: sent as they are
    repeated, _ = _kv_for_ulysses(k, k, num_heads=8, size=4)
    assert repeated.shape[1] == 8 and torch.equal(repeated[:, 3], k[:, 0])  # one copy per query head
    with pytest.raises(ContextParallelError, match="ring_attention_size"):
        _kv_for_ulysses(k, k, num_heads=6, size=4)


def test_cp_errors_are_user_errors():
    from magistral_cli.errors import UserError

    assert issubclass(ContextParallelError, UserError) and ContextParallelError.exit_code == 2
