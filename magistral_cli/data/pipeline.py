"""Preprocessing: read the dataset, encode it over worker processes, commit a cache entry.

``run_preprocess`` is what ``magistral preprocess`` and the trainer's ``prepare_dataset``
call. It is idempotent: the same inputs find the existing cache entry (a lock file makes
concurrent callers, such as the ranks of one node, wait for the first one instead of
encoding the same data again).

Progress is reported through a ``progress(done_rows, total_rows)`` callback, as checkpoint
conversion reports bytes; the CLI passes a rich progress bar (DESIGN.md, "Layers").
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from magistral_cli.assets.hashing import sha256_file
from magistral_cli.errors import UserError
from magistral_cli.model_config import read_config_json

from . import cache as cache_mod
from .encoder import ENCODER_REVISION, EncodedPair, EncodedSample, EncodeParams, Encoder
from .pixtral import ImageSettings, load_image_settings
from .readers import Drop, RecordFormat, RowSource, read_rows
from .report import SampleNotes, build_report
from .tokenizer import (
    TekkenTokenizer,
    check_against_model_config,
    load_tokenizer,
    tokenizer_files,
)


@dataclass
class PreprocessPlan:
    """Everything resolved from the recipe before any row is encoded."""

    model_dir: Path
    dataset: Path
    dataset_dir: Path
    cache_dir: Path
    tokenizer_options: tuple  # (source, fix_mistral_regex, split_special_tokens)
    settings: ImageSettings
    params: EncodeParams
    fmt: RecordFormat
    workers: int
    batch_size: int
    max_samples: int | None
    overwrite: bool
    fingerprint_parts: dict = field(default_factory=dict)
    fingerprint: str = ""
    _tokenizer: TekkenTokenizer | None = None

    @property
    def tokenizer(self) -> TekkenTokenizer:
        """The checked tokenizer, built on first use (a cache hit never needs it)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir, *self.tokenizer_options)
            config_path = self.model_dir / "config.json"
            if config_path.is_file():
                config = read_config_json(config_path)
                check_against_model_config(self._tokenizer.special, config, config_path)
        return self._tokenizer

    @property
    def entry(self) -> Path:
        return cache_mod.entry_dir(self.cache_dir, self.fingerprint)


@dataclass
class PreprocessResult:
    dataset: cache_mod.EncodedDataset
    report: dict
    reused: bool


def _resolve_paths(recipe) -> tuple[Path, Path, Path, Path]:
    dp = recipe.data.dataset_param
    basic = dp.basic_parameters
    model_dir = dp.preprocess_parameters.model_name_or_path or recipe.model.model_name_or_path
    if not model_dir:
        raise UserError(
            "no model directory for the tokenizer: set data.dataset_param.preprocess_parameters.model_name_or_path "
            "(or model.model_name_or_path)"
        )
    if not basic.dataset:
        raise UserError(
            "no dataset: set data.dataset_param.basic_parameters.dataset to a LLaVA/ShareGPT JSON(L) file"
        )
    dataset = Path(basic.dataset).expanduser()
    if not dataset.is_file() and basic.dataset_dir and (Path(basic.dataset_dir) / basic.dataset).is_file():
        dataset = Path(basic.dataset_dir) / basic.dataset
    if not dataset.is_file():
        raise UserError(f"dataset not found: {dataset} (data.dataset_param.basic_parameters.dataset)")
    dataset_dir = Path(basic.dataset_dir).expanduser() if basic.dataset_dir else dataset.parent
    if not dataset_dir.is_dir():
        raise UserError(
            f"dataset_dir not found: {dataset_dir} (data.dataset_param.basic_parameters.dataset_dir)"
        )
    return (
        Path(model_dir).expanduser(),
        dataset.resolve(),
        dataset_dir.resolve(),
        Path(basic.cache_dir).expanduser(),
    )


def plan_preprocess(recipe, *, overwrite: bool | None = None) -> PreprocessPlan:
    """Resolve paths and processor settings, identify the tokenizer, compute the fingerprint.

    Cheap (file hashes, no tokenizer build), so that a cache hit costs well under a second.
    """
    dp = recipe.data.dataset_param
    pre, basic = dp.preprocess_parameters, dp.basic_parameters
    if dp.is_synthetic:  # the schema allows huggingface and synthetic; synthetic data has no file to encode
        raise UserError(
            "dataset_type 'synthetic' has no dataset to preprocess; use 'huggingface' (LLaVA/ShareGPT JSON)"
        )
    model_dir, dataset, dataset_dir, cache_dir = _resolve_paths(recipe)
    tokenizer_options = (pre.tokenizer_source, pre.fix_mistral_regex, pre.split_special_tokens)
    _, _, tokenizer_ids = tokenizer_files(model_dir, *tokenizer_options)
    config_path = model_dir / "config.json"
    model_files: dict[str, str] = {}
    if config_path.is_file():
        model_files["config.json"] = sha256_file(config_path)[0]
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (model_dir / name).is_file():
            model_files[name] = sha256_file(model_dir / name)[0]
    settings = load_image_settings(model_dir, pre.image_min_pixels, pre.image_max_pixels, pre.image_grid)
    params = EncodeParams.from_recipe(recipe, dataset_dir)
    pairs = recipe.training.stage == "dpo"
    fmt = RecordFormat.from_attr(dp.attr, pairs=pairs)
    plan = PreprocessPlan(
        model_dir=model_dir,
        dataset=dataset,
        dataset_dir=dataset_dir,
        cache_dir=cache_dir,
        tokenizer_options=tokenizer_options,
        settings=settings,
        params=params,
        fmt=fmt,
        workers=basic.preprocessing_num_workers or 1,
        batch_size=basic.preprocessing_batch_size,
        max_samples=basic.max_samples,
        overwrite=basic.overwrite_cache if overwrite is None else overwrite,
    )
    plan.fingerprint_parts = {
        "dataset_sha256": sha256_file(dataset)[0],
        "tokenizer": tokenizer_ids,
        "model_files": model_files,
        "image_settings": settings.fingerprint_fields(),
        "encode": params.__dict__,
        "encoder_revision": ENCODER_REVISION,
        "template": basic.template,
        "format": fmt.fingerprint_fields(),
        "max_samples": basic.max_samples,
    }
    if pairs:  # absent for sft, so that SFT entries keep their fingerprints
        plan.fingerprint_parts["stage"] = recipe.training.stage
    plan.fingerprint = cache_mod.fingerprint(plan.fingerprint_parts)
    return plan


# ----------------------------------------------------------------------------- worker side

_WORKER: dict = {}


def _init_worker(tokenizer_str: str, tokenizer_meta: dict, settings, params, fmt) -> None:
    import tokenizers

    backend = tokenizers.Tokenizer.from_str(tokenizer_str)
    backend.encode_special_tokens = tokenizer_meta["split_special_tokens"]
    tok = TekkenTokenizer(
        backend,
        tokenizer_meta["special"],
        tokenizer_meta["source"],
        tokenizer_meta["files"],
        tokenizer_meta["split_special_tokens"],
        tokenizer_meta["version"],
    )
    _WORKER["encoder"] = Encoder(tok, settings, params, fmt)


def _encode_chunk(rows: list[RowSource]) -> list[EncodedSample | EncodedPair | tuple[int, Drop]]:
    results = _WORKER["encoder"].encode_rows(rows)
    return [(row.index, r) if isinstance(r, Drop) else r for row, r in zip(rows, results, strict=True)]


def _chunks(rows: list[RowSource], size: int) -> list[list[RowSource]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _encode_all(plan: PreprocessPlan, rows: list[RowSource], progress: Callable[[int], None]):
    """Yield per-chunk results in dataset order, over ``plan.workers`` processes."""
    tok = plan.tokenizer
    meta = {
        "special": tok.special,
        "source": tok.source,
        "split_special_tokens": tok.split_special_tokens,
        "version": tok.version,
        "files": tok.files,
    }
    init_args = (tok.to_str(), meta, plan.settings, plan.params, plan.fmt)
    workers = max(1, min(plan.workers, len(rows) // 64 or 1))
    # Small chunks keep the workers balanced and the progress bar moving; larger ones amortize IPC.
    chunk = max(16, min(plan.batch_size, -(-len(rows) // (workers * 8))))
    if workers == 1:
        _init_worker(*init_args)
        for part in _chunks(rows, chunk):
            yield _encode_chunk(part)
            progress(len(part))
        return
    # spawn: the parent may hold tokenizer threads, which a fork would copy in a broken state.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        for part_result in pool.imap(_encode_chunk, _chunks(rows, chunk)):
            yield part_result
            progress(len(part_result))


@contextlib.contextmanager
def _entry_lock(plan: PreprocessPlan):
    plan.cache_dir.mkdir(parents=True, exist_ok=True)
    lock_path = plan.cache_dir / f".{plan.entry.name}.lock"
    with open(lock_path, "w") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock (Windows, some network filesystems): rename stays atomic
            pass
        yield


#: progress(done_rows, total_rows), called once before the first row is encoded (done 0) and
#: after every encoded chunk; never called on a cache hit.
ProgressFn = Callable[[int, int], None]


def run_preprocess(
    recipe,
    *,
    progress: ProgressFn | None = None,
    overwrite: bool | None = None,
    strict: bool = False,
    plan: PreprocessPlan | None = None,
) -> PreprocessResult:
    """Encode the recipe's dataset into the cache, or reuse the entry with the same fingerprint.

    ``progress(done_rows, total_rows)`` is told how far the encoding is (see ``ProgressFn``).
    """
    plan = plan or plan_preprocess(recipe, overwrite=overwrite)
    with _entry_lock(plan):
        # A damaged entry is not reusable (cache.open_reusable warns): it is encoded again below.
        if not plan.overwrite and (dataset := cache_mod.open_reusable(plan.entry)) is not None:
            if strict and dataset.meta.get("dropped"):
                _raise_strict(dataset.drops())
            return PreprocessResult(dataset, dataset.report, reused=True)
        plan.tokenizer  # noqa: B018 -- build and check it before reading any row: fail fast
        started = time.perf_counter()
        rows = read_rows(plan.dataset, plan.max_samples)
        writer = cache_mod.CacheWriter()
        notes = SampleNotes(
            split_special_tokens=plan.tokenizer.split_special_tokens,
            train_on_reasoning=plan.params.train_on_reasoning,
        )
        for part in _encode_all(plan, rows, _counter(progress, len(rows))):
            for item in part:
                if isinstance(item, EncodedSample):
                    writer.add(item)
                    notes.add(item)
                elif isinstance(item, EncodedPair):
                    writer.add_pair(item)
                    notes.add(item.chosen)
                    notes.add(item.rejected)
                else:
                    index, drop = item
                    writer.drop(index, drop.reason, drop.detail)
        if strict and writer.drops:
            _raise_strict(writer.drops)
        if not len(writer):
            raise UserError(_nothing_kept(plan, writer.drops))
        seconds = time.perf_counter() - started
        report = build_report(
            writer,
            rows=len(rows),
            seconds=seconds,
            cutoff_len=plan.params.cutoff_len,
            workers=plan.workers,
            notes=notes,
        )
        meta = {
            "format_version": cache_mod.FORMAT_VERSION,
            "fingerprint": plan.fingerprint,
            "inputs": plan.fingerprint_parts,
            "dataset": str(plan.dataset),
            "model_dir": str(plan.model_dir),
            "image_settings": asdict(plan.settings),
            "special_ids": asdict(plan.tokenizer.special),
            "pad_token_id": plan.tokenizer.special.pad,
            "num_samples": len(writer),
            "num_tokens": report["tokens"],
            "dropped": len(writer.drops),
            **({"pairs": True, "num_pairs": writer.pairs} if plan.fmt.pair_columns else {}),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        writer.commit(plan.entry, meta, report)
        return PreprocessResult(cache_mod.EncodedDataset(plan.entry), report, reused=False)


def find_cached_dataset(recipe) -> cache_mod.EncodedDataset | None:
    """The recipe's cache entry if it exists, else None; never encodes anything.

    As cheap as ``plan_preprocess`` (file hashes, no tokenizer build), whose UserError it raises
    for unusable inputs (a missing dataset or tokenizer file, an unsupported template).
    """
    plan = plan_preprocess(recipe)
    return cache_mod.open_reusable(plan.entry)  # None for a damaged entry too (with a warning)


def _nothing_kept(plan, drops: list[dict]) -> str:
    """Why no row of the dataset could be kept, and what to do: the first row's reason, and the
    stage's record layout when every row looks like the other stage's."""
    pairs = plan.fmt.pair_columns is not None
    unit = "pair" if pairs else "sample"
    first = drops[0]
    message = (
        f"no {unit} of {plan.dataset} could be kept ({len(drops)} dropped, first: row {first['index']}: "
        f"{first['reason']}: {first['detail']})"
    )
    reasons = {d["reason"] for d in drops}
    if pairs and reasons <= {"missing_chosen", "missing_rejected"}:
        return message + (
            "; the rows hold no chosen / rejected answers: preference training (training.stage: dpo) reads "
            "pairs (attr.chosen, attr.rejected), SFT conversations train with training.stage: sft"
        )
    if not pairs and reasons <= {"missing_assistant"}:
        return message + (
            "; the rows hold no assistant answer: preference pairs (chosen / rejected) train with "
            "training.stage: dpo"
        )
    return message + "; fix the rows, or point data.dataset_param.basic_parameters.dataset at the right file"


def _raise_strict(drops: list[dict]) -> None:
    first = drops[0]
    raise UserError(
        f"--strict: {len(drops)} row(s) would be dropped; first: row {first['index']} ({first['reason']}): "
        f"{first['detail']}; fix those rows, or run without --strict to drop them (the report counts them)"
    )


def _counter(progress: ProgressFn | None, total: int) -> Callable[[int], None]:
    """``advance(rows)`` for ``_encode_all``: adds up the rows and tells ``progress`` the sum."""
    if progress is None:
        return lambda n: None
    done = 0
    progress(0, total)

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    return advance


def image_settings_of(dataset: cache_mod.EncodedDataset) -> ImageSettings:
    """The processor settings a cache entry was encoded with (for the loader's workers)."""
    s = dict(dataset.meta["image_settings"])
    s["image_mean"], s["image_std"] = tuple(s["image_mean"]), tuple(s["image_std"])
    return ImageSettings(**s)
