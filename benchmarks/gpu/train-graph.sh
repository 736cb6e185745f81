#!/usr/bin/env bash
# Session 40, one GPU, <= 240 s: the training harness's --cuda-graph mode (the whole step
# captured once and replayed per batch, flashmask3/train/graphed.py): its GPU tests (the same
# losses as eager with a new mask every step, and the check that a stale mask would be caught),
# then `benchmarks/train.py --graph-ab` (eager vs graphed step time, small model, 2K-8K tokens).
#   OUT=/path bash benchmarks/gpu/train-graph.sh
# Results: $OUT/train-graph/graph_<gpu>.{json,md}, pytest.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the results directory}
DEST="$OUT/train-graph"
mkdir -p "$DEST"
TAG=$(python -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu -rfEs tests/train/test_graphed.py \
  > "$DEST/pytest.log" 2>&1; echo "graphed GPU tests rc=$?"; tail -n 15 "$DEST/pytest.log"
timeout 150 python benchmarks/train.py --graph-ab --seq-lens 2048 4096 8192 --warmup 3 --steps 10 \
  --budget-s 120 --tag "$TAG" --out "$DEST"
