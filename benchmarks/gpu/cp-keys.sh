#!/usr/bin/env bash
# cp-keys (session 29): the CP runtime's key buffer (each stage's keys gathered once, by
# kernels/gather.py; views for contiguous direct messages) against the runtime before it, on one
# H200, communication emulated: the same ranks of the same plans (128K corpus tokens, Hq=16,
# Hk=8, D=128, bf16), one process per side, back to back.
#   1. GPU tests of the two CP device kernels (gather, returns; CP_KEYS_TESTS=0 skips them).
#   2. The new runtime, four layouts at cp 8/32/128 with --breakdown (cp_runtime_breakdown.json:
#      the scale model's per-rank validation file).
#   3. The old runtime (AB_OLD: a tree holding the previous commit's flashmask3/ and this tree's
#      benchmarks/, e.g. `git archive 9ef0f89 flashmask3 | tar -x -C ab_old; cp -r benchmarks
#      ab_old/`), sparse+overlap and sparse+allgather at cp 8/32/128 with --breakdown.
# Results: $OUT/cp-keys/{new,old}/cp_runtime.{json,md}, pytest.log. CP_KEYS_CPS: the cp sizes
# ("8 32 128"); the time budgets below fit five.
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
DIR="$OUT/cp-keys"
AB_OLD="${AB_OLD:-ab_old}"
mkdir -p "$DIR/new" "$DIR/old"
export PYTHONUNBUFFERED=1 FLASHMASK3_BACKEND=triton
read -r -a CPS <<< "${CP_KEYS_CPS:-8 32 128}"  # the cp sizes of both sides
ARGS=(--cp "${CPS[@]}" --check --breakdown --heaviest 4 --random 2)
if [[ "${CP_KEYS_TESTS:-1}" == 1 ]]; then  # (0: gpu-tests.sh ran them in this call)
  echo "== GPU tests of the CP kernels $(date -u +%T)"
  timeout 60 python -m pytest -q -m gpu tests/kernels/test_gather.py tests/kernels/test_returns.py \
    > "$DIR/pytest.log" 2>&1 && echo "passed" || echo "FAILED or timed out (rc=$?)"
  tail -3 "$DIR/pytest.log" || true
fi
echo "== new runtime $(date -u +%T)"
timeout 200 python benchmarks/cp_single_gpu.py "${ARGS[@]}" --time-budget 170 --out "$DIR/new" \
  --configs sparse+overlap sparse+allgather dual_chunk+allgather "sparse+overlap hier" \
  || echo "new runtime FAILED or timed out (rc=$?)"
if [[ -d "$AB_OLD/flashmask3" ]]; then
  echo "== old runtime ($AB_OLD) $(date -u +%T)"
  timeout 110 python "$AB_OLD/benchmarks/cp_single_gpu.py" "${ARGS[@]}" --time-budget 85 --out "$DIR/old" \
    --configs sparse+overlap sparse+allgather || echo "old runtime FAILED or timed out (rc=$?)"
fi
echo "== done $(date -u +%T)"
cat "$DIR/new/cp_runtime.md" "$DIR/old/cp_runtime.md" 2>/dev/null | grep -v "^$" | head -80
