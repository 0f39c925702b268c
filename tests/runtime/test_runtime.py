"""The runtime layer: one device/backend/dtype map and one way to start rank processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from magistral_cli.runtime import (
    BACKENDS,
    ResolvedDevice,
    device_module,
    device_name,
    device_peak_tflops,
    device_type_of_backend,
    parse_dtype,
    peak_tflops_of,
    resolve_device,
    resolve_device_type,
    set_device,
    spawn_ranks,
)
from magistral_cli.runtime.distributed import RANK_PRELOAD, RankFailure, rank_start_method


def _sum_of_ranks(rank: int, offset: int) -> dict:
    value = torch.tensor([float(rank + offset)])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "sum": value.item(),
        "threads": torch.get_num_threads(),
    }


def _fails_on_rank_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank one was told to fail")
    return rank


def _dies_on_rank_one(rank: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_spawn_ranks_runs_one_group_and_returns_every_rank_in_order():
    results = spawn_ranks(_sum_of_ranks, 2, (10,), threads=1)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 21.0 and r["threads"] == 1 for r in results)


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(RankFailure, match=r"rank 1 failed: ValueError: rank one was told to fail") as info:
        spawn_ranks(_fails_on_rank_one, 2, threads=1)
    assert "_fails_on_rank_one" in str(info.value)


def test_a_rank_that_dies_is_reported_not_hidden():
    with pytest.raises(RankFailure, match=r"rank 1 ended without a result \(exit code 3\)"):
        spawn_ranks(_dies_on_rank_one, 2, threads=1)


def _how_the_rank_started(rank: int, name: str) -> dict:
    import sys

    return {
        "preloaded": all(module in sys.modules for module in RANK_PRELOAD),
        "value": os.environ.get(name),
        "test": os.environ.get("PYTEST_CURRENT_TEST"),
        "threads": torch.get_num_threads(),
    }


def test_cpu_ranks_start_from_the_fork_server_with_the_engine_imported_and_the_callers_environment():
    """The session's fork server (tests/conftest.py starts it) serves an unchanged environment; the
    variable pytest rewrites for every test reaches the ranks with the caller's value."""
    assert rank_start_method("cpu") == "forkserver"
    ranks = spawn_ranks(_how_the_rank_started, 2, ("MAGISTRAL_TEST_SET_LATER",), threads=1)
    for r in ranks:
        assert r["preloaded"] and r["value"] is None and r["threads"] == 1, r
        assert r["test"] == os.environ["PYTEST_CURRENT_TEST"], r


def test_a_variable_set_since_the_server_started_gives_fresh_interpreters_that_see_it(monkeypatch):
    """``MALLOC_*``, ``TMPDIR`` and the like act when a process starts: a rank forked from a server
    started without them would not have them, so such a call spawns its ranks."""
    monkeypatch.setenv("MAGISTRAL_TEST_SET_LATER", "yes")
    assert rank_start_method("cpu") == "spawn"
    ranks = spawn_ranks(_how_the_rank_started, 2, ("MAGISTRAL_TEST_SET_LATER",), threads=1)
    assert all(not r["preloaded"] and r["value"] == "yes" for r in ranks), ranks
    monkeypatch.delenv("MAGISTRAL_TEST_SET_LATER")
    assert rank_start_method("cpu") == "forkserver"  # the session's environment again


def test_what_imports_write_into_the_environment_is_no_difference(monkeypatch, tmp_path):
    """Importing torch's compiler writes its default cache directory into the environment, its C++
    loader a pointer it writes again before each use, OpenCV's import a library directory that may
    not exist: a fresh rank would write or never read the same, so the server still serves. A value
    that would act, a cache directory elsewhere or a library directory that exists, spawns."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "140442639977504")
    libraries = os.environ.get("LD_LIBRARY_PATH")  # the session's, if any, stays behind
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join(filter(None, [str(tmp_path / "none"), libraries])))
    assert rank_start_method("cpu") == "forkserver"
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join(filter(None, [str(tmp_path), libraries])))
    assert rank_start_method("cpu") == "spawn"
    monkeypatch.setenv("LD_LIBRARY_PATH", libraries or "")
    if libraries is None:
        monkeypatch.delenv("LD_LIBRARY_PATH")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert rank_start_method("cpu") == "spawn"


def test_accelerator_ranks_and_the_opt_out_always_spawn(monkeypatch):
    assert rank_start_method("cuda") == rank_start_method("npu") == "spawn"
    monkeypatch.setenv("MAGISTRAL_RANK_START", "spawn")
    assert rank_start_method("cpu") == "spawn"


def test_maps_are_consistent():
    assert {device_type_of_backend(b) for b in BACKENDS.values()} == set(BACKENDS)
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("half") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        parse_dtype("int3")
    assert device_module("cpu") is None and set_device("cpu", 3) == torch.device("cpu")
    assert resolve_device_type("cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown device type"):
        device_module("tpu")


def test_one_resolver_turns_a_requested_device_into_this_machines(monkeypatch):
    from magistral_cli.launch.device import resolve_device as launch_resolve_device

    monkeypatch.setattr("magistral_cli.runtime.device.detect_device", lambda: ("cuda", 4))
    assert resolve_device("auto") == resolve_device("cuda") == ResolvedDevice("cuda", 4)
    assert resolve_device("cpu") == ResolvedDevice("cpu", 1)
    assert resolve_device("npu") == ResolvedDevice("npu", None, "no npu device is visible here (found cuda)")
    assert resolve_device_type("auto") == "cuda" and resolve_device_type("npu") == "npu"
    # The launcher's shape: the problem said of the recipe's parallel.device.
    assert launch_resolve_device("auto") == ("cuda", 4, None)
    assert launch_resolve_device("npu") == (
        "npu",
        None,
        "parallel.device is 'npu' but no npu device is visible here (found cuda)",
    )


def _job(value: int) -> int:
    if value < 0:
        raise ValueError(f"negative {value}")
    return value * 2


def test_run_jobs_reports_a_failing_job_in_its_place_and_runs_the_rest():
    from magistral_cli.runtime.distributed import run_jobs

    first, failed, last = run_jobs(_job, [1, -1, 3])
    assert (first, last) == (2, 6)
    assert failed["error"] == "ValueError: negative -1"
    assert any("raise ValueError" in line for line in failed["where"]), failed


def _sleeps(rank: int) -> None:
    import time

    time.sleep(60)


def test_a_group_past_its_time_is_stopped_with_a_timeout_error():
    from magistral_cli.runtime.distributed import RankTimeout

    with pytest.raises(RankTimeout, match="the 2 rank processes ran past 1 s") as info:
        spawn_ranks(_sleeps, 2, threads=1, timeout_s=1)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RankFailure)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        # as torch.cuda.get_device_name() / torch.npu.get_device_name() report them
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("Ascend910B1", 373.88),
        ("Ascend910B2", 353.89),
        ("Ascend910B2C", 353.89),
        ("Ascend910B3", 294.91),
        ("Ascend910B4", 245.76),
        ("Ascend910_9392", 353.89),
        ("nvidia h100 pcie", 756.0),  # case does not matter
        ("NVIDIA GeForce RTX 4090", None),  # unlisted: no peak, no MFU
        ("Ascend910_9382", None),
        ("", None),
        (None, None),
    ],
)
def test_bf16_peak_by_device_name(name, peak):
    assert peak_tflops_of(name) == peak


def test_the_cpu_has_no_name_and_no_peak():
    assert device_name("cpu") is None and device_peak_tflops("cpu") is None
