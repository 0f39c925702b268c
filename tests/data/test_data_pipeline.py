"""`magistral preprocess` end to end: bad rows, report, cache reuse and invalidation, workers, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from magistral_cli.data.pipeline import run_preprocess
from magistral_cli.errors import UserError

from .helpers import write_recipe

EXPECTED_DROPS = {
    "invalid_json": 1,
    "missing_image": 1,
    "image_count_mismatch": 1,
    "empty_assistant": 1,
    "unknown_role": 1,
    "image_tokens_truncated": 1,
}


@pytest.fixture(scope="module")
def first_run(model_dir, broken_dataset, make_recipe, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    recipe = make_recipe(model_dir, broken_dataset, cache)
    return recipe, run_preprocess(recipe)


def test_good_rows_kept_bad_rows_counted_by_reason(first_run):
    _, result = first_run
    report = result.report
    assert not result.reused
    assert report["rows"] == 46 and report["kept"] == 40 and report["dropped"] == 6
    assert report["dropped_by_reason"] == EXPECTED_DROPS
    assert {d["index"] for d in result.dataset.drops()} == set(range(40, 46))
    assert report["images"] == sum(int(k) * v for k, v in report["images_per_sample"].items())
    assert report["length_percentiles"]["p100"] <= 1024
    on_disk = json.loads((result.dataset.path / "report.json").read_text())
    assert on_disk == report


def test_cache_holds_no_pickle_and_no_partial_entries(first_run):
    _, result = first_run
    entry = result.dataset.path
    names = sorted(p.name for p in entry.iterdir())
    assert all(name.endswith((".npy", ".json", ".jsonl")) for name in names), names
    for name in names:
        if name.endswith(".npy"):
            np.load(entry / name, allow_pickle=False)
    assert [p.name for p in entry.parent.iterdir() if p.is_dir()] == [entry.name]
    sample = result.dataset[0]
    assert sample.input_ids.dtype == np.int32 and len(sample.input_ids) == len(sample.labels)
    assert (sample.input_ids == 10).sum() == sum((h // 28) * (w // 28) for h, w in sample.image_sizes)


def test_second_run_reuses_and_changes_make_new_entries(first_run, model_dir, broken_dataset, make_recipe):
    recipe, result = first_run
    cache = result.dataset.path.parent
    again = run_preprocess(recipe)
    assert again.reused and again.dataset.path == result.dataset.path
    longer = run_preprocess(make_recipe(model_dir, broken_dataset, cache, basic={"cutoff_len": 8192}))
    assert not longer.reused and longer.dataset.path != result.dataset.path
    assert longer.report["dropped_by_reason"].get("image_tokens_truncated") is None  # fits now
    forced = run_preprocess(recipe, overwrite=True)
    assert not forced.reused and forced.dataset.path == result.dataset.path


def test_dataset_content_is_fingerprinted(tmp_path, model_dir, broken_dataset, make_recipe):
    data = tmp_path / "d.jsonl"
    lines = broken_dataset.read_text().splitlines()[:10]
    data.write_text("\n".join(lines) + "\n")
    recipe = make_recipe(
        model_dir, data, tmp_path / "cache", basic={"dataset_dir": str(broken_dataset.parent)}
    )
    first = run_preprocess(recipe)
    data.write_text("\n".join(lines[:9]) + "\n")
    second = run_preprocess(recipe)
    assert not second.reused and second.dataset.path != first.dataset.path
    assert len(second.dataset) == len(first.dataset) - 1


def test_progress_counts_rows_and_says_nothing_on_a_cache_hit(
    tmp_path, model_dir, broken_dataset, make_recipe
):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(broken_dataset.read_text().splitlines()[:10]) + "\n")
    recipe = make_recipe(
        model_dir, data, tmp_path / "cache", basic={"dataset_dir": str(broken_dataset.parent)}
    )
    calls: list[tuple[int, int]] = []
    run_preprocess(recipe, progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (0, 10) and calls[-1] == (10, 10)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and {t for _, t in calls} == {10}
    hit: list[tuple[int, int]] = []
    assert run_preprocess(recipe, progress=lambda done, total: hit.append((done, total))).reused
    assert hit == []


@pytest.mark.slow
def test_two_workers_encode_the_same_samples(first_run, model_dir, broken_dataset, make_recipe, tmp_path):
    _, result = first_run
    recipe = make_recipe(model_dir, broken_dataset, tmp_path, basic={"preprocessing_num_workers": 2})
    parallel = run_preprocess(recipe)
    assert parallel.dataset.fingerprint == result.dataset.fingerprint  # workers are not an input
    for name in ("input_ids", "labels", "offsets", "source_index", "image_sizes"):
        np.testing.assert_array_equal(
            np.load(parallel.dataset.path / f"{name}.npy"), np.load(result.dataset.path / f"{name}.npy")
        )
    assert parallel.dataset.drops() == result.dataset.drops()


def test_strict_names_the_first_dropped_row(first_run):
    recipe, _ = first_run
    with pytest.raises(UserError, match=r"row 40 \(invalid_json\)"):
        run_preprocess(recipe, strict=True)


def test_cli_json_inspect_export_and_strict(tmp_path, model_dir, broken_dataset):
    from magistral_cli.cli.main import app

    recipe = write_recipe(tmp_path / "r.yaml", model_dir, broken_dataset, tmp_path / "cache")
    runner = CliRunner()
    export = tmp_path / "out.jsonl"
    args = ["preprocess", str(recipe), "--json", "--inspect", "2", "--export-jsonl", str(export)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["reused"] is False and payload["report"]["kept"] == 40
    text = payload["inspect"][0]["text"]
    # No system message in the rows: the seed template's default system prompt (Magistral's thinking prompt).
    assert text.startswith("<s>[SYSTEM_PROMPT]First draft your thinking process")
    assert (
        "[/SYSTEM_PROMPT][INST]" in text and "[IMG_END]" in text and "\u27e6" in text and "</s>\u27e7" in text
    )
    lines = export.read_text().splitlines()
    assert len(lines) == 40
    first = json.loads(lines[0])
    assert set(first) == {"index", "input_ids", "labels", "image_sizes", "images"}

    again = runner.invoke(
        app, ["preprocess", str(recipe), "--json", "data.dataset_param.basic_parameters.cutoff_len=1024"]
    )
    assert again.exit_code == 0 and json.loads(again.stdout)["reused"] is True
    assert "cache hit" in again.stderr

    strict = runner.invoke(app, ["preprocess", str(recipe), "--strict"])
    assert strict.exit_code == 2 and "row 40" in strict.output

    bad = runner.invoke(
        app, ["preprocess", str(recipe), "data.dataset_param.basic_parameters.template=chatml"]
    )
    assert bad.exit_code == 2 and "template 'chatml' is not supported" in bad.output
