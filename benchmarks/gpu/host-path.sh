#!/usr/bin/env bash
# One GPU call for issue 25 (host path), <= 180 s on one H200. From the repository root:
#   OUT=/some/dir bash benchmarks/gpu/host-path.sh
# Steps (each logged; a failing step is recorded and the next one still runs):
#   1. GPU tests: no device sync per call under torch.cuda.set_sync_debug_mode("error") (fwd+bwd,
#      FlashMask and raw columns), CUDA columns out of range (clamped; rejected
#      with FLASHMASK3_CHECK_MASK_VALUES=1), CUDA-graph capture of fwd+bwd replayed with new
#      inputs and a new mask, torch.compile(fullgraph=True) with inductor: one graph per shape
#   2. benchmarks/host_path.py: host µs per call (fwd, fwd+bwd; 32K, 16 heads, D=128, causal
#      documents; FlashMask and raw columns), kernels per call, and the 4K/8K fwd+bwd table vs
#      FlexAttention (standard do_bench and GPU time)
# Outputs: $OUT/host-path/{log.txt, pytest.txt, host_path.json, host_path.md, summary.txt}
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

step "gpu tests (sync debug, out-of-range, CUDA graph, compile)" 90 \
  $PY -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_api.py \
    -k "gpu_no_device_sync or gpu_out_of_range or gpu_cuda_graph or gpu_torch_compile" \
    --junitxml="$DIR/pytest.xml"
step "host time + small problems" 85 $PY benchmarks/host_path.py --out "$DIR"

{ echo "host-path GPU run $(date -u +%FT%TZ)"
  printf '%s\n' "${status[@]}"
  grep -E "passed|failed|error" "$LOG" | tail -3 || true
  [[ -f "$DIR/host_path.md" ]] && sed -n '/^| form/,$p' "$DIR/host_path.md"; } | tee "$DIR/summary.txt"
