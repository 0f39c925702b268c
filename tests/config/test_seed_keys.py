"""Every key of the seed's four configs takes effect or is refused: none is accepted and ignored.

The keys are read from tests/fixtures/seed_configs/*.yaml, so a key the seed adds fails
``test_every_seed_key_has_a_check`` until ``CHECKS`` says how it is checked. Each check changes one
key of a seed config to another value and proves one of:

- ``Reads``: the resolved recipe holds the new value and the named consumer module reads the
  field (its source has ``<needle>``, by default ``.<leaf>``): the engine/data side uses it.
- ``Probe``: a function the engine calls returns something else for the new value.
- ``Refused``: the new value is refused with a UserError (exit 2) that names the key and the fix;
  the seed's value is accepted because it means what this tool does.
- ``Gated``: the key is read only behind a switch whose other value is refused, so it can never
  take effect (logged once as unused, ``compatibility_notes``).
"""

from __future__ import annotations

import copy
import json
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from magistral_cli.config import check_world_size, validate_recipe
from magistral_cli.config.loader import log_compatibility_notes
from magistral_cli.config.schema import StaticProfileParam, compatibility_notes
from magistral_cli.engine.parallelize import prefetch_plan
from magistral_cli.engine.profiling import StepProfiler, npu_profiler_kwargs
from magistral_cli.errors import UserError

REPO = Path(__file__).resolve().parents[2]
SEED_CONFIGS = sorted((REPO / "tests" / "fixtures" / "seed_configs").glob("*.yaml"))
SOURCE = REPO / "magistral_cli"


def _leaves(data: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every non-mapping value (a list is one value)."""
    out = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(_leaves(value, path))
        else:
            out[path] = value
    return out


def _seed_keys() -> dict[str, tuple[Path, Any]]:
    """Every dotted key of the four seed configs, with the first config that has it and its value."""
    keys: dict[str, tuple[Path, Any]] = {}
    for path in SEED_CONFIGS:
        for key, value in _leaves(yaml.safe_load(path.read_text(encoding="utf-8"))).items():
            keys.setdefault(key, (path, value))
    return keys


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _set(data: dict, key: str, value: Any) -> dict:
    data = copy.deepcopy(data)
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return data


@dataclass(frozen=True)
class Reads:
    other: Any
    where: str  # module under magistral_cli/ that consumes the field
    needle: str | None = None  # default: ".<leaf>" as a word


@dataclass(frozen=True)
class Probe:
    other: Any
    probe: Callable[[Any], Any]


@dataclass(frozen=True)
class Refused:
    other: Any
    match: str


@dataclass(frozen=True)
class Gated:
    gate: str
    gate_value: Any
    match: str


def _world(recipe) -> Any:
    try:
        return check_world_size(recipe, 8)
    except UserError as exc:
        return str(exc)


def _prefetch(recipe) -> list:
    plan = recipe.parallel.fsdp_plan
    return prefetch_plan(list(range(6)), plan.num_to_forward_prefetch, plan.num_to_backward_prefetch)


class _Names:
    """Stands in for a torch_npu.profiler enum: each member is its own name."""

    def __getattr__(self, name: str) -> str:
        return name


FAKE_NPU_PROFILER = types.SimpleNamespace(
    ProfilerActivity=types.SimpleNamespace(CPU="CPU", NPU="NPU"),
    ProfilerLevel=_Names(),
    AiCMetrics=_Names(),
    _ExperimentalConfig=lambda **kwargs: kwargs,
    tensorboard_trace_handler=lambda path: ("handler", path),
)


def _npu_profiler(recipe) -> dict:
    """What the NPU profiler would be built with (torch_npu replaced by FAKE_NPU_PROFILER)."""
    return npu_profiler_kwargs(recipe.tools.profile.static_param, FAKE_NPU_PROFILER, Path("trace"))


PRE = "data.dataset_param.preprocess_parameters"
BASIC = "data.dataset_param.basic_parameters"
ATTR = "data.dataset_param.attr"
LOADER = "data.dataloader_param"
STATIC = "tools.profile.static_param"
MEM = "tools.memory_profile"

CHECKS: dict[str, Reads | Probe | Refused | Gated] = {
    # parallel
    "parallel.tensor_parallel_size": Refused(2, "tensor parallelism is not supported"),
    "parallel.fully_shard_parallel_size": Probe(4, _world),
    "parallel.fsdp_plan.apply_modules": Reads(["lm_head"], "engine/parallelize.py"),
    "parallel.fsdp_plan.param_dtype": Reads("fp32", "engine/parallelize.py"),
    "parallel.fsdp_plan.reduce_dtype": Reads("fp32", "engine/parallelize.py"),
    "parallel.fsdp_plan.num_to_forward_prefetch": Probe(2, _prefetch),
    "parallel.fsdp_plan.num_to_backward_prefetch": Probe(2, _prefetch),
    "parallel.fsdp_plan.use_triton_split_copy": Reads(False, "engine/parallelize.py"),
    "parallel.ring_attention_size": Reads(2, "engine/parallelize.py"),
    "parallel.ulysses_parallel_size": Reads(2, "engine/parallelize.py"),
    # data: dataset
    "data.dataset_param.dataset_type": Reads("synthetic", "engine/data.py", ".is_synthetic"),
    f"{ATTR}.images": Reads("pictures", "data/readers.py"),
    f"{ATTR}.messages": Reads("turns", "data/readers.py"),
    f"{ATTR}.role_tag": Reads("from", "data/readers.py"),
    f"{ATTR}.content_tag": Reads("value", "data/readers.py"),
    f"{ATTR}.user_tag": Reads("human", "data/readers.py"),
    f"{ATTR}.assistant_tag": Reads("gpt", "data/readers.py"),
    f"{PRE}.model_name_or_path": Reads(
        "/other/model", "data/pipeline.py", "preprocess_parameters.model_name_or_path"
    ),
    f"{PRE}.use_fast_tokenizer": Refused(
        False, "false is not supported.*always the fast one.*set it to true"
    ),
    f"{PRE}.split_special_tokens": Reads(True, "data/pipeline.py"),
    f"{PRE}.image_max_pixels": Reads(500_000, "data/pipeline.py"),
    f"{PRE}.image_min_pixels": Reads(4096, "data/pipeline.py"),
    f"{PRE}.video_max_pixels": Refused(65536, "videos are not supported.*keep the seed's value 16384"),
    f"{PRE}.video_min_pixels": Refused(256, "videos are not supported.*keep the seed's value 0"),
    f"{PRE}.video_fps": Refused(1.0, "videos are not supported.*keep the seed's value 2.0"),
    f"{PRE}.video_maxlen": Refused(128, "videos are not supported.*keep the seed's value 64"),
    # Behaviour on a tokenizer.json: tests/data/test_data_tokenizer.py::test_broken_regex_needs_fix_mistral_regex;
    # with tekken.json both values give Tekken's regex (test_fix_mistral_regex_is_tekkens_own_regex).
    f"{PRE}.fix_mistral_regex": Reads(False, "data/pipeline.py"),
    f"{PRE}.trust_remote_code": Refused(True, "true is not supported here.*never runs code.*set it to false"),
    f"{BASIC}.cutoff_len": Reads(4096, "data/pipeline.py"),
    f"{BASIC}.template": Refused("other", "template 'other' is not supported; Magistral uses 'mistral'"),
    f"{BASIC}.enable_thinking": Reads(True, "data/encoder.py"),
    f"{BASIC}.train_on_prompt": Reads(True, "data/encoder.py"),
    f"{BASIC}.mask_history": Reads(True, "data/encoder.py"),
    f"{BASIC}.dataset_dir": Reads("/other/dir", "data/pipeline.py"),
    f"{BASIC}.dataset": Reads("/other/data.json", "data/pipeline.py"),
    f"{BASIC}.cache_dir": Reads("/other/cache", "data/pipeline.py"),
    f"{BASIC}.overwrite_cache": Reads(True, "data/pipeline.py"),
    f"{BASIC}.preprocessing_batch_size": Reads(10, "data/pipeline.py"),
    f"{BASIC}.preprocessing_num_workers": Reads(2, "data/pipeline.py"),
    f"{BASIC}.max_samples": Reads(100, "data/pipeline.py"),
    # data: loading
    f"{LOADER}.pin_memory": Reads(False, "data/loader.py"),
    f"{LOADER}.shuffle": Reads(False, "data/loader.py"),
    f"{LOADER}.dataloader_mode": Reads("other", "data/loader.py"),
    f"{LOADER}.drop_last": Reads(False, "data/loader.py"),
    f"{LOADER}.sampler_type": Reads("other", "data/loader.py"),
    f"{LOADER}.num_workers": Reads(2, "data/loader.py"),
    f"{LOADER}.infinite_sampler": Reads(False, "data/loader.py"),
    f"{LOADER}.collate_param.collator_id": Reads("other", "data/loader.py"),
    f"{LOADER}.collate_param.ignore_pad_token_for_loss": Reads(False, "data/loader.py"),
    f"{LOADER}.enable_preload": Refused(
        True, "true is not supported: there is no preload stage.*set it to false"
    ),
    # model
    "model.model_id": Refused("qwen2_vl", "not supported; this tool trains 'mistral3'"),
    "model.model_name_or_path": Reads("/other/model", "engine/trainer.py", "model.model_name_or_path"),
    "model.trust_remote_code": Reads(True, "engine/trainer.py", "model.trust_remote_code"),
    "model.attn_implementation": Reads("sdpa", "engine/trainer.py"),
    "model.freeze": Reads(["model.vision_tower"], "engine/parallelize.py", "model.freeze"),
    # features
    "features.loss_cfg.loss_type": Reads("per_token_loss", "engine/trainer.py"),
    "features.recompute": Reads(False, "engine/parallelize.py", "features.recompute"),
    "features.recompute_plan.apply_modules": Reads(
        ["model.language_model.layers.{*}"], "engine/parallelize.py", "recompute_plan.apply_modules"
    ),
    "features.enable_chunk_loss": Reads(True, "engine/trainer.py"),
    "features.chunkloss_plan.apply_module": Reads("other", "engine/trainer.py"),
    "features.chunkloss_plan.chunk_size": Reads(256, "engine/trainer.py"),
    "features.contiguous_linear_grad_modules": Reads([], "engine/parallelize.py"),
    "features.activation_offload_plan.apply_modules": Gated(
        "features.enable_activation_offload", True, "activation offload is not supported"
    ),
    # training
    "training.micro_batch_size": Reads(2, "engine/data.py"),
    "training.gradient_accumulation_steps": Reads(4, "engine/trainer.py"),
    "training.seed": Reads(7, "engine/trainer.py"),
    "training.lr": Reads(2e-5, "engine/optim.py"),
    "training.lr_decay_style": Reads("linear", "engine/optim.py"),
    "training.lr_warmup_ratio": Reads(0.0, "engine/optim.py"),
    "training.weight_decay": Reads(0.1, "engine/optim.py"),
    "training.train_iters": Reads(10, "engine/trainer.py"),
    "training.clip_grad": Reads(1.0, "engine/trainer.py"),
    "training.init_model_with_meta_device": Reads(False, "engine/trainer.py"),
    "training.optimizer": Reads("adamw_swap", "engine/optim.py"),
    "training.adam_fused": Reads(False, "engine/optim.py"),
    "training.log_interval": Reads(10, "engine/trainer.py"),
    "training.save_interval": Reads(5, "engine/trainer.py"),
    "training.load": Reads("/other/model", "engine/trainer.py"),
    "training.load_format": Reads("dcp", "engine/resume.py"),
    "training.load_strict": Reads(False, "engine/resume.py"),
    "training.no_load_optim": Reads(False, "engine/resume.py"),
    "training.no_load_rng": Reads(False, "engine/resume.py"),
    "training.no_save_optim": Reads(False, "engine/resume.py"),
    "training.no_save_rng": Reads(False, "engine/resume.py"),
    "training.use_deter_comp": Reads(True, "engine/trainer.py"),
    "training.freeze_gc_after_init": Reads(False, "engine/trainer.py"),
    "training.plugin": Refused(["mindspeed_mm/fsdp/models/qwen3omni"], "imports no MindSpeed-MM plugins"),
    # tools
    "tools.profile.enable": Reads(True, "engine/profiling.py"),
    "tools.profile.profile_type": Refused("dynamic", "only 'static' profiling"),
    "tools.profile.ranks": Reads([0, 1], "engine/profiling.py"),
    f"{STATIC}.level": Probe("level2", _npu_profiler),
    f"{STATIC}.with_stack": Reads(True, "engine/profiling.py"),
    f"{STATIC}.with_memory": Reads(True, "engine/profiling.py"),
    f"{STATIC}.record_shapes": Reads(True, "engine/profiling.py"),
    f"{STATIC}.with_cpu": Probe(False, _npu_profiler),
    f"{STATIC}.save_path": Reads("/other/profiling", "engine/profiling.py"),
    f"{STATIC}.start_step": Reads(5, "engine/profiling.py"),
    f"{STATIC}.end_step": Reads(12, "engine/profiling.py"),
    f"{STATIC}.data_simplification": Probe(True, _npu_profiler),
    f"{STATIC}.aic_metrics_type": Probe("ArithmeticUtilization", _npu_profiler),
    f"{MEM}.enable": Reads(True, "engine/profiling.py"),
    f"{MEM}.start_step": Reads(3, "engine/profiling.py"),
    f"{MEM}.end_step": Reads(4, "engine/profiling.py"),
    f"{MEM}.save_path": Reads("/other/snapshot", "engine/profiling.py"),
    f"{MEM}.dump_ranks": Reads([0, 1], "engine/profiling.py"),
    f"{MEM}.stacks": Reads("python", "engine/profiling.py"),
    f"{MEM}.max_entries": Reads(1000, "engine/profiling.py"),
    f"{MEM}.mem_info": Reads(True, "engine/profiling.py"),
}

SEED_KEYS = _seed_keys()


def test_every_seed_key_has_a_check():
    assert len(SEED_CONFIGS) == 4
    missing = sorted(set(SEED_KEYS) - set(CHECKS))
    assert not missing, (
        f"seed keys with no entry in CHECKS (say how each takes effect or is refused): {missing}"
    )
    stale = sorted(set(CHECKS) - set(SEED_KEYS))
    assert not stale, f"CHECKS entries for keys no seed config has: {stale}"


@pytest.mark.parametrize("key", sorted(CHECKS), ids=str)
def test_seed_key_takes_effect_or_is_refused(key):
    path, seed_value = SEED_KEYS[key]
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    seed = validate_recipe(copy.deepcopy(data))  # the seed's own value is accepted
    check = CHECKS[key]
    if isinstance(check, Refused):
        assert check.other != seed_value
        with pytest.raises(UserError) as info:
            validate_recipe(_set(data, key, check.other))
        message = str(info.value)
        assert key in message, message  # the message names the key ...
        assert re.search(check.match, message), message  # ... and what to do
        return
    if isinstance(check, Gated):
        with pytest.raises(UserError, match=check.match) as info:
            validate_recipe(_set(data, check.gate, check.gate_value))
        assert check.gate in str(info.value)
        assert any(key.rsplit(".", 1)[0] in note for note in compatibility_notes(seed)), "logged as unused"
        return
    changed = validate_recipe(_set(data, key, check.other))
    if isinstance(check, Probe):
        assert check.probe(changed) != check.probe(seed), f"{key}: {check.other!r} changes nothing"
        return
    assert _get(changed, key) == check.other != _get(seed, key)
    source = (SOURCE / check.where).read_text(encoding="utf-8")
    needle = check.needle or "." + key.rsplit(".", 1)[-1]
    assert re.search(re.escape(needle) + r"\b", source), f"{check.where} does not read {needle}"


def test_the_schema_is_not_a_consumer():
    """``Reads`` must name the code that uses a field, not the schema that declares it."""
    assert all(c.where != "config/schema.py" for c in CHECKS.values() if isinstance(c, Reads))


def test_accepted_plugin_paths_are_logged_once(caplog):
    path = SEED_CONFIGS[0]
    recipe = validate_recipe(yaml.safe_load(path.read_text(encoding="utf-8")))
    notes = compatibility_notes(recipe)
    assert any("training.plugin" in n and "built in" in n for n in notes)
    assert any("activation_offload_plan" in n and "not used" in n for n in notes)
    with caplog.at_level("INFO", logger="magistral_cli.config.loader"):
        first = log_compatibility_notes(recipe)
        again = log_compatibility_notes(recipe)
    assert again == [] and len([r for r in caplog.records if "training.plugin" in r.message]) <= 1
    assert first == [] or any("training.plugin" in n for n in first)  # an earlier load may have logged it
    # Plugin paths with a trailing slash or in dotted form are the same plugins; no plugin list, no note.
    for plugin in (["mindspeed_mm/fsdp/models/mistral3/"], ["mindspeed_mm.fsdp.data.datasets.huggingface"]):
        validate_recipe(_set(yaml.safe_load(path.read_text(encoding="utf-8")), "training.plugin", plugin))
    bare = validate_recipe({"training": {"train_iters": 1}})
    assert compatibility_notes(bare) == []


def test_npu_profiler_gets_the_seeds_options():
    kwargs = npu_profiler_kwargs(StaticProfileParam(), FAKE_NPU_PROFILER, Path("out"))
    assert kwargs["activities"] == ["CPU", "NPU"]
    assert kwargs["experimental_config"] == {
        "profiler_level": "Level1",
        "aic_metrics": "PipeUtilization",
        "data_simplification": False,
    }
    assert kwargs["on_trace_ready"] == ("handler", "out")
    npu = npu_profiler_kwargs(
        StaticProfileParam(level="level_none", aic_metrics_type="MemoryAccess", with_cpu=False),
        FAKE_NPU_PROFILER,
        Path("out"),
    )
    assert npu["activities"] == ["NPU"] and npu["experimental_config"]["profiler_level"] == "Level_none"


@pytest.mark.parametrize(
    ("field", "value"), [("level", "level2"), ("aic_metrics_type", "Memory"), ("data_simplification", True)]
)
def test_npu_only_profiler_options_are_refused_elsewhere(tmp_path, field, value):
    profile = {"enable": True, "static_param": {field: value}}
    recipe = validate_recipe({"training": {"train_iters": 1}, "tools": {"profile": profile}})
    with pytest.raises(UserError, match=rf"{field}=.*torch_npu profiler options.*on cpu"):
        StepProfiler(recipe.tools.profile, tmp_path, rank=0, device_type="cpu")
    StepProfiler(recipe.tools.profile, tmp_path, rank=0, device_type="npu")  # where they apply
    off = validate_recipe(
        {"training": {"train_iters": 1}, "tools": {"profile": {**profile, "enable": False}}}
    )
    StepProfiler(off.tools.profile, tmp_path, rank=0, device_type="cuda")  # not profiling: nothing to refuse


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("level", "level3", "unknown profiler level"), ("aic_metrics_type", "Pipe", "unknown AI-core metrics")],
)
def test_unknown_npu_profiler_values_are_refused(field, value, message):
    with pytest.raises(UserError, match=message):
        validate_recipe(
            {"training": {"train_iters": 1}, "tools": {"profile": {"static_param": {field: value}}}}
        )


def test_fix_mistral_regex_is_tekkens_own_regex():
    """With tekken.json the flag changes nothing: the file carries the regex the repair writes."""
    from magistral_cli.data.tokenizer import TEKKEN_PATTERN
    from magistral_cli.testing.tiny_data import tekken_path

    assert json.loads(tekken_path().read_text(encoding="utf-8"))["config"]["pattern"] == TEKKEN_PATTERN


def test_step_profiler_on_npu_runs_torch_npus_profiler(tmp_path, monkeypatch):
    """The NPU path end to end with torch_npu replaced: built with the recipe's options, entered, exited."""
    import sys

    calls = []

    class FakeProfile:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs))

        def __enter__(self):
            calls.append(("enter",))

        def __exit__(self, *exc):
            calls.append(("exit",))
            kwargs = calls[0][1]
            Path(kwargs["on_trace_ready"][1]).mkdir(parents=True)  # what tensorboard_trace_handler writes

    fake = types.SimpleNamespace(**vars(FAKE_NPU_PROFILER), profile=FakeProfile)
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(profiler=fake))
    monkeypatch.setitem(sys.modules, "torch_npu.profiler", fake)
    static = {"start_step": 2, "end_step": 4, "level": "level2", "aic_metrics_type": "Memory"}
    recipe = validate_recipe(
        {"training": {"train_iters": 5}, "tools": {"profile": {"enable": True, "static_param": static}}}
    )
    profiler = StepProfiler(recipe.tools.profile, tmp_path, rank=0, device_type="npu")
    for step in range(1, 6):
        profiler.before_step(step)
        profiler.after_step(step)
    assert [c[0] for c in calls] == ["init", "enter", "exit"]
    assert calls[0][1]["experimental_config"] == {
        "profiler_level": "Level2",
        "aic_metrics": "Memory",
        "data_simplification": False,
    }
    assert profiler.written == tmp_path / "profiling" / "rank0_steps2-3" and profiler.written.is_dir()
