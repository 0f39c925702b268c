"""Safetensors headers and a streaming safetensors writer.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
a JSON header ``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}}`` padded with
spaces to a multiple of 8 bytes, then the raw little-endian tensor bytes.

``read_safetensors_header`` reads only the header (no tensor data). ``SafetensorsStreamWriter``
writes the header first and then each tensor at its offset as soon as it arrives, so an export
never holds a whole output file in memory (``safetensors.torch.save_file`` needs every tensor of
the file at once). It lays the file out exactly as ``save_file`` does (same tensor order, same
header text), so its files are byte-identical to the ones ``save_file`` writes.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magistral_cli.errors import UserError

#: safetensors dtype name -> torch dtype name.
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}
_TORCH_TO_ST = {v: k for k, v in _DTYPES.items()}
# safetensors orders tensors by its Dtype enum (descending), then by name; this is that enum order.
_ORDER = [
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
]
_MAX_HEADER = 100 * 1024 * 1024
# Writes of 1 MiB: one pwrite of a whole large tensor measured several times slower here.
_WRITE_CHUNK = 1 << 20
#: With ``sync_early``, a background ``fdatasync`` starts after every this many bytes written, so
#: the disk writes a large file while it is still being filled (not all of it after its last byte).
SYNC_EVERY = 256 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file: name, safetensors dtype (``BF16``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)

    def torch_dtype(self):
        import torch

        return getattr(torch, _DTYPES[self.dtype])


def _itemsize(st_dtype: str) -> int:
    import torch

    return getattr(torch, _DTYPES[st_dtype]).itemsize


def safetensors_dtype(torch_dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"BF16"``."""
    name = str(torch_dtype).removeprefix("torch.")
    if name not in _TORCH_TO_ST:
        raise ValueError(f"dtype {name} cannot be stored in safetensors")
    return _TORCH_TO_ST[name]


def read_safetensors_header(path: str | Path) -> tuple[list[TensorSpec], dict[str, str]]:
    """The tensors (in file order) and the ``__metadata__`` of a safetensors file, without its data."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw_len)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        metadata = header.pop("__metadata__", None) or {}
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserError(f"{path} is not a readable safetensors file ({exc!r}); fetch it again") from None
    size = path.stat().st_size
    if size != 8 + n + end:
        raise UserError(
            f"{path} is truncated or padded: its header needs {8 + n + end} bytes, the file has {size}; fetch it again"
        )
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    specs = []
    for name, entry in entries:
        if entry["dtype"] not in _DTYPES:
            raise UserError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which is not supported")
        specs.append(TensorSpec(name, entry["dtype"], tuple(entry["shape"])))
    return specs, metadata


def read_data_offsets(path: str | Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(start of the data section, name -> (begin, end) within it) of a safetensors file, for
    copying a tensor's bytes as they are (``SafetensorsStreamWriter.copy_range``)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, {k: (v["data_offsets"][0], v["data_offsets"][1]) for k, v in header.items()}


def safetensors_layout(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The order in which ``safetensors`` stores tensors: by dtype (widest enum first), then by name."""
    return sorted(specs, key=lambda s: (-_ORDER.index(s.dtype), s.name))


class SafetensorsStreamWriter:
    """Write one safetensors file tensor by tensor, in any arrival order.

    The header (all names, dtypes and shapes) is known up front; ``write(name, tensor)``
    stores the bytes of one tensor at its offset; ``close()`` checks that every tensor came
    and closes the file (with an fsync if asked).

    ``sync_early``: an executor (one background thread) that starts the file's fsync as soon as
    its last byte is written, so the disk writes it while the caller fills the next file, and an
    ``fdatasync`` of what is written so far after every ``SYNC_EVERY`` bytes, so that a large file
    (or the only one) is not written out all at once after its last byte; ``close(fsync=True)``
    then waits for those syncs. An exporter that fsyncs every file at the end instead leaves the
    disk idle while it copies and the copy idle while the disk writes.
    """

    def __init__(
        self,
        path: str | Path,
        specs: Iterable[TensorSpec],
        metadata: dict[str, str] | None = None,
        sync_early: Executor | None = None,
    ):
        self.path = Path(path)
        self._sync_early = sync_early
        self._synced: Future | None = None  # the final fsync, once every byte is in
        self._partial: list[Future] = []  # fdatasyncs of the bytes written so far
        self._since_sync = 0
        self._specs = {s.name: s for s in safetensors_layout(specs)}
        self._offsets: dict[str, int] = {}
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for spec in self._specs.values():
            header[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self._offsets[spec.name] = offset
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self._data_start = 8 + len(text)
        self.nbytes = offset
        self._pending = set(self._specs)
        self._remaining = {name: spec.nbytes for name, spec in self._specs.items()}
        self._unwritten = offset  # bytes of tensor data still to come
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(self._fd, struct.pack("<Q", len(text)) + text)

    @property
    def layout(self) -> list[TensorSpec]:
        """The tensors in the order of their bytes in the file (write them in this order to append)."""
        return list(self._specs.values())

    def write(self, name: str, tensor, row_offset: int = 0) -> int:
        """Store ``tensor`` (CPU, the declared dtype) as ``name``, or as its rows from ``row_offset``.

        A tensor may come whole or in row blocks (FSDP2 shards tensors by rows, and rows are
        contiguous in the file); it is complete once all of its bytes arrived. Returns the byte
        count written.
        """
        import torch

        spec = self._specs.get(name)
        if spec is None or name not in self._pending:
            raise ValueError(f"{self.path.name}: unexpected or repeated tensor {name!r}")
        shape = tuple(tensor.shape)
        rows_fit = (
            shape == spec.shape
            if not spec.shape
            else shape[1:] == spec.shape[1:] and row_offset >= 0 and row_offset + shape[0] <= spec.shape[0]
        )
        if not rows_fit or safetensors_dtype(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"{self.path.name}: {name!r} gets {tensor.dtype} {shape} at row {row_offset}, "
                f"the header says {spec.dtype} {spec.shape}"
            )
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        view = memoryview(flat.numpy()).cast("B")
        start = (
            self._data_start
            + self._offsets[name]
            + row_offset * (spec.nbytes // max(spec.shape[0], 1) if spec.shape else 0)
        )
        pos, end = 0, len(view)
        while pos < end:  # pwrite may write less than asked
            pos += os.pwrite(self._fd, view[pos : pos + _WRITE_CHUNK], start + pos)
        return self._count(name, end)

    def copy_range(self, name: str, src_fd: int, src_offset: int, nbytes: int, row_offset: int = 0) -> int:
        """Store ``nbytes`` raw bytes of the open file ``src_fd`` from ``src_offset`` as ``name``,
        or as its rows from ``row_offset``: the bytes of whole rows, in the declared dtype,
        little-endian, copied file to file (``_copy_file_range``: in the kernel where that is
        faster, else through one reused 1 MiB buffer). Returns the byte count written.
        """
        spec = self._specs.get(name)
        if spec is None or name not in self._pending:
            raise ValueError(f"{self.path.name}: unexpected or repeated tensor {name!r}")
        rows = spec.shape[0] if spec.shape else 1
        row_bytes = spec.nbytes // rows if rows else 0
        fits = (
            (row_offset == 0 and nbytes == spec.nbytes)
            if not spec.shape or not row_bytes
            else nbytes % row_bytes == 0
            and row_offset >= 0
            and row_offset * row_bytes + nbytes <= spec.nbytes
        )
        if not fits:
            raise ValueError(
                f"{self.path.name}: {name!r} gets {nbytes} bytes at row {row_offset}, "
                f"the header says {spec.dtype} {spec.shape}"
            )
        start = self._data_start + self._offsets[name] + row_offset * row_bytes
        _copy_file_range(src_fd, src_offset, self._fd, start, nbytes)
        return self._count(name, nbytes)

    def _count(self, name: str, nbytes: int) -> int:
        """Count ``nbytes`` written to ``name`` (done when its shape is full); returns ``nbytes``."""
        self._remaining[name] -= nbytes
        self._unwritten -= nbytes
        if self._remaining[name] < 0:
            raise ValueError(f"{self.path.name}: {name!r} got more bytes than its shape holds")
        self._since_sync += nbytes
        # One at a time: a sync still running when the next is due has that much more to do.
        idle = not self._partial or self._partial[-1].done()
        if self._sync_early is not None and self._unwritten and self._since_sync >= SYNC_EVERY and idle:
            self._partial.append(self._sync_early.submit(os.fdatasync, self._fd))
            self._since_sync = 0
        if self._remaining[name] == 0:
            self._tensor_done(name)
        return nbytes

    def _tensor_done(self, name: str) -> None:
        self._pending.discard(name)
        if self._sync_early is not None and self._synced is None and self._unwritten == 0:
            self._synced = self._sync_early.submit(os.fsync, self._fd)

    def close(self, fsync: bool = False) -> None:
        """Close (after an fsync if asked); raises if a declared tensor was never written."""
        try:
            missing = sorted(n for n in self._pending if self._specs[n].nbytes)
            if missing:
                raise ValueError(
                    f"{self.path.name}: {len(missing)} tensors never written, e.g. {missing[:5]}"
                )
            size = os.fstat(self._fd).st_size
            if size != self._data_start + self.nbytes:
                raise ValueError(
                    f"{self.path.name} has {size} bytes, expected {self._data_start + self.nbytes}"
                )
            if fsync:
                for sync in [*self._partial, self._synced]:
                    if sync is not None:
                        sync.result()  # an early sync's error, if it had one
                os.fsync(self._fd)  # nothing left to write after an early sync: returns at once
        finally:
            self._wait_for_sync()
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        """Close without checks (the caller removes the partial file)."""
        if self._fd >= 0:
            self._wait_for_sync()
            os.close(self._fd)
            self._fd = -1

    def _wait_for_sync(self) -> None:
        """Early syncs must end before the descriptor closes (a closed number can be reused)."""
        pending = [sync for sync in [*self._partial, self._synced] if sync is not None]
        if pending:
            wait(pending)


class StreamWriters:
    """The output files of one export: each a ``SafetensorsStreamWriter`` whose fsync (with
    ``fsync=True``) starts in the background as soon as its last byte is in, while the next file
    is filled (one thread: the disk, not the CPU, is what it waits on); every file is closed when
    the ``with`` block ends, and on an error every one is aborted (the caller removes the files).

    An exporter that closed each file with its fsync before starting the next would leave the disk
    idle while it copies and the copy idle while the disk writes.
    """

    def __init__(self, fsync: bool):
        self.fsync = fsync
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="fsync") if fsync else None
        self._writers: list[SafetensorsStreamWriter] = []

    def open(
        self, path: str | Path, specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None
    ) -> SafetensorsStreamWriter:
        writer = SafetensorsStreamWriter(path, specs, metadata=metadata, sync_early=self._syncer)
        self._writers.append(writer)
        return writer

    def __enter__(self) -> StreamWriters:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                for writer in self._writers:
                    writer.close(fsync=self.fsync)
        except BaseException:
            exc_type = BaseException
            raise
        finally:
            if exc_type is not None:
                for writer in self._writers:
                    writer.abort()
            if self._syncer is not None:
                self._syncer.shutdown(wait=True)


# copy_file_range fails with these where the kernel or the file systems cannot copy in-kernel
# (older kernels, files on different file systems, some network and FUSE file systems).
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP}
_copy_file_range_works = hasattr(os, "copy_file_range")
_PAGE = mmap.PAGESIZE


def _copy_file_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset`` (file offsets
    of neither descriptor move); raises ``ValueError`` if the source ends early.

    In the kernel (``copy_file_range``) only when both offsets sit at the same place in their pages:
    the kernel splices the source page by page, and when the two offsets differ within a page every
    page is written as two pieces, measured at about half the speed of a copy through one reused
    1 MiB buffer (which stays in the CPU cache). A DCP record's bytes start 64-byte aligned and a
    tensor's place in a safetensors file is fixed by its header, so most copies take the buffer.
    """
    global _copy_file_range_works
    done = 0
    congruent = (src_offset - dst_offset) % _PAGE == 0
    while done < nbytes and congruent and _copy_file_range_works:
        try:
            n = os.copy_file_range(
                src_fd, dst_fd, nbytes - done, offset_src=src_offset + done, offset_dst=dst_offset + done
            )
        except OSError as exc:
            if exc.errno not in _NO_COPY_FILE_RANGE or done:
                raise
            _copy_file_range_works = False
            break
        if n == 0:
            raise ValueError(f"source ends {nbytes - done} bytes short of the range to copy")
        done += n
    if done == nbytes:
        return
    # One buffer, reused: a fresh bytes object per read (os.pread) costs page faults on every MiB.
    buffer = _copy_buffer()
    while done < nbytes:
        want = min(len(buffer), nbytes - done)
        got = os.preadv(src_fd, [buffer[:want]], src_offset + done)
        if not got:
            raise ValueError(f"source ends {nbytes - done} bytes short of the range to copy")
        pos = 0
        while pos < got:  # pwrite may write less than asked
            pos += os.pwrite(dst_fd, buffer[pos:got], dst_offset + done + pos)
        done += got


def read_exactly(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill ``buffer`` with the bytes of ``fd`` from ``offset`` (pread: the file offset stays);
    raises ``ValueError`` if the file ends first."""
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if not got:
            raise ValueError(f"source ends {len(buffer) - done} bytes short of the range to read")
        done += got


_buffers = threading.local()


def _copy_buffer() -> memoryview:
    """This thread's copy buffer (``_WRITE_CHUNK`` bytes)."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = memoryview(bytearray(_WRITE_CHUNK))
    return buffer
