"""Attention selection per device and the right-padding check."""

from __future__ import annotations

import pytest
import torch

from magistral_cli.ops.attention import resolve_attention, validate_right_padding


def test_right_padding_passes():
    validate_right_padding(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    validate_right_padding(None)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.tensor([[0, 1, 1, 1]]), "right padding only"),
        (torch.tensor([[1, 0, 1, 0]]), "right padding only"),
        (torch.tensor([[1, 1, 2, 2]]), "neat_packing"),
        (torch.ones(1, 1, 4, 4), "2D"),
    ],
)
def test_other_masks_are_rejected(mask, message):
    with pytest.raises(ValueError, match=message):
        validate_right_padding(mask)


def test_cpu_uses_sdpa_for_flash_recipes():
    assert resolve_attention("flash_attention_2", "cpu") == "sdpa"
    assert resolve_attention("sdpa", "cpu") == "sdpa"
    assert resolve_attention("eager", "cpu") == "eager"


def test_unknown_attention_is_an_error():
    with pytest.raises(ValueError, match="not supported"):
        resolve_attention("paged_whatever", "cpu")
