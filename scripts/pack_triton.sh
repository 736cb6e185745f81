#!/usr/bin/env bash
# Pack a Triton release small enough to travel to the GPU machine (a call carries 64 MiB; the
# wheel is ~270 MiB): the NVIDIA backend and the Python package only. Dropped: the AMD backend,
# CUPTI and the profiler (proton), the Blackwell ptxas, the instrumentation and plugin test
# libraries; libtriton.so's debug info and static symbol table are stripped (its dynamic
# symbols stay). Triton 3.8.0 packs to ~49 MiB, 3.9.0 to ~55 (xz -9e, ~4 minutes on two cores).
#   bash scripts/pack_triton.sh 3.9.0        -> .triton-pack/triton-3.9.0.tar.xz
# Then: OUT=... NEWER_TRITON=.triton-pack/triton-3.9.0.tar.xz bash benchmarks/gpu/newer-triton.sh
# with `carry: [".triton-pack"]` (benchmarks/gpu/newer-triton.sh unpacks it into /tmp).
set -euo pipefail
VERSION=${1:?usage: pack_triton.sh VERSION}
cd "$(dirname "$0")/.."
OUTDIR=.triton-pack
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WORK" "triton==$VERSION"
mkdir -p "$WORK/site"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$WORK"/triton-*.whl "$WORK/site"
T="$WORK/site/triton"
rm -rf "$T/backends/amd" "$T/backends/nvidia/lib/cupti" "$T/backends/nvidia/lib/cupti-blackwell" \
  "$T/instrumentation" "$T/FileCheck" "$T/plugins" "$T/_C/libproton.so"
# one ptxas: the one the release compiles sm_90 with (up to 3.8 `ptxas`, the CUDA 12 one; from 3.9
# `ptxas-blackwell` for every arch from sm_90, a CUDA 13 ptxas); the other name links to it
BIN="$T/backends/nvidia/bin"
if grep -q "arch >= 100 else knobs.nvidia.ptxas" "$T/backends/nvidia/compiler.py"; then
  rm -f "$BIN/ptxas-blackwell"; ln -s ptxas "$BIN/ptxas-blackwell"
else
  rm -f "$BIN/ptxas"; ln -s ptxas-blackwell "$BIN/ptxas"
fi
chmod -R u+w "$T"
strip --strip-unneeded "$T/_C/libtriton.so"
chmod +x "$BIN"/*
strip --strip-debug "$BIN"/* 2>/dev/null || true
mkdir -p "$OUTDIR"
tar -C "$WORK/site" -cf - triton | xz -9e -T2 > "$OUTDIR/triton-$VERSION.tar.xz"
ls -la "$OUTDIR/triton-$VERSION.tar.xz"
