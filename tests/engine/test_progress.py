"""Rank 0's progress line, and the validation loss it shows after an evaluation."""

from __future__ import annotations

import io
import sys

from magistral_cli.engine.metrics import Progress

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
