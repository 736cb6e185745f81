#!/usr/bin/env bash
# Issue 24 (branch harness), one H200, <= 150 s: the training harness's step time with the next
# batch packed, masked and copied to the GPU in the loader's background thread vs inside the
# step (bench-0.6b model, cp 1, bf16, flashmask3; 32K and 128K tokens; 1 warm-up + 3 timed
# steps each), plus the host time to pack a 128K batch and to plan it for CP 8.
#   OUT=/path bash benchmarks/gpu/harness.sh            # GPU
#   DRY_RUN=1 OUT=/tmp/x bash benchmarks/gpu/harness.sh # CPU smoke test, tiny model
# Results: $OUT/harness/harness_h200.{json,md} (or harness_cpu_toy.* when dry), harness.log.
# benchmarks/results/ keeps the harness table as a section of train_h200.md (folded in session 18).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the results directory}
DEST="$OUT/harness"
mkdir -p "$DEST"
LOG="$DEST/harness.log"
PY=${PY:-python}
if [[ -n "${DRY_RUN:-}" ]]; then
  ARGS=(--toy --seq-lens 512 --warmup 1 --steps 2 --budget-s 60)
else
  ARGS=(--seq-lens 32768 131072 --warmup 1 --steps 3 --budget-s 90)
fi
SECONDS=0
{
  echo "== harness.sh $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    || echo "version check failed"
  timeout 140 "$PY" benchmarks/train.py --loader-ab "${ARGS[@]}" --out "$DEST" \
    || echo "loader A/B failed or timed out (rc=$?)"
  echo "== harness.sh: ${SECONDS}s"
} 2>&1 | tee "$LOG"
for md in "$DEST"/harness_*.md; do [[ -f "$md" ]] && cat "$md"; done
