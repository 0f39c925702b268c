"""Faults that used to surface late or as tracebacks, each broken for real and run as a user would.

- Checks of the recipe alone, and of the recipe against the model's config, stop `magistral train
  --dry-run` with exit 2 before torchrun starts.
- Operating-system errors (a file where the run directory goes, a read-only or full disk) are one
  message naming the path, its errno and the fix: exit 2 for a wrong path, 1 for the machine.
- An image changed after preprocessing is found inside the ranks and reported by the launcher
  as one line naming the image and its sample, exit 2.
- Input nested too deeply for the parsers (dataset JSON) is one message or a dropped row.
- A run whose steps were all skipped (training.skip_nonfinite_steps) exits 1 and saves nothing.
- A metrics.jsonl line whose step is null does not stop a resume.

The disk cases mount a small tmpfs (root only: skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.engine import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from engine.helpers import (  # noqa: E402
    mounted_tmpfs,
    recipe_dict,
    run_train,
    train_command,
    train_env,
    write_tiny_model,
)

runner = CliRunner()
TINY = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
BASIC = "data.dataset_param.basic_parameters"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """The tiny model (4 attention heads) on synthetic data: a 2-process recipe."""
    root = tmp_path_factory.mktemp("late")
    write_tiny_model(root / "model")
    data = recipe_dict(root / "model", root / "unused", micro_batch_size=1, train_iters=2, save_interval=0)
    del data["training"]["output_dir"]
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _nothing_started(run_dir: Path) -> bool:
    return not (run_dir / "rank_status").exists() and not any((run_dir / "logs").glob("*/attempt_*"))


# --------------------------------------------------------------------------- checks that ran late


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.attn_implementation=flash"], "model.attn_implementation: 'flash' is not supported"),
        (["--nproc-per-node", "3", "parallel.ulysses_parallel_size=3"], "4 heads do not divide over 3"),
        ([f"training.train_iters={10**30}"], f"training.train_iters: {10**30} does not fit in 64 bits"),
        ([f"training.seed={10**30}"], "training.seed: Input should be less than or equal to 4294967295"),
        ([f"{BASIC}.cutoff_len={10**30}"], f"{BASIC}.cutoff_len: Input should be less than or equal to"),
        (
            [
                "parallel.ulysses_parallel_size=2",
                "data.dataloader_param.collate_param.ignore_pad_token_for_loss=false",
            ],
            "ignore_pad_token_for_loss: false would train differently from CP=1",
        ),
        # Rules that the trainer, the CP model hooks or the data pipeline used to check only after
        # torchrun had started; the recipe schema holds them now.
        (
            [
                "parallel.ulysses_parallel_size=2",
                "features.loss_cfg.loss_type=per_sample_loss",
                "training.micro_batch_size=2",
            ],
            "per_sample_loss with context parallelism",
        ),
        (
            ["parallel.ulysses_parallel_size=2", f"{BASIC}.neat_packing=true"],
            "neat_packing with context parallelism",
        ),
        (["--nproc-per-node", "3", "parallel.ulysses_parallel_size=2"], "does not divide the world size 3"),
        (
            ["parallel.fully_shard_parallel_size=4"],
            "parallel.fully_shard_parallel_size is 4 but world size 2",
        ),
        ([f"{BASIC}.val_size=0.1"], "has no dataset size to take a fraction of"),
        (
            ["training.micro_batch_size=0"],
            "training.micro_batch_size: Input should be greater than or equal to 1",
        ),
        (["training.eval_interval=1"], "training.eval_interval needs a validation split"),
    ],
)
def test_a_dry_run_stops_with_exit_2_before_torchrun(recipe, tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    args = ["train", str(recipe), "--dry-run", f"training.output_dir={run_dir}", *overrides]
    if "--nproc-per-node" not in overrides:
        args += ["--nproc-per-node", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert _nothing_started(run_dir)


# --------------------------------------------------------------------------- operating-system errors


def test_an_output_dir_that_is_a_file_exits_2_naming_it(recipe, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for run_dir in (afile, afile / "run"):
        result = runner.invoke(
            app, ["train", str(recipe), "--nproc-per-node", "2", f"training.output_dir={run_dir}"]
        )
        assert result.exit_code == 2, result.output
        # One message naming the path (the launcher's own check, or errors.os_error's errno and fix).
        assert result.output.count("error: ") == 1 and str(afile) in result.output, result.output
        assert "Traceback" not in result.output
    assert afile.read_text() == "keep me"


@pytest.fixture
def read_only_disk(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "size=1m", "ro") as disk:
        yield disk


@pytest.fixture
def small_disk(tmp_path):
    with mounted_tmpfs(tmp_path / "disk", "size=24m") as disk:
        yield disk


def test_a_run_directory_on_a_read_only_disk_exits_1_naming_it(recipe, read_only_disk):
    run_dir = read_only_disk / "run"
    result = runner.invoke(
        app, ["train", str(recipe), "--nproc-per-node", "2", f"training.output_dir={run_dir}"]
    )
    assert result.exit_code == 1, result.output
    assert f"error: {run_dir}: Read-only file system (EROFS); that file system is read-only" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_a_run_directory_that_fills_up_ends_with_one_line_and_whole_files(recipe, small_disk):
    run_dir = small_disk / "run"
    proc = subprocess.Popen(
        train_command(recipe, run_dir, "training.train_iters=100000"),
        env=train_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with open(small_disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    # Rank 0's status, written over the space it reserved at start-up, names the file and the cause.
    assert f"rank 0 failed: {metrics}: No space left on device (ENOSPC); free space on that disk" in err
    status = json.loads((run_dir / "rank_status" / "rank0.json").read_text())
    assert (status["exit_status"], status["kind"]) == (1, "check")
    text = metrics.read_text()
    assert text.endswith("\n")
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == list(range(1, len(steps) + 1))
    assert not [p.name for p in run_dir.rglob("*.tmp")]


# --------------------------------------------------------------------------- images changed since preprocessing


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The tiny recipe's model and image dataset, preprocessed; the pristine images kept aside."""
    sys.path.insert(0, str(REPO))
    from tests.workflow.test_context_parallel_recipe import _build_quickstart

    root = tmp_path_factory.mktemp("images")
    _build_quickstart(root)
    quick = root / "quickstart"
    overrides = [
        f"model.model_name_or_path={quick / 'model'}",
        f"training.load={quick / 'model'}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={quick / 'model'}",
        f"{BASIC}.dataset={quick / 'data' / 'data.jsonl'}",
        f"{BASIC}.dataset_dir={quick / 'data'}",
        f"{BASIC}.cache_dir={root / 'cache'}",
        "training.train_iters=2",
        "training.save_interval=0",
    ]
    result = runner.invoke(app, ["preprocess", str(TINY), *overrides])
    assert result.exit_code == 0, result.output
    shutil.copytree(quick / "data" / "images", root / "pristine")
    return quick / "data" / "images", root / "pristine", overrides


def _resize(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as image:
        image.load()
    image.resize((max(28, image.width // 2), image.height)).save(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "reason", "extra"),
    [
        (Path.unlink, "(No such file or directory)", []),
        (_resize, "when the dataset was preprocessed: it changed on disk)", []),
        # Cut files, read by data-loader workers: the rank shows the worker's own error.
        (lambda p: p.write_bytes(p.read_bytes()[:300]), "", ["data.dataloader_param.num_workers=2"]),
    ],
    ids=["deleted", "resized", "corrupted"],
)
def test_an_image_changed_since_preprocessing_exits_2_naming_it_and_its_sample(
    quickstart, tmp_path, change, reason, extra
):
    images, pristine, overrides = quickstart
    try:
        for path in images.iterdir():
            change(path)
        run_dir = tmp_path / "run"
        done = run_train(TINY, run_dir, *overrides, *extra)
    finally:
        shutil.rmtree(images)
        shutil.copytree(pristine, images)
    assert done.returncode == 2, done.stderr[-3000:]
    failed = [line for line in done.stderr.splitlines() if line.startswith("rank ") and " failed: " in line]
    assert failed, done.stderr[-3000:]
    line = failed[0].split(" failed: ", 1)[1]
    assert line.startswith(f"image {images}/") and " of sample " in line
    assert " changed since preprocessing: re-run magistral preprocess with " in line
    assert line.endswith(reason) and "Traceback" not in line
    assert "ended without a status" not in done.stderr


@pytest.mark.slow
def test_an_image_only_rank_1_reads_is_named_first_and_exits_2(quickstart, tmp_path):
    """Rank 1 stops on a deleted image; rank 0's next collective then loses its connection. The
    report names rank 1's error first and exits 2 (it used to lead with rank 0's "Connection closed
    by peer" and its traceback, exit 1, because ranks were listed in order)."""
    from magistral_cli.data.samplers import BaseRandomBatchSampler

    images, pristine, overrides = quickstart
    rows = [json.loads(line) for line in (images.parent / "data.jsonl").read_text().splitlines()]
    recipe = yaml.safe_load(TINY.read_text())
    sampler = recipe["data"]["dataloader_param"].get("sampler_type", "BaseRandomBatchSampler")
    assert sampler == "BaseRandomBatchSampler"
    micro = recipe["training"]["micro_batch_size"]

    def first_batch(rank):  # the recipe's sampler: the samples, and their images, of the rank's step 1
        batch = next(iter(BaseRandomBatchSampler(len(rows), micro, num_replicas=2, rank=rank)))
        return batch, {name for i in batch for name in rows[i].get("images", [])}

    batch, names = first_batch(1)
    victim = sorted(names - first_batch(0)[1])[0]
    sample = next(i for i in batch if victim in rows[i].get("images", []))
    try:
        (images.parent / victim).unlink()
        done = run_train(TINY, tmp_path / "run", *overrides)
    finally:
        shutil.rmtree(images)
        shutil.copytree(pristine, images)
    assert done.returncode == 2, done.stderr[-3000:]
    report = done.stderr.partition("training failed (exit status 2)\n")[2].splitlines()
    first = f"rank 1 failed: image {images.parent / victim} of sample {sample} changed since preprocessing"
    assert report[0].startswith(first), report
    # rank 0 recorded its lost connection, or torchrun stopped it first: either way named after rank 1
    assert report[1] in (
        "rank(s) 0 lost the connection after that failure",
        "rank(s) 0 stopped by torchrun after that failure (no status of their own)",
    ), report
    assert "crashed" not in done.stderr and "Traceback" not in done.stderr
    # summary.json's error is that cause too, not rank 0's lost connection
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["exit_status"], summary["error"]) == (2, report[0])


# --------------------------------------------------------------------------- input nested too deeply


def test_a_dataset_nested_too_deeply_is_one_error_or_a_dropped_row(quickstart, tmp_path):
    _, _, overrides = quickstart
    deep = "[" * 5000 + "]" * 5000
    array = tmp_path / "array.json"
    array.write_text(f"[{deep}]")
    args = ["preprocess", str(TINY), *overrides, f"{BASIC}.cache_dir={tmp_path / 'cache'}"]
    result = runner.invoke(app, [*args, f"{BASIC}.dataset={array}"])
    assert result.exit_code == 2, result.output
    assert f"{array}: the JSON is nested too deeply to parse" in result.output
    lines = tmp_path / "lines.jsonl"
    good = (quickstart[0].parent / "data.jsonl").read_text().splitlines()[:4]
    lines.write_text("\n".join([*good, deep, '{"x": ' + "[" * 900 + "]" * 900 + "}"]) + "\n")
    result = runner.invoke(app, [*args, f"{BASIC}.dataset={lines}", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    dropped = report["report"]["dropped_by_reason"]
    assert dropped["invalid_json"] == 1 and dropped["invalid_record"] == 1, dropped


# --------------------------------------------------------------------------- skipped steps, metrics on resume


@pytest.mark.slow
def test_a_run_that_skipped_every_step_exits_1_and_saves_nothing(recipe, tmp_path):
    from safetensors.torch import load_file, save_file

    model = Path(yaml.safe_load(recipe.read_text())["training"]["load"])
    poisoned = tmp_path / "model"
    shutil.copytree(model, poisoned)
    for shard in poisoned.glob("*.safetensors"):
        tensors = load_file(shard)
        if "language_model.model.norm.weight" in tensors:
            tensors["language_model.model.norm.weight"][0] = float("nan")
            save_file(tensors, shard, metadata={"format": "pt"})
    run_dir = tmp_path / "run"
    done = run_train(
        recipe,
        run_dir,
        f"training.load={poisoned}",
        "training.skip_nonfinite_steps=true",
        "training.train_iters=4",
        "training.save_interval=2",
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "rank 0 failed: steps 1-4: 4 steps in a row had a non-finite loss or gradient norm" in done.stderr
    assert ckpt.list_checkpoints(run_dir / "checkpoints") == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["exit_status"], summary["skipped_steps"], summary["last_applied_step"]) == (1, 4, 0)
    assert summary["error"].startswith("steps 1-4: ")


@pytest.mark.slow
def test_a_metrics_line_with_a_null_step_does_not_stop_a_resume(recipe, tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(recipe, run_dir, "training.save_interval=2", "training.resume=auto")
    assert first.returncode == 0, first.stderr[-3000:]
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": null, "loss": 1.0}\n')
    again = run_train(
        recipe, run_dir, "training.save_interval=2", "training.resume=auto", "training.train_iters=3"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (run_dir / "metrics.after_step_2.jsonl").read_text() == '{"step": null, "loss": 1.0}\n'
