#!/usr/bin/env bash
# cp-bwd-calls: the A/B of the overlapped backward's calls (docs/cp-runtime.md "Backward calls")
# on one H200, every (sampled) rank's real staged path with communication emulated by device
# copies (benchmarks/cp_single_gpu.py): backward_calls stage / one / local+one for sparse+overlap
# flat and hierarchical (nodes = cp/8) at cp 8, 16, 32, 128K tokens, B=1, Hq=16, Hk=8, D=128,
# bf16, causal document masks from the corpus lengths; output and dQ checked (--check). The
# emulation has no link time, so it measures the call-count side of the trade-off only (fewer,
# fuller backward calls), not the returns' lost overlap; the scale model predicts both.
# The benchmark stops starting ranks after 150 s (hard timeout 170 s).
# Results: $OUT/cp-bwd-calls/cp_runtime.{json,md} + the log. Run from the repo root.
# CPU dry run: CP_BWD_ARGS="--device cpu --tokens 2048 --cp 8 16 --heads 2 --kv-heads 1
# --head-dim 8 --dtype float32 --iters 1 --warmup 0" FLASHMASK3_BACKEND=torch OUT=/tmp/x
# bash benchmarks/gpu/cp-bwd-calls.sh (the extra arguments come last and win).
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
DIR="$OUT/cp-bwd-calls"
mkdir -p "$DIR"
LOG="$DIR/cp-bwd-calls.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "== environment $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv || echo "nvidia-smi failed"
  echo "== cp_single_gpu --backward-calls stage one local+one $(date -u +%T)"
  timeout 170 python benchmarks/cp_single_gpu.py --cp 8 16 32 --check --time-budget 150 --out "$DIR" \
    --configs sparse+overlap "sparse+overlap hier" --backward-calls stage one local+one ${CP_BWD_ARGS:-} \
    || echo "cp_single_gpu FAILED or timed out (rc=$?): the finished layouts are in $DIR"
  echo "== summary $(date -u +%T)"
  cat "$DIR/cp_runtime.md" 2>/dev/null || echo "no cp_runtime.md written"
} 2>&1 | tee "$LOG"
