"""FSDP2 really copies out through our kernel once registered, and trains bit-identically."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fsdp2_uses_the_kernel_and_matches_native_training(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    worker = Path(__file__).with_name("split_copy_fsdp_worker.py")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--log-dir={tmp_path / 'torchrun'}",  # not a torchelastic_* left in /tmp
        str(worker),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Ranks share stdout, so their lines may run together: match, do not split.
    ranks = re.findall(r"rank (\d+) ok kernel_calls=[1-9]", result.stdout)
    assert sorted(ranks) == ["0", "1"], result.stdout
