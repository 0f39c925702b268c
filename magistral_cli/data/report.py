"""The preprocessing report: kept, dropped by reason, lengths (percentiles and a histogram), images
(and how many came from outside dataset_dir), control-token strings in the data text, the samples
with reasoning, speed, and the split."""

from __future__ import annotations

from collections import Counter

import numpy as np

from .packing import length_histogram
from .readers import DROP_REASONS

#: Dropped rows listed per reason in the report (the full list is drops.jsonl).
EXAMPLES_PER_REASON = 5
#: Control tokens named in the console summary (the report has them all).
TOKENS_SHOWN = 6


class SampleNotes:
    """What the kept samples tell the report beyond the cache writer's numbers."""

    def __init__(self, split_special_tokens: bool, train_on_reasoning: bool = True):
        self.split_special_tokens = split_special_tokens
        self.train_on_reasoning = train_on_reasoning
        self.control_tokens: Counter = Counter()
        self.control_samples = 0
        self.outside_images = 0
        self.reasoning_samples = 0
        self.reasoning_tokens = 0

    def add(self, sample) -> None:
        """Take the notes of one kept :class:`~magistral_cli.data.encoder.EncodedSample`."""
        if sample.text_control_tokens:
            self.control_tokens.update(sample.text_control_tokens)
            self.control_samples += 1
        self.outside_images += sample.outside_images
        if sample.reasoning_tokens:
            self.reasoning_samples += 1
            self.reasoning_tokens += sample.reasoning_tokens

    def fields(self) -> dict:
        return {
            "control_tokens_in_text": {
                "encoded_as": "text" if self.split_special_tokens else "control tokens",
                "samples": self.control_samples,
                "total": sum(self.control_tokens.values()),
                "tokens": dict(self.control_tokens.most_common()),
            },
            "images_outside_dataset_dir": self.outside_images,
            "reasoning": {
                "samples": self.reasoning_samples,
                "tokens": self.reasoning_tokens,
                "trained": self.train_on_reasoning,
            },
        }


def build_report(
    writer, *, rows: int, seconds: float, cutoff_len: int, workers: int, notes: SampleNotes | None = None
) -> dict:
    """Summary numbers of one preprocessing run (``writer`` is the filled CacheWriter)."""
    lengths = np.asarray(writer.lengths, dtype=np.int64)
    by_reason = Counter(d["reason"] for d in writer.drops)
    examples: dict[str, list[dict]] = {}
    for drop in writer.drops:
        bucket = examples.setdefault(drop["reason"], [])
        if len(bucket) < EXAMPLES_PER_REASON:
            bucket.append({"index": drop["index"], "detail": drop["detail"]})
    percentiles = {}
    if len(lengths):
        for p in (0, 50, 90, 99, 100):
            percentiles[f"p{p}"] = int(np.percentile(lengths, p, method="nearest"))
    images = Counter(writer.images_per_sample)
    # A pair entry counts pairs (rows) kept and dropped; lengths, tokens and images are its sequences'.
    pairs = {"pairs": True, "sequences": len(lengths)} if writer.pairs else {}
    return {
        "rows": rows,
        "kept": writer.pairs if writer.pairs else len(lengths),
        **pairs,
        "dropped": len(writer.drops),
        "dropped_by_reason": dict(sorted(by_reason.items())),
        "drop_examples": examples,
        "truncated": writer.truncated,
        "tokens": int(lengths.sum()),
        "label_tokens": writer.label_tokens,
        "length_percentiles": percentiles,
        # Fixed bins, a few KiB for any dataset: the padding estimate of `magistral train --dry-run`.
        "length_histogram": length_histogram(lengths, cutoff_len),
        "cutoff_len": cutoff_len,
        "images": len(writer.images),
        "images_per_sample": {str(k): v for k, v in sorted(images.items())},
        **(notes.fields() if notes is not None else {}),
        "seconds": round(seconds, 3),
        "samples_per_s": round(rows / seconds, 1) if seconds > 0 else None,
        "workers": workers,
    }


def render_report(report: dict, console, *, entry: str, reused: bool) -> None:
    """The report as rich tables on ``console`` (text from the data and paths are escaped: a
    ``[/INST]`` in them is not rich markup)."""
    from rich.markup import escape
    from rich.table import Table

    title = "preprocess: cache reused" if reused else "preprocess: encoded"
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("cache entry", escape(entry))
    table.add_row("rows read", str(report["rows"]))
    pairs = report.get("pairs", False)
    if pairs:
        table.add_row(
            "kept pairs", f"[green]{report['kept']}[/] ({report['sequences']} sequences: chosen, rejected)"
        )
    else:
        table.add_row("kept", f"[green]{report['kept']}[/]")
    split = report.get("split")
    if split:
        table.add_row(
            "train / validation",
            f"{split['train']} / {split['val']} (val_size {split['val_size']}, seed {split['seed']})",
        )
    table.add_row(
        "dropped pairs" if pairs else "dropped", f"[red]{report['dropped']}[/]" if report["dropped"] else "0"
    )
    table.add_row("truncated (kept)", str(report["truncated"]))
    table.add_row("tokens", f"{report['tokens']} ({report['label_tokens']} trained)")
    pct = report["length_percentiles"]
    if pct:
        table.add_row(
            "length p0/p50/p90/p99/max",
            f"{pct['p0']} / {pct['p50']} / {pct['p90']} / {pct['p99']} / {pct['p100']} (cutoff_len {report['cutoff_len']})",
        )
    per = ", ".join(f"{k}: {v}" for k, v in report["images_per_sample"].items())
    table.add_row("images", f"{report['images']} (images per {'sequence' if pairs else 'sample'} {per})")
    if "images_outside_dataset_dir" in report:
        table.add_row("images outside dataset_dir", str(report["images_outside_dataset_dir"]))
    control = report.get("control_tokens_in_text")
    if control is not None:
        table.add_row("control tokens in data text", _control_summary(control))
    reasoning = report.get("reasoning")
    if reasoning is not None:
        table.add_row("reasoning", _reasoning_summary(reasoning))
    if report.get("samples_per_s") is not None:
        table.add_row(
            "speed when encoded" if reused else "speed",
            f"{report['samples_per_s']} rows/s ({report['seconds']} s, {report['workers']} worker(s))",
        )
    console.print(table)
    if control and control["total"] and control["encoded_as"] != "text":
        console.print(
            f"[yellow]warning:[/] {control['total']} control token(s) written in the text of {control['samples']} "
            "sample(s) were encoded as control tokens (split_special_tokens: false, the seed's setting); "
            "mistral-common encodes them as plain text: set "
            "data.dataset_param.preprocess_parameters.split_special_tokens=true to do the same"
        )
    if report["dropped_by_reason"]:
        drops = Table(title="dropped rows by reason", title_justify="left")
        drops.add_column("reason", style="bold red")
        drops.add_column("rows", justify="right")
        drops.add_column("first rows (index: detail)")
        for reason, count in report["dropped_by_reason"].items():
            shown = "\n".join(
                f"{e['index']}: {escape(e['detail'])}" for e in report["drop_examples"].get(reason, [])
            )
            drops.add_row(f"{reason}\n[dim]{escape(DROP_REASONS.get(reason, ''))}[/]", str(count), shown)
        console.print(drops)


def _control_summary(control: dict) -> str:
    from rich.markup import escape

    if not control["total"]:
        return "none"
    tokens = list(control["tokens"].items())
    named = ", ".join(f"{token} x{count}" for token, count in tokens[:TOKENS_SHOWN])
    if len(tokens) > TOKENS_SHOWN:
        named += f", {len(tokens) - TOKENS_SHOWN} more kinds"
    where = f"{control['total']} in {control['samples']} sample(s)"
    if control["encoded_as"] == "text":
        return f"{where}, kept as text: {escape(named)}"
    return f"[yellow]{where}, encoded as control tokens: {escape(named)}[/]"


def _reasoning_summary(reasoning: dict) -> str:
    if not reasoning["samples"]:
        return "none"
    how = "trained" if reasoning["trained"] else "masked (train_on_reasoning: false)"
    return f"{reasoning['samples']} sample(s), {reasoning['tokens']} tokens, {how}"
