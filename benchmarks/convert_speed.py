"""Memory and speed of `magistral convert` on a multi-GB synthetic checkpoint, side by side with a file copy.

    python benchmarks/convert_speed.py --size-gib 4 --shard-gib 1

Writes a Mistral3 checkpoint in the official layout (config.json, shards, index; bf16 random
bytes) whose shapes are a scaled-down Magistral (hidden 2048, as many decoder layers as the
size asks for), then, in the same run and on the same disk, for each repeat:

* copies the shards with ``shutil.copyfile``, and runs ``hf-to-dcp`` (fsdp2 layout),
  ``dcp-to-hf`` (official layout) and ``dcp-to-hf --format mistral`` (the native layout: the query
  and key rows go through memory to be put in rotary order, the rest is copied) in fresh child
  processes, each reporting its peak resident memory and the wall time of the conversion call;
* does the same again with an fsync of every written file (``--fsync``), against a copy that
  fsyncs each file too.

It prints peak RSS against the budget "largest shard + 512 MiB", and conversion throughput as
a ratio of the plain copy's. The child's RSS includes the Python, torch and transformers
imports (reported separately as the import baseline).

``--baseline DIR`` (a directory holding another commit's ``magistral_cli``, e.g. from
``git archive``) runs both exports with that code too, interleaved with the current code's runs,
so a change is measured before and after under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
GIB = 2**30

CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
mode, a, b, c, fsync = sys.argv[1:6]
fsync = fsync == "fsync"
# Imports are a fixed start-up cost (seconds, a few hundred MiB), measured apart from the work.
import torch
from transformers import Mistral3ForConditionalGeneration
from magistral_cli.checkpoint.hf_to_dcp import convert_hf_to_dcp
from magistral_cli.checkpoint.dcp_to_hf import export_dcp_to_hf

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

imports_rss = status("VmRSS")
imports_peak = status("VmHWM")
with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the peak of the work alone from here
    f.write("5")
t = time.perf_counter()
if mode == "hf-to-dcp":
    convert_hf_to_dcp(a, b, "fsdp2", fsync=fsync)
elif mode == "dcp-to-hf":
    export_dcp_to_hf(a, b, c, fsync=fsync)
elif mode == "dcp-to-native":
    export_dcp_to_hf(a, b, c, fsync=fsync, format="mistral")
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "imports_rss": imports_rss, "work_peak_rss": status("VmHWM"),
                  "process_peak_rss": max(imports_peak, status("VmHWM"))}))
"""


def _child(mode: str, *args: str, code: Path = REPO) -> dict:
    """Run one conversion in a fresh process with the ``magistral_cli`` found in ``code``."""
    os.sync()  # start every measurement without a backlog of dirty pages from the previous one
    env = dict(os.environ, PYTHONPATH=str(code) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _config(size_bytes: int) -> tuple[dict, int]:
    """A Mistral3 config.json whose bf16 weights are about ``size_bytes``."""
    hidden, inter, vocab, heads, kv, head_dim = 2048, 8192, 32768, 16, 8, 128
    per_layer = 2 * (
        2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    )
    fixed = 2 * (2 * vocab * hidden + hidden)
    layers = max(1, round((size_bytes - fixed) / per_layer))
    from magistral_cli.testing.tiny_model import tiny_mistral3_config

    config = tiny_mistral3_config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers)
    text = config.text_config
    text.intermediate_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim = (
        inter,
        heads,
        kv,
        head_dim,
    )
    return config.to_dict(), layers


def write_synthetic_checkpoint(directory: Path, size_bytes: int, shard_bytes: int) -> dict:
    """config.json + bf16 shards of at most ``shard_bytes`` in the official layout + index."""
    import torch
    from safetensors.torch import save_file
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from magistral_cli.checkpoint.keys import transformers_to_official_key
    from magistral_cli.model_config import apply_tying_rule

    config_dict, layers = _config(size_bytes)
    config_dict["dtype"] = "bfloat16"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2))
    # The native export ships the base's tokenizer file with the weights: a stand-in will do.
    (directory / "tekken.json").write_text(json.dumps({"config": {"pattern": "synthetic"}, "vocab": []}))
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(apply_tying_rule(Mistral3Config.from_dict(config_dict)))
    shapes = [(transformers_to_official_key(k), tuple(v.shape)) for k, v in model.state_dict().items()]
    groups: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for key, shape in shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, shape))
        size += nbytes
    # Random bytes, made fast: one 64 MiB random block tiled over every tensor.
    block = torch.randint(-(2**15), 2**15, (32 * MIB,), dtype=torch.int16).view(torch.bfloat16)
    weight_map, total, largest = {}, 0, 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key, shape in group:
            n = int(torch.Size(shape).numel())
            flat = block.repeat(-(-n // block.numel()))[:n].clone()
            tensors[key] = flat.view(shape)
            weight_map[key] = name
        save_file(tensors, directory / name, metadata={"format": "pt"})
        nbytes = sum(t.numel() * 2 for t in tensors.values())
        total += nbytes
        largest = max(largest, (directory / name).stat().st_size)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"layers": layers, "shards": len(groups), "bytes": total, "largest_shard": largest}


def copy_shards(src: Path, dst: Path, fsync: bool) -> float:
    dst.mkdir()
    os.sync()
    start = time.perf_counter()
    for path in sorted(src.glob("*.safetensors")):
        shutil.copyfile(path, dst / path.name)
        if fsync:
            fd = os.open(dst / path.name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=4.0, help="Checkpoint size (default 4 GiB).")
    parser.add_argument("--shard-gib", type=float, default=1.0, help="Largest shard size (default 1 GiB).")
    parser.add_argument("--repeats", type=int, default=2, help="Alternating repeats; medians are printed.")
    parser.add_argument("--work-dir", type=Path, default=None, help="Where to write (default: a temp dir).")
    parser.add_argument("--keep", action="store_true", help="Keep the files.")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="A directory holding another commit's magistral_cli: its exports run too, interleaved.",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="convert-bench-", dir=args.work_dir))
    try:
        t = time.perf_counter()
        info = write_synthetic_checkpoint(work / "hf", int(args.size_gib * GIB), int(args.shard_gib * GIB))
        print(
            f"synthetic checkpoint: {info['bytes'] / GIB:.2f} GiB in {info['shards']} shards "
            f"(largest {info['largest_shard'] / MIB:.0f} MiB), {info['layers']} decoder layers, "
            f"written in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
        exports = (
            ("dcp2hf", "dcp-to-hf", "dcp-to-hf (official)"),
            ("native", "dcp-to-native", "dcp-to-hf --format mistral"),
        )
        codes = [("", REPO)] + ([("_base", args.baseline.resolve())] if args.baseline else [])
        names = [("shutil.copyfile", "copy"), ("hf-to-dcp (fsdp2)", "hf2dcp")]
        names += [
            (label + (" [baseline]" if tag else ""), key + tag)
            for key, _, label in exports
            for tag, _ in codes
        ]
        rows: dict[str, list[float]] = {key + sync: [] for _, key in names for sync in ("", "_fsync")}
        mem: dict[str, list[dict]] = {k: [] for k in rows if not k.startswith("copy")}
        for r in range(args.repeats):
            for sync in ("", "_fsync"):
                flag = "fsync" if sync else "-"
                rows["copy" + sync].append(copy_shards(work / "hf", work / f"copy{r}", fsync=bool(sync)))
                # Each measurement starts with only its inputs in the page cache: outputs left
                # behind would shrink free memory and make the later runs pay for page reclaim.
                shutil.rmtree(work / f"copy{r}")
                res = _child("hf-to-dcp", str(work / "hf"), str(work / f"dcp{r}"), "-", flag)
                rows["hf2dcp" + sync].append(res["seconds"])
                mem["hf2dcp" + sync].append(res)
                # Alternate the order of the two codes between repeats: neither always runs first.
                for tag, code in codes if r % 2 == 0 else codes[::-1]:
                    for key, mode, _ in exports:
                        out = work / f"out{r}{key}{tag}"
                        res = _child(mode, str(work / f"dcp{r}"), str(work / "hf"), str(out), flag, code=code)
                        rows[key + tag + sync].append(res["seconds"])
                        mem[key + tag + sync].append(res)
                        shutil.rmtree(out)
                shutil.rmtree(work / f"dcp{r}")
        size = info["bytes"]
        budget = info["largest_shard"] + 512 * MIB
        print(
            f"\n{'':46}{'MiB/s':>7}{'vs copy':>9}{'spread':>13}{'peak RSS':>10}{'budget':>8}{'in budget':>11}{'imports':>9}{'process':>9}"
        )
        for sync in ("", "_fsync"):
            copy_tp = size / statistics.median(rows["copy" + sync]) / MIB
            for label, key in names:
                key += sync
                tp = size / statistics.median(rows[key]) / MIB
                ratios = [size / s / MIB / copy_tp for s in rows[key]]
                line = f"{label + (' + fsync' if sync else ''):46}{tp:7.0f}{tp / copy_tp:9.2f}"
                line += f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}"
                if key in mem:
                    peak = max(m["work_peak_rss"] for m in mem[key])
                    imports = max(m["imports_rss"] for m in mem[key])
                    process = max(m["process_peak_rss"] for m in mem[key])
                    line += f"{peak / MIB:10.0f}{budget / MIB:8.0f}{'yes' if peak <= budget else 'NO':>11}"
                    line += f"{imports / MIB:9.0f}{process / MIB:9.0f}"
                print(line)
        print(
            "\nMiB/s: checkpoint bytes / median wall time (conversion call, after imports); vs copy: against\n"
            "the copy with the same durability (fsync rows against copy + fsync); spread: the lowest and\n"
            "highest single run against the median copy. peak RSS (MiB):\n"
            "the process's resident peak while converting (VmHWM reset after the imports, so it includes\n"
            "the resident imports); budget = largest shard + 512 MiB; imports = RSS after importing torch\n"
            "and transformers; process = the child's peak over its whole life, import-time spikes included\n"
            "(VmHWM; ru_maxrss would include the parent's RSS at fork)."
        )
        print("runs (s): " + ", ".join(f"{k}={[round(x, 2) for x in v]}" for k, v in rows.items()))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
