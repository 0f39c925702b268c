"""Streaming SHA-256: same digests as hashlib on whole bytes, several files at once, cancellable."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading

import pytest

from magistral_cli.assets.hashing import Cancelled, sha256_file, sha256_files

BLOCK = 4096


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7])
def test_streamed_digest_equals_hashlib(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    seen = []
    digest, n = sha256_file(path, block_size=BLOCK, on_bytes=seen.append)
    assert digest == hashlib.sha256(data).hexdigest()
    assert n == size == sum(seen)
    assert all(chunk <= BLOCK for chunk in seen)


def test_several_files_in_parallel(tmp_path):
    blobs = {tmp_path / f"f{i}.bin": os.urandom(50_000 * (i + 1)) for i in range(5)}
    for path, data in blobs.items():
        path.write_bytes(data)
    total = []
    lock = threading.Lock()

    def count(n):
        with lock:
            total.append(n)

    out = sha256_files(blobs, workers=3, block_size=BLOCK, on_bytes=count)
    assert out == {p: (hashlib.sha256(d).hexdigest(), len(d)) for p, d in blobs.items()}
    assert sum(total) == sum(len(d) for d in blobs.values())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_agrees_with_openssl(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * 1024 * 1024 + 5))
    out = subprocess.run(
        ["openssl", "dgst", "-sha256", "-r", str(path)], capture_output=True, text=True, check=True
    )
    assert sha256_file(path)[0] == out.stdout.split()[0]


def test_cancel_stops_midway(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(10 * BLOCK))
    cancel = threading.Event()
    seen = []

    def on_bytes(n):
        seen.append(n)
        if len(seen) == 2:
            cancel.set()

    with pytest.raises(Cancelled):
        sha256_file(path, block_size=BLOCK, on_bytes=on_bytes, cancel=cancel)
    assert len(seen) == 2
