"""Downloads through ``huggingface_hub`` at a pinned revision into a model directory.

The environment is read at call time, not when ``huggingface_hub`` was imported:
``HF_ENDPOINT`` (a mirror or a local hub) is passed as ``endpoint``, ``HF_HUB_OFFLINE`` stops
every request, and the token (``HF_TOKEN`` or ``hf auth login``) is left to the client, which
sends it as a header and never logs it. Messages that could carry it are scrubbed anyway.

Resuming: a download whose connection drops midway is resumed with an HTTP ``Range`` request
from the bytes already received. ``huggingface_hub`` 2.x does that inside its own call (up to five
times per file); 1.x (what transformers 5.17-5.2x install) gives up at the first dropped
connection, so ``download_file`` calls it again, up to ``ATTEMPTS`` times, and the client resumes
from its ``.incomplete`` file. Files that were completed are kept with their ``.cache/huggingface``
metadata, so a second ``magistral fetch`` after an interruption skips them. The partial file of a
file interrupted by the user (Ctrl-C) never reaches its destination: 2.x removes it, 1.x keeps it
in ``.cache/huggingface/download`` and the next fetch resumes from it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from magistral_cli.errors import CheckFailed, UserError

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_TRUE = {"1", "on", "yes", "true"}


def hub_endpoint() -> str | None:
    """``HF_ENDPOINT`` now (``None``: the client's default, huggingface.co)."""
    value = os.environ.get("HF_ENDPOINT", "").strip()
    return value.rstrip("/") or None


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value now."""
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def scrub_secrets(text: str) -> str:
    """Replace any token from the environment that appears in ``text``."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        token = os.environ.get(var, "").strip()
        if len(token) >= 4:
            text = text.replace(token, "***")
    return text


@dataclass(frozen=True)
class HubRecord:
    """What the Hub said about a downloaded file: commit and ETag (the SHA-256 for LFS files)."""

    commit_hash: str | None
    etag: str | None

    @property
    def sha256(self) -> str | None:
        """The ETag when it is a SHA-256 (LFS files: the weight shards); ``None`` otherwise."""
        return self.etag if self.etag and _SHA256.fullmatch(self.etag) else None


class ByteProgress:
    """What a download reports to: ``update(n)`` per chunk, ``close()`` at the end."""

    def update(self, n: int) -> None:  # pragma: no cover - interface
        pass

    def close(self) -> None:  # pragma: no cover - interface
        pass


def _tqdm_adapter(
    name: str, make_bar: Callable[[str, int | None, int], ByteProgress] | None, cancel: threading.Event | None
):
    """A class ``huggingface_hub`` instantiates as its tqdm, forwarding bytes to ``make_bar``'s bar.

    ``update`` also checks ``cancel`` so that Ctrl-C stops a download thread midway.
    """

    class _Bar:
        # The subset of tqdm's interface that huggingface_hub's HTTP and Xet downloads use.
        def __init__(self, *args, total=None, initial=0, **kwargs):
            self.total = total
            self.n = initial or 0
            self.format_dict: dict = {}
            self._bar = make_bar(name, total, initial or 0) if make_bar else None

        def update(self, n=1):
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt
            if n:
                self.n += int(n)
                if self._bar is not None:
                    self._bar.update(int(n))

        def update_transfer(self, n=1):  # network bytes (Xet); the bar shows bytes written
            pass

        def set_postfix_str(self, *args, **kwargs):
            pass

        set_transfer_postfix_str = set_postfix = set_description = set_description_str = set_postfix_str

        def refresh(self, *args, **kwargs):
            pass

        def close(self):
            if self._bar is not None:
                self._bar.close()
                self._bar = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()
            return False

    return _Bar


def local_hub_record(model_dir: Path, name: str) -> HubRecord | None:
    """The commit and ETag ``huggingface_hub`` recorded when it put ``name`` into ``model_dir``."""
    try:
        from huggingface_hub._local_folder import read_download_metadata
    except ImportError:  # a client without that helper: no record, the caller falls back
        return None
    try:
        meta = read_download_metadata(local_dir=model_dir, filename=name)
    except Exception:
        return None
    if meta is None:
        return None
    return HubRecord(commit_hash=meta.commit_hash, etag=meta.etag)


def remote_hub_record(repo: str, revision: str, name: str) -> HubRecord:
    """The Hub's commit and ETag for ``name`` at ``revision`` (one HEAD request)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    endpoint = hub_endpoint()
    try:
        meta = get_hf_file_metadata(
            hf_hub_url(repo, name, revision=revision, endpoint=endpoint), endpoint=endpoint
        )
    except Exception as exc:
        raise _translate(exc, repo, revision, name) from None
    return HubRecord(commit_hash=meta.commit_hash, etag=meta.etag)


#: Calls of the client per file while the connection keeps dropping midway (each resumes).
ATTEMPTS = 5


def _dropped_connection(exc: Exception) -> bool:
    """A network failure mid-transfer from huggingface_hub 1.x's client (``httpx`` transport errors),
    worth resuming. 2.x's client (``httpx2``) has already resumed five times, a second apart (the count
    starting over whenever bytes arrive), before its error reaches us: that one is final."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - huggingface_hub >= 1.0 depends on httpx
        return False
    return isinstance(exc, httpx.TransportError)


def download_file(
    model_dir: Path,
    repo: str,
    revision: str,
    name: str,
    *,
    make_bar: Callable[[str, int | None, int], ByteProgress] | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """Download ``name`` from ``repo`` at ``revision`` to ``model_dir/name`` with ``huggingface_hub``."""
    from huggingface_hub import hf_hub_download

    if hub_offline():
        raise UserError(
            f"{name} is not in {model_dir} and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to download "
            "it, or copy the files in and run `magistral fetch --verify-only`"
        )
    attempt = 1
    while True:
        try:
            return Path(
                hf_hub_download(
                    repo_id=repo,
                    filename=name,
                    revision=revision,
                    local_dir=str(model_dir),
                    endpoint=hub_endpoint(),
                    tqdm_class=_tqdm_adapter(name, make_bar, cancel),
                )
            )
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            if attempt < ATTEMPTS and _dropped_connection(exc) and not (cancel and cancel.is_set()):
                attempt += 1
                log.warning(
                    "%s: the connection dropped (%s); resuming (attempt %d of %d)",
                    name,
                    _detail(exc),
                    attempt,
                    ATTEMPTS,
                )
                continue
            raise _translate(exc, repo, revision, name) from None


def _detail(exc: Exception) -> str:
    """An exception's first line (or its type), scrubbed of secrets."""
    return scrub_secrets(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _translate(exc: Exception, repo: str, revision: str, name: str) -> Exception:
    """One clear message for the ways a Hub request fails (never with a token in it)."""
    from huggingface_hub import errors as hf_errors

    where = f"{repo}@{revision[:12]}:{name}"
    endpoint = hub_endpoint() or "https://huggingface.co"
    detail = _detail(exc)
    if isinstance(exc, hf_errors.GatedRepoError):
        return UserError(
            f"{where}: the repository is gated ({detail}); accept its terms on the Hub and set HF_TOKEN "
            "to a token of that account"
        )
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return UserError(
            f"{where}: repository not found or not accessible at {endpoint} ({detail}); check the lock's "
            "repo, HF_ENDPOINT, and HF_TOKEN for private repositories"
        )
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return UserError(f"{where}: revision not found at {endpoint} ({detail}); check the lock's revision")
    remote_missing = getattr(hf_errors, "RemoteEntryNotFoundError", None)
    if remote_missing is not None and isinstance(exc, remote_missing):
        return UserError(
            f"{where}: file not found at that revision at {endpoint} ({detail}); check the lock's file names"
        )
    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return UserError(f"{where}: HF_HUB_OFFLINE is set; unset it to download")
    return CheckFailed(
        f"{where}: download from {endpoint} failed ({type(exc).__name__}: {detail}); run the same "
        "command again: completed files are kept"
    )
