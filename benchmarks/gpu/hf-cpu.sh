#!/usr/bin/env bash
# hf-cpu (issue 26), one GPU call of <= 150 s, from the repository root:
#   1. the transformers implementation in fp16 on a tiny Llama (packed logits vs sdpa per
#      document, one fwd+bwd step): the fp16 CUDA path;
#   2. tokens/s of a ~0.59B HF Llama (random init, bf16) on 32K packed tokens of real documents,
#      forward+backward: fm3_columnmask (packed) vs sdpa (padded batch of the same documents)
#      vs transformers' flex_attention (packed), in one run, plus the bf16 per-document check.
# Results: $OUT/hf-cpu/{hf_attention.json, tiny_fp16/hf_attention.json, log.txt}.
# DRY_RUN=1: the same steps on the CPU with a tiny model (fp32; flex_attention has no CPU backward).
set -euo pipefail
OUT_DIR="${OUT:?set OUT}/hf-cpu"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/log.txt"
PY="${PYTHON:-python}"
export FLASHMASK3_COMMIT="${FLASHMASK3_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" || true
} >>"$LOG" 2>&1

step() {  # name, command...: run, log, and keep going past a failure
  local name=$1; shift
  echo "== $name: $*" | tee -a "$LOG"
  "$@" >>"$LOG" 2>&1 || echo "!! $name failed (rc $?)" | tee -a "$LOG"
}

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  FP16="--dtype fp32 --device cpu"; BIG="--preset tiny --tokens 2048 --max-doc-len 512 --device cpu"; T1=600; T2=600
else
  FP16="--dtype fp16"; BIG="--preset 0.5b --tokens 32768"; T1=30; T2=115
fi
# shellcheck disable=SC2086
step tiny_fp16 timeout $T1 "$PY" benchmarks/hf_attention.py --preset tiny --tokens 4096 --max-doc-len 512 $FP16 \
  --steps 1 --warmup 1 --impls fm3_columnmask --out "$OUT_DIR/tiny_fp16"
# shellcheck disable=SC2086
step tokens_per_s timeout $T2 "$PY" benchmarks/hf_attention.py $BIG --steps 3 --warmup 1 --out "$OUT_DIR"

echo "== summary" | tee -a "$LOG"
"$PY" - "$OUT_DIR" <<'PYEOF' 2>&1 | tee -a "$LOG" || true
import json, os, sys
for sub in ("tiny_fp16", ""):
    path = os.path.join(sys.argv[1], sub, "hf_attention.json")
    if not os.path.exists(path):
        print(f"{path}: missing"); continue
    r = json.load(open(path))
    print(f"{r['preset']} {r['dtype']} {r['tokens']} tokens {r['documents']} docs check={r.get('check')} errors={list(r['errors'])}")
    for row in r["rows"]:
        print(f"  {row['impl']:<16} {row['tokens_per_s']:>10.0f} tokens/s  step {row['step_s']*1e3:8.1f} ms  "
              f"padded {row['padded_tokens']}  peak {row.get('peak_memory_gib', 0):.1f} GiB")
PYEOF
