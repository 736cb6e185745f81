#!/usr/bin/env bash
# The README's headline cells re-timed with the standard do_bench columns (host work included)
# next to the interleaved GPU-time ones, plus host_path.py's small-problem table (4K/8K vs Flex).
#   OUT=/dir bash benchmarks/gpu/kernel-headline.sh      (<= 250 s on one H200)
# Outputs: $OUT/kernel-headline/{kernel_headline.json, small/host_path.{json,md}, log.txt}.
set -uo pipefail
DIR="${OUT:?set OUT}/kernel-headline"; mkdir -p "$DIR/small"
PY="${PYTHON:-python}"
export FLASHMASK3_BACKEND=triton
timeout 75 $PY benchmarks/host_path.py --skip-host --out "$DIR/small" > "$DIR/small.log" 2>&1 \
  || echo "small-problem table failed or timed out (rc $?)"
tail -n 8 "$DIR/small/host_path.md" 2>/dev/null
timeout 170 $PY benchmarks/kernel.py --seqlens 32768 --dims 128 --no-gqa \
  --masks causal,causal_document_corpus,document_corpus,causal_document_short,sliding_window,global_sliding_window,shared_question,prefix_lm \
  --impls flashmask3,flex,sdpa_cudnn --budget-s 140 --out "$DIR" --tag headline > "$DIR/log.txt" 2>&1 \
  || echo "kernel.py failed or timed out (rc $?)"
tail -n 30 "$DIR/log.txt"
