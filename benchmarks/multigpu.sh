#!/usr/bin/env bash
# Multi-GPU context-parallel benchmark: one script, one device call, under 10 minutes.
#
#   bash benchmarks/multigpu.sh                                    # every GPU, 128K + 512K tokens
#   bash benchmarks/multigpu.sh --device cpu --world 2 --tokens 4096   # gloo smoke run on CPU
#
# (1) CP attention fwd+bwd (bf16, D=128) over document masks (synthetic spreads + real-corpus
#     lengths) and plain causal: dual_chunk+allgather, sparse+allgather, sparse+overlap, and
#     torch context_parallel + FlexAttention as the outside reference.
# (2) end-to-end training tokens/s with the flashmask3.train CLI at 128K context:
#     baseline (dual_chunk + allgather) vs ours (sparse + overlap).
# (3) JSON + markdown + PNG (machine, GPU count, date, versions, exact command) into --out.
#
# Options: --device cuda|cpu  --world N (default: all GPUs / 2 on CPU)  --tokens "T1 T2"
#          --train-tokens T  --train-steps N  --budget-s S (attention part)  --out DIR
# Environment: PYTHON (default .venv/bin/python), TRAIN_TIMEOUT (s per training run),
#              MG_RUNS (training output folder).
# Time on 8 GPUs (defaults): attention <= ~200 s + the run in progress, training 2 x <= 150 s.
set -euo pipefail

# NVLink SHARP / multicast off in every process (inherited by torchrun's workers).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

COMMAND_LINE="bash benchmarks/multigpu.sh $*"
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" && -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python}

DEVICE=cuda WORLD="" TOKENS="" TRAIN_TOKENS="" TRAIN_STEPS="" BUDGET="" OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --world) WORLD=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --train-tokens) TRAIN_TOKENS=$2; shift 2 ;;
    --train-steps) TRAIN_STEPS=$2; shift 2 ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "multigpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

if [[ $DEVICE == cuda ]]; then
  WORLD=${WORLD:-$($PY -c "import torch; print(torch.cuda.device_count())")}
  TOKENS=${TOKENS:-"131072 524288"}
  TRAIN_TOKENS=${TRAIN_TOKENS:-131072}
  TRAIN_STEPS=${TRAIN_STEPS:-6}
  BUDGET=${BUDGET:-200}
  OUT=${OUT:-benchmarks/results}
  ATTN_ARGS=(--heads 16 --kv-heads 8 --head-dim 128 --dtype bfloat16)
  TRAIN_ARGS=(--preset bench-0.6b --warmup-exclude 2)
  TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-150}
elif [[ $DEVICE == cpu ]]; then
  WORLD=${WORLD:-2}
  TOKENS=${TOKENS:-4096}
  TRAIN_TOKENS=${TRAIN_TOKENS:-${TOKENS%% *}}
  TRAIN_STEPS=${TRAIN_STEPS:-3}
  BUDGET=${BUDGET:-240}
  OUT=${OUT:-runs/multigpu-cpu/results}
  ATTN_ARGS=(--heads 2 --kv-heads 1 --head-dim 16 --dtype float32 --warmup 0 --iters 1
             --spreads corpus short causal)
  TRAIN_ARGS=(--preset tiny --warmup-exclude 1)
  TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-300}
else
  echo "multigpu.sh: --device must be cuda or cpu" >&2; exit 2
fi
if [[ "$WORLD" -lt 1 ]]; then echo "multigpu.sh: no GPUs visible (use --device cpu)" >&2; exit 2; fi

RUNS=${MG_RUNS:-runs/multigpu-$DEVICE}   # training outputs (summary.json per variant)
mkdir -p "$OUT" "$RUNS"
ATTN_JSON=$OUT/cp_multigpu_attention.json
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$WORLD")
echo "== multigpu.sh: $WORLD × $DEVICE, tokens: $TOKENS, out: $OUT"

# (1) attention: no new run starts after --budget-s; the hard timeout covers the last one
SECONDS=0
timeout $((BUDGET + 150)) "${RUN[@]}" benchmarks/cp_multigpu.py attention --device "$DEVICE" --tokens $TOKENS \
  --budget-s "$BUDGET" --json "$ATTN_JSON" "${ATTN_ARGS[@]}" || echo "attention benchmark failed (rc=$?)"
echo "== attention part: ${SECONDS}s"

# (2) end-to-end training, baseline vs ours (each bounded so the whole call stays < 10 min)
TRAIN=()
for variant in baseline ours; do
  if [[ $variant == baseline ]]; then BAL=dual_chunk COMM=allgather; else BAL=sparse COMM=overlap; fi
  rm -rf "$RUNS/$variant"
  SECONDS=0
  timeout "$TRAIN_TIMEOUT" "${RUN[@]}" -m flashmask3.train.cli train "${TRAIN_ARGS[@]}" \
    --device "$DEVICE" --seq-len "$TRAIN_TOKENS" --cp "$WORLD" --balance "$BAL" --comm "$COMM" \
    --steps "$TRAIN_STEPS" --checkpoint-every 0 --no-resume --no-progress --no-plot --log-every 1 \
    --out-dir "$RUNS/$variant" || echo "training $variant failed or timed out (rc=$?)"
  echo "== training $variant: ${SECONDS}s"
  TRAIN+=("$variant=$RUNS/$variant/summary.json")
done

# (3) report
"$PY" benchmarks/cp_multigpu.py report --attention-json "$ATTN_JSON" --train "${TRAIN[@]}" \
  --command-line "$COMMAND_LINE" --out "$OUT"
