"""Side-by-side timings of the ops behind the probes; prints measured figures and ratios.

    python benchmarks/bench_probe_ops.py [--device auto|cpu|cuda|npu] [--images 4] [--side 448]

- vision attention: transformers' dense block mask (sdpa) against our per-image attention,
  forward + backward of a Pixtral layer stack on ``--images`` images of ``--side`` pixels
  (patch 14), plus the size of the mask it no longer builds;
- split-copy: FSDP2's native copy-out against the Triton kernel (cuda / npu only: on the CPU
  the kernel only runs in Triton's interpreter, which measures nothing useful);
- contiguous Linear: native Linear against the custom weight-gradient path (cuda / npu; bf16).

Not run in CI. Timings are medians of ``--repeats`` alternating runs after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "npu":
        torch.npu.synchronize()


def _compare_ms(fn_a, fn_b, device: str, repeats: int) -> tuple[float, float]:
    """Median ms of two variants, run alternately so that load drift hits both alike."""
    fn_a()
    fn_b()
    _sync(device)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, bucket in ((fn_a, times[0]), (fn_b, times[1])):
            start = time.perf_counter()
            fn()
            _sync(device)
            bucket.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times[0]), statistics.median(times[1])


def bench_vision_attention(device: str, images: int, side: int, repeats: int) -> None:
    import torch
    from transformers import PixtralVisionConfig
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

    from magistral_cli.ops.vision_attention import (
        ATTENTION_NAME,
        apply_vision_attention,
        set_attention_implementation,
    )

    dtype = torch.bfloat16
    config = PixtralVisionConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=side,
        patch_size=14,
    )
    torch.manual_seed(0)
    tower = PixtralVisionModel(config).to(device=device, dtype=dtype)
    pixels = torch.randn(images, 3, side, side, device=device, dtype=dtype)
    sizes = torch.tensor([[side, side]] * images, device=device)

    def step():
        out = tower(pixels, image_sizes=sizes).last_hidden_state
        out.float().sum().backward()

    apply_vision_attention(tower, device)  # adds the pre-hook; the dense variant ignores its lengths

    def dense_step():
        set_attention_implementation(tower, "sdpa")  # transformers' dense block mask
        step()

    def our_step():
        set_attention_implementation(tower, ATTENTION_NAME)
        step()

    dense, ours = _compare_ms(dense_step, our_step, device, repeats)
    patches = images * (side // 14) ** 2
    mask_mib = patches * patches * torch.finfo(dtype).bits / 8 / 2**20
    print(
        f"vision attention  {device} bf16, {images} images of {side}px ({patches} patches), 2 layers fwd+bwd: "
        f"dense block mask {dense:.1f} ms, per-image {ours:.1f} ms, speed-up x{dense / ours:.2f}; "
        f"dense mask not built: {mask_mib:.1f} MiB"
    )


def bench_split_copy(device: str, repeats: int) -> None:
    import torch

    if device == "cpu":
        print("split-copy        skipped on the CPU (the kernel only runs interpreted there)")
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401

    from magistral_cli.ops import split_copy

    world = 8
    sizes = [
        5120 * 5120 // world,
        5120 // world,
        5120 * 1024 // world,
    ] * 4  # one decoder layer's shards, roughly
    source = torch.randn(world, sum(sizes), device=device, dtype=torch.bfloat16)
    out = [torch.empty(world, n, device=device, dtype=torch.bfloat16) for n in sizes]
    native, kernel = _compare_ms(
        lambda: torch.split_with_sizes_copy(source, sizes, dim=1, out=out),
        lambda: split_copy.split_with_sizes_copy(source, sizes, 1, out=out),
        device,
        repeats,
    )
    print(
        f"split-copy        {device} bf16 world {world}: native {native:.3f} ms, Triton {kernel:.3f} ms, x{native / kernel:.2f}"
    )


def bench_contiguous_linear(device: str, repeats: int) -> None:
    import torch

    if device == "cpu":
        print("contiguous Linear skipped on the CPU (the path is for NPU / CUDA bf16)")
        return
    from magistral_cli.config.patterns import select_modules
    from magistral_cli.ops.contiguous_linear import WHAT, apply_contiguous_linear_grad

    x = torch.randn(8192, 5120, device=device, dtype=torch.bfloat16, requires_grad=True)
    native = torch.nn.Sequential(torch.nn.Linear(5120, 5120, bias=False)).to(device, torch.bfloat16)
    ours = torch.nn.Sequential(torch.nn.Linear(5120, 5120, bias=False)).to(device, torch.bfloat16)
    apply_contiguous_linear_grad(
        select_modules(ours, ["0"], what=WHAT), device=device, param_dtype=torch.bfloat16
    )

    def step(model):
        model(x).sum().backward()

    a, b = _compare_ms(lambda: step(native), lambda: step(ours), device, repeats)
    print(
        f"contiguous Linear {device} bf16 8192x5120x5120 fwd+bwd: native {a:.2f} ms, contiguous {b:.2f} ms, x{a / b:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "npu"))
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from magistral_cli.probes.common import resolve_probe_device

    device = resolve_probe_device(args.device)
    if device == "npu":
        import torch_npu  # noqa: F401
    bench_vision_attention(device, args.images, args.side, args.repeats)
    bench_split_copy(device, args.repeats)
    bench_contiguous_linear(device, args.repeats)


if __name__ == "__main__":
    main()
