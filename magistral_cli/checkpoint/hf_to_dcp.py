"""HF safetensors shards -> a torch.distributed.checkpoint (DCP) directory, one shard at a time.

How the DCP is written: DCP's own save protocol, run in one process with each source shard in
the role of one rank. Every shard's save plan is made up front from the safetensors headers
(meta tensors, no data), ``DefaultSavePlanner.create_global_plan`` merges them into the
checkpoint's metadata, and ``FileSystemWriter.prepare_global_plan`` gives shard *i* the file
``__i_0.distcp``. Then each shard is opened in turn and its tensors written with
``FileSystemWriter.write_data``; ``finish`` writes ``.metadata``. The result is an ordinary DCP
checkpoint (``dcp.load(state, checkpoint_id=dir)`` reads it, on any number of ranks), while only
one shard is ever open.

Why FileSystemWriter and not DCP's Hugging Face storage classes (torch 2.13
``torch.distributed.checkpoint.HuggingFaceStorageWriter/Reader``): the writer produces safetensors
files that ``dcp.load`` reads only through ``HuggingFaceStorageReader``, while the training engine,
Megatron's loader and the seed's tests read DCP directories with the default ``FileSystemReader``;
and the reader copies every tensor into a state dict allocated by the caller, which for a whole
shard doubles its memory. Shards are instead opened with ``safetensors.safe_open``, whose tensors
are zero-copy views of the memory-mapped file, so the DCP writer serializes them straight from
the page cache.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from magistral_cli.errors import CheckFailed, UserError

from .hf import HFWeights, read_hf_weights, require_model_dir
from .keys import CONVERSION_LAYOUTS, MEGATRON_PREFIX
from .layout import MEGATRON_RELEASE_DIR, MEGATRON_TRACKER
from .safetensors_io import TensorSpec
from .staging import refuse_existing, staged_directory
from .validate import (
    ModelKeys,
    compare_keys,
    dtype_name,
    model_keys,
    require_valid,
    required_dtype,
    validate_dcp,
)

#: Megatron's ``checkpoint_version`` entry (MindSpeed-MM's DCP conversions store 3.0).
MEGATRON_CHECKPOINT_VERSION = 3.0

#: progress(done_bytes, total_bytes)
ProgressFn = Callable[[int, int], None]


@dataclass
class ConversionResult:
    """What ``convert_hf_to_dcp`` wrote."""

    layout: str
    dcp_dir: Path
    checkpoint_dir: Path
    tensors: int
    bytes: int
    source_files: int
    seconds: float
    validated_keys: int

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "dcp_dir": str(self.dcp_dir),
            "checkpoint_dir": str(self.checkpoint_dir),
            "tensors": self.tensors,
            "bytes": self.bytes,
            "source_files": self.source_files,
            "seconds": round(self.seconds, 3),
            "throughput_mib_s": round(self.bytes / 2**20 / self.seconds, 1) if self.seconds > 0 else None,
            "validated_keys": self.validated_keys,
        }


def _source_keys(weights: HFWeights) -> dict[str, dict[str, str]]:
    """file -> {source key: transformers key}; unknown keys keep their name (validation reports them)."""
    out: dict[str, dict[str, str]] = {}
    seen: dict[str, str] = {}
    for name, specs in weights.files.items():
        out[name] = {}
        for spec in specs:
            try:
                key = weights.transformers_key(spec.name)
            except KeyError:
                key = spec.name
            if key in seen:
                raise CheckFailed(
                    f"{weights.directory}: {spec.name!r} in {name} and {seen[key]!r} are the same "
                    f"model key {key!r}; the directory mixes two checkpoints"
                )
            seen[key] = f"{spec.name} ({name})"
            out[name][spec.name] = key
    return out


def _native_reader(model_dir: Path):
    """``read(shard, name)`` for Mistral's native layout: the tensor, with the query and key rows
    back in transformers' order (a copy of those tensors; the others stay views of the file)."""
    from magistral_cli.model_config import read_model_config

    from .native import from_native_rows, rotary_head_dim

    config = read_model_config(model_dir, what="model directory")

    def read(shard, name: str):
        tensor = shard.get_tensor(name)
        head_dim = rotary_head_dim(name, config)
        return tensor if head_dim is None else from_native_rows(tensor, head_dim)

    return read


def _state(layout: str, tensors: dict[str, object], first: bool) -> dict:
    """The state dict DCP saves for one shard: the layout's nesting around transformers keys."""
    if layout == "fsdp2":
        return dict(tensors)
    state: dict = {"model": {MEGATRON_PREFIX + k: v for k, v in tensors.items()}}
    if first:
        state["checkpoint_version"] = MEGATRON_CHECKPOINT_VERSION
    return state


class _CountingSavePlanner:
    """Factory of DefaultSavePlanners that report each tensor as the writer takes it."""

    @staticmethod
    def make(on_tensor: Callable[[int], None] | None):
        from torch.distributed.checkpoint import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            def resolve_data(self, write_item):
                data = super().resolve_data(write_item)
                if on_tensor is not None and write_item.tensor_data is not None:
                    on_tensor(data.numel() * data.element_size())
                return data

        return Planner()


@contextmanager
def _without_record_crc32() -> Iterator[None]:
    """Skip the CRC32 that ``torch.save`` computes for every record of a DCP file, and restore it.

    ``torch.load`` (and so ``dcp.load``) never checks it (a flipped byte loads silently), and it
    costs about as much CPU time as the rest of the write.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:  # an older torch without the switch
        yield
        return
    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def convert_hf_to_dcp(
    model_dir: str | Path,
    dcp_dir: str | Path,
    layout: str = "fsdp2",
    progress: ProgressFn | None = None,
    fsync: bool = False,
    allow_dtype_mismatch: bool = False,
) -> ConversionResult:
    """Convert the HF checkpoint in ``model_dir`` into a new DCP directory ``dcp_dir``.

    ``layout="fsdp2"``: the DCP keys are transformers' ``Mistral3ForConditionalGeneration`` keys
    at the root. ``layout="megatron"``: ``{"model": {"model." + key: ...}, "checkpoint_version"}``
    (flattened keys ``model.model.<key>``) under ``dcp_dir/release`` plus Megatron's tracker file.
    Source keys may be official or transformers keys, or ``model_dir`` may be in Mistral's native
    layout (``consolidated.safetensors`` + ``params.json``; config.json, when present, still
    decides; the query and key rows are put back in transformers' order). Values and dtypes are
    kept exactly. The keys, shapes and dtypes are validated against config.json before and after
    writing: every tensor floating point and of config.json's ``dtype``, unless
    ``allow_dtype_mismatch`` accepts other floating dtypes (integer and bool tensors are refused regardless). ``dcp_dir`` must not
    exist; on any failure nothing is left behind. ``fsync=True`` syncs every file to disk before
    the directory appears (durable across a power loss; slower where the disk is slower than memory).
    """
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemWriter

    if layout not in CONVERSION_LAYOUTS:
        raise UserError(f"unknown layout {layout!r}; use one of {list(CONVERSION_LAYOUTS)}")
    model_dir = require_model_dir(model_dir)
    dcp_dir = Path(dcp_dir)
    refuse_existing(dcp_dir, "DCP directory")
    weights = read_hf_weights(model_dir)
    expected: ModelKeys = model_keys(model_dir)
    keymap = _source_keys(weights)

    # Check the source before writing gigabytes: the same report the DCP gets afterwards.
    specs_by_key: dict[str, TensorSpec] = {
        keymap[name][s.name]: s for name, specs in weights.files.items() for s in specs
    }
    source_report = compare_keys(
        f"HF checkpoint {model_dir}",
        expected,
        {k: s.shape for k, s in specs_by_key.items()},
        dtypes={k: dtype_name(s.torch_dtype()) for k, s in specs_by_key.items()},
        dtype=required_dtype(expected, layout, allow_dtype_mismatch),
    )
    if not source_report.ok:
        raise CheckFailed(source_report.message("Check that config.json belongs to these weights."))

    total = weights.total_bytes
    done = 0
    started = time.perf_counter()
    read = _native_reader(model_dir) if weights.native else lambda f, name: f.get_tensor(name)

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    with (
        staged_directory(dcp_dir, "DCP directory") as tmp,
        warnings.catch_warnings(),
        _without_record_crc32(),
    ):
        # DCP warns that it runs without a process group: that is the intent here.
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        checkpoint_dir = tmp / MEGATRON_RELEASE_DIR if layout == "megatron" else tmp
        writer = FileSystemWriter(
            str(checkpoint_dir), single_file_per_rank=True, sync_files=fsync, overwrite=False
        )
        files = list(weights.files)

        # 1. Plan every shard from its header (meta tensors), then merge the plans.
        local_plans = []
        for i, name in enumerate(files):
            meta = {
                keymap[name][s.name]: torch.empty(s.shape, dtype=s.torch_dtype(), device="meta")
                for s in weights.files[name]
            }
            planner = _CountingSavePlanner.make(None)
            planner.set_up_planner(_state(layout, meta, i == 0), writer.storage_meta(), is_coordinator=i == 0)
            writer.set_up_storage_writer(i == 0, rank=i, use_collectives=True)
            local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
        global_plans, metadata = planner.create_global_plan(local_plans)
        global_plans = writer.prepare_global_plan(global_plans)

        # 2. Write each shard from its memory map, then close it before opening the next.
        results = []
        for i, name in enumerate(files):
            try:
                shard = safe_open(str(model_dir / name), framework="pt")
            except Exception as exc:  # safetensors' SafetensorError: say which file, not a Rust message
                raise CheckFailed(f"{model_dir / name} cannot be read ({exc}); fetch it again") from None
            with shard as f:
                tensors = {keymap[name][s.name]: read(f, s.name) for s in weights.files[name]}
                planner = _CountingSavePlanner.make(advance)
                planner.set_up_planner(
                    _state(layout, tensors, i == 0), writer.storage_meta(), is_coordinator=i == 0
                )
                future = writer.write_data(planner.finish_plan(global_plans[i]), planner)
                future.wait()
                results.append(future.value())
                del tensors, planner, future  # drop the views before the map closes
        writer.finish(metadata, results)
        if layout == "megatron":
            (tmp / MEGATRON_TRACKER).write_text(MEGATRON_RELEASE_DIR + "\n", encoding="utf-8")

        validation = require_valid(validate_dcp(model_dir, tmp, layout, expected, allow_dtype_mismatch))
    return ConversionResult(
        layout=layout,
        dcp_dir=dcp_dir,
        checkpoint_dir=dcp_dir / validation.checkpoint_dir.relative_to(tmp),
        tensors=len(specs_by_key),
        bytes=total,
        source_files=len(files),
        seconds=time.perf_counter() - started,
        validated_keys=validation.report.expected,
    )


__all__ = ["MEGATRON_TRACKER", "ConversionResult", "convert_hf_to_dcp"]
