"""How a rank reports the failure that ended it (``engine.run.describe_failure``): one rule for
every exception, operating-system errors classified by their errno, data-loader workers' errors
shown as the worker raised them, and a status that still gets written on a full disk."""

from __future__ import annotations

import json

import pytest
import torch

from magistral_cli.engine import run
from magistral_cli.errors import CheckFailed, UserError

from .helpers import mounted_tmpfs


def _raised(action) -> BaseException:
    try:
        action()
    except BaseException as exc:
        return exc
    raise AssertionError("nothing was raised")


def test_operating_system_errors_name_the_path_the_errno_and_the_fix(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    # A file where a directory is expected: the user's path, exit 2.
    status, kind, error = run.describe_failure(_raised(lambda: (afile / "run").mkdir(parents=True)))
    assert (status, kind) == (2, "user")
    assert error == (
        f"{afile / 'run'}: Not a directory (ENOTDIR); a file is in the way where a directory is expected: "
        "move it or choose another path"
    )
    status, kind, error = run.describe_failure(_raised(lambda: afile.mkdir(parents=True, exist_ok=True)))
    assert (status, kind) == (2, "user") and error.startswith(f"{afile}: File exists (EEXIST)")
    # The machine's: exit 1, reported as a failed check (one line, no traceback).
    status, kind, error = run.describe_failure(OSError(28, "No space left on device", "/d/metrics.jsonl"))
    assert (status, kind) == (1, "check")
    assert (
        error
        == "/d/metrics.jsonl: No space left on device (ENOSPC); free space on that disk, or write to another one"
    )
    assert run.describe_failure(OSError(30, "Read-only file system", "/ro/x"))[:2] == (1, "check")
    # Our own errors keep their exit code; anything else is a crash.
    assert run.describe_failure(UserError("bad key")) == (2, "user", "bad key")
    assert run.describe_failure(CheckFailed("step 3 is not finite")) == (1, "check", "step 3 is not finite")
    assert run.describe_failure(KeyError("x")) == (1, "crash", "KeyError: 'x'")
    # A collective whose peer is gone (gloo's and NCCL's words): "lost", a consequence of another failure.
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:17299. This is typically caused by a remote worker crashing."
    )
    assert run.describe_failure(gloo)[:2] == (1, "lost")
    nccl = RuntimeError("NCCL error: remote process exited or there was a network error")
    assert run.describe_failure(nccl)[:2] == (1, "lost")
    # NCCL's other words for it: an older NCCL's internal error over a closed socket, and ncclRemoteError's
    # explanation when it is the message's first line.
    nccl_internal = RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:1275, internal error, NCCL version 2.14.3\n"
        "ncclInternalError: Internal check failed.\nLast error:\nNet : Connection closed by remote peer host<50260>"
    )
    assert run.describe_failure(nccl_internal)[:2] == (1, "lost")
    nccl_remote = RuntimeError(
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
    )
    assert run.describe_failure(nccl_remote)[:2] == (1, "lost")
    # A timeout is not a lost peer: the other rank may be stuck, not gone (HCCL's words for both).
    hccl = RuntimeError(
        "EI0006: Getting socket times out. Reason: Remote Rank did not send the data in time. "
        "Please check the reason for the rank being stuck"
    )
    assert run.describe_failure(hccl)[:2] == (1, "crash")
    assert run.describe_failure(RuntimeError("Connection refused"))[:2] == (1, "crash")


class _Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise UserError(f"image /data/{index}.jpg of sample {index} changed since preprocessing")


def test_an_error_from_a_data_loader_worker_is_shown_as_the_worker_raised_it():
    loader = torch.utils.data.DataLoader(_Broken(), num_workers=1, batch_size=None)
    exc = _raised(lambda: next(iter(loader)))
    assert isinstance(exc, UserError) and "Original Traceback" in str(exc)  # torch's re-raise
    assert run.describe_failure(exc) == (
        2,
        "user",
        "image /data/0.jpg of sample 0 changed since preprocessing",
    )


def test_the_status_is_written_over_the_reserve_on_a_full_disk(tmp_path, monkeypatch):
    with mounted_tmpfs(tmp_path / "disk", "size=1m") as disk:
        monkeypatch.setenv("RANK", "1")
        run._reserve_status(str(disk))
        path = disk / run.STATUS_DIR / "rank1.json"
        with pytest.raises(ValueError):  # blanks: a rank that dies here has recorded nothing
            json.loads(path.read_text())
        with open(disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
        run._write_status(str(disk), 1, "check", "e" * 10_000)
        record = json.loads(path.read_text())
        assert (record["rank"], record["exit_status"], record["kind"]) == (1, 1, "check")
        assert record["error"].startswith("eeee") and record["error"].endswith(" ...")
        assert sorted(p.name for p in path.parent.iterdir()) == ["rank1.json"]
