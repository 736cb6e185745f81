#!/usr/bin/env bash
# cp-graph (session 30): one CP layer per rank captured in a CUDA graph (forward + the q/k/v
# gradients through the staged runtime, communication emulated by device copies) against the
# same layer run eagerly, on one H200: 128K corpus tokens, Hq=16, Hk=8, D=128, bf16, cp 8 to 128
# (CP_GRAPH_CPS), four layouts and the hierarchical layout's torch-returns A/B arm (session 31),
# the 4 heaviest + 2 random ranks (+ the one needing most K/V).
#   1. GPU tests: the captured layer replayed with new inputs equals the eager layer
#      (tests/distributed/test_cp_runtime.py -k graph; CP_GRAPH_TESTS=0 skips them).
#   2. cp_single_gpu.py --graph --check: eager and replay times per rank (cp_runtime.{json,md}).
# Results: $OUT/cp-graph/cp_runtime.{json,md}, pytest.log. Run from the repo root.
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
DIR="$OUT/cp-graph"
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
read -r -a CPS <<< "${CP_GRAPH_CPS:-8 16 32 64 128}"
if [[ "${CP_GRAPH_TESTS:-1}" == 1 ]]; then
  echo "== GPU tests of the captured CP layer $(date -u +%T)"
  timeout 150 python -m pytest -q -m gpu tests/distributed/test_cp_runtime.py -k graph \
    > "$DIR/pytest.log" 2>&1 && echo "passed" || echo "FAILED or timed out (rc=$?): see pytest.log"
  tail -15 "$DIR/pytest.log" || true
fi
echo "== cp_single_gpu --graph $(date -u +%T)"
timeout "${CP_GRAPH_TIMEOUT:-260}" python benchmarks/cp_single_gpu.py --cp "${CPS[@]}" --check --graph \
  --heaviest 4 --random 2 --time-budget "${CP_GRAPH_BUDGET:-220}" --out "$DIR" \
  --configs "sparse+overlap hier" "sparse+overlap hier torch returns" sparse+overlap sparse+allgather \
  dual_chunk+allgather \
  || echo "cp_single_gpu FAILED or timed out (rc=$?): the finished layouts are in $DIR"
echo "== summary $(date -u +%T)"
cat "$DIR/cp_runtime.md" 2>/dev/null || echo "no cp_runtime.md written"
