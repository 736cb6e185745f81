"""Calibration: the fit recovers known costs (round trip), through the measurement file too."""

import json
import random

import pytest

from benchmarks.scale_model import calibrate as C
from benchmarks.scale_model.calibrate import TileCounts
from dataclasses import replace


def _points(rng, a_full, a_part, call, kind):
    pts = []
    for _ in range(40):
        rows = rng.choice([1024, 4096, 16384])
        keys = rng.choice([1024, 8192, 65536])
        t = TileCounts(rng.randint(50, 40000), rng.randint(0, 3000), rows, keys)
        heads = rng.choice([8, 16, 32])
        programs = C._programs(kind, t, heads)
        fill = max(1.0, C.N_SM / programs)
        pts.append((t, heads, call + heads * (a_full * t.full + a_part * t.partial) * fill))
    return pts


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_fit_recovers_known_costs(kind):
    rng = random.Random(7 if kind == "fwd" else 8)
    a_full, a_part, call = rng.uniform(10e-9, 60e-9), rng.uniform(20e-9, 90e-9), rng.uniform(5e-6, 80e-6)
    fit = C.fit_pass(_points(rng, a_full, a_part, call, kind), kind)
    assert fit.a_full == pytest.approx(a_full, rel=1e-6)
    assert fit.a_partial == pytest.approx(a_part, rel=1e-6)
    assert fit.call == pytest.approx(call, rel=1e-5)
    assert fit.rms_rel_err < 1e-6


def test_fit_with_fixed_call_and_noise():
    rng = random.Random(3)
    pts = [(t, h, s * rng.uniform(0.97, 1.03)) for t, h, s in _points(rng, 20e-9, 30e-9, 20e-6, "fwd")]
    fit = C.fit_pass(pts, "fwd", call=20e-6)
    assert fit.call == 20e-6
    assert fit.a_full == pytest.approx(20e-9, rel=0.1)
    assert 0 < fit.rms_rel_err < 0.05


def test_fit_recovers_a_host_bound_floor():
    """Calls below a floor take the floor (host-bound); the fit finds it and the linear part."""
    rng = random.Random(5)
    truth = C.PassCost(12e-9, 40e-9, 100e-6, 0, 0, floor=0.5e-3)
    pts = []
    for _ in range(120):
        t = TileCounts(int(10 ** rng.uniform(0, 4.3)), rng.randint(0, 300), 4096, rng.choice([2048, 16384]))
        pts.append((t, 32, truth.seconds(t, 32, C._programs("fwd", t, 32)) * rng.uniform(0.97, 1.03)))
    assert sum(s <= 0.52e-3 for _, _, s in pts) >= 20  # the floor is really sampled
    fit = C.fit_pass(pts, "fwd", floor=True)
    assert fit.floor == pytest.approx(0.5e-3, rel=0.1)
    assert fit.a_full == pytest.approx(12e-9, rel=0.1)
    assert fit.rms_rel_err < 0.05
    linear = C.fit_pass(pts, "fwd")
    assert linear.floor == 0.0 and linear.rms_rel_err > fit.rms_rel_err


def test_fit_from_the_measurement_file_round_trip(tmp_path):
    """measure.py's json format -> fit_from_measured -> the costs that generated it."""
    rng = random.Random(11)
    rows = []
    for _ in range(30):
        q_rows, keys = rng.choice([1024, 8192]), rng.choice([2048, 32768])
        full, part = rng.randint(100, 20000), rng.randint(0, 2000)
        t = TileCounts(full, part, q_rows, keys)
        fwd = C.PassCost(15e-9, 25e-9, 30e-6, 0, 0).seconds(t, 32, C._programs("fwd", t, 32))
        bwd = C.PassCost(40e-9, 45e-9, 60e-6, 0, 0).seconds(t, 32, C._programs("bwd", t, 32))
        rows.append({"head_dim": 128, "heads": 32, "kv_heads": 4, "q_rows": q_rows, "keys": keys,
                     "full_tiles": full, "partial_tiles": part, "fwd_ms": fwd * 1e3,
                     "fwd_bwd_ms": (fwd + bwd) * 1e3})
    rows.append({"head_dim": 128, "heads": 32, "kv_heads": 4, "q_rows": 1024, "keys": 1024,
                 "full_tiles": 1, "partial_tiles": 0, "error": "failed shape"})  # skipped
    path = tmp_path / "scale_model_attention.json"
    path.write_text(json.dumps({"env": {"gpu": "test", "date": "now"}, "attention": rows}))
    cost = C.fit_from_measured(str(path), 128, True)
    assert cost.source.startswith("measured")
    assert cost.fwd.a_full == pytest.approx(15e-9, rel=1e-4) and cost.fwd.call == pytest.approx(30e-6, rel=1e-3)
    assert cost.bwd.a_partial == pytest.approx(45e-9, rel=1e-4) and cost.bwd.call == pytest.approx(60e-6, rel=1e-3)
    t = TileCounts(5000, 300, 4096, 16384)
    assert cost.forward(t, 32) == pytest.approx(C.PassCost(15e-9, 25e-9, 30e-6, 0, 0).seconds(t, 32, 4096 // 128 * 32))


def test_fit_without_points_is_a_clear_error():
    with pytest.raises(ValueError, match="no fwd points"):
        C.fit_pass([], "fwd")


def test_tile_counts_of_a_causal_mask():
    t = C.tile_counts(None, True, 1024, 1024)  # 8x8 blocks: 8 diagonal partial, 28 full
    assert (t.full, t.partial) == (28, 8)


def test_cached_calibration_loads_every_family():
    for name in C.FITS:
        cost = C.load_cost(name, True)
        assert cost.fwd.a_full > 0 and cost.bwd.a_full > 0 and cost.head_dim == 128


def test_matmul_throughput_uses_the_nearest_measured_shape(tmp_path, monkeypatch):
    from benchmarks.scale_model.params import Cluster

    path = tmp_path / "mm.json"
    path.write_text(json.dumps({"matmul": [{"key": "1024x4096x2048", "tflops": 400.0},
                                           {"key": "8192x4096x2048", "tflops": 600.0},
                                           {"key": "8192x4096x14336", "tflops": 700.0}]}))
    monkeypatch.setattr(C, "MATMUL_FILE", str(path))
    assert C.matmul_tflops(Cluster(), "6000x4096x2048")[0] == 600.0
    assert C.matmul_tflops(Cluster(), "1500x4096x2048")[0] == 400.0
    assert C.matmul_tflops(Cluster(), "100x4096x14336")[0] == 700.0
    tf, src = C.matmul_tflops(Cluster(), "100x8192x1000")  # no such dims: ceiling x efficiency
    assert tf == Cluster().matmul_tflops.value * Cluster().matmul_efficiency.value and "assumed" in src
    # the sensitivity sweep's matmul_efficiency moves a measured throughput too (x0.5: half)
    half, src = C.matmul_tflops(Cluster().swept("matmul_efficiency", 0.5), "6000x4096x2048")
    assert half == 300.0 and "x0.5" in src


def test_fit_recovers_per_block_costs():
    """GPU times built from tile and per-query/key-block costs: the fit with blocks finds them."""
    rng = random.Random(13)
    truth = C.PassCost(15e-9, 40e-9, 20e-6, 0, 0, a_qblock=200e-9, a_kblock=30e-9)
    pts = []
    for _ in range(60):
        t = TileCounts(rng.randint(50, 30000), rng.randint(0, 2000), rng.choice([1024, 4096, 16384]),
                       rng.choice([2048, 16384, 65536]))
        h = rng.choice([16, 32])
        pts.append((t, h, truth.gpu_seconds(t, h, C._programs("bwd", t, h))))
    fit = C.fit_pass(pts, "bwd", blocks=True)
    assert fit.a_qblock == pytest.approx(200e-9, rel=1e-4) and fit.a_kblock == pytest.approx(30e-9, rel=1e-3)
    assert fit.a_full == pytest.approx(15e-9, rel=1e-4) and fit.rms_rel_err < 1e-6
    assert C.fit_pass(pts, "bwd").rms_rel_err > 1e-3  # without the block terms it cannot fit them


def _gpu_host_rows(rng, host_fwd_us, host_fb_us):
    fwd_c = C.PassCost(15e-9, 25e-9, 30e-6, 0, 0, a_qblock=20e-9)
    bwd_c = C.PassCost(40e-9, 45e-9, 60e-6, 0, 0, a_qblock=150e-9)
    rows = []
    for _ in range(40):
        q_rows, keys = rng.choice([1024, 8192]), rng.choice([2048, 32768])
        t = TileCounts(int(10 ** rng.uniform(0.5, 4.3)), rng.randint(0, 200), q_rows, keys)
        g_f = fwd_c.gpu_seconds(t, 32, C._programs("fwd", t, 32))
        g_b = bwd_c.gpu_seconds(t, 32, C._programs("bwd", t, 32))
        hf = host_fwd_us * rng.uniform(0.9, 1.1)
        hfb = host_fb_us * rng.uniform(0.9, 1.1)
        rows.append({"head_dim": 128, "heads": 32, "kv_heads": 4, "q_rows": q_rows, "keys": keys,
                     "full_tiles": t.full, "partial_tiles": t.partial,
                     "gpu_fwd_ms": g_f * 1e3, "gpu_fwd_bwd_ms": (g_f + g_b) * 1e3,
                     "host_fwd_us": hf, "host_fwd_bwd_us": hfb,
                     "fwd_ms": max(hf * 1e-3, g_f * 1e3), "fwd_bwd_ms": max(hfb * 1e-3, (g_f + g_b) * 1e3)})
    return rows, fwd_c, bwd_c


def _host_row(fwd: float, fwd_bwd: float, expanded: bool = False, repeats: bool = True) -> dict:
    row = {"stream_host_fwd_us": fwd, "stream_host_fwd_bwd_us": fwd_bwd, "kv_expanded": expanded}
    if repeats:  # a host-relevant call: measure.repeat_streams sampled it again
        row["stream_host_fwd_us_repeats"], row["stream_host_fwd_bwd_us_repeats"] = [fwd], [fwd_bwd]
    return row


def test_measured_host_from_host_relevant_rows_and_expansion():
    """The host terms come from the host-relevant rows (those with repeats) once there are
    MIN_HOST_ROWS of them: a GPU-bound stream's slower host is left out. The backward is the
    grouped calls' median, and an expanded GQA backward adds the measured difference of the
    medians once both sides have MIN_EXPAND_ROWS rows (else EXPAND_HOST_S)."""
    rng = random.Random(5)
    n_rel = C.MIN_HOST_ROWS
    relevant = [_host_row(60.0 + rng.uniform(-2, 2), 400.0 + rng.uniform(-5, 5)) for _ in range(n_rel)]
    gpu_bound = [_host_row(90.0, 700.0, repeats=False) for _ in range(3 * n_rel)]
    fwd, bwd, expand = C.measured_host(relevant + gpu_bound)
    assert 58e-6 < fwd < 62e-6 and 330e-6 < bwd < 350e-6 and expand == C.EXPAND_HOST_S
    # too few host-relevant rows (an older file): every row counts, so the GPU-bound ones dominate
    assert C.measured_host(relevant[:n_rel - 1] + gpu_bound)[0] == pytest.approx(90e-6)
    expanded = [_host_row(60.0, 470.0 + rng.uniform(-5, 5), expanded=True) for _ in range(C.MIN_EXPAND_ROWS)]
    fwd, bwd, expand = C.measured_host(relevant + expanded + gpu_bound)
    assert 330e-6 < bwd < 350e-6  # still the grouped calls' backward
    assert 60e-6 < expand < 80e-6  # ~470 - ~400 us
    # one expanded row short: the median of all rows and the one launch
    _, bwd_all, expand = C.measured_host(relevant + expanded[1:] + gpu_bound)
    assert expand == C.EXPAND_HOST_S and bwd_all > bwd


def test_fit_on_gpu_time_with_measured_host():
    """Rows with GPU and host times: the GPU part is fitted on the GPU time (exact here, although
    most do_bench times are host-bound), the host term is the rows' median host time."""
    rows, fwd_c, bwd_c = _gpu_host_rows(random.Random(17), 300.0, 1400.0)
    assert sum(r["fwd_ms"] == r["host_fwd_us"] * 1e-3 for r in rows) > 10  # host-bound calls exist
    cost = C.fit_rows(rows, "test", 128, True)
    assert cost.fwd.host_measured and cost.fwd.fitted_on == "gpu"
    assert cost.fwd.a_full == pytest.approx(15e-9, rel=1e-4) and cost.bwd.a_qblock == pytest.approx(150e-9, rel=1e-3)
    hf, hb, he = C.measured_host(rows)
    assert cost.fwd.floor == hf and cost.bwd.floor == hb and cost.bwd.expand_host == he
    assert 250e-6 < hf < 350e-6 and 1000e-6 < hb < 1250e-6
    t = TileCounts(5000, 300, 4096, 16384)
    assert cost.gpu_forward(t, 32) == pytest.approx(fwd_c.gpu_seconds(t, 32, C._programs("fwd", t, 32)), rel=1e-4)
    assert cost.forward(t, 32) == pytest.approx(max(hf, cost.gpu_forward(t, 32)))
    # forced onto the do_bench times instead, the host term comes out as a fitted floor
    floored = C.fit_rows(rows, "test", 128, True, use_gpu_times=False)
    assert not floored.fwd.host_measured and floored.fwd.floor > 0


def test_with_host_replaces_only_the_host_term():
    rows, _, _ = _gpu_host_rows(random.Random(19), 300.0, 1400.0)
    cost = C.fit_rows(rows, "test", 128, True)
    zero = C.with_host(cost, 0.0, 0.0, "zero")
    t = TileCounts(50, 0, 1024, 2048)  # a small call: host-bound with the measured host
    assert cost.forward(t, 32) == cost.fwd.floor > zero.forward(t, 32) == pytest.approx(cost.gpu_forward(t, 32))
    assert zero.fwd.a_full == cost.fwd.a_full and "zero" in zero.source


# -- per-program work and the greedy schedule (session 19) ----------------------------------------

import numpy as np  # noqa: E402


def test_greedy_makespan_follows_the_launch_order():
    """Two SMs: [3, 1, 1] -> the long program first, the two short ones share the other SM
    (3); [1, 1, 3] -> the long one starts after a short one (4). Few programs: the longest."""
    assert C.greedy_makespan(np.array([3.0, 1.0, 1.0]), 1, slots=2) == 3.0
    assert C.greedy_makespan(np.array([1.0, 1.0, 3.0]), 1, slots=2) == 4.0
    assert C.greedy_makespan(np.array([1.0, 2.0]), 3, slots=6) == 2.0  # 6 programs, 6 SMs
    assert C.greedy_makespan(np.array([1.0]), 264, slots=132) == 2.0  # two full waves
    f = np.array([[1.0, 3.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    crit = C.critical_features(f, np.array([0.0, 1.0, 0.0]), 1, slots=2)
    assert list(crit) == [1.0, 3.0, 0.0]  # the SM of the long program finishes last


def test_program_work_of_a_document_mask():
    """Per-program tiles: forward per 128-row query block (128x128), backward per 128-key block
    (64x128 tiles); the forward's blocks add up to the call's tile totals."""
    import flashmask3.masks as M

    m = M.causal_document_mask([256, 768])  # 1024 tokens: 8 query blocks, 8 key blocks
    w = C.program_work(m.startend_row_indices, True, 1024, 1024)
    t = C.tile_counts(m.startend_row_indices, True, 1024, 1024)
    assert w.totals() == (t.full, t.partial)
    assert list(w.fwd_full + w.fwd_partial) == [1, 2, 1, 2, 3, 4, 5, 6]  # docs of 2 and 6 blocks
    # backward: key block 2 (first of the 6-block document) is seen by 12 query blocks of 64 rows
    assert (w.bwd_full + w.bwd_partial)[2] == 12 and len(w.bwd_full) == 8


def _greedy_points(rng, truth, kind, n=50):
    import flashmask3.masks as M

    pts = []
    for _ in range(n):
        docs = [rng.choice([100, 300, 650, 1000, 2000, 4100]) for _ in range(rng.randint(1, 12))]
        s = sum(docs)
        s += (-s) % 128
        docs[-1] += s - sum(docs)
        m = M.causal_document_mask(docs)
        w = C.program_work(m.startend_row_indices, True, s, s)
        f, p = w.totals()
        t = TileCounts(f, p, s, s, work=w, kv_expanded=False)  # (as the measured calls ran)
        h, hk = rng.choice([(32, 4), (16, 16), (8, 8)])
        pts.append((t, h, hk, truth.gpu_time(t, kind, h, hk)))
    return pts


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_greedy_fit_recovers_known_costs(kind):
    """GPU times made by the greedy schedule itself: the fit (reschedule, refit) finds them."""
    rng = random.Random(23 if kind == "fwd" else 29)
    truth = C.PassCost(1.6e-6, 2.8e-6, 10e-6, 0, 0, a_qblock=40e-9 if kind == "bwd" else 0.0,
                       a_program=6e-6, schedule="greedy")
    fit = C.fit_pass_greedy(_greedy_points(rng, truth, kind), kind, host=200e-6)
    assert fit.schedule == "greedy" and fit.floor == 200e-6 and fit.host_measured
    assert fit.rms_rel_err < 1e-3
    assert fit.a_full == pytest.approx(1.6e-6, rel=0.02) and fit.a_program == pytest.approx(6e-6, rel=0.05)
    assert fit.a_partial == pytest.approx(2.8e-6, rel=0.05) and fit.call == pytest.approx(10e-6, rel=0.1)
    # the fill model cannot reproduce these times (few programs, uneven documents)
    fill = C.fit_pass([(t, h, s) for t, h, _, s in _greedy_points(random.Random(1), truth, kind)], kind,
                      blocks=True)
    assert fill.rms_rel_err > 10 * fit.rms_rel_err


def test_backward_programs_are_per_kv_head():
    """GQA 8:1 backward: 4 KV-head programs each loop over 8 query heads, so a call with one
    live key block takes 8x the per-head work on one SM, not 1/32 of a 32-head total."""
    w = C.ProgramWork(np.array([1]), np.array([0]), np.array([10, 0]), np.array([0, 0]))
    t = TileCounts(1, 0, 128, 256, work=w, kv_expanded=False)
    cost = C.PassCost(1e-6, 1e-6, 0.0, 0, 0, a_program=0.0, schedule="greedy")
    assert cost.gpu_time(t, "bwd", 32, 4) == pytest.approx(8 * 10 * 1e-6)
    assert cost.gpu_time(t, "bwd", 16, 16) == pytest.approx(10 * 1e-6)


def test_the_expanded_gqa_backward_runs_one_program_per_query_head():
    """Where the library expands K/V (dispatch.kv_expansion: 8 grouped programs of 8 heads on
    132 SMs), the model runs 64 programs of one head each, plus the copies' bytes; the host
    pays the copies' launches. A call recorded as grouped stays grouped."""
    from flashmask3.kernels.dispatch import kv_expansion

    assert kv_expansion(8, 8, C.N_SM) and not kv_expansion(8, 1, C.N_SM)
    w = C.ProgramWork(np.array([1]), np.array([0]), np.array([10, 0]), np.array([0, 0]))
    t = TileCounts(1, 0, 128, 256, work=w)  # kv_expanded None: as the library decides
    cost = C.PassCost(1e-6, 1e-6, 0.0, 0, 0, a_program=0.0, schedule="greedy", floor=100e-6)
    copies = 256 * 32 * C.EXPAND_BYTES_PER_KEY_HEAD / C.HBM_BYTES_S
    assert cost.gpu_time(t, "bwd", 32, 4) == pytest.approx(10e-6 + copies)
    assert cost.time(t, "bwd", 32, 4) == pytest.approx(100e-6 + C.EXPAND_HOST_S)
    assert replace(cost, expand_host=50e-6).time(t, "bwd", 32, 4) == pytest.approx(150e-6)  # a fitted one
    assert cost.time(t, "fwd", 32, 4) == pytest.approx(100e-6)  # the forward is not expanded
    grouped = TileCounts(1, 0, 128, 256, work=w, kv_expanded=False)
    assert cost.gpu_time(grouped, "bwd", 32, 4) == pytest.approx(80e-6)


def test_rows_that_cannot_be_rebuilt_are_left_without_work(tmp_path):
    """attach_program_work rebuilds a measured call from its plan and keeps it only when the tile
    totals match the row's: a changed count (another planner, another corpus) is excluded."""
    from benchmarks.corpus import document_spreads
    from benchmarks.scale_model.measure import plan_calls

    lens = document_spreads(4096, seed=0)["long"]
    rows = []
    for meta, fm, keys in plan_calls(lens, "long", 4, "sparse"):
        t = C.tile_counts(fm.startend_row_indices, False, fm.seqlen_q, keys)
        rows.append(dict(meta, q_rows=fm.seqlen_q, keys=keys, full_tiles=t.full, partial_tiles=t.partial))
    rows[0]["full_tiles"] += 1
    rows.append(dict(rows[1], spread="nowhere"))
    C.attach_program_work(rows, {"args": {"tokens": 4096}, "spreads": {"long": lens}})
    assert rows[0]["_work"] is None and rows[-1]["_work"] is None
    assert all(r["_work"] is not None for r in rows[1:-1])
    n, missing = C.work_summary(rows)
    assert n == len(rows) - 2 and missing == {"long": 1, "nowhere": 1}


def test_filled_spreads_the_programs_over_every_sm():
    """The attribution's "no SM underfill": total program work / SMs instead of the makespan."""
    w = C.ProgramWork(np.array([100, 0, 0]), np.array([0, 0, 0]), np.array([1]), np.array([0]))
    t = TileCounts(100, 0, 384, 128, work=w)
    p = C.PassCost(1e-6, 1e-6, 5e-6, 0, 0, a_program=2e-6, schedule="greedy")
    cost = C.AttentionCost(p, p, "test", 128, False)
    assert cost.gpu_forward(t, 1) == pytest.approx(5e-6 + 102e-6)  # one SM runs the 100-tile program
    f = C.filled(cost)
    assert f.gpu_forward(t, 1) == pytest.approx(5e-6 + (100e-6 + 3 * 2e-6) / C.SLOTS)
    fill_model = C.AttentionCost(C.PassCost(1e-9, 1e-9, 0, 0, 0), C.PassCost(1e-9, 1e-9, 0, 0, 0), "x", 128, False)
    assert C.filled(fill_model) is fill_model  # only the per-program model has programs to spread


# -- kernel variants the model predicts (issue 23's underfill levers) --------------------------------


def test_gqa_expansion_rules_at_their_boundaries():
    """GQA 8:1 on 132 SMs: the library expands up to 115 grouped programs (fewer than 8 waves of
    one head), then, up to 4 grouped waves, where the expanded grid needs fewer waves than 8 x
    the grouped one's (200: 13 < 16; 264: 16, not fewer; 500: 31 < 32; 600 programs: 5 waves, never);
    lt_group only within one wave, waves also past 4 grouped waves."""
    from flashmask3.kernels.dispatch import KV_EXPANSION_MAX_WAVES, kv_expansion

    assert KV_EXPANSION_MAX_WAVES == 4
    assert kv_expansion(115, 8, 132) and not kv_expansion(116, 8, 132)
    assert kv_expansion(200, 8, 132) and not kv_expansion(264, 8, 132)
    assert kv_expansion(500, 8, 132) and not kv_expansion(600, 8, 132)
    lt, wv = C.KV_RULES["lt_group"], C.KV_RULES["waves"]
    assert lt(115, 8, 132) and not lt(116, 8, 132) and not lt(200, 8, 132)
    assert all(wv(p, 8, 132) == lt(p, 8, 132) == kv_expansion(p, 8, 132) for p in range(1, 133))
    assert all(kv_expansion(p, 8, 132) == wv(p, 8, 132) for p in range(1, 4 * 132 + 1))
    assert wv(200, 8, 132) and not wv(264, 8, 132) and not wv(100, 1, 132) and not kv_expansion(100, 1, 132)
    assert wv(600, 8, 132)  # (the uncapped rule: 5 waves, 37 < 40)


def _bwd_call(key_blocks, tiles_each=10):
    w = C.ProgramWork(np.array([1]), np.array([0]), np.full(key_blocks, tiles_each), np.zeros(key_blocks, int))
    return TileCounts(1, 0, 128, 128 * key_blocks, work=w)


def test_the_rule_and_the_expansion_factor_reach_the_backward_grid():
    """28 key blocks x 4 KV heads = 112 grouped programs: 'never' keeps them grouped (one wave of
    8 heads each), the library, lt_group and waves expand (896 one-head programs: 7 waves, fewer
    than 8); a forced factor of 2 runs 224 programs of 4 heads (2 waves), the copies scale with
    the factor."""
    t = _bwd_call(28)
    cost = C.PassCost(1e-6, 1e-6, 0.0, 0, 0, a_program=0.0, schedule="greedy")
    never = replace(cost, kv_rule="never")
    assert never.bwd_factor(t, 32, 4) == 1 and never.gpu_time(t, "bwd", 32, 4) == pytest.approx(8 * 10e-6)
    for rule in ("library", "lt_group", "waves"):
        assert replace(cost, kv_rule=rule).bwd_factor(t, 32, 4) == 8
    full, _, group, sweeps = C.program_grid(t, "bwd", 32, 4, factor=2)
    assert (group, sweeps * len(full)) == (4, 224)
    copies = lambda e: t.keys * 4 * e * C.EXPAND_BYTES_PER_KEY_HEAD / C.HBM_BYTES_S  # noqa: E731
    assert cost.gpu_time(t, "bwd", 32, 4, factor=2) == pytest.approx(2 * 4 * 10e-6 + copies(2))
    assert replace(cost, kv_rule="waves").gpu_time(t, "bwd", 32, 4) == pytest.approx(7 * 10e-6 + copies(8))
    assert copies(8) == pytest.approx(t.keys * 32 * C.EXPAND_BYTES_PER_KEY_HEAD / C.HBM_BYTES_S)
    with pytest.raises(ValueError, match="divide"):
        C.program_grid(t, "bwd", 32, 4, factor=3)


def test_best_and_split_pick_the_cheapest_grid():
    """'best' takes grouped or expanded, whichever this cost predicts faster (host launches of the
    copies included); 'split' any divisor of the group, never slower than 'best'."""
    cost = C.PassCost(1e-6, 1e-6, 0.0, 0, 0, a_program=5e-6, schedule="greedy", floor=50e-6)
    for kb in (4, 29, 40, 200):
        t = _bwd_call(kb)
        times = {e: cost.time(t, "bwd", 32, 4, factor=e) for e in (1, 2, 4, 8)}
        best = replace(cost, kv_rule="best").bwd_factor(t, 32, 4)
        split = replace(cost, kv_rule="split").bwd_factor(t, 32, 4)
        assert times[best] == min(times[1], times[8]) and times[split] == min(times.values())
    assert replace(cost, kv_rule="best").bwd_factor(_bwd_call(1), 32, 32) == 1  # MHA: nothing to expand


def test_longest_first_order_removes_the_late_long_program():
    """132 one-tile programs then a ten-tile one: in launch order the long one starts when the
    first SM frees (1 + 10); longest first it starts at once (10). 'filled': the total / SMs."""
    w = C.ProgramWork(np.array([1] * 132 + [10]), np.zeros(133, int), np.array([1]), np.array([0]))
    t = TileCounts(142, 0, 128 * 133, 128, work=w)
    cost = C.PassCost(1.0, 1.0, 0.0, 0, 0, a_program=0.0, schedule="greedy")
    assert cost.gpu_time(t, "fwd", 1, 1) == pytest.approx(11.0)
    assert replace(cost, order="longest").gpu_time(t, "fwd", 1, 1) == pytest.approx(10.0)
    assert C.filled(C.AttentionCost(cost, cost, "t", 128, False)).fwd.gpu_time(t, "fwd", 1, 1) == \
        pytest.approx(142 / 132)


def test_variant_sets_the_rule_and_order_of_a_greedy_cost():
    p = C.PassCost(1e-6, 1e-6, 0.0, 0, 0, schedule="greedy")
    cost = C.AttentionCost(p, p, "fit", 128, True)
    v = C.variant(cost, kv_rule="waves", order="longest")
    assert (v.fwd.order, v.bwd.order, v.bwd.kv_rule, v.fwd.kv_rule) == ("longest", "longest", "waves", "library")
    assert C.variant(cost) is cost
    with pytest.raises(ValueError, match="kv_rule"):
        C.variant(cost, kv_rule="sometimes")
    fill = C.AttentionCost(replace(p, schedule="fill"), replace(p, schedule="fill"), "tables", 128, True)
    assert C.variant(fill, order="longest") is fill  # no programs to reorder


def test_greedy_fit_norm_trades_mean_for_worst_error():
    """Noisy times (+-12% scatter, every 9th call 25% slow): the fit over several norms has a
    smaller worst relative error than least squares alone; a norm below 2 is refused."""
    rng = random.Random(31)
    truth = C.PassCost(1.6e-6, 2.8e-6, 10e-6, 0, 0, a_program=6e-6, schedule="greedy")
    pts = [(t, h, hk, s * (1 + rng.uniform(-0.12, 0.12)) * (1.25 if i % 9 == 0 else 1.0))
           for i, (t, h, hk, s) in enumerate(_greedy_points(rng, truth, "fwd"))]

    def worst(fit):
        return max(abs(fit.gpu_time(t, "fwd", h, hk) / s - 1) for t, h, hk, s in pts)

    lsq, lp = C.fit_pass_greedy(pts, "fwd", 0.0, norms=(2.0,)), C.fit_pass_greedy(pts, "fwd", 0.0)
    assert worst(lp) < worst(lsq) - 0.01
    with pytest.raises(ValueError, match="norms must be"):
        C.fit_pass_greedy(pts, "fwd", 0.0, norms=(1.0,))


def test_between_interpolates_every_fitted_term_in_log2_group():
    """A group between the MHA fit (1) and the GQA fit's group takes each fitted term linear in
    log2(group); the ends and anything beyond the GQA fit's group are the fits themselves."""
    rng = random.Random(3)

    def fit(scale: float) -> C.PassCost:
        return C.PassCost(**{f: scale * rng.uniform(0.5, 2.0) * 1e-6 for f in C.FITTED_TERMS},
                          rms_rel_err=0.0, points=1, schedule="greedy")

    mha = C.AttentionCost(fit(1.0), fit(1.0), "mha", 128, False)
    gqa = C.AttentionCost(fit(3.0), fit(3.0), "gqa", 128, True, group=8)
    assert C.between(mha, gqa, 1) is mha and C.between(mha, gqa, 8) is gqa and C.between(mha, gqa, 16) is gqa
    mid = C.between(mha, gqa, 2)  # log2(2) / log2(8) = 1/3 of the way
    assert mid.group == 2 and mid.gqa and mid.interpolated and "interpolated to 2:1" in mid.source
    assert not (mha.interpolated or gqa.interpolated)
    for part in ("fwd", "bwd"):
        a, b, m = getattr(mha, part), getattr(gqa, part), getattr(mid, part)
        for f in C.FITTED_TERMS:
            assert getattr(m, f) == pytest.approx(getattr(a, f) * 2 / 3 + getattr(b, f) / 3)
        assert m.schedule == b.schedule and m.kv_rule == b.kv_rule
    four = C.between(mha, gqa, 4)
    assert four.fwd.a_full == pytest.approx(mha.fwd.a_full / 3 + gqa.fwd.a_full * 2 / 3)


def test_cost_for_picks_the_fit_by_group_and_rejects_bad_heads():
    """cost_for: group 1 -> the MHA fit, the GQA fit's group -> the GQA fit, between -> the
    interpolation; heads that are not a multiple of kv_heads are a ValueError."""
    mha, gqa = C.load_cost("flashmask3", False), C.load_cost("flashmask3", True)
    assert gqa.group == 8  # the measured calibration is 32/4
    assert C.cost_for("flashmask3", 16, 16) == mha and C.cost_for("flashmask3", 32, 4) == gqa
    assert C.cost_for("flashmask3", 16, 8) == C.between(mha, gqa, 2)
    for heads, kv in ((16, 3), (0, 1), (8, 0)):
        with pytest.raises(ValueError, match="kv_heads"):
            C.cost_for("flashmask3", heads, kv)
