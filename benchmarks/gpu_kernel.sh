#!/usr/bin/env bash
# One device call for the Triton kernel (issue 3): GPU tests, then the benchmark, all output
# under $OUT. Usage (repository root, on the GPU machine):
#   bash benchmarks/gpu_kernel.sh tests+d128     # full gpu pytest marker + benchmark grid at D=128 (+GQA)
#   bash benchmarks/gpu_kernel.sh final          # gpu smoke subset + the prioritised FINAL_PLAN
#   FULL_TESTS=1 SKIP_DONE=benchmarks/results/kernel_v5_final.json bash benchmarks/gpu_kernel.sh final
#   BENCH_BUDGET=200 bash benchmarks/gpu_kernel.sh train   # end-to-end tokens/s, flashmask3 vs flex
#   bash benchmarks/gpu_kernel.sh d64,256        # benchmark grid at D=64 and D=256
#   BENCH_BUDGET=180 bash benchmarks/gpu_kernel.sh bwd   # backward variants (split vs fused) + all gpu tests
#   DIMS=64,256 BENCH_BUDGET=240 bash benchmarks/gpu_kernel.sh configs  # each backward kernel's configs + gpu tests
#   BENCH_BUDGET=330 bash benchmarks/gpu_kernel.sh gluon  # Gluon dK/dV and fused-dQ A/B + the Gluon gpu tests
#   BENCH_BUDGET=150 bash benchmarks/gpu_kernel.sh gluon64  # Gluon (WS) dK/dV vs tl at D=64 + the fused 128-key shape
#   BENCH_BUDGET=400 bash benchmarks/gpu_kernel.sh rest   # D=256 GPU tests + the grid cases no kernel_v6*.json has
#   BENCH_BUDGET=150 bash benchmarks/gpu_kernel.sh wsm    # STATS_SMEM dK/dV (64x128 w8) bitwise tests + A/B vs the WS default
#   bash benchmarks/gpu_kernel.sh tests128  # GPU tests of the D=128 split backward default (v6.4)
#   BENCH_BUDGET=220 BUDGET_128K=100 bash benchmarks/gpu_kernel.sh v64  # v6.4 default tests + D=128 table rows
#   BENCH_BUDGET=300 BUDGET_128K=120 bash benchmarks/gpu_kernel.sh table128  # D=128 rows, default (fused) + split variant
#   BENCH_BUDGET=300 bash benchmarks/gpu_kernel.sh v66  # v6.6 (fused default at D=64) tests + 32K D=128 rows
#   BENCH_BUDGET=110 BUDGET_128K=100 BUDGET_TRAIN=150 bash benchmarks/gpu_kernel.sh v66b  # train, 128K D=128, 32K D=64 rows
#   BENCH_BUDGET=110 BUDGET_D64=70 bash benchmarks/gpu_kernel.sh v66c  # 8K rows at D=128 and D=64
#   IMPLS=flashmask3,flex,sdpa_dense TAG_8K=dense_8k BENCH_BUDGET=150 BUDGET_D64=0 bash benchmarks/gpu_kernel.sh v66c  # dense-mask SDPA at 8K (never measured)
#   BENCH_BUDGET=120 bash benchmarks/gpu_kernel.sh fwdconfigs  # forward tiles on short-document masks (D=128, 64)
#   BENCH_BUDGET=150 bash benchmarks/gpu_kernel.sh fused64  # fused DS_SHARED backward (64x128 w8) tests + A/B vs split
#   BENCH_BUDGET=200 bash benchmarks/gpu_kernel.sh fused64d # the D=64 DS_SHARED backward (64x64 w4) tests + A/B vs split at D=64
#   BENCH_BUDGET=200 bash benchmarks/gpu_kernel.sh dpwait   # DS_SHARED with DP_LATE_WAIT (dPᵀ wait below the exp2s) tests + A/B vs DS_SHARED
#   BENCH_BUDGET=130 bash benchmarks/gpu_kernel.sh fwdws   # the warp-specialised Gluon forward: A/B vs tl (small + 32K), D=128 document rows with it, D=64/256
#   BENCH_BUDGET=100 bash benchmarks/gpu_kernel.sh fwdws2  # the 128-key WS forward tiles (A/B + small pass), D=256 rows with the WS forward default
#   bash benchmarks/gpu_kernel.sh fwdws3  # the WS forward defaults and its persistent variant: GPU tests, A/B at D=128 and D=256
#   BENCH_BUDGET=200 bash benchmarks/gpu_kernel.sh fwdws4  # public-path Gluon forward GPU tests, 32K D=128 rows (tl forward variant)
#   bash benchmarks/gpu_kernel.sh fwdws5  # the claimed-walk persistent WS forward: bitwise tests, A/B vs one-block and tl at D=128/256/64
#   bash benchmarks/gpu_kernel.sh fwdws6  # COLS_SMEM (mask columns staged by the WS producer): tests, A/B staged vs global vs tl at D=128/256/64
#   bash benchmarks/gpu_kernel.sh v69     # v6.9 table rows: 32K D=128 (all masks), 8K D=128 (document and plain masks), 8K D=256 causal
#   bash benchmarks/gpu_kernel.sh v69b    # the interleaved timer on the D=128 document rows at 8K, 32K GQA, 128K
#   bash benchmarks/gpu_kernel.sh shortdocs  # (not yet run) WS vs tl forward on short documents at 8K/32K/128K
#   bash benchmarks/gpu_kernel.sh s15a  # dispatch tests, short-document WS vs tl at 8K/128K, D=64 WS forward A/B, fixed-timer rows
#   bash benchmarks/gpu_kernel.sh s15b  # the D=256 Gluon dK/dV (head-dim split): tests, A/B vs tl, D=256 causal rows
#   BENCH_BUDGET=420 bash benchmarks/gpu_kernel.sh s15c  # the D=256 rows with v7.0 (32K, 8K, 128K; causal from s15b)
#   bash benchmarks/gpu_kernel.sh s15d  # every gpu test of the public function, then the 128K D=64 cells never run
#   bash benchmarks/gpu_kernel.sh s16a    # the one-warpgroup WS forward A/B, its GPU tests, the D=256 tests
#   bash benchmarks/gpu_kernel.sh s16b    # the short-rows forward tile: GPU tests, its table rows, backward tiles
#   bash benchmarks/gpu_kernel.sh s16c    # its last two table rows, the public GPU tests no recent run reached
#   bash benchmarks/gpu_kernel.sh s16d    # the one-warpgroup WS forward persistent / 64x32; 128K D=64 full
#   bash benchmarks/gpu_kernel.sh s16e    # the 128K D=256 rows still from v6.6
#   bash benchmarks/gpu_kernel.sh next16  # (not yet run) session 15's unchecked GPU tests, D=64 WS forward on random eviction
#   SEQ=8192 BENCH_BUDGET=420 bash benchmarks/gpu_kernel.sh grid128  # (not yet run) the D=128 grid at one length, interleaved timer
#   BENCH_BUDGET=170 bash benchmarks/gpu_kernel.sh order   # the persistent DS_SHARED kernel: tests, backward stages, A/B at D=128 and D=64 (STAGES=0, BUDGET_D64=0, CASES=... to trim)
# Each stage has its own timeout so the whole call stays under the 600 s device limit; the
# benchmark writes its JSON after every case, so a stopped run keeps what it measured.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLASHMASK3_BACKEND=triton NCCL_NVLS_ENABLE=0
export FLASHMASK3_TRITON_AUTOTUNE=${AUTOTUNE:-1}
OUT=${OUT:-/tmp/fm3_out}
mkdir -p "$OUT"
PHASE=${1:-tests+d128}
BUDGET=${BENCH_BUDGET:-300}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
case "$PHASE" in
  tests+d128)
    timeout 230 python3 -m pytest -q -m gpu -x tests/kernels/test_triton_flashmask.py -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/pytest_gpu.log"
    timeout $((BUDGET + 60)) python3 benchmarks/kernel.py --dims 128 --budget-s "$BUDGET" --out "$OUT" --tag d128 2>&1 | tee "$OUT/bench_d128.log"
    ;;
  final)
    # FULL_TESTS=1: every gpu test (~3 min) instead of the smoke subset; SKIP_DONE="a.json ...":
    # leave out the cases an earlier, budget-cut run of the plan measured.
    if [ "${FULL_TESTS:-0}" = 1 ]; then
      FLASHMASK3_TRITON_AUTOTUNE=0 timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py tests/kernels/test_gluon_dkdv.py -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest_gpu.log"
    else
      timeout 70 python3 -m pytest -q -m gpu -x tests/kernels/test_triton_flashmask.py -p no:cacheprovider \
        -k "bfloat16-128-causal_document or bfloat16-128-global_sliding_window or bfloat16-64-full or float16-128-sliding_window or (long_sequences and causal_document)" 2>&1 | tail -15 | tee "$OUT/pytest_gpu.log"
    fi
    # shellcheck disable=SC2086  # SKIP_DONE is a list of paths
    timeout $((BUDGET + 45)) python3 benchmarks/kernel.py --plan final --budget-s "$BUDGET" --out "$OUT" --tag final \
      --impls "${IMPLS:-flashmask3,flex,sdpa_cudnn,sdpa_flash,varlen,sdpa_dense}" \
      --skip-done ${SKIP_DONE:-} 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_final.log"
    ;;
  train)
    # the end-to-end run (benchmarks/train.py, issue 5) with the default configs (autotune off)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 60)) python3 benchmarks/train.py --backends ${BACKENDS:-flashmask3 flex} \
      --budget-s "$BUDGET" --out "$OUT" 2>&1 | tail -40 | tee "$OUT/train.log"
    ;;
  bwd)
    # the backward variants side by side (each checks its gradients against split), then every
    # gpu test (split and fused backward). BENCH_BUDGET=180 keeps the call under 600 s.
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 60)) python3 benchmarks/backward_modes.py --budget-s "$BUDGET" --out "$OUT" 2>&1 | tee "$OUT/bench_bwd.log"
    timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest_gpu.log"
    ;;
  configs)
    # each backward kernel alone over its configurations (tile shape, A operand, split loop),
    # then the gpu tests of both backward modes on the causal-document and window masks.
    timeout $((BUDGET + 90)) python3 benchmarks/backward_configs.py --dims "${DIMS:-128}" --budget-s "$BUDGET" --out "$OUT" 2>&1 | tee "$OUT/bench_configs.log"
    timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py -p no:cacheprovider \
      -k "causal_document or sliding_window or long_sequences or deterministic" 2>&1 | tail -25 | tee "$OUT/pytest_gpu.log"
    ;;
  gluon)
    # the Gluon kernels: the fused-dQ prototype's correctness and whole-backward time against
    # split (and the tl fused kernel), then every Gluon gpu test
    timeout $((BUDGET + 90)) python3 benchmarks/gluon_dkdv_ab.py --fused --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_gluon.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest_gluon.log"
    ;;
  gluon64)
    # the Gluon dK/dV (plain and warp-specialised) against tl at D=64 (bitwise-checked in the
    # timed pass), then the one untimed fused shape (32x128 w8, plain and WS) at D=128
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 90)) python3 benchmarks/gluon_dkdv_ab.py --head-dim 64 --skip-small \
      --configs 64x64w4s2,64x64w4s2ws,32x64w4s3ws --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_gluon64.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 90)) python3 benchmarks/gluon_dkdv_ab.py --fused --skip-small \
      --fused-configs 32x64w4s3ws,32x128w8s3,32x128w8s3ws --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_fused128.log"
    ;;
  wsm)
    # first the GPU tests of the D=256 forward tile (a default since session 8, timed there but
    # not yet run against the float64 reference on a GPU); then the STATS_SMEM dK/dV variant
    # (lse2/delta staged in shared memory by the producer; offline spill-free at 64x128 w8): its
    # bitwise GPU tests, then timed against the WS default at D=128
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py -k "256" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_d256.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py -k "stats_smem or warp_spec" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_wsm.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 90)) python3 benchmarks/gluon_dkdv_ab.py --skip-small \
      --configs 32x64w4s3ws,64x128w8s2wsm,64x128w8s3wsm,32x64w4s3wsm --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_wsm.log"
    ;;
  tests128)
    # the split backward's D=128 default (Gluon 64x128 w8 STATS_SMEM dK/dV since v6.4) against
    # the float64 reference (bf16, fp16), the 16-32K sequences against SDPA, deterministic mode
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 180 python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py \
      -k "(128 and split) or long_seq or determin" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_d128.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py \
      -k "default_tile or dispatch" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_dispatch.log"
    ;;
  v64)
    # v6.4's defaults (D=128: fused Gluon DS_SHARED backward, split dK/dV at 64x128 STATS_SMEM):
    # their GPU tests, then the D=128 rows of the table (32K MHA + GQA, then 128K)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py \
      -k "default_tile or default_backward" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_default.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 170 python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py \
      -k "(random_columns and d128) or (128 and fused) or (long_seq and fused)" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_fused.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 --kernel-version v6.4 \
      --impls flashmask3,flex,sdpa_cudnn,varlen --budget-s "$BUDGET" --out "$OUT" --tag v64_32k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_32k.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_128K:-100} + 50)) python3 benchmarks/kernel.py --seqlens 131072 --dims 128 --no-gqa --kernel-version v6.4 \
      --impls flashmask3,flex,sdpa_cudnn --budget-s "${BUDGET_128K:-100}" --out "$OUT" --tag v64_128k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_128k.log"
    ;;
  table128)
    # the D=128 rows with the library's default backward (fused Gluon on Hopper since v6.4) and
    # the split backward as a variant in the same run: 32K MHA + GQA, then 128K
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 \
      --impls flashmask3,flashmask3_split,flex,sdpa_cudnn,varlen --budget-s "$BUDGET" --out "$OUT" --tag v65_32k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_32k.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_128K:-120} + 50)) python3 benchmarks/kernel.py --seqlens 131072 --dims 128 --no-gqa \
      --impls flashmask3,flashmask3_split,flex,sdpa_cudnn --budget-s "${BUDGET_128K:-120}" --out "$OUT" --tag v65_128k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_128k.log"
    ;;
  v66)
    # v6.6 (the fused Gluon backward the default at D=64 too): its GPU tests (the dispatch and
    # default-tile tests, random columns on every layout at D=64 with the default backward, the
    # D=64 float64-reference cases of both backwards), then the table's 32K D=128 rows (MHA +
    # GQA) with the fused default and the split backward as a variant
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py \
      -k "default_tile or default_backward" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_default.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py \
      -k "(random_columns and d64) or float16-64" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_d64.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 \
      --impls flashmask3,flashmask3_split,flex,sdpa_cudnn,varlen --budget-s "$BUDGET" --out "$OUT" --tag v66_32k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_32k.log"
    ;;
  v66b)
    # the end-to-end run (train.py, flashmask3 vs flex), then the rest of v6.6's table rows:
    # 128K D=128 (document masks first), 32K D=64 (the fused default; vs split: the A/B)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_TRAIN:-150} + 60)) python3 benchmarks/train.py --backends flashmask3 flex \
      --budget-s "${BUDGET_TRAIN:-150}" --out "$OUT" 2>&1 | tail -40 | tee "$OUT/train.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_128K:-100} + 50)) python3 benchmarks/kernel.py --seqlens 131072 --dims 128 --no-gqa \
      --impls flashmask3,flex,sdpa_cudnn --budget-s "${BUDGET_128K:-100}" --out "$OUT" --tag v66_128k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_128k.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 64 --no-gqa \
      --impls flashmask3,flex,sdpa_cudnn,varlen --budget-s "$BUDGET" --out "$OUT" --tag v66_d64 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_d64.log"
    # the 32K D=128 cases kernel_v66_32k.json (phase v66, budget-cut) has not measured
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_REST:-60} + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 \
      --impls flashmask3,flex,sdpa_cudnn,varlen --budget-s "${BUDGET_REST:-60}" --out "$OUT" --tag v66_32k_b \
      --skip-done benchmarks/results/kernel_v66_32k.json 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_32k_b.log"
    ;;
  v66c)
    # v6.6 at 8K (batch 16): the D=128 rows (the table's were v6's), then D=64 (not run before)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 40)) python3 benchmarks/kernel.py --seqlens 8192 --dims 128 --no-gqa \
      --impls "${IMPLS:-flashmask3,flex,sdpa_cudnn,varlen}" --budget-s "$BUDGET" --out "$OUT" --tag "${TAG_8K:-v66_8k}" 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_8k.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_D64:-70} + 40)) python3 benchmarks/kernel.py --seqlens 8192 --dims 64 --no-gqa \
      --impls flashmask3,flex,sdpa_cudnn,varlen --budget-s "${BUDGET_D64:-70}" --out "$OUT" --tag v66_8k_d64 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_8k_d64.log"
    ;;
  fwdconfigs)
    # the forward tile sweep (benchmarks/forward_configs.py): each tile alone on the short-document
    # masks and their controls at 32K, D=128 then D=64 (DIMS=256: the D=256 forward tiles, causal
    # 0.80x cuDNN); O/LSE compared with the default tile's
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 60)) python3 benchmarks/forward_configs.py --dims "${DIMS:-128,64}" \
      --budget-s "$BUDGET" --out "$OUT" 2>&1 | tee "$OUT/bench_fwdconfigs.log"
    ;;
  fused64)
    # the fused DS_SHARED backward (64x128 w8 WS + STATS_SMEM, dQ once per tile; offline
    # spill-free): dK, dV bitwise vs tl and dQ vs split (S=1000, 6 masks, s2 and s3), then the
    # whole backward at 32K against split, next to the 32x64 fused WS kernel
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${DS_TEST_S:-240} python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py -k "ds_shared and not d64" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_fused64.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 90)) python3 benchmarks/gluon_dkdv_ab.py --fused --skip-small \
      --fused-configs 32x64w4s3ws,64x128w8s2wsmds,64x128w8s3wsmds --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_fused64.log"
    ;;
  fused64d)
    # the fused DS_SHARED backward at D=64 (64x64 w4, one compute warpgroup, dQ once per tile;
    # offline spill-free at s2 and s3, never run on a GPU before this phase): its GPU tests (dK,
    # dV bitwise vs tl and split, dQ vs split; S=1000, 6 masks, s2 and s3), then the whole
    # backward at 32K, D=64 (Hq=64, GQA 64:16) against split (Gluon WS 64x64 w4 s2 dK/dV + tl
    # dQ). AB_SMALL=1 also runs the A/B's small pass at D=64 (Sq != Sk, Hm=Hq, fp16) first.
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${DS_TEST_S:-240} python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py -k "ds_shared and d64" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_fused64d.log"
    SMALL_FLAG=--skip-small
    [ "${AB_SMALL:-0}" = 1 ] && SMALL_FLAG=
    # shellcheck disable=SC2086  # SMALL_FLAG is empty or one flag
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 90)) python3 benchmarks/gluon_dkdv_ab.py --fused --head-dim 64 $SMALL_FLAG \
      --fused-configs 64x64w4s2wsmds,64x64w4s3wsmds --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_fused64d.log"
    ;;
  dpwait)
    # DS_SHARED with DP_LATE_WAIT (Pᵀ stored before the dPᵀ wait, so ptxas keeps that wait
    # below the exp2s; offline only before this phase): dK, dV bitwise vs the default DS_SHARED
    # kernel and tl, dQ vs split (S=1000, 6 masks; D=128 s2/s3, D=64 s2), then the whole
    # backward at 32K, default DS_SHARED vs DP_LATE_WAIT, both against split. (The split
    # STATS_SMEM _tile already waits for dPᵀ after its exp2s: no split variant.)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${DS_TEST_S:-240} python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py -k "dp_late_wait" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_dpwait.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 90)) python3 benchmarks/gluon_dkdv_ab.py --fused --skip-small \
      --fused-configs 64x128w8s2wsmds,64x128w8s2wsmdsL --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_dpwait.log"
    ;;
  order)
    # PERSISTENT (the DS_SHARED kernel looping over key blocks claimed in launch order;
    # offline only before this phase): dK, dV bitwise vs the default DS_SHARED kernel, the dQ
    # scaling kernel vs torch.mul; where the default backward's time goes; then the whole
    # backward at 32K, default vs +p, on the short-document masks and three others (D=128),
    # and at D=64. (Session 12's first run of this phase also timed +h and a static walk.)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${DS_TEST_S:-170} python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py -k "persistent or scale_dq" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_order.log"
    [ "${STAGES:-1}" = 1 ] && FLASHMASK3_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/backward_stages.py --masks causal,causal_document_short,document_short,causal_document_corpus --out "$OUT" 2>&1 | tail -12 | tee "$OUT/stages.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 60)) python3 benchmarks/gluon_dkdv_ab.py --fused --skip-small --skip-tl-fused \
      --cases ${CASES:-causal_document_short,document_short,causal_document_corpus,causal_document_mixed,document_corpus,causal} \
      --fused-configs 64x128w8s2wsmds,64x128w8s2wsmds+p --budget-s "$BUDGET" 2>&1 | tee "$OUT/bench_order.log"
    cp "$OUT/gluon_fused_ab.json" "$OUT/gluon_order_ab.json"; cp "$OUT/gluon_fused_ab.md" "$OUT/gluon_order_ab.md"
    [ "${BUDGET_D64:-100}" -gt 0 ] && FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${BUDGET_D64:-100} python3 benchmarks/gluon_dkdv_ab.py --fused --skip-small --skip-tl-fused --head-dim 64 \
      --cases causal_document_short,document_short,causal_document_corpus \
      --fused-configs 64x64w4s2wsmds,64x64w4s2wsmds+p --budget-s "$((${BUDGET_D64:-100} - 40))" 2>&1 | tee "$OUT/bench_order_d64.log"
    ;;
  fwdws)
    # the warp-specialised Gluon forward (a TMA producer warp, separate K/V rings, two consumer
    # warpgroups of 64 rows, optional ping-pong; offline only before this phase): the A/B's
    # small pass (O, LSE vs the float64 reference and tl, fully masked rows, the backward on
    # its O/LSE), forward times against the tl forward at 32K D=128, then the D=128 document
    # rows of the table with the tl and the WS forward side by side, then D=64 and D=256
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-260} python3 benchmarks/gluon_fwd_ab.py --budget-s $((${AB_S:-260} - 60)) \
      --small-configs ${SMALL_CONFIGS:-128x64w8s4wsp,128x128w8s2ws} \
      --cases ${CASES:-causal,causal_document_corpus,causal_document_short,causal_document_mixed,document_short,prefix_document_corpus,full} \
      --configs ${CONFIGS:-128x64w8s4ws,128x64w8s4wsp,128x128w8s2wsp} 2>&1 | tee "$OUT/bench_fwdws.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 40)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 --no-gqa \
      --masks causal_document_corpus,causal_document_short,causal_document_mixed,causal_document_long,document_corpus,document_short,prefix_document_corpus \
      --impls flashmask3,flashmask3_fwd_wsp,flex --budget-s "$BUDGET" --out "$OUT" --tag fwdws_32k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_32k.log"
    [ "${BUDGET_DIMS:-50}" -gt 0 ] && FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_DIMS:-50} + 50)) python3 benchmarks/gluon_fwd_ab.py --skip-small \
      --budget-s "${BUDGET_DIMS:-50}" --dims 64,256 --cases causal,causal_document_corpus,document_corpus \
      --configs 128x128w8s3wsp,128x64w8s2wsp 2>&1 | tee "$OUT/bench_fwdws_dims.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws_dims_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws_dims_ab.md"
    ;;
  fwdws2)
    # session 13's second forward call: the 128-key WS tiles (s2/s3, with and without
    # ping-pong) after the masked-loop register fix, small pass included; then the D=256 rows
    # with the WS forward as the default there and the tl forward as a variant
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-330} python3 benchmarks/gluon_fwd_ab.py --budget-s $((${AB_S:-330} - 70)) \
      --small-configs ${SMALL_CONFIGS:-128x128w8s2wsp,128x128w8s3} \
      --cases ${CASES:-causal,causal_document_corpus,causal_document_short,causal_document_mixed,document_short,document_corpus,prefix_document_corpus,sliding_window,full} \
      --configs ${CONFIGS:-128x128w8s2ws,128x128w8s2wsp,128x128w8s3wsp} 2>&1 | tee "$OUT/bench_fwdws2.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws2_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws2_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 60)) python3 benchmarks/kernel.py --seqlens 8192,32768 --dims 256 --no-gqa \
      --masks causal,prefix_document_corpus,global_sliding_window,causal_document_short \
      --impls flashmask3,flashmask3_tl_fwd,flex,sdpa_cudnn --budget-s "$BUDGET" --out "$OUT" --tag fwdws_d256 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_d256.log"
    ;;
  fwdws3)
    # session 13's WS forward defaults (D=128: causal, full, non-causal C=2; D=256: four
    # layouts) and its PERSISTENT variant: GPU tests (the persistent kernel bitwise equal to
    # the one-block one; the WS kernel against the float64 reference with the env forcing it;
    # the default path's reference tests at D=128/256; 16K causal against SDPA), then the
    # A/B: the small pass on the persistent kernel with 3 programs (many blocks each), the
    # one-block vs persistent kernel at 32K D=128 and D=256
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-180} python3 -m pytest -q -m gpu tests/kernels/test_gluon_fwd.py tests/kernels/test_triton_flashmask.py \
      -k "persistent or (ws_forward and ((128 and gluon_ws and not wsp) or (256 and wsp))) or (against_float64 and fused and (128 or 256)) or (long_seq and fused and causal)" \
      -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_fwdws.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-230} python3 benchmarks/gluon_fwd_ab.py --budget-s $((${AB_S:-230} - 50)) \
      --small-configs 128x128w8s2ws+P3 \
      --cases ${CASES:-causal,causal_document_short,causal_document_mixed,causal_document_corpus,document_short,full} \
      --configs ${CONFIGS:-128x128w8s2ws,128x128w8s2ws+P,128x128w8s2wsp+P} 2>&1 | tee "$OUT/bench_fwdws3.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws3_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws3_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 90 python3 benchmarks/gluon_fwd_ab.py --skip-small --budget-s 40 --dims 256 \
      --cases causal,causal_document_corpus,document_short --configs 128x64w8s2wsp,128x64w8s2wsp+P 2>&1 | tee "$OUT/bench_fwdws3_d256.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws3_d256_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws3_d256_ab.md"
    ;;
  fwdws4)
    # the public-path GPU tests of the Gluon forwards (the masks now carry q's batch), then the
    # 32K D=128 rows with the WS forward default (tl forward as a variant)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-130} python3 -m pytest -q -m gpu tests/kernels/test_gluon_fwd.py \
      -k "(ws_forward and ((128 and gluon_ws and not wsp) or (256 and wsp))) or public_forward" \
      -p no:cacheprovider --tb=short 2>&1 | tail -30 | tee "$OUT/pytest_fwdws4.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 --no-gqa \
      --impls flashmask3,flashmask3_tl_fwd,flex,sdpa_cudnn --budget-s "$BUDGET" --out "$OUT" --tag v68_32k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_32k.log"
    ;;
  fwdws5)
    # session 14: the PERSISTENT WS forward with a claimed walk (the producer takes blocks from a
    # global counter in the grid's order; session 13's static walk lost 4-20%): its bitwise
    # tests against the one-block kernel, the A/B's small pass with 3 programs, then one-block
    # vs persistent against tl at 32K D=128 (the causal C=1 masks the default leaves to tl
    # first), D=256 and D=64
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-110} python3 -m pytest -q -m gpu tests/kernels/test_gluon_fwd.py -k persistent \
      -p no:cacheprovider --tb=short 2>&1 | tail -30 | tee "$OUT/pytest_fwdws5.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-250} python3 benchmarks/gluon_fwd_ab.py --budget-s $((${AB_S:-250} - 50)) \
      --small-configs 128x128w8s2ws+P3 \
      --cases ${CASES:-causal_document_short,causal_document_mixed,causal_document_corpus,causal_document_long,sliding_window,causal,document_short,full} \
      --configs ${CONFIGS:-128x128w8s2ws,128x128w8s2ws+P} 2>&1 | tee "$OUT/bench_fwdws5.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws5_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws5_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${DIMS_S:-150} python3 benchmarks/gluon_fwd_ab.py --skip-small --budget-s $((${DIMS_S:-150} - 50)) --dims 256,64 \
      --cases causal,causal_document_short,causal_document_corpus,document_short --configs 128x64w8s2wsp,128x64w8s2wsp+P,128x128w8s3wsp,128x128w8s3wsp+P 2>&1 | tee "$OUT/bench_fwdws5_dims.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws5_dims_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws5_dims_ab.md"
    ;;
  fwdws6)
    # session 14: COLS_SMEM (the WS forward's producer stages the masked tiles' mask columns in
    # shared memory; the consumers had waited for those global loads after their S wait):
    # GPU tests of the WS forward (the default now stages them) and its persistent kernel, the
    # A/B's small pass, then staged (ws) vs global (wsg) columns against tl at 32K D=128 on
    # every masked layout, then D=256 and D=64
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-130} python3 -m pytest -q -m gpu tests/kernels/test_gluon_fwd.py \
      -k "(persistent and None) or (ws_forward and 128 and gluon_ws and not wsp)" \
      -p no:cacheprovider --tb=short 2>&1 | tail -30 | tee "$OUT/pytest_fwdws6.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-230} python3 benchmarks/gluon_fwd_ab.py --budget-s $((${AB_S:-230} - 50)) \
      --small-configs 128x128w8s2ws,128x128w8s2ws+P3 \
      --cases ${CASES:-causal_document_short,causal_document_mixed,causal_document_corpus,causal_document_long,sliding_window,causal_blockwise,shared_question,document_short,prefix_document_corpus,global_sliding_window,random_eviction} \
      --configs ${CONFIGS:-128x128w8s2ws,128x128w8s2wsg} 2>&1 | tee "$OUT/bench_fwdws6.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws6_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws6_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${DIMS_S:-120} python3 benchmarks/gluon_fwd_ab.py --skip-small --budget-s $((${DIMS_S:-120} - 45)) --dims 256,64 \
      --cases causal_document_short,causal_document_corpus,document_short,causal_blockwise --configs 128x64w8s2wsp,128x64w8s2wspg,128x128w8s3wsp,128x128w8s3wspg 2>&1 | tee "$OUT/bench_fwdws6_dims.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_ws6_dims_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_ws6_dims_ab.md"
    ;;
  v69)
    # session 14's table rows with v6.9 (the WS forward with staged mask columns on every
    # layout at D=128 and D=256): 32K D=128 (all masks), 8K D=128 (the document masks and the
    # plain ones), the 8K D=256 causal row (forward against cuDNN)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_32K:-240} + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 --no-gqa \
      --impls flashmask3,flex,sdpa_cudnn,sdpa_flash,varlen --budget-s "${BUDGET_32K:-240}" --out "$OUT" --tag v69_32k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_32k.log"
    [ "${BUDGET_8K:-90}" -gt 0 ] && FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_8K:-90} + 40)) python3 benchmarks/kernel.py --seqlens 8192 --dims 128 --no-gqa \
      --masks ${MASKS_8K:-causal_document_mixed,prefix_document_corpus,causal_document_corpus,causal_document_short,document_short,causal_document_long,document_corpus,causal,full} \
      --impls flashmask3,flex,sdpa_cudnn,sdpa_flash,varlen --budget-s "${BUDGET_8K:-90}" --out "$OUT" --tag v69_8k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_8k.log"
    [ "${BUDGET_D256:-30}" -gt 0 ] && FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_D256:-30} + 40)) python3 benchmarks/kernel.py --seqlens 8192 --dims 256 --no-gqa \
      --masks ${MASKS_D256:-causal} --impls flashmask3,flex,sdpa_cudnn,sdpa_flash --budget-s "${BUDGET_D256:-30}" --out "$OUT" --tag v69_d256 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_d256.log"
    ;;
  v69b)
    # session 14's last call, the interleaved timer (every implementation's calls alternate
    # round by round): the D=128 document rows at 8K, 32K GQA (the MHA cases kernel_v69_32k.json
    # measured are skipped) and 128K
    DOCS=causal_document_mixed,causal_document_short,causal_document_long,prefix_document_corpus,causal_document_corpus,document_short,document_corpus
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_8K:-80} + 50)) python3 benchmarks/kernel.py --seqlens 8192 --dims 128 --no-gqa --masks "$DOCS" \
      --impls flashmask3,flex,varlen --budget-s "${BUDGET_8K:-80}" --out "$OUT" --tag v69b_8k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_8k.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_GQA:-70} + 50)) python3 benchmarks/kernel.py --seqlens 32768 --dims 128 --masks "$DOCS" \
      --skip-done benchmarks/results/kernel_v69_32k.json --impls flashmask3,flex,varlen --budget-s "${BUDGET_GQA:-70}" --out "$OUT" --tag v69b_gqa 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_gqa.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_128K:-90} + 60)) python3 benchmarks/kernel.py --seqlens 131072 --dims 128 --no-gqa --masks "$DOCS" \
      --impls flashmask3,flex,varlen --budget-s "${BUDGET_128K:-90}" --out "$OUT" --tag v69b_128k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_128k.log"
    ;;
  shortdocs)
    # (prepared in session 14, not yet run) causal short documents, the WS forward against tl in
    # one process at 8K, 32K and 128K (the v6.9 table suggests tl is 7-14% faster at 8K and
    # 128K): the evidence a host-side document-length hint would need
    for S in 8192 32768 131072; do
      FLASHMASK3_TRITON_AUTOTUNE=0 timeout 100 python3 benchmarks/gluon_fwd_ab.py --skip-small --budget-s 50 --seqlen $S \
        --cases causal_document_short,causal_document_mixed,document_short --configs 128x128w8s2ws,128x128w8s2wsg 2>&1 | tee "$OUT/bench_shortdocs_$S.log"
      mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_shortdocs_${S}_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_shortdocs_${S}_ab.md"
    done
    ;;
  s15a)
    # session 15, first call: GPU tests of the GLUON_FWD_DIMS dispatch refactor (4f01434, CPU-only
    # so far); WS vs tl forward on short documents at 8K and 128K (the v6.9 rows suggest tl is
    # faster there); the D=64 WS forward (staged columns) on the non-short layouts at 32K; the
    # fixed interleaved timer's first GPU run on the three missed document cells
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-90} python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py \
      -k "bfloat16-128-causal_document-fused or bfloat16-256-document-split or bfloat16-128-document-fused or float16-128-sliding_window-fused" \
      -p no:cacheprovider --tb=short 2>&1 | tail -15 | tee "$OUT/pytest_s15a.log"
    for S in 8192 131072; do
      FLASHMASK3_TRITON_AUTOTUNE=0 timeout 75 python3 benchmarks/gluon_fwd_ab.py --skip-small --budget-s 35 --seqlen $S \
        --cases causal_document_short,document_short,causal_document_mixed --configs 128x128w8s2ws 2>&1 | tee "$OUT/bench_shortdocs_$S.log"
      mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_shortdocs_${S}_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_shortdocs_${S}_ab.md"
    done
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${D64_S:-110} python3 benchmarks/gluon_fwd_ab.py --skip-small --budget-s $((${D64_S:-110} - 40)) --dims 64 \
      --cases document_corpus,causal_document_corpus,causal,full,sliding_window,prefix_document_corpus --configs 128x64w8s2wsp,128x128w8s3wsp 2>&1 | tee "$OUT/bench_d64ws.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_d64ws_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_d64ws_ab.md"
    for SD in 8192:128:causal_document_short 131072:128:causal_document_short 131072:64:document_corpus; do
      IFS=: read -r S D M <<< "$SD"
      FLASHMASK3_TRITON_AUTOTUNE=0 timeout 90 python3 benchmarks/kernel.py --seqlens "$S" --dims "$D" --no-gqa --masks "$M" \
        --impls flashmask3,flex --budget-s 30 --out "$OUT" --tag "s15a_${S}_${D}" 2>&1 \
        | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_s15a_${S}_${D}.log"
    done
    ;;
  s15b)
    # session 15: the Gluon dK/dV at D=256 (two warpgroups split the head dim; the split
    # backward's default there now): its GPU tests and the public D=256 ones against the float64
    # reference, the A/B against the tl kernel at 32K, then the D=256 causal rows (cuDNN)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py tests/kernels/test_triton_flashmask.py \
      -k "d256 or bfloat16-256" -p no:cacheprovider --tb=short 2>&1 | tail -25 | tee "$OUT/pytest_s15b.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-170} python3 benchmarks/gluon_dkdv_ab.py --skip-small --head-dim 256 --budget-s $((${AB_S:-170} - 60)) \
      --configs ${CONFIGS:-64x64w8s2wsm,64x64w8s2ws,32x64w8s3wsm} 2>&1 | tee "$OUT/bench_dkdv256.log"
    mv "$OUT/gluon_dkdv_ab.json" "$OUT/gluon_dkdv_d256_ab.json"; mv "$OUT/gluon_dkdv_ab.md" "$OUT/gluon_dkdv_d256_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_ROWS:-150} + 50)) python3 benchmarks/kernel.py --seqlens ${SEQS:-32768,8192,131072} --dims 256 --no-gqa \
      --masks ${MASKS:-causal} --impls flashmask3,flex,sdpa_cudnn,sdpa_flash --budget-s "${BUDGET_ROWS:-150}" --out "$OUT" --tag s15b_d256 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_s15b_d256.log"
    ;;
  s15c)
    # session 15: the D=256 table rows with v7.0 (the Gluon dK/dV at D=256) at 32K, 8K, then
    # 128K, every mask but the causal rows s15b measured (the budget cuts the 128K tail)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 80)) python3 benchmarks/kernel.py --seqlens 32768,8192,131072 --dims 256 --no-gqa \
      --impls flashmask3,flex,sdpa_cudnn,sdpa_flash,varlen --budget-s "$BUDGET" --out "$OUT" --tag v70_d256 \
      --skip-done benchmarks/results/kernel_v70_d256_causal.json 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_v70_d256.log"
    ;;
  s15d)
    # session 15's last call: the GPU tests of the public function (every gpu test of
    # test_triton_flashmask.py against the float64 reference, through the v7.0 dispatch), then
    # the three 128K D=64 grid cells never run (causal, full, random eviction)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py \
      -p no:cacheprovider --tb=short 2>&1 | tail -30 | tee "$OUT/pytest_s15d.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((${BUDGET_ROWS:-120} + 80)) python3 benchmarks/kernel.py --seqlens 131072 --dims 64 --no-gqa \
      --masks causal,random_eviction,full --impls flashmask3,flex,sdpa_cudnn,sdpa_flash --budget-s "${BUDGET_ROWS:-120}" --out "$OUT" --tag v70_d64_128k 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_v70_d64_128k.log"
    ;;
  next16)
    # (prepared in session 15, not yet run) what session 15 left unchecked on the GPU: the D=256
    # tests written after its device time ran out, the public GPU test file's fused / fp16 /
    # long-sequence / deterministic cases (its 200 s run stopped after the split ones), then the
    # D=64 WS forward against tl on random eviction (81-84 TFLOP/s with tl)
    # 5 + 51 tests: about 7 minutes cold, so the A/B below may want a call of its own (TEST_S)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 90 python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py \
      -k "dispatch_picks_gluon_ws or d256" -p no:cacheprovider --tb=short 2>&1 | tail -15 | tee "$OUT/pytest_next16_dkdv.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-330} python3 -m pytest -m gpu tests/kernels/test_triton_flashmask.py \
      -k "d256_random_columns or fused or float16 or long_sequences or deterministic" \
      -p no:cacheprovider --tb=short -v 2>&1 | tail -70 | tee "$OUT/pytest_next16.log"  # -v: names survive a timeout
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-150} python3 benchmarks/gluon_fwd_ab.py --skip-small --budget-s $((${AB_S:-150} - 50)) --dims 64 \
      --cases random_eviction,causal_blockwise,shared_question --configs 128x128w8s3wsp 2>&1 | tee "$OUT/bench_d64re.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_d64re_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_d64re_ab.md"
    ;;
  s16a)
    # session 16: the one-warpgroup WS forward (64 query rows, two programs per SM) against the
    # default WS tile and the tl 64x64 tiles on the document spreads, then its GPU tests, then
    # session 15's unchecked D=256 tests
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-280} python3 benchmarks/gluon_fwd_ab.py --budget-s $((${AB_S:-280} - 60)) --dims 128,64 \
      --skip-small --cases causal_document_short,document_short,causal_document_mixed,causal_document_corpus,causal,sliding_window \
      --configs 128x128w8s2ws,64x64w4s2ws,64x128w4s2ws --tl-configs 64x64w4s3,64x64w4s2 2>&1 | tee "$OUT/bench_fwd1c.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_1c_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_1c_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${T1_S:-80} python3 -m pytest -q -m gpu tests/kernels/test_gluon_fwd.py \
      -k "one_consumer" -p no:cacheprovider --tb=short 2>&1 | tail -15 | tee "$OUT/pytest_s16a_fwd.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${T2_S:-90} python3 -m pytest -q -m gpu tests/kernels/test_gluon_dkdv.py \
      -k "dispatch_picks_gluon_ws or d256" -p no:cacheprovider --tb=short 2>&1 | tail -15 | tee "$OUT/pytest_next16_dkdv.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${T3_S:-110} python3 -m pytest -m gpu tests/kernels/test_triton_flashmask.py \
      -k "d256_random_columns or (fused and 128)" -p no:cacheprovider --tb=short -v 2>&1 | tail -40 | tee "$OUT/pytest_s16a_public.log"
    ;;
  s16b)
    # session 16: the short-rows forward tile through the public function (GPU tests), the rest
    # of session 15's D=256 tests, the kernel table's rows the tile changes (the no-hint forward
    # as a variant in the same run), then fused-backward tiles on short documents
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${T1_S:-130} python3 -m pytest -q -m gpu tests/kernels/test_gluon_fwd.py tests/kernels/test_gluon_dkdv.py \
      -k "short_rows_tile or dispatch_picks_gluon_ws or d256_head_dim_split_matches_tl" -p no:cacheprovider --tb=short 2>&1 | tail -15 | tee "$OUT/pytest_s16b.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${K1_S:-120} python3 benchmarks/kernel.py --seqlens 32768,8192,131072 --dims 128 --no-gqa \
      --masks causal_document_short --impls flashmask3,flashmask3_fwd_ws,flex --budget-s $((${K1_S:-120} - 40)) \
      --out "$OUT" --tag v71_d128 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_v71_d128.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${K2_S:-190} python3 benchmarks/kernel.py --seqlens 32768,8192,131072 --dims 64 --no-gqa \
      --masks causal_document_short,document_short,shared_question,causal_document_mixed,random_eviction \
      --impls flashmask3,flashmask3_tl_fwd,flex --budget-s $((${K2_S:-190} - 50)) \
      --out "$OUT" --tag v71_d64 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_v71_d64.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-110} python3 benchmarks/gluon_dkdv_ab.py --fused --skip-small --skip-tl-fused \
      --cases causal_document_short,document_short --fused-configs 64x128w8s2wsmds,64x128w8s3wsmds,32x64w4s3ws,64x64w4s2ws \
      --budget-s $((${AB_S:-110} - 40)) 2>&1 | tee "$OUT/bench_bwd_short.log"
    ;;
  s16c)
    # session 16: the two causal short-document rows the short-rows tile changes that s16b's
    # budget left out (128K MHA, 32K GQA 32:8), then the public GPU test file's cases no recent
    # run reached (fp16, bf16 fused at D=64/256, flipped, long sequences, deterministic)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${K1_S:-150} python3 benchmarks/kernel.py --seqlens 131072,32768 --dims 128 \
      --masks causal_document_short --impls flashmask3,flashmask3_fwd_ws,flex --budget-s $((${K1_S:-150} - 50)) \
      --skip-done benchmarks/results/kernel_v71_d128.json \
      --out "$OUT" --tag v71_d128b 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_v71_d128b.log"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${TEST_S:-330} python3 -m pytest -m gpu tests/kernels/test_triton_flashmask.py \
      -k "(float16 and not bfloat16) or (fused and not 128) or flipped or long_sequences or deterministic" \
      -p no:cacheprovider --tb=short -v 2>&1 | tail -45 | tee "$OUT/pytest_s16c.log"  # -v: names survive a timeout
    ;;
  s16d)
    # session 16: the one-warpgroup WS forward persistent (two programs per SM) and at 64x32 s4,
    # against its one-block 64x64 s2 on the short spreads; then the grid's never-run cell
    # (128K D=64 full)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${AB_S:-170} python3 benchmarks/gluon_fwd_ab.py --budget-s $((${AB_S:-170} - 50)) --dims 128 \
      --skip-small --cases causal_document_short,document_short,causal_document_mixed \
      --configs 128x128w8s2ws,64x64w4s2ws,64x64w4s2ws+P,64x32w4s4ws 2>&1 | tee "$OUT/bench_fwd1c2.log"
    mv "$OUT/gluon_fwd_ab.json" "$OUT/gluon_fwd_1c2_ab.json"; mv "$OUT/gluon_fwd_ab.md" "$OUT/gluon_fwd_1c2_ab.md"
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${K1_S:-160} python3 benchmarks/kernel.py --seqlens 131072 --dims 64 --no-gqa \
      --masks full --impls flashmask3,flex,sdpa_cudnn,sdpa_flash --budget-s 60 \
      --out "$OUT" --tag v71_d64_full 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_v71_d64_full.log"
    ;;
  s16e)
    # session 16: grid upkeep, the 128K D=256 rows still from v6.6 (cheapest first; the budget
    # cuts the tail)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout ${K1_S:-320} python3 benchmarks/kernel.py --seqlens 131072 --dims 256 --no-gqa \
      --masks shared_question,sliding_window,global_sliding_window,causal_blockwise,document_short,document_corpus,prefix_document_corpus,random_eviction,prefix_lm,full \
      --impls flashmask3,flex,sdpa_cudnn,sdpa_flash,varlen --budget-s $((${K1_S:-320} - 80)) \
      --out "$OUT" --tag v71_d256_128k 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_v71_d256_128k.log"
    ;;
  grid128)
    # (prepared in session 14) the D=128 grid with the interleaved timer, one sequence length
    # per call: SEQ=8192|32768|131072 (32K includes GQA 32:8); about 8 minutes each
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 60)) python3 benchmarks/kernel.py --seqlens "${SEQ:-32768}" --dims 128 \
      --impls "${IMPLS:-flashmask3,flex,sdpa_cudnn,sdpa_flash,varlen}" --budget-s "$BUDGET" --out "$OUT" --tag "grid128_${SEQ:-32768}" 2>&1 \
      | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_grid128.log"
    ;;
  rest)
    # what the v6.3 table left out: first the GPU tests of the D=256 forward tile (new default,
    # not yet run against the float64 reference on a GPU), then every grid case no committed
    # kernel_v6*.json has (8K/128K at D=64 and D=256, GQA and D=256 masks at 32K, 128K heavy masks)
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_triton_flashmask.py -k "256" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_gpu.log"
    # shellcheck disable=SC2046  # the list of committed result files
    FLASHMASK3_TRITON_AUTOTUNE=0 timeout $((BUDGET + 60)) python3 benchmarks/kernel.py --plan grid --budget-s "$BUDGET" --out "$OUT" --tag rest \
      --impls "${IMPLS:-flashmask3,flex,sdpa_cudnn,varlen}" --skip-done $(ls benchmarks/results/kernel_v6*.json | grep -v compiled) 2>&1 | grep -v "DeprecationWarning\|create_block_mask(mm" | tee "$OUT/bench_rest.log"
    ;;
  d*)
    DIMS=${PHASE#d}
    timeout $((BUDGET + 60)) python3 benchmarks/kernel.py --dims "$DIMS" --no-gqa --budget-s "$BUDGET" --out "$OUT" --tag "d${DIMS//,/_}" 2>&1 | tee "$OUT/bench_d${DIMS//,/_}.log"
    ;;
  *)
    echo "unknown phase $PHASE"; exit 2;;
esac
