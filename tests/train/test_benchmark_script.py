"""benchmarks/train.py runs end to end at toy size on CPU and reports every backend."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "train.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy_benchmark_reports_all_backends(tmp_path):
    bench = _load()
    assert "flashmask3-fused" not in bench.parse_args([]).backends  # opt-in: backward pinned
    rc = bench.main(["--toy", "--seq-lens", "128", "256", "--steps", "1", "--warmup", "1",
                     "--sdpa-max-seq", "128", "--out", str(tmp_path),
                     "--backends", *bench.BACKENDS])
    assert rc == 0
    report = json.loads((tmp_path / "train_cpu_toy.json").read_text())
    runs = {(r["seq_len"], r["backend"]): r for r in report["runs"]}
    assert len(runs) == 2 * len(bench.BACKENDS)
    for pinned in ("flashmask3-fused", "flashmask3-split"):
        assert runs[(128, pinned)]["status"] == "skipped"  # a Triton (CUDA) option
    assert runs[(128, "flashmask3")]["status"] == "ok"
    assert runs[(128, "sdpa")]["status"] == "ok"
    assert runs[(256, "sdpa")]["status"] == "skipped"  # above --sdpa-max-seq
    assert runs[(128, "flex")]["status"] == "skipped"  # no CPU backward
    ok = runs[(256, "flashmask3")]
    assert ok["tokens_per_s"] > 0 and 0 < ok["attention_share"] < 1
    # same data and init for every backend: the losses agree
    assert abs(runs[(128, "flashmask3")]["losses"][0] - runs[(128, "sdpa")]["losses"][0]) < 1e-4
    assert "128" in report["speedup_vs_sdpa"]
    md = (tmp_path / "train_cpu_toy.md").read_text()
    assert "| 256 | sdpa |" in md
    assert report["commit"] and f"(commit {report['commit']})" in md  # this checkout's HEAD
