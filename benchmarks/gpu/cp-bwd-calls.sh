#!/usr/bin/env bash
# cp-bwd-calls: the A/B of the overlapped backward's calls (docs/cp-runtime.md "Backward calls")
# on one GPU, every (sampled) rank's real staged path with communication emulated by device
# copies (benchmarks/cp_single_gpu.py through cp-runtime.sh): backward_calls stage / one /
# one+local for sparse+overlap flat and hierarchical (nodes = cp/8) at cp 8, 16, 32, 128K tokens,
# B=1, Hq=16, Hk=8, D=128, bf16, causal document masks from the corpus lengths; output and dQ
# checked (--check). The emulation has no link time, so it measures the call-count side of the
# trade-off only (fewer, fuller backward calls), not the returns' lost overlap; the scale model
# predicts both. The benchmark stops starting ranks after 150 s (hard timeout 170 s).
# Results: $OUT/cp-bwd-calls/cp_runtime.{json,md} + the log. Run from the repo root.
# CPU dry run: CP_BWD_ARGS="--device cpu --tokens 2048 --cp 8 16 --heads 2 --kv-heads 1
# --head-dim 8 --dtype float32 --iters 1 --warmup 0" FLASHMASK3_BACKEND=torch OUT=/tmp/x
# bash benchmarks/gpu/cp-bwd-calls.sh (the extra arguments come last and win).
set -euo pipefail
CP_RUNTIME_NAME=cp-bwd-calls CP_RUNTIME_TESTS=0 CP_RUNTIME_TIMEOUT=170 \
  CP_RUNTIME_ARGS="--cp 8 16 32 --time-budget 150 --configs sparse+overlap 'sparse+overlap hier' \
  --backward-calls stage one one+local ${CP_BWD_ARGS:-}" \
  exec bash "$(dirname "$0")/cp-runtime.sh"
