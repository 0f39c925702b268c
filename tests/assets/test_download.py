"""The progress adapter handed to huggingface_hub as its tqdm class, for HTTP and Xet downloads."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from magistral_cli.assets.download import _tqdm_adapter, scrub_secrets

pytestmark = pytest.mark.compat  # huggingface_hub's progress classes changed between 1.x and 2.x


class Recorder:
    def __init__(self):
        self.bytes = 0
        self.closed = False

    def update(self, n):
        self.bytes += n

    def close(self):
        self.closed = True


def test_xet_progress_reporter_drives_the_adapter():
    """Xet downloads report progress through the ``tqdm_class`` they are given: huggingface_hub 2.x
    through its ``XetDownloadProgressReporter``, 1.x through the plain progress-bar context that its
    HTTP downloads use too. Each release is driven the way its ``xet_get`` drives it."""
    xet = pytest.importorskip("huggingface_hub.utils._xet_progress_reporting")
    bars = []

    def make_bar(name, total, initial):
        bars.append(Recorder())
        return bars[-1]

    cls = _tqdm_adapter("model-00001.safetensors", make_bar, None)
    if not hasattr(xet, "XetDownloadProgressReporter"):
        from huggingface_hub.file_download import _get_progress_bar_context

        with _get_progress_bar_context(
            desc="model-00001.safetensors",
            log_level=30,
            total=1000,
            initial=0,
            name="huggingface_hub.xet_get",
            tqdm_class=cls,
        ) as progress:
            for done in (300, 700):
                progress.update(done)
        assert [b.bytes for b in bars] == [1000]
        assert bars[0].closed
        return
    with xet.XetDownloadProgressReporter(
        reconstruction_desc="r", total=1000, log_level=30, tqdm_class=cls
    ) as reporter:
        for done in (300, 1000):
            report = SimpleNamespace(
                total_bytes_completed=done,
                total_transfer_bytes_completed=done // 2,
                total_bytes_completion_rate=1.0,
                total_transfer_bytes_completion_rate=1.0,
                total_bytes=1000,
            )
            reporter.update_progress(report)
    assert [b.bytes for b in bars] == [1000]
    assert bars[0].closed


def test_cancel_interrupts_a_download_at_the_next_chunk():
    cancel = threading.Event()
    bar = _tqdm_adapter("f", None, cancel)(total=10)
    bar.update(5)
    cancel.set()
    with pytest.raises(KeyboardInterrupt):
        bar.update(5)


def test_scrub_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdef123456")
    assert scrub_secrets("401 for token hf_abcdef123456 at x") == "401 for token *** at x"
