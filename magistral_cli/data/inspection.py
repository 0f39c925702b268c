"""Looking at encoded samples: decoded with special tokens visible and trained spans marked,
and exported as JSON Lines for other tools."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cache import EncodedDataset
from .encoder import IGNORE_INDEX
from .tokenizer import TekkenTokenizer

#: Marks around trained (label) spans in plain text.
TRAIN_OPEN, TRAIN_CLOSE = "\u27e6", "\u27e7"


@dataclass
class Span:
    text: str
    trained: bool


def _image_summary(ids: np.ndarray, start: int, special) -> tuple[str, int]:
    """Text for the image block starting at ``start`` and the index after it."""
    end = start
    while end < len(ids) and ids[end] != special.img_end:
        end += 1
    block = ids[start : end + 1]
    rows = int((block == special.img_break).sum()) + 1
    cols = int((block == special.img).sum()) // rows
    return f"[IMG]x{cols}[IMG_BREAK] x{rows - 1} ... [IMG_END] ({rows}x{cols} tokens)", end + 1


def sample_spans(input_ids: np.ndarray, labels: np.ndarray, tokenizer: TekkenTokenizer) -> list[Span]:
    """The sample as runs of text, each trained or not; image blocks are summarized."""
    special = tokenizer.special
    ids = np.asarray(input_ids)
    trained = np.asarray(labels) != IGNORE_INDEX
    spans: list[Span] = []
    run: list[int] = []
    run_trained = None

    def flush():
        nonlocal run
        if run:
            spans.append(Span(tokenizer.decode(run), bool(run_trained)))
            run = []

    i = 0
    while i < len(ids):
        if ids[i] in (special.img, special.img_break):
            flush()
            text, after = _image_summary(ids, i, special)
            spans.append(Span(text, bool(trained[i:after].any())))
            i = after
            continue
        if run_trained is not None and trained[i] != run_trained:
            flush()
        run_trained = trained[i]
        run.append(int(ids[i]))
        i += 1
    flush()
    return spans


def plain_text(spans: list[Span]) -> str:
    return "".join(f"{TRAIN_OPEN}{s.text}{TRAIN_CLOSE}" if s.trained else s.text for s in spans)


def rich_text(spans: list[Span]):
    from rich.text import Text

    text = Text()
    for span in spans:
        text.append(span.text, style="bold green" if span.trained else "dim")
    return text


def _side(dataset: EncodedDataset, i: int) -> dict:
    """``{"side": "chosen" | "rejected"}`` for sample ``i`` of a pair entry (2k chosen, 2k + 1 rejected)."""
    return {"side": ("chosen", "rejected")[i % 2]} if dataset.pairs else {}


def inspect_samples(dataset: EncodedDataset, tokenizer: TekkenTokenizer, count: int) -> list[dict]:
    """The first ``count`` samples: source row, length, images and spans (and, of a pair entry, the
    side: the first two samples are row one's chosen and rejected sequences)."""
    out = []
    for i in range(min(count, len(dataset))):
        sample = dataset[i]
        out.append(
            {
                "index": sample.source_index,
                **_side(dataset, i),
                "tokens": len(sample.input_ids),
                "label_tokens": int((sample.labels != IGNORE_INDEX).sum()),
                "images": sample.images,
                "image_sizes": sample.image_sizes.tolist(),
                "spans": sample_spans(sample.input_ids, sample.labels, tokenizer),
            }
        )
    return out


def export_jsonl(dataset: EncodedDataset, path: str | Path) -> int:
    """Write every kept sample as one JSON object per line (a pair entry's with its ``side``);
    returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as handle:
        for i in range(len(dataset)):
            sample = dataset[i]
            record = {
                "index": sample.source_index,
                **_side(dataset, i),
                "input_ids": sample.input_ids.tolist(),
                "labels": sample.labels.tolist(),
                "image_sizes": sample.image_sizes.tolist(),
                "images": sample.images,
            }
            handle.write(json.dumps(record) + "\n")
    tmp.replace(path)
    return len(dataset)
