"""Preprocessing speed: `magistral preprocess` cold and with a warm cache, and LLaMA-Factory.

    PYTHONPATH=. python benchmarks/preprocess_speed.py --samples 2000 --workers 2 \
        [--llamafactory-python /path/to/venv/bin/python]

Writes ``--samples`` synthetic LLaVA-style rows with PNG/JPEG images of varied sizes (56x56 to
1000x700, one or two images per row, a tenth text-only with two turns), then measures:

- ``cold``: a fresh cache, everything from reading the file to the committed cache entry
  (tokenizer conversion and file hashing included), with 1 and with ``--workers`` processes;
- ``warm``: the same command again, which finds the cache entry;
- LLaMA-Factory's ``get_dataset`` (the pipeline the seed's data code derives from) on the same
  file with the same number of workers, when a Python with ``llamafactory`` is given; its
  token ids are compared with ours (template ``pixtral``, which differs from ``mistral`` only
  in how it writes system prompts, so rows without a system message must match exactly).

Prints samples per second and the ratios. Nothing is asserted: this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_model_dir(path: Path) -> Path:
    from magistral_cli.testing.tiny_data import write_tiny_tokenizer_files
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_mistral3_config().to_dict()), encoding="utf-8")
    write_tiny_tokenizer_files(path)
    return path


def make_hf_model_dir(model_dir: Path, out: Path) -> Path:
    """The same tokenizer and processor as Hugging Face files (what LLaMA-Factory loads)."""
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    convert_tekken_tokenizer(str(model_dir / "tekken.json"), chat_template="").save_pretrained(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "PixtralImageProcessorPil",
                "processor_class": "PixtralProcessor",
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "patch_size": {"height": 14, "width": 14},
                "resample": 3,
                "rescale_factor": 1 / 255,
                "size": {"longest_edge": 1540},
            }
        )
    )
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2})
    )
    shutil.copy(model_dir / "config.json", out / "config.json")
    return out


def recipe_for(model_dir: Path, dataset: Path, cache: Path, workers: int, cutoff_len: int):
    from magistral_cli.config.loader import validate_recipe

    return validate_recipe(
        {
            "data": {
                "dataset_param": {
                    "preprocess_parameters": {"model_name_or_path": str(model_dir)},
                    "basic_parameters": {
                        "dataset": str(dataset),
                        "cache_dir": str(cache),
                        "cutoff_len": cutoff_len,
                        "preprocessing_num_workers": workers,
                    },
                }
            },
            "training": {"train_iters": 1},
        }
    )


def timed_preprocess(recipe) -> tuple[float, object]:
    """One `magistral preprocess` as a fresh process would run it (no tokenizer cached in memory)."""
    from magistral_cli.data import tokenizer
    from magistral_cli.data.pipeline import run_preprocess

    tokenizer._BACKENDS.clear()
    started = time.perf_counter()
    result = run_preprocess(recipe)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cutoff-len", type=int, default=2048)
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="Keep files here (default: a temporary folder)."
    )
    parser.add_argument("--llamafactory-python", default=None, help="A Python with llamafactory installed.")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per measurement; the fastest counts.")
    args = parser.parse_args()

    from magistral_cli.testing.tiny_data import write_synthetic_llava_dataset

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="preprocess-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(work / "model")
    t0 = time.perf_counter()
    dataset = write_synthetic_llava_dataset(work / "data", args.samples, seed=0)
    n_images = sum(len(json.loads(line)["images"]) for line in dataset.read_text().splitlines())
    print(
        f"dataset: {args.samples} rows, {n_images} images, written in {time.perf_counter() - t0:.1f} s ({work})"
    )

    results = {}
    for workers in sorted({1, args.workers}):
        cache = work / f"cache-{workers}"
        recipe = recipe_for(model_dir, dataset, cache, workers, args.cutoff_len)
        colds, encodes, warms = [], [], []
        for _ in range(args.repeat):
            shutil.rmtree(cache, ignore_errors=True)
            cold_s, cold = timed_preprocess(recipe)
            warm_s, warm = timed_preprocess(recipe)
            assert warm.reused and not cold.reused
            colds.append(cold_s)
            encodes.append(cold.report["seconds"])
            warms.append(warm_s)
        results[workers] = {"cold_s": min(colds), "encode_s": min(encodes), "warm_s": min(warms)}
        r = results[workers]
        print(
            f"magistral preprocess, {workers} worker(s): cold {r['cold_s']:.2f} s = {args.samples / r['cold_s']:.0f} "
            f"samples/s (encoding alone {r['encode_s']:.2f} s = {args.samples / r['encode_s']:.0f} samples/s); "
            f"warm cache {r['warm_s']:.2f} s = {args.samples / r['warm_s']:.0f} samples/s; "
            f"kept {cold.report['kept']}, {cold.report['tokens']} tokens (best of {args.repeat})"
        )
    ours = results[args.workers]
    print(f"warm / cold speed-up ({args.workers} workers): {ours['cold_s'] / ours['warm_s']:.1f}x")

    if args.llamafactory_python:
        hf_dir = make_hf_model_dir(model_dir, work / "hf_model")
        runner = Path(__file__).with_name("_llamafactory_preprocess.py")
        env = dict(os.environ, DISABLE_VERSION_CHECK="1")
        assert hf_dir.is_dir()
        for workers in sorted(results):
            command = [
                args.llamafactory_python,
                str(runner),
                str(work),
                str(dataset),
                str(workers),
                str(args.cutoff_len),
            ]
            runs = []
            for _ in range(args.repeat):
                done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
                if done.returncode != 0:
                    print(f"LLaMA-Factory: failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
                    sys.exit(1)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            lf = min(runs, key=lambda run: run["seconds"])
            r = results[workers]
            print(
                f"LLaMA-Factory get_dataset, {workers} worker(s): {lf['seconds']:.2f} s = {lf['samples_per_s']:.0f} "
                f"samples/s, kept {lf['kept']} (best of {args.repeat})"
            )
            print(
                f"  ratio magistral / LLaMA-Factory, {workers} worker(s) (>1 = magistral faster): "
                f"encoding {lf['seconds'] / r['encode_s']:.2f}x; cold end to end {lf['seconds'] / r['cold_s']:.2f}x "
                f"(ours includes building the tokenizer and hashing, theirs excludes loading it); "
                f"warm cache {lf['seconds'] / r['warm_s']:.0f}x"
            )
        # Token ids: rows without a system message must be identical (templates pixtral vs mistral).
        from magistral_cli.data.cache import EncodedDataset

        encoded = EncodedDataset(next((work / f"cache-{args.workers}").glob("magistral-*")))
        rows = [json.loads(line) for line in dataset.read_text().splitlines()]
        theirs = [json.loads(line) for line in (work / "llamafactory_ids.jsonl").read_text().splitlines()]
        compared = same = 0
        for i in range(min(len(encoded), len(theirs))):
            sample = encoded[i]
            if any(m["role"] == "system" for m in rows[sample.source_index]["messages"]):
                continue
            compared += 1
            same += sample.input_ids.tolist() == theirs[i]
        print(f"token ids identical to LLaMA-Factory's on {same}/{compared} rows without a system message")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
