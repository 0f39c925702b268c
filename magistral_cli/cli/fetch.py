"""`magistral fetch`: download the model at pinned revisions, verify every SHA-256, keep a manifest."""

from __future__ import annotations

import threading
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .output import JsonOut, bytes_progress, console, emit_json


class TokenizerSource(str, Enum):
    official = "official"
    unsloth = "unsloth"


class _RichFetchProgress:
    """Download bars per file and one bar for hashing, on stderr (thread-safe: rich locks)."""

    def __init__(self, progress) -> None:
        self.progress = progress
        self._hash_task = None
        self._lock = threading.Lock()

    def download_bar(self, name: str, total: int | None, initial: int):
        task = self.progress.add_task(f"download {name}", total=total, completed=initial)
        progress = self.progress

        class _Bar:
            def update(self, n: int) -> None:
                progress.advance(task, n)

            def close(self) -> None:
                progress.update(task, visible=False)

        return _Bar()

    def add_hash_work(self, n_bytes: int) -> None:
        with self._lock:
            if self._hash_task is None:
                self._hash_task = self.progress.add_task("verify sha256", total=n_bytes)
            else:
                total = self.progress.tasks[self._hash_task].total or 0
                self.progress.update(self._hash_task, total=total + n_bytes)

    def hashed(self, n_bytes: int) -> None:
        if self._hash_task is not None:
            self.progress.advance(self._hash_task, n_bytes)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _render(report) -> None:
    from rich.table import Table

    table = Table(title=f"{report.model_dir}", title_justify="left", show_edge=False)
    table.add_column("file", overflow="fold", ratio=1)
    for col in ("status", "size", "sha256", "against"):
        table.add_column(col, no_wrap=True)
    style = {"ok": "green", "recorded": "cyan"}
    for f in report.files:
        table.add_row(
            f.name,
            f"[{style.get(f.status, 'red')}]{f.status}[/]",
            _fmt_bytes(f.bytes),
            (f.sha256 or "-")[:10],
            f.expected_from or "-",
        )
    console.print(table)
    if report.ok:
        where = f"; manifest {report.manifest}" if report.manifest else ""
        n_new = sum(f.downloaded for f in report.files)
        console.print(
            f"[green]all {len(report.files)} files verified[/] ({n_new} downloaded, "
            f"{_fmt_bytes(report.hashed_bytes)} hashed in {report.wall_s:.1f} s{where})"
        )


def fetch_command(
    model_dir: Annotated[
        Path, typer.Option("--model-dir", help="Directory to download into (created if missing).")
    ],
    lock: Annotated[
        Optional[Path],
        typer.Option(
            "--lock",
            help="Asset lock file (default: the packaged Magistral-Small-2509 lock, "
            "recipes/magistral-small-2509/assets.lock.json).",
        ),
    ] = None,
    no_weights: Annotated[
        bool,
        typer.Option(
            "--no-weights",
            help="Skip the HF weight shards (config, index and tokenizer only); with --native, Mistral's "
            "layout is still fetched whole (consolidated.safetensors too: the native layout without the shards).",
        ),
    ] = False,
    tokenizer_source: Annotated[
        TokenizerSource,
        typer.Option(
            "--tokenizer-source",
            help="official: only the official repository's files (tekken.json); "
            "unsloth: add the third-party tokenizer/processor files.",
        ),
    ] = TokenizerSource.official,
    native: Annotated[
        bool,
        typer.Option(
            "--native",
            help="Add Mistral's native layout (params.json, consolidated.safetensors: vLLM's "
            "--load-format mistral); about as large again as the weight shards.",
        ),
    ] = False,
    verify_only: Annotated[
        bool,
        typer.Option(
            "--verify-only",
            help="No network, no change: check the files in --model-dir against the manifest and the lock, and "
            "report a file that does not match without moving it.",
        ),
    ] = False,
    quarantine: Annotated[
        bool,
        typer.Option(
            "--quarantine",
            help="With --verify-only: move a file that does not match into DIR/.magistral-quarantine/ "
            "(a fetch always does, before downloading it again).",
        ),
    ] = False,
    json_out: JsonOut = False,
) -> None:
    """Download the model and tokenizer at pinned revisions and verify every file's SHA-256.

    Downloads go through huggingface_hub (HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply; a dropped
    connection resumes with a Range request; completed files are kept across runs). Every file is
    hashed and compared with the lock (or, for weight shards, with the sum recorded at first
    download); DIR/magistral-manifest.json records the result. A file that does not match is moved
    to DIR/.magistral-quarantine/ (with --verify-only only if --quarantine is given) and the command
    exits 1.
    """
    from magistral_cli.assets.fetch import fetch_assets
    from magistral_cli.assets.lock import load_lock

    if quarantine and not verify_only:
        from magistral_cli.errors import UserError

        raise UserError(
            "--quarantine applies to --verify-only (a fetch always moves a file that does not match aside "
            "before downloading it again); add --verify-only or drop --quarantine"
        )
    lock_obj = load_lock(lock)
    with bytes_progress(binary_units=True) as progress:
        report = fetch_assets(
            model_dir,
            lock_obj,
            weights=not no_weights,
            tokenizer_source=tokenizer_source.value,
            verify_only=verify_only,
            quarantine=quarantine or not verify_only,
            progress=_RichFetchProgress(progress),
            native=native,
        )
    if json_out:
        emit_json(report.to_json())
    else:
        _render(report)
    report.raise_for_failures()


def register(app: typer.Typer) -> None:
    app.command(name="fetch")(fetch_command)
