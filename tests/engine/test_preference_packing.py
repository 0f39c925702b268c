"""Neat packing of preference pairs (``training.stage: dpo`` with ``neat_packing: true``).

The loader packs whole pairs (a pair's chosen and rejected sequences in one pack, each its own
attention segment); the step sums each sequence's answer log-probabilities per segment and finds
every pair's two sums again. On the tiny model in fp32, against a reference model that differs from
the policy: a packed micro-batch gives the same per-sequence log-probabilities, loss, metrics and
gradients as the same pairs unpacked, with the live reference and with stored sums looked up by cache
sample. tests/workflow/test_dpo_recipes.py runs the tiny full DPO recipe neatly packed on 2 processes.
"""

from __future__ import annotations

import pytest
import torch

from magistral_cli.config import load_recipe
from magistral_cli.data.collator import SAMPLE_INDEX, PairCollator, PairLayout, PixtralCollator
from magistral_cli.data.loader import TrainDataset, dataset_split
from magistral_cli.engine.preference import model_inputs
from magistral_cli.engine.trainer import Trainer
from magistral_cli.testing.tiny_model import build_tiny_model, save_official_checkpoint

from .helpers import DPO_RECIPE, pair_overrides, write_pair_assets

#: The packed attention and the loss head read transformers' forward: the lowest transformers too.
pytestmark = pytest.mark.compat
NEAT = [
    "data.dataset_param.basic_parameters.neat_packing=true",
    "data.dataset_param.basic_parameters.cutoff_len=384",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = write_pair_assets(tmp_path_factory.mktemp("dpo-packing"))
    save_official_checkpoint(build_tiny_model(seed=5), root / "reference", num_shards=1)
    return root


def _sequence_logps(model, mb, layout):
    batch = model_inputs(mb, torch.device("cpu"))
    if layout.sequence_ids is not None:
        batch.update(sequence_ids=layout.sequence_ids, num_sequences=len(layout.counts))
    with torch.no_grad():
        logps = model(**batch, sequence_logps=True)
    return logps if layout.order is None else logps[layout.order]


def _grads(trainer):
    return {
        n: p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters() if p.grad is not None
    }


def test_a_neat_pack_of_pairs_equals_the_pairs_unpacked(assets, tmp_path):
    recipe = load_recipe(
        DPO_RECIPE,
        [
            *pair_overrides(assets),
            *NEAT,
            "training.micro_batch_size=2",
            f"training.dpo.ref_model={assets / 'reference'}",
            f"training.output_dir={tmp_path / 'run'}",
            "training.save_interval=0",
        ],
    )
    trainer = Trainer(recipe)
    try:
        # The epoch's packs hold every training pair once, whole.
        encoded = trainer.data.dataset.encoded
        train_pairs = dataset_split(recipe, encoded)[0]
        packed_samples = sorted(s for pack in trainer.data.dataset.packs for s in pack)
        assert packed_samples == [s for k in train_pairs for s in (2 * k, 2 * k + 1)]
        packed = next(iter(trainer.data))
        index = packed[SAMPLE_INDEX]
        layout = PairLayout.of(packed)
        # Two packs (rows) of whole pairs, more than one pair in a row, and a padding segment.
        assert packed["input_ids"].shape[0] == 2 and layout.pairs > 2 and layout.pairs == len(index) // 2
        assert len(packed["cu_seqlens"]) - 1 > len(index)
        # The same pairs, unpacked, as the loader collates pairs without packing.
        items = TrainDataset(encoded, trainer.data.dataset.settings)
        unpacked = PairCollator(PixtralCollator(int(encoded.meta["pad_token_id"])))(
            [items[int(k) // 2] for k in index[0::2]]
        )
        plain = PairLayout.of(unpacked)
        assert torch.equal(unpacked[SAMPLE_INDEX], index[layout.order])
        assert torch.equal(plain.counts, layout.counts)

        got = _sequence_logps(trainer.model, packed, layout)
        want = _sequence_logps(trainer.model, unpacked, plain)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-5), (got - want).abs().max()

        out = trainer.forward_backward([packed])
        got_sums, got_grads = out["objective"].tolist(), _grads(trainer)
        trainer.optimizer.zero_grad(set_to_none=True)
        out_plain = trainer.forward_backward([unpacked])
        want_sums, want_grads = out_plain["objective"].tolist(), _grads(trainer)
        trainer.optimizer.zero_grad(set_to_none=True)

        # Precomputed reference sums (by cache sample, as training.dpo.precompute_ref stores them) are
        # found again in pack order: the same step as with the live reference.
        step = trainer.preference
        stored = torch.full((len(encoded),), float("nan"))
        stored[unpacked[SAMPLE_INDEX]] = _sequence_logps(step.reference, unpacked, plain)
        step.precomputed, step.stored, step.reference = True, stored, None
        stored_sums = trainer.forward_backward([packed])["objective"].tolist()
    finally:
        trainer.close()
    assert int(out["counts"][3]) == int(out_plain["counts"][3]) == layout.pairs
    assert int(out["counts"][0]) == int(out_plain["counts"][0])
    assert abs(want_sums[0] / layout.pairs - 0.693147) > 1e-3, "the reference must differ from the policy"
    assert got_sums == pytest.approx(want_sums, rel=1e-5, abs=1e-5)
    assert stored_sums == pytest.approx(got_sums, rel=1e-5, abs=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        assert torch.allclose(grad, want_grads[name], rtol=1e-4, atol=1e-5), name
