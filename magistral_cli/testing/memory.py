"""This process's resident memory, read from ``/proc/self/status`` (Linux): what the memory tests and
benchmarks measure on the CPU, where the device is host memory."""

from __future__ import annotations

from pathlib import Path

STATUS = Path("/proc/self/status")


def status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (the peak since the start or the last ``reset_peak``), bytes."""
    for line in STATUS.read_text(encoding="ascii").splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in {STATUS}")


def reset_peak() -> None:
    """Restart ``VmHWM`` from the resident set now."""
    Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
