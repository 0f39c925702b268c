"""Context-parallel attention against full attention: time per forward+backward, side by side.

Runs the full causal SDPA on one process, then Ulysses, Ring and (with 4 processes) Hybrid
on ``--nproc`` CPU processes with gloo, on the same global tensors, and prints the median
time of each and its ratio to the full attention. On the CPU the figures show the cost of
the communication and of the ring's block kernel, not a speed-up: CP exists to fit
sequences that one device's memory cannot hold. With ``--ring-kernel math`` the size of the
fp32 score block the math kernel materialises per rank is printed.

    python benchmarks/cp_attention.py --nproc 2 --seq-len 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from magistral_cli.runtime import spawn_ranks


def _tensors(args, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape_q = (1, args.heads, args.seq_len, args.head_dim)
    shape_kv = (1, args.kv_heads, args.seq_len, args.head_dim)
    return (
        torch.randn(*shape_q, generator=gen),
        torch.randn(*shape_kv, generator=gen),
        torch.randn(*shape_kv, generator=gen),
        torch.randn(*shape_q, generator=gen),
    )


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _full(args) -> float:
    q, k, v, dout = _tensors(args)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=args.kv_heads != args.heads)
        out.backward(dout)

    return _time(run, args.repeats)


def _worker(rank, args, mode):
    """One rank's median forward+backward time of the CP attention (inside the process group)."""
    from magistral_cli.ops.context_parallel import (
        build_cp_mesh,
        cp_attention,
        cp_groups_from_mesh,
        mode_sizes,
        set_attention_backends,
    )
    from magistral_cli.ops.context_parallel.layout import split_for_cp
    from magistral_cli.ops.context_parallel.ring import BLOCK_KERNELS

    set_attention_backends(ring_kernel=BLOCK_KERNELS[args.ring_kernel]())

    u, r = mode_sizes(mode, dist.get_world_size())
    groups = cp_groups_from_mesh(build_cp_mesh("cpu", u, r))
    q, k, v, dout = (split_for_cp(t, groups, dim=2) for t in _tensors(args))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = args.head_dim**-0.5

    def run():
        dist.barrier()
        cp_attention(q, k, v, groups, scale).backward(dout)

    return _time(run, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--ring-kernel", choices=("cpu_flash", "math"), default="cpu_flash")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    full = _full(args)
    modes = ["ulysses", "ring"] + (["hybrid"] if args.nproc >= 4 and args.nproc % 2 == 0 else [])
    print(
        f"seq_len {args.seq_len}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
        f"{args.nproc} processes, ring kernel {args.ring_kernel}"
    )
    print(f"{'attention':<10} {'fwd+bwd s':>10} {'vs full':>8}")
    print(f"{'full':<10} {full:>10.4f} {1.0:>8.2f}")
    for mode in modes:
        # Rank 0's time, as before (the barrier in every run keeps the ranks in step).
        seconds = spawn_ranks(_worker, args.nproc, (args, mode), threads=args.threads)[0]
        print(f"{mode:<10} {seconds:>10.4f} {seconds / full:>8.2f}")
    if args.ring_kernel == "math":
        chunk = args.seq_len // (2 * args.nproc)
        block_mib = args.heads * 2 * chunk * chunk * 4 / 2**20
        whole_mib = args.heads * args.seq_len**2 * 4 / 2**20
        print(
            f"ring math kernel: fp32 score block per rank {block_mib:.1f} MiB (whole matrix {whole_mib:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
