#!/usr/bin/env bash
# One device call for several GPU phases: `bash benchmarks/gpu/run.sh NAME[:SECONDS] ...`.
# Each NAME is benchmarks/gpu/NAME.sh, run with a wall-clock cap (default 180 s) and its own
# log; a failing or timed-out phase does not stop the others. Everything written under $OUT is
# packed into $OUT/gpu_results.tar.gz at the end (the device tool returns at most 8 files).
set -u
OUT="${OUT:?OUT must name the output folder}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  git log -1 --format='commit %H %s' 2>/dev/null || true
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
for spec in "$@"; do
  name="${spec%%:*}"; secs="${spec#*:}"; [ "$secs" = "$spec" ] && secs=180
  mkdir -p "$OUT/$name"
  start=$(date +%s)
  echo "== $name (cap ${secs}s)"
  timeout --kill-after=10 "$secs" bash "benchmarks/gpu/$name.sh" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - start ))s"; tail -n 25 "$OUT/$name.log"
done
cd "$OUT" && tar -czf gpu_results.tar.gz --exclude=gpu_results.tar.gz ./* && \
  find . -mindepth 1 ! -name gpu_results.tar.gz ! -name environment.txt -exec rm -rf {} + 2>/dev/null
ls -la "$OUT"
