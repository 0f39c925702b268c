"""The fingerprinted cache of encoded samples: plain .npy arrays and JSON, no pickle.

An entry lives in ``<cache_dir>/magistral-<fingerprint[:16]>/``::

    meta.json            format version, full fingerprint and what went into it, counts
    input_ids.npy        int32, every kept sample's ids, concatenated
    labels.npy           int32, aligned with input_ids (-100 = not trained)
    offsets.npy          int64 [n + 1], sample i is input_ids[offsets[i]:offsets[i + 1]]
    source_index.npy     int64 [n], the row of the dataset file each sample came from
    image_offsets.npy    int64 [n + 1], sample i's images are rows image_offsets[i]:[i + 1] of
    image_sizes.npy      int32 [m, 2], (height, width) after resizing
    images.json          [m] image paths (pixels are loaded by the data-loader workers)
    drops.jsonl          one line per dropped row: index, reason, detail
    report.json          the preprocessing report

An entry of preference pairs (``training.stage: dpo``; meta.json's ``pairs`` true, ``num_pairs``)
has the same files: pair ``k`` is sample ``2k`` (the prompt with the chosen answer) and sample
``2k + 1`` (with the rejected one), both from the same row.

The fingerprint is the SHA-256 of the dataset file's contents, the tokenizer and processor
files, every parameter that changes the encoding, and the format version: any change makes
a new entry, the same inputs find the old one. An entry is written into a temporary folder
and renamed into place, so a reader never sees half an entry; its files get the modes the
user's umask gives new files (``mkdtemp`` alone would make the entry private).

Integrity: ``meta.json`` records the size and xxh3-64 digest of every other file of the entry
(``files``), hashed when the entry is written. Opening an entry checks every size (a stat per
file: a truncated array is named instead of failing in ``mmap``); reusing it (``open_reusable``,
what preprocessing and the trainer do on a cache hit) also checks every digest, which reads the
whole entry once: for a 2 GiB entry 0.3 s from the page cache and 1.0 s from disk, less than the
SHA-256 of the dataset file (1 GiB/s) that the fingerprint computes on every cache hit already.
A damaged entry is not reused: it is encoded again (with a warning naming the file and what
differs), since everything in it derives from inputs the fingerprint has just confirmed, so a
rebuild gives exactly the intended samples and refusing would only make the user run that
rebuild by hand. An entry without the record (removed from meta.json) counts as damaged:
entries of format 1, which had none, no longer match any fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from magistral_cli.checkpoint.integrity import DIGEST, describe_file, file_digest
from magistral_cli.checkpoint.staging import current_umask
from magistral_cli.errors import CheckFailed

from .encoder import EncodedPair, EncodedSample

log = logging.getLogger(__name__)

#: Bump when the encoding or the layout changes: old entries then stop matching.
#: 2: meta.json records every file's size and digest.
FORMAT_VERSION = 2
ENTRY_PREFIX = "magistral-"
META = "meta.json"
#: meta.json's record of the entry's other files: name -> {"size", "xxh3_64"}.
FILES_KEY = "files"


def fingerprint(parts: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``parts`` (plus the format version)."""
    blob = json.dumps({"format_version": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def entry_dir(cache_dir: Path, digest: str) -> Path:
    return cache_dir / f"{ENTRY_PREFIX}{digest[:16]}"


def _save(path: Path, array: np.ndarray) -> None:
    np.save(path, array, allow_pickle=False)


class CacheWriter:
    """Collects encoded samples and drops, then commits them as one entry."""

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.source_index: list[int] = []
        self.images_per_sample: list[int] = []
        self._sizes: list[np.ndarray] = []
        self.images: list[str] = []
        self.truncated = 0
        self.label_tokens = 0
        self.drops: list[dict] = []
        self.pairs = 0  # preference pairs added (each is two samples)

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, sample: EncodedSample) -> None:
        self._ids.append(sample.input_ids)
        self._labels.append(sample.labels)
        self.lengths.append(len(sample.input_ids))
        self.source_index.append(sample.source_index)
        self.images_per_sample.append(len(sample.images))
        self._sizes.append(sample.image_sizes.reshape(-1, 2))
        self.images.extend(sample.images)
        self.truncated += int(sample.truncated)
        self.label_tokens += int((sample.labels != -100).sum())

    def add_pair(self, pair: EncodedPair) -> None:
        """A preference pair as two adjacent samples: ``2k`` chosen, ``2k + 1`` rejected."""
        if len(self) != 2 * self.pairs:
            raise ValueError("a cache entry holds samples or pairs, not both")
        self.add(pair.chosen)
        self.add(pair.rejected)
        self.pairs += 1

    def drop(self, index: int, reason: str, detail: str) -> None:
        self.drops.append({"index": index, "reason": reason, "detail": detail})

    def commit(self, target: Path, meta: dict, report: dict) -> Path:
        """Write everything into a temporary folder beside ``target`` and rename it into place."""
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            empty_i32 = np.zeros(0, dtype=np.int32)
            _save(tmp / "input_ids.npy", np.concatenate(self._ids) if self._ids else empty_i32)
            _save(tmp / "labels.npy", np.concatenate(self._labels) if self._labels else empty_i32)
            _save(
                tmp / "offsets.npy",
                np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]).astype(np.int64),
            )
            _save(tmp / "source_index.npy", np.asarray(self.source_index, dtype=np.int64))
            _save(
                tmp / "image_offsets.npy",
                np.concatenate([[0], np.cumsum(self.images_per_sample, dtype=np.int64)]).astype(np.int64),
            )
            sizes = (
                np.concatenate(self._sizes).astype(np.int32) if self._sizes else np.zeros((0, 2), np.int32)
            )
            _save(tmp / "image_sizes.npy", sizes.reshape(-1, 2))
            (tmp / "images.json").write_text(json.dumps(self.images), encoding="utf-8")
            with open(tmp / "drops.jsonl", "w", encoding="utf-8") as handle:
                for drop in self.drops:
                    handle.write(json.dumps(drop, ensure_ascii=False) + "\n")
            (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            record = {path.name: describe_file(path) for path in sorted(tmp.iterdir())}
            # meta.json last: its presence marks a complete entry.
            meta = {**meta, FILES_KEY: record}
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            # mkdtemp makes the directory private; the files in it follow the umask already
            os.chmod(tmp, 0o777 & ~current_umask())
            if target.exists():
                # overwrite_cache: move the old entry aside first, so the rename below is atomic.
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                os.rename(target, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target


def is_complete(entry: Path) -> bool:
    return (entry / META).is_file()


def entry_problems(entry: Path, checksums: bool = True) -> list[str]:
    """What differs between the files of a complete entry and the record in its meta.json: a file
    missing or of another size, and with ``checksums`` another digest. Empty when nothing does."""
    entry = Path(entry)
    try:
        meta = json.loads((entry / META).read_text(encoding="utf-8"))
        record = meta[FILES_KEY]
        if not isinstance(record, dict) or not all(isinstance(v, dict) for v in record.values()):
            raise ValueError(f"{FILES_KEY} is not a record of files")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{entry / META} holds no record of the entry's files ({exc.__class__.__name__}: {exc})"]
    problems = []
    for name, want in sorted(record.items()):
        path = entry / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        if size != want.get("size"):
            problems.append(f"{path} has {size} bytes, {want.get('size')} were written")
        elif checksums and file_digest(path) != want.get(DIGEST):
            problems.append(f"{path} does not match its {DIGEST} checksum (same size, other bytes)")
    return problems


def open_reusable(entry: Path) -> EncodedDataset | None:
    """The entry for reuse if it is complete and intact (every size and digest as written), else
    None; a damaged one is reported in a warning naming what differs, and is to be encoded again."""
    entry = Path(entry)
    if not is_complete(entry):
        return None
    problems = entry_problems(entry, checksums=True)
    if problems:
        log.warning(
            "the cache entry %s is damaged and will be encoded again: %s", entry, "; ".join(problems[:5])
        )
        return None
    return EncodedDataset(entry, reused=True, checked=True)


class EncodedDataset:
    """Read-only handle on a cache entry: ``len()`` and ``[i]`` -> :class:`EncodedSample`.

    Arrays are memory-mapped on first use in each process, so the handle pickles cheaply into
    data-loader workers. Opening checks every file's size against meta.json (``CheckFailed``
    naming a damaged file) unless ``checked`` says ``open_reusable`` has just checked more.
    """

    def __init__(self, path: str | Path, reused: bool = False, checked: bool = False):
        self.path = Path(path)
        if not is_complete(self.path):
            raise FileNotFoundError(f"{self.path} is not a complete cache entry (no meta.json)")
        problems = [] if checked else entry_problems(self.path, checksums=False)
        if problems:
            raise CheckFailed(
                f"the cache entry {self.path} is damaged: "
                + "; ".join(problems[:5])
                + "; nothing was read from "
                "it. Run `magistral preprocess` again (a damaged entry is encoded again), or delete the entry"
            )
        self.meta = json.loads((self.path / META).read_text(encoding="utf-8"))
        self.reused = reused
        self._arrays: dict[str, Any] | None = None

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def report(self) -> dict:
        return json.loads((self.path / "report.json").read_text(encoding="utf-8"))

    def _load(self) -> dict[str, Any]:
        if self._arrays is None:
            arrays: dict[str, Any] = {}
            for name in ("input_ids", "labels", "offsets", "source_index", "image_offsets", "image_sizes"):
                arrays[name] = np.load(self.path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            arrays["images"] = json.loads((self.path / "images.json").read_text(encoding="utf-8"))
            self._arrays = arrays
        return self._arrays

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_arrays"] = None  # reopened (memory-mapped) in the receiving process
        return state

    def __len__(self) -> int:
        """Samples (sequences): a pair entry holds two per pair."""
        return int(self.meta["num_samples"])

    @property
    def pairs(self) -> bool:
        """Whether the entry holds preference pairs (sample ``2k`` chosen, ``2k + 1`` rejected)."""
        return bool(self.meta.get("pairs", False))

    @property
    def num_units(self) -> int:
        """What the split and the samplers count: pairs in a pair entry, else samples."""
        return int(self.meta["num_pairs"]) if self.pairs else len(self)

    @property
    def num_images(self) -> int:
        """Images in the whole entry, from image_offsets.npy alone (its last offset)."""
        offsets = np.load(self.path / "image_offsets.npy", mmap_mode="r", allow_pickle=False)
        return int(offsets[-1]) if len(offsets) else 0

    @property
    def lengths(self) -> np.ndarray:
        """Every sample's token count, from offsets.npy alone (8 bytes a sample; nothing else is read)."""
        if self._arrays is not None:
            offsets = self._arrays["offsets"]
        else:
            offsets = np.load(self.path / "offsets.npy", mmap_mode="r", allow_pickle=False)
        return np.diff(np.asarray(offsets))

    def __getitem__(self, index: int) -> EncodedSample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range ({len(self)} samples)")
        index %= len(self)
        a = self._load()
        start, end = int(a["offsets"][index]), int(a["offsets"][index + 1])
        i0, i1 = int(a["image_offsets"][index]), int(a["image_offsets"][index + 1])
        return EncodedSample(
            input_ids=np.array(a["input_ids"][start:end]),
            labels=np.array(a["labels"][start:end]),
            images=a["images"][i0:i1],
            image_sizes=np.array(a["image_sizes"][i0:i1]),
            source_index=int(a["source_index"][index]),
        )

    def drops(self) -> list[dict]:
        with open(self.path / "drops.jsonl", encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
