"""`magistral train`: run directory, run identity, torchrun command, environment precedence."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.errors import UserError
from magistral_cli.launch.device import NPU_ENV, merge_env
from magistral_cli.launch.identity import relevant_environment
from magistral_cli.launch.launcher import LaunchOptions, plan_launch, run_launch

REPO = Path(__file__).resolve().parents[2]
EIGHT_CARD = REPO / "recipes" / "magistral-small-2509" / "v1_8card.yaml"
TINY = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
runner = CliRunner()


@pytest.fixture
def machine_paths(tmp_path):
    """A model directory with a fetch manifest and a dataset file, as overrides."""
    model = tmp_path / "Magistral-Small-2509"
    model.mkdir()
    manifest = {"format": 1, "files": [{"name": "config.json", "sha256": "ab" * 32, "bytes": 3}]}
    (model / "magistral-manifest.json").write_text(json.dumps(manifest))
    data = tmp_path / "data"
    data.mkdir()
    dataset = data / "llava.json"
    dataset.write_text('[{"messages": [], "images": []}]')
    overrides = [
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"model.model_name_or_path={model}",
        f"training.load={model}",
        f"data.dataset_param.basic_parameters.dataset_dir={data}",
        f"data.dataset_param.basic_parameters.dataset={dataset}",
        f"training.output_dir={tmp_path / 'run'}",
    ]
    return {"model": model, "dataset": dataset, "run": tmp_path / "run", "overrides": overrides}


def test_dry_run_of_the_8_card_recipe(machine_paths):
    result = runner.invoke(
        app, ["train", str(EIGHT_CARD), *machine_paths["overrides"], "--dry-run", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    cmd = plan["command"]
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[-2:] == ["magistral_cli.engine.run", str(machine_paths["run"] / "resolved_config.yaml")]
    assert "--standalone" in cmd and str(machine_paths["run"] / "logs") in cmd
    assert plan["world_size"] == 8
    assert "dry run" in result.stderr and "nothing was started or written" in result.stderr

    # A dry run writes nothing: the resolved recipe is in its JSON.
    run = machine_paths["run"]
    assert not run.exists() and plan["written"] is False
    assert plan["resolved_recipe"]["training"]["output_dir"] == str(run)
    assert plan["resolved_recipe"]["training"]["adam_beta1"] == 0.9  # defaults filled in

    # A plan that writes (as --slurm's does, for a job started elsewhere) writes the run directory.
    written = plan_launch(
        EIGHT_CARD, machine_paths["overrides"], LaunchOptions(dry_run=True, write_run_dir=True)
    )
    assert written.written
    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["training"]["output_dir"] == str(run)
    assert resolved["training"]["adam_beta1"] == 0.9  # defaults filled in
    assert resolved["parallel"]["nproc_per_node"] == 8

    identity = json.loads((run / "run_identity.json").read_text())
    expected = hashlib.sha256(machine_paths["dataset"].read_bytes()).hexdigest()
    assert identity["dataset"]["sha256"] == expected
    assert identity["assets"]["files"] == {"config.json": "ab" * 32}
    assert identity["world_size"] == 8 and identity["nproc_per_node"] == 8
    assert identity["versions"]["torch"] and identity["versions"]["transformers"]
    assert identity["recipe"]["sha256"] == hashlib.sha256(EIGHT_CARD.read_bytes()).hexdigest()
    assert identity["run_id"] == written.run_id and identity["resume"] is None
    assert identity["data_setup"]["data_parallel_size"] == 8
    assert (run / "logs").is_dir()


def test_nproc_flag_wins_over_the_recipe(machine_paths):
    plan = plan_launch(EIGHT_CARD, machine_paths["overrides"], LaunchOptions(nproc_per_node=2, dry_run=True))
    assert plan.command[plan.command.index("--nproc-per-node") + 1] == "2"
    assert plan.world_size == 2


def test_multi_node_uses_torchrun_static_rendezvous(machine_paths):
    options = LaunchOptions(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=6000, dry_run=True)
    plan = plan_launch(EIGHT_CARD, machine_paths["overrides"], options)
    cmd = plan.command
    assert "--standalone" not in cmd
    for flag, value in [
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--master-addr", "10.0.0.1"),
        ("--master-port", "6000"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert plan.world_size == 16


@pytest.mark.parametrize(
    ("options", "extra", "message"),
    [
        (LaunchOptions(nnodes=2, dry_run=True), [], "needs --master-addr"),
        (
            LaunchOptions(nnodes=2, node_rank=2, master_addr="h", dry_run=True),
            [],
            "must be smaller than --nnodes",
        ),
        (
            LaunchOptions(nproc_per_node=6, dry_run=True),
            ["parallel.ulysses_parallel_size=4"],
            "does not divide the world size 6",
        ),
    ],
)
def test_launch_errors(machine_paths, options, extra, message):
    with pytest.raises(UserError, match=message):
        plan_launch(EIGHT_CARD, machine_paths["overrides"] + extra, options)


def test_multi_node_needs_a_shared_output_dir(machine_paths):
    overrides = [o for o in machine_paths["overrides"] if not o.startswith("training.output_dir")]
    with pytest.raises(UserError, match="training.output_dir"):
        plan_launch(EIGHT_CARD, overrides, LaunchOptions(nnodes=2, master_addr="h", dry_run=True))


def test_missing_inputs_warn_in_a_dry_run_and_stop_a_real_launch(tmp_path):
    overrides = [f"training.output_dir={tmp_path / 'run'}"]
    plan = plan_launch(EIGHT_CARD, overrides, LaunchOptions(dry_run=True))
    assert any("/path/to/Magistral-Small-2509" in w for w in plan.warnings)
    with pytest.raises(UserError, match="does not exist"):
        plan_launch(EIGHT_CARD, overrides, LaunchOptions(dry_run=False))


def test_a_file_where_a_directory_goes_and_the_reverse_are_named_as_such(machine_paths):
    """training.load and the model path are directories, the dataset a file: the wrong kind is named
    as what it is (not "does not exist") and a real launch stops in pre-flight, before any rank."""
    model, dataset = machine_paths["model"], machine_paths["dataset"]
    cases = [
        (
            f"training.load={dataset}",
            f"training.load points to {dataset}, which is a file; it takes a directory",
        ),
        (f"model.model_name_or_path={dataset}", "which is a file; it takes a directory"),
        (
            f"data.dataset_param.basic_parameters.dataset={model}",
            f"dataset points to {model}, which is a directory; it takes a file",
        ),
    ]
    for override, message in cases:
        overrides = [*machine_paths["overrides"], override]
        plan = plan_launch(EIGHT_CARD, overrides, LaunchOptions(dry_run=True))
        assert any(message in w for w in plan.warnings), plan.warnings
        with pytest.raises(UserError, match=re.escape(message)):
            plan_launch(EIGHT_CARD, overrides, LaunchOptions(dry_run=False))
    assert not machine_paths["run"].exists()


def test_unknown_key_in_a_recipe_file_exits_2_and_names_the_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(EIGHT_CARD.read_text().replace("  lr: 1.0e-5", "  lrr: 1.0e-5"))
    result = runner.invoke(app, ["train", str(recipe), "--dry-run"])
    assert result.exit_code == 2
    assert "unknown key training.lrr (did you mean training.lr?)" in result.output


def test_npu_environment_defaults_and_user_precedence(machine_paths, monkeypatch):
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "99")
    plan = plan_launch(
        EIGHT_CARD, [*machine_paths["overrides"], "parallel.device=npu"], LaunchOptions(dry_run=True)
    )
    assert plan.device == "npu"
    assert plan.env_kept["HCCL_CONNECT_TIMEOUT"] == "99"
    assert "HCCL_CONNECT_TIMEOUT" not in plan.env_added
    for key in (
        "PYTORCH_NPU_ALLOC_CONF",
        "MULTI_STREAM_MEMORY_REUSE",
        "TASK_QUEUE_ENABLE",
        "CPU_AFFINITY_CONF",
    ):
        assert plan.env_added[key] == NPU_ENV[key]
    assert any("no npu device" in w for w in plan.warnings)
    assert "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in plan.command_line


def test_a_requested_device_that_is_absent_stops_a_real_launch(machine_paths):
    with pytest.raises(UserError, match="no cuda device is visible"):
        plan_launch(EIGHT_CARD, [*machine_paths["overrides"], "parallel.device=cuda"], LaunchOptions())


def test_cpu_threads_are_split_between_ranks(machine_paths, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = plan_launch(EIGHT_CARD, machine_paths["overrides"], LaunchOptions(nproc_per_node=2, dry_run=True))
    assert plan.device == "cpu"
    assert int(plan.env_added["OMP_NUM_THREADS"]) >= 1


def test_merge_env_keeps_the_users_value():
    added, kept = merge_env({"A": "1", "B": "2"}, {"B": "mine"})
    assert added == {"A": "1"} and kept == {"B": "mine"}


def test_credentials_are_never_recorded():
    env = {
        "HF_TOKEN": "hf_secret",
        "NCCL_DEBUG": "INFO",
        "HCCL_TOKEN_X": "s",
        "PATH": "/bin",
        "HF_ENDPOINT": "http://x",
    }
    assert relevant_environment(env) == {"HF_ENDPOINT": "http://x", "NCCL_DEBUG": "INFO"}


@pytest.mark.slow
class _Lines:
    """A console that keeps what the launcher prints."""

    def __init__(self):
        self.lines: list[str] = []

    def print(self, *args, **kwargs):
        self.lines.append(" ".join(str(a) for a in args))


def _tiny_overrides(tmp_path: Path, model: Path, load: Path) -> list[str]:
    return [
        f"model.model_name_or_path={model}",
        f"training.load={load}",
        "data.dataset_param.dataset_type=synthetic",
        "training.train_iters=2",
        f"training.output_dir={tmp_path / 'run'}",
    ]


def test_pre_flight_stops_a_bad_model_directory_before_any_rank_starts(tmp_path):
    model = tmp_path / "model"
    model.mkdir()  # no config.json: the engine could not start
    with pytest.raises(UserError, match="holds no config.json"):
        plan_launch(TINY, _tiny_overrides(tmp_path, model, model), LaunchOptions(nproc_per_node=1))
    assert not (tmp_path / "run" / "logs").exists(), "torchrun must not have started"


@pytest.mark.slow
def test_a_failing_rank_is_named_with_its_own_error(tmp_path):
    """A rank's user error (weights of another model): exit 2 and that rank's message, not torchrun's traceback."""
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    for name, vocab in (("model", 512), ("other", 256)):
        save_official_checkpoint(build_tiny_model(tiny_mistral3_config(vocab_size=vocab)), tmp_path / name)
    plan = plan_launch(
        TINY,
        _tiny_overrides(tmp_path, tmp_path / "model", tmp_path / "other"),
        LaunchOptions(nproc_per_node=2),
    )
    console = _Lines()
    code = run_launch(plan, console)
    assert code == 2
    report = "\n".join(console.lines)
    # Both ranks load the same files and fail alike: whichever error torchrun records first is named.
    assert re.search(r"rank [01] failed: cannot load", report), report
    assert "the checkpoint belongs to another model config" in report
    assert "Traceback" not in report
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["exit_status"] == 2
    assert "ChildFailedError" in (tmp_path / "run" / "logs" / "torchrun_failure.log").read_text()


@pytest.mark.slow
def test_a_killed_rank_exits_1_with_its_log_tail(tmp_path, monkeypatch):
    from magistral_cli.engine.checkpoint import FAULT_ENV
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    save_official_checkpoint(build_tiny_model(tiny_mistral3_config(vocab_size=512)), tmp_path / "model")
    overrides = [
        *_tiny_overrides(tmp_path, tmp_path / "model", tmp_path / "model"),
        "training.save_interval=1",
    ]
    monkeypatch.setenv(FAULT_ENV, "kill-during-save:1:0")
    plan = plan_launch(TINY, overrides, LaunchOptions(nproc_per_node=2))
    console = _Lines()
    assert run_launch(plan, console) == 1
    report = "\n".join(console.lines)
    assert report.splitlines()[1].startswith("rank 0 was killed by signal 9 (SIGKILL)")  # the cause first
    assert "fault injection: killing rank 0" in report  # its log's last lines


def test_the_trainer_adds_its_resolved_choices_to_the_launchers_identity(machine_paths):
    """record_resolved keeps what the launcher wrote and adds the device-side choices under "resolved"."""
    from magistral_cli.launch.identity import record_resolved

    plan = plan_launch(
        EIGHT_CARD, machine_paths["overrides"], LaunchOptions(dry_run=True, write_run_dir=True)
    )
    path = plan.run_dir / "run_identity.json"
    launched = json.loads(path.read_text())
    choice = {"implementation": "foreach", "reason": "training.adam_fused is false"}
    assert record_resolved(plan.run_dir, adamw=choice) == path
    record_resolved(plan.run_dir, attention="sdpa")
    assert json.loads(path.read_text()) == {**launched, "resolved": {"adamw": choice, "attention": "sdpa"}}
    assert sorted(p.name for p in plan.run_dir.iterdir()) == [
        ".magistral.lock",  # the run directory's lock file (free after the plan)
        "logs",
        "resolved_config.yaml",
        "run_identity.json",
    ]

    with pytest.raises(TypeError):  # not JSON: the file on disk is left as it was
        record_resolved(plan.run_dir, bad=object())
    assert json.loads(path.read_text())["resolved"] == {"adamw": choice, "attention": "sdpa"}
    path.write_text("{half")
    with pytest.raises(UserError, match="is not valid JSON"):
        record_resolved(plan.run_dir, adamw=choice)


def test_the_dry_run_json_carries_a_memory_plan_when_the_config_is_there(machine_paths):
    """Without config.json the plan is skipped with a warning; with the real one it joins the JSON."""
    no_config = runner.invoke(
        app, ["train", str(EIGHT_CARD), *machine_paths["overrides"], "--dry-run", "--json"]
    )
    assert no_config.exit_code == 0, no_config.output
    skipped = json.loads(no_config.stdout)
    assert skipped["memory_plan"] is None
    assert any("no memory plan" in w and "config.json" in w for w in skipped["warnings"])

    config = REPO / "tests" / "fixtures" / "magistral-small-2509" / "config.json"
    (machine_paths["model"] / "config.json").write_text(config.read_text())
    result = runner.invoke(
        app, ["train", str(EIGHT_CARD), *machine_paths["overrides"], "--dry-run", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["world_size"] == 8 and out["command"] == skipped["command"]  # the existing keys are unchanged
    plan = out["memory_plan"]
    assert plan["parameters"]["total"] == plan["parameters"]["trainable"] + plan["parameters"]["frozen"]
    memory = plan["memory"]
    assert set(memory["items"]) >= {"parameter_shards", "gradient_shards", "optimizer_states", "loss_logits"}
    assert memory["per_rank_device_gib"] == max(memory["phases_gib"].values())
    assert memory["per_rank_host_gib"] >= 0


def test_a_too_old_tokenizer_stops_the_launch_before_any_rank_starts(tmp_path):
    """Seen: a Tekken v3 tokenizer was found only after the ranks built and sharded the model, followed by
    torchrun's traceback. The launcher encodes the data itself, before torchrun."""
    from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset, write_tiny_tokenizer_files
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    model = tmp_path / "model"
    save_official_checkpoint(build_tiny_model(tiny_mistral3_config()), model)
    tekken = write_tiny_tokenizer_files(model)
    data = json.loads(tekken.read_text())
    data["config"]["version"] = "v3"
    tekken.write_text(json.dumps(data))
    write_synthetic_llava_dataset(tmp_path / "data", 4)
    overrides = [
        f"model.model_name_or_path={model}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"training.load={model}",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp_path / 'data'}",
        f"data.dataset_param.basic_parameters.dataset={tmp_path / 'data' / 'data.jsonl'}",
        f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}",
        f"training.output_dir={tmp_path / 'run'}",
    ]
    result = CliRunner().invoke(app, ["train", str(TINY), *overrides, "--nproc-per-node", "2"])
    assert result.exit_code == 2, result.output
    assert "is Tekken v3" in result.output and "Traceback" not in result.output
    assert not list((tmp_path / "run" / "logs").iterdir()), "torchrun must not have started"


def _statuses(run_dir: Path, **records: dict) -> None:
    (run_dir / "rank_status").mkdir(parents=True)
    for name, record in records.items():
        (run_dir / "rank_status" / f"{name}.json").write_text(json.dumps(record), encoding="utf-8")


def test_a_rank_stopped_by_torchrun_after_a_user_error_keeps_exit_2(tmp_path):
    """torchrun SIGTERMs the other ranks when one fails; one killed before it recorded a status is
    that consequence, not a second failure (under load this race turned exit 2 into exit 1)."""
    from magistral_cli.launch.supervise import failure_report

    error = "cannot load /m: the checkpoint belongs to another model config"
    _statuses(tmp_path, rank0={"rank": 0, "exit_status": 2, "kind": "user", "error": error})
    lines, status = failure_report(tmp_path, 1, 2)
    assert status == 2
    assert lines[0] == f"rank 0 failed: {error}"
    assert "rank(s) 1 stopped by torchrun after that failure" in lines[1]
    # a crash next to it is still exit 1
    other = tmp_path / "crash"
    _statuses(
        other,
        rank0={"rank": 0, "exit_status": 2, "kind": "user", "error": error},
        rank1={"rank": 1, "exit_status": 1, "kind": "crash", "error": "RuntimeError: boom"},
    )
    lines, status = failure_report(other, 1, 2)
    assert status == 1 and any("rank 1 crashed: RuntimeError: boom" in x for x in lines)
    # no status at all: killed, exit 1 (unchanged)
    lines, status = failure_report(tmp_path / "none", 1, 2)
    assert status == 1 and "ended without a status" in lines[0]


def test_a_rank_killed_by_a_signal_comes_first_and_torchruns_own_stops_after(tmp_path):
    """torchrun's report gives the signal; the lost connection of the other rank is named after it."""
    from magistral_cli.launch.supervise import failure_report

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "torchrun_failure.log").write_text(
        "Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 11)\n"
        "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -9 (pid: 12)  (SIGKILL)\n"
    )
    lines, status = failure_report(tmp_path, 1, 2)
    assert status == 1
    assert lines[0] == "rank 1 was killed by signal 9 (SIGKILL): the out-of-memory killer or a `kill -9`"
    assert lines[-1] == "rank(s) 0 stopped by torchrun after that failure"
    error = "RuntimeError: [gloo/pair.cc:553] Connection closed by peer"
    _statuses(tmp_path, rank0={"rank": 0, "exit_status": 1, "kind": "crash", "error": error})
    lines, status = failure_report(tmp_path, 1, 2)
    assert status == 1 and lines[0].startswith("rank 1 was killed by signal 9")
    assert lines[-1] == f"rank 0 crashed after rank 1 was killed: {error}"
    # as a rank records it now: its lost connection is named after the kill, without a traceback
    (tmp_path / "rank_status" / "rank0.json").write_text(
        json.dumps({"rank": 0, "exit_status": 1, "kind": "lost", "error": error, "failed_at": 5.0})
    )
    lines, status = failure_report(tmp_path, 1, 2)
    assert status == 1 and lines[0].startswith("rank 1 was killed by signal 9")
    assert lines[-1] == "rank(s) 0 lost the connection after that failure"


def test_the_earliest_failure_comes_first_and_a_lost_connection_after_it(tmp_path):
    """Rank 1 fails on bad input; rank 0's collective then loses its connection. Rank order put rank
    0's "Connection closed by peer" first (exit 1); the earliest failure is the cause (exit 2)."""
    from magistral_cli.launch.supervise import failure_report

    lost = "RuntimeError: [gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:17299"
    image = "image /d/7.png of sample 7 changed since preprocessing: re-run magistral preprocess"
    _statuses(
        tmp_path / "user",
        rank0={"rank": 0, "exit_status": 1, "kind": "lost", "error": lost, "failed_at": 100.5},
        rank1={"rank": 1, "exit_status": 2, "kind": "user", "error": image, "failed_at": 100.2},
    )
    assert failure_report(tmp_path / "user", 1, 2) == (
        [f"rank 1 failed: {image}", "rank(s) 0 lost the connection after that failure"],
        2,
    )
    # two failures of their own: the earlier one first, whatever the rank
    _statuses(
        tmp_path / "crash",
        rank0={"rank": 0, "exit_status": 1, "kind": "crash", "error": "RuntimeError: b", "failed_at": 9.0},
        rank1={"rank": 1, "exit_status": 1, "kind": "crash", "error": "RuntimeError: a", "failed_at": 8.0},
        rank2={"rank": 2, "exit_status": 1, "kind": "lost", "error": lost, "failed_at": 9.5},
    )
    lines, status = failure_report(tmp_path / "crash", 1, 3)
    crashed = [line for line in lines if line.startswith("rank ")]
    assert crashed == ["rank 1 crashed: RuntimeError: a", "rank 0 crashed: RuntimeError: b"]
    assert (lines[-1], status) == ("rank(s) 2 lost the connection after that failure", 1)
    # nothing but lost connections: those are all there is, named as they are
    _statuses(
        tmp_path / "only",
        rank0={"rank": 0, "exit_status": 1, "kind": "lost", "error": lost, "failed_at": 1.0},
        rank1={"rank": 1, "exit_status": 1, "kind": "lost", "error": lost, "failed_at": 1.0},
    )
    lines, status = failure_report(tmp_path / "only", 1, 2)
    assert (lines, status) == ([f"rank 0 crashed: {lost}", f"rank 1 crashed: {lost}"], 1)


_TORCHRUN_STDERR = [
    "W1206 rank 0 warming up\n",
    "Traceback (most recent call last):\n",
    '  File "run.py", line 1, in <module>\n',
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
    "rank : 1 (local_rank: 1)\n",
]


@pytest.mark.parametrize(
    "failure_log",
    [
        Path("/dev/full"),  # every write fails with ENOSPC, as on a full disk
        Path("/nonexistent-dir/logs/torchrun_failure.log"),  # the file cannot be created
    ],
    ids=["disk-full", "cannot-create"],
)
def test_torchrun_stderr_is_drained_to_the_end_when_the_failure_log_fails(failure_log, capsys):
    """A failing report file never stops the copy (a stopped reader would block torchrun)."""
    import io

    from magistral_cli.launch import supervise

    if failure_log == Path("/dev/full") and not failure_log.exists():
        pytest.skip("no /dev/full on this machine")
    stream = io.StringIO("".join(_TORCHRUN_STDERR))
    supervise._forward_stderr(stream, failure_log)
    err = capsys.readouterr().err
    assert stream.read() == ""  # read to the end
    assert f"cannot keep torchrun's failure report in {failure_log}" in err
    for line in _TORCHRUN_STDERR:
        assert line in err  # the warning before the report, and the whole report after the note
    assert "Traceback (most recent call last):\n" in err.split("cannot keep")[1]


def test_torchrun_failure_report_goes_to_its_file(tmp_path, capsys):
    import io

    from magistral_cli.launch import supervise

    log = tmp_path / "torchrun_failure.log"
    supervise._forward_stderr(io.StringIO("".join(_TORCHRUN_STDERR)), log)
    assert capsys.readouterr().err == _TORCHRUN_STDERR[0]
    assert log.read_text() == "".join(_TORCHRUN_STDERR[1:])
