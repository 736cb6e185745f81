#!/usr/bin/env bash
# CI step 3: the newest torch with its own Triton, in a venv of its own (the project's .venv
# keeps torch 2.13 and the Triton the Hopper kernels were checked on). Runs (1) an offline
# sm_90 compile of every kernel the dispatch can launch (.ci/compile_sm90.py: the tl kernels
# must compile; Gluon kernels are reported, and on a Triton outside GLUON_CHECKED_TRITON the
# script checks that the dispatch routes every launch to tl), (2) the CPU suite as `make test`
# runs it (everything but the slow matrices' extra cases: the custom op, torch.compile, CUDA-
# graph helpers, context parallelism over gloo, FSDP2 training, the transformers integration,
# the kernels under the interpreter), and (3) the rest of the interpreter tests of the tl
# kernels and of the public function. Budget: <= 30 minutes on a 2-core machine.
#
#   NEWEST_TORCH    the torch release (default 2.15.0: PyPI's build, which runs on the CPU and
#                   brings the Triton it was released with). This machine's pip config caps
#                   torch at 2.14.1 (the releases on its disk), so the install skips pip's
#                   config files; where PyPI cannot be reached, the newest CPU wheel in
#                   /opt/wheels is used with NEWEST_TRITON next to it (the step says which).
#   NEWEST_TRITON   the Triton release (default 3.9.0, torch 2.15's)
#   TORCH_SPEC      what pip installs as torch instead (skips the above)
#   VENV            where the venv goes (default: under ~/.cache, outside the clone, so that a
#                   CI run reuses it; it is rebuilt when its stamp is missing: the install
#                   takes 2-9 minutes on the 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/.."
NEWEST_TORCH=${NEWEST_TORCH:-2.15.0}
NEWEST_TRITON=${NEWEST_TRITON:-3.9.0}
VENV=${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/flashmask3/venv-torch$NEWEST_TORCH-triton$NEWEST_TRITON}
PYTHON=${PYTHON:-python3.11}
STAMP="$VENV/.stamp-torch$NEWEST_TORCH-triton$NEWEST_TRITON"
if [[ ! -f "$STAMP" ]]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
  if [[ -n "${TORCH_SPEC:-}" ]]; then
    "${PIP[@]}" "$TORCH_SPEC"
  elif ! PIP_CONFIG_FILE=/dev/null "${PIP[@]}" "torch==$NEWEST_TORCH"; then
    wheel=$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -1 || true)
    echo "newest-triton step: torch $NEWEST_TORCH could not be installed; using ${wheel:-torch (PyPI)}" >&2
    "${PIP[@]}" "${wheel:-torch}"
  fi
  # the Triton to test (a no-op where torch brought it; --no-deps: a CPU torch does not depend on it)
  "${PIP[@]}" --no-deps "triton==$NEWEST_TRITON"
  "${PIP[@]}" "numpy<2.4" tqdm matplotlib "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "hypothesis>=6.100" \
    "transformers>=5"
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
# the CPU suite (make test's selection); the Gluon offline checks and the raw-launch tests run
# where this Triton is in GLUON_CHECKED_TRITON / RAW_LAUNCH_TRITON (3.9.0 is) and skip elsewhere
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" -n 2 tests || status=1
# then, with TRITON_INTERPRET=1 for the whole run (the Triton backend for every CPU call): the
# interpreter tests of the tl kernels (the preprocessing, forward/backward on every mask layout,
# the fused path's dQ scaling, the TMA descriptor path, fully masked rows), the public
# function's Triton-backend tests (out-of-range columns, compile, the version guard), the
# context-parallel merge / gather / returns kernels and the GQA backward's split groups.
# INTERPRETER_TESTS overrides the selection.
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
