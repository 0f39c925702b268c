"""``--push-to-hub``: an export directory published to a Hub repository, with a generated model card.

The card (``README.md``, written into the export directory before the upload, so the local copy
shows what was published) is built from the records that exist: the base model directory's
``magistral-manifest.json`` (the Hub repository and revision `magistral fetch` took it from), and
the records of the run that wrote the checkpoint (``run_identity.json``, ``resolved_config.yaml``,
``metrics.jsonl``, ``summary.json``), found beside the checkpoint as generate and the LoRA export
find them (``<run>/checkpoints/step_N``) or through the save directory's owner record. Metrics are
summarised up to the exported step: later lines belong to later checkpoints.

The upload is ``huggingface_hub``'s: ``create_repo(exist_ok=True)``, ``create_branch`` for
``--revision``, ``upload_folder`` (one commit). ``HF_ENDPOINT`` applies, the token is the
client's own resolution (``HF_TOKEN``, ``hf auth login``); it is never printed or written, and
messages that could carry it are scrubbed. Before any export starts, ``check_push`` refuses a
malformed repository id or branch, a missing token and offline mode (exit 2), so a long export
does not end in a refusal that was known at the start.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magistral_cli.assets.download import hub_endpoint, hub_offline, scrub_secrets
from magistral_cli.errors import CheckFailed, UserError

#: The model card's file name on the Hub.
CARD_NAME = "README.md"
#: What an export holds, as the card names it.
EXPORT_KINDS = {
    "full": "full fine-tuned weights (Hugging Face safetensors, transformers' Mistral3 layout)",
    "adapters": "LoRA adapters (PEFT's adapter_model.safetensors and adapter_config.json)",
    "merged": "full weights with the LoRA adapters merged in (Hugging Face safetensors)",
    "native": "full fine-tuned weights in Mistral's native layout (consolidated.safetensors, params.json)",
}
_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")


@dataclass
class PushResult:
    """Where an export went."""

    repo_id: str
    revision: str
    commit_url: str
    private: bool
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit_url": self.commit_url,
            "private": self.private,
            "files": self.files,
        }


def check_push(repo_id: str, revision: str | None) -> None:
    """Refuse what would make the upload fail, before the export: exit 2 with the fix."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise UserError(
            f"--push-to-hub {repo_id!r} is not a Hub repository id ({exc}); pass NAMESPACE/NAME, e.g. my-org/my-model"
        ) from None
    if revision is not None and (
        not _BRANCH.fullmatch(revision) or ".." in revision or revision.endswith("/")
    ):
        raise UserError(
            f"--revision {revision!r} is not a branch name; pass letters, digits and . _ - / (e.g. v1 or exp/lr-2e-5)"
        )
    if hub_offline():
        raise UserError("--push-to-hub needs the network, and HF_HUB_OFFLINE is set: unset it to publish")
    if not get_token():
        raise UserError(
            "--push-to-hub needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`"
        )


# ---------------------------------------------------------------------------------------------
# The run's records


@dataclass
class RunRecords:
    """What the run that wrote a checkpoint recorded (every field None or empty when absent)."""

    run_dir: Path | None = None
    step: int | None = None
    recipe: dict | None = None
    recipe_text: str | None = None
    identity: dict | None = None
    metrics: list[dict] = field(default_factory=list)
    summary: dict | None = None


def find_run_dir(checkpoint: Path) -> Path | None:
    """The run directory of a training checkpoint (``<run>/checkpoints/step_N``, a save directory
    inside it, or one that names its run in ``.magistral-owner.json``); None for a conversion."""
    from magistral_cli.run_lock import read_save_owner
    from magistral_cli.run_record import IDENTITY_NAME, RESOLVED_CONFIG

    candidates = [checkpoint.parent.parent, checkpoint.parent]
    try:
        owner = read_save_owner(checkpoint.parent)
    except (UserError, OSError):
        owner = None
    if owner and owner.get("run_dir"):
        candidates.insert(0, Path(owner["run_dir"]))
    for run_dir in candidates:
        if (run_dir / IDENTITY_NAME).is_file() or (run_dir / RESOLVED_CONFIG).is_file():
            return run_dir
    return None


def read_run_records(checkpoint: Path) -> RunRecords:
    """The records of the run that wrote ``checkpoint`` (unreadable ones are left out, not fatal:
    a card with less in it is better than no upload)."""
    import yaml

    from magistral_cli.checkpoint.layout import STEP_DIR
    from magistral_cli.run_record import IDENTITY_NAME, RESOLVED_CONFIG, read_identity

    records = RunRecords()
    match = STEP_DIR.fullmatch(checkpoint.name)
    records.step = int(match.group(1)) if match else None
    run_dir = find_run_dir(checkpoint)
    if run_dir is None:
        return records
    records.run_dir = run_dir
    records.identity = read_identity(run_dir) if (run_dir / IDENTITY_NAME).is_file() else None
    try:
        records.recipe_text = (run_dir / RESOLVED_CONFIG).read_text(encoding="utf-8")
        recipe = yaml.safe_load(records.recipe_text)
        records.recipe = recipe if isinstance(recipe, dict) else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        records.recipe_text = None
    try:
        lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.metrics.append(record)
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        records.summary = summary if isinstance(summary, dict) else None
    except (OSError, ValueError):
        pass
    return records


def summarize_metrics(metrics: list[dict], up_to_step: int | None) -> dict[str, Any]:
    """Training and validation figures up to the exported step (the last record of each step wins:
    a resumed run writes a step again)."""
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    for record in metrics:
        step = record["step"]
        if up_to_step is not None and step > up_to_step:
            continue
        (val if record.get("split") == "val" else train)[step] = record
    out: dict[str, Any] = {"steps": len(train)}
    if train:
        steps = sorted(train)
        losses = [(s, train[s].get("loss")) for s in steps if isinstance(train[s].get("loss"), (int, float))]
        if losses:
            out["first_loss"] = {"step": losses[0][0], "loss": losses[0][1]}
            out["last_loss"] = {"step": losses[-1][0], "loss": losses[-1][1]}
        out["tokens"] = sum(int(train[s].get("tokens") or 0) for s in steps)
        rates = sorted(float(train[s]["tokens_per_s"]) for s in steps if train[s].get("tokens_per_s"))
        if rates:
            out["median_tokens_per_s"] = rates[len(rates) // 2]
        out["skipped_steps"] = sum(1 for s in steps if train[s].get("skipped"))
    if val:
        last = max(val)
        out["val_loss"] = {"step": last, "loss": val[last].get("loss"), "samples": val[last].get("samples")}
    return out


# ---------------------------------------------------------------------------------------------
# The card


def base_model_repo(base_dir: Path | None) -> tuple[str | None, str | None]:
    """(Hub repository, revision) of a base model `magistral fetch` downloaded, from its manifest."""
    if base_dir is None:
        return None, None
    from magistral_cli.assets.manifest import read_manifest

    try:
        entries = read_manifest(base_dir)
    except UserError:
        return None, None
    entry = entries.get("config.json") or next(iter(entries.values()), None)
    return (entry.repo, entry.revision) if entry else (None, None)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _get(tree: dict | None, *path: str) -> Any:
    for key in path:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def model_card(
    export_dir: Path,
    *,
    repo_id: str,
    kind: str,
    checkpoint: Path | None,
    base_dir: Path | None,
) -> str:
    """The model card of an export: YAML metadata the Hub reads, then what the export is, its base
    model, data, recipe, metrics and files, and the `magistral` version that wrote it."""
    import yaml

    from magistral_cli import __version__

    records = read_run_records(checkpoint) if checkpoint is not None else RunRecords()

    def missing(why: str) -> str:
        return why if records.run_dir is not None else "no run records beside the checkpoint"

    base_repo, base_revision = base_model_repo(base_dir)
    meta: dict[str, Any] = {}
    if base_repo:
        meta["base_model"] = base_repo
    if kind != "native":  # the native layout is read by vLLM's mistral loader, not a Hub library
        meta["library_name"] = "peft" if kind == "adapters" else "transformers"
    meta["tags"] = ["magistral-cli", "mistral3", *(["lora"] if kind in ("adapters", "merged") else [])]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", ""]

    lines += [f"# {repo_id.split('/')[-1]}", ""]
    what = EXPORT_KINDS.get(kind, kind)
    source = f"step {records.step} of a fine-tuning run" if records.step is not None else "a DCP checkpoint"
    lines += [
        f"This repository holds {what}, exported from {source} and published with "
        f"magistral-cli {__version__} (`magistral convert dcp-to-hf --push-to-hub`).",
        "",
        "## Base model",
        "",
    ]
    if base_repo:
        lines.append(f"- [`{base_repo}`](https://huggingface.co/{base_repo}) at revision `{base_revision}`")
    else:
        name = _get(records.recipe, "model", "model_name_or_path") or (base_dir.name if base_dir else None)
        lines.append(
            f"- `{name}` (a local model directory without a `magistral fetch` manifest)"
            if name
            else "- not recorded"
        )
    if _get(records.recipe, "model", "model_id"):
        lines.append(f"- model: `{_get(records.recipe, 'model', 'model_id')}`")
    lines.append("")

    lines += ["## Training data", ""]
    basic = _get(records.recipe, "data", "dataset_param", "basic_parameters") or {}
    dataset = _get(records.identity, "dataset") or {}
    if basic.get("dataset") or dataset.get("path"):
        lines.append(f"- dataset: `{basic.get('dataset') or dataset.get('path')}`")
        if dataset.get("sha256"):
            lines.append(f"- dataset SHA-256: `{dataset['sha256']}`")
        for key in ("template", "cutoff_len"):
            if basic.get(key) is not None:
                lines.append(f"- {key}: `{basic[key]}`")
    else:
        lines.append(f"- not recorded ({missing('no dataset in the run records')})")
    lines.append("")

    lines += ["## Training recipe", ""]
    if records.recipe is not None:
        training = records.recipe.get("training") or {}
        parallel = records.recipe.get("parallel") or {}
        rows = [
            ("steps", training.get("train_iters")),
            ("learning rate", training.get("lr")),
            ("schedule", training.get("lr_decay_style")),
            ("micro batch", training.get("micro_batch_size")),
            ("gradient accumulation", training.get("gradient_accumulation_steps")),
            ("optimizer", training.get("optimizer")),
            ("seed", training.get("seed")),
            ("world size", _get(records.identity, "world_size")),
            ("device", _get(records.identity, "device") or parallel.get("device")),
        ]
        lora = _get(records.recipe, "model", "lora")
        if lora:
            rows += [
                ("LoRA r / alpha", f"{lora.get('r')} / {lora.get('alpha')}"),
                ("LoRA targets", ", ".join(lora.get("target_modules") or [])),
            ]
        lines += ["| setting | value |", "| --- | --- |"]
        lines += [f"| {name} | {_fmt(value)} |" for name, value in rows if value not in (None, "")]
        lines += [
            "",
            "<details><summary>The resolved recipe (resolved_config.yaml)</summary>",
            "",
            "```yaml",
            (records.recipe_text or "").rstrip(),
            "```",
            "",
            "</details>",
        ]
    else:
        lines.append(f"- not recorded ({missing('the run directory has no resolved_config.yaml')})")
    lines.append("")

    lines += ["## Metrics", ""]
    summary = summarize_metrics(records.metrics, records.step)
    if summary["steps"]:
        upto = f" up to step {records.step}" if records.step is not None else ""
        lines += [f"From the run's metrics.jsonl{upto}:", "", "| metric | value |", "| --- | --- |"]
        lines.append(f"| training steps logged | {summary['steps']} |")
        if "first_loss" in summary:
            first, last = summary["first_loss"], summary["last_loss"]
            lines.append(
                f"| training loss | {_fmt(first['loss'])} (step {first['step']}) -> "
                f"{_fmt(last['loss'])} (step {last['step']}) |"
            )
        if "val_loss" in summary:
            val = summary["val_loss"]
            lines.append(
                f"| validation loss | {_fmt(val['loss'])} (step {val['step']}, {val['samples']} samples) |"
            )
        lines.append(f"| tokens trained | {summary['tokens']} |")
        if "median_tokens_per_s" in summary:
            lines.append(f"| median tokens/s | {_fmt(summary['median_tokens_per_s'])} |")
        if summary.get("skipped_steps"):
            lines.append(f"| skipped (non-finite) steps | {summary['skipped_steps']} |")
    else:
        lines.append(f"- not recorded ({missing('no metrics.jsonl lines up to this step')})")
    lines.append("")

    lines += ["## Files", "", "| file | bytes |", "| --- | --- |"]
    for path in sorted(export_dir.iterdir()):
        if path.is_file() and path.name != CARD_NAME:
            lines.append(f"| `{path.name}` | {path.stat().st_size} |")
    lines.append("")

    lines += ["## Provenance", ""]
    lines.append(f"- published with magistral-cli {__version__}")
    if records.identity:
        for label, key in (
            ("run id", "run_id"),
            ("trained with magistral-cli", "package_version"),
            ("source", "source"),
        ):
            if records.identity.get(key):
                lines.append(f"- {label}: `{records.identity[key]}`")
    if records.summary and records.summary.get("exit_status") is not None:
        lines.append(
            f"- run exit status: `{records.summary['exit_status']}` after {records.summary.get('steps')} steps"
        )
    lines.append("")
    return "\n".join(lines)


def write_card(export_dir: Path, card: str) -> Path:
    """``README.md`` in the export directory (replacing a base model's card copied with the tokenizer)."""
    from magistral_cli.errors import os_error
    from magistral_cli.run_record import write_text_atomic

    path = export_dir / CARD_NAME
    try:
        write_text_atomic(path, card)
    except OSError as exc:
        raise os_error(exc) from None
    return path


# ---------------------------------------------------------------------------------------------
# The upload


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    message: str | None = None,
) -> PushResult:
    """Upload ``folder`` to ``repo_id`` (created if new; ``private`` applies to a new repository) on
    branch ``revision`` (created from main if new; default main), in one commit."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub_endpoint())
    branch = revision or "main"
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        repo_id = repo.repo_id or repo_id
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            revision=branch,
            commit_message=message or f"Upload {folder.name} with magistral-cli",
        )
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise _translate(exc, repo_id, folder) from None
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    return PushResult(repo_id, branch, str(info.commit_url), private, files)


def _translate(exc: Exception, repo_id: str, folder: Path) -> Exception:
    """One message for each way an upload fails; never with a token in it. The user's side (the
    token, the repository, the branch) is exit 2; the network and the server are exit 1."""
    from huggingface_hub import errors as hf_errors

    endpoint = hub_endpoint() or "https://huggingface.co"
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        from huggingface_hub import get_token

        token = get_token()
    except Exception:  # the message must come out whatever the token store says
        token = None
    detail = scrub_secrets(detail)
    if token and len(token) >= 4:
        detail = detail.replace(token, "***")
    again = (
        f"the export in {folder} is complete; publish it again with `magistral convert push --dir {folder} "
        f"--repo-id {repo_id}`"
    )
    if isinstance(exc, hf_errors.HFValidationError):
        return UserError(f"{repo_id}: {detail}; pass a repository id NAMESPACE/NAME")
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(exc, hf_errors.HfHubHTTPError) and status is not None:
        if status == 401:
            return UserError(
                f"{endpoint} refused the token (401: {detail}); set HF_TOKEN to a valid token with write "
                f"access, or run `hf auth login`; {again}"
            )
        if status == 403:
            return UserError(
                f"{endpoint} refused to write to {repo_id} (403: {detail}); the token needs write access to that "
                f"namespace: use a namespace you own or a token with write rights there; {again}"
            )
        if status == 404:
            return UserError(
                f"{repo_id} or its branch is not at {endpoint} or not writable with this token (404: {detail}); "
                f"check the repository id, HF_ENDPOINT and the token; {again}"
            )
        if 400 <= status < 500:
            return UserError(f"{endpoint} refused the upload to {repo_id} ({status}: {detail}); {again}")
        return CheckFailed(f"{endpoint} failed the upload to {repo_id} ({status}: {detail}); {again}")
    return CheckFailed(
        f"uploading to {repo_id} at {endpoint} failed ({type(exc).__name__}: {detail}); check the network "
        f"and HF_ENDPOINT; {again}"
    )
