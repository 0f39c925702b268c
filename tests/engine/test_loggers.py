"""``tools.logger``: metrics.jsonl's lines and the resolved recipe, read back from a real
TensorBoard event file (tensorboard's EventAccumulator) and a real offline W&B run (its
``run-<id>.wandb`` transaction log, parsed with wandb's own protobuf records)."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
import yaml

from magistral_cli.engine.loggers import check_logger_available
from magistral_cli.engine.metrics import FIELDS, MetricsFile
from magistral_cli.errors import UserError

from .helpers import make_recipe, write_tiny_model

pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install 'magistral-cli[tensorboard]'")
# Found, not imported: the rank processes of spawn_ranks import this module to find their function, and
# an import of wandb there would leave its temporary directories behind in ranks that never log to it.
if importlib.util.find_spec("wandb") is None:
    pytest.skip("the wandb extra: pip install 'magistral-cli[wandb]'", allow_module_level=True)

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.fixture(autouse=True)
def _wandb_offline(monkeypatch, tmp_path):
    """W&B stays on this machine: offline, silent, its settings and cache in the test's tmp dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    # A run in this process started wandb-core: stop it (its address in the environment goes with
    # every test's changes, tests/conftest.py).
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def _record(step, loss, **extra):
    record = {
        "step": step,
        "loss": loss,
        "grad_norm": 0.5 + step,
        "lr": 1e-3 * step,
        "step_time_ms": 12.5,
        "tokens": 96,
        "tokens_per_s": 7680.0,
        "peak_allocated_mib": None,
        "peak_reserved_mib": None,
        "alloc_retries": None,
    }
    record.update(extra)
    return record


RECORDS = [
    _record(1, 6.25),
    _record(2, 6.0, grad_norm=float("nan"), skipped=True),  # metrics.jsonl: null, so no scalar
    {"step": 2, "split": "val", "loss": 5.5},
    _record(3, 5.75),
]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _expected_scalars(lines: list[dict]) -> dict[str, dict[int, float]]:
    """{"train/loss": {step: value}, "val/loss": ...}: every number metrics.jsonl holds."""
    out: dict[str, dict[int, float]] = {}
    for line in lines:
        prefix = line.get("split", "train")
        for key, value in line.items():
            if key in ("step", "split") or value is None:
                continue
            out.setdefault(f"{prefix}/{key}", {})[line["step"]] = float(value)
    return out


def _event_scalars(log_dir: Path) -> tuple[EventAccumulator, dict[str, dict[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc, {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for tag, values in expected.items():
        assert got[tag].keys() == values.keys(), tag
        for step, value in values.items():
            assert math.isclose(got[tag][step], value, rel_tol=1e-6), (tag, step)  # event files hold fp32


def _recipe_text(acc: EventAccumulator) -> str:
    (event,) = acc.Tensors("recipe/text_summary")
    return event.tensor_proto.string_val[0].decode()


# ----------------------------------------------------------------------------- the W&B run file


def read_wandb_records(path: Path) -> list:
    """Every record of a ``run-<id>.wandb`` file: W&B's LevelDB-style log (a 7-byte ``:W&B``
    header, 32 KiB blocks of [crc32c u32, length u16, type u8] chunks), each a ``pb.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    block, header = 32768, 7
    pos, chunks, pending = 7, [], b""
    while pos + header <= len(data):
        room = block - pos % block
        if room < header:  # the block's tail is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if pos + header + length > len(data):  # still being written
            break
        chunk = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 1:  # FULL
            chunks.append(chunk)
        elif kind == 2:  # FIRST
            pending = chunk
        elif kind == 3:  # MIDDLE
            pending += chunk
        elif kind == 4:  # LAST
            chunks.append(pending + chunk)
    return [pb.Record.FromString(c) for c in chunks]


def _wandb_run(wandb_dir: Path) -> tuple:
    """(run record, config {key: value}, history {tag: {step: value}}) of the one offline run."""
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    # run.finish() returns once wandb-core has the run's exit; its writer flushes the file a few
    # milliseconds later (on process exit at the latest), so wait for the exit record.
    deadline = time.monotonic() + 30
    while True:
        records = read_wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in r.config.update})
    history: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for key, value in items.items():
            if not key.startswith("_"):
                history.setdefault(key, {})[items["_step"]] = value
    assert records[-1].WhichOneof("record_type") == "exit", "the run was not finished"
    return run, config, history


# ----------------------------------------------------------------------------- through MetricsFile


def test_tensorboard_gets_every_metrics_line_and_the_recipe(tmp_path):
    run_dir = tmp_path / "run"
    recipe = make_recipe(tmp_path / "model", run_dir, overrides=["tools.logger=tensorboard"])
    metrics = MetricsFile(run_dir / "metrics.jsonl", recipe=recipe)
    for record in RECORDS:
        metrics.write(record)
    metrics.close()

    lines = _lines(run_dir)
    assert lines[2] == {"step": 2, "split": "val", "loss": 5.5}  # a validation line is kept as given
    assert lines[1]["grad_norm"] is None and lines[1]["skipped"] is True
    assert list(lines[0]) == list(FIELDS)

    acc, got = _event_scalars(run_dir / "tensorboard")
    expected = _expected_scalars(lines)
    assert "val/loss" in expected and "train/skipped" in expected and 2 not in expected["train/grad_norm"]
    _assert_same(got, expected)
    text = _recipe_text(acc)
    assert yaml.safe_load("\n".join(line[4:] for line in text.splitlines())) == recipe.model_dump(mode="json")


def test_tensorboard_log_dir_and_resume_drop_the_steps_taken_again(tmp_path):
    run_dir, board = tmp_path / "run", tmp_path / "elsewhere" / "tb"
    recipe = make_recipe(
        tmp_path / "model",
        run_dir,
        overrides=["tools.logger=tensorboard", f"tools.tensorboard.log_dir={board}"],
    )
    first = MetricsFile(run_dir / "metrics.jsonl", recipe=recipe)
    for step in (1, 2, 3):
        first.write(_record(step, 10.0 + step))
    first.close()
    # Resumed from the step-1 checkpoint: steps 2 and 3 are taken again, with other values.
    resumed = MetricsFile(run_dir / "metrics.jsonl", resume_step=1, recipe=recipe)
    for step in (2, 3):
        resumed.write(_record(step, 20.0 + step))
    resumed.close()

    assert not (run_dir / "tensorboard").exists()
    _, got = _event_scalars(board)
    assert got["train/loss"] == {1: 11.0, 2: 22.0, 3: 23.0}
    _assert_same(got, _expected_scalars(_lines(run_dir)))


def test_wandb_offline_run_holds_the_recipe_and_every_metrics_line(tmp_path):
    run_dir = tmp_path / "run-42"
    recipe = make_recipe(
        tmp_path / "model",
        run_dir,
        overrides=["tools.logger=wandb", "tools.wandb.project=tests", "tools.wandb.tags=[tiny]"],
    )
    metrics = MetricsFile(run_dir / "metrics.jsonl", recipe=recipe)
    for record in RECORDS:
        metrics.write(record)
    metrics.close()

    run, config, history = _wandb_run(run_dir)  # tools.wandb.dir "." is the run directory
    assert (run.project, run.display_name, list(run.tags)) == ("tests", "run-42", ["tiny"])
    dumped = recipe.model_dump(mode="json")
    assert {k: config[k] for k in dumped} == dumped
    assert history == _expected_scalars(_lines(run_dir))
    assert not list(run_dir.rglob("output.log"))  # the rank's console is left alone


def test_missing_packages_name_the_extra_to_install(tmp_path, monkeypatch):
    for logger in ("tensorboard", "wandb"):
        recipe = make_recipe(tmp_path / "model", tmp_path / "run", overrides=[f"tools.logger={logger}"])
        check_logger_available(recipe)  # installed here
        monkeypatch.setitem(sys.modules, logger, None)  # as if it were not installed
        with pytest.raises(UserError, match=rf"pip install 'magistral-cli\[{logger}\]'"):
            check_logger_available(recipe)
        with pytest.raises(UserError, match=rf"tools.logger is {logger} .*not installed"):
            MetricsFile(tmp_path / "run" / "metrics.jsonl", recipe=recipe)
        monkeypatch.delitem(sys.modules, logger)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was started
    check_logger_available(make_recipe(tmp_path / "model", tmp_path / "run"))  # none needs nothing


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


def _train_rank(rank: int, model_dir: str, run_dir: str, overrides: list[str]) -> int:
    from magistral_cli.engine.trainer import Trainer

    trainer = Trainer(make_recipe(Path(model_dir), Path(run_dir), overrides=overrides, train_iters=3))
    try:
        return len(trainer.train())
    finally:
        trainer.close()


@pytest.mark.slow
def test_two_rank_training_logs_to_tensorboard_from_rank_0(tiny_model, tmp_path):
    from magistral_cli.runtime import spawn_ranks

    run_dir = tmp_path / "run"
    # With a validation split evaluated at step 2 and at the end: its losses go to TensorBoard too.
    overrides = [
        "tools.logger=tensorboard",
        "data.dataset_param.basic_parameters.val_size=4",
        "training.eval_interval=2",
    ]
    steps = spawn_ranks(_train_rank, 2, (str(tiny_model), str(run_dir), overrides), threads=1)
    assert steps == [3, 3]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0's only
    lines = _lines(run_dir)
    assert [line["step"] for line in lines if "split" not in line] == [1, 2, 3]
    assert [line["step"] for line in lines if line.get("split") == "val"] == [2, 3]
    acc, got = _event_scalars(run_dir / "tensorboard")
    _assert_same(got, _expected_scalars(lines))
    recipe = yaml.safe_load("\n".join(line[4:] for line in _recipe_text(acc).splitlines()))
    assert recipe["tools"]["logger"] == "tensorboard" and recipe["training"]["train_iters"] == 3


@pytest.mark.slow
def test_training_logs_to_wandb_offline(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    assert _train_rank(0, str(tiny_model), str(run_dir), ["tools.logger=wandb"]) == 3
    run, config, history = _wandb_run(run_dir)
    assert run.display_name == "run" and config["training"]["train_iters"] == 3
    lines = _lines(run_dir)
    assert history == _expected_scalars(lines) and set(history["train/loss"]) == {1, 2, 3}


@pytest.mark.slow
def test_a_rank_that_logs_to_wandb_leaves_no_temporary_directory(tiny_model, tmp_path, monkeypatch):
    """A rank ends with os._exit, which skips the exit handlers that remove wandb's module-level
    temporary directories (media, artifacts): the rank removes them itself."""
    from magistral_cli.runtime import spawn_ranks

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the rank's tempfile.gettempdir()
    steps = spawn_ranks(
        _train_rank, 1, (str(tiny_model), str(tmp_path / "run"), ["tools.logger=wandb"]), threads=1
    )
    assert steps == [3]
    assert (tmp_path / "run" / "wandb").is_dir()  # it did log to W&B
    # wandb's module-level ones; the wandb-core service removes its own socket directory as it ends.
    assert [p.name for p in scratch.iterdir() if p.name.endswith(("wandb-media", "wandb-artifacts"))] == []
