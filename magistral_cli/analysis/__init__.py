"""`compare`: log readers (``logs``), metric math and verdict (``metrics``), the PNG (``plot``)."""

from .logs import KNOWN_FORMATS, RunLog, StepRecord, detect_format, read_run
from .metrics import Comparison, compare_runs, normalized_mean_abs_diff, percentile, step_time_summary

__all__ = [
    "KNOWN_FORMATS",
    "Comparison",
    "RunLog",
    "StepRecord",
    "compare_runs",
    "detect_format",
    "normalized_mean_abs_diff",
    "percentile",
    "read_run",
    "step_time_summary",
]
