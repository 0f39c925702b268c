"""Reading runs for `compare`: format detection and every log format, written out by hand."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from magistral_cli.analysis.logs import KNOWN_FORMATS, detect_format, read_run
from magistral_cli.errors import UserError
from magistral_cli.testing.run_logs import megatron_line, write_run_dir

# Lines as MindSpeed-MM's Megatron backend prints them (pretrain_transformers.py, log interval 1),
# with the launcher's noise around them.
MEGATRON_LOG = textwrap.dedent(
    """\
    using world size: 8, data-parallel size: 8, context-parallel size: 1
    > building train, validation, and test datasets ...
     [2025-09-20 10:00:01] iteration        1/    2000 | consumed samples:            8 | elapsed time per iteration (ms): 9123.4 | throughput per GPU (TFLOP/s/GPU): 50.1 | learning rate: 5.000000E-08 | global batch size:     8 | lm loss: 1.834500E+00 | loss scale: 1.0 | grad norm: 12.345 | number of skipped iterations:   0 | number of nan iterations:   0 |
    [Rank 0] (after 1 iterations) memory (MB) | allocated: 30000.5 | max allocated: 51234.25 | reserved: 52000.0 | max reserved: 60100.0
    [Rank 3] (after 1 iterations) memory (MB) | allocated: 30001.5 | max allocated: 51300.75 | reserved: 52000.0 | max reserved: 60000.0
     [2025-09-20 10:00:03] iteration        2/    2000 | consumed samples:           16 | elapsed time per iteration (ms): 1987.7 | throughput per GPU (TFLOP/s/GPU): 230.2 | learning rate: 1.000000E-07 | global batch size:     8 | lm loss: 1.234000E+00 | loss scale: 1.0 | grad norm: 3.210 | number of skipped iterations:   0 | number of nan iterations:   0 |
    [rank7]: [2025-09-20 10:00:05] iteration        3/    2000 | consumed samples:           24 | elapsed time per iteration (ms): 1990.1 | throughput per GPU (TFLOP/s/GPU): 229.9 | learning rate: 1.500000E-07 | global batch size:     8 | grad norm: nan | number of skipped iterations:   1 | number of nan iterations:   1 |
    (min, max) time across ranks (ms):
        forward-backward ...............................: (1900.11, 1901.42)
     validation loss at iteration 3 | lm loss value: 1.200000E+00 | lm loss PPL: 3.320117E+00 |
     [2025-09-20 10:00:07] iteration        4/    2000 | consumed samples:           32 | elapsed time per iteration (ms): 1985.0 | throughput per GPU (TFLOP/s/GPU): 230.5 | learning rate: 2.000000E-07 | global batch size:     8 | lm loss: 1.100000E+00 | loss scale: 1.0 | grad norm: 2.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
    """
)

# Lines as MindSpeed-MM's FSDP2 trainer prints them (TrainEngine.training_log and report_memory).
FSDP2_LOG = textwrap.dedent(
    """\
    [INFO] Froze 1234 setup objects; automatic GC remains enabled for new objects
     [2025-09-20 11:00:01] iteration        1/    2000 | consumed samples:            8 | elapsed time per iteration (ms): 8000.0 | learning rate: 0.000000E+00 | global batch size:     8 | loss: 1.830000E+00 | grad norm: 11.000 |
     [2025-09-20 11:00:03] iteration        2/    2000 | consumed samples:           16 | elapsed time per iteration (ms): 1900.5 | learning rate: 5.000000E-08 | global batch size:     8 | loss: 1.240000E+00 | aux loss: 9.000000E+00 | mtp_1 loss: 7.000000E+00 | grad norm: 3.000 |
    [Rank 0] (after 2 iterations) memory (MB) | allocated: 20000.0 | max allocated: 40960.5 | reserved: 45000.0 | max reserved: 47000.0
     [2025-09-20 11:00:05] iteration        3/    2000 | consumed samples:           24 | elapsed time per iteration (ms): 1899.5 | learning rate: 1.000000E-07 | global batch size:     8 | loss: NAN | grad norm: nan |
    Running validation at iteration 3...
     [2025-09-20 11:00:06] ** validation after iteration 3 ** | validation steps: 4 | validation loss: 1.500000E+00 |
    """
)


def test_megatron_log(tmp_path):
    path = tmp_path / "megatron.log"
    path.write_text(MEGATRON_LOG)
    run = read_run(path)
    assert run.format == "megatron-log"
    assert sorted(run.steps) == [1, 2, 3, 4]
    assert [run.steps[s].loss for s in (1, 2, 4)] == [1.8345, 1.234, 1.1]
    assert math.isnan(run.steps[3].loss)  # counted as a NaN iteration: no loss printed
    assert [run.steps[s].step_time_ms for s in (1, 2, 3, 4)] == [9123.4, 1987.7, 1990.1, 1985.0]
    assert [run.steps[s].tflops_per_gpu for s in (1, 2, 3, 4)] == [50.1, 230.2, 229.9, 230.5]
    assert all(run.steps[s].mfu is None for s in (1, 2, 3, 4))  # Megatron prints no MFU
    # max over the ranks that reported memory
    assert run.peak_allocated_mib == 51300.75
    assert run.peak_reserved_mib == 60100.0
    assert run.alloc_retries is None and run.wall_s is None
    assert run.duplicate_steps == []


def test_fsdp2_trainer_log_reads_only_the_loss_field(tmp_path):
    path = tmp_path / "fsdp2.log"
    path.write_text(FSDP2_LOG)
    run = read_run(path)
    assert run.format == "mindspeed-fsdp2-log"
    assert sorted(run.steps) == [1, 2, 3]
    assert run.steps[1].loss == 1.83
    assert run.steps[2].loss == 1.24  # not "aux loss" nor "mtp_1 loss"
    assert math.isnan(run.steps[3].loss)  # printed as NAN
    assert [run.steps[s].step_time_ms for s in (1, 2, 3)] == [8000.0, 1900.5, 1899.5]
    assert all(run.steps[s].tflops_per_gpu is None for s in (1, 2, 3))  # it prints no throughput
    assert (run.peak_allocated_mib, run.peak_reserved_mib) == (40960.5, 47000.0)


def test_run_directory_and_metrics_jsonl(tmp_path):
    records = [
        {"step": 1, "loss": 2.5, "step_time_ms": 900.0, "peak_allocated_mib": 100.0, "peak_reserved_mib": 150.0,
         "alloc_retries": 0},
        {"step": 2, "loss": None, "step_time_ms": 450.0, "peak_allocated_mib": 130.0, "peak_reserved_mib": 140.0,
         "alloc_retries": 2},
        {"step": 3, "loss": 2.25, "step_time_ms": None, "peak_allocated_mib": None, "peak_reserved_mib": 160.0,
         "alloc_retries": None},
    ]  # fmt: skip
    run_dir = write_run_dir(tmp_path / "run", records, wall_s=12.5)
    run = read_run(run_dir)
    assert run.format == "run-dir"
    assert [run.steps[s].loss for s in (1, 2, 3)] == [2.5, None, 2.25]
    assert [run.steps[s].step_time_ms for s in (1, 2, 3)] == [900.0, 450.0, None]
    assert (run.peak_allocated_mib, run.peak_reserved_mib, run.alloc_retries) == (130.0, 160.0, 2)
    assert run.wall_s == 12.5
    # the same file given directly: its summary.json next to it still supplies the wall time
    alone = read_run(run_dir / "metrics.jsonl")
    assert alone.format == "metrics-jsonl" and alone.wall_s == 12.5
    assert alone.steps == run.steps


def test_metrics_jsonl_nan_is_kept_as_nan(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": 1.5}\n')
    run = read_run(path)
    assert math.isnan(run.steps[1].loss) and run.steps[2].loss == 1.5


def test_incomplete_last_line_is_ignored_and_said(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    run = read_run(path)
    assert sorted(run.steps) == [1, 2]
    assert any("incomplete last line 3" in note for note in run.notes)


def test_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.9}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2 is not valid JSON"):
        read_run(path)


def test_record_without_step_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"loss": 1.9}\n')
    with pytest.raises(UserError, match=r':2 has no integer "step"'):
        read_run(path)


def test_restart_keeps_the_last_value_and_says_so(tmp_path):
    # steps 1-6, then a resume from the checkpoint of step 4 appends 5-8 to the same log
    first = [megatron_line(s, 8, 3.0 - 0.1 * s, 1000.0 + s) for s in range(1, 7)]
    second = [megatron_line(s, 8, 2.0 - 0.1 * s, 2000.0 + s) for s in range(5, 9)]
    path = tmp_path / "resumed.log"
    path.write_text("\n".join([*first, "resuming from step 4", *second]) + "\n")
    run = read_run(path)
    assert sorted(run.steps) == list(range(1, 9))
    assert run.duplicate_steps == [5, 6]
    assert run.steps[5].loss == pytest.approx(1.5) and run.steps[5].step_time_ms == 2005.0
    assert run.steps[4].loss == pytest.approx(2.6) and run.steps[4].step_time_ms == 1004.0


def test_duplicates_in_metrics_jsonl(tmp_path):
    records = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 2, 3, 4)]
    records[3]["loss"] = 20.0
    run = read_run(write_run_dir(tmp_path / "run", records))
    assert run.duplicate_steps == [2, 3]
    assert run.steps[2].loss == 20.0 and run.steps[3].loss == 3.0


@pytest.mark.parametrize(
    "content",
    [
        "hello\nthis is not a training log\n",
        '{"epoch": 1, "loss": 2.0}\n',  # JSON lines, but no "step"
        "step 1 loss 2.0\nstep 2 loss 1.9\n",
        "",
    ],
)
def test_unknown_format_names_the_known_ones(tmp_path, content):
    path = tmp_path / "mystery.txt"
    path.write_text(content)
    with pytest.raises(UserError) as info:
        detect_format(path)
    message = str(info.value)
    assert "no known format" in message
    for name in KNOWN_FORMATS:
        assert name in message


def test_missing_path_and_directory_without_metrics(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_run(tmp_path / "nope")
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(UserError, match="without metrics.jsonl"):
        read_run(tmp_path / "empty_run")


def test_log_with_no_step_is_an_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="logs no training step"):
        read_run(run_dir)


def test_broken_summary_is_an_error(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", [{"step": 1, "loss": 1.0}])
    (run_dir / "summary.json").write_text("{not json")
    with pytest.raises(UserError, match="summary.json is not valid JSON"):
        read_run(run_dir)


def test_describe(tmp_path):
    run = read_run(write_run_dir(tmp_path / "run", [{"step": s, "loss": 1.0} for s in (3, 4, 5)]))
    assert run.describe() == {
        "path": str(tmp_path / "run"),
        "format": "run-dir",
        "steps_logged": 3,
        "first_step": 3,
        "last_step": 5,
        "duplicate_steps": [],
        "validation_steps_logged": 0,
    }
    assert json.dumps(run.describe())


def test_the_issue_example_line_shape(tmp_path):
    # the shape quoted in the docs: single spaces, few fields, no timestamp
    path = tmp_path / "short.log"
    path.write_text(
        "iteration 10/ 2000 | consumed samples: 80 | elapsed time per iteration (ms): 1987.7 | lm loss: 1.234E+00 |\n"
        "iteration 11/ 2000 | elapsed time per iteration (ms): 1990.0 | lm loss: 1.2E+00 |\n"
    )
    run = read_run(path)
    assert run.format == "megatron-log"
    assert {s: (r.loss, r.step_time_ms) for s, r in run.steps.items()} == {
        10: (1.234, 1987.7),
        11: (1.2, 1990.0),
    }


def test_newer_megatron_compute_per_gpu_field(tmp_path):
    """Newer Megatron prints ``compute per GPU (TFLOP/s/GPU): 496.3 (avg 496.1)``: the first number."""
    line = (
        " [2026-01-01 00:00:00] iteration        7/      10 | consumed samples:           56 |"
        " elapsed time per iteration (ms): 1500.0 | compute per GPU (TFLOP/s/GPU): 496.3 (avg 496.1) |"
        " lm loss: 1.500000E+00 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )
    path = tmp_path / "megatron.log"
    path.write_text(line + "\n")
    assert read_run(path).steps[7].tflops_per_gpu == 496.3


def test_metrics_jsonl_throughput_fields(tmp_path):
    records = [
        {"step": 1, "loss": 2.0, "tflops_per_gpu": 412.5, "mfu": 0.417},
        {"step": 2, "loss": 2.0, "tflops_per_gpu": 0.00123, "mfu": None},  # CPU: no peak
        {"step": 3, "loss": 2.0},  # a run from before these fields
    ]
    run = read_run(write_run_dir(tmp_path / "run", records))
    assert [(run.steps[s].tflops_per_gpu, run.steps[s].mfu) for s in (1, 2, 3)] == [
        (412.5, 0.417),
        (0.00123, None),
        (None, None),
    ]
