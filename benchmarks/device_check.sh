#!/usr/bin/env bash
# One command for a CUDA machine: the probes, tiny CUDA trains (images and packing, DPO, QLoRA), and the
# real-width step benchmark against a bare loop (with the top kernels and the host syncs per step).
#
#   bash benchmarks/device_check.sh OUT_DIR [LAYERS]
#   DEVICE=cpu bash benchmarks/device_check.sh OUT_DIR   # the same stages on the CPU (a dry rehearsal)
#   ONLY="gpu_step gpu_step_lora" bash benchmarks/device_check.sh OUT_DIR   # some stages only
#
# Run from the repository root. Python packages the machine image lacks come as wheels in .whl/
# (benchmarks/README.md says how to download them); they install into /tmp/site, never into the
# image's environment. Each stage has its own time limit and writes one file under OUT_DIR (8 files
# in all: a device lease brings back at most 8); a stage that fails does not stop the next.
set -uo pipefail
out=${1:?usage: device_check.sh OUT_DIR [LAYERS]}
layers=${2:-2}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return 0
    fi
    local start=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.txt"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} >"$out/summary.txt" 2>&1
cat "$out/summary.txt"

stage probes "${PROBES_S:-240}" python3 -m magistral_cli probe all --device "$device" --require-device

qs=$(mktemp -d)
python3 -c "from pathlib import Path; from magistral_cli.quickstart import write_assets; write_assets(Path('$qs'), 64)" \
    >>"$out/summary.txt" 2>&1 || echo "assets: failed (see above)" | tee -a "$out/summary.txt"
tiny() {  # tiny RECIPE DATA_SUBDIR RUN_NAME [OVERRIDES...]: a tiny recipe on one device, 6 steps
    local recipe=$1 data=$2 run=$3
    shift 3
    python3 -m magistral_cli train "$recipe" parallel.device="$device" parallel.nproc_per_node=1 \
        data.dataset_param.preprocess_parameters.model_name_or_path="$qs/model" model.model_name_or_path="$qs/model" \
        training.load="$qs/model" data.dataset_param.basic_parameters.dataset_dir="$qs/$data" \
        data.dataset_param.basic_parameters.dataset="$qs/$data/data.jsonl" \
        data.dataset_param.basic_parameters.cache_dir="$qs/cache" \
        training.train_iters=6 training.save_interval=0 training.output_dir="$qs/$run" "$@" &&
        tail -n 3 "$qs/$run/metrics.jsonl"
}
export qs device
export -f tiny  # timeout runs a program: each stage below is `bash -c "tiny ..."`
stage tiny_train "${TINY_S:-180}" bash -c "tiny recipes/tiny/tiny_cpu.yaml data run \
    data.dataset_param.basic_parameters.neat_packing=true data.dataset_param.basic_parameters.packing=true"
# Preference training (LoRA, the base with adapters off as the reference) and QLoRA (torchao from .whl/).
stage tiny_dpo "${DPO_S:-180}" bash -c "tiny recipes/tiny/tiny_cpu_dpo_lora.yaml pairs dpo"
stage tiny_qlora "${QLORA_S:-180}" bash -c "tiny recipes/tiny/tiny_cpu_qlora.yaml data qlora"

shape=(--layers "$layers" --micro-batch 2 --seq 4096)
[ "$device" = cpu ] && shape=()  # the tiny default shape: real widths would take hours on a CPU
work=$(mktemp -d)  # the profiles land here, then go into one file
# The engine a second time with reshard_after_forward: false (its own row and ratio), in the same run.
stage gpu_step "${STEP_S:-480}" python3 benchmarks/gpu_step.py --device "$device" "${shape[@]}" --profile "$work" \
    --also-no-reshard
cat "$work"/engine_top_kernels.txt "$work"/bare_top_kernels.txt >"$out/top_kernels.txt" 2>/dev/null
# The one-GPU case people run: LoRA r 16 on both sides (the engine's frozen base used in place).
stage gpu_step_lora "${LORA_S:-240}" python3 benchmarks/gpu_step.py --device "$device" "${shape[@]}" --lora 16 \
    --no-inside
