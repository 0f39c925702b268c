"""Attention selection per device and the right-padding check."""

from __future__ import annotations

import pytest
import torch

from magistral_cli.ops.attention import resolve_attention, right_padding_problem, validate_right_padding


def test_right_padding_passes():
    validate_right_padding(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    validate_right_padding(None)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.tensor([[0, 1, 1, 1]]), "right padding only"),
        (torch.tensor([[1, 0, 1, 0]]), "right padding only"),
        (torch.tensor([[1, 1, 2, 2]]), "values other than 0 and 1"),
        (torch.ones(1, 1, 4, 4), "2D"),
    ],
)
def test_other_masks_are_rejected(mask, message):
    with pytest.raises(ValueError, match=message):
        validate_right_padding(mask)


@pytest.mark.parametrize(
    ("mask", "problem"),
    [
        (None, None),
        (torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), None),
        (torch.tensor([[0, 1, 1, 1]]), "left_padding"),
        (torch.tensor([[1, 0, 1, 0]]), "left_padding"),
        (torch.tensor([[1, 1, 2, 2]]), "values"),
        (torch.ones(1, 1, 4, 4), "shape"),
    ],
)
def test_one_rule_for_every_mask_check(mask, problem):
    """The rule that the trainer's check and the context-parallel batch check both apply."""
    from magistral_cli.ops.context_parallel import ContextParallelError, validate_cp_batch

    assert right_padding_problem(mask) == problem
    for validate, error in ((validate_right_padding, ValueError), (validate_cp_batch, ContextParallelError)):
        if problem is None:
            validate(mask)
        else:
            with pytest.raises(error):
                validate(mask)


def test_the_shape_alone_is_checked_without_reading_values():
    # A mask whose values cannot be read back (the meta device holds none) gets the shape check.
    assert right_padding_problem(torch.zeros(1, 4, device="meta"), read_values=False) is None
    assert right_padding_problem(torch.zeros(1, 1, 4, 4, device="meta"), read_values=False) == "shape"


def test_cpu_uses_sdpa_for_flash_recipes():
    assert resolve_attention("flash_attention_2", "cpu") == "sdpa"
    assert resolve_attention("sdpa", "cpu") == "sdpa"
    assert resolve_attention("eager", "cpu") == "eager"


def test_unknown_attention_is_an_error():
    with pytest.raises(ValueError, match="not supported"):
        resolve_attention("paged_whatever", "cpu")
