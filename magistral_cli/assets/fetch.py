"""Fetch a model directory at the lock's pinned revisions, verify every file, keep the manifest.

``fetch_assets`` does the whole job: download what is missing (through ``huggingface_hub``, several
files at a time), hash every file (several at a time, streamed), compare each with its expected
sum and size, move any file that does not match into ``DIR/.magistral-quarantine/`` so that
nothing takes it for valid, and write ``DIR/magistral-manifest.json``.

Where a file's expected sum comes from, in order:

1. the lock (``lock``): every listed file has one;
2. the manifest (``manifest``): weight shards verified before, at the same repo and revision;
3. the Hub (``hub``): at a shard's first download, the ETag the Hub serves for an LFS file is its
   SHA-256, so even the first download is checked end to end. A file the Hub gives no SHA-256 for
   is recorded as it is (status ``recorded``).

``verify_only`` touches no network and changes nothing: missing files and shards without a
recorded sum fail, and a file that does not match is reported and left where it is, unless
``quarantine`` asks for it to be moved aside (``magistral fetch --verify-only --quarantine``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from magistral_cli.errors import CheckFailed, MagistralError, UserError

from .download import ByteProgress, download_file, hub_offline, local_hub_record, remote_hub_record
from .hashing import default_workers, sha256_file
from .lock import OFFICIAL_SOURCE, AssetLock, LockedFile, load_lock
from .manifest import ManifestEntry, read_manifest, utc_now, write_manifest

QUARANTINE_DIR = ".magistral-quarantine"
#: Files downloaded at the same time (the hashing runs beside them, one thread per core).
DOWNLOAD_WORKERS = 4

OK_STATUSES = ("ok", "recorded")


@dataclass
class FileResult:
    """The outcome for one file. ``status``: ``ok`` (matches its expected sum), ``recorded`` (no
    expected sum existed; the sum is now recorded), ``mismatch`` (moved aside), ``missing``,
    ``unverified`` (no sum to check against, offline) or ``error`` (the download failed)."""

    name: str
    repo: str
    revision: str
    status: str = "pending"
    sha256: str | None = None
    bytes: int | None = None
    expected_sha256: str | None = None
    expected_bytes: int | None = None
    expected_from: str | None = None
    downloaded: bool = False
    quarantined_to: str | None = None
    message: str | None = None
    error: MagistralError | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("error")
        return out


@dataclass
class FetchReport:
    model_dir: Path
    lock: Path
    verify_only: bool
    files: list[FileResult]
    manifest: Path | None = None
    downloaded_bytes: int = 0
    hashed_bytes: int = 0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(f.status in OK_STATUSES for f in self.files)

    @property
    def failures(self) -> list[FileResult]:
        return [f for f in self.files if f.status not in OK_STATUSES]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model_dir": str(self.model_dir),
            "lock": str(self.lock),
            "manifest": str(self.manifest) if self.manifest else None,
            "verify_only": self.verify_only,
            "downloaded_bytes": self.downloaded_bytes,
            "hashed_bytes": self.hashed_bytes,
            "wall_s": round(self.wall_s, 3),
            "files": [f.to_json() for f in self.files],
        }

    def raise_for_failures(self) -> None:
        """``CheckFailed`` (exit 1) naming every failed file; ``UserError`` (exit 2) when every
        failure is a download refused for a reason the user must fix (repo, revision, access)."""
        bad = self.failures
        if not bad:
            return
        lines = [f"{f.name}: {f.message or f.status}" for f in bad]
        text = f"{len(bad)} of {len(self.files)} files failed in {self.model_dir}:\n  " + "\n  ".join(lines)
        if all(isinstance(f.error, UserError) for f in bad):
            raise UserError(text)
        raise CheckFailed(text)


class FetchProgress:
    """What ``fetch_assets`` reports progress to (no-op here; the CLI renders it with rich).
    Called from worker threads: implementations must be thread-safe."""

    def download_bar(self, name: str, total: int | None, initial: int) -> ByteProgress:
        return ByteProgress()

    def add_hash_work(self, n_bytes: int) -> None:
        pass

    def hashed(self, n_bytes: int) -> None:
        pass


def quarantine(model_dir: Path, name: str) -> Path:
    """Move ``model_dir/name`` to ``model_dir/.magistral-quarantine/<name>.<UTC time>``."""
    src = model_dir / name
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    target = model_dir / QUARANTINE_DIR / f"{name}.{stamp}"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, target)
    return target


class _Fetcher:
    def __init__(
        self,
        model_dir: Path,
        lock: AssetLock,
        verify_only: bool,
        progress: FetchProgress,
        workers: int | None,
        quarantine: bool = True,
    ) -> None:
        self.dir = model_dir
        self.lock = lock
        self.verify_only = verify_only
        self.quarantine = quarantine
        self.offline = verify_only or hub_offline()
        self.progress = progress
        self.workers = workers
        self.manifest = read_manifest(model_dir) if model_dir.is_dir() else {}
        self.cancel = threading.Event()
        self.downloaded_bytes = 0
        self.hashed_bytes = 0
        self._lock = threading.Lock()

    # -- one group of files: download what is missing, hash everything, compare --------------------
    def run_group(self, files: list[LockedFile]) -> list[FileResult]:
        results = {f.name: FileResult(f.name, f.repo, f.revision) for f in files}
        by_name = {f.name: f for f in files}
        hashes: dict[str, Future] = {}
        n_hash = self.workers or default_workers(len(files))
        with (
            ThreadPoolExecutor(max_workers=n_hash, thread_name_prefix="sha256") as hash_pool,
            ThreadPoolExecutor(max_workers=DOWNLOAD_WORKERS, thread_name_prefix="download") as dl_pool,
        ):
            try:
                downloads: dict[Future, str] = {}
                for f in files:
                    path = self.dir / f.name
                    if path.is_file():
                        hashes[f.name] = self._submit_hash(hash_pool, path)
                    elif self.offline:
                        res = results[f.name]
                        res.status = "missing"
                        why = "--verify-only" if self.verify_only else "HF_HUB_OFFLINE is set"
                        res.message = f"missing from {self.dir} ({why}: nothing is downloaded)"
                    else:
                        downloads[dl_pool.submit(self._download, f)] = f.name
                for fut in as_completed(downloads):
                    name = downloads[fut]
                    try:
                        path = fut.result()
                    except MagistralError as exc:
                        res = results[name]
                        res.status, res.message, res.error = "error", str(exc), exc
                        continue
                    results[name].downloaded = True
                    hashes[name] = self._submit_hash(hash_pool, path)
                for name, fut in hashes.items():
                    try:
                        sha, size = fut.result()
                    except OSError as exc:  # unreadable file: report it, check the others
                        res = results[name]
                        res.status, res.message = "error", f"could not read {self.dir / name}: {exc}"
                        res.error = CheckFailed(res.message)
                        continue
                    self._judge(by_name[name], results[name], sha, size)
            except BaseException:
                # Ctrl-C or a bug: stop the download and hashing threads at their next chunk.
                self.cancel.set()
                hash_pool.shutdown(wait=False, cancel_futures=True)
                dl_pool.shutdown(wait=False, cancel_futures=True)
                raise
        return [results[f.name] for f in files]

    def _submit_hash(self, pool: ThreadPoolExecutor, path: Path) -> Future:
        self.progress.add_hash_work(path.stat().st_size)

        def on_bytes(n: int) -> None:
            self.progress.hashed(n)

        return pool.submit(sha256_file, path, on_bytes=on_bytes, cancel=self.cancel)

    def _download(self, f: LockedFile) -> Path:
        path = download_file(
            self.dir, f.repo, f.revision, f.name, make_bar=self.progress.download_bar, cancel=self.cancel
        )
        with self._lock:
            self.downloaded_bytes += path.stat().st_size
        return path

    # -- the verdict for one hashed file -----------------------------------------------------------
    def _expected(self, f: LockedFile) -> tuple[str | None, int | None, str | None]:
        if f.sha256 is not None:
            return f.sha256, f.bytes, "lock"
        entry = self.manifest.get(f.name)
        if entry is not None and (entry.repo, entry.revision) == (f.repo, f.revision):
            return entry.sha256, entry.bytes, "manifest"
        record = local_hub_record(self.dir, f.name)
        if record is not None and record.commit_hash == f.revision and record.sha256:
            return record.sha256, None, "hub"
        if not self.offline:
            record = remote_hub_record(f.repo, f.revision, f.name)
            if record.sha256:
                return record.sha256, None, "hub"
        return None, None, None

    def _judge(self, f: LockedFile, res: FileResult, sha: str, size: int) -> None:
        with self._lock:
            self.hashed_bytes += size
        res.sha256, res.bytes = sha, size
        try:
            expected_sha, expected_bytes, source = self._expected(f)
        except MagistralError as exc:
            res.status, res.message, res.error = "error", f"could not get the Hub's sum: {exc}", exc
            return
        res.expected_sha256, res.expected_bytes, res.expected_from = expected_sha, expected_bytes, source
        if expected_sha is None:
            if self.offline:
                res.status = "unverified"
                res.message = (
                    f"no recorded SHA-256 for this file (the lock has none and {self.dir.name}/"
                    "magistral-manifest.json has no entry at this revision); run `magistral fetch` "
                    "online once to record it"
                )
            else:
                res.status = "recorded"
            return
        size_bad = expected_bytes is not None and expected_bytes != size
        if sha == expected_sha and not size_bad:
            res.status = "ok"
            return
        res.status = "mismatch"
        detail = f"expected sha256 {expected_sha} ({source}), actual {sha}"
        if size_bad:
            detail += f"; expected {expected_bytes} bytes, actual {size}"
        if not self.quarantine:
            where = (
                "left in place (--verify-only changes nothing): `magistral fetch` moves it aside and downloads "
                "it again, or add --quarantine to move it aside now"
            )
        else:
            try:
                res.quarantined_to = str(quarantine(self.dir, f.name))
                where = f"moved to {res.quarantined_to}; run `magistral fetch` to download it again"
            except OSError as exc:
                where = f"could not move it aside ({exc}): delete it before using this directory"
        if source == "manifest":
            where += (
                f" (the expected sum was recorded in magistral-manifest.json at {self.manifest[f.name].verified_at};"
                " if that record itself is wrong, remove its entry)"
            )
        res.message = f"SHA-256 mismatch: {detail}; {where}"


def fetch_assets(
    model_dir: str | Path,
    lock: AssetLock | str | Path | None = None,
    *,
    weights: bool = True,
    tokenizer_source: str = OFFICIAL_SOURCE,
    verify_only: bool = False,
    progress: FetchProgress | None = None,
    workers: int | None = None,
    quarantine: bool | None = None,
    native: bool = False,
) -> FetchReport:
    """Download (unless ``verify_only``) and verify the lock's files in ``model_dir``.

    Returns the report; call ``report.raise_for_failures()`` to turn failures into an exit code.
    Writes ``model_dir/magistral-manifest.json`` (not with ``verify_only``, which only reads).
    A file that does not match is moved into ``.magistral-quarantine/``: always when fetching (a
    new copy replaces it), with ``verify_only`` only when ``quarantine`` is true (a check moves
    nothing of the user's unless asked).

    ``native``: also the lock's native-layout files (``params.json``, ``consolidated.safetensors``).
    A directory whose manifest records any of them has them checked on every run, asked or not.
    """
    import time

    t0 = time.perf_counter()
    lock = lock if isinstance(lock, AssetLock) else load_lock(lock)
    model_dir = Path(model_dir).expanduser().resolve()
    if quarantine is None:
        quarantine = not verify_only
    elif not verify_only and not quarantine:
        raise UserError(
            "a fetch moves a file that does not match aside before downloading it again; drop quarantine=False"
        )
    if verify_only and not model_dir.is_dir():
        raise UserError(
            f"--model-dir {model_dir} does not exist; run `magistral fetch --model-dir {model_dir}` first"
        )
    if model_dir.exists() and not model_dir.is_dir():
        raise UserError(f"--model-dir {model_dir} is a file; pass a directory")
    if not verify_only:
        model_dir.mkdir(parents=True, exist_ok=True)
    fetcher = _Fetcher(model_dir, lock, verify_only, progress or FetchProgress(), workers, quarantine)

    plain = lock.select(tokenizer_source)
    results = fetcher.run_group(plain)
    if weights and lock.weights is not None:
        index_result = next(r for r in results if r.name == lock.weights.index)
        if index_result.status in OK_STATUSES:
            shards = lock.weights.shard_files(model_dir / lock.weights.index)
            results += fetcher.run_group(shards)
        else:
            results.append(
                FileResult(
                    lock.weights.pattern,
                    lock.weights.repo,
                    lock.weights.revision,
                    status="error",
                    message=f"weight shards not checked: their index {lock.weights.index} failed",
                )
            )

    if native and lock.native is None:
        raise UserError(
            f"the lock {lock.path} lists no native-layout files (no 'native' entry); drop --native or "
            "pass a lock that has one"
        )
    if lock.native is not None and (native or any(n in fetcher.manifest for n in lock.native.names)):
        results += fetcher.run_group(lock.native.locked_files())

    report = FetchReport(
        model_dir=model_dir,
        lock=lock.path,
        verify_only=verify_only,
        files=results,
        downloaded_bytes=fetcher.downloaded_bytes,
        hashed_bytes=fetcher.hashed_bytes,
    )
    if not verify_only:
        entries = dict(fetcher.manifest)
        now = utc_now()
        for r in results:
            if r.status in OK_STATUSES and r.sha256 is not None and r.bytes is not None:
                entries[r.name] = ManifestEntry(r.name, r.repo, r.revision, r.sha256, r.bytes, now)
        report.manifest = write_manifest(model_dir, entries)
    else:
        manifest = model_dir / "magistral-manifest.json"
        report.manifest = manifest if manifest.is_file() else None
    report.wall_s = time.perf_counter() - t0
    return report


def verify_model_dir(
    model_dir: str | Path, lock: AssetLock | str | Path | None = None, **kwargs
) -> FetchReport:
    """``fetch_assets(..., verify_only=True)`` that raises on any failure: for other commands that
    want to know a model directory is intact before they use it (nothing is moved)."""
    report = fetch_assets(model_dir, lock, verify_only=True, **kwargs)
    report.raise_for_failures()
    return report
