"""Streaming SHA-256 of large files, several at once.

One file is hashed by one thread reading fixed blocks into a reused buffer: hashlib's OpenSSL
SHA-256 releases the GIL for updates this large, and so does ``readinto``, so threads hash
different files on different cores. A single file cannot be split (SHA-256 is sequential), so
one file runs at the single-core speed of OpenSSL; several files scale with the cores.
``benchmarks/hash_speed.py`` measures this against ``openssl dgst -sha256``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: Read size. 1 MiB keeps the buffer in the L2 cache; larger reads measured no faster
#: (page cache) and readahead covers cold reads (see benchmarks/hash_speed.py).
BLOCK_SIZE = 1 << 20


class Cancelled(Exception):
    """Raised inside a hashing thread when the caller asked to stop."""


def sha256_file(
    path: str | Path,
    *,
    block_size: int = BLOCK_SIZE,
    on_bytes: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[str, int]:
    """``(hex digest, size in bytes)`` of one file, read in ``block_size`` blocks (never whole)."""
    digest = hashlib.sha256()
    buf = bytearray(block_size)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            total += n
            if on_bytes is not None:
                on_bytes(n)
            if cancel is not None and cancel.is_set():
                raise Cancelled(str(path))
    return digest.hexdigest(), total


def default_workers(n_files: int) -> int:
    """One thread per file, at most one per core the process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(n_files, cores))


def sha256_files(
    paths: Iterable[str | Path],
    *,
    workers: int | None = None,
    block_size: int = BLOCK_SIZE,
    on_bytes: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
) -> dict[Path, tuple[str, int]]:
    """Hash several files in parallel: ``{path: (hex digest, bytes)}``.

    The largest files start first so that the last one to finish is a small one.
    """
    items = [Path(p) for p in paths]
    items.sort(key=lambda p: p.stat().st_size, reverse=True)
    if not items:
        return {}
    n = workers or default_workers(len(items))
    if n == 1:
        return {p: sha256_file(p, block_size=block_size, on_bytes=on_bytes, cancel=cancel) for p in items}
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sha256") as pool:
        futures = {
            p: pool.submit(sha256_file, p, block_size=block_size, on_bytes=on_bytes, cancel=cancel)
            for p in items
        }
        return {p: fut.result() for p, fut in futures.items()}
