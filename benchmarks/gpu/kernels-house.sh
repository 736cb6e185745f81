#!/usr/bin/env bash
# kernels-house (issue 27, session 18): one H200 run, <= 150 s: benchmarks/ab_trees.py, the
# old tree (old_tree/: main's flashmask3/ before this branch) against this tree, interleaved, on
# exactly the cells this branch's kernel edits touch: the tl forward at D=64 (fwd and fwd+bwd)
# and the Gluon dK/dV range walk (fwd+bwd at D=128 and D=256), each on a causal, a causal-
# document and a non-causal C=4 mask, 16K tokens, bf16 (12 cells); ratio new/old per cell
# (target: within 2%) and whether the outputs are identical. GPU tests: gpu-tests.sh.
#
# Run from the repo root with old_tree/ present:  OUT=/some/dir bash benchmarks/gpu/kernels-house.sh
# Writes $OUT/kernels-house/{ab_trees.json,ab_trees.log,summary.txt,run.log}.
set -euo pipefail
OUT="${OUT:-/tmp/out}"
DIR="$OUT/kernels-house"
mkdir -p "$DIR"
exec > >(tee -a "$DIR/run.log") 2>&1
START=$(date +%s)
PY="${PYTHON:-python3}"
step() {  # name, timeout seconds, command...: run, log, never stop the script
  local name="$1" limit="$2"; shift 2
  echo "=== $name (cap ${limit} s) $(date -u +%H:%M:%S)"
  if timeout "$limit" "$@"; then echo "=== $name: ok"; else echo "=== $name: FAILED or timed out (rc $?)"; fi
}
echo "kernels-house GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true
if [ ! -d old_tree/flashmask3 ]; then echo "old_tree/flashmask3 missing: the A/B cannot run"; fi

# old vs new, interleaved (budget 110 s inside a 140 s cap; compiles included).
# DRY_RUN=1: the same protocol on the CPU (interpreter, tiny, D=64 only): a check, not a number.
AB_ARGS="--dims 64,128,256 --cells fwd:64,fwd_bwd:64,fwd_bwd:128,fwd_bwd:256 --seqlen 16384 --batch 2 --hidden 2048 --rounds 3 --budget-s 110"
[ "${DRY_RUN:-0}" = 1 ] && AB_ARGS="--dims 64 --cells fwd:64,fwd_bwd:64 --dry-run --budget-s 400"
[ -d old_tree/flashmask3 ] && step ab_trees "${AB_CAP:-140}" $PY benchmarks/ab_trees.py --a old_tree --b . $AB_ARGS \
  --out "$DIR/ab_trees.json" 2>&1 | tee "$DIR/ab_trees.log" || true

{
  echo "kernels-house summary ($(( $(date +%s) - START )) s)"
  $PY - "$DIR/ab_trees.json" <<'EOF' || echo "ab_trees: no result"
import json, sys
r = json.load(open(sys.argv[1]))
print("ab_trees:", json.dumps(r["summary"]))
for row in r["rows"]:
    print(f"  {row['mask']:22s} D={row['D']:3d} {row['pass']:7s} ratio {row.get('ratio_b_over_a', float('nan')):.3f}"
          f" same_output={row.get('same_output')} {row['errors'] or ''}")
EOF
} | tee "$DIR/summary.txt"
