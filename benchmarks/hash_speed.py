"""SHA-256 verification speed of `magistral fetch --verify-only` against `openssl dgst -sha256`.

Writes N files of SIZE in a temporary folder, then times, on the same files:

* ``openssl dgst -sha256`` on one file, and on all files (one process, one file after the other);
* our verify (``fetch_assets(..., verify_only=True)``, the code `magistral fetch --verify-only`
  runs, with a lock holding the files' sums) on one file and on all files;
* ``sha256sum`` on one file, for reference.

Each figure is the best of ``--repeat`` runs. By default the files stay in the page cache (the
hashing itself is measured); ``--cold`` evicts them before every run (posix_fadvise DONTNEED),
so the disk is measured too. Prints MiB/s and the ratio ours / openssl.

    python benchmarks/hash_speed.py                 # 4 x 1 GiB
    python benchmarks/hash_speed.py --files 2 --size-gib 2 --cold
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from magistral_cli.assets.fetch import fetch_assets  # noqa: E402
from magistral_cli.assets.hashing import default_workers  # noqa: E402

MIB = 1 << 20


def write_files(folder: Path, n: int, size: int) -> list[Path]:
    block = bytearray(os.urandom(16 * MIB))
    paths = []
    for i in range(n):
        path = folder / f"shard-{i + 1:05d}.bin"
        with open(path, "wb") as f:
            left = size
            while left:
                block[:8] = (i * 1_000_003 + left).to_bytes(8, "little")  # every block differs
                chunk = memoryview(block)[: min(left, len(block))]
                f.write(chunk)
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    return paths


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def best_of(repeat: int, paths: list[Path], cold: bool, fn) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        if cold:
            evict(paths)
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def openssl(paths: list[Path]) -> dict[str, str]:
    out = subprocess.run(
        ["openssl", "dgst", "-sha256", "-r", *map(str, paths)], capture_output=True, text=True, check=True
    )
    sums = {}
    for line in out.stdout.splitlines():
        digest, name = line.split(" ", 1)
        sums[Path(name.lstrip("*")).name] = digest
    return sums


def sha256sum(paths: list[Path]) -> dict[str, str]:
    out = subprocess.run(["sha256sum", *map(str, paths)], capture_output=True, text=True, check=True)
    return {Path(line.split()[1]).name: line.split()[0] for line in out.stdout.splitlines()}


def write_lock(folder: Path, paths: list[Path], sums: dict[str, str]) -> Path:
    lock = {
        "format": 1,
        "files": [
            {
                "name": p.name,
                "repo": "bench/files",
                "revision": hashlib.sha1(b"bench").hexdigest(),
                "sha256": sums[p.name],
                "bytes": p.stat().st_size,
            }
            for p in paths
        ],
    }
    path = folder / f"lock-{len(paths)}.json"
    path.write_text(json.dumps(lock))
    return path


def ours(folder: Path, lock: Path):
    def run():
        report = fetch_assets(folder / "model", lock, verify_only=True)
        if not report.ok:
            raise SystemExit(f"verify failed: {report.to_json()}")
        return report

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=4, help="number of files (default 4)")
    parser.add_argument("--size-gib", type=float, default=1.0, help="size of each file in GiB (default 1)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write them (default: a temp folder)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept (default 3)")
    parser.add_argument(
        "--cold", action="store_true", help="evict the files from the page cache before each run"
    )
    args = parser.parse_args()
    if shutil.which("openssl") is None:
        raise SystemExit("openssl is not on PATH: nothing to compare against")

    size = int(args.size_gib * (1 << 30))
    tmp = Path(tempfile.mkdtemp(prefix="hash-speed-", dir=args.dir))
    try:
        model = tmp / "model"
        model.mkdir()
        t0 = time.perf_counter()
        paths = write_files(model, args.files, size)
        print(f"wrote {args.files} x {size / MIB:.0f} MiB in {time.perf_counter() - t0:.1f} s to {model}")
        total = size * args.files
        cores = default_workers(args.files)
        print(
            f"openssl: {subprocess.run(['openssl', 'version'], capture_output=True, text=True).stdout.strip()}"
        )
        print(f"cores usable: {cores}; cache: {'cold (evicted before each run)' if args.cold else 'warm'}")

        one = paths[:1]
        t_ossl1, sums1 = best_of(args.repeat, one, args.cold, lambda: openssl(one))
        t_ossl_all, sums = best_of(args.repeat, paths, args.cold, lambda: openssl(paths))
        lock1, lock_all = write_lock(tmp, one, sums1), write_lock(tmp, paths, sums)
        t_ours1, _ = best_of(args.repeat, one, args.cold, ours(tmp, lock1))
        t_ours_all, _ = best_of(args.repeat, paths, args.cold, ours(tmp, lock_all))
        t_sum1, sums_c = (
            best_of(1, one, args.cold, lambda: sha256sum(one)) if shutil.which("sha256sum") else (None, None)
        )
        if sums_c is not None:
            assert sums_c[one[0].name] == sums1[one[0].name], "sha256sum and openssl disagree"

        def rate(nbytes, t):
            return nbytes / MIB / t

        rows = [
            ("openssl dgst -sha256, 1 file", size, t_ossl1),
            ("magistral verify, 1 file", size, t_ours1),
            (f"openssl dgst -sha256, {args.files} files (sequential)", total, t_ossl_all),
            (f"magistral verify, {args.files} files (parallel)", total, t_ours_all),
        ]
        if t_sum1 is not None:
            rows.append(("sha256sum, 1 file", size, t_sum1))
        print()
        print(f"{'':52s} {'MiB':>8s} {'s':>8s} {'MiB/s':>8s}")
        for label, nbytes, t in rows:
            print(f"{label:52s} {nbytes / MIB:8.0f} {t:8.3f} {rate(nbytes, t):8.0f}")
        print()
        print(f"ratio 1 file       magistral / openssl: {t_ossl1 / t_ours1:.2f}  (goal >= 0.90)")
        print(
            f"ratio {args.files} files      magistral / openssl: {t_ossl_all / t_ours_all:.2f}  (goal > 1 with several cores)"
        )
        if t_sum1 is not None:
            print(f"ratio 1 file       sha256sum / openssl: {t_ossl1 / t_sum1:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
