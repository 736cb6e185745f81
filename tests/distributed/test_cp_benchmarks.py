"""The CP benchmark scripts run at tiny sizes on CPU and report what they claim."""

from __future__ import annotations

import json

import torch

from benchmarks import balance, cp_single_gpu
from benchmarks.corpus import corpus_document_lengths, document_spreads, pack_corpus_documents


def test_corpus_lengths_are_real_files_and_pack_exactly():
    lengths = corpus_document_lengths()
    assert len(lengths) > 100 and min(lengths) >= 1
    packed = pack_corpus_documents(8192, seed=1)
    assert sum(packed) == 8192 and all(n > 0 for n in packed)
    assert pack_corpus_documents(8192, seed=1) == packed  # deterministic
    spreads = document_spreads(8192)
    assert set(spreads) == {"short", "mixed", "long", "corpus"}
    assert all(sum(v) == 8192 for v in spreads.values())


def test_balance_benchmark_small(tmp_path):
    assert balance.main(["--tokens", "8192", "--cp", "2", "4", "16", "--plan-tokens", "8192", "--plan-cp", "4",
                         "--plan-heads", "1", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "balance.json").read_text())
    for rows in out["results"].values():
        for r in rows:
            assert r["imbalance_sparse"] <= 1.05
            assert r["kv_gib_overlap_sparse"] <= r["kv_gib_allgather"]
            for s in balance.STRATEGIES:  # hierarchical routing never crosses nodes more than flat
                assert r[f"xnode_gib_hier_{s}"] <= r[f"xnode_gib_flat_{s}"]
    for rows in out["windows"].values():  # a window layer moves no more than the full-mask layer
        assert {r["window"] for r in rows} == {1024, 4096}
        for r in rows:
            assert r["kv_gib_overlap"] <= r["kv_gib_overlap_full_mask"] + 1e-12
            assert r["imbalance"] >= 1.0 and r["imbalance_own_placement"] >= 1.0
    assert out["planning"] and out["meta"]["torch"]
    assert (tmp_path / "balance.png").stat().st_size > 0
    text = (tmp_path / "balance.md").read_text()
    assert "imbalance" in text and "Sliding-window layers" in text


def test_cp_single_gpu_cpu_mode(tmp_path):
    """The one-device emulation runs every rank of cp 4 and a sample at cp 16 through the staged
    runtime, and reports the slowest rank, host time and launches it measured."""
    args = ["--device", "cpu", "--tokens", "1024", "--cp", "4", "16", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--dtype", "float32", "--iters", "1", "--warmup", "0",
            "--all-ranks-up-to", "4", "--heaviest", "2", "--random", "1", "--check", "--out", str(tmp_path)]
    assert cp_single_gpu.main(args) == 0
    res = json.loads((tmp_path / "cp_runtime.json").read_text())["cp"]
    assert set(res["4"]) == {"dual_chunk+allgather", "sparse+allgather", "sparse+overlap",
                             "sparse+overlap bwd per stage", "sparse+overlap torch returns",
                             "ptrr+allgather"}
    assert {"sparse+overlap hier", "sparse+overlap hier torch returns", "ptrr+overlap hier"} <= set(res["16"])
    for cp, configs in res.items():
        for entry in configs.values():
            ranks = entry["ranks"]
            assert len(ranks) == (4 if cp == "4" else entry["ranks_wanted"]) and ranks
            assert entry["slowest_seconds"] == max(r["seconds"] for r in ranks) > 0
            assert entry["launches_max"] <= 64 and entry["syncs_max"] == 0
            assert all(r["attention_calls"] == _attention_calls(entry, r) for r in ranks)
            assert entry["max_err_out"] < 1e-5 and entry["max_err_dq"] < 1e-5
            for r in ranks:  # every timed iteration, layer and host, behind the medians
                assert len(r["iterations"]) == 1 and r["iterations"][0] == [r["seconds"], r["host_seconds"]]
    assert entry["sampled"] and "(sampled)" in (tmp_path / "cp_runtime.md").read_text()


def _attention_calls(entry, r) -> int:
    """A forward call per stage; the backward's by its backward_calls (allgather: one per stage
    too), one backward prepare and finish on overlap."""
    if entry["comm"] == "allgather":
        return 2 * r["stages"]
    remote = r["stages"] - r["own_stage"]
    two = r["own_stage"] + min(1, remote)
    bwd = {"stage": r["stages"], "one": min(1, r["stages"]), "one+local": two}[r["backward_calls"]]
    return r["stages"] + bwd + 2


def test_cp_single_gpu_backward_calls_ab(tmp_path):
    """``--backward-calls`` measures each overlap layout once per mode (named by it; the
    allgather layout once), all exact, the merged modes with fewer attention calls."""
    args = ["--device", "cpu", "--tokens", "1024", "--cp", "4", "16", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--dtype", "float32", "--iters", "1", "--warmup", "0",
            "--all-ranks-up-to", "4", "--heaviest", "1", "--random", "0", "--check",
            "--configs", "sparse+allgather", "sparse+overlap", "sparse+overlap hier",
            "--backward-calls", "stage", "one", "one+local", "--autograd-thread", "calling",
            "--out", str(tmp_path)]
    assert cp_single_gpu.main(args) == 0
    assert torch._C._is_multithreading_enabled()  # the engine's setting is restored afterwards
    full = json.loads((tmp_path / "cp_runtime.json").read_text())
    assert full["args"]["autograd_thread"] == "calling"
    res = full["cp"]
    modes = ("stage", "one", "one+local")
    assert set(res["4"]) == {"sparse+allgather"} | {f"sparse+overlap bwd={m}" for m in modes}
    assert {f"sparse+overlap hier bwd={m}" for m in modes} <= set(res["16"])
    for configs in res.values():
        for entry in configs.values():
            for r in entry["ranks"]:
                assert r["attention_calls"] == _attention_calls(entry, r)
                if entry["comm"] == "overlap":
                    assert r["backward_calls"] == entry["backward_calls"]
            assert entry["max_err_out"] < 1e-5 and entry["max_err_dq"] < 1e-5
        for layout in ("sparse+overlap", "sparse+overlap hier"):
            if f"{layout} bwd=one" in configs:
                one, stage = (configs[f"{layout} bwd={m}"]["ranks"] for m in ("one", "stage"))
                assert sum(r["attention_calls"] for r in one) < sum(r["attention_calls"] for r in stage)


def test_kernel_breakdown_busy_idle_and_own_kernels(monkeypatch):
    """The breakdown's arithmetic on a stand-in profile: overlapping kernels count once in the
    busy time, the gaps between kernels are idle, flashmask3's kernels (``_..._kernel``) are
    listed in launch order and every other kernel is a torch op."""
    import types

    import torch

    cuda = torch.autograd.DeviceType.CUDA
    spans = [(0.0, 100.0, "_fwd_ws_kernel"), (50.0, 120.0, "void at::native::index_select"),
             (200.0, 260.0, "_dkdv_gluon_kernel"), (300.0, 310.0, "Memcpy DtoD"),
             (305.0, 400.0, "_scale_dq_kernel")]
    events = [types.SimpleNamespace(device_type=cuda, name=n,
                                    time_range=types.SimpleNamespace(start=a, end=b))
              for a, b, n in reversed(spans)]  # out of order: sorted by start
    events.append(types.SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, name="aten::x",
                                        time_range=types.SimpleNamespace(start=0.0, end=999.0)))

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    calls = []
    out = cp_single_gpu.kernel_breakdown(lambda: calls.append(1), lambda step: (step(), (0.5e-3, 0.2e-3))[1])
    assert calls == [1]
    assert out["kernels"] == 5 and out["layer_ms"] == 0.5 and out["host_ms"] == 0.2
    # busy: [0,120] + [200,260] + [300,400] = 120 + 60 + 100 us; span 400 us
    assert abs(out["busy_ms"] - 0.28) < 1e-12 and abs(out["span_ms"] - 0.4) < 1e-12
    assert abs(out["idle_ms"] - 0.12) < 1e-12
    assert [n for n, _ in out["own"]] == ["_fwd_ws_kernel", "_dkdv_gluon_kernel", "_scale_dq_kernel"]
    assert abs(out["own_ms"] - 0.255) < 1e-12 and abs(out["torch_ms"] - 0.08) < 1e-12
    assert out["torch_top"][0][0] == "void at::native::index_select"


def test_cp_single_gpu_records_the_document_lengths(tmp_path):
    """The result file keeps the document lengths it planned (the corpus spread depends on the
    machine's files), so the scale model can rebuild every rank's plan from the file alone."""
    args = ["--device", "cpu", "--tokens", "1024", "--cp", "4", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--dtype", "float32", "--iters", "1", "--warmup", "0",
            "--configs", "sparse+overlap", "--breakdown", "--out", str(tmp_path)]
    assert cp_single_gpu.main(args) == 0
    res = json.loads((tmp_path / "cp_runtime.json").read_text())
    assert res["lengths"] == document_spreads(1024, seed=0)["corpus"]
    assert all("breakdown" not in r for r in res["cp"]["4"]["sparse+overlap"]["ranks"])  # CPU: none


def test_planner_contention_cpu_mode(tmp_path):
    """The planning-contention benchmark times a rank's step alone, with a planning thread and
    with the loader's planning process, and records every plan it made."""
    from benchmarks import cp_planner_contention

    assert cp_planner_contention.main(
        ["--device", "cpu", "--tokens", "2048", "--cp", "4", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "8", "--dtype", "float32", "--layers", "1", "--reps", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "cp_planner_contention.json").read_text())
    assert set(res["modes"]) == {"alone", "planning thread", "planning process"}
    assert all(len(m["samples"]) == 2 and m["step_seconds"] > 0 for m in res["modes"].values())
    assert all(len(s) == 2 for s in res["plan_during_step_seconds"].values())
    assert len(res["plan_alone_seconds"]) == 3
