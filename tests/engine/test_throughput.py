"""Model FLOPs, TFLOP/s per device and MFU in metrics.jsonl, from a real 2-process training run.

The expected FLOPs are computed here on their own: the matmul weights counted on the built tiny
model (its decoder's and head's ``nn.Linear`` layers), the attention term from the config's sizes,
and every sequence length from the synthetic data (sample ``k`` depends only on the seed and ``k``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from magistral_cli.data.collator import PixtralCollator
from magistral_cli.engine.metrics import FIELDS, FLOP_UNIT, micro_batch_flops
from magistral_cli.engine.synthetic import SyntheticBatches
from magistral_cli.testing.tiny_model import build_tiny_model, tiny_mistral3_config

from .helpers import VOCAB, make_recipe, write_tiny_model

pytestmark = pytest.mark.compat

MICRO_BATCH, RANKS, SEQ_LEN, SEED, PEAK = 2, 2, 48, 7, 0.05


def _hand_counts() -> tuple[int, int]:
    """(6 x matmul weights, 6 x layers x heads x head_dim) of the tiny model, counted on it."""
    config = tiny_mistral3_config(vocab_size=VOCAB)
    model = build_tiny_model(config)
    linear = [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and (name.startswith("model.language_model.") or name == "lm_head")
    ]
    weights = sum(module.weight.numel() for module in linear)
    text = config.text_config
    assert len(linear) == text.num_hidden_layers * 7 + 1  # q, k, v, o, gate, up, down; the head
    return 6 * weights, 6 * text.num_hidden_layers * text.num_attention_heads * text.head_dim


def _train_rank(rank: int, model_dir: str, run_dir: str) -> int:
    from magistral_cli.engine.trainer import Trainer

    recipe = make_recipe(
        Path(model_dir),
        Path(run_dir),
        overrides=[f"tools.peak_tflops={PEAK}"],
        train_iters=3,
        micro_batch_size=MICRO_BATCH,
        seed=SEED,
    )
    trainer = Trainer(recipe)
    try:
        return len(trainer.train())
    finally:
        trainer.close()


@pytest.mark.slow
def test_two_rank_run_logs_model_tflops_per_device_and_mfu(tmp_path):
    from magistral_cli.runtime import spawn_ranks

    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    write_tiny_model(model_dir)
    assert spawn_ranks(_train_rank, RANKS, (str(model_dir), str(run_dir)), threads=1) == [3, 3]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3] and all(list(line) == list(FIELDS) for line in lines)

    six_n, attention = _hand_counts()
    data = SyntheticBatches(
        vocab_size=VOCAB,
        seq_len=SEQ_LEN,
        micro_batch_size=MICRO_BATCH,
        grad_accumulation=1,
        dp_rank=0,
        dp_size=RANKS,
        seed=SEED,
    )
    per_step = MICRO_BATCH * RANKS
    for line in lines:
        first = (line["step"] - 1) * per_step
        lengths = [data.sample(k)["input_ids"].numel() for k in range(first, first + per_step)]
        assert line["tokens"] == sum(lengths)
        flops = sum(six_n * n + attention * n * n for n in lengths)
        step_s = line["step_time_ms"] / 1000
        assert line["flops_per_token"] == pytest.approx(flops / sum(lengths), rel=1e-4)
        # Global model FLOPs / (step time x every device): the rounding of the logged fields only.
        assert line["tflops_per_gpu"] == pytest.approx(flops / (step_s * RANKS) / 1e12, rel=1e-3)
        # The check: (6N + attention at the cutoff length) x tokens, within 5 %.
        rough = (six_n + attention * SEQ_LEN) * line["tokens"] / step_s / RANKS / 1e12
        assert line["tflops_per_gpu"] == pytest.approx(rough, rel=0.05)
        assert line["mfu"] == pytest.approx(line["tflops_per_gpu"] / PEAK, rel=1e-5)


def test_a_neat_pack_counts_each_sample_as_its_own_sequence():
    config = tiny_mistral3_config(vocab_size=VOCAB)
    six_n, attention = _hand_counts()

    def item(*lengths):
        total = sum(lengths)
        return {
            "input_ids": np.arange(20, 20 + total),
            "labels": np.arange(20, 20 + total),
            "position_ids": np.concatenate([np.arange(n) for n in lengths]),
            "sample_lengths": np.array(lengths),
            "pixel_values": [],
        }

    items = [item(30, 10), item(25)]  # a pack of two samples, and a padded row of one
    neat = PixtralCollator(0, segments="samples")(items)
    assert micro_batch_flops(config, neat) == sum(six_n * n + attention * n * n for n in (30, 10, 25))
    plain = PixtralCollator(0, segments="rows")(items)  # plain packing: a row is one causal sequence
    assert micro_batch_flops(config, plain) == sum(six_n * n + attention * n * n for n in (40, 25))
    unpacked = PixtralCollator(0)(items)
    assert micro_batch_flops(config, unpacked) == micro_batch_flops(config, plain)
    # the unit the trainer all-reduces them in divides every count: no rounding, whatever the split
    assert (
        micro_batch_flops(config, neat) % FLOP_UNIT == 0 and micro_batch_flops(config, plain) % FLOP_UNIT == 0
    )
