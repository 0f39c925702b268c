"""What a Hugging Face model directory holds: its weight files, their keys, and the other files.

A model directory has ``config.json`` and either ``model.safetensors.index.json`` with its
shards (the official repository's layout) or a single ``model.safetensors``; or it is in Mistral's
native layout (``params.json`` and ``consolidated.safetensors``, or its shards with
``consolidated.safetensors.index.json``: ``native``), whose names and rotary order
``HFWeights.transformers_key`` and ``native.from_native_rows`` translate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from magistral_cli.errors import UserError

from .keys import native_to_transformers_key, to_transformers_key
from .safetensors_io import TensorSpec, read_safetensors_header

WEIGHT_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
CONFIG = "config.json"
#: Mistral's native layout (``checkpoint.native``): its weights, their index past one file, its tokenizer.
NATIVE_WEIGHTS = "consolidated.safetensors"
NATIVE_INDEX = "consolidated.safetensors.index.json"
TEKKEN = "tekken.json"


def native_shard_name(i: int, n: int) -> str:
    """The ``i``-th (0-based) of ``n`` native weight files."""
    return NATIVE_WEIGHTS if n == 1 else f"consolidated-{i + 1:05d}-of-{n:05d}.safetensors"


def is_native_dir(path: Path) -> bool:
    """Whether ``path`` holds Mistral's native weights (``params.json`` and ``consolidated*.safetensors``)
    and no transformers weights (a repository with both is read in its transformers layout)."""
    from magistral_cli.model_config import PARAMS_FILE

    if (path / WEIGHT_INDEX).is_file() or (path / SINGLE_WEIGHTS).is_file():
        return False
    return (path / PARAMS_FILE).is_file() and (
        (path / NATIVE_INDEX).is_file() or (path / NATIVE_WEIGHTS).is_file()
    )


# Files of a model directory that dcp-to-hf does not copy next to the exported weights: the
# weights themselves (written anew), other weight formats that would disagree with them
# (Mistral's consolidated.safetensors + params.json), and the fetch manifest, whose SHA-256
# sums describe the original files.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_NOT_COPIED_NAMES = {WEIGHT_INDEX, "pytorch_model.bin.index.json", "params.json", "magistral-manifest.json"}


@dataclass
class HFWeights:
    """The weight files of a model directory, in order, with each file's tensors."""

    directory: Path
    #: file name -> its tensors in file order (source keys: official or transformers).
    files: dict[str, list[TensorSpec]]
    #: ``metadata`` of model.safetensors.index.json (empty for a single file).
    index_metadata: dict = field(default_factory=dict)
    #: Mistral's native layout (consolidated.safetensors): native names, q/k rows in rotary order.
    native: bool = False

    def transformers_key(self, key: str) -> str:
        """The transformers key of a source key (``KeyError`` for a key of no known layout)."""
        return native_to_transformers_key(key) if self.native else to_transformers_key(key)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for specs in self.files.values() for s in specs)


def require_model_dir(model_dir: str | Path) -> Path:
    """``model_dir`` as a Path, after checking it is a directory with config.json."""
    from magistral_cli.model_config import PARAMS_FILE

    path = Path(model_dir)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise UserError(f"model directory {path} {what}; pass the directory `magistral fetch` wrote")
    if not (path / CONFIG).is_file() and not (path / PARAMS_FILE).is_file():
        raise UserError(
            f"{path} has neither {CONFIG} nor Mistral's {PARAMS_FILE}; pass a model directory (`magistral fetch`)"
        )
    return path


def read_weight_index(model_dir: Path, name: str = WEIGHT_INDEX) -> tuple[dict[str, str], dict] | None:
    """(weight_map, metadata) of model.safetensors.index.json (or the index ``name``), or None without one."""
    index_path = model_dir / name
    if not index_path.is_file():
        return None
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{index_path} is not a valid safetensors index ({exc!r}); fetch it again") from None
    for name in set(weight_map.values()):
        if Path(name).name != name:
            raise UserError(f"{index_path} names {name!r}, which is not a file of {model_dir}")
    return weight_map, dict(index.get("metadata") or {})


def read_hf_weights(model_dir: str | Path) -> HFWeights:
    """The shards of ``model_dir`` and their tensors (headers only: no tensor data is read)."""
    model_dir = require_model_dir(model_dir)
    native = is_native_dir(model_dir)
    index_name, single = (NATIVE_INDEX, NATIVE_WEIGHTS) if native else (WEIGHT_INDEX, SINGLE_WEIGHTS)
    index = read_weight_index(model_dir, index_name)
    if index is None:
        if not (model_dir / single).is_file():
            raise UserError(
                f"{model_dir} has neither {WEIGHT_INDEX} nor {SINGLE_WEIGHTS} (nor Mistral's {NATIVE_WEIGHTS}); "
                "download the weights with `magistral fetch` (without --no-weights)"
            )
        specs, _ = read_safetensors_header(model_dir / single)
        return HFWeights(model_dir, {single: specs}, native=native)
    weight_map, metadata = index
    files: dict[str, list[TensorSpec]] = {}
    for name in sorted(set(weight_map.values())):
        if not (model_dir / name).is_file():
            raise UserError(f"{model_dir / name} is listed in {index_name} but missing; fetch it again")
        specs, _ = read_safetensors_header(model_dir / name)
        listed = {k for k, v in weight_map.items() if v == name}
        present = {s.name for s in specs}
        if listed - present:
            missing = sorted(listed - present)
            raise UserError(
                f"{model_dir / name} lacks {len(missing)} tensors that {index_name} assigns to it, "
                f"e.g. {missing[:5]}; fetch it again"
            )
        # A file may hold tensors the index does not list; the index decides, as in transformers.
        files[name] = [s for s in specs if s.name in listed]
    return HFWeights(model_dir, files, metadata, native=native)


def support_files(model_dir: Path) -> list[Path]:
    """The files dcp-to-hf copies from the model directory: config, tokenizer, processor, templates."""
    out = []
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.name in _NOT_COPIED_NAMES or path.name.endswith(_NOT_COPIED_SUFFIXES):
            continue
        if path.name.startswith("consolidated"):
            continue
        out.append(path)
    return out
