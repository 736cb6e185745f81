#!/usr/bin/env bash
# cp-host (issues 23/25): where the host time of one context-parallel layer goes, with a
# round-robin A/B of host-path variants in the same run on the same inputs (session 27: the
# prepared Gluon launches against launcher.launch; session 24's variants: no PreparedCall memo,
# no one-launch merge, neither; session 25's garbage-collector variants were dropped: no effect). cp 16 and 64 at 128K tokens, the heaviest rank, flat and
# hierarchical. ~90 s on one H200 including compiles.
# Results: $OUT/cp-host/{cp_host_profile.json, log.txt}. VARIANTS overrides the variants.
set -euo pipefail
DIR="${OUT:?set OUT}/cp-host"; mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FLASHMASK3_BACKEND=triton python benchmarks/cp_host_profile.py --cp 16 64 --reps 30 \
  --variants ${VARIANTS:-current no-bound} --out "$DIR" 2>&1 | tee "$DIR/log.txt"
