#!/usr/bin/env bash
# Every GPU test (pytest -m gpu) in one call: pytest-xdist spreads the cases over
# GPU_TEST_WORKERS processes (default 12 of the GPU machine's 16 cores) that share the one GPU,
# so the kernels' compiles (the slow part: each case compiles its own) run in parallel.
# The whole pytest run is capped at GPU_TEST_CAP seconds (default 300); at the cap pytest gets
# SIGINT, so the cases finished by then are still reported and the JUnit XML is still written.
#
#   OUT=/dir bash benchmarks/gpu/gpu-tests.sh                  # the GPU call (under run.sh)
#   GPU_TEST_MARK="not gpu and not slow" GPU_TEST_FILES=tests/masks GPU_TEST_WORKERS=2 \
#     OUT=/tmp/x bash benchmarks/gpu/gpu-tests.sh              # CPU dry run of the same path
#
# Parallel safety (checked for session 18): the GPU tests write only under pytest's tmp_path
# (per worker under xdist), steer the library through monkeypatch (per process), use no network
# port (the distributed tests' gloo groups rendezvous through a file:// store under tmp_path and
# are not GPU tests), and measure memory with torch.cuda.max_memory_allocated (per process).
# Triton's on-disk kernel cache is shared by the workers; its writes are atomic renames.
# pytest-xdist comes from the wheels in .gpu_wheels/ (no network on the GPU machine); without it
# the run is serial. Log: $OUT/gpu-tests/pytest.log; JUnit XML (all workers): pytest.xml.
set -uo pipefail
DIR="${OUT:?set OUT}/gpu-tests"; mkdir -p "$DIR"
PY="${PYTHON:-python}"
WORKERS=${GPU_TEST_WORKERS:-12}
CAP=${GPU_TEST_CAP:-300}
MARK=${GPU_TEST_MARK:-gpu}
FILES=${GPU_TEST_FILES:-tests}
if ! $PY -c "import xdist, hypothesis" 2>/dev/null; then  # wheels: `pip download` them into .gpu_wheels
  { $PY -m pip install --no-index --find-links .gpu_wheels pytest-xdist hypothesis \
      || $PY -m pip install --no-index --no-deps .gpu_wheels/*.whl; } > "$DIR/pip.log" 2>&1 \
    || echo "pytest-xdist/hypothesis did not install (see $DIR/pip.log)"
fi
PAR=""
$PY -c "import xdist" 2>/dev/null && PAR="-n $WORKERS --dist load"
START=$(date +%s)
echo "pytest -m '$MARK' $PAR on $FILES (cap ${CAP} s) $(date -u +%H:%M:%S)"
# shellcheck disable=SC2086  # FILES and PAR are word lists
timeout -s INT --kill-after=30 "$CAP" $PY -m pytest -v -rfEs -m "$MARK" -p no:cacheprovider $PAR \
  --junitxml="$DIR/pytest.xml" $FILES > "$DIR/pytest.log" 2>&1
RC=$?
echo "pytest rc=$RC in $(( $(date +%s) - START )) s (124: cut by the cap)"
grep -E "^(FAILED|ERROR) " "$DIR/pytest.log" | head -n 30
tail -n 1 "$DIR/pytest.log"
[ -s "$DIR/pytest.xml" ] && echo "JUnit XML: $DIR/pytest.xml" || echo "JUnit XML missing"
exit "$RC"
