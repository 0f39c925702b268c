"""Where the device waited: its busy and idle time in a profiled step range, from the Chrome trace that
``tools.profile`` writes (the torch profiler's export), and the largest idle gaps with what the host was
doing when it launched the work that ended each.

A step whose kernels cost less than its wall time leaves the device idle somewhere. Each gap ends with a
kernel (or copy) whose launch the trace links to a host call by its ``correlation`` id. When that launch
came after the gap began, the device was waiting for the host (Python, a hook, a data fetch, a
synchronisation before it): the gap is *host-bound*, and the host operators around the launch say
where. When the launch came before the gap, the device waited on something else (another stream, an
event, a collective). The report sums both kinds and lists the largest gaps.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Trace categories of device work (torch profiler / kineto names).
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Host calls that launch device work, with the launched work's ``correlation`` id.
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
#: Host spans that say what the host was doing.
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
#: Idle stretches shorter than this are launch latency between back-to-back kernels, not gaps.
MIN_GAP_US = 20.0


@dataclass(frozen=True)
class Gap:
    """One idle stretch of the device, and the launch of the work that ended it."""

    start_us: float
    length_us: float
    next_work: str
    #: The innermost host operator and the innermost annotation (``record_function``) around the launch.
    launched_in: str | None = None
    annotation: str | None = None
    #: Launch time minus the gap's start: > 0, the device waited that long for the host to launch it.
    launch_lag_us: float | None = None

    @property
    def host_bound_us(self) -> float:
        """The part of the gap spent waiting for the host's launch."""
        if self.launch_lag_us is None:
            return 0.0
        return min(self.length_us, max(0.0, self.launch_lag_us))


@dataclass(frozen=True)
class DeviceTime:
    """Busy and idle device time between the first and the last device work of a trace."""

    window_us: float
    busy_us: float
    gaps: list[Gap] = field(default_factory=list)
    #: Host synchronisation calls (``cuda*Synchronize``) in the trace, and the host time they took.
    syncs: int = 0
    sync_us: float = 0.0

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us

    @property
    def host_bound_us(self) -> float:
        return sum(g.host_bound_us for g in self.gaps)

    def lines(self, steps: int = 1, top: int = 8) -> list[str]:
        """A short report; figures per step when the trace holds ``steps`` steps."""
        n = max(steps, 1)
        per = " per step" if n > 1 else ""
        busy = 100 * self.busy_us / self.window_us if self.window_us else 0.0
        out = [
            f"device busy {self.busy_us / n / 1000:.1f} ms of {self.window_us / n / 1000:.1f} ms{per} ({busy:.1f}%); "
            f"idle {self.idle_us / n / 1000:.1f} ms in {len(self.gaps)} gaps of {MIN_GAP_US:.0f} us or more, "
            f"{self.host_bound_us / n / 1000:.1f} ms of it waiting for the host to launch; "
            f"{self.syncs} host synchronisations ({self.sync_us / 1000:.1f} ms)",
        ]
        for g in sorted(self.gaps, key=lambda g: g.length_us, reverse=True)[:top]:
            where = g.launched_in or "an unknown host call"
            if g.annotation and g.annotation != g.launched_in:
                where += f" in {g.annotation}"
            lag = (
                ""
                if g.launch_lag_us is None
                else f", launched {g.launch_lag_us / 1000:+.2f} ms after the gap began"
            )
            out.append(
                f"  {g.length_us / 1000:7.2f} ms idle before {_short(g.next_work)}: launched from {where}{lag}"
            )
        return out


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _spans(events: list[dict[str, Any]], categories: frozenset[str]) -> list[dict[str, Any]]:
    return sorted(
        (e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in categories),
        key=lambda e: float(e["ts"]),
    )


def _enclosing(host: list[dict[str, Any]], starts: list[float], t: float, where: tuple[Any, Any]):
    """The innermost host operator and the innermost annotation on thread ``where`` that span time ``t``."""
    op = annotation = None
    op_start = annotation_start = float("-inf")
    for e in host[: bisect_right(starts, t)]:
        start = float(e["ts"])
        if (e.get("pid"), e.get("tid")) != where or start + float(e.get("dur", 0)) < t:
            continue
        if str(e.get("cat")).lower() == "user_annotation":
            if start >= annotation_start:
                annotation, annotation_start = e.get("name"), start
        elif start >= op_start:
            op, op_start = e.get("name"), start
    return op, annotation


def device_time(trace: dict[str, Any] | Path | str, top: int = 8) -> DeviceTime | None:
    """The device's busy and idle time in ``trace`` (a Chrome trace, or its file); None without device
    work. The ``top`` longest gaps name the host operators around their launch."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text(encoding="utf-8"))
    events = trace.get("traceEvents", [])
    work = _spans(events, DEVICE_CATEGORIES)
    if not work:
        return None
    calls = _spans(events, LAUNCH_CATEGORIES)
    launches = {
        e["args"]["correlation"]: e for e in calls if e.get("args", {}).get("correlation") is not None
    }
    busy = 0.0
    found: list[tuple[Gap, dict[str, Any] | None]] = []
    first = float(work[0]["ts"])
    end = first
    for e in work:  # every stream's work, in start order: idle is when none runs
        start, stop = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if start - end >= MIN_GAP_US:
            launch = launches.get(e.get("args", {}).get("correlation"))
            lag = None if launch is None else float(launch["ts"]) - end
            found.append((Gap(end, start - end, str(e.get("name", "?")), launch_lag_us=lag), launch))
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    host = _spans(events, HOST_CATEGORIES)
    starts = [float(e["ts"]) for e in host]
    longest = {id(g) for g, _ in sorted(found, key=lambda x: x[0].length_us, reverse=True)[:top]}
    gaps = []
    for gap, launch in found:
        if id(gap) in longest and launch is not None:
            op, annotation = _enclosing(
                host, starts, float(launch["ts"]), (launch.get("pid"), launch.get("tid"))
            )
            gap = Gap(gap.start_us, gap.length_us, gap.next_work, op, annotation, gap.launch_lag_us)
        gaps.append(gap)
    syncs = [e for e in calls if "Synchronize" in str(e.get("name", ""))]
    return DeviceTime(
        window_us=end - first,
        busy_us=busy,
        gaps=gaps,
        syncs=len(syncs),
        sync_us=sum(float(e.get("dur", 0)) for e in syncs),
    )
