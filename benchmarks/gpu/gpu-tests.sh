#!/usr/bin/env bash
# Every GPU test (pytest -m gpu), files in the order given by GPU_TEST_FILES (default: the
# public API and integrations first, then the kernels), verbose so a run cut by its cap still
# reports each case. Log: $OUT/gpu-tests/pytest.log, JUnit XML beside it.
set -uo pipefail
DIR="${OUT:?set OUT}/gpu-tests"; mkdir -p "$DIR"
FILES=${GPU_TEST_FILES:-"tests/test_api.py tests/integrations tests/train tests/distributed
  tests/kernels/test_attention.py tests/kernels/test_torch_path.py tests/kernels/test_dispatch.py
  tests/kernels/test_gluon_bwd.py tests/kernels/test_tl_kernels.py tests/kernels/test_gluon_fwd.py"}
python -m pytest -v -m gpu -p no:cacheprovider --junitxml="$DIR/pytest.xml" $FILES 2>&1 | tee "$DIR/pytest.log" \
  | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -n 40
