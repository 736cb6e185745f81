#!/usr/bin/env bash
# The GQA backward's split groups (issue 23/25, session 26): benchmarks/gqa_expand_ab.py on the
# committed stage shapes and on the paper setting's cp-16 stage calls (the shape set), each
# arm's GPU time, host time per call and do_bench time: split in the kernel (KV_SPLIT), grouped,
# and K/V copied by torch (the library until session 26). ~2-3 min including compiles.
# Writes $OUT/gqa-split/gqa_expand_ab.json (the stage shapes as "rows", the shape set as
# "stages": benchmarks/scale_model/validate.py reads both).
#   OUT=/some/dir bash benchmarks/gpu/gqa-split.sh
set -euo pipefail
DIR="${OUT:?set OUT}/gqa-split"
mkdir -p "$DIR/stage" "$DIR/shapes"
export FLASHMASK3_BACKEND=triton
PY=${PY:-python}
SHAPES=benchmarks/results/gqa_expand_shapes.json
$PY benchmarks/gqa_expand_ab.py --out "$DIR/stage"
$PY benchmarks/gqa_expand_ab.py --shapes "$SHAPES" --out "$DIR/shapes"
$PY - "$DIR" "$SHAPES" <<'PY'
import json, sys
d, shapes = sys.argv[1], sys.argv[2]
stage = json.load(open(f"{d}/stage/gqa_expand_ab.json"))
sets = json.load(open(f"{d}/shapes/gqa_expand_ab.json"))
stage["stages"] = dict(meta=sets["meta"], shapes=shapes, rows=sets["rows"])
json.dump(stage, open(f"{d}/gqa_expand_ab.json", "w"), indent=1)
PY
