"""`magistral train --slurm`: the sbatch script (checked line by line for 2 nodes x 8 GPUs), its
torchrun line run for real on the CPU (1 node, 2 processes, c10d rendezvous on 127.0.0.1), and
the submission (never with --dry-run; a clear error without sbatch)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from magistral_cli.cli.main import app
from magistral_cli.errors import UserError
from magistral_cli.launch.slurm import SlurmOptions, plan_slurm

REPO = Path(__file__).resolve().parents[2]
EIGHT_CARD = REPO / "recipes" / "magistral-small-2509" / "v1_8card.yaml"
TINY = REPO / "recipes" / "tiny" / "tiny_cpu.yaml"
PY = shlex.quote(sys.executable)
runner = CliRunner()


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """The 8-card recipe's machine paths (a fetch manifest, a dataset file), as overrides; cwd = tmp."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "Magistral-Small-2509"
    model.mkdir()
    manifest = {"format": 1, "files": [{"name": "config.json", "sha256": "ab" * 32, "bytes": 3}]}
    (model / "magistral-manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "data").mkdir()
    dataset = tmp_path / "data" / "llava.json"
    dataset.write_text('[{"messages": [], "images": []}]')
    run = tmp_path / "shared" / "run-2x8"
    overrides = [
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        f"model.model_name_or_path={model}",
        f"training.load={model}",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp_path / 'data'}",
        f"data.dataset_param.basic_parameters.dataset={dataset}",
        f"training.output_dir={run}",
    ]
    return {"tmp": tmp_path, "run": run, "overrides": overrides}


def test_the_2_node_x_8_gpu_script_line_by_line(machine):
    run, tmp = machine["run"], machine["tmp"]
    options = SlurmOptions(nodes=2, gpus_per_node=8, partition="gpu", time="2-00:00:00", account="mm-ft")
    plan = plan_slurm(EIGHT_CARD, machine["overrides"], options)
    assert plan.script == run / "train.sbatch" and plan.script.read_text() == plan.text
    expected = [
        "#!/bin/bash",
        f"# Written by `magistral train --slurm` from {EIGHT_CARD} (overrides: {' '.join(machine['overrides'])}).",
        f"# Submit it with: sbatch {run}/train.sbatch",
        "#SBATCH --job-name=run-2x8",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --account=mm-ft",
        f"#SBATCH --output={run}/logs/slurm-%j.out",
        f"#SBATCH --chdir={tmp}",
        "set -euo pipefail",
        "",
        "# cuda defaults of `magistral train`; a variable already set in the job's environment wins.",
        'export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"',
        'export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"',
        'export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"',
        "",
        "# torchrun's c10d rendezvous on the job's first node.",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'MASTER_PORT="${MASTER_PORT:-29500}"',
        f'RUN_DIR="{run}"',
        "# A summary or rank statuses left by an earlier launch into this run directory describe that launch.",
        'rm -rf "$RUN_DIR/summary.json" "$RUN_DIR/rank_status"',
        "# Encode the dataset (or find its cache entry) once, before any rank waits for it.",
        f'{PY} -m magistral_cli preprocess "$RUN_DIR/resolved_config.yaml"',
        "",
        f"srun --kill-on-bad-exit=1 {PY} -m torch.distributed.run"
        ' --nnodes "$SLURM_NNODES" --nproc-per-node 8'
        ' --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID"'
        ' --log-dir "$RUN_DIR/logs" --tee 3 --local-ranks-filter 0'
        ' -m magistral_cli.engine.run "$RUN_DIR/resolved_config.yaml"',
    ]
    got = plan.text.splitlines()
    for number, (line, want) in enumerate(zip(got, expected, strict=False), 1):
        assert line == want, f"line {number}"
    assert len(got) == len(expected)
    assert plan.text.endswith("\n") and os.access(plan.script, os.X_OK)
    subprocess.run(["bash", "-n", str(plan.script)], check=True)  # bash parses it

    # The run directory is the launcher's: the resolved recipe every node reads, and the identity.
    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["parallel"]["device"] == "cuda" and resolved["parallel"]["nproc_per_node"] == 8
    assert resolved["training"]["output_dir"] == str(run)
    identity = json.loads((run / "run_identity.json").read_text())
    assert (identity["world_size"], identity["nnodes"], identity["nproc_per_node"]) == (16, 2, 8)
    assert plan.to_json()["world_size"] == 16
    # No accelerator on the submitting machine is expected; /tmp is not shared storage.
    assert not any("visible" in w for w in plan.warnings)
    assert any("node-local storage" in w and str(run) in w for w in plan.warnings)


def test_the_users_environment_wins_over_the_scripts_defaults(machine):
    plan = plan_slurm(EIGHT_CARD, machine["overrides"], SlurmOptions(nodes=2, gpus_per_node=8))
    exports = "\n".join(line for line in plan.text.splitlines() if line.startswith("export "))
    show = exports + '\necho "$PYTORCH_ALLOC_CONF|$TORCH_NCCL_ASYNC_ERROR_HANDLING"'
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    }
    mine = subprocess.run(
        ["bash", "-c", show], env={**env, "PYTORCH_ALLOC_CONF": "mine"}, capture_output=True, text=True
    )
    assert mine.stdout.strip() == "mine|3"
    # No --partition / --time / --account given: no such lines (the cluster's defaults apply).
    assert not [line for line in plan.text.splitlines() if line.startswith(("#SBATCH --part", "#SBATCH --t"))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_line(text: str) -> str:
    """The script's ``srun ...`` line (the one command the job runs on every node)."""
    (line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    return line


@pytest.mark.slow
def test_the_scripts_torchrun_line_trains_the_tiny_recipe_on_the_cpu(tmp_path, monkeypatch):
    """The script as the job's first node runs it, with srun's one task and SLURM's variables
    given by hand: --nnodes 1 --nproc-per-node 2, the c10d rendezvous on 127.0.0.1."""
    from magistral_cli.testing.tiny_model import (
        build_tiny_model,
        save_official_checkpoint,
        tiny_mistral3_config,
    )

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    save_official_checkpoint(build_tiny_model(tiny_mistral3_config(vocab_size=512)), model)
    run = tmp_path / "run"
    overrides = [
        f"model.model_name_or_path={model}",
        f"training.load={model}",
        "data.dataset_param.dataset_type=synthetic",
        "training.train_iters=2",
        f"training.output_dir={run}",
    ]
    plan = plan_slurm(TINY, overrides, SlurmOptions(nodes=1, gpus_per_node=2))
    text = plan.text
    assert "#SBATCH --gpus-per-node" not in text and "preprocess" not in text  # CPU, synthetic data
    srun = _torchrun_line(plan.text)
    assert srun.startswith(f"srun --kill-on-bad-exit=1 {PY} -m torch.distributed.run ")
    assert ' --nnodes "$SLURM_NNODES" --nproc-per-node 2 --rdzv-backend c10d ' in srun
    # Run the script itself: srun's task is this process, MASTER_ADDR what scontrol would print.
    master = 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'
    assert text.count(master) == 1 and text.count(srun) == 1
    job = text.replace(master, 'MASTER_ADDR="127.0.0.1"').replace(
        srun, srun.removeprefix("srun --kill-on-bad-exit=1 ")
    )
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))
        },
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        ["bash", "-c", job], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and all(line["loss"] > 0 for line in lines)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["exit_status"] == 0
    statuses = sorted(p.name for p in (run / "rank_status").iterdir())
    assert statuses == ["rank0.json", "rank1.json"]
    # torchrun's per-rank logs under the run directory, named by the rendezvous id (the job id).
    assert sorted(p.name for p in (run / "logs").glob("4242_*/attempt_0/*")) == ["0", "1"]


def _sbatch_stub(directory: Path) -> Path:
    """A stand-in for SLURM's sbatch (none runs here): records its arguments, prints a job id."""
    directory.mkdir()
    calls = directory / "calls.txt"
    stub = directory / "sbatch"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "4711;cluster-a"\n')
    stub.chmod(0o755)
    return calls


def test_dry_run_writes_the_script_and_submits_nothing(machine, monkeypatch):
    calls = _sbatch_stub(machine["tmp"] / "bin")
    monkeypatch.setenv("PATH", f"{machine['tmp'] / 'bin'}{os.pathsep}{os.environ['PATH']}")
    args = [
        "train",
        str(EIGHT_CARD),
        *machine["overrides"],
        "--slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
    ]
    result = runner.invoke(app, [*args, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    script = machine["run"] / "train.sbatch"
    assert f"sbatch script  {script}" in result.stderr
    assert f"dry run: not submitted; submit it with: sbatch {script}" in result.stderr
    assert not calls.exists()  # sbatch was not called
    plan = json.loads(result.stdout)
    assert (plan["script"], plan["job_id"], plan["nodes"], plan["world_size"]) == (str(script), None, 2, 16)

    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert calls.read_text().split() == ["--parsable", str(script)]
    assert json.loads(result.stdout)["job_id"] == "4711"
    assert f"submitted job 4711; its log: {machine['run']}/logs/slurm-4711.out" in result.stderr


def test_without_sbatch_the_error_names_the_fix(machine, monkeypatch):
    empty = machine["tmp"] / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    result = runner.invoke(
        app, ["train", str(EIGHT_CARD), *machine["overrides"], "--slurm", "--gpus-per-node", "8"]
    )
    assert result.exit_code == 2, result.output
    assert "sbatch was not found on PATH" in result.stderr and "--dry-run" in result.stderr
    assert (machine["run"] / "train.sbatch").is_file()  # written, ready to submit by hand
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nodes", "2"], "--nodes only apply with --slurm"),
        (["--slurm", "--nnodes", "2"], "--slurm takes --nodes N"),
        (["--slurm", "--time", "two days"], "is not a SLURM time limit"),
        (["--slurm", "--partition", "gpu;rm"], "--partition 'gpu;rm'"),
        (["--slurm", "--gpus-per-node", "8", "--nproc-per-node", "4"], "differ"),
    ],
)
def test_bad_slurm_flags_exit_2(machine, extra, message):
    result = runner.invoke(app, ["train", str(EIGHT_CARD), *machine["overrides"], *extra, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert not (machine["run"] / "train.sbatch").exists()


def test_a_run_directory_is_chosen_under_the_submitting_directory(machine):
    overrides = [o for o in machine["overrides"] if not o.startswith("training.output_dir=")]
    plan = plan_slurm(EIGHT_CARD, overrides, SlurmOptions(nodes=2, gpus_per_node=8))
    assert plan.launch.run_dir.parent == machine["tmp"] / "runs"
    assert plan.launch.run_dir.name.startswith("v1_8card-")
    with pytest.raises(UserError, match="--gpus-per-node"):
        plan_slurm(EIGHT_CARD, [*machine["overrides"], "parallel.nproc_per_node=null"], SlurmOptions())


def test_a_submission_checks_inputs_and_the_logger_package_first(machine, monkeypatch):
    calls = _sbatch_stub(machine["tmp"] / "bin")
    monkeypatch.setenv("PATH", f"{machine['tmp'] / 'bin'}{os.pathsep}{os.environ['PATH']}")
    gone = machine["tmp"] / "gone.json"
    base = ["train", str(EIGHT_CARD), *machine["overrides"], "--slurm", "--gpus-per-node", "8"]
    missing_data = [*base, f"data.dataset_param.basic_parameters.dataset={gone}"]
    result = runner.invoke(app, missing_data)
    assert result.exit_code == 2 and f"points to {gone}, which does not exist" in result.stderr
    assert not machine["run"].exists() and not calls.exists()
    result = runner.invoke(app, [*missing_data, "--dry-run"])  # a dry run (often elsewhere) warns
    assert (
        result.exit_code == 0 and "warning:" in result.stderr and (machine["run"] / "train.sbatch").exists()
    )

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    result = runner.invoke(app, [*base, "tools.logger=wandb"])
    assert result.exit_code == 2, result.output
    assert "pip install 'magistral-cli[wandb]'" in result.stderr and not calls.exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700)])
def test_the_script_follows_the_umask(machine, umask, mode):
    import os

    old = os.umask(umask)
    try:
        plan = plan_slurm(EIGHT_CARD, machine["overrides"], SlurmOptions(nodes=2, gpus_per_node=8))
    finally:
        os.umask(old)
    assert plan.script.stat().st_mode & 0o777 == mode
