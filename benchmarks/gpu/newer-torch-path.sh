#!/usr/bin/env bash
# What a torch 2.12-2.15 user runs, timed on this machine's torch 2.11 / Triton 3.6: on a Triton
# outside GLUON_CHECKED_TRITON and RAW_LAUNCH_TRITON the library takes every pass's portable tl
# kernel (FLASHMASK3_KERNELS=portable does the same here) and launches warm kernels through
# `compiled.run` (here: launcher.RAW_LAUNCH_HERE set False before the first launch). A proxy:
# Triton 3.7-3.9 compile the same tl source, with their own compiler and launcher.
#   OUT=/dir bash benchmarks/gpu/newer-torch-path.sh        (<= 330 s on one H200; with
#   NEWER_TORCH_SHORT=1: four of the masks and the host table only, <= 215 s)
# Steps:
#   1. benchmarks/kernel.py, the README's eight 32K D=128 cells: flashmask3 (default path, raw
#      launch off) and its portable variant against FlexAttention, one run, interleaved timer
#      and the standard do_bench columns (host work included)
#   2. benchmarks/host_path.py under FLASHMASK3_KERNELS=portable, raw launch off: the host table
#      and the small-problem table against FlexAttention
# Outputs: $OUT/newer-torch-path/{kernel_newer_torch.json, host/host_path.{json,md},
#          newer_torch_path.{json,md} (benchmarks/newer_torch_path.py's summary), *.log}
set -uo pipefail
DIR="${OUT:?set OUT}/newer-torch-path"; mkdir -p "$DIR/host"
PY="${PYTHON:-python}"
export FLASHMASK3_BACKEND=triton PYTHONUNBUFFERED=1

no_raw_launch() {  # no_raw_launch SCRIPT ARGS...: run SCRIPT with the raw C launch switched off
  $PY - "$@" <<'EOF'
import runpy, sys
import flashmask3.kernels.launcher as launcher
launcher.RAW_LAUNCH_HERE = False  # every warm launch through compiled.run, as on Triton 3.7-3.9
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
}

MASKS=causal,causal_document_corpus,document_corpus,causal_document_short,sliding_window,global_sliding_window,shared_question,prefix_lm
KERNEL_S=160; HOST_ARGS="--no-graphs"; HOST_S=130
if [[ "${NEWER_TORCH_SHORT:-0}" == 1 ]]; then
  MASKS=causal,causal_document_corpus,sliding_window,shared_question
  KERNEL_S=95; HOST_ARGS="--skip-small"; HOST_S=90
fi
timeout $((KERNEL_S + 30)) bash -c "$(declare -f no_raw_launch); PY='$PY' no_raw_launch benchmarks/kernel.py \
  --seqlens 32768 --dims 128 --no-gqa --masks $MASKS \
  --impls flashmask3,flashmask3_portable,flex --budget-s $KERNEL_S --out '$DIR' --tag newer_torch" \
  > "$DIR/kernel.log" 2>&1 || echo "kernel.py failed or timed out (rc $?)"
tail -n 20 "$DIR/kernel.log"
FLASHMASK3_KERNELS=portable timeout $HOST_S bash -c "$(declare -f no_raw_launch); PY='$PY' \
  no_raw_launch benchmarks/host_path.py $HOST_ARGS --out '$DIR/host'" > "$DIR/host.log" 2>&1 \
  || echo "host_path.py failed or timed out (rc $?)"
sed -n '/^| form/,$p' "$DIR/host/host_path.md" 2>/dev/null
# the summary (commit it as benchmarks/results/newer_torch_path.{json,md})
$PY benchmarks/newer_torch_path.py --kernels "$DIR"/kernel_newer_torch.json \
  --host-path "$DIR/host/host_path.json" --out "$DIR/newer_torch_path" > "$DIR/summary.log" 2>&1 \
  || echo "summary failed (see $DIR/summary.log)"
