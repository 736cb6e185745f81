#!/usr/bin/env bash
# One GPU phase for issue 25: where the host time goes (benchmarks/host_breakdown.py), then the
# 4K/8K small-problem table (benchmarks/host_path.py --skip-host).
set -uo pipefail
export FLASHMASK3_BACKEND=triton
python benchmarks/host_breakdown.py --out "$OUT/host-breakdown"
python benchmarks/host_path.py --skip-host --out "$OUT/host-breakdown"
