#!/usr/bin/env bash
# The wheels of benchmarks/gpu-wheels.txt for the GPU machine (Python 3.12, manylinux x86_64) into .whl/ (WHEELS_DIR),
# then their total size: a call to that machine carries at most 64 MiB, the repository included.
# There, before anything else: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#   --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEELS_DIR:-.whl}
PY=${PYTHON:-$(command -v python3)}
LIST=benchmarks/gpu-wheels.txt
SOURCE_ONLY="antlr4-python3-runtime|rouge-score"  # no wheel on PyPI: built here (pure Python)
mkdir -p "$DEST"
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
grep -Ev "^($SOURCE_ONLY)==" "$LIST" >"$DEST/.binary.txt"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DEST" -r "$DEST/.binary.txt"
grep -E "^($SOURCE_ONLY)==" "$LIST" >"$DEST/.source.txt" || true
[ -s "$DEST/.source.txt" ] && "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DEST" -r "$DEST/.source.txt"
rm -f "$DEST/.binary.txt" "$DEST/.source.txt"
# one version of each: two stop the whole install there
wanted=$(grep -c '==' "$LIST")
have=$(ls "$DEST"/*.whl | wc -l)
[ "$have" -eq "$wanted" ] || echo "warning: $DEST holds $have wheels, $LIST lists $wanted: remove the others" >&2
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "%d wheels, %.1f MiB\n", '"$have"', $1 / 1048576}'
