#!/usr/bin/env bash
# Where the host time of one attention call goes (issue 25): benchmarks/host_breakdown.py on the
# GPU, ~60-90 s including compiles. Writes $OUT/host-breakdown/{host_breakdown.json,md, profile_*.txt}.
#   OUT=/some/dir bash benchmarks/gpu/host-breakdown.sh
set -euo pipefail
DIR="${OUT:?set OUT}/host-breakdown"
mkdir -p "$DIR"
export FLASHMASK3_BACKEND=triton
${PY:-python} benchmarks/host_breakdown.py --out "$DIR"
