#!/usr/bin/env bash
# Scale-model calibration on one H200 (issue 23): per-rank attention shapes (GPU time with the
# host hidden, host time per call, steady-state time per call of a back-to-back stream) + matmul
# throughput, and more stream samples of the host-bound calls, interleaved (REPEAT_S=125: ~48
# rounds, measure.STREAM_REPEATS). Runs from the repo root; <= 330 s (BUDGET_S=175 + REPEAT_S of
# measurement + start-up, killed at BUDGET_S + REPEAT_S + 30; ~50 s of it is idle GPU before the
# long calls' streams, measure.STREAM_IDLE_S). Writes $OUT/scale-model/.
#   OUT=/root/out bash benchmarks/gpu/scale-model.sh
#   OUT=/tmp/sm DRY_RUN=1 bash benchmarks/gpu/scale-model.sh      # CPU smoke run (tiny sizes)
# Then commit $OUT/scale-model/scale_model_{attention,matmul}.json to benchmarks/results/ and run
#   python -m benchmarks.scale_model calibrate && python -m benchmarks.scale_model all
set -euo pipefail
OUT="${OUT:?set OUT}"
DIR="$OUT/scale-model"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-175}"
REPEAT_S="${REPEAT_S:-125}"
EXTRA=()
if [[ "${DRY_RUN:-0}" == "1" ]]; then EXTRA=(--dry-run --device cpu); fi
mkdir -p "$DIR"
LOG="$DIR/log.txt"
echo "scale-model.sh start $(date -u +%FT%TZ) budget ${BUDGET_S}s + ${REPEAT_S}s" | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$LOG" 2>&1 || true
export FLASHMASK3_TRITON_AUTOTUNE="${FLASHMASK3_TRITON_AUTOTUNE:-0}"
if ! timeout $((BUDGET_S + REPEAT_S + 30)) "$PY" benchmarks/scale_model/measure.py --out "$DIR" \
        --budget-s "$BUDGET_S" --repeat-s "$REPEAT_S" "${EXTRA[@]}" \
        >> "$LOG" 2>&1; then
    echo "measure.py failed or timed out (rc=$?); partial results kept" | tee -a "$LOG"
fi
ls -la "$DIR" >> "$LOG" 2>&1 || true
grep -h "SUMMARY" "$DIR/measure.log" 2>/dev/null || echo "SUMMARY scale-model: no summary (see $LOG)"
tail -n 5 "$LOG"
