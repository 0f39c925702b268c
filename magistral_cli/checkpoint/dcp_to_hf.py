"""A DCP checkpoint -> Hugging Face safetensors shards that ``from_pretrained`` and vLLM load.

The input is a conversion (fsdp2 or megatron layout) or a training checkpoint of the engine
(``checkpoints/step_N/``: ``{"model": ..., "optimizer": ..., ...}``); only the model tensors
are read. By default the output has the keys and the file split of the model directory's own
``model.safetensors.index.json`` (the official layout), so HF -> DCP -> HF gives back the same
files.

Memory: one ``dcp.load`` reads every model tensor through a load planner that hands each tensor
(or each block of rows, for checkpoints that FSDP2 ranks saved) to a streaming safetensors writer
as soon as it is read, and the writer stores it at its offset in its output file. At most one
tensor (plus the copy DCP's reader deserializes) is in memory, whatever the shard size. DCP's ``HuggingFaceStorageWriter`` would
serialize each whole output file in memory (``safetensors.torch.save``) from a state dict that
``dcp.save`` needs complete, and it names files by its own pattern: it does not fit here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import shutil
import struct
import sys
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from magistral_cli.errors import CheckFailed, MagistralError, UserError

from .hf import (
    CONFIG,
    SINGLE_WEIGHTS,
    TEKKEN,
    WEIGHT_INDEX,
    native_shard_name,
    read_hf_weights,
    read_weight_index,
    require_model_dir,
    support_files,
)
from .keys import (
    DCP_MODEL_PREFIX,
    to_transformers_key,
    transformers_to_native_key,
    transformers_to_official_key,
)
from .native import check_native_base, rotary_head_dim, write_native_files, write_rows
from .safetensors_io import StreamWriters, TensorSpec, read_exactly, safetensors_dtype
from .staging import refuse_existing, staged_directory
from .validate import (
    compare_keys,
    dcp_dtypes,
    dcp_shapes,
    detect_dcp_layout,
    model_keys,
    read_dcp_metadata,
    required_dtype,
    resolve_dcp_checkpoint,
)

EXPORT_LAYOUTS = ("official", "transformers")
#: What an export writes: ``hf`` (safetensors shards, config and tokenizer files for transformers)
#: or ``mistral`` (Mistral's native consolidated.safetensors + params.json + tekken.json).
EXPORT_FORMATS = ("hf", "mistral")
#: Output shard size when the model directory has no weights to copy the split from.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

ProgressFn = Callable[[int, int], None]


@dataclass
class ExportResult:
    """What ``export_dcp_to_hf`` wrote."""

    out_dir: Path
    checkpoint_dir: Path
    dcp_layout: str
    layout: str
    files: list[str]
    tensors: int
    bytes: int
    seconds: float
    copied: list[str]
    #: How many DCP read items were copied file to file ("direct") and how many went through
    #: DCP's reader ("torch_load").
    reads: dict[str, int] = dataclasses.field(default_factory=dict)
    #: What the export lacks that a user of it needs (no tokenizer in the model directory).
    warnings: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "out_dir": str(self.out_dir),
            "checkpoint_dir": str(self.checkpoint_dir),
            "dcp_layout": self.dcp_layout,
            "layout": self.layout,
            "files": self.files,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "throughput_mib_s": round(self.bytes / 2**20 / self.seconds, 1) if self.seconds > 0 else None,
            "copied": self.copied,
            "reads": self.reads,
            "warnings": self.warnings,
        }


def plan_output_files(model_dir: Path) -> tuple[dict[str, list[str]], dict]:
    """Output file -> the transformers keys it holds, and the index metadata to start from.

    The split of ``model_dir``'s weights when it has some (index or single file); otherwise
    ``model-0000i-of-0000N.safetensors`` files of at most ``DEFAULT_MAX_SHARD_BYTES``, in
    state-dict order (tied aliases left out, as ``save_pretrained`` does).
    """
    if read_weight_index(model_dir) is not None or (model_dir / SINGLE_WEIGHTS).is_file():
        weights = read_hf_weights(model_dir)
        files = {
            name: [to_transformers_key_or_raw(s.name) for s in specs] for name, specs in weights.files.items()
        }
        return files, weights.index_metadata
    return {}, {}


def to_transformers_key_or_raw(key: str) -> str:
    try:
        return to_transformers_key(key)
    except KeyError:
        return key


def _split_by_size(
    keys: list[str], nbytes: dict[str, int], limit: int, native: bool = False
) -> dict[str, list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        if groups[-1] and size + nbytes[key] > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes[key]
    n = len(groups)
    if native:
        return {native_shard_name(i, n): g for i, g in enumerate(groups)}
    if n == 1:
        return {SINGLE_WEIGHTS: groups[0]}
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def _make_streaming_planner(sink: Callable[[str, object, int], None]):
    """A DefaultLoadPlanner that hands every tensor to ``sink(dcp_key, tensor, row_offset)`` as
    soon as DCP has read it, instead of keeping a state dict.

    A tensor saved whole, or in blocks of whole rows (FSDP2 shards by rows, one block per rank),
    is read into one reused buffer and passed on block by block: memory stays at one block, and
    a reused buffer avoids faulting in fresh pages for every tensor. A tensor split any other
    way is assembled whole first and passed on once complete.
    """
    import math

    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class StreamingLoadPlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._buffer = torch.empty(0, dtype=torch.uint8)
            self._assembling: dict[str, torch.Tensor] = {}
            self._remaining: dict[str, int] = {}

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            # DefaultLoadPlanner would materialize the meta tensors here (all at once); keep them
            # as the plan's shapes and allocate in resolve_tensor instead.
            self.original_state_dict = self.state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def resolve_tensor(self, read_item):
            fqn = read_item.dest_index.fqn
            md = self.metadata.state_dict_metadata[fqn]
            dtype, lengths = md.properties.dtype, list(read_item.lengths)
            whole_rows = all(
                offset == 0 and length == size
                for offset, length, size in zip(
                    read_item.dest_offsets[1:], lengths[1:], md.size[1:], strict=True
                )
            )
            if whole_rows and fqn not in self._assembling:
                nbytes = math.prod(lengths) * dtype.itemsize
                if self._buffer.numel() < nbytes:
                    self._buffer = torch.empty(nbytes, dtype=torch.uint8)
                return self._buffer[:nbytes].view(dtype).view(lengths)
            full = self._assembling.get(fqn)
            if full is None:
                full = self._assembling[fqn] = torch.empty(md.size, dtype=dtype)
                self._remaining[fqn] = full.numel()
            return self.transform_tensor(read_item, full)  # the chunk this read fills

        def commit_tensor(self, read_item, tensor) -> None:
            fqn = read_item.dest_index.fqn
            if fqn not in self._assembling:
                sink(fqn, tensor, read_item.dest_offsets[0] if len(read_item.dest_offsets) else 0)
                return
            self._remaining[fqn] -= tensor.numel()
            if self._remaining[fqn] == 0:
                del self._remaining[fqn]
                sink(fqn, self._assembling.pop(fqn), 0)

    return StreamingLoadPlanner()


class _FileRange(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a read-only seekable stream (pread:
    the descriptor's own offset is left alone)."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise ValueError("negative seek position")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        data = os.pread(self._fd, n, self._start + self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


_RECORD = re.compile(r"[^/]+/data/\d+")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then the name and extra field lengths


def _record_data(fd: int, start: int, length: int, record: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed zip record's bytes begin, from the start of its archive (at ``start``)."""
    if record.compress_type != zipfile.ZIP_STORED or record.compress_size != record.file_size:
        return None
    header = os.pread(fd, _LOCAL_HEADER.size, start + record.header_offset)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    data = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    return data if data + record.file_size <= length else None


def _pickle_bytes(fd: int, start: int, length: int, infos: list[zipfile.ZipInfo]) -> bytes | None:
    """The raw bytes of a ``torch.save`` archive's one ``data.pkl`` record when it is stored
    uncompressed, else None."""
    pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(pickles) != 1:
        return None
    where = _record_data(fd, start, length, pickles[0])
    if where is None:
        return None
    data = os.pread(fd, pickles[0].file_size, start + where)
    return data if len(data) == pickles[0].file_size else None


def locate_rows(
    fd: int, start: int, length: int, dtype, storage_offsets, lengths, loaded: dict | None = None
) -> tuple[int, int] | None:
    """Where the bytes of one DCP read item lie in its ``.distcp`` file, or None.

    ``start``/``length`` are the item's bytes (DCP's ``_StorageInfo.offset``/``.length``): one
    ``torch.save`` archive, a zip of the pickled tensor and one record of its storage's raw bytes.
    When that record is stored uncompressed, holds ``dtype`` little-endian, and the tensor is
    contiguous, the rows ``storage_offsets``/``lengths`` ask for (whole rows: all of every other
    dimension) are one run of bytes of the file: returns its (file offset, byte count). Any
    other case (compressed or transformed items, another dtype, strides, a split of the
    columns) returns None, and the caller reads the item through ``torch.load``.

    The tensor's geometry comes from ``torch.load(..., weights_only=True, map_location="meta")``,
    which reads the pickle but no storage bytes; the record's place from ``zipfile``. Loading to
    the meta device makes the result a function of the pickle's bytes alone, so ``loaded`` (a dict
    the caller keeps across items) maps those bytes to the meta tensor: the items of a checkpoint
    share a handful of geometries (every layer's query weight pickles the same), and the weights-only
    unpickler costs about a millisecond a call.
    """
    import torch

    if sys.byteorder != "little":
        return None
    view = _FileRange(fd, start, length)
    try:
        with zipfile.ZipFile(view) as archive:
            infos = archive.infolist()
        records = [i for i in infos if _RECORD.fullmatch(i.filename)]
        if len(records) != 1:
            return None
        record = records[0]
        data = _record_data(fd, start, length, record)
        if data is None:
            return None
        # DCP saves with torch's CRC computation off (CRC 0, which zipfile.read rejects and
        # torch.load never checks): read the byte-order record (absent in old archives: native
        # order) as raw bytes too.
        for info in infos:
            if info.filename.endswith("/byteorder"):
                where = _record_data(fd, start, length, info)
                if where is None or os.pread(fd, info.file_size, start + where) != b"little":
                    return None
        pickled = _pickle_bytes(fd, start, length, infos)
        tensor = loaded.get(pickled) if loaded is not None and pickled is not None else None
        if tensor is None:
            view.seek(0)
            tensor = torch.load(view, map_location="meta", weights_only=True)
            if loaded is not None and pickled is not None:
                loaded[pickled] = tensor
    except (zipfile.BadZipFile, RuntimeError, ValueError, OSError, EOFError, KeyError):
        return None
    if (
        type(tensor) is not torch.Tensor
        or tensor.dtype != dtype
        or tensor.layout != torch.strided
        or not tensor.is_contiguous()
        or tensor.untyped_storage().nbytes() != record.file_size
        or len(storage_offsets) != tensor.dim()
        or len(lengths) != tensor.dim()
    ):
        return None
    itemsize = dtype.itemsize
    first = tensor.storage_offset() * itemsize
    if first + tensor.numel() * itemsize > record.file_size:
        return None
    if tensor.dim() == 0:
        return start + data + first, itemsize
    shape = tuple(tensor.shape)
    if any(o != 0 or n != s for o, n, s in zip(storage_offsets[1:], lengths[1:], shape[1:], strict=True)):
        return None
    if storage_offsets[0] < 0 or lengths[0] < 0 or storage_offsets[0] + lengths[0] > shape[0]:
        return None
    row_bytes = math.prod(shape[1:]) * itemsize
    return start + data + first + storage_offsets[0] * row_bytes, lengths[0] * row_bytes


def _make_direct_reader(
    checkpoint_dir: Path, metadata, sink_range, counts: dict[str, int], direct: bool = True
):
    """A SafeFileSystemReader that copies each tensor item's bytes from its ``.distcp`` file straight
    into the output file (``sink_range(dcp_key, fd, offset, nbytes, row_offset)``), where
    ``locate_rows`` finds them, and hands every other item to DCP's own reader (``torch.load``,
    then the load planner), in the checkpoint's order. ``counts`` tallies the items of each path;
    ``direct=False`` sends every item to DCP's reader.

    DCP's reader deserializes every item with ``torch.load`` (a zip archive per tensor) into a
    fresh tensor and copies it into the planner's; the direct copy skips both and keeps the
    bytes out of the process.
    """
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    from .safe_dcp import SafeFileSystemReader

    def whole_rows(item) -> bool:
        md = metadata.state_dict_metadata[item.dest_index.fqn]
        return all(
            offset == 0 and length == size
            for offset, length, size in zip(item.dest_offsets[1:], item.lengths[1:], md.size[1:], strict=True)
        )

    class DirectReader(SafeFileSystemReader):
        def read_data(self, plan, planner):
            # A tensor goes the direct way only if every chunk of it is a block of whole rows:
            # the planner assembles the others whole and must see all of their chunks.
            rows_only: dict[str, bool] = {}
            loaded: dict = {}  # locate_rows' geometries, by pickle bytes
            for item in plan.items:
                fqn = item.dest_index.fqn
                rows_only[fqn] = (
                    rows_only.get(fqn, True) and item.type == LoadItemType.TENSOR and whole_rows(item)
                )
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for relative_path, items in per_file.items():
                fd = os.open(checkpoint_dir / relative_path, os.O_RDONLY)
                try:
                    pending: list = []
                    for item in items:
                        info = self.storage_data[item.storage_index]
                        where = None
                        fqn = item.dest_index.fqn
                        if direct and rows_only[fqn] and not info.transform_descriptors:
                            dtype = metadata.state_dict_metadata[fqn].properties.dtype
                            where = locate_rows(
                                fd,
                                info.offset,
                                info.length,
                                dtype,
                                item.storage_offsets,
                                item.lengths,
                                loaded,
                            )
                        if where is None:
                            pending.append(item)
                            continue
                        if pending:  # keep the checkpoint's order: earlier items first
                            super().read_data(dataclasses.replace(plan, items=pending), planner).wait()
                            counts["torch_load"] += len(pending)
                            pending = []
                        row = item.dest_offsets[0] if len(item.dest_offsets) else 0
                        sink_range(fqn, fd, where[0], where[1], row)
                        counts["direct"] += 1
                    if pending:
                        super().read_data(dataclasses.replace(plan, items=pending), planner).wait()
                        counts["torch_load"] += len(pending)
                finally:
                    os.close(fd)
            done: Future = Future()
            done.set_result(None)
            return done

    return DirectReader(str(checkpoint_dir))


def _unwrap(exc, checkpoint_dir: Path) -> BaseException:
    """DCP wraps every failure, even Ctrl-C, in a CheckpointException (a BaseException): unwrap it."""
    failures = [failure for failure, _ in exc.failures.values()]
    first = failures[0] if failures else exc
    if isinstance(first, (KeyboardInterrupt, MagistralError, OSError)):
        return first
    return CheckFailed(f"reading the DCP checkpoint {checkpoint_dir} failed: {first!r}")


def load_in_process(state: dict, checkpoint_dir: Path) -> None:
    """``dcp.load`` of ``state`` from ``checkpoint_dir`` in this process (no process group),
    through the restricted reader; a failure is one message naming the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .safe_dcp import SafeFileSystemReader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint_dir)), no_dist=True)
        except CheckpointException as exc:
            raise _unwrap(exc, checkpoint_dir) from None


def _check_model_tensors(checkpoint_dir: Path, model_dir: Path, allow_dtype_mismatch: bool):
    """(metadata, shapes, expected model keys, DCP layout) of a checkpoint whose model tensors fit
    ``model_dir``'s config.json: every key present, shapes and dtypes right (``CheckFailed`` if not)."""
    metadata = read_dcp_metadata(checkpoint_dir)
    shapes = dcp_shapes(metadata)
    expected = model_keys(model_dir)

    dcp_layout = detect_dcp_layout(expected, shapes)
    if dcp_layout is None:
        # Report against the layout that matches best, so the message names the nearest problem.
        reports = [
            compare_keys(f"DCP checkpoint {checkpoint_dir} (layout {name})", expected, shapes, prefix)
            for name, prefix in DCP_MODEL_PREFIX.items()
        ]
        best = min(reports, key=lambda r: len(r.missing))
        raise CheckFailed(
            best.message("Pass a checkpoint of the model that --model-dir's config.json describes.")
        )
    prefix = DCP_MODEL_PREFIX[dcp_layout]
    report = compare_keys(
        f"DCP checkpoint {checkpoint_dir} (layout {dcp_layout})",
        expected,
        shapes,
        prefix,
        dtypes=dcp_dtypes(metadata),
        dtype=required_dtype(expected, dcp_layout, allow_dtype_mismatch),
    )
    if report.wrong_shapes or report.wrong_dtypes:
        raise CheckFailed(
            report.message("Pass a checkpoint of the model that --model-dir's config.json describes.")
        )
    return metadata, shapes, expected, dcp_layout


def read_dcp_model_state(
    dcp_dir: str | Path,
    model_dir: str | Path,
    into: dict | None = None,
    allow_dtype_mismatch: bool = False,
    allow_unverified: bool = False,
) -> tuple[Path, str, dict]:
    """The model tensors of a DCP checkpoint in memory, checked as ``export_dcp_to_hf`` checks them.

    Returns (checkpoint directory, DCP layout, transformers key -> tensor), tied aliases left out.
    ``into`` (transformers key -> tensor, e.g. a materialized model's state dict) receives the
    values in place, cast to its tensors' dtypes (one copy of the model in memory); without it
    each tensor is allocated on the CPU in the checkpoint's dtype. The checkpoint is verified first
    (``resolve_dcp_checkpoint``; ``allow_unverified`` reads a training checkpoint without its record).
    """
    import torch

    model_dir = require_model_dir(model_dir)
    checkpoint_dir = resolve_dcp_checkpoint(dcp_dir, allow_unverified)
    metadata, _, expected, dcp_layout = _check_model_tensors(checkpoint_dir, model_dir, allow_dtype_mismatch)
    prefix = DCP_MODEL_PREFIX[dcp_layout]
    state = {}
    for key in expected.required:
        md = metadata.state_dict_metadata[prefix + key]
        if into is not None:
            state[prefix + key] = into[key]
        else:
            state[prefix + key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    load_in_process(state, checkpoint_dir)
    return checkpoint_dir, dcp_layout, {k[len(prefix) :]: v for k, v in state.items()}


def export_dcp_to_hf(
    dcp_dir: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
    layout: str = "official",
    progress: ProgressFn | None = None,
    fsync: bool = False,
    direct: bool = True,
    allow_dtype_mismatch: bool = False,
    allow_unverified: bool = False,
    format: str = "hf",
) -> ExportResult:
    """Write the model tensors of the DCP checkpoint ``dcp_dir`` as an HF model directory ``out_dir``.

    ``model_dir`` gives config.json (the model the checkpoint must match), the tokenizer and
    processor files (copied) and the file split of its weights (kept). ``layout`` names the keys:
    ``official`` (mistralai's repository) or ``transformers`` (``save_pretrained``). Tensor values
    and dtypes are kept exactly. ``out_dir`` must not exist; on failure nothing is left behind.
    ``fsync=True`` syncs every file to disk before the directory appears. ``direct=False``
    reads every tensor through DCP's own reader (``torch.load`` of each item) instead of copying
    the bytes of plain items file to file (the result is the same; the direct copy is faster).
    ``format="mistral"`` writes Mistral's native layout instead (``checkpoint.native``): native
    names, the query and key rows in rotary order, ``consolidated*.safetensors`` split at
    ``DEFAULT_MAX_SHARD_BYTES``, params.json and the base's tekken.json (``layout`` is then unused).
    Every model tensor must be floating point; a conversion (fsdp2, megatron layout) must also
    have config.json's ``dtype`` unless ``allow_dtype_mismatch`` (a training checkpoint holds fp32
    master weights and is exported as it is). A training checkpoint is verified against its
    integrity record before anything is read (``resolve_dcp_checkpoint``: from a run's checkpoints/,
    the newest intact one); ``allow_unverified`` reads one that has no record. Files are written
    with the modes the user's umask gives new files (contents are copied, never modes).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if layout not in EXPORT_LAYOUTS:
        raise UserError(f"unknown layout {layout!r}; use one of {list(EXPORT_LAYOUTS)}")
    if format not in EXPORT_FORMATS:
        raise UserError(f"unknown format {format!r}; use one of {list(EXPORT_FORMATS)}")
    native = format == "mistral"
    model_dir = require_model_dir(model_dir)
    out_dir = Path(out_dir)
    refuse_existing(out_dir, "output directory")
    checkpoint_dir = resolve_dcp_checkpoint(dcp_dir, allow_unverified)
    metadata, shapes, expected, dcp_layout = _check_model_tensors(
        checkpoint_dir, model_dir, allow_dtype_mismatch
    )
    prefix = DCP_MODEL_PREFIX[dcp_layout]

    def dcp_md(key: str):
        return metadata.state_dict_metadata[prefix + key]

    config = None
    if native:
        from magistral_cli.model_config import read_model_config

        config = read_model_config(model_dir, what="model directory")
        check_native_base(model_dir, config)
    files, index_metadata = ({}, {}) if native else plan_output_files(model_dir)
    if not files:
        present = [k for k in expected.shapes if prefix + k in shapes and k not in expected.aliases]
        nbytes = {k: dcp_md(k).size.numel() * dcp_md(k).properties.dtype.itemsize for k in present}
        files = _split_by_size(present, nbytes, DEFAULT_MAX_SHARD_BYTES, native=native)
    unknown = sorted({k for keys in files.values() for k in keys if prefix + k not in shapes})
    if unknown:
        raise CheckFailed(
            f"{model_dir / WEIGHT_INDEX} lists {len(unknown)} tensors that the DCP checkpoint lacks, "
            f"e.g. {unknown[:5]}; pass the model directory this checkpoint was converted from"
        )

    listed = {k for keys in files.values() for k in keys}
    left_out = [k for k in expected.required if k not in listed]
    if left_out:
        raise CheckFailed(
            f"{model_dir / WEIGHT_INDEX} does not list {len(left_out)} tensors of the model, e.g. "
            f"{left_out[:5]}; pass the model directory this checkpoint was converted from"
        )

    def out_key(key: str) -> str:
        if native:
            return transformers_to_native_key(key)
        return transformers_to_official_key(key) if layout == "official" else key

    specs = {
        name: [
            TensorSpec(out_key(k), safetensors_dtype(dcp_md(k).properties.dtype), tuple(dcp_md(k).size))
            for k in keys
        ]
        for name, keys in files.items()
    }
    destination = {prefix + k: (name, out_key(k)) for name, keys in files.items() for k in keys}
    total = sum(s.nbytes for file_specs in specs.values() for s in file_specs)
    done = 0
    read_counts = {"direct": 0, "torch_load": 0}
    started = time.perf_counter()

    # With --fsync each file's sync starts in the background as soon as its last tensor is in, while
    # the next file is copied (StreamWriters).
    with staged_directory(out_dir, "output directory") as tmp:
        with StreamWriters(fsync) as group:
            writers = {
                name: group.open(tmp / name, file_specs, metadata={"format": "pt"})
                for name, file_specs in specs.items()
            }
            # Native query and key weights: head_dim of the rows to put in rotary order.
            rotary = (
                {k: rotary_head_dim(key, config) for k, (_, key) in destination.items()} if native else {}
            )

            # Reused for every query and key weight: the bytes read, and the rows in native order.
            scratch = {"read": torch.empty(0, dtype=torch.uint8), "rows": torch.empty(0, dtype=torch.uint8)}

            def reserve(which: str, nbytes: int):
                if scratch[which].numel() < nbytes:
                    scratch[which] = torch.empty(nbytes, dtype=torch.uint8)
                return scratch[which]

            def sink(dcp_key: str, tensor, row_offset: int) -> None:
                nonlocal done
                name, key = destination[dcp_key]
                if rotary.get(dcp_key):
                    rows = reserve("rows", tensor.numel() * tensor.element_size())
                    done += write_rows(writers[name], key, tensor, row_offset, rotary[dcp_key], rows)
                else:
                    done += writers[name].write(key, tensor, row_offset)
                if progress is not None:
                    progress(done, total)

            def sink_range(dcp_key: str, fd: int, offset: int, nbytes: int, row_offset: int) -> None:
                nonlocal done
                name, key = destination[dcp_key]
                if rotary.get(dcp_key):  # rows move: through memory (one block)
                    md = dcp_md(dcp_key[len(prefix) :])
                    block = reserve("read", nbytes)[:nbytes]
                    read_exactly(fd, memoryview(block.numpy()), offset)
                    sink(dcp_key, block.view(md.properties.dtype).view(-1, *tuple(md.size)[1:]), row_offset)
                    return
                done += writers[name].copy_range(key, fd, offset, nbytes, row_offset)
                if progress is not None:
                    progress(done, total)

            # Meta tensors: the planner allocates each real tensor when DCP reaches it. Their order
            # is the order of the output files' bytes: DCP reads in state-dict order within each of
            # its files, so a checkpoint with the source's split is written append-only (writing
            # into holes of a sparse file is several times slower on ext4).
            to_tkey = {out_key(k): k for keys in files.values() for k in keys}
            state = {
                prefix + to_tkey[spec.name]: torch.empty(spec.shape, dtype=spec.torch_dtype(), device="meta")
                for name in files
                for spec in writers[name].layout
            }
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed.*")
                try:
                    dcp.load(
                        state,
                        storage_reader=_make_direct_reader(
                            checkpoint_dir, metadata, sink_range, read_counts, direct
                        ),
                        planner=_make_streaming_planner(sink),
                    )
                except CheckpointException as exc:
                    raise _unwrap(exc, checkpoint_dir) from None
        weight_map = {s.name: name for name, file_specs in specs.items() for s in file_specs}
        if native:
            copied = write_native_files(tmp, model_dir, config, weight_map, total)
        source_index = None if native else read_weight_index(model_dir)
        if source_index is not None:  # keep the source index's key order
            order = [out_key(to_transformers_key_or_raw(k)) for k in source_index[0]]
            weight_map = {k: weight_map[k] for k in order if k in weight_map}
        else:
            weight_map = dict(sorted(weight_map.items()))
        if not native and (len(files) > 1 or source_index is not None):
            index = {"metadata": {**index_metadata, "total_size": total}, "weight_map": weight_map}
            (tmp / WEIGHT_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if not native:
            copied = []
            for path in support_files(model_dir):
                shutil.copyfile(path, tmp / path.name)
                copied.append(path.name)
            if not (model_dir / CONFIG).is_file():  # a native base: its params.json as a config.json
                from magistral_cli.model_config import read_model_config

                read_model_config(model_dir, what="model directory").to_json_file(tmp / CONFIG)
                copied.append(CONFIG)
    return ExportResult(
        out_dir=out_dir,
        checkpoint_dir=checkpoint_dir,
        dcp_layout=dcp_layout,
        layout="mistral" if native else layout,
        files=list(files),
        tensors=len(destination),
        bytes=total,
        seconds=time.perf_counter() - started,
        copied=copied,
        reads=read_counts,
        warnings=[] if native else missing_tokenizer(model_dir, copied),
    )


#: A tokenizer file of the model directory that an HF export carries (Mistral's, or transformers').
TOKENIZER_FILES = (TEKKEN, "tokenizer.json")


def missing_tokenizer(model_dir: Path, copied: list[str]) -> list[str]:
    """A warning when the export carries no tokenizer: transformers and vLLM read it from the model
    directory, so the export cannot be served or used by ``magistral generate`` until one is copied in."""
    if any(name in copied for name in TOKENIZER_FILES):
        return []
    return [
        f"{model_dir} has no tokenizer ({' or '.join(TOKENIZER_FILES)}), so the export has none either: copy "
        "tekken.json in before serving it (`magistral fetch --no-weights` downloads it)"
    ]


def export_hf_to_native(
    model_dir: str | Path,
    out_dir: str | Path,
    progress: ProgressFn | None = None,
    fsync: bool = False,
    replace: Callable[[str, Callable[[], object]], object | None] | None = None,
    checkpoint_dir: Path | None = None,
) -> ExportResult:
    """Write the weights of the HF model directory ``model_dir`` in Mistral's native layout.

    Every model tensor (an untied head included) under its native name, in the source's dtype; the
    bytes of a tensor that stays as it is are copied file to file, the query and key weights go
    through memory (their rows move into rotary order), one tensor at a time. ``replace(key,
    read)`` may give another value for a transformers ``key`` (``read()`` is the source tensor;
    None keeps it): the LoRA merge. The files, params.json and tekken.json are
    ``checkpoint.native``'s. ``out_dir`` must not exist; on failure nothing is left behind.
    """
    from contextlib import ExitStack

    import torch
    from safetensors import safe_open

    from magistral_cli.model_config import read_model_config

    from .keys import native_to_transformers_key
    from .safetensors_io import read_data_offsets

    started = time.perf_counter()
    model_dir = require_model_dir(model_dir)
    out_dir = Path(out_dir)
    refuse_existing(out_dir, "output directory")
    weights = read_hf_weights(model_dir)
    if weights.native:
        raise UserError(
            f"{model_dir} is already in Mistral's native layout; copy it, or export a checkpoint of it"
        )
    config = read_model_config(model_dir, what="model directory")
    check_native_base(model_dir, config)
    expected = model_keys(model_dir)
    source: dict[str, tuple[str, TensorSpec]] = {}
    for name, file_specs in weights.files.items():
        for spec in file_specs:
            source[to_transformers_key_or_raw(spec.name)] = (name, spec)
    report = compare_keys(
        f"HF checkpoint {model_dir}", expected, {k: s.shape for k, (_, s) in source.items()}
    )
    if not report.ok:
        raise CheckFailed(report.message("Check that config.json belongs to these weights."))
    keys = [k for k in expected.shapes if k not in expected.aliases]
    files = _split_by_size(keys, {k: source[k][1].nbytes for k in keys}, DEFAULT_MAX_SHARD_BYTES, native=True)
    total = sum(source[k][1].nbytes for k in keys)
    done = 0
    with staged_directory(out_dir, "output directory") as tmp, ExitStack() as stack:
        opened: dict[str, tuple[object, int, int, dict]] = {}

        def open_source(name: str):
            if name not in opened:
                path = model_dir / name
                fd = os.open(path, os.O_RDONLY)
                stack.callback(os.close, fd)
                start, offsets = read_data_offsets(path)
                opened[name] = (stack.enter_context(safe_open(str(path), framework="pt")), fd, start, offsets)
            return opened[name]

        weight_map: dict[str, str] = {}
        scratch = torch.empty(0, dtype=torch.uint8)  # reused for the query and key rows
        # Each file's sync (--fsync) runs while the next file is filled (StreamWriters).
        with StreamWriters(fsync) as group:
            for out_name, file_keys in files.items():
                specs = [
                    TensorSpec(transformers_to_native_key(k), source[k][1].dtype, source[k][1].shape)
                    for k in file_keys
                ]
                writer = group.open(tmp / out_name, specs, metadata={"format": "pt"})
                for spec in writer.layout:  # the file's byte order: appended, never a hole
                    key = native_to_transformers_key(spec.name)
                    name, src = source[key]
                    shard, fd, start, offsets = open_source(name)
                    tensor = replace(key, lambda s=shard, n=src.name: s.get_tensor(n)) if replace else None
                    head_dim = rotary_head_dim(spec.name, config)
                    if tensor is None and head_dim is None:
                        begin, end = offsets[src.name]
                        done += writer.copy_range(spec.name, fd, start + begin, end - begin)
                    else:
                        tensor = shard.get_tensor(src.name) if tensor is None else tensor
                        if head_dim is None:
                            done += writer.write(spec.name, tensor)
                        else:
                            if scratch.numel() < spec.nbytes:
                                scratch = torch.empty(spec.nbytes, dtype=torch.uint8)
                            done += write_rows(writer, spec.name, tensor, 0, head_dim, scratch)
                    weight_map[spec.name] = out_name
                    if progress is not None:
                        progress(done, total)
        weight_map = {transformers_to_native_key(k): weight_map[transformers_to_native_key(k)] for k in keys}
        copied = write_native_files(tmp, model_dir, config, weight_map, total)
    return ExportResult(
        out_dir=out_dir,
        checkpoint_dir=checkpoint_dir or model_dir,
        dcp_layout="hf",
        layout="mistral",
        files=list(files),
        tensors=len(keys),
        bytes=total,
        seconds=time.perf_counter() - started,
        copied=copied,
    )
