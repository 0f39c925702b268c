"""Packing through the real data pipeline and the training model (fp32, CPU).

- ``neat_packing``: a pack's per-token losses and the gradients of its summed loss equal those of
  its samples run one by one through transformers' own SDPA model (1e-5), images included.
- ``packing``: the packed attention (explicit row segments) gives what transformers' SDPA gives
  with the 2D padding mask, the path plain packing took before: one meaning of a plain pack.
- ``per_sample_loss`` weighs a neat pack's samples as a micro-batch of them would.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from magistral_cli.config.loader import validate_recipe
from magistral_cli.data.collator import PixtralCollator
from magistral_cli.data.loader import TrainDataset, build_train_dataloader, prepare_dataset
from magistral_cli.data.pipeline import image_settings_of
from magistral_cli.engine.batch import per_sample_weights
from magistral_cli.engine.batch import to_device as _to_device
from magistral_cli.engine.model import build_model, install_loss_head
from magistral_cli.ops.attention import resolve_attention
from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset, write_tiny_tokenizer_files
from magistral_cli.testing.tiny_model import tiny_mistral3_config

pytestmark = pytest.mark.compat

CPU = torch.device("cpu")
#: The model's vocabulary: Tekken's ids are folded into it (id % VOCAB) after collation, which keeps
#: the special and image tokens (all below 512) and the logits cheap.
VOCAB = 512


def _fold(batch):
    out = dict(batch)
    out["input_ids"] = batch["input_ids"] % VOCAB
    out["labels"] = torch.where(batch["labels"] == -100, -100, batch["labels"] % VOCAB)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(tiny_mistral3_config().to_dict()), encoding="utf-8")
    write_tiny_tokenizer_files(model_dir)
    dataset = write_synthetic_llava_dataset(root / "data", 10, seed=3)

    def recipe(**basic):
        return validate_recipe(
            {
                "data": {
                    "dataset_param": {
                        "preprocess_parameters": {
                            "model_name_or_path": str(model_dir),
                            "image_max_pixels": 50176,
                        },
                        "basic_parameters": {
                            "dataset": str(dataset),
                            "cache_dir": str(root / "cache"),
                            "cutoff_len": 1024,
                            **basic,
                        },
                    },
                    "dataloader_param": {"shuffle": False},
                },
                "training": {"train_iters": 2, "micro_batch_size": 2, "seed": 7},
            }
        )

    encoded = prepare_dataset(recipe())
    config = tiny_mistral3_config(vocab_size=VOCAB)
    torch.manual_seed(0)
    packed_model = build_model(
        copy.deepcopy(config), meta=False, attn_implementation=resolve_attention("sdpa", "cpu", packed=True)
    )
    install_loss_head(packed_model, "lm_head", None)
    plain_model = build_model(copy.deepcopy(config), meta=False, attn_implementation="sdpa")
    install_loss_head(plain_model, "lm_head", None)
    plain_model.load_state_dict(packed_model.state_dict())
    return recipe, encoded, packed_model, plain_model


def _first_batch(recipe, encoded):
    return _fold(next(iter(build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1))))


def _token_losses(model, batch):
    """Per-token cross entropies [B, L - 1] (0 where ignored) of the training forward."""
    seen = {}
    handle = model.lm_head.register_forward_hook(
        lambda m, args, out: seen.update(hidden=args[0], targets=args[1])
    )
    try:
        total = model(**_to_device(batch, CPU))
    finally:
        handle.remove()
    with torch.no_grad():
        logits = F.linear(seen["hidden"], model.lm_head.weight)
        losses = F.cross_entropy(logits.transpose(1, 2), seen["targets"], ignore_index=-100, reduction="none")
    return total, losses


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_neat_pack_equals_its_samples_one_by_one(setup):
    recipe_for, encoded, packed_model, plain_model = setup
    recipe = recipe_for(neat_packing=True)
    assert recipe.data.dataset_param.basic_parameters.packing  # neat_packing turns packing on
    batch = _first_batch(recipe, encoded)
    bounds = batch["cu_seqlens"].tolist()
    loader = build_train_dataloader(recipe, encoded, dp_rank=0, dp_size=1)
    packs = [loader.dataset.packs[i] for i in next(iter(loader.batch_sampler))]
    assert sum(len(p) for p in packs) >= 4 and "pixel_values" in batch

    packed_total, packed_losses = _token_losses(packed_model, batch)
    packed_grads = _grads(packed_model, packed_total)

    single = TrainDataset(encoded, image_settings_of(encoded))
    collate = PixtralCollator(int(encoded.meta["pad_token_id"]))
    one_by_one_total = 0.0
    plain_model.zero_grad(set_to_none=True)
    checked = images = 0
    length = batch["input_ids"].shape[1]
    for row, members in enumerate(packs):
        start = row * length
        for member in members:
            sample = _fold(collate([single[member]]))
            images += len(single[member]["pixel_values"])
            n = sample["input_ids"].shape[1]
            assert start + n in bounds  # the collator's segment is exactly this sample
            total, losses = _token_losses(plain_model, sample)
            offset = start - row * length
            # the pack's tokens are the sample's, and so are their losses (the sample's last
            # token predicts nothing: the next sample's first label is ignored)
            assert torch.equal(batch["input_ids"][row, offset : offset + n], sample["input_ids"][0])
            torch.testing.assert_close(
                packed_losses[row, offset : offset + n - 1], losses[0], rtol=1e-5, atol=1e-5
            )
            if offset + n - 1 < length - 1:
                assert packed_losses[row, offset + n - 1] == 0
            total.backward()
            one_by_one_total += float(total.detach())
            start += n
            checked += 1
    assert checked == sum(len(p) for p in packs) and images >= 2
    torch.testing.assert_close(float(packed_total.detach()), one_by_one_total, rtol=1e-5, atol=1e-5)
    reference = {n: p.grad for n, p in plain_model.named_parameters() if p.grad is not None}
    assert packed_grads.keys() == reference.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-5, msg=name)


def test_plain_pack_means_one_thing_on_every_path(setup):
    """Plain packing: the packed attention with row segments equals transformers' SDPA with the
    2D mask, and a neat pack of the same samples differs (samples there see no neighbours)."""
    recipe_for, encoded, packed_model, plain_model = setup
    batch = _first_batch(recipe_for(packing=True), encoded)
    assert batch["cu_seqlens"].numel() - 1 <= 2 * batch["input_ids"].shape[0]  # rows + their padding
    with torch.no_grad():
        segments = packed_model(**_to_device(batch, CPU))
        mask_2d = plain_model(**{k: v for k, v in batch.items() if k != "cu_seqlens"})
        neat = dict(batch)
        neat["cu_seqlens"] = _first_batch(recipe_for(neat_packing=True), encoded)["cu_seqlens"]
        isolated = packed_model(**_to_device(neat, CPU))
    torch.testing.assert_close(segments, mask_2d, rtol=1e-5, atol=1e-5)
    assert abs(float(isolated) - float(segments)) > 1e-3


def test_per_sample_loss_weighs_a_neat_pack_like_its_samples(setup):
    recipe_for, encoded, packed_model, _ = setup
    batch = _first_batch(recipe_for(neat_packing=True), encoded)
    with torch.no_grad():
        _, losses = _token_losses(packed_model, batch)
    weights = per_sample_weights(batch["labels"], batch["attention_mask"], batch["cu_seqlens"])
    assert weights.shape == losses.shape
    # the mean over the pack's samples of each sample's token mean
    bounds = batch["cu_seqlens"].tolist()
    flat_labels, flat_losses = (
        batch["labels"].flatten(),
        torch.cat([losses, torch.zeros(losses.shape[0], 1)], 1),
    )
    flat_mask = batch["attention_mask"].flatten()
    means = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        if not flat_mask[a:b].any():
            continue  # a padding segment
        targets = flat_labels[a + 1 : b] != -100
        means.append(flat_losses.flatten()[a : b - 1][targets].mean())
    expected = torch.stack(means).mean()
    torch.testing.assert_close((weights * losses).sum(), expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        weighted = packed_model(**_to_device(batch, CPU), sample_weights=weights)
    torch.testing.assert_close(weighted, expected, rtol=1e-5, atol=1e-6)


def test_packed_batch_needs_the_packed_attention(setup):
    recipe_for, encoded, _, plain_model = setup
    batch = _first_batch(recipe_for(neat_packing=True), encoded)
    with pytest.raises(ValueError, match="needs the packed attention"):
        plain_model(**_to_device(batch, CPU))


def test_neat_pack_with_recompute_and_chunked_loss_gives_the_same_loss_and_gradients(setup):
    """The trainer's activation checkpointing re-runs each decoder layer with the packed segments,
    and the chunked loss head scores the same targets."""
    from magistral_cli.engine.parallelize import apply_ac

    recipe_for, encoded, packed_model, _ = setup
    batch = _first_batch(recipe_for(neat_packing=True), encoded)
    reference_loss = packed_model(**_to_device(batch, CPU))
    reference = _grads(packed_model, reference_loss)

    optimized = copy.deepcopy(packed_model)
    assert apply_ac(optimized, ["model.language_model.layers.{*}"])
    install_loss_head(optimized, "lm_head", 64)
    loss = optimized(**_to_device(batch, CPU))
    grads = _grads(optimized, loss)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-5)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
