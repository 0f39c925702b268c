"""metrics.jsonl and summary.json under bad input and a full disk: whole lines or none, and the path named.

The full-disk cases mount a small tmpfs (root only: skipped with the reason otherwise).
"""

from __future__ import annotations

import json

import pytest

from magistral_cli.engine.metrics import MetricsFile, write_summary

from .helpers import mounted_tmpfs


def test_lines_that_are_no_record_of_a_step_are_moved_aside_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        '{"step": 1, "loss": 1.0}',
        '{"step": null, "loss": 2.0}',  # seen: a line whose step is null stopped the resume
        '{"step": "2"}',
        '{"step": true}',
        "[1, 2]",
        '{"loss": 3.0}',
        "[" * 5000 + "]" * 5000,  # nested too deeply for the JSON parser
        '{"step": 3}',
        '{"step": 2, "loss": 4.0',  # cut by a crash
    ]
    path.write_text("\n".join(lines), encoding="utf-8")
    metrics = MetricsFile(path, resume_step=2, sinks=[])
    metrics.write({"step": 3, "loss": 0.5})
    metrics.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 3]
    assert metrics.moved_aside == tmp_path / "metrics.after_step_2.jsonl"
    assert metrics.moved_aside.read_text().splitlines() == lines[1:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.after_step_2.jsonl", "metrics.jsonl"]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs at tmp_path/disk."""
    with mounted_tmpfs(tmp_path / "disk", "size=1m") as disk:
        yield disk


def _fill(disk) -> None:
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_line_that_does_not_fit_is_taken_back_and_names_the_file(small_disk):
    path = small_disk / "metrics.jsonl"
    metrics = MetricsFile(path, sinks=[])
    metrics.write({"step": 1, "loss": 1.0})
    _fill(small_disk)
    with pytest.raises(OSError) as info:
        for step in range(2, 10_000):
            metrics.write({"step": step, "loss": 1.0, "lr": 1e-5, "tokens": 10**6})
    metrics.close()
    assert info.value.filename == str(path) and info.value.strerror == "No space left on device"
    text = path.read_text()
    assert text.endswith("\n")  # every line whole: the one that did not fit is not half there
    steps = [json.loads(x)["step"] for x in text.splitlines()]
    assert steps == list(range(1, len(steps) + 1))


def test_summary_on_a_full_disk_names_the_file_and_leaves_no_temporary(small_disk):
    _fill(small_disk)
    with pytest.raises(OSError) as info:
        write_summary(small_disk / "summary.json", steps=3, wall_s=1.0, exit_status=0, error="x" * 100_000)
    assert info.value.filename == str(small_disk / "summary.json")
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]
