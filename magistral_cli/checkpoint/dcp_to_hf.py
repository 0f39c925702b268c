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

import json
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from magistral_cli.errors import CheckFailed, MagistralError, UserError

from .hf import WEIGHT_INDEX, read_hf_weights, read_weight_index, require_model_dir, support_files
from .keys import DCP_MODEL_PREFIX, to_transformers_key, transformers_to_official_key
from .safetensors_io import SafetensorsStreamWriter, TensorSpec, safetensors_dtype
from .staging import refuse_existing, staged_directory
from .validate import (
    compare_keys,
    dcp_shapes,
    detect_dcp_layout,
    model_keys,
    read_dcp_metadata,
    resolve_dcp_checkpoint,
)

EXPORT_LAYOUTS = ("official", "transformers")
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
        }


def plan_output_files(model_dir: Path) -> tuple[dict[str, list[str]], dict]:
    """Output file -> the transformers keys it holds, and the index metadata to start from.

    The split of ``model_dir``'s weights when it has some (index or single file); otherwise
    ``model-0000i-of-0000N.safetensors`` files of at most ``DEFAULT_MAX_SHARD_BYTES``, in
    state-dict order (tied aliases left out, as ``save_pretrained`` does).
    """
    if read_weight_index(model_dir) is not None or (model_dir / "model.safetensors").is_file():
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


def _split_by_size(keys: list[str], nbytes: dict[str, int], limit: int) -> dict[str, list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        if groups[-1] and size + nbytes[key] > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes[key]
    n = len(groups)
    if n == 1:
        return {"model.safetensors": groups[0]}
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


def _unwrap(exc, checkpoint_dir: Path) -> BaseException:
    """DCP wraps every failure, even Ctrl-C, in a CheckpointException (a BaseException): unwrap it."""
    failures = [failure for failure, _ in exc.failures.values()]
    first = failures[0] if failures else exc
    if isinstance(first, (KeyboardInterrupt, MagistralError, OSError)):
        return first
    return CheckFailed(f"reading the DCP checkpoint {checkpoint_dir} failed: {first!r}")


def export_dcp_to_hf(
    dcp_dir: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
    layout: str = "official",
    progress: ProgressFn | None = None,
    fsync: bool = False,
) -> ExportResult:
    """Write the model tensors of the DCP checkpoint ``dcp_dir`` as an HF model directory ``out_dir``.

    ``model_dir`` gives config.json (the model the checkpoint must match), the tokenizer and
    processor files (copied) and the file split of its weights (kept). ``layout`` names the keys:
    ``official`` (mistralai's repository) or ``transformers`` (``save_pretrained``). Tensor values
    and dtypes are kept exactly. ``out_dir`` must not exist; on failure nothing is left behind.
    ``fsync=True`` syncs every file to disk before the directory appears.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    if layout not in EXPORT_LAYOUTS:
        raise UserError(f"unknown layout {layout!r}; use one of {list(EXPORT_LAYOUTS)}")
    model_dir = require_model_dir(model_dir)
    out_dir = Path(out_dir)
    refuse_existing(out_dir, "output directory")
    checkpoint_dir = resolve_dcp_checkpoint(dcp_dir)
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
    report = compare_keys(f"DCP checkpoint {checkpoint_dir} (layout {dcp_layout})", expected, shapes, prefix)
    if report.wrong_shapes:
        raise CheckFailed(
            report.message("Pass a checkpoint of the model that --model-dir's config.json describes.")
        )

    def dcp_md(key: str):
        return metadata.state_dict_metadata[prefix + key]

    files, index_metadata = plan_output_files(model_dir)
    if not files:
        present = [k for k in expected.shapes if prefix + k in shapes and k not in expected.aliases]
        nbytes = {k: dcp_md(k).size.numel() * dcp_md(k).properties.dtype.itemsize for k in present}
        files = _split_by_size(present, nbytes, DEFAULT_MAX_SHARD_BYTES)
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
    started = time.perf_counter()

    with staged_directory(out_dir, "output directory") as tmp:
        writers = {
            name: SafetensorsStreamWriter(tmp / name, file_specs, metadata={"format": "pt"})
            for name, file_specs in specs.items()
        }
        try:

            def sink(dcp_key: str, tensor, row_offset: int) -> None:
                nonlocal done
                name, key = destination[dcp_key]
                done += writers[name].write(key, tensor, row_offset)
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
                        storage_reader=FileSystemReader(str(checkpoint_dir)),
                        planner=_make_streaming_planner(sink),
                    )
                except CheckpointException as exc:
                    raise _unwrap(exc, checkpoint_dir) from None
            for writer in writers.values():
                writer.close(fsync=fsync)
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        weight_map = {s.name: name for name, file_specs in specs.items() for s in file_specs}
        source_index = read_weight_index(model_dir)
        if source_index is not None:  # keep the source index's key order
            order = [out_key(to_transformers_key_or_raw(k)) for k in source_index[0]]
            weight_map = {k: weight_map[k] for k in order if k in weight_map}
        else:
            weight_map = dict(sorted(weight_map.items()))
        if len(files) > 1 or source_index is not None:
            index = {"metadata": {**index_metadata, "total_size": total}, "weight_map": weight_map}
            (tmp / WEIGHT_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        copied = []
        for path in support_files(model_dir):
            shutil.copy2(path, tmp / path.name)
            copied.append(path.name)
    return ExportResult(
        out_dir=out_dir,
        checkpoint_dir=checkpoint_dir,
        dcp_layout=dcp_layout,
        layout=layout,
        files=list(files),
        tensors=len(destination),
        bytes=total,
        seconds=time.perf_counter() - started,
        copied=copied,
    )
