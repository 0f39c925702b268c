"""Rank 0's progress line, the validation loss it shows after an evaluation, and the throughput it shows."""

from __future__ import annotations

import io
import sys

import pytest

from magistral_cli.engine.metrics import Progress, throughput

RECORD = {"step": 3, "loss": 2.5, "lr": 1e-5, "step_time_ms": 120.0, "tokens_per_s": 900.0}


def _plain(monkeypatch) -> io.StringIO:
    err = io.StringIO()  # not a terminal: plain lines
    monkeypatch.setattr(sys, "stderr", err)
    return err


def test_plain_lines_show_the_validation_loss_once_there_is_one(monkeypatch):
    err = _plain(monkeypatch)
    progress = Progress(10, 0, enabled=True)
    progress.update(RECORD)
    assert "val" not in err.getvalue()
    assert err.getvalue().startswith("step 3/10  loss 2.5000  lr 1.00e-05  120 ms/step  900 tok/s  eta ")
    progress.validation({"step": 3, "split": "val", "loss": 2.71828, "samples": 12, "targets": 345})
    progress.update({**RECORD, "step": 4, "loss": 2.4})
    lines = err.getvalue().splitlines()
    assert lines[1] == "step 3 validation loss 2.7183 (12 samples)"
    assert lines[2].startswith("step 4/10  loss 2.4000  val 2.7183  lr 1.00e-05")
    assert progress.val_loss == 2.71828
    progress.validation({"step": 4, "split": "val", "loss": None, "samples": 12})  # non-finite: null
    assert err.getvalue().splitlines()[-1] == "step 4 validation loss nan (12 samples)"
    progress.close()


def test_disabled_progress_prints_nothing(monkeypatch):
    err = _plain(monkeypatch)
    progress = Progress(10, 0, enabled=False)
    progress.validation({"step": 1, "split": "val", "loss": 1.0, "samples": 2})
    progress.update(RECORD)
    assert err.getvalue() == ""


def test_terminal_prints_through_the_rich_console_and_updates_the_line(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    progress = Progress(10, 0, enabled=True)
    printed = []
    monkeypatch.setattr(progress._live.console, "print", lambda text, *a, **k: printed.append(text))
    progress.update(RECORD)
    progress.validation({"step": 3, "split": "val", "loss": 1.5, "samples": 4})
    assert printed == ["step 3 validation loss 1.5000 (4 samples)"]
    info = progress._live.tasks[0].fields["info"]
    assert info.startswith("loss 2.5000  val 1.5000  lr")
    progress.close()


def test_the_line_shows_tflops_per_device_and_mfu_when_known(monkeypatch):
    err = _plain(monkeypatch)
    progress = Progress(10, 0, enabled=True)
    progress.update({**RECORD, "tflops_per_gpu": 412.345, "mfu": 0.41693})
    progress.update({**RECORD, "step": 4, "tflops_per_gpu": 0.0123456, "mfu": None})  # CPU: no peak
    progress.update({**RECORD, "step": 5})  # an older record without the fields
    lines = err.getvalue().splitlines()
    assert "  900 tok/s  412.3 TFLOP/s/dev  MFU 41.7%  eta " in lines[0]
    assert "  900 tok/s  0.0123 TFLOP/s/dev  eta " in lines[1]
    assert "  900 tok/s  eta " in lines[2]
    progress.close()


def test_throughput_is_global_flops_per_device_second():
    # 8 devices, 2 s per step, 8e15 model FLOPs: 0.5e15 FLOP/s per device = 500 TFLOP/s.
    out = throughput(8 * 10**15, 40_000, 2.0, 8, 989.0)
    assert out["flops_per_token"] == 200_000_000_000
    assert out["tflops_per_gpu"] == 500.0
    assert out["mfu"] == pytest.approx(500 / 989, rel=1e-6)
    assert throughput(8 * 10**15, 40_000, 2.0, 8, None)["mfu"] is None
    assert throughput(10, 0, 0.0, 1, 1.0) == {"flops_per_token": None, "tflops_per_gpu": None, "mfu": None}
