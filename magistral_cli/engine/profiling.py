"""``tools.profile`` (torch profiler over a step range) and ``tools.memory_profile`` (allocator snapshot).

On NPU the profiler is ``torch_npu.profiler``, as in the seed (MindSpeed-MM's FSDP2 ``Profiler``):
CPU and NPU activity, with ``static_param.level``, ``aic_metrics_type`` and
``data_simplification`` passed in its ``_ExperimentalConfig``; it writes its own trace directory.
On CUDA and the CPU those three options mean nothing, so a value other than their default is
refused there rather than silently dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from magistral_cli.config.schema import (
    NPU_PROFILER_LEVELS,
    MemoryProfile,
    Profile,
    StaticProfileParam,
)
from magistral_cli.errors import UserError

log = logging.getLogger(__name__)

#: The NPU-only options of ``tools.profile.static_param`` (their defaults are the seed's values).
NPU_ONLY_OPTIONS = ("level", "aic_metrics_type", "data_simplification")


def npu_profiler_kwargs(p: StaticProfileParam, npu_profiler: Any, trace_dir: Path) -> dict[str, Any]:
    """The keyword arguments of ``torch_npu.profiler.profile`` for ``static_param``.

    ``npu_profiler`` is the ``torch_npu.profiler`` module (a parameter so that tests can check
    the mapping without an NPU). ``with_cpu`` adds CPU activity to the NPU's, as on CUDA.
    """
    activities = [npu_profiler.ProfilerActivity.NPU]
    if p.with_cpu:
        activities.insert(0, npu_profiler.ProfilerActivity.CPU)
    experimental = npu_profiler._ExperimentalConfig(
        profiler_level=getattr(npu_profiler.ProfilerLevel, NPU_PROFILER_LEVELS[p.level]),
        aic_metrics=getattr(npu_profiler.AiCMetrics, p.aic_metrics_type),
        data_simplification=p.data_simplification,
    )
    return {
        "activities": activities,
        "record_shapes": p.record_shapes,
        "profile_memory": p.with_memory,
        "with_stack": p.with_stack,
        "experimental_config": experimental,
        "on_trace_ready": npu_profiler.tensorboard_trace_handler(str(trace_dir)),
    }


def check_npu_only_options(cfg: Profile, device_type: str) -> None:
    """Refuse NPU profiler options set away from their default on a device whose profiler lacks them."""
    if device_type == "npu" or not cfg.enable:
        return
    p, defaults = cfg.static_param, StaticProfileParam()
    changed = [
        f"{name}={getattr(p, name)!r}"
        for name in NPU_ONLY_OPTIONS
        if getattr(p, name) != getattr(defaults, name)
    ]
    if changed:
        raise UserError(
            f"tools.profile.static_param {', '.join(changed)}: these are torch_npu profiler options and this "
            f"run profiles on {device_type}, whose profiler has no such setting; remove them (or set the "
            "defaults: level1, PipeUtilization, false), or profile on an NPU"
        )


def _under(run_dir: Path, save_path: str) -> Path:
    path = Path(save_path)
    return path if path.is_absolute() else run_dir / path


class StepProfiler:
    """Runs the torch profiler from ``start_step`` up to (not including) ``end_step`` on the listed ranks.

    Writes ``<save_path>/rank<r>_steps<a>-<b>.json`` (a Chrome trace) under the run directory; on
    NPU, torch_npu's trace directory ``<save_path>/rank<r>_steps<a>-<b>/`` (its own format, read by
    MindStudio Insight). NPU-only options on another device are refused here, before step 1.
    """

    def __init__(self, cfg: Profile, run_dir: Path, rank: int, device_type: str):
        check_npu_only_options(cfg, device_type)
        self.cfg = cfg
        self.active = cfg.enable and rank in cfg.ranks
        self.rank = rank
        self.dir = _under(run_dir, cfg.static_param.save_path)
        self.device_type = device_type
        self._prof = None
        self._npu_trace: Path | None = None
        self.written: Path | None = None

    def before_step(self, step: int) -> None:
        if not self.active or step != self.cfg.static_param.start_step:
            return
        p = self.cfg.static_param
        if self.device_type == "npu":
            import torch_npu.profiler as npu_profiler

            self._npu_trace = self.dir / f"rank{self.rank}_steps{p.start_step}-{p.end_step - 1}"
            self._prof = npu_profiler.profile(**npu_profiler_kwargs(p, npu_profiler, self._npu_trace))
            self._prof.__enter__()
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] if p.with_cpu or self.device_type == "cpu" else []
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            record_shapes=p.record_shapes,
            with_stack=p.with_stack,
            profile_memory=p.with_memory,
        )
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step != self.cfg.static_param.end_step - 1:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prof.__exit__(None, None, None)
        if self.device_type == "npu":  # on_trace_ready wrote the trace directory on exit
            self._prof = None
            self.written = self._npu_trace
            log.info("profile written to %s", self.written)
            return
        p = self.cfg.static_param
        self.written = self.dir / f"rank{self.rank}_steps{p.start_step}-{p.end_step - 1}.json"
        self._prof.export_chrome_trace(str(self.written))
        self._prof = None
        log.info("profile written to %s", self.written)
        if self.device_type == "cuda":
            from .trace_gaps import device_time

            report = device_time(self.written)
            if report is not None:
                log.info("profiled device time: %s", "\n".join(report.lines(steps=p.end_step - p.start_step)))


class MemoryProfiler:
    """Records allocator history from ``start_step`` and dumps a snapshot at ``end_step`` (CUDA / NPU)."""

    def __init__(self, cfg: MemoryProfile, run_dir: Path, rank: int, device_type: str):
        self.cfg = cfg
        self.rank = rank
        self.dir = _under(run_dir, cfg.save_path)
        self.mod = None
        self.active = cfg.enable and rank in cfg.dump_ranks
        if self.active and device_type in ("cuda", "npu"):
            self.mod = torch.cuda if device_type == "cuda" else torch.npu  # type: ignore[attr-defined]
        elif self.active:
            log.warning("tools.memory_profile needs a CUDA or NPU allocator; skipped on %s", device_type)
            self.active = False
        self.written: Path | None = None

    def before_step(self, step: int) -> None:
        if self.active and step == self.cfg.start_step:
            kwargs = {"stacks": self.cfg.stacks}
            if self.cfg.max_entries:
                kwargs["max_entries"] = self.cfg.max_entries
            self.mod.memory._record_memory_history(**kwargs)

    def after_step(self, step: int) -> None:
        if not self.active or step != self.cfg.end_step:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.written = self.dir / f"rank{self.rank}_step{step}.pickle"
        self.mod.memory._dump_snapshot(str(self.written))
        self.mod.memory._record_memory_history(enabled=None)
        if self.cfg.mem_info:
            log.info("%s", self.mod.memory_summary())
        log.info("memory snapshot written to %s", self.written)
