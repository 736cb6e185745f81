#!/usr/bin/env bash
# One GPU call for issue 25 (host path), budget 150 s on one H200 including compiles. From the
# repository root:
#   OUT=/some/dir bash benchmarks/gpu/host-path.sh
# Steps (each logged; a failing step is recorded and the next one still runs):
#   1. GPU tests (~40 s): the fast launch path (flashmask3/kernels/launcher.py) against Triton's
#      own (forward and dK/dV bitwise, dQ to fp32-atomics tolerance), the current stream, a
#      profiler hook falling back to JITFunction.run; the plan cache (in-place edits of CUDA
#      columns, fresh masks); no device sync per call (set_sync_debug_mode("error")), CUDA
#      columns out of range, CUDA-graph capture of fwd+bwd replayed with new inputs and a new
#      mask (the cache warm before the capture), torch.compile(fullgraph=True): one graph per
#      shape
#   2. benchmarks/host_path.py (~80 s): host µs per call at 32K (16 heads, D=128, 16 causal
#      documents; FlashMask and raw columns; fwd and fwd+bwd) with the mask reused (a model's
#      layers) and with the plans rebuilt every call (a fresh mask), and the A/B with every
#      kernel through JITFunction.run; std/GPU ms and kernels per call; a cProfile per variant
#      (profile_*.txt); the 4K/8K fwd+bwd table vs FlexAttention
# Outputs: $OUT/host-path/{log.txt, pytest.xml, host_path.json, host_path.md, profile_*.txt,
#          summary.txt}
set -euo pipefail
OUT=${OUT:-/tmp/out}
DIR="$OUT/host-path"
mkdir -p "$DIR"
LOG="$DIR/log.txt"
: > "$LOG"
export FLASHMASK3_BACKEND=triton
PY=${PY:-python}
status=()

step() {  # step NAME TIMEOUT_S CMD...: run, log, keep going
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  if timeout "$limit" "$@" >> "$LOG" 2>&1; then
    status+=("$name: ok ($((SECONDS - t0)) s)")
  else
    status+=("$name: FAILED rc=$? ($((SECONDS - t0)) s)")
  fi
  echo "-- ${status[-1]}" | tee -a "$LOG"
}

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null || true; } >> "$LOG" 2>&1

step "gpu tests (launcher, plan cache, sync debug, out-of-range, CUDA graph, compile)" 70 \
  $PY -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -m gpu \
    tests/kernels/test_launcher.py tests/kernels/test_plan_cache.py tests/test_api.py \
    --junitxml="$DIR/pytest.xml"
step "host time + small problems" 100 $PY benchmarks/host_path.py --out "$DIR"

{ echo "host-path GPU run $(date -u +%FT%TZ)"
  printf '%s\n' "${status[@]}"
  grep -E "passed|failed|error" "$LOG" | tail -3 || true
  [[ -f "$DIR/host_path.md" ]] && sed -n '/^| form/,$p' "$DIR/host_path.md"; } | tee "$DIR/summary.txt"
