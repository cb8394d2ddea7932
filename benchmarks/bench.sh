#!/usr/bin/env bash
# make bench RECIPE=<qwen2-0.5b|gpt-oss-20b>: on a GPU machine (requirements-gpu.txt), the seed baseline, then
# train_throughput.py on one GPU and on every visible GPU; a JSON line per run appended to measurements/results.jsonl
# (docs/performance.md#how-it-is-measured). PROFILE=<path prefix> also writes each run's top kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package, where it is not installed (make setup)
RECIPE=${1:?usage: benchmarks/bench.sh <qwen2-0.5b|gpt-oss-20b> [extra train_throughput.py args]}
shift
SEED_BASELINE=${SEED_BASELINE:-../shared/bench/seed_baseline.py}
RUNS=${BENCH_RUNS:-/tmp/bench-runs}; RESULTS=${BENCH_RESULTS:-measurements/results.jsonl}
COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$RUNS" "$(dirname "$RESULTS")"
BEFORE=$(cat "$RESULTS" 2>/dev/null | wc -l)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

case $RECIPE in
  # STEPS: the timed steps, a window of seconds (10 of Qwen2-0.5B's short steps were too few to compare runs:
  # docs/performance.md)
  qwen2-0.5b) MICRO=32; STEPS=40; batch() { echo "$MICRO 1"; } ;;                # micro-batch, grad accumulation
  gpt-oss-20b) STEPS=10; batch() { local m=$((16 / $1 < 8 ? 16 / $1 : 8)); echo "$m $((16 / $1 / m))"; } ;;  # global 16,
    # as the seed's 8 GPUs; at most 8 rows a micro-step: the recipe's own split (train.global_batch_size: 16), set
    # here by hand with train.global_batch_size=0 (8 x GA 2 on one GPU; 2 x 1 on 8 GPUs)
  *) echo "unknown recipe $RECIPE" >&2; exit 2 ;;
esac

echo "=== seed baseline, $RECIPE, 1 GPU ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 python3 "$SEED_BASELINE" --recipe "$RECIPE" --out "$RUNS/seed.jsonl" 2>&1 | grep '^{'

for n in ${BENCH_GPUS:-1 $( [ "$GPUS" -ge 2 ] && echo "$GPUS")}; do  # BENCH_GPUS="2": only that count
  read -r micro accum <<<"$(batch "$n")"
  echo "=== ours, $RECIPE, $n GPU(s), micro-batch $micro x grad accumulation $accum ($(date +%T))"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) accelerate launch --num_processes "$n" --num_machines 1 \
    $( [ "$n" -gt 1 ] && echo --multi_gpu ) --mixed_precision no --dynamo_backend no \
    benchmarks/train_throughput.py --recipe "$RECIPE" --arch "$RECIPE" --checkpoint "/tmp/bench-$RECIPE" \
    --set train.global_batch_size=0 --set "train.sft.per_device_train_batch_size=$micro" \
    --set "train.sft.gradient_accumulation_steps=$accum" \
    --steps "$STEPS" --seed-result "$RUNS/seed.jsonl" --commit "$COMMIT" --label fast --out "$RESULTS" \
    ${PROFILE:+--profile "$PROFILE-$RECIPE-${n}gpu.txt"} "$@" 2>&1 | grep --line-buffered -E '^\{|^#|^built|Error|^Thread|^  File|^Current' || true
done
tail -n +$((BEFORE + 1)) "$RESULTS" >"$RUNS/this-call.jsonl"  # this call's rows, as make bench-history shows them
python3 benchmarks/bench_history.py "$RUNS/this-call.jsonl"
