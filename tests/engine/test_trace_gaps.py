"""Device busy and idle time from a profiler trace, and what the host did before each gap.

The trace below is written in the torch profiler's Chrome format, as CUDA runs export it: kernels and
copies on device lanes, runtime launch calls on the host thread linked by ``correlation``, host
operators and ``record_function`` annotations around them, and device-side annotations that are not
work. A CPU profile has no device lane: there is nothing to report.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from magistral_cli.engine.trace_gaps import MIN_GAP_US, device_time

HOST = {"pid": 100, "tid": 100}


def _x(cat, name, ts, dur, where=None, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **(where or HOST), "args": args}


def _kernel(name, ts, dur, correlation, stream=7):
    return _x("kernel", name, ts, dur, {"pid": 0, "tid": stream}, correlation=correlation, stream=stream)


def _trace():
    return {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {"name": "python"}},
            _x("user_annotation", "FSDP::pre_forward", 0, 1000),
            _x("cpu_op", "aten::mm", 100, 100),
            _x("cuda_runtime", "cudaLaunchKernel", 150, 5, correlation=1),
            _kernel("gemm", 160, 500, 1),
            # Launched late: the device waits 890 us for the host (inside the optimizer's step).
            _x("user_annotation", "Optimizer.step#AdamW.step", 1400, 600),
            _x("cpu_op", "aten::_foreach_add_", 1500, 100),
            _x("cuda_runtime", "cudaLaunchKernel", 1550, 5, correlation=2),
            _kernel("multi_tensor_apply_kernel", 1560, 100, 2),
            # Another stream, overlapping: busy time is the union.
            _x("cuda_runtime", "cudaLaunchKernel", 1000, 5, correlation=3),
            _kernel("nccl_all_gather", 1600, 300, 3, stream=8),
            # Launched early, started late: a wait on another stream or an event, not the host.
            _x("cuda_runtime", "cudaLaunchKernel", 1700, 5, correlation=4),
            _x("gpu_memcpy", "Memcpy DtoD", 2500, 100, {"pid": 0, "tid": 7}, correlation=4),
            # 10 us after the last: launch latency, not a gap.
            _x("cuda_runtime", "cudaLaunchKernel", 2590, 5, correlation=5),
            _kernel("elementwise", 2610, 10, 5),
            _x("cuda_runtime", "cudaStreamSynchronize", 2700, 50, correlation=6),
            # A device-side annotation spans everything but is not work.
            _x("gpu_user_annotation", "FSDP::pre_forward", 0, 3000, {"pid": 0, "tid": 7}),
        ]
    }


def test_busy_idle_and_the_host_bound_gap(tmp_path):
    path = tmp_path / "rank0_steps1-2.json"
    path.write_text(json.dumps(_trace()))
    report = device_time(path)
    assert report.window_us == 2620 - 160
    assert report.busy_us == 500 + (1900 - 1560) + 100 + 10
    assert report.idle_us == 900 + 600 + 10
    first, second = report.gaps  # the 10 us one is below MIN_GAP_US
    assert MIN_GAP_US > 10
    assert (first.start_us, first.length_us, first.next_work) == (660, 900, "multi_tensor_apply_kernel")
    assert (first.launched_in, first.annotation, first.launch_lag_us) == (
        "aten::_foreach_add_",
        "Optimizer.step#AdamW.step",
        890,
    )
    assert first.host_bound_us == 890
    assert (second.length_us, second.next_work, second.launch_lag_us) == (600, "Memcpy DtoD", -200)
    assert second.host_bound_us == 0
    assert report.host_bound_us == 890
    assert (report.syncs, report.sync_us) == (1, 50)
    lines = report.lines(steps=2)
    assert lines[0].startswith("device busy 0.5 ms of 1.2 ms per step (38.6%); idle 0.8 ms in 2 gaps")
    assert "0.4 ms of it waiting for the host to launch; 1 host synchronisations (0.1 ms)" in lines[0]
    assert lines[1].strip().startswith("0.90 ms idle before multi_tensor_apply_kernel: launched from")
    assert (
        "aten::_foreach_add_ in Optimizer.step#AdamW.step, launched +0.89 ms after the gap began" in lines[1]
    )


def test_only_the_longest_gaps_look_up_their_host_operators():
    report = device_time(_trace(), top=1)
    assert report.gaps[0].launched_in == "aten::_foreach_add_"
    assert report.gaps[1].launched_in is None and report.gaps[1].launch_lag_us == -200


def test_a_cpu_profile_has_no_device_time(tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("step"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    assert json.loads(path.read_text())["traceEvents"]
    assert device_time(path) is None


@pytest.mark.parametrize("damaged", ["{}", '{"traceEvents": []}'])
def test_a_trace_without_events_has_no_device_time(tmp_path, damaged):
    path = tmp_path / "t.json"
    path.write_text(damaged)
    assert device_time(path) is None
