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


def test_graph_ab_needs_a_gpu_and_renders_its_table(tmp_path, capsys):
    """``--graph-ab`` (eager vs --cuda-graph) refuses to run without CUDA, and its table shows
    both step times, the speed-up and the loss difference of each length."""
    bench = _load()
    assert bench.main(["--graph-ab", "--toy", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    ok = {"status": "ok", "step_time_s": 0.012}
    report = {"device": "GPU", "date": "today", "torch": "t", "triton": "3", "command": "cmd",
              "commit": "abc", "steps": 5, "warmup": 2, "model": bench.GRAPH_AB_MODEL,
              "runs": [{"seq_len": 2048, "eager": ok, "graphed": {**ok, "step_time_s": 0.004},
                        "speedup": 3.0, "max_loss_rel_diff": 1.5e-4},
                       {"seq_len": 4096, "eager": ok, "graphed": {"status": "error"}}]}
    md = bench.graph_markdown(report)
    assert "| 2048 | 12.00 | 4.00 | 3.00x | 0.015% |" in md
    assert "| 4096 | 12.00 | error | - | - |" in md
