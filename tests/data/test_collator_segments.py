"""The collator's attention segments (``cu_seqlens``) for packed micro-batches."""

from __future__ import annotations

import numpy as np
import pytest

from magistral_cli.data.collator import PixtralCollator, sequence_lengths


def _item(*lengths):
    total = sum(lengths)
    positions = np.concatenate([np.arange(n) for n in lengths])
    return {
        "input_ids": np.arange(1, total + 1),
        "labels": np.arange(1, total + 1),
        "position_ids": positions,
        "sample_lengths": np.array(lengths),
        "pixel_values": [],
    }


def test_samples_rows_and_padding_segments():
    items = [_item(3, 4), _item(2, 2, 5)]  # rows of 7 and 9 tokens: the first is padded by 2
    neat = PixtralCollator(0, segments="samples")(items)
    assert neat["cu_seqlens"].tolist() == [0, 3, 7, 9, 11, 13, 18]
    assert str(neat["cu_seqlens"].dtype) == "torch.int32"
    plain = PixtralCollator(0, segments="rows")(items)
    assert plain["cu_seqlens"].tolist() == [0, 7, 9, 18]  # a row's real tokens, then its padding
    assert "cu_seqlens" not in PixtralCollator(0)(items)  # no packing: nothing changes
    # the rest of the batch is the same in every mode
    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
        assert neat[key].equal(plain[key])
    assert neat["attention_mask"].sum(dim=1).tolist() == [7, 9]


def test_padding_to_a_multiple_keeps_the_padding_a_segment():
    neat = PixtralCollator(0, pad_to_multiple_of=8, segments="samples")([_item(3, 4)])
    assert neat["input_ids"].shape == (1, 8) and neat["cu_seqlens"].tolist() == [0, 3, 7, 8]


def test_lengths_that_do_not_add_up_are_refused():
    bad = _item(3, 4)
    bad["sample_lengths"] = np.array([3, 3])
    with pytest.raises(ValueError, match="do not add up"):
        PixtralCollator(0, segments="samples")([bad])
    with pytest.raises(ValueError, match="segments must be one of"):
        PixtralCollator(0, segments="tokens")


def test_sequence_lengths_are_the_causal_sequences_real_tokens():
    """What the step's model FLOPs are counted over: rows, or a pack's segments, never padding."""
    items = [_item(3, 4), _item(2, 2, 5)]
    plain_rows = PixtralCollator(0)(items)
    assert sequence_lengths(plain_rows["attention_mask"]) == [7, 9]
    neat = PixtralCollator(0, pad_to_multiple_of=8, segments="samples")(items)  # rows of 16, padded
    assert sequence_lengths(neat["attention_mask"], neat["cu_seqlens"]) == [3, 4, 2, 2, 5]
    rows = PixtralCollator(0, pad_to_multiple_of=8, segments="rows")(items)
    assert sequence_lengths(rows["attention_mask"], rows["cu_seqlens"]) == [7, 9]
    empty = plain_rows["attention_mask"].clone()
    empty[0] = 0  # a filler row without real tokens is no sequence
    assert sequence_lengths(empty) == [9]
