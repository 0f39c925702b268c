"""The trainer in one process (a one-rank FSDP2 group on gloo), fp32 on the CPU.

Each test compares the engine with an independent computation: a plain transformers training
loop, another split of the same global batch, the plain loss, the on-device optimizer.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from magistral_cli.engine.optim import lr_at
from magistral_cli.engine.synthetic import SyntheticBatches
from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import UserError

from .helpers import VOCAB, full_params, make_recipe, write_tiny_model

pytestmark = [pytest.mark.compat, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    model = write_tiny_model(directory)
    return directory, model


def _run(recipe, steps=None):
    trainer = Trainer(recipe)
    try:
        records = trainer.train(max_steps=steps)
        return [r["loss"] for r in records], [r["grad_norm"] for r in records], full_params(trainer.model)
    finally:
        trainer.close()


#: After AdamW updates: the first steps move each weight by about lr * g / |g|, so gradients that
#: are ~0 and differ only by summation order can move a weight by a visible fraction of lr.
#: The gradients themselves are compared tightly (``_first_step_grads``).
UPDATE_ATOL = 1e-4  # 10% of the tests' lr


def _first_step_grads(recipe) -> dict:
    """Gradients of the first global batch (before any update), gathered, by parameter name."""
    trainer = Trainer(recipe)
    try:
        acc = recipe.training.gradient_accumulation_steps
        trainer.forward_backward([trainer._next_micro_batch() for _ in range(acc)])
        return {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters() if p.grad is not None}
    finally:
        trainer.close()


def _assert_close(a: dict, b: dict, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=rtol, atol=atol), name


def test_matches_plain_transformers_loop(tiny, tmp_path):
    model_dir, source = tiny
    recipe = make_recipe(model_dir, tmp_path / "run", train_iters=3)

    # Reference: the model as transformers runs it, its own loss (mean over shifted targets).
    reference = copy.deepcopy(source).train()
    reference.model.vision_tower.requires_grad_(False)
    reference.model.multi_modal_projector.requires_grad_(False)
    params = [p for p in reference.parameters() if p.requires_grad]
    t = recipe.training
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, eps=t.adam_eps, foreach=True)
    data = SyntheticBatches(
        vocab_size=VOCAB,
        seq_len=48,
        micro_batch_size=2,
        grad_accumulation=1,
        dp_rank=0,
        dp_size=1,
        seed=t.seed,
    )
    ref_losses, ref_norms, ref_grads = [], [], None
    for step in range(1, 4):
        batch = next(data)
        loss = reference(**batch).loss
        loss.backward()
        if step == 1:
            ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(params, t.clip_grad)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, t)  # read before the scheduler steps, as MindSpeed-MM does
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    trainer = Trainer(recipe)
    try:
        # Step 1 by hand to look at the gradients before the update.
        out = trainer.forward_backward([next(iter(trainer.data))])
        grads = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys()
        _assert_close(grads, ref_grads)
        assert out["loss_sum"].item() / out["counts"][0].item() == pytest.approx(ref_losses[0], rel=1e-6)
        trainer.optimizer_step()
        records = trainer.train()
        losses = [out["loss_sum"].item() / out["counts"][0].item()] + [r["loss"] for r in records]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms[1:], rel=1e-5)
        expected = {n: p.detach() for n, p in reference.named_parameters()}
        _assert_close(full_params(trainer.model), expected, atol=UPDATE_ATOL)
    finally:
        trainer.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 3]
    assert set(lines[0]) == {
        "step", "loss", "grad_norm", "lr", "step_time_ms", "tokens", "tokens_per_s",
        "peak_allocated_mib", "peak_reserved_mib", "alloc_retries", "flops_per_token", "tflops_per_gpu", "mfu",
    }  # fmt: skip
    assert lines[0]["peak_allocated_mib"] is None  # the CPU allocator reports nothing
    assert lines[0]["tflops_per_gpu"] > 0 and lines[0]["mfu"] is None  # no bf16 peak on the CPU
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def test_micro_batch_split_and_freezing(tiny, tmp_path):
    model_dir, source = tiny
    recipe_a = make_recipe(model_dir, tmp_path / "a", micro_batch_size=2)
    recipe_b = make_recipe(model_dir, tmp_path / "b", micro_batch_size=1, gradient_accumulation_steps=2)
    _assert_close(_first_step_grads(recipe_b), _first_step_grads(recipe_a), rtol=1e-5, atol=1e-7)
    losses_a, norms_a, params_a = _run(recipe_a)
    losses_b, norms_b, params_b = _run(recipe_b)
    assert losses_b == pytest.approx(losses_a, rel=1e-6)
    assert norms_b == pytest.approx(norms_a, rel=1e-5)
    _assert_close(params_b, params_a, atol=UPDATE_ATOL)

    initial = {n: p.detach() for n, p in source.named_parameters()}
    for name, value in params_a.items():
        frozen = name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
        assert torch.equal(value, initial[name]) == frozen, name


def test_chunked_loss_and_adamw_swap_match(tiny, tmp_path):
    model_dir, _ = tiny
    plain = make_recipe(model_dir, tmp_path / "plain")
    chunked = make_recipe(
        model_dir,
        tmp_path / "chunk",
        ["features.enable_chunk_loss=true", "features.chunkloss_plan.chunk_size=16"],
    )
    _assert_close(_first_step_grads(chunked), _first_step_grads(plain), rtol=1e-5, atol=1e-7)
    losses, norms, params = _run(plain)
    c_losses, c_norms, c_params = _run(chunked)
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert c_norms == pytest.approx(norms, rel=1e-5)
    _assert_close(c_params, params, atol=UPDATE_ATOL)

    s_losses, _, s_params = _run(make_recipe(model_dir, tmp_path / "swap", optimizer="adamw_swap"))
    assert s_losses == losses
    _assert_close(s_params, params, rtol=0, atol=0)


def test_recompute_and_prefetch_change_nothing(tiny, tmp_path):
    model_dir, _ = tiny
    losses, _, params = _run(make_recipe(model_dir, tmp_path / "plain", train_iters=2))
    recipe = make_recipe(
        model_dir,
        tmp_path / "ac",
        [
            "features.recompute=true",
            "features.recompute_plan.apply_modules=['model.language_model.layers.{*}']",
            "parallel.fsdp_plan.num_to_forward_prefetch=1",
            "parallel.fsdp_plan.num_to_backward_prefetch=1",
        ],
        train_iters=2,
    )
    ac_losses, _, ac_params = _run(recipe)
    assert ac_losses == pytest.approx(losses, rel=1e-6)
    _assert_close(ac_params, params, atol=UPDATE_ATOL)


def test_load_strict_missing_key_fails_before_step_one(tiny, tmp_path):
    model_dir, _ = tiny
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = "language_model.model.layers.1.mlp.up_proj.weight"
    del index["weight_map"][dropped]
    index_path.write_text(json.dumps(index))
    recipe = make_recipe(broken, tmp_path / "run")
    with pytest.raises(UserError) as info:
        Trainer(recipe)
    message = str(info.value)
    assert "missing keys (1): model.language_model.layers.1.mlp.up_proj.weight" in message
    assert "load_strict" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    import torch.distributed as dist

    if dist.is_initialized():  # the failed constructor left its group behind
        dist.destroy_process_group()


def test_loads_fsdp2_and_megatron_dcp_layouts(tiny, tmp_path):
    import torch.distributed.checkpoint as dcp

    from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp

    model_dir, source = tiny
    state = {k: v.clone() for k, v in source.state_dict().items()}
    dcp.save(state, checkpoint_id=str(tmp_path / "fsdp2"), no_dist=True)
    # The megatron layout as `magistral convert hf-to-dcp --layout megatron` writes it (model.model.* keys).
    convert_hf_to_dcp(model_dir, tmp_path / "megatron", layout="megatron")
    expected = {n: p.detach() for n, p in source.named_parameters()}
    for layout in ("fsdp2", "megatron"):
        trainer = Trainer(make_recipe(model_dir, tmp_path / f"run-{layout}", load=str(tmp_path / layout)))
        try:
            _assert_close(full_params(trainer.model), expected, rtol=0, atol=0)
        finally:
            trainer.close()


def test_profile_manual_gc_and_determinism(tiny, tmp_path):
    import gc

    model_dir, _ = tiny
    recipe = make_recipe(
        model_dir,
        tmp_path / "run",
        [
            "tools.profile.enable=true",
            "tools.profile.static_param.start_step=2",
            "tools.profile.static_param.end_step=3",
            "tools.memory_profile.enable=true",
        ],
        train_iters=3,
        manual_gc_interval=2,
        use_deter_comp=True,
    )
    losses, _, _ = _run(make_recipe(model_dir, tmp_path / "plain", train_iters=3))
    trainer = Trainer(recipe)
    try:
        assert not gc.isenabled()  # manual_gc_interval: collection only every N steps
        assert torch.are_deterministic_algorithms_enabled()
        records = trainer.train()
    finally:
        trainer.close()
        torch.use_deterministic_algorithms(False)
    assert gc.isenabled()
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-6)
    trace = tmp_path / "run" / "profiling" / "rank0_steps2-2.json"
    assert trace.is_file()
    assert json.loads(trace.read_text())["traceEvents"]
    assert not (tmp_path / "run" / "memory_snapshot").exists()  # needs a CUDA / NPU allocator


def test_adamw_swap_resumes_exactly(tiny, tmp_path):
    """The host-held optimizer state goes through the same DCP checkpoint as adamw's."""
    model_dir, _ = tiny
    whole_losses, _, whole_params = _run(
        make_recipe(model_dir, tmp_path / "whole", train_iters=4, optimizer="adamw_swap")
    )
    recipe = make_recipe(
        model_dir, tmp_path / "run", train_iters=4, optimizer="adamw_swap", save_interval=2, resume="auto"
    )
    first, _, _ = _run(recipe, steps=2)  # stops after the step-2 checkpoint
    rest, _, params = _run(recipe)  # a new trainer: resume: auto finds checkpoints/latest
    assert first + rest == whole_losses
    _assert_close(params, whole_params, rtol=0, atol=0)
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
