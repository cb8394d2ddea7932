#!/usr/bin/env bash
# The GPU measurements behind docs/gpu-runs.md, on a machine with 2 GPUs:
#   bash benchmarks/gpu_runs.sh ddp      (a) Qwen2-0.5B full size, 2 processes, with and without Liger
#   bash benchmarks/gpu_runs.sh parallel   (a) Qwen2-0.5B full size and (b) gpt-oss full width, 4 layers,
#                                          both through accelerate with 2 processes; plus the tiny default's
#                                          train stage on 2 GPUs and the seed baseline for Qwen2-0.5B
#   bash benchmarks/gpu_runs.sh gpt-oss-20b (c) full-size gpt-oss-20b on one GPU, and its seed baseline
# Needs torch, transformers, peft, accelerate, trl, datasets, liger-kernel; SEED_BASELINE points at the seed
# recipes' benchmark (../shared/bench/seed_baseline.py) to run beside ours. Results go to $OUT (default ./gpu-out).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package, where it is not installed (make setup)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
SEED_BASELINE=${SEED_BASELINE:-../shared/bench/seed_baseline.py}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LAUNCH2="accelerate launch --config_file configs/accelerate/multi_gpu_2.yaml"
step() { echo; echo "=== $* ($(date +%T))"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.csv"
python3 -c "import torch, transformers, peft, trl, accelerate, datasets, liger_kernel, importlib.metadata as m
print({k: m.version(k) for k in ['torch', 'transformers', 'peft', 'trl', 'accelerate', 'datasets', 'liger-kernel', 'triton']})" \
  | tee "$OUT/versions.txt"

case "${1:-parallel}" in
ddp)
  for liger in on off; do
    step "(a) Qwen2-0.5B full size, recipe, Liger $liger, 2 processes"
    $LAUNCH2 benchmarks/train_throughput.py --recipe qwen2-0.5b --arch qwen2-0.5b --liger $liger \
      --checkpoint /tmp/qwen2-0.5b --out "$OUT/ours.jsonl" 2>&1 | grep -E "^\{|Error|error" | tail -5
  done
  ;;
parallel)
  step "seed baseline, Qwen2-0.5B, 1 GPU"
  CUDA_VISIBLE_DEVICES=0 python3 "$SEED_BASELINE" --recipe qwen2-0.5b --out "$OUT/seed.jsonl" 2>&1 | tail -1
  step "(a) Qwen2-0.5B full size, recipe (Liger on), 1 process"
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/train_throughput.py --recipe qwen2-0.5b --arch qwen2-0.5b \
    --checkpoint /tmp/qwen2-0.5b --out "$OUT/ours.jsonl" 2>&1 | grep -E "^\{|Error|error" | tail -5
  step "(a) Qwen2-0.5B full size, recipe, 2 processes, built-in conversations (loss must fall)"
  $LAUNCH2 benchmarks/train_throughput.py --recipe qwen2-0.5b --arch qwen2-0.5b --workload builtin \
    --steps 20 --checkpoint /tmp/qwen2-0.5b --out "$OUT/ours.jsonl" 2>&1 | grep -E "^\{|Error|error" | tail -5
  step "(b) gpt-oss full width, 4 layers, MXFP4 checkpoint loaded with dequantize, 2 processes"
  $LAUNCH2 benchmarks/train_throughput.py --recipe gpt-oss-20b --arch gpt-oss-20b --layers 4 \
    --checkpoint /tmp/gpt-oss-4l --out "$OUT/ours.jsonl" 2>&1 | grep -E "^\{|built|Error|error" | tail -5
  $LAUNCH2 benchmarks/train_throughput.py --recipe gpt-oss-20b --arch gpt-oss-20b --layers 4 \
    --workload builtin --steps 20 --checkpoint /tmp/gpt-oss-4l --out "$OUT/ours.jsonl" 2>&1 | grep -E "^\{|Error|error" | tail -5
  step "the tiny default's stages on 2 GPUs: fetch, split, train (accelerate, 2 processes), merge, evaluate"
  python3 -m stages.fetch > "$OUT/tiny.log" 2>&1 && python3 -m stages.split >> "$OUT/tiny.log" 2>&1 \
    && $LAUNCH2 -m stages.train >> "$OUT/tiny.log" 2>&1 && python3 -m stages.merge >> "$OUT/tiny.log" 2>&1 \
    && python3 -m stages.evaluate >> "$OUT/tiny.log" 2>&1; echo "exit $?"
  cp metrics/train.json "$OUT/tiny-train.json" 2>/dev/null; cp metrics/eval.json "$OUT/tiny-eval.json" 2>/dev/null
  tail -3 "$OUT/tiny.log"
  ;;
gpt-oss-20b)
  step "seed baseline, gpt-oss-20b, 1 GPU"
  CUDA_VISIBLE_DEVICES=0 python3 "$SEED_BASELINE" --recipe gpt-oss-20b --out "$OUT/seed.jsonl" 2>&1 | tail -1
  step "(c) gpt-oss-20b full size: build MXFP4 checkpoint, load with dequantize, train, 1 GPU"
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/train_throughput.py --recipe gpt-oss-20b --arch gpt-oss-20b --steps 6 \
    --checkpoint /tmp/gpt-oss-20b --out "$OUT/ours.jsonl" 2>&1 | grep -E "^\{|built|Error|error" | tail -5
  ;;
esac
echo; echo "=== results"; cat "$OUT"/seed.jsonl "$OUT"/ours.jsonl 2>/dev/null
