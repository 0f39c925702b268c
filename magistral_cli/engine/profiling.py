"""``tools.profile`` (torch profiler over a step range) and ``tools.memory_profile`` (allocator snapshot)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from magistral_cli.config.schema import MemoryProfile, Profile

log = logging.getLogger(__name__)


def _under(run_dir: Path, save_path: str) -> Path:
    path = Path(save_path)
    return path if path.is_absolute() else run_dir / path


class StepProfiler:
    """Runs the torch profiler from ``start_step`` up to (not including) ``end_step`` on the listed ranks.

    Writes ``<save_path>/rank<r>_steps<a>-<b>.json`` (a Chrome trace) under the run directory.
    """

    def __init__(self, cfg: Profile, run_dir: Path, rank: int, device_type: str):
        self.cfg = cfg
        self.active = cfg.enable and rank in cfg.ranks
        self.rank = rank
        self.dir = _under(run_dir, cfg.static_param.save_path)
        self.device_type = device_type
        self._prof = None
        self.written: Path | None = None

    def before_step(self, step: int) -> None:
        if not self.active or step != self.cfg.static_param.start_step:
            return
        from torch.profiler import ProfilerActivity, profile

        p = self.cfg.static_param
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
        self._prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.cfg.static_param
        self.written = self.dir / f"rank{self.rank}_steps{p.start_step}-{p.end_step - 1}.json"
        self._prof.export_chrome_trace(str(self.written))
        self._prof = None
        log.info("profile written to %s", self.written)


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
