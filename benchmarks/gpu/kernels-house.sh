#!/usr/bin/env bash
# kernels-house (issue 27, session 18, round 2): one H200 run, <= 100 s: benchmarks/ab_trees.py,
# the old tree (old_tree/) against this tree, interleaved, 16K tokens, bf16, ratio new/old per
# cell (target: within 2%) and whether the outputs are identical, on the three cells that
# round 1's twins A/B (benchmarks/results/kernels_restructure_ab.json, run "twins") lost to its
# cap: fwd+bwd at D=256 on a causal, a causal-document and a non-causal C=4 (global + sliding
# window) mask. Round 2 changes no kernel code (its live-range merge was tried and reverted:
# benchmarks/NOTES.md), so it adds no cell.
#
# old_tree/ must hold 06327d4's flashmask3/ (the tree before round 1's twins, as in the call at
# 20:41); against current main the A/B would time nothing that changed.
# Run from the repo root with old_tree/ present:  OUT=/some/dir bash benchmarks/gpu/kernels-house.sh
# Writes $OUT/kernels-house/{ab_trees.json,ab_trees.log,kernels_restructure_ab.json,summary.txt,
# run.log}; kernels_restructure_ab.json is the committed file with this run appended (commit it
# over benchmarks/results/kernels_restructure_ab.json). GPU tests: gpu-tests.sh.
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
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "kernels-house GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $COMMIT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true
if [ ! -d old_tree/flashmask3 ]; then echo "old_tree/flashmask3 missing: the A/B cannot run"; fi

# old vs new, interleaved: budget 70 s inside a 90 s cap, compiles included (the budget is
# checked between rounds, so every cell reached gets at least one round).
# DRY_RUN=1: the same protocol on the CPU (interpreter, tiny, one D=64 cell, cap 900 s): a
# check, not a number.
AB_ARGS="--dims 256 --cells fwd_bwd:256 --seqlen 16384 --batch 2 --hidden 2048 --rounds 3 --budget-s 70"
AB_CAP="${AB_CAP:-90}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  AB_ARGS="--dims 64 --cells fwd_bwd:64:global_sliding_window --dry-run --budget-s 400"
  AB_CAP=900
fi
rm -f "$DIR/ab_trees.json"  # a failed run must not fold an older file
[ -d old_tree/flashmask3 ] && step ab_trees "$AB_CAP" $PY benchmarks/ab_trees.py --a old_tree --b . $AB_ARGS \
  --out "$DIR/ab_trees.json" 2>&1 | tee "$DIR/ab_trees.log" || true

# the committed runs file with this run appended, named, with its trees and device call
$PY - benchmarks/results/kernels_restructure_ab.json "$DIR/ab_trees.json" \
  "$DIR/kernels_restructure_ab.json" "$COMMIT" <<'EOF' || echo "kernels_restructure_ab.json: not written"
import json, sys
runs_file, run_file, out, commit = sys.argv[1:]
runs = json.load(open(runs_file))
run = json.load(open(run_file))
runs["runs"].append(dict(
    name="twins D=256",
    what="round 1's twins on the three fwd+bwd D=256 cells its run lost to the cap",
    tree_a="06327d4 (old_tree/)", tree_b=commit,
    script="OUT=... bash benchmarks/gpu/kernels-house.sh", **run))
json.dump(runs, open(out, "w"), indent=1)
print(f"appended run {len(runs['runs'])} to {out}")
EOF

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
