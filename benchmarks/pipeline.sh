#!/usr/bin/env bash
# make pipeline RECIPE=<qwen2-0.5b|gpt-oss-20b|default>: a recipe's whole pipeline offline, each stage timed, in a
# scratch copy (PIPELINE_WORK) with stand-ins for what only the Hub serves; one JSON line per stage to PIPELINE_OUT
# (default measurements/pipeline.jsonl). How, and MGSM_DIR, PIPELINE_ACCELERATE, _SET, _EXP, _FORCE, _TINY and _ROWS:
# docs/performance.md#the-whole-pipeline-stage-by-stage-make-pipeline. Also PIPELINE_NOTE (recorded in each row),
# PIPELINE_COMMIT, PIPELINE_CMD=1 (each stage's cmd, not `dvc repro -s`).
#   bash benchmarks/pipeline.sh gpt-oss-20b [stage ...]   only those stages
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
RECIPE=${1:?usage: benchmarks/pipeline.sh <qwen2-0.5b|gpt-oss-20b|default> [stage ...]}
shift
WORK=${PIPELINE_WORK:-/tmp/pipeline-$RECIPE}
OUT=${PIPELINE_OUT:-measurements/pipeline.jsonl}
mkdir -p "$WORK" "$(dirname "$OUT")"
WORK=$(cd "$WORK" && pwd) OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")  # absolute: the rest runs in the copy
MGSM=${MGSM_DIR:-../shared/data/mgsm}
[ "$MGSM" = none ] || MGSM=$(cd "$MGSM" 2>/dev/null && pwd || echo "$MGSM")
COMMIT=${PIPELINE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -z "${PIPELINE_COMMIT:-}" ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  COMMIT="$COMMIT+changes"  # the working tree differs from the commit
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset MLFLOW_TRACKING_URI DVC_ROOT DVC_EXP_NAME  # the copy's own sqlite store and DVC repo
PY=$(command -v python || command -v python3)
# dvc.yaml's commands call `python` and `accelerate`: shims where the machine has only python3 / the module
mkdir -p "$WORK/bin"
command -v python >/dev/null || ln -sf "$PY" "$WORK/bin/python"
command -v accelerate >/dev/null || printf '#!/bin/sh\nexec %s -m accelerate.commands.accelerate_cli "$@"\n' "$PY" >"$WORK/bin/accelerate"
chmod +x "$WORK/bin/"* 2>/dev/null || true
export PATH="$WORK/bin:$PATH"

REPO=$(PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/pipeline_setup.py copy --work "$WORK")
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the copy's code, where the package is installed elsewhere
SETS=()
for s in ${PIPELINE_SET:-}; do SETS+=(--set "$s"); done
echo "=== setup $RECIPE in $WORK ($(date +%T))"
"$PY" benchmarks/pipeline_setup.py build "$RECIPE" --work "$WORK" --mgsm "$MGSM" \
  ${PIPELINE_ACCELERATE:+--accelerate "$PIPELINE_ACCELERATE"} ${PIPELINE_TINY:+--tiny} \
  ${PIPELINE_ROWS:+--rows "$PIPELINE_ROWS"} "${SETS[@]}"
# exec: a SIGTERM (timeout) reaches the recorder, which stops the stage and records it
exec "$PY" benchmarks/pipeline_record.py "$RECIPE" "$@" --repo "$REPO" --out "$OUT" --commit "$COMMIT" \
  ${PIPELINE_FORCE:+--force} ${PIPELINE_CMD:+--cmd} ${PIPELINE_NOTE:+--note "$PIPELINE_NOTE"} \
  ${PIPELINE_EXP:+--exp $PIPELINE_EXP}
