#!/usr/bin/env bash
# Generation levers for gpt-oss-20b on one GPU, in one call (well within 9 minutes): the evaluate stage's generate
# path at 301 rows against transformers' continuous batching (benchmarks/generation_speed.py's cb variants), on the
# full-size stand-in. From the repository root of the GPU machine:
#   bash benchmarks/generation_levers.sh
# 1. The pinned wheels (benchmarks/fetch_gpu_wheels.sh -> .whl/, carried to the machine) into /tmp/site, as the other
#    GPU runs install them: transformers 5.24 over the image's 5.17 (the cb variants need 5.24), DVC and pydantic
#    (lora_pipeline.config). Without .whl/: the image's packages.
# 2. The stand-in: `benchmarks/pipeline_setup.py stand-in gpt-oss-20b` (openai/gpt-oss-20b's config, random init,
#    experts written in MXFP4, a tokenizer trained on the stand-in rows), built under LEVERS_WORK once and kept there.
# 3. generation_speed.py loads it as the recipe does (flex attention, grouped_mm experts: generation runs eager
#    attention and grouped_mm_generate) and runs each variant for LEVERS_NEW_TOKENS tokens a row; it is stopped at
#    LEVERS_DEADLINE seconds from the start, and what it measured by then stays (the script then exits 3).
# Results: $OUT/generation.jsonl (one JSON line a call, with recipe, commit, date and command added) and
# $OUT/generation_levers.log. Env: OUT (default ./gpu-out), LEVERS_WORK (/tmp/generation-levers), LEVERS_NEW_TOKENS
# (128: about 13 s an eager variant at 100 ms a step), LEVERS_VARIANTS, LEVERS_DEADLINE (520), LEVERS_COMMIT,
# WHEELS_DIR (.whl), LEVERS_TINY=1 (a reduced stand-in: a check of the script on a CPU, with small LEVERS_VARIANTS).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${LEVERS_WORK:-/tmp/generation-levers}
WHEELS=${WHEELS_DIR:-.whl}
NEW_TOKENS=${LEVERS_NEW_TOKENS:-128}
# the shipped path first; then continuous batching at 512 tokens a step, with its steps as CUDA graphs (two calls:
# the first records them), and at 2048 tokens a step (fewer steps while the prompts are read)
VARIANTS=${LEVERS_VARIANTS:-generate:301 cb:301 cb:301:cudagraphs cb:301:eager:2048}
DEADLINE=${LEVERS_DEADLINE:-520}
COMMIT=${LEVERS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LOG=$OUT/generation_levers.log
RAW=$WORK/generation.jsonl
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
step() { echo "=== $* ($(date +%T), ${SECONDS} s)" | tee -a "$LOG"; }
trap 'echo "stopped at line $LINENO (exit $?); the log: $LOG" >&2; tail -n 30 "$LOG" >&2' ERR

step "wheels from $WHEELS"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
else
  echo "no wheels in $WHEELS: the image's packages" | tee -a "$LOG"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this copy's code
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG" || true
python3 -c "import importlib.metadata as m, sys
print(sys.version.split()[0], {k: m.version(k) for k in ['torch', 'transformers', 'accelerate', 'dvc']})" | tee -a "$LOG"

step "stand-in gpt-oss-20b under $WORK"
mkdir -p "$WORK"
MODEL=$(python3 benchmarks/pipeline_setup.py stand-in gpt-oss-20b --work "$WORK" \
  ${LEVERS_TINY:+--tiny --rows 120} 2>>"$LOG")
{ cat "$WORK/model.json"; echo; } >>"$LOG"

step "generation_speed.py: $VARIANTS; $NEW_TOKENS new tokens a row"
rm -f "$RAW"
COMMAND="python benchmarks/generation_speed.py <stand-in> --attention flex_attention --experts grouped_mm --variants \
$VARIANTS --new-tokens $NEW_TOKENS --calls 2"
status=0
timeout --kill-after=15 $((DEADLINE - SECONDS > 30 ? DEADLINE - SECONDS : 30)) \
  python3 benchmarks/generation_speed.py "$MODEL" --attention flex_attention --experts grouped_mm \
  --variants $VARIANTS --new-tokens "$NEW_TOKENS" --calls 2 --out "$RAW" >>"$LOG" 2>&1 || status=$?
[ "$status" -eq 0 ] || echo "generation_speed.py exited $status (124: stopped at the deadline)" | tee -a "$LOG"
[ "$status" -ne 124 ] || status=3  # the script's own exit 124 would read as a run past the machine's time limit

step "results"
LABEL="gpt-oss-20b stand-in (benchmarks/pipeline_setup.py, random init${LEVERS_TINY:+, reduced})"
python3 - "$RAW" "$OUT/generation.jsonl" "$COMMIT" "$COMMAND" "$LABEL" <<'EOF' | tee -a "$LOG"
import datetime, json, pathlib, sys
raw, out, commit, command, label = sys.argv[1:]
rows = [json.loads(line) for line in pathlib.Path(raw).read_text().splitlines()] if pathlib.Path(raw).exists() else []
with open(out, "a") as f:
    for row in rows:
        row.update(model=label, recipe="gpt-oss-20b", commit=commit, date=datetime.date.today().isoformat(),
                   command=command)
        f.write(json.dumps(row) + "\n")
        print(json.dumps(row))
print(f"{len(rows)} rows -> {out}")
EOF
exit "$status"
