"""Chunked cross entropy equals the plain one: loss, d/d hidden and d/d weight."""

from __future__ import annotations

import torch

from magistral_cli.ops.chunked_loss import ChunkedCrossEntropy, cross_entropy_sum


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 37), generator=g)
    labels[0, :5] = -100
    labels[1, -7:] = -100
    return hidden, weight, labels


def test_plain_matches_torch_cross_entropy():
    hidden, weight, labels = _inputs()
    expected = torch.nn.functional.cross_entropy(
        (hidden @ weight.t()).reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    assert torch.allclose(cross_entropy_sum(hidden, weight, labels), expected, rtol=1e-6)


def test_chunked_equals_plain_loss_and_gradients():
    hidden, weight, labels = _inputs()
    plain = cross_entropy_sum(hidden, weight, labels)
    g_plain = torch.autograd.grad(plain * 0.37, (hidden, weight))
    for chunk in (1, 8, 73):
        chunked = cross_entropy_sum(hidden, weight, labels, chunk_size=chunk)
        assert chunked.grad_fn is not None and "ChunkedCrossEntropy" in type(chunked.grad_fn).__name__
        g_chunk = torch.autograd.grad(chunked * 0.37, (hidden, weight))
        assert torch.allclose(chunked, plain, rtol=1e-6), chunk
        assert torch.allclose(g_chunk[0], g_plain[0], atol=1e-6), chunk
        assert torch.allclose(g_chunk[1], g_plain[1], atol=1e-5), chunk


def test_single_chunk_uses_plain_autograd():
    hidden, weight, labels = _inputs()
    loss = cross_entropy_sum(hidden, weight, labels, chunk_size=74)  # 74 tokens: one chunk
    assert "ChunkedCrossEntropy" not in type(loss.grad_fn).__name__
    assert torch.allclose(loss, cross_entropy_sum(hidden, weight, labels), rtol=0)


def test_frozen_weight_gets_no_gradient_buffer():
    hidden, weight, labels = _inputs()
    weight = weight.detach()
    loss = cross_entropy_sum(hidden, weight, labels, chunk_size=8)
    (grad_hidden,) = torch.autograd.grad(loss, (hidden,))
    assert torch.allclose(
        grad_hidden, torch.autograd.grad(cross_entropy_sum(hidden, weight, labels), (hidden,))[0], atol=1e-6
    )


def test_logits_never_exceed_one_chunk():
    """The [tokens, vocab] logits only ever exist one chunk at a time."""
    hidden, weight, labels = _inputs()
    seen = []
    real = torch.Tensor.float

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if out.ndim == 2 and out.shape[-1] == 50:
            seen.append(out)
        return out

    torch.Tensor.float = spy
    try:
        ChunkedCrossEntropy.apply(hidden.reshape(-1, 16), weight, labels.reshape(-1), 8)
    finally:
        torch.Tensor.float = real
    assert len(seen) == 10  # 74 tokens in chunks of 8
    assert all(t.shape[0] <= 8 for t in seen)
