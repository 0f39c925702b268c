"""Check a checkpoint's keys, shapes and dtypes against the model that config.json describes.

The reference is transformers' ``Mistral3ForConditionalGeneration`` built on the meta device
from ``config.json`` (no memory, no weights, ``trust_remote_code=False``). Every key and every
shape must match; the report lists what is missing, unexpected or of the wrong shape.

Dtypes: a model tensor must be floating point, always (an int32 ``lm_head`` passed keys and
shapes, and training from it started at loss ln(vocab)). And it must have config.json's
``dtype`` (legacy ``torch_dtype``) unless the caller allows another floating dtype
(``--allow-dtype-mismatch``), since the conversions keep dtypes exactly and a float16 tensor in
a bfloat16 model is a mixed-up checkpoint more often than an intent. Training checkpoints are
the exception: they hold the fp32 master weights, so only floating point is required of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from magistral_cli.errors import CheckFailed, UserError

from .hf import CONFIG, require_model_dir
from .integrity import fix_for, newest_intact, require_intact, verify_checkpoint
from .keys import DCP_MODEL_PREFIX
from .layout import DCP_METADATA, LATEST, MEGATRON_RELEASE_DIR, checkpoints_dir, latest_name

SHOWN = 5


@dataclass
class ModelKeys:
    """The transformers state-dict keys of the model with their shapes, in state-dict order."""

    shapes: dict[str, tuple[int, ...]]
    #: Keys that alias another key's tensor (tied weights): a checkpoint may leave them out.
    aliases: set[str] = field(default_factory=set)
    #: config.json's ``dtype`` (or legacy ``torch_dtype``) as a torch name ("bfloat16"), or None.
    dtype: str | None = None

    @property
    def required(self) -> list[str]:
        return [k for k in self.shapes if k not in self.aliases]


def model_keys(model_dir: str | Path) -> ModelKeys:
    """Keys and shapes of ``Mistral3ForConditionalGeneration`` for ``model_dir/config.json``."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.model_config import read_model_config, tied_aliases

    model_dir = require_model_dir(model_dir)
    # The tying rule decides whether lm_head.weight is its own tensor (Magistral: it is).
    config = read_model_config(model_dir, what="model directory")
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(config)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict(keep_vars=True).items()}
    return ModelKeys(shapes, tied_aliases(model), config_dtype(model_dir))


def config_dtype(model_dir: Path) -> str | None:
    """config.json's ``dtype`` (transformers >= 4.56) or ``torch_dtype`` (older files), at the top
    level or in ``text_config``; None when absent or not a floating torch dtype name ("auto")."""
    try:
        data = json.loads((Path(model_dir) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # read_model_config has already said what is wrong with the file
    for section in (data, data.get("text_config") or {}):
        value = section.get("dtype") or section.get("torch_dtype")
        if isinstance(value, str):
            name = value.removeprefix("torch.")
            return name if is_floating_dtype(name) else None
    return None


def is_floating_dtype(name: str) -> bool:
    """Whether ``name`` ("bfloat16", "int32") is a floating-point torch dtype."""
    import torch

    dtype = getattr(torch, name, None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass
class KeyReport:
    """The outcome of comparing a checkpoint's keys with the model's."""

    what: str
    expected: int
    found: int
    missing: list[str]
    unexpected: list[str]
    #: (key, expected shape, actual shape)
    wrong_shapes: list[tuple[str, tuple[int, ...], tuple[int, ...] | None]]
    #: (key, expected dtype or "floating point", actual dtype)
    wrong_dtypes: list[tuple[str, str, str]] = field(default_factory=list)
    #: The dtype every model tensor must have, or None when only floating point was required.
    dtype: str | None = None
    #: Whether dtypes were compared at all (False for callers that passed none).
    dtypes_checked: bool = False

    @property
    def keys_ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shapes)

    @property
    def ok(self) -> bool:
        return self.keys_ok and not self.wrong_dtypes

    def message(self, fix: str = "") -> str:
        if self.ok:
            if not self.dtypes_checked:
                return f"{self.what}: all {self.expected} model keys and shapes match config.json"
            dtypes = f"dtype {self.dtype}" if self.dtype else "floating-point dtypes"
            return f"{self.what}: all {self.expected} model keys, shapes and {dtypes} match config.json"
        if self.keys_ok:  # only dtypes are wrong: say so without the empty key lists
            return f"{self.what}: {self._dtype_text()}"
        shapes = [
            f"{k}: expected {list(e)}, got {list(a) if a is not None else 'a non-tensor'}"
            for k, e, a in self.wrong_shapes
        ]
        text = (
            f"{self.what}: model keys do not match config.json: "
            f"missing={len(self.missing)} {self.missing[:SHOWN]}, "
            f"unexpected={len(self.unexpected)} {self.unexpected[:SHOWN]}, "
            f"wrong_shapes={len(self.wrong_shapes)} {shapes[:SHOWN]}"
        )
        if self.wrong_dtypes:
            text += f"; {self._dtype_text()}"
        return f"{text}. {fix}" if fix else text

    def _dtype_text(self) -> str:
        listed = [f"{k}: {a}, expected {e}" for k, e, a in self.wrong_dtypes]
        text = f"wrong_dtypes={len(self.wrong_dtypes)} {listed[:SHOWN]}"
        if any(not is_floating_dtype(a) for _, _, a in self.wrong_dtypes):
            text += "; integer and bool tensors are never model weights, whatever the options"
        if any(is_floating_dtype(a) for _, _, a in self.wrong_dtypes):
            text += (
                f"; convert them to config.json's dtype {self.dtype}, or pass --allow-dtype-mismatch "
                "to accept floating-point tensors of another dtype"
            )
        return text

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "expected_keys": self.expected,
            "found_keys": self.found,
            "missing_count": len(self.missing),
            "missing": self.missing[:SHOWN],
            "unexpected_count": len(self.unexpected),
            "unexpected": self.unexpected[:SHOWN],
            "wrong_shape_count": len(self.wrong_shapes),
            "wrong_shapes": [
                {"key": k, "expected": list(e), "actual": list(a) if a is not None else None}
                for k, e, a in self.wrong_shapes[:SHOWN]
            ],
            "dtype": self.dtype,
            "wrong_dtype_count": len(self.wrong_dtypes),
            "wrong_dtypes": [{"key": k, "expected": e, "actual": a} for k, e, a in self.wrong_dtypes[:SHOWN]],
        }


def compare_keys(
    what: str,
    expected: ModelKeys,
    actual: dict[str, tuple[int, ...] | None],
    prefix: str = "",
    dtypes: dict[str, str | None] | None = None,
    dtype: str | None = None,
) -> KeyReport:
    """Compare ``actual`` (key -> shape, None for a non-tensor) with ``prefix`` + the model keys.

    Keys outside the prefix's top-level entry (``model.`` for ``model.model.``) are not model
    keys (an optimizer, a step counter) and are ignored, as Megatron's loader ignores them; keys
    inside it that are not the model's are reported as unexpected.

    ``dtypes`` (key -> torch dtype name, None for a non-tensor), when given, is checked too: every
    model tensor must be floating point and, when ``dtype`` is given, of that dtype.
    """
    top = prefix.split(".", 1)[0] + "." if prefix else ""
    considered = {k: v for k, v in actual.items() if k.startswith(top)}
    want = {prefix + k: s for k, s in expected.shapes.items()}
    optional = {prefix + k for k in expected.aliases}
    missing = [k for k in want if k not in considered and k not in optional]
    unexpected = sorted(k for k in considered if k not in want)
    wrong = [(k, want[k], considered[k]) for k in want if k in considered and considered[k] != want[k]]
    wrong_dtypes = []
    for k in want if dtypes is not None else ():
        got = dtypes.get(k)
        if got is None:  # absent, or a non-tensor (reported as a wrong shape)
            continue
        if not is_floating_dtype(got) or (dtype is not None and got != dtype):
            wrong_dtypes.append((k, dtype or "floating point", got))
    return KeyReport(
        what,
        len(want) - len(optional),
        len(considered),
        missing,
        unexpected,
        wrong,
        wrong_dtypes,
        dtype,
        dtypes is not None,
    )


def resolve_dcp_checkpoint(dcp_dir: str | Path, allow_unverified: bool = False) -> Path:
    """The verified checkpoint directory (the one holding the DCP ``.metadata``) that ``dcp_dir`` names.

    Accepts the checkpoint directory itself, a megatron-layout conversion (``<dir>/release``), a
    directory of training checkpoints (a run's ``checkpoints/``) and a run directory: from those
    the newest intact ``step_<N>``, as resume takes it (``latest`` is a hint, warned about when it
    disagrees). Every one passes ``integrity.verify_checkpoint`` (``CheckFailed`` naming the damaged
    file otherwise); ``allow_unverified`` reads a training checkpoint that has no integrity record.
    """
    path = Path(dcp_dir)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise UserError(f"DCP directory {path} {what}")
    if (path / DCP_METADATA).is_file():
        return require_intact(path, allow_unverified)
    if (path / MEGATRON_RELEASE_DIR / DCP_METADATA).is_file():
        return require_intact(path / MEGATRON_RELEASE_DIR, allow_unverified)
    save_dir = checkpoints_dir(path)
    if save_dir is not None:
        return newest_intact(save_dir, allow_unverified, what=str(save_dir))
    name, problem = latest_name(path)
    if (path / LATEST).exists() and (problem or name is not None):
        raise UserError(
            f"{path}: {problem or f'latest names {name}, which holds no complete DCP checkpoint ({DCP_METADATA})'}"
        )
    raise UserError(
        f"{path} holds no DCP checkpoint: no {DCP_METADATA} there, in {MEGATRON_RELEASE_DIR}/, "
        "or in a step_N directory"
    )


def read_dcp_metadata(checkpoint_dir: Path, check_files: bool = True):
    """The DCP ``Metadata`` of a checkpoint directory, read by the restricted unpickler of
    ``safe_dcp`` (a planted ``.metadata`` is refused before it can run anything); ``CheckFailed``
    when a data file it names is missing or too short, unless ``check_files=False``."""
    from .safe_dcp import read_metadata

    return read_metadata(checkpoint_dir, check_files=check_files)


def dcp_shapes(metadata) -> dict[str, tuple[int, ...] | None]:
    """Flattened DCP key -> tensor shape (None for non-tensor entries)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def dcp_dtypes(metadata) -> dict[str, str | None]:
    """Flattened DCP key -> torch dtype name (None for non-tensor entries)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: dtype_name(md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def required_dtype(expected: ModelKeys, layout: str, allow_dtype_mismatch: bool) -> str | None:
    """The dtype a checkpoint in ``layout`` must have: config.json's, except for training
    checkpoints (fp32 master weights) and when the caller allows another floating dtype."""
    if layout == "engine" or allow_dtype_mismatch:
        return None
    return expected.dtype


def dcp_checkpoint_dir(dcp_dir: str | Path, layout: str) -> Path:
    """Where a ``layout`` conversion keeps its DCP files: ``release/`` for megatron, else the dir."""
    path = Path(dcp_dir)
    if layout == "megatron" and (path / MEGATRON_RELEASE_DIR).is_dir():
        return path / MEGATRON_RELEASE_DIR
    if not (path / DCP_METADATA).is_file() and (path / MEGATRON_RELEASE_DIR / DCP_METADATA).is_file():
        return path / MEGATRON_RELEASE_DIR  # a megatron conversion checked as another layout: report its keys
    if not (path / DCP_METADATA).is_file():
        if layout == "megatron":
            raise UserError(f"{path} has no {MEGATRON_RELEASE_DIR}/ with a DCP checkpoint ({DCP_METADATA})")
        raise UserError(f"{path} holds no DCP checkpoint ({DCP_METADATA} is missing)")
    return path


def detect_dcp_layout(expected: ModelKeys, shapes: dict[str, tuple[int, ...] | None]) -> str | None:
    """The DCP layout whose model keys are all present in ``shapes``, or None."""
    best = None
    for layout in ("megatron", "engine", "fsdp2"):  # longest prefix first
        prefix = DCP_MODEL_PREFIX[layout]
        if all(prefix + k in shapes for k in expected.required):
            best = layout
            break
    return best


@dataclass
class DCPValidation:
    """The result of ``validate_dcp``."""

    layout: str
    checkpoint_dir: Path
    report: KeyReport
    #: When the keys do not match ``layout``: the layout they do match, if any.
    matching_layout: str | None = None
    #: The files that do not hold what was saved: missing or short data files, and for a training
    #: checkpoint every difference from its integrity record (``integrity.verify_checkpoint``).
    file_problems: list[str] = field(default_factory=list)
    #: A training checkpoint without an integrity record, checked as asked (``allow_unverified``).
    unverified: bool = False
    #: What to do about damaged files.
    file_fix: str = ""

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.file_problems

    def message(self) -> str:
        if self.file_problems:
            text = f"DCP checkpoint {self.checkpoint_dir}: failed the check of its files: " + "; ".join(
                self.file_problems[:SHOWN]
            )
            return f"{text}. {self.file_fix}" if self.report.ok else f"{text}. {self._keys_message()}"
        return self._keys_message()

    def _keys_message(self) -> str:
        fix = f"Convert the weights with `magistral convert hf-to-dcp --layout {self.layout}`"
        if self.layout == "engine":
            fix = "Pass a checkpoint that training wrote for this config.json"
        if self.matching_layout:
            fix = (
                f"These keys are those of the {self.matching_layout} layout: pass --layout "
                f"{self.matching_layout} to check it as one, or, for the {self.layout} layout, "
                f"{fix[0].lower()}{fix[1:]}"
            )
        return self.report.message(fix + "." if not self.report.keys_ok else "")

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "checkpoint_dir": str(self.checkpoint_dir),
            **self.report.to_dict(),
            "ok": self.ok,
            "matching_layout": self.matching_layout,
            "file_problem_count": len(self.file_problems),
            "file_problems": self.file_problems[:SHOWN],
            "unverified": self.unverified,
        }


def validate_dcp(
    model_dir: str | Path,
    dcp_dir: str | Path,
    layout: str,
    expected: ModelKeys | None = None,
    allow_dtype_mismatch: bool = False,
    allow_unverified: bool = False,
) -> DCPValidation:
    """Compare the model keys, shapes and dtypes of the DCP checkpoint ``dcp_dir`` (written in
    ``layout``) with config.json, and its files with what was saved.

    ``layout`` is fsdp2, megatron (read from ``dcp_dir/release``) or engine (a training checkpoint:
    floating point required, not config.json's dtype). ``allow_dtype_mismatch`` accepts floating
    tensors of another dtype than config.json's; integer and bool tensors fail regardless.
    The files: every data file ``.metadata`` names must exist and reach the end of its last item;
    a training checkpoint is verified against its integrity record (every byte is read), and
    without one it fails unless ``allow_unverified``.
    Returns the validation; ``require_valid`` turns a mismatch into ``CheckFailed``.
    """
    if layout not in DCP_MODEL_PREFIX:
        raise UserError(f"unknown DCP layout {layout!r}; use one of {sorted(DCP_MODEL_PREFIX)}")
    expected = expected or model_keys(model_dir)
    checkpoint_dir = dcp_checkpoint_dir(dcp_dir, layout)
    metadata = read_dcp_metadata(checkpoint_dir, check_files=False)  # reported below, not raised
    integrity = verify_checkpoint(checkpoint_dir, allow_unverified=allow_unverified)
    shapes = dcp_shapes(metadata)
    what = f"DCP checkpoint {checkpoint_dir} (layout {layout})"
    report = compare_keys(
        what,
        expected,
        shapes,
        DCP_MODEL_PREFIX[layout],
        dtypes=dcp_dtypes(metadata),
        dtype=required_dtype(expected, layout, allow_dtype_mismatch),
    )
    other = None if report.ok else detect_dcp_layout(expected, shapes)
    return DCPValidation(
        layout,
        checkpoint_dir,
        report,
        other if other != layout else None,
        file_problems=integrity.problems,
        unverified=integrity.unverified,
        file_fix=fix_for(integrity) if integrity.problems else "",
    )


def require_valid(validation: DCPValidation) -> DCPValidation:
    """Raise ``CheckFailed`` with the key report unless ``validation`` passed."""
    if not validation.ok:
        raise CheckFailed(validation.message())
    return validation
