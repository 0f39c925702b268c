"""Mistral's native layout: ``consolidated.safetensors`` + ``params.json`` + ``tekken.json``.

The layout mistral-inference writes and vLLM serves with ``--tokenizer-mode mistral
--config-format mistral --load-format mistral``. The tensor names are ``keys``'s native table;
``params.json`` is ``model_config``'s (``params_from_config`` / ``config_from_params``). What this
module adds is the one difference in the values and the files:

- **Rotary order.** The native query and key weights (``attention.wq`` / ``attention.wk``, text
  and vision tower) keep each head's rows interleaved, as the complex rotary embedding pairs them
  (rows ``2i`` and ``2i + 1``); transformers' rotary pairs row ``i`` with row ``i + head_dim / 2``.
  transformers' Mistral3 conversion script permutes native -> transformers; ``to_native_rows`` is
  its inverse. It is a permutation of rows inside each head, so a block of rows can be written row
  by row (``native_row``) where it does not hold whole heads.
- **Files** (their names are ``hf``'s, with the other files of a model directory).
  ``consolidated.safetensors``, or ``consolidated-0000i-of-0000N.safetensors`` with
  ``consolidated.safetensors.index.json`` past the shard size; ``params.json`` (the base's own copy
  when it has one, else built from config.json); the base's ``tekken.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from magistral_cli.errors import UserError
from magistral_cli.model_config import PARAMS_FILE, params_from_config

from .hf import NATIVE_INDEX, TEKKEN
from .keys import native_rotary_tower


def rotary_head_dim(native_key: str, config) -> int | None:
    """The head size whose rows ``native_key`` keeps in rotary order, or None for other tensors."""
    tower = native_rotary_tower(native_key)
    if tower is None:
        return None
    if tower == "vision":
        vision = config.vision_config
        return vision.hidden_size // vision.num_attention_heads
    text = config.text_config
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def to_native_rows(tensor, head_dim: int, scratch=None):
    """transformers' row order -> native rotary order, for a tensor of whole heads: row
    ``a * half + b`` of each head goes to row ``2 b + a`` (``a`` in 0, 1; ``half = head_dim / 2``).

    ``scratch`` (a uint8 tensor of at least the tensor's bytes) receives the result instead of
    fresh memory: an exporter reuses one for every query and key weight."""
    cols = tensor.shape[1:]
    moved = tensor.reshape(-1, 2, head_dim // 2, *cols).transpose(1, 2)
    if scratch is None:
        return moved.reshape(tensor.shape).contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    out = scratch[:nbytes].view(tensor.dtype).view(tensor.shape)
    out.view(moved.shape).copy_(moved)
    return out


def from_native_rows(tensor, head_dim: int):
    """The inverse of ``to_native_rows`` (what transformers' conversion script does)."""
    cols = tensor.shape[1:]
    return tensor.reshape(-1, head_dim // 2, 2, *cols).transpose(1, 2).reshape(tensor.shape).contiguous()


def native_row(row: int, head_dim: int) -> int:
    """Where transformers' row ``row`` of a query or key weight sits in the native tensor."""
    head, j = divmod(row, head_dim)
    half = head_dim // 2
    return head * head_dim + 2 * (j % half) + j // half


def write_rows(writer, name: str, tensor, row_offset: int, head_dim: int, scratch=None) -> int:
    """Write a block of transformers' rows of a query or key weight in native order: at once when
    it holds whole heads (through ``scratch``, see ``to_native_rows``), else row by row. Returns
    the byte count written."""
    rows = tensor.shape[0]
    if row_offset % head_dim == 0 and rows % head_dim == 0:
        return writer.write(name, to_native_rows(tensor, head_dim, scratch), row_offset)
    return sum(
        writer.write(name, tensor[i : i + 1], native_row(row_offset + i, head_dim)) for i in range(rows)
    )


def check_native_base(model_dir: Path, config) -> None:
    """Refuse, before anything is written, a base the native layout cannot be made from: a model
    params.json cannot describe, or no tekken.json to ship with the weights."""
    if not (model_dir / PARAMS_FILE).is_file():
        params_from_config(config)  # raises on what the native layout cannot say
    if not (model_dir / TEKKEN).is_file():
        raise UserError(
            f"{model_dir} has no {TEKKEN}: Mistral's native layout is served with its tokenizer; "
            "fetch the model with `magistral fetch` (it downloads tekken.json)"
        )


def native_params(model_dir: Path, config) -> dict:
    """params.json: the base's own when ``model_dir`` has one, else built from its config."""
    path = model_dir / PARAMS_FILE
    if not path.is_file():
        return params_from_config(config)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); download it again") from None


def write_native_files(
    tmp: Path, model_dir: Path, config, weight_map: dict[str, str], total: int
) -> list[str]:
    """Write params.json, the index (when there are several weight files) and the base's tekken.json
    into ``tmp`` (``check_native_base`` has passed); returns their names."""
    (tmp / PARAMS_FILE).write_text(
        json.dumps(native_params(model_dir, config), indent=2) + "\n", encoding="utf-8"
    )
    written = [PARAMS_FILE]
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / NATIVE_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        written.append(NATIVE_INDEX)
    shutil.copyfile(model_dir / TEKKEN, tmp / TEKKEN)
    written.append(TEKKEN)
    return written
