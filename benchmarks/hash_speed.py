"""SHA-256 verification speed of `magistral fetch --verify-only` against `openssl dgst -sha256`.

Writes N files of SIZE in a temporary folder, then times, on the same files:

* ``openssl dgst -sha256`` on one file, and on all files (one process, one file after the other);
* our verify (``fetch_assets(..., verify_only=True)``, the code `magistral fetch --verify-only`
  runs, with a lock holding the files' sums) on one file and on all files;
* ``sha256sum`` on one file, for reference.

The cases run interleaved for ``--repeat`` rounds; each figure is the best round's wall time,\nand the best CPU time (user + sys), which other load on the machine hardly changes. By default the files stay in the page cache (the
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
import resource
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


def measure(cases: dict, paths_of: dict, repeat: int, cold: bool) -> dict[str, tuple[float, float]]:
    """Run the cases interleaved (so a change in machine load hits all of them alike) ``repeat``
    times; per case keep the best wall time and the best CPU time (user + sys of this process and
    its children: other load hardly changes it, it shows the cost per byte)."""
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeat):
        for label, fn in cases.items():
            if cold:
                evict(paths_of[label])
            r0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
            r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = sum(
                getattr(after, f) - getattr(before, f)
                for before, after in ((r0, r1), (c0, c1))
                for f in ("ru_utime", "ru_stime")
            )
            w, c = best.get(label, (float("inf"), float("inf")))
            best[label] = (min(w, wall), min(c, cpu))
    return best


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
        sums = openssl(paths)
        lock1, lock_all = write_lock(tmp, one, sums), write_lock(tmp, paths, sums)
        n = args.files
        labels = [
            "openssl dgst -sha256, 1 file",
            "magistral verify, 1 file",
            f"openssl dgst -sha256, {n} files (one after the other)",
            f"magistral verify, {n} files (in parallel)",
        ]
        runs = [lambda: openssl(one), ours(tmp, lock1), lambda: openssl(paths), ours(tmp, lock_all)]
        cases = dict(zip(labels, runs, strict=True))
        sizes = dict(zip(labels, [size, size, total, total], strict=True))
        paths_of = dict(zip(labels, [one, one, paths, paths], strict=True))
        if shutil.which("sha256sum"):
            if sha256sum(one)[one[0].name] != sums[one[0].name]:
                raise SystemExit("sha256sum and openssl disagree")
            cases["sha256sum, 1 file"] = lambda: sha256sum(one)
            sizes["sha256sum, 1 file"], paths_of["sha256sum, 1 file"] = size, one
        best = measure(cases, paths_of, args.repeat, args.cold)

        print()
        head = f"best of {args.repeat} rounds"
        print(f"{head:52s} {'MiB':>7s} {'wall s':>7s} {'MiB/s':>7s} {'MiB/cpu-s':>10s}")
        for label, (wall, cpu) in best.items():
            mib = sizes[label] / MIB
            print(f"{label:52s} {mib:7.0f} {wall:7.3f} {mib / wall:7.0f} {mib / max(cpu, 1e-9):10.0f}")
        (o1, o1_cpu), (m1, m1_cpu), (on, _), (mn, _) = (best[label] for label in labels)
        print()
        print(f"speed, 1 file:  magistral / openssl = {o1 / m1:.2f}  (goal >= 0.90)")
        print(f"speed, {n} files: magistral / openssl = {on / mn:.2f}  (goal > 1 with {cores} cores)")
        print(f"CPU cost per byte, 1 file: openssl / magistral = {o1_cpu / m1_cpu:.2f}")
        if "sha256sum, 1 file" in best:
            print(f"speed, 1 file:  sha256sum / openssl = {o1 / best['sha256sum, 1 file'][0]:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
