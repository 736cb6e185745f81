#!/usr/bin/env bash
# cp-runtime (issue 22; session 18: the staged backward): one layer of context-parallel
# attention, every (sampled) rank's real staged path on one H200, communication emulated by
# device copies: cp 8, 32, 128 at 128K tokens, B=1, Hq=16, Hk=8, D=128, bf16, causal document
# masks from the real corpus lengths. Layouts, in this order (the A/B pair first, so a cut
# budget cannot lose one half): sparse+overlap (staged backward), sparse+overlap bwd per stage
# (one whole backward per stage: the runtime before session 18), sparse+allgather, sparse+overlap
# hier (nodes = cp/8). All ranks at cp 8; the 8 heaviest + 8 random (+ the rank needing most
# K/V) at cp 32 and 128. Every timed rank's output and dQ are checked against the single-GPU
# layer (--check). First the GPU test of the staged backward (fused and split, D=64/128, against
# the float64 reference and one whole backward; <= 45 s with compiles).
# Total GPU run time <= 170 s: pytest <= 45 s, the benchmark stops starting ranks after 95 s
# (hard timeout 120 s). Results: $OUT/cp-runtime/cp_runtime.{json,md}, pytest.log + the log.
# CP_RUNTIME_TESTS=0 skips the pytest step; CP_RUNTIME_TIMEOUT (120) is the benchmark's hard limit;
# CP_RUNTIME_NAME names the results folder (default cp-runtime).
# Session 28's breakdown call (where each rank's GPU time goes, for the scale model):
#   CP_RUNTIME_TESTS=0 CP_RUNTIME_TIMEOUT=200 CP_RUNTIME_ARGS="--breakdown --time-budget 150 \
#   --configs sparse+overlap sparse+allgather 'sparse+overlap hier' --heaviest 4 --random 2"
# Run from the repo root. CPU dry run: CP_RUNTIME_ARGS="--device cpu --tokens 2048 --cp 8 16
# --heads 2 --kv-heads 1 --head-dim 8 --dtype float32 --iters 1 --warmup 0" FLASHMASK3_BACKEND=torch
# OUT=/tmp/x benchmarks/gpu/cp-runtime.sh (the extra arguments come last and win).
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
NAME="${CP_RUNTIME_NAME:-cp-runtime}"  # the results folder and log name (cp-bwd-calls.sh sets its own)
DIR="$OUT/$NAME"
mkdir -p "$DIR"
LOG="$DIR/$NAME.log"
eval "EXTRA=(${CP_RUNTIME_ARGS:-})"  # shell words: a quoted layout name stays one argument
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "== environment $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv || echo "nvidia-smi failed"
  python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' || true
  if [[ "${CP_RUNTIME_TESTS:-1}" == 1 ]]; then  # (0: gpu-tests.sh ran them in this call)
    echo "== GPU test of the staged backward $(date -u +%T)"
    timeout 45 python -m pytest -q -m gpu tests/kernels/test_staged.py > "$DIR/pytest.log" 2>&1 \
      && echo "staged backward GPU tests passed" || echo "staged backward GPU tests FAILED or timed out (rc=$?): see pytest.log"
    tail -3 "$DIR/pytest.log" || true
  fi
  echo "== cp_single_gpu (staged runtime, emulated exchange) $(date -u +%T)"
  timeout "${CP_RUNTIME_TIMEOUT:-120}" python benchmarks/cp_single_gpu.py --cp 8 32 128 --check --time-budget 95 --out "$DIR" \
    --configs sparse+overlap "sparse+overlap bwd per stage" sparse+allgather "sparse+overlap hier" "${EXTRA[@]}" \
    || echo "cp_single_gpu FAILED or timed out (rc=$?): the finished layouts are in $DIR"
  echo "== summary $(date -u +%T)"
  cat "$DIR/cp_runtime.md" 2>/dev/null || echo "no cp_runtime.md written"
} 2>&1 | tee "$LOG"
