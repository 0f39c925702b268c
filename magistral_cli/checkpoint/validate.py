"""Check a checkpoint's keys and shapes against the model that config.json describes.

The reference is transformers' ``Mistral3ForConditionalGeneration`` built on the meta device
from ``config.json`` (no memory, no weights, ``trust_remote_code=False``). Every key and every
shape must match; the report lists what is missing, unexpected or of the wrong shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from magistral_cli.errors import CheckFailed, UserError

from .hf import require_model_dir
from .keys import DCP_MODEL_PREFIX, MEGATRON_RELEASE_DIR

DCP_METADATA = ".metadata"
SHOWN = 5


@dataclass
class ModelKeys:
    """The transformers state-dict keys of the model with their shapes, in state-dict order."""

    shapes: dict[str, tuple[int, ...]]
    #: Keys that alias another key's tensor (tied weights): a checkpoint may leave them out.
    aliases: set[str] = field(default_factory=set)

    @property
    def required(self) -> list[str]:
        return [k for k in self.shapes if k not in self.aliases]


def model_keys(model_dir: str | Path) -> ModelKeys:
    """Keys and shapes of ``Mistral3ForConditionalGeneration`` for ``model_dir/config.json``."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.model_config import read_model_config

    model_dir = require_model_dir(model_dir)
    # The tying rule decides whether lm_head.weight is its own tensor (Magistral: it is).
    config = read_model_config(model_dir, what="model directory")
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(config)
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: set[str] = set()
    seen: dict[int, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        shapes[key] = tuple(value.shape)
        if id(value) in seen:
            aliases.add(key)
        else:
            seen[id(value)] = key
    return ModelKeys(shapes, aliases)


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

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shapes)

    def message(self, fix: str = "") -> str:
        if self.ok:
            return f"{self.what}: all {self.expected} model keys and shapes match config.json"
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
        return f"{text}. {fix}" if fix else text

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
        }


def compare_keys(
    what: str, expected: ModelKeys, actual: dict[str, tuple[int, ...] | None], prefix: str = ""
) -> KeyReport:
    """Compare ``actual`` (key -> shape, None for a non-tensor) with ``prefix`` + the model keys.

    Keys outside the prefix's top-level entry (``model.`` for ``model.model.``) are not model
    keys (an optimizer, a step counter) and are ignored, as Megatron's loader ignores them; keys
    inside it that are not the model's are reported as unexpected.
    """
    top = prefix.split(".", 1)[0] + "." if prefix else ""
    considered = {k: v for k, v in actual.items() if k.startswith(top)}
    want = {prefix + k: s for k, s in expected.shapes.items()}
    optional = {prefix + k for k in expected.aliases}
    missing = [k for k in want if k not in considered and k not in optional]
    unexpected = sorted(k for k in considered if k not in want)
    wrong = [(k, want[k], considered[k]) for k in want if k in considered and considered[k] != want[k]]
    return KeyReport(what, len(want) - len(optional), len(considered), missing, unexpected, wrong)


def resolve_dcp_checkpoint(dcp_dir: str | Path) -> Path:
    """The directory that holds the DCP ``.metadata`` for ``dcp_dir``.

    Accepts the checkpoint directory itself, a megatron-layout conversion (``<dir>/release``),
    and a run's ``checkpoints/`` directory with its ``latest`` file.
    """
    path = Path(dcp_dir)
    if not path.is_dir():
        raise UserError(f"DCP directory {path} does not exist")
    if (path / DCP_METADATA).is_file():
        return path
    if (path / MEGATRON_RELEASE_DIR / DCP_METADATA).is_file():
        return path / MEGATRON_RELEASE_DIR
    latest = path / "latest"
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        target = (path / name) if name else path
        if (target / DCP_METADATA).is_file():
            return target
        raise UserError(f"{latest} names {name!r}, which holds no complete DCP checkpoint ({DCP_METADATA})")
    raise UserError(
        f"{path} holds no DCP checkpoint: no {DCP_METADATA} there, in {MEGATRON_RELEASE_DIR}/, "
        "or behind a `latest` file"
    )


def read_dcp_metadata(checkpoint_dir: Path):
    """The DCP ``Metadata`` of a checkpoint directory."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise UserError(f"{checkpoint_dir / DCP_METADATA} is not readable DCP metadata ({exc!r})") from None


def dcp_shapes(metadata) -> dict[str, tuple[int, ...] | None]:
    """Flattened DCP key -> tensor shape (None for non-tensor entries)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


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

    @property
    def ok(self) -> bool:
        return self.report.ok

    def message(self) -> str:
        fix = f"Convert the weights with `magistral convert hf-to-dcp --layout {self.layout}`"
        if self.layout == "engine":
            fix = "Pass a checkpoint that training wrote for this config.json"
        if self.matching_layout:
            fix = f"These keys are those of the {self.matching_layout} layout. {fix}"
        return self.report.message(fix + "." if not self.report.ok else "")

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "checkpoint_dir": str(self.checkpoint_dir),
            **self.report.to_dict(),
            "matching_layout": self.matching_layout,
        }


def validate_dcp(
    model_dir: str | Path, dcp_dir: str | Path, layout: str, expected: ModelKeys | None = None
) -> DCPValidation:
    """Compare the model keys of the DCP checkpoint ``dcp_dir`` (written in ``layout``) with config.json.

    ``layout`` is fsdp2, megatron (read from ``dcp_dir/release``) or engine (a training checkpoint).
    Returns the validation; ``require_valid`` turns a mismatch into ``CheckFailed``.
    """
    if layout not in DCP_MODEL_PREFIX:
        raise UserError(f"unknown DCP layout {layout!r}; use one of {sorted(DCP_MODEL_PREFIX)}")
    expected = expected or model_keys(model_dir)
    checkpoint_dir = dcp_checkpoint_dir(dcp_dir, layout)
    shapes = dcp_shapes(read_dcp_metadata(checkpoint_dir))
    what = f"DCP checkpoint {checkpoint_dir} (layout {layout})"
    report = compare_keys(what, expected, shapes, DCP_MODEL_PREFIX[layout])
    other = None if report.ok else detect_dcp_layout(expected, shapes)
    return DCPValidation(layout, checkpoint_dir, report, other if other != layout else None)


def require_valid(validation: DCPValidation) -> DCPValidation:
    """Raise ``CheckFailed`` with the key report unless ``validation`` passed."""
    if not validation.ok:
        raise CheckFailed(validation.message())
    return validation
