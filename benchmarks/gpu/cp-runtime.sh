#!/usr/bin/env bash
# cp-runtime (issue 22): one layer of context-parallel attention, every (sampled) rank's real
# staged path on one H200, communication emulated by device copies: cp 8, 32, 128 at 128K
# tokens, B=1, Hq=16, Hk=8, D=128, bf16, causal document masks from the real corpus lengths.
# Layouts dual_chunk+allgather, sparse+allgather, sparse+overlap flat and hierarchical
# (nodes = cp/8). All ranks at cp 8; the 8 heaviest + 8 random (+ the rank needing most K/V)
# at cp 32 and 128. Every timed rank's output and dQ are also checked against the
# single-GPU layer (--check). Total GPU run time <= 240 s (the benchmark stops starting ranks
# after 180 s; a hard timeout of 230 s). Results: $OUT/cp-runtime/cp_runtime.{json,md} + log.
# Run from the repo root. CPU dry run: CP_RUNTIME_ARGS="--device cpu --tokens 2048 --cp 8 16
# --heads 2 --kv-heads 1 --head-dim 8 --dtype float32 --iters 1 --warmup 0" FLASHMASK3_BACKEND=torch
# OUT=/tmp/x benchmarks/gpu/cp-runtime.sh (the extra arguments come last and win).
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
DIR="$OUT/cp-runtime"
mkdir -p "$DIR"
LOG="$DIR/cp-runtime.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "== environment $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv || echo "nvidia-smi failed"
  python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' || true
  echo "== cp_single_gpu (staged runtime, emulated exchange)"
  timeout 230 python benchmarks/cp_single_gpu.py --cp 8 32 128 --check --time-budget 180 --out "$DIR" ${CP_RUNTIME_ARGS:-} \
    || echo "cp_single_gpu FAILED or timed out (rc=$?): the finished layouts are in $DIR"
  echo "== summary"
  cat "$DIR/cp_runtime.md" 2>/dev/null || echo "no cp_runtime.md written"
} 2>&1 | tee "$LOG"
