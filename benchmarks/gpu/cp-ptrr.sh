#!/usr/bin/env bash
# cp-ptrr: the sparse placement against PyTorch's PTRR placement (plan(balance="ptrr")) in the
# same runtime and kernels, on one H200, every sampled rank's real staged path with
# communication emulated by device copies (benchmarks/cp_single_gpu.py through cp-runtime.sh,
# --breakdown so the scale model's per-rank check reads it): cp 16, 32, 64, 128 at 128K tokens,
# B=1, Hq=16, Hk=8, D=128, bf16, causal document masks from the corpus lengths; output and dQ
# checked. Session 37's scale model predicts PTRR's attention time better balanced at cp 16
# (1.1-1.6 points of the paper step) and its exchange exposed beyond a node; the emulation has
# no link time, so this call checks the compute side (each rank's layer, per-rank errors of
# the model). 4 heaviest + 2 random ranks a layout; stops starting ranks after 230 s (hard
# timeout 260 s). Results: $OUT/cp-ptrr/cp_runtime.{json,md} + the log. Run from the repo root.
# CPU dry run: CP_PTRR_ARGS="--device cpu --tokens 4096 --cp 16 --heads 2 --kv-heads 1
# --head-dim 8 --dtype float32 --iters 1 --warmup 0" FLASHMASK3_BACKEND=torch OUT=/tmp/x
# bash benchmarks/gpu/cp-ptrr.sh (the extra arguments come last and win).
set -euo pipefail
CP_RUNTIME_NAME=cp-ptrr CP_RUNTIME_TESTS=0 CP_RUNTIME_TIMEOUT=260 \
  CP_RUNTIME_ARGS="--cp 16 32 64 128 --time-budget 230 --breakdown --heaviest 4 --random 2 \
  --configs 'sparse+overlap hier' 'ptrr+overlap hier' sparse+allgather ptrr+allgather ${CP_PTRR_ARGS:-}" \
  exec bash "$(dirname "$0")/cp-runtime.sh"
