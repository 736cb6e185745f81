#!/usr/bin/env bash
# CI step 2: the Triton kernels under the newest Triton, next to a CPU torch, in a venv of its
# own (the project's .venv keeps the Triton its torch pins). Runs (1) an offline sm_90 compile
# of every kernel the dispatch can launch (.ci/compile_sm90.py: the tl kernels must compile;
# Gluon kernels are reported, and on a Triton outside GLUON_CHECKED_TRITON the script checks
# that the dispatch routes every launch to tl) and (2) the interpreter tests of the tl kernels
# and of the public function. Budget: <= 20 minutes on a 2-core machine (docs/host-path.md).
#
#   NEWEST_TRITON   the Triton release to test (default 3.9.0)
#   TORCH_SPEC      what pip installs as torch (default: the newest CPU wheel in /opt/wheels,
#                   else torch from the PyTorch CPU index)
#   VENV            where the venv goes (default: under ~/.cache, outside the clone, so that a
#                   CI run reuses it; it is rebuilt when its Triton stamp is missing: the
#                   install takes 3-9 minutes on the 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/.."
NEWEST_TRITON=${NEWEST_TRITON:-3.9.0}
VENV=${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/flashmask3/venv-triton-$NEWEST_TRITON}
PYTHON=${PYTHON:-python3.11}
if [[ -z "${TORCH_SPEC:-}" ]]; then
  TORCH_SPEC=$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -1 || true)
  TORCH_INDEX=()
  if [[ -z "$TORCH_SPEC" ]]; then
    TORCH_SPEC=torch
    TORCH_INDEX=(--index-url https://download.pytorch.org/whl/cpu)
  fi
else
  TORCH_INDEX=()
fi
STAMP="$VENV/.stamp-triton-$NEWEST_TRITON"
if [[ ! -f "$STAMP" ]]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_SPEC" "${TORCH_INDEX[@]}"
  # --no-deps: a CPU torch does not depend on Triton; the newest Triton goes next to it
  "$VENV/bin/pip" install -q --no-deps "triton==$NEWEST_TRITON"
  "$VENV/bin/pip" install -q "numpy<2.4" tqdm matplotlib "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
  touch "$STAMP"
fi
PY="$VENV/bin/python"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this tree's flashmask3
"$PY" -c "import torch, triton; print('newest-triton step: torch', torch.__version__, 'triton', triton.__version__)"
mkdir -p .ci/out
# a fresh kernel cache: every kernel is really compiled by this Triton
export TRITON_CACHE_DIR
TRITON_CACHE_DIR=$(mktemp -d)
trap 'rm -rf "$TRITON_CACHE_DIR"' EXIT
status=0
"$PY" -W ignore .ci/compile_sm90.py --out ".ci/out/compile_sm90_triton$NEWEST_TRITON.json" || status=1
# the interpreter tests of the tl kernels: the preprocessing (tile classes, live ranges) and
# forward/backward on every mask layout and the dQ scaling of the fused path, the TMA
# descriptor path, fully masked rows; the public function's Triton-backend tests (out-of-range
# columns, compile, the version guard); the context-parallel merge kernel's tests; the GQA
# backward's split groups. The Gluon test files compile Gluon offline: they belong to the
# checked versions (the dispatch never runs Gluon here). INTERPRETER_TESTS overrides the
# selection.
TL_TESTS="classification_twin_matches or live_ranges or forward_backward_random_columns or fully_masked_everything or short_and_unequal or tma_descriptor_path or scale_dq"
API_TESTS="triton or clamped or gluon_kernels or announced or eager_calls"
if [[ -n "${INTERPRETER_TESTS:-}" ]]; then
  TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    $INTERPRETER_TESTS || status=1
else
  TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/kernels/test_tl_kernels.py -k "$TL_TESTS" || status=1
  TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/test_api.py -k "$API_TESTS" || status=1
  # the context-parallel merge, key-gather and gradient-returns kernels (run on every CUDA
  # Triton, Gluon or not)
  TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/kernels/test_merge.py tests/kernels/test_gather.py tests/kernels/test_returns.py || status=1
  # the GQA backward's split groups (the tl dK/dV kernel's KV_SPLIT, the partials' sum)
  TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/kernels/test_staged.py -k "kv_split or kv_groups" || status=1
fi
exit $status
