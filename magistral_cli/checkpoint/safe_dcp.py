"""Reading DCP checkpoints without running code that a checkpoint file brings along.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``: a
planted file runs whatever it names (``os.system``, ``builtins.exec``) before anything looks at
what came out. And ``DefaultLoadPlanner.load_bytes`` unpickles every non-tensor entry (a
``BytesStorageMetadata`` item of a ``.distcp`` file) with ``torch.load(weights_only=False)``; a
metadata file may declare any key such an entry, so a checkpoint can reach that call too.

``SafeFileSystemReader`` is ``FileSystemReader`` with both closed:

- ``.metadata`` is read by ``MetadataUnpickler``, which admits only the classes and callables
  that DCP's metadata is made of (``ADMITTED``, taken from the pickles of real checkpoints: the
  fsdp2 and megatron conversions, one- and two-process FSDP2 training checkpoints, ``dcp.save``
  of a state dict with a non-tensor entry). Anything else stops the read at that reference,
  before any object is built, with a ``UserError`` naming the file and the reference. The result
  must then be a ``Metadata`` whose entries have DCP's types and whose data files lie inside the
  checkpoint directory.
- a non-tensor entry is first read with ``torch.load(weights_only=True)``; what that admits is
  saved again with ``torch.save`` and only that copy is handed to the planner, so the planner's
  ``weights_only=False`` load sees nothing but what ``weights_only`` allowed.

Before anything is read, every data file the metadata names must exist and reach the end of its
last item (``storage_problems``): a missing or truncated ``.distcp`` is named in one
``CheckFailed`` instead of failing somewhere inside DCP's read.

Tensor items are read as torch reads them (``torch.load(weights_only=True)``). Everything else
(``storage_data``, ``load_id``, ``rank`` metadata files, transforms) is FileSystemReader's own.
Every DCP read in magistral goes through ``SafeFileSystemReader`` or ``read_metadata``.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from magistral_cli.errors import CheckFailed, UserError

from .layout import DCP_METADATA

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

#: (module, name) -> why a DCP ``.metadata`` pickle may reference it. Every entry either is a
#: dataclass of DCP's metadata (built by ``NEWOBJ`` + ``BUILD``: no code of the file's choosing)
#: or a constructor / lookup that only builds a plain value from plain arguments.
ADMITTED: dict[tuple[str, str], str] = {
    (_DCP_METADATA, "Metadata"): "the file's root object",
    (_DCP_METADATA, "TensorStorageMetadata"): "a tensor entry: properties, size, chunks",
    (_DCP_METADATA, "BytesStorageMetadata"): "a non-tensor entry (e.g. megatron's checkpoint_version)",
    (_DCP_METADATA, "ChunkStorageMetadata"): "one saved chunk of a tensor (offsets, sizes)",
    (_DCP_METADATA, "TensorProperties"): "a tensor's dtype, layout, memory format",
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): "the enum TensorProperties stores its memory format as",
    (_DCP_METADATA, "MetadataIndex"): "the keys of storage_data",
    (_DCP_METADATA, "StorageMeta"): "checkpoint_id, save_id, load_id, modules",
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "where an item lies in a .distcp file",
    ("torch.serialization", "_get_layout"): "torch.layout's reducer: a lookup of torch's layouts by name",
    ("torch", "Size"): "tensor and chunk sizes",
    ("pathlib", "PosixPath"): "StorageMeta.checkpoint_id (the save path, a Path even when a str was given)",
    ("pathlib", "PurePosixPath"): "StorageMeta.checkpoint_id",
    ("pathlib._local", "PosixPath"): "StorageMeta.checkpoint_id (Python 3.13 names pathlib's module so)",
    ("pathlib._local", "PurePosixPath"): "StorageMeta.checkpoint_id",
    ("collections", "OrderedDict"): "a mapping older DCP versions and planners may store",
    ("builtins", "set"): "pickle protocols below 4 rebuild sets by calling set",
    ("builtins", "frozenset"): "pickle protocols below 4 rebuild frozensets by calling frozenset",
}
#: Besides ``ADMITTED``: ``torch.<name>`` when it is a dtype, layout or memory format (a constant
#: pickled by name, e.g. ``torch.bfloat16``, ``torch.strided``, ``torch.contiguous_format``).
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.reference = f"{module}.{name}"


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``ADMITTED`` globals and torch's dtype/layout constants.

    ``find_class`` is the only way a pickle reaches a Python object by name (``GLOBAL``,
    ``STACK_GLOBAL``, ``INST``, ``OBJ`` and the ``EXT`` codes all go through it), so refusing here
    stops a planted file before it can call anything. Persistent ids are refused as well.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise _Refused(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def _check_structure(metadata: Any, path: Path) -> None:
    """Refuse a pickle of admitted pieces that is still not DCP metadata (wrong root or entries)."""

    def refuse(what: str) -> UserError:
        return UserError(f"{path} is not DCP metadata: {what}; it was not used")

    if not isinstance(metadata, Metadata):
        raise refuse(f"it holds a {type(metadata).__name__}, not a Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise refuse("state_dict_metadata is not a dict")
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise refuse(f"entry {key!r} is a {type(entry).__name__}")
    storage = metadata.storage_data
    if storage is not None:
        if not isinstance(storage, dict):
            raise refuse("storage_data is not a dict")
        for index, info in storage.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
                raise refuse(f"storage_data holds a {type(info).__name__} for {index!r}")
            # The data files are the checkpoint's own: a path out of its directory would read any file.
            rel = info.relative_path
            if not isinstance(rel, str) or PurePath(rel).is_absolute() or ".." in PurePath(rel).parts:
                raise refuse(f"{index.fqn!r} names the data file {rel!r}, outside the checkpoint directory")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise refuse(f"storage_meta is a {type(storage_meta).__name__}")


def load_metadata_file(stream: Any, path: Path) -> Metadata:
    """Unpickle one DCP metadata stream with ``MetadataUnpickler``; one ``UserError`` naming ``path``."""
    try:
        metadata = MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise UserError(
            f"{path} is refused: its pickle references {exc.reference}, which DCP metadata never holds "
            "(a .metadata file runs what it references when unpickled); nothing of it was loaded. "
            "Use a checkpoint that `magistral convert` or training wrote, from a source you trust"
        ) from None
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise UserError(f"{path} is not readable DCP metadata ({exc!r})") from None
    _check_structure(metadata, path)
    return metadata


class _SafeBytesPlanner:
    """The caller's load planner, except that ``load_bytes`` gets a ``weights_only``-checked copy.

    Every load planner (DefaultLoadPlanner and ours) unpickles a non-tensor item with
    ``torch.load(weights_only=False)``; this wrapper reads the item with ``weights_only=True``
    first and passes on a fresh ``torch.save`` of the result, so nothing else reaches it.
    """

    def __init__(self, planner: Any, reader: SafeFileSystemReader):
        self._planner = planner
        self._reader = reader

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        info = self._reader.storage_data[read_item.storage_index]
        where = Path(str(self._reader.path)) / info.relative_path
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UserError(
                f"{where} holds a non-tensor entry {read_item.dest_index.fqn!r} that "
                f"torch.load(weights_only=True) refuses ({exc}); it was not loaded"
            ) from None
        checked = io.BytesIO()
        torch.save(obj, checked)
        checked.seek(0)
        self._planner.load_bytes(read_item, checked)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata and non-tensor reads run no code from the checkpoint, and
    which reads nothing from a checkpoint whose data files cannot hold what its metadata says
    (``check_files=False`` leaves that to the caller, as ``convert validate`` reports it)."""

    def __init__(self, path: Any, *args: Any, check_files: bool = True, **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self.check_files = check_files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # FileSystemReader.read_metadata (torch 2.13) with pickle.load replaced: same file
        # (``__<rank>.metadata`` when DCP asks for one rank's), same storage_meta / load_id handling.
        path = Path(str(self._get_metadata_path(kwargs.get("rank"))))
        try:
            with self.fs.create_stream(path, "rb") as metadata_file:
                metadata = load_metadata_file(metadata_file, path)
        except OSError as exc:
            raise UserError(f"{path} cannot be read ({exc.strerror or exc})") from None
        if self.check_files:
            problems = storage_problems(Path(str(self.path)), metadata)
            if problems:
                raise CheckFailed(
                    f"{Path(str(self.path))} is damaged: "
                    + "; ".join(problems[:5])
                    + "; nothing was read from it. "
                    "Use an intact copy of the checkpoint (convert it again, or take another checkpoints/step_N)"
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            planner = _SafeBytesPlanner(planner, self)
        return super().read_data(plan, planner)


def storage_problems(checkpoint_dir: Path, metadata: Any) -> list[str]:
    """What keeps the data files of a DCP from holding what its ``.metadata`` places in them:
    a file that is missing, or shorter than the end of its last item. Empty when they can."""
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    problems = []
    for name, end in sorted(ends.items()):
        path = Path(checkpoint_dir) / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing ({DCP_METADATA} places {end} bytes of tensors in it)")
            continue
        if size < end:
            problems.append(
                f"{path} has {size} bytes, but {DCP_METADATA} places data up to byte {end} (truncated)"
            )
    return problems


def read_metadata(path: str | os.PathLike, check_files: bool = True) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint directory ``path``, read with ``MetadataUnpickler``
    (and its data files checked against it unless ``check_files=False``)."""
    return SafeFileSystemReader(str(path), check_files=check_files).read_metadata()


__all__ = [
    "ADMITTED",
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "load_metadata_file",
    "read_metadata",
    "storage_problems",
]
