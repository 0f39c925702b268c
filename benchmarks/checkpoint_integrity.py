"""What the checkpoint integrity record costs: `save_checkpoint` (and its hashing) against a bare `dcp.save`.

The trainer's save (``magistral_cli.engine.checkpoint.save_checkpoint``) writes the DCP, then every
rank hashes the files it wrote (xxh3-64) and rank 0 records sizes and digests in integrity.json;
resume verifies them. This script saves the same state (``--gib`` of fp32 tensors, split over
``--ranks`` gloo processes, as FSDP shards would be) both ways, interleaved for ``--repeat``
rounds, and times the verification that resume runs. It also times SHA-256 on the same files, the
digest the integrity record does not use. Prints the best round of each, and the ratios.

    python benchmarks/checkpoint_integrity.py                 # 2 GiB over 2 ranks, 3 rounds
    python benchmarks/checkpoint_integrity.py --gib 4 --ranks 2 --repeat 5
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MIB = 1 << 20


def _worker(rank: int, out: str, gib: float, repeat: int) -> dict[str, list[float]]:
    """One rank's times per round (inside the process group, 1 thread)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from magistral_cli.engine import checkpoint as ckpt

    world = dist.get_world_size()
    # This rank's share of the state: 16 MiB tensors, as a shard of a large model would be.
    per_rank = int(gib * (1 << 30) / world)
    tensors = {
        f"model.t{rank}_{i}": torch.randn(16 * MIB // 4) for i in range(max(1, per_rank // (16 * MIB)))
    }
    root = Path(out)
    times: dict[str, list[float]] = {
        "dcp.save": [],
        "save_checkpoint": [],
        "  of which hashing": [],
        "verify": [],
        "sha256": [],
    }
    for r in range(repeat):
        for case in ("dcp.save", "save_checkpoint"):
            target = root / f"{case}-{r}"
            dist.barrier()
            t0 = time.perf_counter()
            if case == "dcp.save":
                dcp.save(tensors, checkpoint_id=str(target / "step_1"))
                dist.barrier()
            else:
                ckpt.save_checkpoint(tensors, target, 1)
            times[case].append(time.perf_counter() - t0)
            if case == "save_checkpoint":
                times["  of which hashing"].append(ckpt.LAST_SAVE["hash_s"])
        # Resume's check: every rank verifies its share of the files.
        checkpoint = root / f"save_checkpoint-{r}" / "step_1"
        dist.barrier()
        t0 = time.perf_counter()
        result = ckpt.verify_checkpoint(checkpoint, rank, world)
        dist.barrier()
        times["verify"].append(time.perf_counter() - t0)
        assert result.ok, result.problems
        # The same files with SHA-256, split the same way.
        t0 = time.perf_counter()
        for path in ckpt.rank_files(checkpoint, rank):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(8 * MIB):
                    digest.update(chunk)
        dist.barrier()
        times["sha256"].append(time.perf_counter() - t0)
        for case in ("dcp.save", "save_checkpoint"):
            shutil.rmtree(root / f"{case}-{r}", ignore_errors=True)
    dist.barrier()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (all ranks together)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()

    from magistral_cli.runtime import spawn_ranks

    base = args.dir or Path(tempfile.mkdtemp(prefix="ckpt-integrity-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        # Rank 0's times, as before (the barriers keep the ranks' rounds together).
        times = spawn_ranks(_worker, args.ranks, (str(base), args.gib, args.repeat), threads=1)[0]
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    size_mib = args.gib * 1024
    print(f"{args.gib:g} GiB over {args.ranks} ranks, best of {args.repeat} rounds (interleaved):")
    for name, seconds in best.items():
        print(f"  {name:<16} {seconds:7.3f} s  {size_mib / seconds:8.0f} MiB/s")
    print(
        f"save_checkpoint / dcp.save: {best['save_checkpoint'] / best['dcp.save']:.3f} (hashing, fsyncs, commit)"
    )
    print(
        f"hashing / dcp.save: {best['  of which hashing'] / best['dcp.save']:.3f} (the integrity record's cost)"
    )
    print(f"verify / dcp.save: {best['verify'] / best['dcp.save']:.3f} (resume's check against a save)")
    print(f"xxh3 verify / SHA-256 on the same files: {best['verify'] / best['sha256']:.3f}")


if __name__ == "__main__":
    main()
