"""Per-image Pixtral attention: equal to transformers' block-masked attention, isolated, idempotent."""

from __future__ import annotations

import copy

import pytest
import torch

from magistral_cli.errors import UserError
from magistral_cli.ops.vision_attention import (
    ATTENTION_NAME,
    apply_vision_attention,
    image_sequence_lengths,
    vision_attention_forward,
)
from magistral_cli.testing.tiny_model import IMAGE_TOKEN_ID, tiny_mistral3_config

pytestmark = pytest.mark.compat


@pytest.fixture(scope="module")
def model():
    from transformers import Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    # Patch size 2: a 16x16 image is 8x8 patches, 4x4 = 16 image tokens after the 2x2 merge.
    return Mistral3ForConditionalGeneration(tiny_mistral3_config(vocab_size=512, patch_size=2)).eval()


def test_image_sequence_lengths():
    assert image_sequence_lengths(torch.tensor([[16, 16], [16, 24]]), 2) == [64, 96]
    assert image_sequence_lengths([(28, 42)], 14) == [6]
    with pytest.raises(ValueError, match="2 image sizes for 3 images"):
        image_sequence_lengths([(2, 2), (2, 2)], 2, count=3)


def test_tower_matches_transformers_block_mask_in_fp32(model):
    reference = copy.deepcopy(model.model.vision_tower)
    reference.config._attn_implementation = "sdpa"  # transformers' dense block mask
    tower = copy.deepcopy(model.model.vision_tower)
    tower.transformer.layers[0].attention.config = copy.deepcopy(tower.config)  # a config not shared
    apply_vision_attention(tower, "cpu")
    assert all(
        m.config._attn_implementation == ATTENTION_NAME for m in tower.modules() if hasattr(m, "config")
    )
    pixels = torch.randn(2, 3, 16, 24)
    sizes = torch.tensor([[16, 16], [16, 24]])
    expected = reference(pixels, image_sizes=sizes).last_hidden_state
    actual = tower(pixels, image_sizes=sizes).last_hidden_state
    assert actual.shape == (1, 64 + 96, 32)  # the tiny tower is 32 wide
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_whole_model_output_unchanged_and_decoder_keeps_its_attention(model):
    patched = copy.deepcopy(model)
    apply_vision_attention(patched, "cpu")
    apply_vision_attention(patched, "cpu")  # idempotent: one hook
    tower = patched.model.vision_tower
    assert len(tower._forward_pre_hooks) == 1
    assert patched.model.language_model.config._attn_implementation != ATTENTION_NAME
    input_ids = torch.randint(16, 500, (1, 64))  # no control token, no image token
    input_ids[:, 1:33] = IMAGE_TOKEN_ID
    pixels = torch.randn(2, 3, 16, 16)
    sizes = torch.tensor([[16, 16], [16, 16]])
    kwargs = dict(input_ids=input_ids, pixel_values=pixels, image_sizes=sizes)
    torch.testing.assert_close(patched(**kwargs).logits, model(**kwargs).logits, rtol=1e-5, atol=1e-5)


def test_attention_without_image_lengths_refuses_a_dense_mask():
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="apply_vision_attention"):
        vision_attention_forward(None, q, q, q, torch.zeros(1, 1, 6, 6))
    out, weights = vision_attention_forward(None, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 2, 6]))
    assert out.shape == (1, 6, 2, 8) and weights is None
    with pytest.raises(ValueError, match="do not cover"):
        vision_attention_forward(None, q, q, q, None, cu_seq_lens_q=[0, 2, 5])


def test_bad_targets_are_user_errors():
    with pytest.raises(UserError, match="no Pixtral vision tower"):
        apply_vision_attention(torch.nn.Linear(2, 2), "cpu")
    with pytest.raises(UserError, match="unknown device"):
        apply_vision_attention(torch.nn.Linear(2, 2), "tpu")
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(UserError, match="needs torch_npu"):
            apply_vision_attention(torch.nn.Linear(2, 2), "npu")


class _CountToList(torch.overrides.TorchFunctionMode):
    """Counts ``Tensor.tolist`` calls: each one on a device tensor is a device synchronisation."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_image_lengths_are_read_once_per_forward_not_once_per_layer(model):
    """Before, every layer read cu_seq_lens_q and cu_seq_lens_k back: 1 + 2 x layers read-backs."""
    reference = copy.deepcopy(model.model.vision_tower)
    reference.config._attn_implementation = "sdpa"
    tower = copy.deepcopy(model.model.vision_tower)
    apply_vision_attention(tower, "cpu")
    assert len(tower.transformer.layers) >= 2
    pixels = torch.randn(2, 3, 16, 24)
    sizes = torch.tensor([[16, 16], [16, 24]])
    with _CountToList() as counted:
        actual = tower(pixels, image_sizes=sizes).last_hidden_state
    assert counted.calls == 1  # image_sizes, in the pre-hook
    as_list = sizes.tolist()
    with _CountToList() as counted:
        from_list = tower(pixels, image_sizes=as_list).last_hidden_state
    assert counted.calls == 0
    expected = reference(pixels, image_sizes=sizes).last_hidden_state
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(from_list, actual)


def test_host_image_ends_must_cover_the_patches():
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="do not cover 6 patches"):
        vision_attention_forward(None, q, q, q, None, magistral_image_ends=(2, 5))
    out, _ = vision_attention_forward(None, q, q, q, None, magistral_image_ends=(2, 6))
    expected, _ = vision_attention_forward(None, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 2, 6]))
    assert torch.equal(out, expected)
