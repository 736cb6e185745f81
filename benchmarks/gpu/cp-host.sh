#!/usr/bin/env bash
# cp-host (issue 25, session 24): where the host time of one context-parallel layer goes, with
# the A/B of this session's host-path changes in the same run on the same inputs (current,
# no PreparedCall memo, no one-launch merge, neither). cp 16 and 64 at 128K tokens, the heaviest
# rank, flat and hierarchical. ~90 s on one H200 including compiles.
# Results: $OUT/cp-host/{cp_host_profile.json, log.txt}.
set -euo pipefail
DIR="${OUT:?set OUT}/cp-host"; mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FLASHMASK3_BACKEND=triton python benchmarks/cp_host_profile.py --cp 16 64 \
  --variants current before no-memo no-merge-kernel --out "$DIR" 2>&1 | tee "$DIR/log.txt"
