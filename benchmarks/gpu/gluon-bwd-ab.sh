#!/usr/bin/env bash
# A/B of the Gluon backward's opaque loop invariants (benchmarks/gluon_bwd_ab.py --arm): the flag
# on and off under the machine's Triton and under a newer one carried as a pack (NEWER_TRITON,
# default Triton 3.9.0's), arms alternating in separate processes (session 46's first call,
# benchmarks/results/gluon_bwd_ab.md). Carry the pack: run's carry [".gpu_wheels",
# ".triton-pack/triton-3.9.0.tar.xz"].
#   OUT=/dir [AB_MASKS=...] [AB_RUNS=2] bash benchmarks/gpu/gluon-bwd-ab.sh
set -u
DIR="${OUT:?set OUT}/ab"; mkdir -p "$DIR"
PACK=${NEWER_TRITON:-.triton-pack/triton-3.9.0.tar.xz}
OUT=$OUT NEWER_TRITON=$PACK NEWER_TRITON_STEPS=smoke bash benchmarks/gpu/newer-triton.sh 2>&1 \
  | grep -E "smoke passed|relative errors"
NAME=$(basename "$PACK" .tar.xz)
SITE=/tmp/newer-triton-site/$NAME
export TRITON_BACKENDS_IN_TREE=1 FLASHMASK3_BACKEND=triton
NEW="env PYTHONPATH=$SITE TRITON_CACHE_DIR=/tmp/newer-triton-cache/$NAME"
OLD="env TRITON_CACHE_DIR=/tmp/ab-cache-machine"
MASKS=${AB_MASKS:-causal_document_corpus,document_corpus,sliding_window,shared_question}
SHOW="^(triton|reference|causal|shared|sliding|document|prefix|Traceback|[A-Za-z]*Error)"
for i in $(seq "${AB_RUNS:-2}"); do
  for a in opaque plain; do
    $NEW timeout 240 python -W ignore benchmarks/gluon_bwd_ab.py --arm $a --masks "$MASKS" \
      --out "$DIR/new_${a}_$i.json" 2>&1 | grep -E "$SHOW"
    $OLD timeout 200 python -W ignore benchmarks/gluon_bwd_ab.py --arm $a --masks "$MASKS" \
      --out "$DIR/machine_${a}_$i.json" 2>&1 | grep -E "$SHOW"
  done
done
python benchmarks/gluon_bwd_ab.py --report "$DIR"/*.json | tee "$DIR/report.md"
