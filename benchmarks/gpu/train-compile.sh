#!/usr/bin/env bash
# Session 35, one H200, <= 240 s: end-to-end training throughput with each decoder block under
# torch.compile (`benchmarks/train.py --compile`, the harness's --compile) for flashmask3, flex
# and sdpa on the same batches (bench-0.6b model, 32K tokens, 2 warm-up steps absorb the
# compiles, 3 timed), next to the eager table of benchmarks/results/train_h200.md.
#   OUT=/path bash benchmarks/gpu/train-compile.sh
# Results: $OUT/train-compile/train_h200_compiled.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the results directory}
DEST="$OUT/train-compile"
mkdir -p "$DEST"
python benchmarks/train.py --compile --seq-lens 32768 --warmup 2 --steps 3 --budget-s 200 \
  --tag h200_compiled --out "$DEST"
