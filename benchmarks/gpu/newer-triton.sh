#!/usr/bin/env bash
# The GPU checks of a Triton release newer than the GPU machine's (torch 2.11 / Triton 3.6), next
# to that machine's torch: the Triton the user of torch 2.12-2.15 gets, carried as a pruned
# tarball (scripts/pack_triton.sh builds it: ~50 MiB for 3.9.0, under the 64 MiB a call
# carries) and unpacked into /tmp. Triton's compiler, driver stub and launcher are the release's
# own; torch 2.11 only provides the tensors and the stream (Triton's kernels do not need the
# torch it was released with; torch.compile's inductor does, so compile tests are left out).
#   OUT=/dir NEWER_TRITON=.triton-pack/triton-3.9.0.tar.xz bash benchmarks/gpu/newer-triton.sh
# NEWER_TRITON_GLUON=1 sets FLASHMASK3_GLUON_UNCHECKED=1: the Gluon kernels run on that Triton
# (the check a release needs before it joins dispatch.GLUON_CHECKED_TRITON), and the kernel step
# times the portable tl path beside them.
# Steps (NEWER_TRITON_STEPS, default "smoke tests kernel host"):
#   smoke   the version Python imports, `flashmask3 env`, one forward+backward against float64
#   tests   the GPU tests (pytest -m gpu, minus torch.compile's) under that Triton, cap
#           NEWER_TRITON_TEST_CAP s (default 330; on Triton 3.8 the kernel and API ones, 321, did not finish in 200)
#   kernel  benchmarks/kernel.py, 32K D=128, the README's masks (NEWER_TRITON_MASKS), flashmask3
#           (what this Triton selects) against FlexAttention, budget NEWER_TRITON_KERNEL_S
#   host    benchmarks/host_path.py's host table (and small table unless NEWER_TRITON_SMALL=0)
# Outputs: $OUT/newer-triton/{smoke.log, pytest.log, pytest.xml, kernel_*.json, host/*,
#          newer_triton.{json,md} (benchmarks/newer_triton.py's summary)}
set -uo pipefail
DIR="${OUT:?set OUT}/newer-triton"; mkdir -p "$DIR/host"
PACK=${NEWER_TRITON:?name the tarball (scripts/pack_triton.sh)}
# one site (and one kernel cache) per pack: a warm machine keeps /tmp between calls, and a
# second pack must not be served the first one's Triton
NAME=$(basename "$PACK" .tar.xz)
SITE=${NEWER_TRITON_SITE:-/tmp/newer-triton-site/$NAME}
PY="${PYTHON:-python}"
STEPS=${NEWER_TRITON_STEPS:-smoke tests kernel host}
TEST_K=${NEWER_TRITON_K:-not compile and not reduce_overhead and not inductor}
TEST_FILES=${NEWER_TRITON_TEST_FILES:-tests}
if [[ ! -d "$SITE/triton" ]]; then
  mkdir -p "$SITE"
  $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$PACK" "$SITE" \
    || { echo "could not unpack $PACK"; exit 1; }
fi
# in-tree backends only: the pack has no dist-info, and the machine Triton's entry points name
# the AMD backend the pack leaves out
export PYTHONPATH="$SITE:$PWD" FLASHMASK3_BACKEND=triton PYTHONUNBUFFERED=1 TRITON_BACKENDS_IN_TREE=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/newer-triton-cache/$NAME}
IMPLS=flashmask3,flex
if [[ "${NEWER_TRITON_GLUON:-0}" == 1 ]]; then
  export FLASHMASK3_GLUON_UNCHECKED=1; IMPLS=flashmask3,flashmask3_portable,flex
fi
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, triton.__file__)" \
  | tee "$DIR/versions.txt"
# a pack named triton-VERSION must import as that VERSION (not the machine's, nor another pack's)
WANT=${NAME#triton-}
if [[ "$NAME" == triton-* ]] && ! grep -q " triton $WANT " "$DIR/versions.txt"; then
  echo "the pack $PACK did not import as Triton $WANT: stopping"; exit 1
fi
status=0
for step in $STEPS; do
  t0=$SECONDS
  case $step in
    smoke)
      { $PY -m flashmask3 env; $PY benchmarks/gpu/newer_triton_smoke.py; } > "$DIR/smoke.log" 2>&1 \
        || status=1
      tail -n 30 "$DIR/smoke.log";;
    tests)
      # the tests pick their own backends (FLASHMASK3_BACKEND=triton would refuse the torch
      # path's tiny shapes, e.g. the integration tests' head dim 8)
      timeout -s INT --kill-after=20 "${NEWER_TRITON_TEST_CAP:-330}" env -u FLASHMASK3_BACKEND $PY -m pytest -q -rfEs -m gpu \
        -p no:cacheprovider -W ignore::DeprecationWarning -n "${NEWER_TRITON_WORKERS:-12}" \
        -k "$TEST_K" \
        --junitxml="$DIR/pytest.xml" $TEST_FILES > "$DIR/pytest.log" 2>&1 \
        || status=1
      grep -E "^(FAILED|ERROR) " "$DIR/pytest.log" | head -n 30; tail -n 3 "$DIR/pytest.log";;
    kernel)
      timeout $(( ${NEWER_TRITON_KERNEL_S:-150} + 40 )) $PY benchmarks/kernel.py --seqlens 32768 \
        --dims 128 --no-gqa --impls $IMPLS \
        --masks "${NEWER_TRITON_MASKS:-causal_document_corpus,shared_question,sliding_window,causal}" \
        --budget-s "${NEWER_TRITON_KERNEL_S:-150}" --out "$DIR" --tag newer_triton \
        > "$DIR/kernel.log" 2>&1 || status=1
      tail -n 16 "$DIR/kernel.log";;
    host)
      ARGS="--no-graphs"; [[ "${NEWER_TRITON_SMALL:-1}" == 0 ]] && ARGS="--skip-small"
      timeout "${NEWER_TRITON_HOST_S:-150}" $PY benchmarks/host_path.py $ARGS --out "$DIR/host" \
        > "$DIR/host.log" 2>&1 || status=1
      sed -n '/^| form/,$p' "$DIR/host/host_path.md" 2>/dev/null | head -n 40;;
    *) echo "unknown step $step"; status=1;;
  esac
  echo "== $step: $((SECONDS - t0)) s (status so far $status)"
done
# the summary (commit it as benchmarks/results/newer_triton_VERSION.{json,md})
if [[ -f "$DIR/pytest.xml" && -f "$DIR/kernel_newer_triton.json" ]]; then
  $PY -m pytest --collect-only -q -m gpu -k "$TEST_K" \
    $TEST_FILES > "$DIR/selected.txt" 2>/dev/null
  $PY benchmarks/newer_triton.py --kernels "$DIR/kernel_newer_triton.json" --junit "$DIR/pytest.xml" \
    --selected "$DIR/selected.txt" --out "$DIR/newer_triton" > "$DIR/summary.log" 2>&1 \
    || echo "summary failed (see $DIR/summary.log)"
fi
exit $status
