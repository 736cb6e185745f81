"""benchmarks/multigpu.sh in its CPU mode (gloo, 2 ranks, small sizes) runs end to end and its
CP attention outputs match single-process attention."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_multigpu_script_cpu_mode(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, PYTHON=sys.executable, MG_RUNS=str(tmp_path / "runs"))
    proc = subprocess.run(
        ["bash", "benchmarks/multigpu.sh", "--device", "cpu", "--world", "2", "--tokens", "2048",
         "--train-steps", "2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((out / "cp_multigpu.json").read_text())
    runs = rep["attention"]["runs"]
    ours = [r for r in runs if r["method"] != "flex_cp"]
    assert {r["method"] for r in ours} == {"dual_chunk+allgather", "sparse+allgather", "sparse+overlap"}
    assert {r["mask"] for r in ours} >= {"corpus", "causal"}
    for r in ours:
        assert r["seconds"] > 0 and r["max_abs_err"] < 1e-4, r
        assert 0 < r["host_seconds"] <= r["seconds"], r  # the issue time, inside the step
    flex = [r for r in runs if r["method"] == "flex_cp"]
    assert flex and all(("seconds" in r) or r.get("error") for r in flex)  # ran, or says why not
    for label in ("baseline", "ours"):
        assert rep["train"][label].get("tokens_per_s", 0) > 0, rep["train"][label]
    assert rep["train"]["baseline"]["balance"] == "dual_chunk" and rep["train"]["ours"]["comm"] == "overlap"
    assert rep["attention"]["env"]["nccl_env"]["NCCL_NVLS_ENABLE"] == "0"
    md = (out / "cp_multigpu.md").read_text()
    assert "| host ms |" in md
    assert "multigpu.sh --device cpu" in md and (out / "cp_multigpu.png").stat().st_size > 0
