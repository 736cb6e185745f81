#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install flashmask3 with its test
# dependencies. Used by `make demo` / `make test` and CI; safe to run repeatedly.
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "flashmask3 needs Python >= 3.11")'
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# PyTorch: keep an existing install; otherwise prefer a local CPU build on machines without a
# GPU (a CUDA build from PyPI is several GB), else the regular wheel. TORCH_SPEC overrides.
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    "${PIP[@]}" "$TORCH_SPEC"
  elif ! command -v nvidia-smi >/dev/null 2>&1 && compgen -G "/opt/wheels/torch-*+cpu-*.whl" >/dev/null; then
    "${PIP[@]}" "$(ls /opt/wheels/torch-*+cpu-*.whl | sort -V | tail -n 1)"
  else
    "${PIP[@]}" "torch>=2.11"
  fi
fi
"${PIP[@]}" -e ".[dev]"
