"""`magistral convert`: HF safetensors <-> torch.distributed.checkpoint, and key validation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from .output import JsonOut, bytes_progress, console, emit_json

convert_app = typer.Typer(
    help="Convert checkpoints between HF safetensors and torch DCP, validate them, export them back.",
    no_args_is_help=True,
)


class DCPLayout(str, Enum):
    fsdp2 = "fsdp2"
    megatron = "megatron"


class ValidateLayout(str, Enum):
    fsdp2 = "fsdp2"
    megatron = "megatron"
    engine = "engine"


class HFLayout(str, Enum):
    official = "official"
    transformers = "transformers"


class ExportFormat(str, Enum):
    hf = "hf"
    mistral = "mistral"


class LoraExport(str, Enum):
    adapters = "adapters"
    merged = "merged"


ModelDir = Annotated[
    Path,
    typer.Option(
        "--model-dir", help="HF model directory (config.json, weights, tokenizer).", show_default=False
    ),
]
Fsync = Annotated[
    bool,
    typer.Option(
        "--fsync",
        help="Sync every written file to disk before the directory appears (survives a power loss; "
        "slower). Without it a failed or interrupted run still leaves nothing behind.",
    ),
]

AllowDtypeMismatch = Annotated[
    bool,
    typer.Option(
        "--allow-dtype-mismatch",
        help="Accept floating-point tensors whose dtype differs from config.json's `dtype` (e.g. float16 or "
        "float32 weights for a bfloat16 config). Without it every model tensor of a conversion must have "
        "that dtype. Integer and bool tensors are refused regardless: they are never model weights.",
    ),
]

AllowUnverified = Annotated[
    bool,
    typer.Option(
        "--allow-unverified",
        help="Read a training checkpoint that has no integrity.json (a save from before training wrote "
        "integrity records, whose files you trust). Without it such a checkpoint is refused: a removed record "
        "looks the same. A checkpoint with a record is always verified, and refused when a file differs.",
    ),
]

PushToHub = Annotated[
    Optional[str],
    typer.Option(
        "--push-to-hub",
        metavar="REPO_ID",
        help="After the export, upload the directory to this Hub repository (created if new) in one commit, "
        "with a generated model card (README.md: base model, data, recipe, metrics, magistral version). The token "
        "is huggingface_hub's (HF_TOKEN or `hf auth login`); HF_ENDPOINT applies.",
        show_default=False,
    ),
]
Private = Annotated[
    bool,
    typer.Option(
        "--private",
        help="With --push-to-hub: create the repository private (an existing one keeps its visibility).",
    ),
]
Revision = Annotated[
    Optional[str],
    typer.Option(
        "--revision",
        metavar="BRANCH",
        help="With --push-to-hub: the branch to commit to (created from main if new; default main).",
        show_default=False,
    ),
]


@dataclass
class _Push:
    repo_id: str
    private: bool
    revision: str | None


def _push_request(repo_id: str | None, private: bool, revision: str | None) -> _Push | None:
    """The --push-to-hub request, checked before any export starts (id, branch, token), or None."""
    from magistral_cli.errors import UserError

    if repo_id is None:
        if private or revision is not None:
            raise UserError("--private and --revision go with --push-to-hub REPO_ID; add it or drop them")
        return None
    from magistral_cli.checkpoint.publish import check_push

    check_push(repo_id, revision)
    return _Push(repo_id, private, revision)


def _publish(
    push: _Push | None, out_dir: Path, kind: str, checkpoint: Path | None, base: Path | None
) -> dict:
    """Write the model card into ``out_dir`` and upload it; ``{"hub": ...}`` for the JSON result."""
    if push is None:
        return {}
    from magistral_cli.checkpoint.publish import model_card, push_folder, write_card

    card = model_card(out_dir, repo_id=push.repo_id, kind=kind, checkpoint=checkpoint, base_dir=base)
    write_card(out_dir, card)
    console.print(f"uploading {out_dir} to {push.repo_id} ...")
    pushed = push_folder(out_dir, push.repo_id, private=push.private, revision=push.revision)
    console.print(f"[green]published[/] {pushed.repo_id}@{pushed.revision}: {pushed.commit_url}")
    return {"hub": pushed.to_dict()}


@contextmanager
def _progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar (bytes) on stderr, driven by the core's progress(done, total) callback."""
    with bytes_progress() as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@convert_app.command("hf-to-dcp")
def hf_to_dcp(
    model_dir: Annotated[
        Path,
        typer.Option(
            "--model-dir",
            help="HF model directory (config.json, weights, tokenizer), or Mistral's native layout "
            "(params.json + consolidated*.safetensors).",
            show_default=False,
        ),
    ],
    dcp_dir: Annotated[
        Path, typer.Option("--dcp-dir", help="New DCP directory (must not exist).", show_default=False)
    ],
    layout: Annotated[
        DCPLayout,
        typer.Option(
            "--layout",
            help="fsdp2: transformers keys at the root. megatron: {'model': 'model.'+key} under release/.",
        ),
    ] = DCPLayout.fsdp2,
    fsync: Fsync = False,
    allow_dtype_mismatch: AllowDtypeMismatch = False,
    json_out: JsonOut = False,
) -> None:
    """Stream the HF safetensors shards into a DCP checkpoint; every key, shape and dtype is checked before and after."""
    from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp

    with _progress(f"hf-to-dcp ({layout.value})") as progress:
        result = convert_hf_to_dcp(
            model_dir,
            dcp_dir,
            layout.value,
            progress=progress,
            fsync=fsync,
            allow_dtype_mismatch=allow_dtype_mismatch,
        )
    console.print(
        f"[green]wrote[/] {result.checkpoint_dir}: {result.tensors} tensors, "
        f"{result.bytes / 2**20:.1f} MiB in {result.seconds:.1f} s; "
        f"validated {result.validated_keys} model keys against the model's config ({layout.value} layout)"
    )
    if json_out:
        emit_json(result.to_dict())


@convert_app.command("validate")
def validate(
    model_dir: ModelDir,
    dcp_dir: Annotated[Path, typer.Option("--dcp-dir", help="DCP directory to check.", show_default=False)],
    layout: Annotated[
        ValidateLayout,
        typer.Option(
            "--layout",
            help="Layout the DCP must have (engine: a training checkpoint; its fp32 master weights need "
            "only be floating point, not of config.json's dtype).",
        ),
    ] = ValidateLayout.fsdp2,
    allow_dtype_mismatch: AllowDtypeMismatch = False,
    allow_unverified: AllowUnverified = False,
    json_out: JsonOut = False,
) -> None:
    """Check every model key, shape and dtype of a DCP checkpoint against config.json, and its files against
    what was saved: every data file present and long enough; a training checkpoint against its integrity.json
    (exit 1 on a mismatch)."""
    from magistral_cli.checkpoint.validate import require_valid, validate_dcp

    validation = validate_dcp(
        model_dir,
        dcp_dir,
        layout.value,
        allow_dtype_mismatch=allow_dtype_mismatch,
        allow_unverified=allow_unverified,
    )
    if json_out:
        emit_json(validation.to_dict())  # printed on a mismatch too, before the exit code 1
    require_valid(validation)
    console.print(f"[green]PASS[/] {validation.message()}")


@convert_app.command("dcp-to-hf")
def dcp_to_hf(
    out_dir: Annotated[
        Path, typer.Option("--out-dir", help="New HF model directory (must not exist).", show_default=False)
    ],
    dcp_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--dcp-dir",
            help="DCP checkpoint: a conversion (either layout), a training checkpoint (checkpoints/step_N), or a "
            "run's checkpoints/ (its newest intact checkpoint). Training checkpoints are verified first. "
            "Without it, --format mistral writes --model-dir's own weights in the native layout.",
            show_default=False,
        ),
    ] = None,
    model_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--model-dir",
            help="HF model directory (config.json, weights, tokenizer); with --lora, the same as --base.",
            show_default=False,
        ),
    ] = None,
    layout: Annotated[
        HFLayout,
        typer.Option("--layout", help="Key names: official (the mistralai repository) or transformers."),
    ] = HFLayout.official,
    export_format: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help="hf: safetensors shards with config and tokenizer files (transformers, vLLM). mistral: Mistral's "
            "native layout, consolidated.safetensors + params.json + tekken.json (vLLM with --tokenizer-mode "
            "mistral --config-format mistral --load-format mistral); with --lora, merged only.",
        ),
    ] = ExportFormat.hf,
    fsync: Fsync = False,
    allow_dtype_mismatch: AllowDtypeMismatch = False,
    lora: Annotated[
        Optional[LoraExport],
        typer.Option(
            "--lora",
            help="A LoRA run's checkpoint (adapters only): 'adapters' writes PEFT's adapter_model.safetensors + "
            "adapter_config.json (PeftModel.from_pretrained, vLLM); 'merged' writes the base's shards with "
            "W + (alpha/r) B A folded in (fp32, rounded once), in the base's file split and key names.",
            show_default=False,
        ),
    ] = None,
    merge: Annotated[bool, typer.Option("--merge", help="The same as --lora merged.")] = False,
    base: Annotated[
        Optional[Path],
        typer.Option(
            "--base",
            help="With --lora: the base HF model directory the run trained on (default: --model-dir, else the "
            "model.model_name_or_path the checkpoint records).",
            show_default=False,
        ),
    ] = None,
    allow_unverified: AllowUnverified = False,
    push_to_hub: PushToHub = None,
    private: Private = False,
    revision: Revision = None,
    json_out: JsonOut = False,
) -> None:
    """Export the model weights of a DCP checkpoint as HF safetensors with the source's file split, or in
    Mistral's native layout (--format mistral)."""
    from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf
    from magistral_cli.checkpoint.staging import refuse_existing
    from magistral_cli.checkpoint.validate import resolve_dcp_checkpoint
    from magistral_cli.errors import UserError

    native = export_format is ExportFormat.mistral
    if merge and lora is LoraExport.adapters:
        raise UserError("--merge means --lora merged; drop one of --merge and --lora adapters")
    mode = LoraExport.merged if merge else lora
    if mode is LoraExport.adapters and native:
        raise UserError(
            "--format mistral writes full weights: use --lora merged, or --format hf for the adapters"
        )
    if mode is None and model_dir is None and base is None:
        raise UserError(
            "--model-dir is required: the HF model directory the checkpoint belongs to (a LoRA run's checkpoint "
            "is exported with --lora adapters or --lora merged)"
        )
    push = _push_request(push_to_hub, private, revision)
    if dcp_dir is None:
        if not native or mode is not None:
            raise UserError(
                "--dcp-dir is required: the checkpoint to export (only --format mistral without --lora exports "
                "--model-dir's own weights)"
            )
        _export_model_dir_native(model_dir or base, out_dir, fsync, json_out, push)
        return
    refuse_existing(out_dir, "output directory")  # before the checkpoint is read (and verified)
    # Resolved and verified once: from a run's checkpoints/, the newest intact step_N.
    checkpoint = resolve_dcp_checkpoint(dcp_dir, allow_unverified)
    if mode is not None:
        _export_lora(
            checkpoint,
            base or model_dir,
            out_dir,
            mode.value,
            fsync,
            json_out,
            allow_unverified,
            export_format.value,
            push,
        )
        return
    from magistral_cli.checkpoint.lora_export import is_lora_checkpoint

    if is_lora_checkpoint(checkpoint, allow_unverified):
        raise UserError(
            f"{checkpoint} is a LoRA run's checkpoint: it holds the adapters, not the model's weights; export it "
            "with --lora adapters (PEFT files) or --lora merged (full weights, needs --base)"
        )
    model_dir = model_dir or base

    with _progress(f"dcp-to-hf ({export_format.value if native else layout.value})") as progress:
        result = export_dcp_to_hf(
            checkpoint,
            model_dir,
            out_dir,
            layout.value,
            progress=progress,
            fsync=fsync,
            allow_dtype_mismatch=allow_dtype_mismatch,
            allow_unverified=allow_unverified,
            format=export_format.value,
        )
    _print_export(result, f"from a {result.dcp_layout}-layout DCP")
    hub = _publish(push, result.out_dir, "native" if native else "full", checkpoint, model_dir)
    if json_out:
        emit_json({**result.to_dict(), **hub})


def _print_export(result, source: str) -> None:
    wrote = "wrote" if result.layout != "mistral" else "wrote (Mistral's native layout)"
    console.print(
        f"[green]{wrote}[/] {result.out_dir}: {len(result.files)} safetensors files, {result.tensors} tensors "
        f"({result.layout} keys, {source}), "
        f"{result.bytes / 2**20:.1f} MiB in {result.seconds:.1f} s; wrote or copied {', '.join(result.copied)}"
    )
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)


def _export_model_dir_native(
    model_dir: Path, out_dir: Path, fsync: bool, json_out: bool, push: _Push | None
) -> None:
    from magistral_cli.checkpoint.dcp_to_hf import export_hf_to_native

    with _progress("dcp-to-hf (mistral)") as progress:
        result = export_hf_to_native(model_dir, out_dir, progress=progress, fsync=fsync)
    _print_export(result, f"from the model directory {model_dir}")
    hub = _publish(push, result.out_dir, "native", None, model_dir)
    if json_out:
        emit_json({**result.to_dict(), **hub})


def _export_lora(
    dcp_dir: Path,
    base: Path | None,
    out_dir: Path,
    mode: str,
    fsync: bool,
    json_out: bool,
    allow_unverified: bool,
    export_format: str = "hf",
    push: _Push | None = None,
) -> None:
    from magistral_cli.checkpoint.lora_export import default_base, export_lora
    from magistral_cli.errors import UserError

    base = base or default_base(dcp_dir, allow_unverified)
    if base is None:
        raise UserError(
            f"--lora {mode} needs the base model directory: pass --base DIR (the model the run trained on; "
            "the checkpoint's recorded model.model_name_or_path is not a directory here)"
        )
    with _progress(f"dcp-to-hf (lora {mode})") as progress:
        result = export_lora(
            dcp_dir,
            base,
            out_dir,
            mode,
            fsync=fsync,
            progress=progress,
            allow_unverified=allow_unverified,
            format=export_format,
        )
    if mode == "adapters":
        what = (
            f"{result.tensors} adapter tensors ({result.bytes / 2**20:.1f} MiB) in {', '.join(result.files)}"
        )
    else:
        what = (
            f"{len(result.files)} safetensors files, {result.merged} weights merged, {result.replaced} replaced, "
            f"{result.copied_tensors} copied; copied {', '.join(result.copied)}"
        )
    console.print(f"[green]wrote[/] {result.out_dir}: {what} in {result.seconds:.1f} s (base {base})")
    hub = _publish(push, result.out_dir, mode, dcp_dir, base)
    if json_out:
        emit_json({**result.to_dict(), **hub})


@convert_app.command("push")
def push(
    directory: Annotated[
        Path, typer.Option("--dir", help="An export directory (dcp-to-hf's --out-dir).", show_default=False)
    ],
    repo_id: Annotated[
        str,
        typer.Option(
            "--repo-id", metavar="REPO_ID", help="The Hub repository (created if new).", show_default=False
        ),
    ],
    private: Private = False,
    revision: Revision = None,
    json_out: JsonOut = False,
) -> None:
    """Upload an export directory to a Hub repository, as dcp-to-hf --push-to-hub does (e.g. again after a
    network failure). Its README.md is uploaded as it is; without one a model card is written first."""
    from magistral_cli.checkpoint.publish import CARD_NAME, model_card, push_folder, write_card
    from magistral_cli.errors import UserError

    request = _push_request(repo_id, private, revision)
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise UserError(
            f"--dir {directory} is not an export directory (no .safetensors files); pass dcp-to-hf's --out-dir"
        )
    if not (directory / CARD_NAME).is_file():
        kind = "adapters" if (directory / "adapter_config.json").is_file() else "full"
        write_card(
            directory, model_card(directory, repo_id=repo_id, kind=kind, checkpoint=None, base_dir=None)
        )
    pushed = push_folder(directory, request.repo_id, private=request.private, revision=request.revision)
    console.print(f"[green]published[/] {pushed.repo_id}@{pushed.revision}: {pushed.commit_url}")
    if json_out:
        emit_json(pushed.to_dict())


def register(app: typer.Typer) -> None:
    app.add_typer(convert_app, name="convert")
