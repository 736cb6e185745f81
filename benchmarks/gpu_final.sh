#!/usr/bin/env bash
# One device call for the end-to-end measurements (run from the repo root on one H200):
#   context-parallel per-rank cost (cp 8 at 128K, dual_chunk vs sparse), the single-GPU
#   training benchmark (flashmask3 vs flex vs sdpa) and the torch-path GPU memory test.
# Results land in $OUT (or benchmarks/results when OUT is unset).
set -u
OUT="${OUT:-benchmarks/results}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/gpu_final.log"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "== cp_single_gpu"; timeout 170 python benchmarks/cp_single_gpu.py --out "$OUT"
  echo "== train"; timeout 290 python benchmarks/train.py --backends flashmask3 flex sdpa --out "$OUT"
  echo "== gpu memory test"; timeout 60 python -m pytest -q -m gpu tests/kernels/test_torch_path.py
} 2>&1 | tee "$LOG"
