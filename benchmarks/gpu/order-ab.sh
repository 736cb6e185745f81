#!/usr/bin/env bash
# order-ab: the longest-first program order (docs/kernels.md) against grid order on one H200.
# 1. benchmarks/order_ab.py: do_bench fwd and fwd+bwd of full-sequence document masks, both
#    arms interleaved in one process, outputs compared.
# 2. benchmarks/gqa_expand_ab.py on the committed cp-16 stage calls of the paper setting
#    (gqa_expand_shapes.json: grouped and expanded backward, fwd+bwd GPU time), once per order
#    (FLASHMASK3_LAUNCH_ORDER=grid, then the default): what the scale model predicts per order.
# Results: $OUT/order-ab/{order_ab.{json,md}, stages-longest/, stages-grid/} + logs. <= 200 s.
set -uo pipefail
DIR="${OUT:?set OUT}/order-ab"; mkdir -p "$DIR"
PY="${PYTHON:-python}"
export FLASHMASK3_BACKEND=triton
timeout 90 $PY benchmarks/order_ab.py --out "$DIR" > "$DIR/order_ab.log" 2>&1 || echo "order_ab failed or timed out (rc $?)"
tail -n 20 "$DIR/order_ab.log"
for order in grid longest; do
  FLASHMASK3_LAUNCH_ORDER=$order timeout 50 $PY benchmarks/gqa_expand_ab.py \
    --shapes benchmarks/results/gqa_expand_shapes.json --out "$DIR/stages-$order" > "$DIR/stages-$order.log" 2>&1 \
    || echo "gqa_expand_ab ($order) failed or timed out (rc $?)"
  tail -n 16 "$DIR/stages-$order.log"
done
