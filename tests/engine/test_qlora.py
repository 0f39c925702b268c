"""QLoRA (``model.lora.quantize_base: nf4``): torchao's NF4 base under PEFT's adapters and FSDP2.

One process: the tiny model's decoder weights round-trip through NF4 within the code book's
bound, and the quantised forward (and the adapters' gradients) equal those over explicitly
dequantised fp32 weights. One and two gloo ranks through the trainer (recompute and chunked loss on): QLoRA from the HF files
equals, step for step, plain LoRA whose base *is* the dequantised NF4 weights (written as an HF model:
the same function); its loss falls; a resumed run whose base loads from a DCP checkpoint continues
exactly; its adapters export as PEFT files that peft loads onto the original base in bf16.
"""

from __future__ import annotations

import pytest
import torch

from .helpers import VOCAB, recipe_dict, write_tiny_model

# Not importorskip: importing torchao outside engine.qlora would print its load warnings here.
pytestmark = [
    pytest.mark.compat,  # PEFT's layers and transformers' modules around NF4 weights, as test_lora_fsdp.py
    pytest.mark.skipif(__import__("importlib.util").util.find_spec("torchao") is None, reason="no torchao"),
]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: The tiny model's k/v projections hold 32 blocks of 64: 2 ranks x 16 scales per scaler block.
BLOCK, SCALER_BLOCK = 64, 16
STEPS = 4
#: The NF4 code book's largest gap (between -1 and -0.6962): no value is further than half of it,
#: times its block's absmax, from its code.
HALF_GAP = (1.0 - 0.6962) / 2


def _qlora_spec(**kwargs):
    from magistral_cli.config.schema import LoraConfig

    return LoraConfig(
        r=4,
        alpha=8,
        target_modules=TARGETS,
        quantize_base="nf4",
        quantize_block_size=BLOCK,
        quantize_scaler_block_size=SCALER_BLOCK,
        **kwargs,
    )


def _decoder_weights(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith("model.language_model.layers.") and v.dim() == 2}


def dequantised_state(state: dict) -> dict[str, torch.Tensor]:
    """``state`` with every decoder Linear weight replaced by its NF4 round trip (whole tensors)."""
    from magistral_cli.engine.qlora import nf4_module

    to_nf4 = nf4_module().to_nf4
    out = dict(state)
    for key, value in _decoder_weights(state).items():
        out[key] = to_nf4(value.contiguous(), BLOCK, SCALER_BLOCK).get_original_weight()
    return out


def test_nf4_round_trip_within_the_code_book_bound_and_quantised_forward_is_the_dequantised_one():
    from magistral_cli.engine.lora import apply_lora
    from magistral_cli.engine.model import build_model, install_loss_head
    from magistral_cli.engine.qlora import is_nf4, nf4_module, quantize_base_
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    to_nf4 = nf4_module().to_nf4
    torch.manual_seed(0)
    model = build_model(tiny_mistral3_config(vocab_size=VOCAB), meta=False, attn_implementation="sdpa")
    worst = 0.0
    for key, weight in _decoder_weights(model.state_dict()).items():
        back = to_nf4(weight.contiguous(), BLOCK, SCALER_BLOCK).get_original_weight()
        blocks = weight.reshape(-1, BLOCK)
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        # The block scale itself is stored in 8 bits around the mean: at most half a step of its
        # scaler block's quantisation off (step = 2 x max |scale - mean| / 256).
        dev = (absmax - absmax.mean()).reshape(-1, SCALER_BLOCK).abs().amax(dim=1)
        scale_err = (dev / 256).repeat_interleave(SCALER_BLOCK).reshape(-1, 1)
        bound = HALF_GAP * absmax + scale_err + 1e-7
        err = (back.reshape(-1, BLOCK) - blocks).abs()
        assert (err <= bound).all(), key
        worst = max(worst, float((err / absmax).max()))
    assert 0 < worst <= HALF_GAP + 0.02

    # The quantised model's forward (NF4 through F.linear) against the same model with the
    # dequantised weights as plain fp32 parameters; adapters random so they take part.
    spec = _qlora_spec(init_lora_weights=False)
    torch.manual_seed(1)
    apply_lora(model, spec)
    plain_state = {k: v.clone() for k, v in model.state_dict().items()}
    done = quantize_base_(model, spec, shards=1)
    assert len(done.modules) == 7 * 2
    assert all(is_nf4(model.get_submodule(name).weight) for name in done.modules)
    assert all("lora_" not in name and "vision" not in name for name in done.modules)
    reference = build_model(tiny_mistral3_config(vocab_size=VOCAB), meta=False, attn_implementation="sdpa")
    apply_lora(reference, spec)
    reference.load_state_dict(
        {k: (v.get_original_weight() if is_nf4(v) else v) for k, v in model.state_dict().items()}
    )
    assert any(not torch.equal(plain_state[k], v) for k, v in reference.state_dict().items())
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    got = model.model(input_ids=ids).last_hidden_state
    want = reference.model(input_ids=ids).last_hidden_state
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
    for m in (model, reference):
        install_loss_head(m, "lm_head", None)
        m(input_ids=ids, labels=ids).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    want_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        assert ((grad - want_grads[name]).abs().max() / want_grads[name].abs().max()).item() <= 1e-5, name
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def _recipe(model_dir, run_dir, qlora: bool, load=None, **training):
    from magistral_cli.config.loader import validate_recipe

    raw = recipe_dict(model_dir, run_dir, micro_batch_size=1, train_iters=STEPS, **training)
    if load is not None:
        raw["training"]["load"] = str(load)
    lora = {"r": 4, "alpha": 8, "target_modules": TARGETS}
    if qlora:
        lora.update(quantize_base="nf4", quantize_block_size=BLOCK, quantize_scaler_block_size=SCALER_BLOCK)
    raw["model"]["lora"] = lora
    raw["model"]["freeze"] = ["model.vision_tower", "model.multi_modal_projector"]
    raw["training"]["init_model_with_meta_device"] = True
    raw["features"]["recompute"] = True
    raw["features"]["recompute_plan"] = {"apply_modules": ["model.language_model.layers.{*}"]}
    raw["features"]["enable_chunk_loss"] = True
    raw["features"]["chunkloss_plan"] = {"apply_module": "lm_head", "chunk_size": 16}
    return validate_recipe(raw)


def _train(recipe, steps=None):
    from magistral_cli.engine.trainer import Trainer

    trainer = Trainer(recipe)
    try:
        losses = [r["loss"] for r in trainer.train(max_steps=steps)]
        params = {n: p.full_tensor().tolist() for n, p in trainer.model.named_parameters() if p.requires_grad}
        return losses, params
    finally:
        trainer.close()


def _worker(rank: int, tmp: str) -> dict:
    from pathlib import Path

    tmp = Path(tmp)
    out = {}
    out["qlora"] = _train(_recipe(tmp / "model", tmp / f"q{rank}", qlora=True))
    out["lora"] = _train(_recipe(tmp / "dequantised", tmp / f"l{rank}", qlora=False))
    resumable = _recipe(
        tmp / "model", tmp / "resume", qlora=True, load=tmp / "dcp", save_interval=2, resume="auto"
    )
    first, _ = _train(resumable, steps=2)
    rest, params = _train(resumable)
    out["resumed"] = (first + rest, params)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


def _write_models(tmp_path) -> None:
    """The tiny model (``model``) and the same with its decoder weights NF4 round-tripped (``dequantised``)."""
    from magistral_cli.engine.model import build_model
    from magistral_cli.testing.tiny_model import save_official_checkpoint, tiny_mistral3_config

    model = write_tiny_model(tmp_path / "model")
    dequantised = build_model(tiny_mistral3_config(vocab_size=VOCAB), meta=False, attn_implementation="sdpa")
    dequantised.load_state_dict(dequantised_state(model.state_dict()))
    save_official_checkpoint(dequantised, tmp_path / "dequantised", num_shards=2, dtype="float32")


@pytest.mark.slow
def test_qlora_on_one_rank_equals_lora_on_the_dequantised_base(tmp_path):
    """One rank: FSDP2 leaves the NF4 weights alone (its one-rank shortcut cannot gather them)."""
    _write_models(tmp_path)
    q_losses, q_params = _train(_recipe(tmp_path / "model", tmp_path / "q", qlora=True))
    l_losses, l_params = _train(_recipe(tmp_path / "dequantised", tmp_path / "l", qlora=False))
    assert q_losses == pytest.approx(l_losses, rel=1e-5)
    assert _max_diff(q_params, l_params) < 1e-5


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing"
)  # PeftModel.from_pretrained on transformers 5.x
def test_qlora_on_two_ranks_equals_lora_on_the_dequantised_base_and_resumes_exactly(tmp_path):
    from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
    from magistral_cli.runtime import spawn_ranks

    _write_models(tmp_path)
    convert_hf_to_dcp(tmp_path / "model", tmp_path / "dcp")

    results = spawn_ranks(_worker, 2, (str(tmp_path),), timeout_s=600)
    q_losses, q_params = results[0]["qlora"]
    l_losses, l_params = results[0]["lora"]
    assert q_losses == pytest.approx(l_losses, rel=1e-5)
    assert _max_diff(q_params, l_params) < 1e-5
    assert q_losses[-1] < q_losses[0]
    r_losses, r_params = results[0]["resumed"]
    assert r_losses == q_losses
    assert _max_diff(r_params, q_params) == 0.0
    print("qlora", q_losses, "lora", l_losses, "max adapter diff", _max_diff(q_params, l_params))

    # The adapters export as PEFT files and load with peft onto the original base in bf16 (how a QLoRA
    # run is served): PEFT holds the trained adapters and the model's output moves off the base's.
    from peft import PeftModel
    from transformers import Mistral3ForConditionalGeneration

    from magistral_cli.checkpoint.lora_export import export_lora
    from magistral_cli.engine.lora import read_checkpoint_record

    checkpoint = tmp_path / "resume" / "checkpoints" / f"step_{STEPS}"
    assert read_checkpoint_record(checkpoint)["quantize_base"] == "nf4"
    export_lora(checkpoint, tmp_path / "model", tmp_path / "adapters", "adapters")

    def bf16_base():
        return Mistral3ForConditionalGeneration.from_pretrained(
            tmp_path / "model", dtype=torch.bfloat16
        ).eval()

    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = bf16_base()(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(bf16_base(), tmp_path / "adapters").eval()
        logits = peft_model(input_ids=ids).logits
    loaded = {n.replace("base_model.model.", ""): p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert loaded.keys() == r_params.keys()
    for name, value in loaded.items():
        assert torch.equal(value.float(), torch.tensor(r_params[name]).to(value.dtype).float()), name
    assert not torch.equal(logits, base_logits)


def test_quantize_apply_to_reaches_the_vision_tower_and_projector_when_asked():
    from magistral_cli.engine.lora import apply_lora
    from magistral_cli.engine.model import build_model
    from magistral_cli.engine.qlora import is_nf4, quantize_base_
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    spec = _qlora_spec(quantize_apply_to=["language_model", "projector", "vision_tower"])
    torch.manual_seed(0)
    model = build_model(tiny_mistral3_config(vocab_size=VOCAB), meta=False, attn_implementation="sdpa")
    apply_lora(model, spec)
    reference = build_model(tiny_mistral3_config(vocab_size=VOCAB), meta=False, attn_implementation="sdpa")
    apply_lora(reference, spec)
    done = quantize_base_(model, spec, shards=1)
    parts = {name.split(".")[1] for name in done.modules}
    assert parts == {"language_model", "multi_modal_projector", "vision_tower"}
    assert not is_nf4(model.lm_head.weight) and not is_nf4(model.model.language_model.embed_tokens.weight)
    reference.load_state_dict(
        {k: (v.get_original_weight() if is_nf4(v) else v) for k, v in model.state_dict().items()}
    )
    patch = model.config.vision_config.patch_size
    pixels = torch.randn(1, 3, 4 * patch, 6 * patch, generator=torch.Generator().manual_seed(5))
    sizes = torch.tensor([[4 * patch, 6 * patch]])
    with torch.no_grad():
        got = model.model.get_image_features(pixel_values=pixels, image_sizes=sizes)
        want = reference.model.get_image_features(pixel_values=pixels, image_sizes=sizes)
    got = torch.cat(list(getattr(got, "pooler_output", got)))
    want = torch.cat(list(getattr(want, "pooler_output", want)))
    assert got.shape == want.shape and ((got - want).abs().max() / want.abs().max()).item() <= 1e-6


@pytest.mark.slow
def test_resume_refuses_to_switch_between_lora_and_qlora(tmp_path):
    """Adapters trained against the NF4 base do not go on against the bf16 one (nor the reverse) unnoticed."""
    import torch.distributed as dist

    from magistral_cli.engine.trainer import Trainer
    from magistral_cli.errors import UserError

    write_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    _train(_recipe(tmp_path / "model", run, qlora=True, save_interval=2, resume="auto"), steps=2)
    try:
        with pytest.raises(
            UserError,
            match=r"other model.lora settings \(quantize_base: quantize_base 'nf4' there, 'none' here\)",
        ):
            Trainer(_recipe(tmp_path / "model", run, qlora=False, save_interval=2, resume="auto"))
    finally:
        if dist.is_initialized():  # the failed constructor left its group behind
            dist.destroy_process_group()
    # The QLoRA recipe itself resumes it.
    rest, _ = _train(_recipe(tmp_path / "model", run, qlora=True, save_interval=2, resume="auto"), steps=1)
    assert len(rest) == 1
