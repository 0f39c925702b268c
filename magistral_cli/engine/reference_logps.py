"""Precomputed reference log-probabilities (``training.dpo.precompute_ref``).

Before the first step the reference (a frozen copy in the policy's FSDP2 layout, or the LoRA
policy with its adapters off) scores every pair of the cache entry once, under ``no_grad``, in
micro-batches of ``training.micro_batch_size`` pairs split over the data-parallel ranks as training
splits them (``data.loader.build_all_pairs_batches``). The result is each sample's summed answer
log-probability (fp32), indexed by the sample's place in the cache entry (pair k: samples 2k, 2k + 1),
all-reduced so every rank holds it, and written by rank 0, atomically, beside the cache entry::

    <cache_dir>/magistral-<entry>.ref-logps-<identity[:16]>.safetensors

The identity (``reference_identity``: the entry's fingerprint and file digests, the reference's
kind and weights, the model's config and the compute dtype) is in the name and, whole, in the file's
metadata. A later run (a resume, or another run over the same data and reference) reads the file
instead of computing; a file that does not match (another identity, wrong size, not finite,
unreadable) is never used: the pass runs again and the log says why. The reference model is then
freed, and training holds none (``PreferenceStep.stored``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from magistral_cli.data.cache import FILES_KEY
from magistral_cli.data.collator import SAMPLE_INDEX
from magistral_cli.errors import UserError
from magistral_cli.ops.chunked_loss import IGNORE_INDEX
from magistral_cli.run_record import write_text_atomic
from magistral_cli.runtime import host_to_device
from magistral_cli.runtime.device import device_module

from .batch import check_micro_batch
from .preference import adapters_off, model_inputs, reference_model_kind, reference_source
from .validate import evaluating

log = logging.getLogger("magistral_cli.engine")

#: Bump when what the stored file means changes: older files then stop matching.
STORE_FORMAT = 1
TENSOR = "logps"


def _stamp(path: str | Path) -> list[list]:
    """What identifies the weights at ``path`` without reading them: every file under it (hidden
    ones left out) with its size and modification time. Rewritten weights make another stamp."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        return [[path.name, st.st_size, st.st_mtime_ns]]
    out = []
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(path)
        if file.is_file() and not any(part.startswith(".") for part in rel.parts):
            st = file.stat()
            out.append([str(rel), st.st_size, st.st_mtime_ns])
    return out


def reference_identity(recipe, dataset) -> dict:
    """What the stored log-probabilities depend on: the cache entry (fingerprint and file digests),
    the reference (its kind, its weights' path and stamp; a LoRA base is the starting weights),
    the model's config.json and the compute dtype."""
    kind = reference_model_kind(recipe)
    weights = reference_source(recipe) if kind == "model" else recipe.training.load
    config = Path(recipe.model.model_name_or_path) / "config.json"
    identity = {
        "format": STORE_FORMAT,
        "cache_entry": dataset.fingerprint,
        "cache_files": dataset.meta.get(FILES_KEY),
        "samples": len(dataset),
        "reference": kind,
        "weights": str(Path(weights).resolve()) if weights else None,
        "weights_stamp": _stamp(weights) if weights else None,
        "model_config": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "dtype": recipe.parallel.fsdp_plan.param_dtype or "fp32",
    }
    if not weights:  # an initialised (not loaded) base: its seed is its identity
        identity["seed"] = recipe.training.seed
    return identity


def _digest(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()


def store_path(dataset, identity: dict) -> Path:
    """The stored file of ``identity``, beside the cache entry ``dataset.path``."""
    return dataset.path.parent / f"{dataset.path.name}.ref-logps-{_digest(identity)[:16]}.safetensors"


def read_stored(path: Path, identity: dict) -> tuple[torch.Tensor | None, str | None]:
    """(the stored sums, None), or (None, why not: no file, or what is wrong with it)."""
    from safetensors import safe_open

    if not path.is_file():
        others = sorted(p.name for p in path.parent.glob(f"{path.name.split('.ref-logps-')[0]}.ref-logps-*"))
        why = "none stored for this reference"
        if others:
            why += f" (stored for another reference, dtype or entry: {', '.join(others)})"
        return None, why
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = json.loads((f.metadata() or {}).get("identity", "null"))
            values = f.get_tensor(TENSOR)
    except Exception as exc:
        return None, f"{path} is unreadable ({type(exc).__name__}: {exc})"
    if stored != identity:
        changed = sorted(
            k for k in identity.keys() | (stored or {}).keys() if (stored or {}).get(k) != identity.get(k)
        )
        return None, f"{path} is stale: it was computed for another {', '.join(changed)}"
    if values.dtype != torch.float32 or tuple(values.shape) != (identity["samples"],):
        return None, f"{path} holds {tuple(values.shape)} {values.dtype}, not {identity['samples']} fp32 sums"
    if not bool(torch.isfinite(values).all()):
        return None, f"{path} holds non-finite values"
    return values, None


def write_stored(path: Path, values: torch.Tensor, identity: dict) -> None:
    """``values`` with ``identity`` into ``path``, atomically (``run_record.write_text_atomic``)."""
    from safetensors.torch import save

    data = save({TENSOR: values.contiguous()}, metadata={"identity": json.dumps(identity, sort_keys=True)})
    write_text_atomic(path, data)


def stored_reference_logps(trainer) -> torch.Tensor:
    """The reference's summed answer log-probabilities of every sample of the trainer's cache entry
    (host fp32): read from the stored file when it matches, else computed by the pass and stored."""
    dataset = getattr(getattr(trainer.data, "dataset", None), "encoded", None)
    if dataset is None:
        raise UserError(
            "training.dpo.precompute_ref needs the preprocessed cache entry of a pair dataset; set "
            "training.dpo.precompute_ref: false"
        )
    identity = reference_identity(trainer.recipe, dataset)
    path = store_path(dataset, identity)
    values, why = read_stored(path, identity)
    # Every rank must take the same branch (the pass is collective): any rank without the file computes.
    found = torch.tensor([0 if values is None else 1], dtype=torch.int64)
    found = host_to_device(found, trainer.device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if int(found.item()):
        log.info("reference log-probabilities: read from %s (no reference model while training)", path)
        return values
    if trainer.rank == 0:
        log.warning(
            "reference log-probabilities: computing them before training: %s",
            why or "another rank lacks the file",
        )
    values = compute_reference_logps(trainer, dataset)
    if trainer.rank == 0:
        try:
            write_stored(path, values, identity)
            log.info("reference log-probabilities: stored in %s", path)
        except OSError as exc:
            log.warning("reference log-probabilities: not stored (%s); this run uses them from memory", exc)
    return values


def compute_reference_logps(trainer, dataset) -> torch.Tensor:
    """The pass: every pair once under ``no_grad``, this rank's share; all-reduced over dp."""
    from magistral_cli.data.loader import build_all_pairs_batches

    batches = build_all_pairs_batches(
        trainer.recipe, dataset, dp_rank=trainer.dp_rank, dp_size=trainer.dims.dp
    )
    reference = trainer._build_reference() if reference_model_kind(trainer.recipe) == "model" else None
    if reference is not None:
        trainer.skip_blank_vision_forward(reference)
    model = reference if reference is not None else trainer.model
    values = torch.zeros(len(dataset), dtype=torch.float32)
    seen = torch.zeros(len(dataset), dtype=torch.float32)
    log.info(
        "reference log-probabilities: %d pairs in %d micro-batches per rank", dataset.num_units, len(batches)
    )
    started, every = time.monotonic(), max(1, len(batches) // 10)
    with (
        evaluating(model, trainer.device_type),
        adapters_off(model) if reference is None else contextlib.nullcontext(),
    ):
        for done, mb in enumerate(batches, 1):
            check_micro_batch(mb, trainer.model_config, context_parallel=False)
            logps = model(**model_inputs(mb, trainer.device), sequence_logps=True)
            if trainer.rank == 0 and done % every == 0:
                log.info("reference log-probabilities: %d of %d micro-batches", done, len(batches))
            if not bool((mb["labels"] != IGNORE_INDEX).any()):
                continue  # a filler: the forward ran for FSDP's collectives
            index = mb[SAMPLE_INDEX]
            values[index] = logps.float().cpu()
            seen[index] += 1
    del model, reference
    gc.collect()
    module = device_module(trainer.device_type)
    if module is not None:
        module.empty_cache()
    both = host_to_device(torch.stack([values, seen]), trainer.device)
    dist.all_reduce(both, group=trainer.dp_group)
    values, seen = both.cpu()
    log.info("reference log-probabilities: computed in %.1f s", time.monotonic() - started)
    if not bool((seen == 1).all()):
        raise RuntimeError(
            f"the reference pass scored {int((seen == 1).sum())} of {len(dataset)} samples exactly once"
        )
    return values
