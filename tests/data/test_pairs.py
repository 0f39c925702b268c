"""Preference pairs (training.stage: dpo): reading, encoding, truncation, the report, the loader's 2B rows."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from magistral_cli.config.schema import DatasetAttr
from magistral_cli.data.collator import SAMPLE_INDEX, PixtralCollator, pair_rows
from magistral_cli.data.encoder import EncodedPair, EncodedSample, EncodeParams, Encoder
from magistral_cli.data.loader import (
    build_train_dataloader,
    build_train_dataset,
    build_val_batches,
    dataset_split,
)
from magistral_cli.data.pipeline import plan_preprocess, run_preprocess
from magistral_cli.data.pixtral import load_image_settings
from magistral_cli.data.readers import DROP_REASONS, Drop, RecordFormat, RowSource
from magistral_cli.data.report import render_report
from magistral_cli.errors import UserError
from magistral_cli.testing.tiny_data import BROKEN_PAIR_REASONS, write_synthetic_pair_dataset

from .helpers import write_recipe

N_PAIRS = 16


def encoder(model_dir, tokenizer, dataset_dir, *, pairs: bool, **params) -> Encoder:
    values = dict(cutoff_len=2048, train_on_prompt=False, mask_history=False, default_system="")
    values.update(params)
    return Encoder(
        tokenizer,
        load_image_settings(model_dir, 1024, 262144),
        EncodeParams(dataset_dir=str(dataset_dir), **values),
        RecordFormat.from_attr(DatasetAttr(), pairs=pairs),
    )


def assert_same_sample(got: EncodedSample, want: EncodedSample) -> None:
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.labels.tolist() == want.labels.tolist()
    assert got.images == want.images and got.image_sizes.tolist() == want.image_sizes.tolist()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pair_images")
    Image.new("RGB", (84, 56), (200, 30, 30)).save(path / "red.png")
    return path


@pytest.fixture(scope="module")
def pair_dataset(tmp_path_factory):
    return write_synthetic_pair_dataset(tmp_path_factory.mktemp("pairs"), N_PAIRS, seed=3, broken_rows=True)


def test_each_side_is_the_sft_encoding_of_prompt_and_answer(model_dir, tokenizer, image_dir):
    prompt = [
        {"role": "system", "content": "You name colors."},
        {"role": "user", "content": "<image>\nWhat color is it?"},
    ]
    chosen = {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}  # chunks, as SFT reads them
    rejected = [{"role": "assistant", "content": "Blue, I think."}]  # a one-element list is one message
    row = {"messages": prompt, "chosen": chosen, "rejected": rejected, "images": ["red.png"]}
    pair = encoder(model_dir, tokenizer, image_dir, pairs=True).encode_rows([RowSource(0, row)])[0]
    assert isinstance(pair, EncodedPair)
    sft = encoder(model_dir, tokenizer, image_dir, pairs=False)
    for side, answer in (("chosen", chosen), ("rejected", rejected[0])):
        want = sft.encode_rows([RowSource(0, {"messages": [*prompt, answer], "images": ["red.png"]})])[0]
        assert isinstance(want, EncodedSample)
        assert_same_sample(getattr(pair, side), want)
    assert (pair.chosen.input_ids == tokenizer.special.img).sum() == 6  # 84x56 pixels: 3x2 image tokens
    trained = [
        tokenizer.decode([int(t) for t in s.labels if t != -100]) for s in (pair.chosen, pair.rejected)
    ]
    assert trained == ["Red.</s>", "Blue, I think.</s>"]


def test_multi_turn_and_sharegpt_prompts(model_dir, tokenizer, image_dir):
    enc = encoder(model_dir, tokenizer, image_dir, pairs=True)
    turns = [
        {"role": "user", "content": "<image>\nIs there a square?"},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": "Its color?"},
    ]
    sharegpt = {
        "conversations": [{"from": "human", "value": "<image>\nColor?"}],
        "chosen": {"from": "gpt", "value": "Red."},
        "rejected": [{"from": "gpt", "value": "Blue."}],
        "images": ["red.png"],
    }
    answers = {
        "chosen": {"role": "assistant", "content": "Red."},
        "rejected": {"role": "assistant", "content": "Blue."},
    }
    multi, shared = enc.encode_rows(
        [RowSource(0, {"messages": turns, **answers, "images": ["red.png"]}), RowSource(1, sharegpt)]
    )
    # An earlier assistant turn of the prompt is context: only the final answer is trained.
    trained = [
        tokenizer.decode([int(t) for t in s.labels if t != -100]) for s in (multi.chosen, multi.rejected)
    ]
    assert trained == ["Red.</s>", "Blue.</s>"] and "No.</s>" in tokenizer.decode(
        multi.chosen.input_ids.tolist()
    )
    plain = enc.encode_rows(
        [
            RowSource(
                1,
                {
                    "messages": [{"role": "user", "content": "<image>\nColor?"}],
                    **answers,
                    "images": ["red.png"],
                },
            )
        ]
    )[0]
    assert_same_sample(shared.chosen, plain.chosen)
    assert_same_sample(shared.rejected, plain.rejected)


def test_bad_pairs_are_dropped_with_their_reason(model_dir, tokenizer, image_dir):
    question = [{"role": "user", "content": "<image>\nColor?"}]
    good, bad = {"role": "assistant", "content": "Red."}, {"role": "assistant", "content": "Blue."}
    rows = {
        "missing_chosen": {"messages": question, "chosen": None, "rejected": bad},
        "missing_rejected": {"messages": question, "chosen": good, "rejected": []},
        "chosen_equals_rejected": {"messages": question, "chosen": good, "rejected": [dict(good)]},
        "answer_not_assistant": {
            "messages": question,
            "chosen": good,
            "rejected": {"role": "user", "content": "x"},
        },
        "image_in_assistant_turn": {
            "messages": question,
            "chosen": good,
            "rejected": {**bad, "content": "<image>"},
        },
        "prompt_not_ending_with_user": {"messages": [*question, good], "chosen": good, "rejected": bad},
        "empty_assistant": {"messages": question, "chosen": {**good, "content": " "}, "rejected": bad},
        # the SFT reader's rules hold for the prompt
        "missing_image": {"messages": question, "chosen": good, "rejected": bad, "images": ["gone.png"]},
        "image_count_mismatch": {"messages": question, "chosen": good, "rejected": bad, "images": []},
        "bad_turn_order": {"messages": [good, *question], "chosen": good, "rejected": bad},
    }
    enc = encoder(model_dir, tokenizer, image_dir, pairs=True)
    results = enc.encode_rows(
        [RowSource(i, {"images": ["red.png"], **row}) for i, row in enumerate(rows.values())]
    )
    got = [r.reason if isinstance(r, Drop) else "kept" for r in results]
    assert got == list(rows)
    assert all(reason in DROP_REASONS for reason in got)
    assert "rejected" in results[3].detail and "'user'" in results[3].detail


def test_truncation_keeps_images_and_drops_a_pair_without_answer(model_dir, tokenizer, image_dir):
    words = " ".join(f"word{k}" for k in range(300))
    long_rejected = " ".join(f"no{k}" for k in range(30))

    def row(prompt: str, rejected: str = "Blue.") -> RowSource:
        return RowSource(
            0,
            {
                "messages": [{"role": "user", "content": prompt}],
                "chosen": {"role": "assistant", "content": "Red."},
                "rejected": {"role": "assistant", "content": rejected},
                "images": ["red.png"],
            },
        )

    enc = encoder(model_dir, tokenizer, image_dir, pairs=True, cutoff_len=64)
    kept, image_cut = enc.encode_rows([row(f"<image>\n{words}", long_rejected), row(f"{words}\n<image>")])
    assert isinstance(kept, EncodedPair)
    assert image_cut.reason == "image_tokens_truncated"
    # ~3300 prompt tokens and an 81-token answer: infer_seqlen leaves the answers int(40 * 81 / 3381) = 0
    enc_short = encoder(model_dir, tokenizer, image_dir, pairs=True, cutoff_len=40)
    (dropped,) = enc_short.encode_rows([row(f"<image>\n{words} {words} {words}", long_rejected)])
    assert dropped.reason == "answer_truncated" and "cutoff_len 40" in dropped.detail
    # Both sides keep the same prompt and every image token; the longer answer is cut to the shared budget.
    chosen, rejected = kept.chosen, kept.rejected
    assert chosen.truncated and rejected.truncated and len(rejected.input_ids) == 64
    prompt_len = int(np.argmax(rejected.labels != -100))
    assert chosen.input_ids[:prompt_len].tolist() == rejected.input_ids[:prompt_len].tolist()
    for sample in (chosen, rejected):
        assert (sample.input_ids == tokenizer.special.img).sum() == 6
        assert (sample.input_ids == tokenizer.special.img_end).sum() == 1
    assert tokenizer.decode([int(t) for t in chosen.labels if t != -100]) == "Red.</s>"


@pytest.fixture(scope="module")
def encoded_pairs(model_dir, pair_dataset, tmp_path_factory):
    from magistral_cli.config.loader import validate_recipe

    cache = tmp_path_factory.mktemp("pair_cache")

    def recipe(**basic):
        return validate_recipe(
            {
                "data": {
                    "dataset_param": {
                        "preprocess_parameters": {"model_name_or_path": str(model_dir)},
                        "basic_parameters": {"dataset": str(pair_dataset), "cache_dir": str(cache), **basic},
                    },
                    "dataloader_param": {"shuffle": True},
                },
                "training": {"train_iters": 4, "micro_batch_size": 2, "seed": 5, "stage": "dpo"},
            }
        )

    return recipe, run_preprocess(recipe())


def _rows(batch) -> list[list[int]]:
    return [
        row[mask.bool()].tolist()
        for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]


def test_report_and_cache_count_pairs(encoded_pairs):
    recipe_for, result = encoded_pairs
    other_column = recipe_for()
    other_column.data.dataset_param.attr.chosen = "preferred"
    assert plan_preprocess(other_column).fingerprint != result.dataset.fingerprint  # the columns are inputs
    report, dataset = result.report, result.dataset
    reasons = {reason: BROKEN_PAIR_REASONS.count(reason) for reason in BROKEN_PAIR_REASONS}
    assert report["kept"] == N_PAIRS and report["pairs"] is True and report["sequences"] == 2 * N_PAIRS
    assert report["dropped"] == len(BROKEN_PAIR_REASONS) and report["dropped_by_reason"] == reasons
    assert dataset.pairs and dataset.num_units == N_PAIRS and len(dataset) == 2 * N_PAIRS
    for k in range(N_PAIRS):  # 2k chosen, 2k + 1 rejected, from the same row
        chosen, rejected = dataset[2 * k], dataset[2 * k + 1]
        assert chosen.source_index == rejected.source_index == k
        assert chosen.images == rejected.images
        assert chosen.input_ids.tolist() != rejected.input_ids.tolist()


def test_loader_yields_chosen_rows_then_rejected_rows_and_resumes(encoded_pairs):
    recipe_for, result = encoded_pairs
    recipe, dataset = recipe_for(), result.dataset
    chosen_of = {tuple(dataset[2 * k].input_ids.tolist()): k for k in range(N_PAIRS)}
    train = build_train_dataset(recipe, dataset)
    sft_collate = PixtralCollator(int(dataset.meta["pad_token_id"]))
    loader = build_train_dataloader(recipe, dataset, dp_rank=0, dp_size=1)
    batches = list(loader)
    assert len(batches) == N_PAIRS // 2
    seen = []
    for batch in batches:
        b = pair_rows(batch)
        assert b == 2 and batch["input_ids"].shape[0] == 4
        rows = _rows(batch)
        pairs = [chosen_of[tuple(row)] for row in rows[:b]]
        assert [dataset[2 * k + 1].input_ids.tolist() for k in pairs] == rows[b:]
        # exactly what the SFT collator makes of the 2B samples as a list (images in row order too)
        items = [train._item([2 * k]) for k in pairs] + [train._item([2 * k + 1]) for k in pairs]
        want = sft_collate(items)
        assert batch.keys() == want.keys() | {SAMPLE_INDEX} and "image_sizes" in batch
        assert all(torch.equal(batch[key], want[key]) for key in want)
        # each row's sample in the cache entry: pair k is samples 2k (chosen) and 2k + 1 (rejected)
        assert batch[SAMPLE_INDEX].tolist() == [2 * k for k in pairs] + [2 * k + 1 for k in pairs]
        seen += pairs
    assert sorted(seen) == list(range(N_PAIRS))

    again = build_train_dataloader(recipe, dataset, dp_rank=0, dp_size=1)
    it = iter(again)
    next(it)
    state = again.state_dict()
    resumed = build_train_dataloader(recipe, dataset, dp_rank=0, dp_size=1)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], batches[1]["input_ids"])

    sft = recipe.model_copy(update={"training": recipe.training.model_copy(update={"stage": "sft"})})
    with pytest.raises(UserError, match="holds preference pairs but training.stage is 'sft'"):
        build_train_dataloader(sft, dataset, dp_rank=0, dp_size=1)


def test_validation_split_splits_pairs(encoded_pairs):
    recipe_for, result = encoded_pairs
    recipe, dataset = recipe_for(val_size=5), result.dataset
    train_pairs, val_pairs = dataset_split(recipe, dataset)
    assert len(val_pairs) == 5 and sorted(train_pairs + val_pairs) == list(range(N_PAIRS))
    assert len(build_train_dataset(recipe, dataset)) == N_PAIRS - 5
    # rank 1 of 2 takes val_pairs[1::2] (2 pairs: one micro-batch), rank 0 three (two): one filler
    val = build_val_batches(recipe, dataset, dp_rank=1, dp_size=2)
    real, filler = list(val)
    assert val.num_fillers == 1 and pair_rows(real) == 2
    want = [dataset[2 * k + side].input_ids.tolist() for side in (0, 1) for k in val_pairs[1::2]]
    assert _rows(real) == want
    assert filler["input_ids"].shape[0] == 4 and (filler["labels"] == -100).all()


def test_preprocess_cli_reports_pairs(tmp_path, model_dir, pair_dataset, wide_console):
    from rich.console import Console

    from magistral_cli.cli.main import app

    recipe = write_recipe(
        tmp_path / "r.yaml",
        model_dir,
        pair_dataset,
        tmp_path / "cache",
        basic={"val_size": 4},
        training={"stage": "dpo"},
    )
    export = tmp_path / "pairs.jsonl"
    args = ["preprocess", str(recipe), "--json", "--inspect", "2", "--export-jsonl", str(export)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [(item["index"], item["side"]) for item in payload["inspect"]] == [(0, "chosen"), (0, "rejected")]
    exported = [json.loads(line) for line in export.read_text().splitlines()]
    assert len(exported) == 2 * N_PAIRS and exported[3]["side"] == "rejected" and exported[3]["index"] == 1
    report, dpo_entry = payload["report"], payload["cache_entry"]
    assert report["kept"] == N_PAIRS and report["pairs"] is True
    assert report["split"] == {"train": N_PAIRS - 4, "val": 4, "val_size": 4, "seed": 42}
    assert set(report["dropped_by_reason"]) == set(BROKEN_PAIR_REASONS)
    console = Console(record=True, width=200)
    render_report(report, console, entry="entry", reused=False)
    text = console.export_text()
    assert re.search(rf"kept pairs +│ {N_PAIRS} \({2 * N_PAIRS} sequences", text), text
    assert re.search(r"dropped pairs +│ 7 ", text) and "prompt_not_ending_with_user" in text
    # An SFT recipe on the same file is another entry (the stage is in the fingerprint), read as SFT
    # rows: only the row whose prompt ends with an assistant turn is a conversation to train on.
    sft = write_recipe(tmp_path / "s.yaml", model_dir, pair_dataset, tmp_path / "cache")
    sft_result = CliRunner().invoke(app, ["preprocess", str(sft), "--json"])
    payload = json.loads(sft_result.stdout)
    assert payload["reused"] is False and payload["cache_entry"] != dpo_entry
    assert payload["report"]["kept"] == 1 and "pairs" not in payload["report"]
    assert (
        payload["report"]["dropped_by_reason"]["missing_assistant"] == N_PAIRS + len(BROKEN_PAIR_REASONS) - 1
    )
