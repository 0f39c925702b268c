"""``magistral probe packed-attention``: the packed (neat / plain) attention on the device.

What training runs with ``packing`` or ``neat_packing`` on this device (``ops.packed_attention``
behind the kernel ``resolve_attention`` picks: SDPA with a block-diagonal mask on the CPU and for
fp32, on CUDA in bf16 a varlen kernel: flash-attn's ``flash_attn_varlen_func`` when installed,
else torch's ``varlen_attn``; ``npu_fusion_attention`` TND on NPU) against a reference computed
here in fp32 on the CPU: causal SDPA run separately on every segment. Per dtype (fp32, bf16) and
layout (neat: several samples a row; plain: one segment a row), the forward output and the query,
key and value gradients must be within the limits, and changing one sample must leave the other
samples of its row unchanged in a neat pack (fp32 and bf16). Every case names the path that ran
(``path``, ``backend``): the varlen kernel ``kernel_path`` reports must be the one that was
called (``ops.attention_kernels.record_varlen_kernels``). A device that is not here is a SKIP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import Cases, ProbeResult, device_missing_reason, skip

PROBE = "packed-attention"
#: relative L2 limits (fp32 / bf16) of the forward output and of the gradients
LIMITS = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 3e-2)}
BATCH, HEADS, KV_HEADS, LENGTH, DIM = 2, 8, 2, 256, 64
#: row 0: samples of 100, 60, 40 tokens and 56 padding; row 1: 30 + 200, 26 padding
NEAT = (100, 160, 200, 256, 286, 486, 512)
PLAIN = (200, 256, 486, 512)


def _kernel(device: str) -> str:
    from magistral_cli.ops.attention import resolve_attention

    return resolve_attention("flash_attention_2", device)


def _reference(q, k, v, ends):
    import torch
    import torch.nn.functional as F

    batch, heads, length, dim = q.shape
    repeat = heads // k.shape[1]
    flat = [
        t.detach().float().cpu().transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (q, k, v)
    ]
    for t in flat:
        t.requires_grad_(True)
    pieces, start = [], 0
    for end in ends:
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in flat)
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start = end
    out = torch.cat(pieces).view(batch, length, heads, dim)
    return out, flat


def run_packed_attention_probe(
    device: str = "cpu", mode: str = "default", *, backend: Callable[..., Any] | None = None
) -> ProbeResult:
    """Run the probe on ``device``; ``backend`` (tests) replaces the packed attention function."""
    missing = device_missing_reason(device)
    if missing:
        return skip(PROBE, device, mode, missing)
    import torch

    from magistral_cli.ops import packed_attention as pa
    from magistral_cli.ops.attention_kernels import VARLEN_KERNELS, record_varlen_kernels
    from magistral_cli.probes.common import relative_l2

    if device == "npu":
        import torch_npu  # noqa: F401
    kernel = _kernel(device)
    attend = backend or pa.packed_attention_forward
    cases = Cases()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    paths = {name: pa.kernel_path(kernel, device, d, head_dim=DIM) for name, d in dtypes.items()}

    def check_ran(ran: list[str], path: str) -> None:
        """Our attention (not a test's backend) called the varlen kernel it reports, once, or none."""
        expected = [path] if path in VARLEN_KERNELS else []
        if backend is None:
            assert ran == expected, f"the varlen kernels that ran, {ran}, are not {expected} ({path})"

    def check(dtype_name: str, ends: tuple[int, ...]) -> dict[str, Any]:
        dtype = dtypes[dtype_name]
        g = torch.Generator().manual_seed(len(ends))
        shapes = ((BATCH, HEADS, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM))
        base = [torch.randn(*s, generator=g) for s in shapes]
        q, k, v = (t.to(device=device, dtype=dtype).requires_grad_(True) for t in base)
        cu = torch.tensor([0, *ends], dtype=torch.int32)
        inputs = pa.packed_inputs(cu, (BATCH, LENGTH), torch.device(device))
        longest = inputs["max_seqlen"]
        with record_varlen_kernels() as ran:
            out, _ = attend(
                None, q, k, v, None, scaling=DIM**-0.5, cu_seq_lens_q=inputs["cu_seqlens"],
                cu_seq_lens_k=inputs["cu_seqlens"], max_length_q=longest, max_length_k=longest,
                packed_seq_ends=inputs["seq_ends"], kernel=kernel,
            )  # fmt: skip
        path = paths[dtype_name]
        check_ran(ran, path)
        grad_out = torch.randn(out.shape, generator=g)
        out.backward(grad_out.to(device=device, dtype=dtype))
        ref, leaves = _reference(q, k, v, ends)
        ref.backward(grad_out)
        forward_limit, grad_limit = LIMITS[dtype_name]
        forward = relative_l2(out.detach().float().cpu(), ref.detach())
        assert forward <= forward_limit, f"forward relative L2 {forward:.3g} > {forward_limit}"
        grads = {}
        for name, mine, theirs in zip("qkv", (q, k, v), leaves, strict=True):
            flat = mine.grad.float().cpu().transpose(1, 2).reshape(theirs.grad.shape)
            grads[name] = relative_l2(flat, theirs.grad)
            assert grads[name] <= grad_limit, f"{name} gradient relative L2 {grads[name]:.3g} > {grad_limit}"
        return {
            "forward_rel_l2": forward,
            "grad_rel_l2": grads,
            "kernel": kernel,
            "path": path,
            "backend": pa.path_name(path),
        }

    for dtype_name in LIMITS:
        for layout, ends in (("neat", NEAT), ("plain", PLAIN)):
            cases.run(f"{dtype_name} {layout}", lambda d=dtype_name, e=ends: check(d, e))

    def isolation() -> dict[str, Any]:
        cu = torch.tensor([0, *NEAT], dtype=torch.int32)
        inputs = pa.packed_inputs(cu, (BATCH, LENGTH), torch.device(device))

        def run(q, k, v):
            return attend(
                None, q, k, v, None, scaling=DIM**-0.5, cu_seq_lens_q=inputs["cu_seqlens"],
                cu_seq_lens_k=inputs["cu_seqlens"], max_length_q=inputs["max_seqlen"],
                max_length_k=inputs["max_seqlen"], packed_seq_ends=inputs["seq_ends"], kernel=kernel,
            )[0].float().cpu()  # fmt: skip

        moved = {}
        for dtype_name, dtype in dtypes.items():
            g = torch.Generator().manual_seed(7)
            q, k, v = (
                torch.randn(BATCH, h, LENGTH, DIM, generator=g).to(device=device, dtype=dtype)
                for h in (HEADS, KV_HEADS, KV_HEADS)
            )
            with record_varlen_kernels() as ran:
                before = run(q, k, v)
            check_ran(ran, paths[dtype_name])
            q2, k2, v2 = (t.clone() for t in (q, k, v))
            for t in (q2, k2, v2):
                t[0, :, : NEAT[0]] += 3.0  # the first sample of row 0
            after = run(q2, k2, v2)
            moved[dtype_name] = float((after[0, NEAT[0] :] - before[0, NEAT[0] :]).abs().max())
            assert moved[dtype_name] <= 1e-6, (
                f"{dtype_name}: changing one sample moved its pack-mates' outputs by {moved[dtype_name]:.3g}"
            )
            assert float((after[0, : NEAT[0]] - before[0, : NEAT[0]]).abs().max()) > 1e-3, (
                f"{dtype_name}: the changed sample did not change"
            )
        return {"neighbour_change": moved, "path": paths}

    cases.run("isolation", isolation)
    for case in cases.cases:
        case.setdefault("kernel", kernel)
    ran = ", ".join(f"{name}: {pa.path_name(path)}" for name, path in paths.items())
    return cases.result(
        PROBE,
        device,
        mode,
        f"the packed attention over {kernel} ({ran}) matches per-segment causal SDPA "
        f"(fp32 {LIMITS['fp32']}, bf16 {LIMITS['bf16']}) and keeps packed samples apart",
    )
