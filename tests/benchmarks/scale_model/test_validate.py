"""The validation script on the committed measurement files, and the plan view."""

import json
from dataclasses import replace
import subprocess
import sys

import numpy as np
import pytest

import flashmask3.masks as M
from benchmarks.scale_model import validate as V
from benchmarks.scale_model.layout import mask_sparsity, view_plan
from flashmask3.distributed import plan


def test_multigpu_file_is_predicted_point_by_point():
    with open(V.MULTI) as f:
        runs = [r for r in json.load(f)["attention"]["runs"] if "seconds" in r]
    points = V.validate_multigpu(V.MULTI)
    assert len(points) == len(runs) == 4
    for p, r in zip(points, runs):
        assert p.measured == r["seconds"]
        assert np.isfinite(p.predicted) and p.predicted > 0
        assert p.error == pytest.approx(p.predicted / r["seconds"] - 1)
    s = V.summary(points)
    assert s["points"] == 4 and s["max_abs_error"] == max(abs(p.error) for p in points)


def test_per_rank_validation_holds_the_sparse_ranks_out():
    r = V.validate_single(V.SINGLE)
    assert len(r["tables"]) == len(r["per_rank"]) == 64
    held = [p for p in r["per_rank"] if p.held_out]
    assert len(held) == 32 and all("sparse" in p.name for p in held)
    assert r["k"] > 0 and r["c"] >= 0


def test_plan_view_reads_the_plan():
    lens = [700, 1300, 300, 1796, 4096]
    mask = M.causal_document_mask(lens)
    p = plan(mask, None, 4, balance="sparse", nodes=2)
    v = view_plan(p, mask.startend_row_indices, True)
    assert v.works == p.works
    for r in range(4):
        # the stages' live tiles add up to the rank's work (tiles model, 128-tile chunks)
        assert sum(t.live for t in v.stages[r]) == p.work(r) == v.sorted_tiles[r].live
        assert [len(s) for s in p.stages(r)] == v.stage_chunks[r]
    assert len(v.rounds) == len(p.rounds)
    assert any(rnd.relay and rnd.source is not None for rnd in v.rounds)
    assert mask_sparsity(lens) == pytest.approx(mask.sparsity())


def test_cli_help_and_validate_mode():
    out = subprocess.run([sys.executable, "-m", "benchmarks.scale_model", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "validate" in out.stdout and "--multigpu" in out.stdout


def _measured_file(tmp_path, rng):
    """A scale_model_attention.json whose times follow a known floored cost (+-2% noise)."""
    from benchmarks.scale_model import calibrate as C

    fwd = C.PassCost(12e-9, 30e-9, 80e-6, 0, 0, floor=0.4e-3)
    bwd = C.PassCost(35e-9, 60e-9, 150e-6, 0, 0, floor=1.5e-3)
    rows = []
    for i in range(80):
        t = C.TileCounts(int(10 ** rng.uniform(1, 4.5)), int(rng.integers(0, 300)), 4096, 8192)
        tf = fwd.seconds(t, 32, C._programs("fwd", t, 32)) * rng.uniform(0.98, 1.02)
        tb = bwd.seconds(t, 32, C._programs("bwd", t, 32)) * rng.uniform(0.98, 1.02)
        rows.append({"spread": "long", "cp": 8, "balance": "sparse" if i % 2 else "dual_chunk", "nodes": 1,
                     "rank": i, "stage": 0, "q_rows": 4096, "keys": 8192, "heads": 32, "kv_heads": 4,
                     "head_dim": 128, "full_tiles": t.full, "partial_tiles": t.partial,
                     "fwd_ms": tf * 1e3, "fwd_bwd_ms": (tf + tb) * 1e3})
    path = tmp_path / "scale_model_attention.json"
    path.write_text(json.dumps({"env": {"gpu": "test"}, "attention": rows}))
    return str(path), rows


def test_measured_shapes_validation_holds_the_sparse_calls_out(tmp_path):
    path, rows = _measured_file(tmp_path, np.random.default_rng(4))
    out = V.validate_measured(path)
    assert set(out) == {"GQA"}  # only GQA rows in the file
    d = out["GQA"]
    assert len(d["in_sample"]["fwd"]) == len(rows) and len(d["held_out"]["fwd+bwd"]) == len(rows) // 2
    assert all(p.held_out for p in d["held_out"]["fwd"]) and not any(p.held_out for p in d["in_sample"]["fwd"])
    assert d["cost"].fwd.floor == pytest.approx(0.4e-3, rel=0.1)
    for check in ("in_sample", "held_out"):
        s = V.summary(d[check]["fwd+bwd"], held_only=False)
        assert s["max_abs_error"] < 0.06 and s["within_target"] == s["points"]


# -- per-program work through the pipeline (session 19) --------------------------------------------

def test_plan_view_work_equals_the_measured_calls_work():
    """The timeline's per-program tiles (view_plan, from the global mask) equal those of the
    very calls measure.py times (plan_calls: the rank-local masks), in launch order."""
    from benchmarks.corpus import document_spreads
    from benchmarks.scale_model.calibrate import program_work
    from benchmarks.scale_model.measure import plan_calls

    lens = document_spreads(16384, seed=0)["mixed"]
    for cp, balance in ((4, "dual_chunk"), (16, "sparse")):
        nodes = cp // 8 if balance == "sparse" and cp > 8 else 1
        mask = M.causal_document_mask(lens)
        v = view_plan(plan(mask, None, cp, balance=balance, nodes=nodes), mask.startend_row_indices, True)
        n = 0
        for meta, fm, keys in plan_calls(lens, "mixed", cp, balance):
            w = program_work(fm.startend_row_indices, False, fm.seqlen_q, keys)
            t = v.sorted_tiles[meta["rank"]] if meta["stage"] == "sorted" else v.stages[meta["rank"]][meta["stage"]]
            for f in ("fwd_full", "fwd_partial", "bwd_full", "bwd_partial"):
                assert np.array_equal(getattr(w, f), getattr(t.work, f)), (meta, f)
            assert w.totals() == (t.full, t.partial)
            n += 1
        assert n >= 4


def _greedy_file(tmp_path, rng):
    """A measurement file of real plans' calls (4K tokens) timed by a known greedy cost, with
    host times scattered +-10% around 200 / 900 us and stream / do_bench columns from them."""
    from benchmarks.corpus import document_spreads
    from benchmarks.scale_model import calibrate as C
    from benchmarks.scale_model.measure import plan_calls

    fwd = C.PassCost(1.6e-6, 2.8e-6, 5e-6, 0, 0, a_program=6e-6, schedule="greedy")
    bwd = C.PassCost(2.4e-6, 3.0e-6, 30e-6, 0, 0, a_qblock=40e-9, a_program=2e-6, schedule="greedy")
    lens = document_spreads(4096, seed=0)
    hidden = V.do_bench_hidden()
    rows = []
    for spread in ("long", "mixed", "short"):
        for cp in (2, 4, 8):
            for balance in ("sparse", "dual_chunk"):
                for meta, fm, keys in plan_calls(lens[spread], spread, cp, balance):
                    w = C.program_work(fm.startend_row_indices, False, fm.seqlen_q, keys)
                    f, p = w.totals()
                    t = C.TileCounts(f, p, fm.seqlen_q, keys, work=w, kv_expanded=False)  # (ran grouped)
                    for h, hk in ((32, 4), (16, 16)):
                        gf, gb = fwd.gpu_time(t, "fwd", h, hk), bwd.gpu_time(t, "bwd", h, hk)
                        hf, hfb = 200e-6 * rng.uniform(0.9, 1.1), 900e-6 * rng.uniform(0.9, 1.1)
                        rows.append(dict(meta, q_rows=fm.seqlen_q, keys=keys, heads=h, kv_heads=hk, head_dim=128,
                                         full_tiles=f, partial_tiles=p, gpu_fwd_ms=gf * 1e3,
                                         gpu_fwd_bwd_ms=(gf + gb) * 1e3, host_fwd_us=hf * 1e6,
                                         host_fwd_bwd_us=hfb * 1e6, stream_fwd_ms=max(hf, gf) * 1e3,
                                         stream_fwd_bwd_ms=max(hfb, gf + gb) * 1e3,
                                         fwd_ms=max(gf, hf - hidden) * 1e3,
                                         fwd_bwd_ms=max(gf + gb, hfb - hidden) * 1e3))
    path = tmp_path / "scale_model_attention.json"
    path.write_text(json.dumps({"env": {"gpu": "test"}, "args": {"tokens": 4096}, "spreads": lens,
                                "attention": rows}))
    return str(path), rows


def test_measured_validation_with_per_program_work_round_trip(tmp_path):
    """validate_measured on a file timed by a known greedy cost: every call rebuilt, the GPU
    checks exact, the stream and do_bench checks exact with the row's host and within the
    host's scatter with the median host."""
    path, rows = _greedy_file(tmp_path, np.random.default_rng(5))
    out = V.validate_measured(path)
    for cls in ("GQA", "MHA"):
        d = out[cls]
        assert d["cost"].fwd.schedule == "greedy" and d["excluded"] == {} and d["with_work"] == d["rows"]
        for check in ("in_sample", "held_out"):
            for kind in ("fwd GPU", "fwd+bwd GPU", "fwd stream, row's host", "fwd+bwd do_bench, row's host"):
                assert V.summary(d[check][kind], held_only=False)["max_abs_error"] < 0.01, (cls, check, kind)
            for kind in ("fwd stream", "fwd+bwd stream"):
                assert V.summary(d[check][kind], held_only=False)["max_abs_error"] < 0.12, (cls, check, kind)
            # do_bench subtracts the memset from the host: its +-10% scatter grows to ~+-15-20%
            assert V.summary(d[check]["fwd do_bench"], held_only=False)["max_abs_error"] < 0.25


def test_do_bench_hides_its_memset_behind_the_host():
    """do_bench of a host-bound call = host - the 256 MB memset's time; a stream = host."""
    from benchmarks.scale_model import calibrate as C

    p = C.PassCost(0.0, 0.0, 10e-6, 0, 0, floor=300e-6, host_measured=True, schedule="greedy")
    cost = C.AttentionCost(p, replace(p, floor=700e-6), "test", 128, True)
    r = {"heads": 32, "kv_heads": 4, "q_rows": 1024, "keys": 1024, "full_tiles": 1, "partial_tiles": 0,
         "gpu_fwd_ms": 0.01, "host_fwd_us": 250.0, "host_fwd_bwd_us": 950.0, "fwd_ms": 0.2,
         "stream_fwd_ms": 0.3}
    pred = V._predictions(cost, r, hidden=60e-6)
    assert pred["fwd do_bench"] == pytest.approx(300e-6 - 60e-6)
    assert pred["fwd do_bench, row's host"] == pytest.approx(250e-6 - 60e-6)
    assert pred["fwd stream"] == pytest.approx(300e-6) and pred["fwd stream, row's host"] == pytest.approx(250e-6)
    assert pred["fwd+bwd stream"] == pytest.approx(1000e-6)
    assert V.do_bench_hidden() == pytest.approx(256 * 2 ** 20 / 4.3e12)
    assert pred["fwd stream, one sample"] == pred["fwd stream"]
    assert V.measured_ms(r, "stream_fwd_ms", "fwd stream") == r["stream_fwd_ms"]  # no repeats: its one sample


def test_stream_check_takes_the_mean_of_a_rows_samples():
    """``stream`` is measured as the mean of the row's first sample and its repeats, ``stream,
    one sample`` as the first alone (same prediction); the calibration's host per call is the
    median over rows of each row's mean."""
    from benchmarks.scale_model import calibrate as C

    p = C.PassCost(0.0, 0.0, 10e-6, 0, 0, floor=300e-6, host_measured=True, schedule="greedy")
    cost = C.AttentionCost(p, replace(p, floor=700e-6), "test", 128, True)
    r = {"heads": 32, "kv_heads": 4, "q_rows": 1024, "keys": 1024, "full_tiles": 1, "partial_tiles": 0,
         "gpu_fwd_ms": 0.01, "gpu_fwd_bwd_ms": 0.03, "host_fwd_us": 250.0, "host_fwd_bwd_us": 950.0,
         "stream_fwd_ms": 0.5, "stream_fwd_ms_repeats": [0.29, 0.31, 0.9, 0.3],
         "stream_fwd_bwd_ms": 1.0, "stream_fwd_bwd_ms_repeats": [1.0, 1.2]}
    pred = V._predictions(cost, r, hidden=60e-6)
    assert pred["fwd stream, one sample"] == pred["fwd stream"] == pytest.approx(300e-6)
    assert V.measured_ms(r, "stream_fwd_ms", "fwd stream") == pytest.approx(0.46)
    assert V.measured_ms(r, "stream_fwd_bwd_ms", "fwd+bwd stream") == pytest.approx(3.2 / 3)
    assert V.measured_ms(r, "stream_fwd_ms", "fwd stream, one sample") == 0.5
    rows = [{"stream_host_fwd_us": 100.0, "stream_host_fwd_us_repeats": [50.0, 60.0],
             "stream_host_fwd_bwd_us": 500.0},
            {"stream_host_fwd_us": 70.0, "stream_host_fwd_bwd_us": 400.0,
             "stream_host_fwd_bwd_us_repeats": [300.0, 310.0]},
            {"stream_host_fwd_us": 80.0, "stream_host_fwd_bwd_us": 450.0}]
    fwd, bwd, expand = C.measured_host(rows)  # row means: fwd 70, 70, 80; fwd+bwd 500, 336.7, 450
    assert fwd == pytest.approx(70e-6) and bwd == pytest.approx(450e-6 - 70e-6)
    assert expand == C.EXPAND_HOST_S  # no expanded rows: the one launch
    rows[2]["stream_host_fwd_us_repeats"] = [20.0, 20.0, 200.0]  # mean 80, median 20: the mean counts
    assert C.measured_host(rows)[0] == pytest.approx(70e-6)
    rows[0]["stream_host_fwd_us_repeats"] = [140.0, 160.0]  # mean 133.3, median 140
    assert C.measured_host(rows)[0] == pytest.approx(80e-6)


#: Every runtime op class at 3 TB/s.
ALL_3TB = dict.fromkeys(("copy", "small_index", "scatter", "fill"), 3e12)


def _breakdown_file(tmp_path, lens, cp, comm, cost, shift=0.0, bad_work=False, bandwidths=None):
    """A ``cp_single_gpu.py --breakdown`` file for a small plan whose profiled attention kernels
    take exactly the model's time (plus ``shift`` seconds) and whose runtime ops take their
    recorded bytes at ``bandwidths`` (by rate class; default 3 TB/s for all, plus the launch
    floor), one rank with a wrong work record."""
    import flashmask3.masks as M
    from benchmarks.scale_model.layout import document_plan_view
    from benchmarks.scale_model.runtime_ops import ops_seconds, record_layer
    from benchmarks.scale_model.timeline import AttnShape
    from flashmask3.distributed import plan

    shape = AttnShape(4, 2, 64)
    view = document_plan_view(lens, cp, "sparse")
    p = plan(M.causal_document_mask(lens), None, cp, balance="sparse")
    ranks = []
    for r in range(cp):
        kern = V.rank_kernel_seconds(view, r, cost, shape, comm, "stage") + shift
        runtime = ops_seconds(record_layer(p, r, comm, "stage", 4, 2, 64), bandwidths or ALL_3TB, V.LAUNCH_FLOOR)
        ranks.append({"rank": r, "work": view.works[r] + (1 if bad_work and r == 0 else 0),
                      "keys": 0, "seconds": 2 * kern + 1e-3, "host_seconds": 1e-3, "backward_calls": "stage",
                      "breakdown": {"own": [["_fwd_ws_kernel", kern * 1e3], ["_merge_kernel", 0.0]],
                                    "torch_ms": runtime * 1e3, "idle_ms": 0.1,
                                    "busy_ms": (kern + runtime) * 1e3}})
    res = {"args": {"tokens": sum(lens), "heads": 4, "kv_heads": 2, "head_dim": 64},
           "env": {"date": "today", "device": "cuda"}, "lengths": lens,
           "cp": {str(cp): {comm: {"config": f"sparse+{comm}", "balance": "sparse", "comm": comm,
                                   "nodes": 1, "ranks": ranks}}}}
    path = tmp_path / "cp_runtime_breakdown.json"
    path.write_text(json.dumps(res))
    return str(path)


@pytest.mark.parametrize("comm", ["overlap", "allgather"])
def test_cp_runtime_check_compares_kernels_runtime_and_layers_per_rank(tmp_path, comm):
    """Each profiled rank gives a kernels point (the model's GPU time of its attention calls vs
    the profiled attention kernels, the runtime's kernels left out), a runtime point (its
    recorded ops at the bandwidths fitted by rate class: the file's times come back), a busy point and
    layer points; a rank whose recorded work the rebuilt plan does not reproduce is skipped; a
    file without the document lengths gives nothing."""
    from benchmarks.scale_model.calibrate import load_cost

    cost = load_cost("flashmask3", True)
    lens = [1500, 700, 1200, 300, 396]
    path = _breakdown_file(tmp_path, lens, 4, comm, cost, bad_work=True)
    out = V.validate_cp_runtime(path, cost, fit_cp=(4,))
    assert [p.name.split()[-1] for p in out["kernels"]] == ["1", "2", "3"]  # rank 0 skipped
    assert all(abs(p.error) < 1e-9 for p in out["kernels"])
    assert all(abs(p.error) < 1e-6 and not p.held_out for p in out["runtime"] + out["busy"])
    for p in out["layer"] + out["layer_host_model"]:
        assert p.predicted > 0 and not p.held_out
    # nothing to fit: the cluster's bandwidths, all held out; a file at twice those: over-predicted
    fast = {c: 2 * x for c, x in V.Cluster().runtime_bandwidths().items()}
    held = V.validate_cp_runtime(_breakdown_file(tmp_path, lens, 4, comm, cost, bandwidths=fast), cost, fit_cp=())
    assert held["bandwidths"] == V.Cluster().runtime_bandwidths() and all(p.held_out for p in held["runtime"])
    assert all(p.error > 0.01 for p in held["runtime"])
    # another file's fit passed in (cp_ptrr.json's check): used as given, nothing fitted, all held out
    given = V.validate_cp_runtime(_breakdown_file(tmp_path, lens, 4, comm, cost, bandwidths=fast), cost,
                                  bandwidths=fast)
    assert given["bandwidths"] == fast and given["copy_fit_cp"] == ()
    assert all(p.held_out and abs(p.error) < 1e-6 for p in given["runtime"])
    shifted = V.validate_cp_runtime(_breakdown_file(tmp_path, lens, 4, comm, cost, shift=1e-3), cost, fit_cp=(4,))
    assert all(p.error < -0.01 for p in shifted["kernels"])  # slower kernels: an under-prediction
    res = json.loads(open(path).read())
    del res["lengths"]
    (tmp_path / "old.json").write_text(json.dumps(res))
    assert V.validate_cp_runtime(str(tmp_path / "old.json"), cost) == {}


def test_layer_check_pairs_the_median_iteration_with_its_own_host(tmp_path):
    """With every iteration recorded, the layer check takes the iteration whose layer is the
    median and that iteration's host (not the two medians, which may come from different
    iterations); without them, the medians."""
    from benchmarks.scale_model.calibrate import load_cost

    r = {"seconds": 5.0, "host_seconds": 3.5}
    assert V.median_iteration(r) == (5.0, 3.5)
    r["iterations"] = [[5.4, 3.5], [4.8, 1.9], [5.0, 3.6], [4.9, 2.0], [6.0, 4.0]]
    assert V.median_iteration(r) == (5.0, 3.6)
    r["iterations"] = [[5.0, 3.0], [4.0, 2.0]]  # even count: the lower middle one
    assert V.median_iteration(r) == (4.0, 2.0)
    cost = load_cost("flashmask3", True)
    lens = [1500, 700, 1200, 300, 396]
    res = json.loads(open(_breakdown_file(tmp_path, lens, 4, "overlap", cost)).read())
    ranks = res["cp"]["4"]["overlap"]["ranks"]
    for x in ranks:  # the medians' host is 3x the median iteration's own
        x["iterations"] = [[x["seconds"], x["host_seconds"]], [x["seconds"] * 2, x["host_seconds"] * 3],
                           [x["seconds"] * 0.5, x["host_seconds"] * 3]]
    path = tmp_path / "iterations.json"
    path.write_text(json.dumps(res))
    paired = V.validate_cp_runtime(str(path), cost, fit_cp=(4,))
    for x in ranks:
        x["host_seconds"] = x["iterations"][0][1] * 3
        del x["iterations"]
    path.write_text(json.dumps(res))
    medians = V.validate_cp_runtime(str(path), cost, fit_cp=(4,))
    assert [p.measured for p in paired["layer"]] == [p.measured for p in medians["layer"]]
    assert all(a.predicted < b.predicted for a, b in zip(paired["layer"], medians["layer"]))


@pytest.mark.parametrize("comm", ["overlap", "allgather"])
def test_cp_graph_check_compares_the_gpu_only_layer_per_rank(tmp_path, comm):
    """A ``--graph`` file: each replayed rank's point is the model's attention time plus its
    recorded runtime ops at the given bandwidths (no host term) against the replay time, all
    held out; a slower replay is an under-prediction; a rank without a replay or whose work the
    plan does not reproduce is skipped."""
    from benchmarks.scale_model.calibrate import load_cost

    cost = load_cost("flashmask3", True)
    lens = [1500, 700, 1200, 300, 396]
    res = json.loads(open(_breakdown_file(tmp_path, lens, 4, comm, cost, bad_work=True)).read())
    ranks = res["cp"]["4"][comm]["ranks"]
    for r in ranks:
        r["graph_seconds"] = r.pop("breakdown")["busy_ms"] * 1e-3
    del ranks[1]["graph_seconds"]
    path = tmp_path / "cp_graph.json"
    path.write_text(json.dumps(res))
    out = V.validate_cp_graph(str(path), ALL_3TB, cost=cost)
    assert [p.name.split()[-1] for p in out["graph"]] == ["2", "3"]
    assert all(abs(p.error) < 1e-9 and p.held_out for p in out["graph"])
    # the same ranks' eager layers, host per op unscaled: the prediction ignores the file's host
    # time, which only moves the reported ratio of measured to modelled host
    eager = out["eager_host_model"]
    assert [p.name for p in eager] == [p.name for p in out["graph"]]
    assert all(p.measured == r["seconds"] for p, r in zip(eager, ranks[2:])) and out["host_ratio"] > 0
    for r in ranks:
        r["host_seconds"] *= 3
    path.write_text(json.dumps(res))
    slow_host = V.validate_cp_graph(str(path), ALL_3TB, cost=cost)
    assert [p.predicted for p in slow_host["eager_host_model"]] == [p.predicted for p in eager]
    assert slow_host["host_ratio"] == pytest.approx(3 * out["host_ratio"])
    assert list(out["by_config"]) == [f"cp 4 sparse+{comm}"]
    for r in ranks:
        if "graph_seconds" in r:
            r["graph_seconds"] = r["graph_seconds"] * 1.5 + 1e-4
    path.write_text(json.dumps(res))
    assert all(p.error < -0.3 for p in V.validate_cp_graph(str(path), ALL_3TB, cost=cost)["graph"])
    assert V.validate_cp_graph(str(tmp_path / "missing.json"), ALL_3TB, cost=cost) == {}


@pytest.mark.parametrize("gpu,path,fit_cp", [("H200", V.CP_RUNTIME_BREAKDOWN, V.COPY_FIT_CP),
                                              ("H100", V.CP_PTRR, V.PTRR_FIT_CP)])
def test_committed_runtime_fits_are_the_fits_of_the_committed_profiles(gpu, path, fit_cp):
    """params.RUNTIME_FITS (the runtime ops' bandwidths per GPU, the H100's the cluster's default)
    is what the fit gives on the committed profiles of that GPU, to the constants' rounding, and
    the file names that GPU: a new profile or a changed recording fails here until the constants
    follow."""
    from benchmarks.scale_model.params import RUNTIME_FITS, Cluster, runtime_fit_of

    out = V.validate_cp_runtime(path, fit_cp=fit_cp)
    assert gpu in out["env"]["gpu"] and runtime_fit_of(out["env"]["gpu"]) == {
        c: RUNTIME_FITS[gpu][c] for c in out["bandwidths"]}
    for c, x in out["bandwidths"].items():
        assert x == pytest.approx(RUNTIME_FITS[gpu][c], rel=0.01), c
    assert all(p.held_out == (int(p.name.split()[1]) not in fit_cp) for p in out["runtime"])
    if gpu == "H100":  # the paper's cluster runs at the H100's fit
        assert Cluster().runtime_bandwidths() == runtime_fit_of(out["env"]["gpu"])


def test_runtime_fit_of_names_the_gpu_or_raises():
    from benchmarks.scale_model.params import runtime_fit_of

    assert runtime_fit_of("NVIDIA H100 80GB HBM3")["copy"] < runtime_fit_of("NVIDIA H200")["copy"]
    with pytest.raises(ValueError, match="no runtime op bandwidths fitted for GPU 'NVIDIA A100'"):
        runtime_fit_of("NVIDIA A100")


def test_emulated_layer_is_host_or_gpu_bound():
    """The two-resource timeline: a GPU-bound op list ends at the host's first issue plus the GPU
    work; a host-bound one at the host's total plus its last op's GPU time. The host scale
    applies to the ops, not to the engine's hand-off."""
    from benchmarks.scale_model.runtime_ops import Op

    ops = [Op("attention", "forward", stage=0, pass_="fwd"), Op("torch", "stack", 0, pass_="fwd"),
           Op("attention", "backward_stage", stage=0, pass_="bwd")]
    us = V.HOST_US
    host = (us["forward"] + us["torch"] + us["engine"] + us["backward_stage"]) * 1e-6
    layer, h = V.emulated_layer_seconds(ops, [1e-2, 2e-2], ALL_3TB)
    assert h == pytest.approx(host)
    assert layer == pytest.approx(us["forward"] * 1e-6 + 1e-2 + V.LAUNCH_FLOOR + 2e-2)
    # host-bound: every op's host x 10, the engine's hand-off as measured (not scaled)
    layer, h = V.emulated_layer_seconds(ops, [1e-6, 1e-6], ALL_3TB, host_scale=10)
    scaled = 10 * host - 9 * us["engine"] * 1e-6
    assert h == pytest.approx(scaled) and layer == pytest.approx(scaled + 1e-6)
    # the factor that gives a measured host time leaves the hand-off out; a forward alone has none
    assert V.emulated_layer_seconds(ops, [1e-6, 1e-6], ALL_3TB, V.host_scale_of(ops, 2e-3))[1] == pytest.approx(2e-3)
    fwd = ops[:2]
    assert V.host_scale_of(fwd, 1e-3) == pytest.approx(1e-3 / ((us["forward"] + us["torch"]) * 1e-6))


def test_committed_gqa_ab_rebuilds_from_its_shape_set():
    """The committed GQA-split A/B pairs its stage rows with the calls of the committed shape set
    (rebuilt from their document lengths): every measured row gets its grouped and split points.
    (A rerun of ``underfill`` writes its new proposals elsewhere, never over this input.)"""
    points = V.validate_kv_expansion()
    assert points and len(points) % 2 == 0
    assert all(p.measured > 0 and p.predicted > 0 for p in points)


def test_the_cli_cluster_takes_another_gpus_runtime_fit():
    """``--gpu H200`` gives the cluster the H200's fitted runtime-op bandwidths (faster copies than
    the default H100's), names it, and keeps the links; an unknown GPU is a clear error."""
    from types import SimpleNamespace

    from benchmarks.scale_model.commands import _cluster
    from benchmarks.scale_model.params import RUNTIME_FITS, Cluster

    args = SimpleNamespace(gpu="H200", gpus_per_node=None, nvlink_gbs=None, ib_gbs=None)
    h200, h100 = _cluster(args), _cluster(SimpleNamespace(**{**vars(args), "gpu": None}))
    assert h200.runtime_bandwidths() == {c: RUNTIME_FITS["H200"][c] for c in h200.runtime_bandwidths()}
    assert h100.runtime_bandwidths() == Cluster().runtime_bandwidths()
    assert h200.runtime_bandwidths()["copy"] > h100.runtime_bandwidths()["copy"]
    assert h200.name.startswith("H200") and h200.nvlink_bw == h100.nvlink_bw
    with pytest.raises(ValueError, match="gpu must be one of"):
        Cluster().on_gpu("A100")


def test_memory_scaled_moves_only_the_per_query_block_passes():
    """The H100 variant of a cost: the backward's per-query-block term x f, so a call's GPU time
    grows by exactly (f - 1) x a_q x heads x query blocks; forward and tiles untouched; x1 is
    the cost itself. The factor is the ratio of the GPUs' fitted copy bandwidths."""
    from benchmarks.scale_model.calibrate import MEASURED_FILE, load_cost
    from benchmarks.scale_model.layout import TileCounts
    from benchmarks.scale_model.params import RUNTIME_FITS

    cost = load_cost("flashmask3", True)
    assert cost.bwd.a_qblock > 0
    f = V.memory_factor(RUNTIME_FITS["H100"]["copy"])
    assert f == pytest.approx(RUNTIME_FITS["H200"]["copy"] / RUNTIME_FITS["H100"]["copy"])
    assert V.memory_factor(RUNTIME_FITS["H200"]["copy"]) == pytest.approx(1.0)
    assert V.memory_scaled(cost, 1.0) is cost
    slow = V.memory_scaled(cost, f)
    t = TileCounts(3000, 200, 4096, 16384)
    extra = (f - 1) * cost.bwd.a_qblock * 32 * t.q_blocks
    assert slow.gpu_backward(t, 32, 4) == pytest.approx(cost.gpu_backward(t, 32, 4) + extra, rel=1e-12)
    assert slow.gpu_forward(t, 32, 4) == cost.gpu_forward(t, 32, 4)
    assert V.on_file_gpu(cost, {"gpu": "NVIDIA H200"}) is cost
    assert V.on_file_gpu(cost, {"gpu": "some other GPU"}) is cost
    assert V.on_file_gpu(cost, {"gpu": "NVIDIA H100 80GB HBM3"}) == slow
    assert V._calibration_copy_bw(MEASURED_FILE) == RUNTIME_FITS["H200"]["copy"]


def test_transfer_check_predicts_every_h100_call_with_the_h100_cost():
    """The H100 file's calls pair with the calibration's by plan call and heads; every timed H100
    row of each class gets both GPU checks, predicted by the H200 fit on the H100 (memory term
    scaled), and the unscaled fit's points are kept beside them."""
    from benchmarks.scale_model.calibrate import load_cost, measured_rows

    pairs = V.paired_calls()
    timed = [r for gqa in (True, False) for r in measured_rows(V.H100_MEASURED, 128, gqa)[0] if "gpu_fwd_ms" in r]
    # the H100 file re-times the calibration's calls: (nearly) every one of them pairs
    assert len(pairs) >= 0.95 * len(timed) >= 250
    assert all(V._call_key(a) == V._call_key(b) for a, b in pairs)
    t = V.validate_transfer()
    assert len(t["repeated"]) == sum("stream_host_fwd_bwd_us_repeats" in r for r in timed) > 0
    assert "H100" in t["env"]["gpu"]
    for cls, gqa in (("GQA", True), ("MHA", False)):
        rows, env = measured_rows(V.H100_MEASURED, 128, gqa)
        cost = V.on_file_gpu(load_cost("flashmask3", gqa), env)
        pts = t["classes"][cls]["fwd+bwd GPU"]
        assert len(pts) == len(t["classes"][cls]["fwd GPU"]) == len(rows)
        r, p = rows[0], pts[0]
        tiles = V.row_tiles(r)
        assert p.measured == pytest.approx(r["gpu_fwd_bwd_ms"] * 1e-3)
        assert p.predicted == pytest.approx(cost.gpu_forward(tiles, r["heads"], r["kv_heads"])
                                            + cost.gpu_backward(tiles, r["heads"], r["kv_heads"]))
    assert len(t["without_memory_term"]) == sum(len(c["fwd+bwd GPU"]) for c in t["classes"].values())


def test_transfer_streams_take_the_measuring_machines_host():
    """The transfer's `its machine's host` checks predict each stream with the host terms taken
    from that file's own host-relevant calls, the GPU part as for the GPU checks."""
    from benchmarks.scale_model.calibrate import load_cost, measured_host, measured_rows

    t = V.validate_transfer()
    rows, env = measured_rows(V.H100_MEASURED, 128, False)
    fwd, bwd, _ = measured_host(rows)
    cost = V.with_machine_host(V.on_file_gpu(load_cost("flashmask3", False), env), rows)
    assert (cost.fwd.floor, cost.bwd.floor) == (fwd, bwd)
    pts = t["classes"]["MHA"]["fwd+bwd stream, its machine's host"]
    assert len(pts) == sum("stream_fwd_bwd_ms" in r for r in rows)
    r = next(r for r in rows if "stream_fwd_bwd_ms" in r)
    tiles = V.row_tiles(r)
    gpu = cost.gpu_forward(tiles, r["heads"], r["kv_heads"]) + cost.gpu_backward(tiles, r["heads"], r["kv_heads"])
    assert pts[0].predicted == pytest.approx(max(fwd + bwd, gpu))
    assert pts[0].measured == pytest.approx(V.measured_ms(r, "stream_fwd_bwd_ms", "fwd+bwd stream") * 1e-3)
