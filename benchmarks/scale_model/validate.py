"""The model's error on what was measured (predictions vs committed measurements).

Two committed measurements, both taken on 2026-11-29 ~13:00-13:30 with the kernel of that
day (v2 forward + v1 backward, commit 234a020; the kernels are much faster now):

* ``cp_single_gpu.json`` -- every rank's local attention fwd+bwd (one call over its needed keys,
  as ``comm="allgather"`` computes it) at cp 8, 128K tokens, one H200: 64 points;
* ``cp_multigpu.json`` -- attention fwd+bwd on 2 H200s (NVLink) for the corpus mask: 3
  flashmask3 methods + FlexAttention CP.

Two calibrations are checked:

``tables``   the old kernel's full-sequence kernel tables only (no per-rank data): a transfer test;
``per-rank`` the table fit scaled by a factor ``k`` plus a per-call cost ``c`` fitted on the
             dual_chunk ranks of ``cp_single_gpu.json`` only; the sparse ranks and the 2-GPU
             run are held out.

``validate_multigpu(path)`` takes any result file in the ``cp_multigpu.json`` format.

The current kernels' calibration is checked on its own measurements (``validate_measured``), on
the same calls timed on an H100 (``validate_transfer``), and against the CP runtime on one GPU
(``validate_cp_runtime``, ``validate_cp_graph``); a file from another GPU is predicted with the
cost on that GPU (``on_file_gpu``: the memory-bound passes at its copy bandwidth).
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .calibrate import (MATMUL_FILE, MEASURED_FILE, RESULTS, AttentionCost, TileCounts, cost_for, fit_rows, load_cost,
                        measured_host, measured_rows, row_tiles, sample_mean, work_summary)
from .layout import PlanView, RoundView, document_plan, document_plan_view, file_tolerance, mask_sparsity
from .params import Cluster, Param, Runtime, runtime_fit_of
from .runtime_ops import MERGED, RATE_CLASSES, bytes_by_rate, op_seconds, ops_seconds
from .timeline import AttnShape, backward_calls_of, merge_calls, simulate_layer

SINGLE = os.path.join(RESULTS, "cp_single_gpu.json")
MULTI = os.path.join(RESULTS, "cp_multigpu.json")
#: The 2-GPU run: two H200s of one host over NVLink (same link figures as H100).
TWO_H200 = Cluster(name="2x H200 SXM, NVLink", gpus_per_node=8)
TARGET = 0.15


@dataclass
class Point:
    name: str
    measured: float
    predicted: float
    held_out: bool = True
    note: str = ""

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


# -- calibration variants -------------------------------------------------------------------------


def scaled_cost(cost: AttentionCost, k: float, call_fwd: float, call_bwd: float, label: str) -> AttentionCost:
    """``cost`` with per-tile costs x ``k`` and per-call costs replaced."""
    f = replace(cost.fwd, a_full=cost.fwd.a_full * k, a_partial=cost.fwd.a_partial * k, call=call_fwd)
    b = replace(cost.bwd, a_full=cost.bwd.a_full * k, a_partial=cost.bwd.a_partial * k, call=call_bwd)
    return AttentionCost(f, b, label, cost.head_dim, cost.gqa)


def memory_scaled(cost: AttentionCost, f: float) -> AttentionCost:
    """``cost`` with its per-query-block terms x ``f``: the backward's whole-GPU passes over the
    query rows (delta pre-pass, dQ zeroing and scaling) move a few bytes per FLOP, so they run at
    the GPU's memory bandwidth, not its tensor-core speed. ``f`` = the calibration GPU's copy
    bandwidth over the target GPU's (:func:`memory_factor`); 1 leaves ``cost`` as it is."""
    if f == 1.0:
        return cost
    return replace(cost, fwd=replace(cost.fwd, a_qblock=cost.fwd.a_qblock * f),
                   bwd=replace(cost.bwd, a_qblock=cost.bwd.a_qblock * f),
                   source=f"{cost.source}; per-query-block passes x{f:.3f} (memory bandwidth)")


def memory_factor(copy_bw: float, path: str = MEASURED_FILE) -> float:
    """How much slower memory-bound kernel work runs on a GPU whose copies run at ``copy_bw``
    bytes/s than on the GPU the kernel calibration was measured on (``path``'s GPU): the ratio
    of the two GPUs' fitted copy bandwidths (``params.RUNTIME_FITS``: measured on the CP
    runtime's own copies, a different workload). 1 where the calibration's GPU has no fit."""
    base = _calibration_copy_bw(os.path.abspath(path))
    return 1.0 if base is None else base / copy_bw


def file_memory_factor(env: dict) -> float:
    """:func:`memory_factor` on the GPU a results file was measured on (its ``env``): 1 on the
    calibration's own GPU and on a GPU without a fit."""
    try:
        copy_bw = runtime_fit_of(env.get("gpu", ""))["copy"]
    except ValueError:
        return 1.0
    return memory_factor(copy_bw)


def with_machine_host(cost: AttentionCost, rows: list[dict]) -> AttentionCost:
    """``cost`` with the host terms of the machine that measured ``rows`` (a results file's rows
    of one class): :func:`calibrate.measured_host`, taken from them as the calibration takes its
    own. The host per call is a parameter of the machine (its CPU, its Python), so a file from
    another machine is predicted with that machine's host, the GPU part as calibrated."""
    fwd, bwd, expand = measured_host(rows)
    return replace(cost, fwd=replace(cost.fwd, floor=fwd), bwd=replace(cost.bwd, floor=bwd, expand_host=expand),
                   source=f"{cost.source}; host {fwd * 1e6:.0f} / {bwd * 1e6:.0f} us (that machine's)")


def on_file_gpu(cost: AttentionCost, env: dict) -> AttentionCost:
    """``cost`` on the GPU a results file was measured on (its ``env``): the memory-bound
    per-query-block passes at that GPU's fitted copy bandwidth (:func:`memory_scaled` by
    :func:`file_memory_factor`)."""
    return memory_scaled(cost, file_memory_factor(env))


@functools.lru_cache(maxsize=None)
def _calibration_copy_bw(path: str) -> Optional[float]:
    """The fitted copy bandwidth of the GPU ``path`` was measured on (None: no file or no fit)."""
    try:
        with open(path) as f:
            return runtime_fit_of(json.load(f).get("env", {}).get("gpu", ""))["copy"]
    except (OSError, ValueError):
        return None


def _spread_lengths(name: str, tokens: int, seed: int = 0) -> Optional[list[int]]:
    from benchmarks.corpus import document_spreads

    return document_spreads(tokens, seed=seed).get(name)


def _rank_tiles(spread: str, balance: str, tokens: int, cp: int, ranks: list[dict],
                tolerance: Optional[float] = None) -> tuple[list[TileCounts], str]:
    """Per-rank tiles: exact from today's plan when it reproduces the recorded per-rank work,
    else estimated from the recorded work (partial = diagonal tiles of the rank's rows)."""
    lens = _spread_lengths(spread, tokens)
    rows = tokens // cp
    if lens is not None and sum(lens) == tokens:
        v = document_plan_view(lens, cp, balance, tolerance=tolerance)
        if [r.get("work") for r in ranks] == v.works:
            return v.sorted_tiles, "exact (plan reproduces the recorded work)"
    out = []
    for r in ranks:
        w = int(r.get("work", 0))
        part = min(w, rows // 128 * 2)
        out.append(TileCounts(w - part, part, rows, int(r["keys"])))
    return out, "estimated from the recorded work (mask not reproducible here)"


def per_rank_points(cost: AttentionCost, path: str = SINGLE) -> tuple[list[dict], dict]:
    """Every rank of ``cp_single_gpu.json`` with its tiles and measured fwd+bwd seconds."""
    with open(path) as f:
        res = json.load(f)
    a = res["args"]
    pts = []
    notes = {}
    for spread, entry in res["spreads"].items():
        for balance in ("dual_chunk", "sparse"):
            ranks = entry[balance]["ranks"]
            tiles, note = _rank_tiles(spread, balance, a["tokens"], a["cp"], ranks, file_tolerance(a))
            notes[(spread, balance)] = note
            for r, t in zip(ranks, tiles):
                if r["seconds"] <= 0:
                    continue
                kernel = cost.forward(t, a["heads"]) + cost.backward(t, a["heads"]) \
                    - cost.fwd.call - cost.bwd.call
                pts.append({"spread": spread, "balance": balance, "rank": r["rank"], "tiles": t,
                            "kernel": kernel, "measured": r["seconds"]})
    return pts, {"args": a, "env": res["env"], "notes": notes}


def fit_per_rank(points: list[dict]) -> tuple[float, float]:
    """``(k, c)``: measured ~ c + k * kernel, least squares on the relative error."""
    y = np.array([p["measured"] for p in points])
    x = np.array([p["kernel"] for p in points])
    a = np.stack([x, np.ones_like(x)], 1) / y[:, None]
    (k, c), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    return float(k), float(max(c, 0.0))


def per_rank_calibration(path: str = SINGLE) -> tuple[AttentionCost, float, float]:
    """The old kernel's table fit, rescaled on the dual_chunk ranks (the fit set)."""
    base = load_cost("flashmask3_old", True)
    pts, _ = per_rank_points(base, path)
    k, c = fit_per_rank([p for p in pts if p["balance"] == "dual_chunk"])
    cost = scaled_cost(base, k, c * 0.3, c * 0.7,
                       f"old-kernel table fit x k={k:.3f}, per-call {c * 1e3:.2f} ms (fwd+bwd), fitted on "
                       "the dual_chunk ranks of cp_single_gpu.json")
    return cost, k, c


def validate_single(path: str = SINGLE) -> dict:
    """Per-rank errors with both calibrations."""
    tables = load_cost("flashmask3_old", True)
    cost, k, c = per_rank_calibration(path)
    out = {"k": k, "c": c, "tables": [], "per_rank": []}
    pts, meta = per_rank_points(tables, path)
    h = meta["args"]["heads"]
    for p in pts:
        name = f"{p['spread']} {p['balance']} rank {p['rank']}"
        t = p["tiles"]
        out["tables"].append(Point(name, p["measured"], tables.forward(t, h) + tables.backward(t, h)))
        out["per_rank"].append(Point(name, p["measured"], cost.forward(t, h) + cost.backward(t, h),
                                     held_out=p["balance"] != "dual_chunk"))
    out["notes"] = {f"{s} {b}": n for (s, b), n in meta["notes"].items()}
    return out


# -- the current kernels' per-rank shapes ----------------------------------------------------------


#: ``triton.testing.do_bench`` zeroes a 256 MB buffer before every timed call (its L2 flush):
#: on a host-bound call the GPU runs that memset while the host issues the call, so that much
#: of the host's work does not show in the call's time.
DO_BENCH_CLEAR_BYTES = 256 * 1024 * 1024


def do_bench_hidden(cluster: Optional[Cluster] = None) -> float:
    """Seconds of host work a ``do_bench`` sample hides: its memset at the measured HBM bandwidth."""
    return DO_BENCH_CLEAR_BYTES / (cluster or Cluster()).hbm_bw.value


def _predictions(cost: AttentionCost, r: dict, hidden: float) -> dict[str, float]:
    """Every check's prediction for one measured row (seconds), keyed like its column:

    ``fwd GPU`` / ``fwd+bwd GPU``: the GPU part alone (vs the GPU time, host hidden);
    ``fwd stream`` / ``fwd+bwd stream``: a stream of back-to-back calls, ``max(host, GPU)``
    with the model's host (calibrate.measured_host: its median, plus ``expand_host`` for a
    GQA backward that expanded K/V), against the mean of the row's stream samples
    (calibrate.sample_mean: the host-relevant rows have ``measure.repeat_streams``' samples
    spread over the run, files from session 48 on; a GPU-bound row has its one sample);
    ``..., one sample``: the same against the row's first sample alone (what one ~10 ms sample
    of a host-bound call says: the host's speed at that moment); ``..., row's host``: the same with the host
    time measured for that row (checks how host and GPU combine, not the host's scatter);
    ``..., its own host``: with the host's CPU time for the very calls the stream timed (files
    from session 20 on: the combination rule alone, the host's drift between loops removed);
    ``fwd do_bench`` / ``fwd+bwd do_bench``: ``max(GPU, host - memset)`` (``do_bench`` hides
    ``hidden`` seconds of host work behind its memset), with the model's and the row's host.
    Files without GPU times (do_bench only, floor fitted on it): ``fwd`` / ``fwd+bwd`` =
    ``max(floor, GPU)``."""
    t, h, hk = row_tiles(r), r["heads"], r.get("kv_heads", r["heads"])
    gf = cost.gpu_forward(t, h, hk)
    gfb = gf + cost.gpu_backward(t, h, hk)
    hf, hfb = cost.fwd.floor, cost.fwd.floor + cost.bwd.floor
    if cost.bwd.bwd_factor(t, h, hk) > 1:  # the expanded backward's host, as PassCost.time adds it
        hfb += cost.bwd.expand_host
    out = {}
    if "gpu_fwd_ms" not in r:
        out["fwd"] = cost.forward(t, h, hk)
        out["fwd+bwd"] = out["fwd"] + cost.backward(t, h, hk)
        return out
    out["fwd GPU"], out["fwd+bwd GPU"] = gf, gfb
    rf, rfb = r["host_fwd_us"] * 1e-6, r["host_fwd_bwd_us"] * 1e-6
    if "stream_fwd_ms" in r:
        out["fwd stream"], out["fwd+bwd stream"] = max(hf, gf), max(hfb, gfb)
        out["fwd stream, one sample"], out["fwd+bwd stream, one sample"] = max(hf, gf), max(hfb, gfb)
        out["fwd stream, row's host"], out["fwd+bwd stream, row's host"] = max(rf, gf), max(rfb, gfb)
        if "stream_host_fwd_us" in r:  # the host's CPU time for the very calls the stream timed
            sf, sfb = r["stream_host_fwd_us"] * 1e-6, r["stream_host_fwd_bwd_us"] * 1e-6
            out["fwd stream, its own host"] = max(sf, gf)
            out["fwd+bwd stream, its own host"] = max(sfb, gfb)
    if "fwd_ms" in r:
        out["fwd do_bench"], out["fwd+bwd do_bench"] = max(gf, hf - hidden), max(gfb, hfb - hidden)
        out["fwd do_bench, row's host"] = max(gf, rf - hidden)
        out["fwd+bwd do_bench, row's host"] = max(gfb, rfb - hidden)
    return out


#: The measured column of each check (milliseconds in the file).
MEASURED_COLUMN = {"fwd": "fwd_ms", "fwd+bwd": "fwd_bwd_ms", "fwd GPU": "gpu_fwd_ms",
                   "fwd+bwd GPU": "gpu_fwd_bwd_ms", "fwd stream": "stream_fwd_ms",
                   "fwd+bwd stream": "stream_fwd_bwd_ms", "fwd do_bench": "fwd_ms",
                   "fwd+bwd do_bench": "fwd_bwd_ms"}


#: Checks measured as the mean of a row's samples (calibrate.sample_mean) rather than its first.
MEAN_OF_SAMPLES = ("fwd stream", "fwd+bwd stream")


def measured_ms(r: dict, col: str, check: str = "") -> float:
    """The measured milliseconds of ``check`` in row ``r``: for the ``stream`` checks the mean
    of the row's sample and its repeats (``col + "_repeats"``), else column ``col``."""
    return sample_mean(r, col) if check in MEAN_OF_SAMPLES else r[col]


def call_name(r: dict) -> str:
    """How the report names one measured call (a row of scale_model_attention.json)."""
    return f"{r['spread']} cp {r['cp']} {r['balance']} rank {r['rank']} stage {r['stage']} Hq={r['heads']}"


def _shape_points(cost: AttentionCost, rows: list[dict], held_out: bool,
                  hidden: Optional[float] = None) -> dict[str, list[Point]]:
    """Predicted vs measured per call, per check (:func:`_predictions`). A ``"greedy"`` cost
    predicts only the rows whose per-program tiles were rebuilt (the others are counted by
    :func:`validate_measured`)."""
    hidden = do_bench_hidden() if hidden is None else hidden
    out: dict[str, list[Point]] = {}
    for r in rows:
        if cost.fwd.schedule == "greedy" and r.get("_work") is None:
            continue
        name = call_name(r)
        for check, pred in _predictions(cost, r, hidden).items():
            col = MEASURED_COLUMN[check.split(",")[0]]
            if col in r:
                out.setdefault(check, []).append(Point(name, measured_ms(r, col, check) * 1e-3, pred, held_out))
    return out


def validate_measured(path: str = MEASURED_FILE) -> dict:
    """The current kernels' calibration on its own measurements (scale-model.sh): per GQA class,
    the in-sample error of the fit on every shape, and a hold-out check -- fitted on the
    dual_chunk plans' calls only, predicting the sparse plans' calls. ``excluded``: rows whose
    per-program tiles could not be rebuilt, per spread (not predicted by the greedy schedule)."""
    out = {}
    for gqa in (True, False):
        rows, _ = measured_rows(path, 128, gqa)
        if not rows:
            continue
        cls = "GQA" if gqa else "MHA"
        fit_set = [r for r in rows if r["balance"] == "dual_chunk"]
        held = [r for r in rows if r["balance"] != "dual_chunk"]
        if os.path.abspath(path) == os.path.abspath(MEASURED_FILE):  # the cached calibration's fits
            every, dual = load_cost("flashmask3", gqa), load_cost("flashmask3_dual_chunk", gqa)
        else:
            every = fit_rows(rows, "all shapes", 128, gqa)
            dual = fit_rows(fit_set, "dual_chunk shapes", 128, gqa)
        n_work, missing = work_summary(rows)
        out[cls] = {"in_sample": _shape_points(every, rows, False),
                    "held_out": _shape_points(dual, held, True), "cost": every,
                    "rows": len(rows), "with_work": n_work,
                    "excluded": missing if every.fwd.schedule == "greedy" else {}}
        if every.fwd.schedule == "greedy":  # the session-18 model on the same calls, for comparison
            same = [r for r in rows if r.get("_work") is not None]
            f_every = fit_rows(same, "all shapes", 128, gqa, schedule="fill")
            f_dual = fit_rows([r for r in same if r["balance"] == "dual_chunk"], "dual", 128, gqa, schedule="fill")
            out[cls]["fill"] = {"in_sample": _shape_points(f_every, same, False),
                                "held_out": _shape_points(f_dual, [r for r in same if r["balance"] != "dual_chunk"],
                                                          True)}
    return out


#: The calibration's calls timed again on an H100 (scale-model.sh, session 52): is the H200's fit
#: the H100 cluster's kernel speed (``Cluster.gpu_scale``)?
H100_MEASURED = os.path.join(RESULTS, "scale_model_attention_h100.json")
H100_MATMUL = os.path.join(RESULTS, "scale_model_matmul_h100.json")
#: The checks of another GPU's measurement file: its GPU time, and its stream against
#: ``max(GPU, the host time of the very calls the stream timed)`` (that machine's own host: the
#: combination rule; the model's host term is the calibration machine's).
TRANSFER_CHECKS = ("fwd GPU", "fwd+bwd GPU", "fwd stream, its own host", "fwd+bwd stream, its own host",
                   "fwd stream, its machine's host", "fwd+bwd stream, its machine's host")
#: The stream checks predicted with the measuring machine's host terms (:func:`with_machine_host`),
#: under the names :data:`TRANSFER_CHECKS` gives them.
MACHINE_HOST_CHECKS = {"fwd stream": "fwd stream, its machine's host",
                       "fwd+bwd stream": "fwd+bwd stream, its machine's host"}


def _call_key(r: dict) -> tuple:
    return (r["spread"], r["cp"], r["balance"], r["nodes"], r["rank"], r["stage"], r["heads"], r["kv_heads"])


def paired_calls(path: str = H100_MEASURED, base: str = MEASURED_FILE) -> list[tuple[dict, dict]]:
    """``(row of base, row of path)`` of every call both measurement files timed with GPU times
    (same plan call and heads), GQA calls first, each class in ``base``'s order; the rows come
    from :func:`calibrate.measured_rows`, loaded once per file."""
    def rows(f):
        return [r for gqa in (True, False) for r in measured_rows(f, 128, gqa)[0] if "gpu_fwd_ms" in r]
    other = {_call_key(r): r for r in rows(path)}
    return [(r, other[_call_key(r)]) for r in rows(base) if _call_key(r) in other]


def gpu_time_ratios(pairs: list[tuple[dict, dict]]) -> dict[str, list[float]]:
    """GPU time per call, other file over base, of :func:`paired_calls` ``pairs``: per pass
    (``"fwd"``, ``"fwd_bwd"``), and ``"fwd_bwd_small"`` for the calls whose base forward+backward
    took under 0.3 ms (where the backward's memory-bound passes weigh most)."""
    out = {n: [o[f"gpu_{n}_ms"] / r[f"gpu_{n}_ms"] for r, o in pairs] for n in ("fwd", "fwd_bwd")}
    out["fwd_bwd_small"] = [o["gpu_fwd_bwd_ms"] / r["gpu_fwd_bwd_ms"] for r, o in pairs if r["gpu_fwd_bwd_ms"] < 0.3]
    return out


def matmul_ratios(path: str = H100_MATMUL, base: str = MATMUL_FILE) -> list[tuple[str, str, float]]:
    """``(model, shape key, throughput in path / in base)`` of every matmul set both files timed."""
    def sets(f):
        with open(f) as fh:
            return {r["key"]: r for r in json.load(fh)["matmul"]}
    other = sets(path)
    return [(r["model"], k, other[k]["tflops"] / r["tflops"]) for k, r in sets(base).items() if k in other]


def validate_transfer(path: str = H100_MEASURED) -> Optional[dict]:
    """The cached (H200) fits on another GPU (:func:`on_file_gpu`: the memory-bound passes at its
    copy bandwidth, the rest as calibrated: ``gpu_scale`` 1) against a measurement file of the
    same calls, :data:`TRANSFER_CHECKS` (the streams with the host of the very calls timed, and
    with that machine's host terms, :func:`with_machine_host`): per class, the points of each check;
    ``without_memory_term``: the fwd+bwd GPU points with the per-query-block passes at the
    calibration GPU's speed; the file's environment; ``ratios`` (:func:`gpu_time_ratios` against
    the calibration's own file), ``matmul`` (:func:`matmul_ratios`), ``memory_factor`` (the
    per-query-block term's factor on that GPU), ``machine_host`` (per class, that machine's host
    terms, as text) and ``repeated`` (the rows with repeated stream samples). None without the file."""
    if not os.path.exists(path):
        return None
    out: dict = {"classes": {}, "without_memory_term": [], "env": {}, "machine_host": {}, "repeated": [],
                 "ratios": gpu_time_ratios(paired_calls(path)), "matmul": [x for *_, x in matmul_ratios()]}
    for gqa in (True, False):
        rows, env = measured_rows(path, 128, gqa)
        if not rows:
            continue
        cls = "GQA" if gqa else "MHA"
        cost = load_cost("flashmask3", gqa)
        on_gpu = on_file_gpu(cost, env)
        machine_cost = with_machine_host(on_gpu, rows)
        pts = _shape_points(on_gpu, rows, True)
        machine = _shape_points(machine_cost, rows, True)
        pts.update({name: machine[c] for c, name in MACHINE_HOST_CHECKS.items() if c in machine})
        out["machine_host"][cls] = (f"{machine_cost.fwd.floor * 1e6:.0f} / {machine_cost.bwd.floor * 1e6:.0f} us "
                                    "forward / backward")
        out["repeated"] += [r for r in rows if "stream_host_fwd_bwd_us_repeats" in r]
        out["classes"][cls] = {c: pts[c] for c in TRANSFER_CHECKS if c in pts}
        out["without_memory_term"] += _shape_points(cost, rows, True).get("fwd+bwd GPU", [])
        out["env"] = env
    out["memory_factor"] = file_memory_factor(out["env"])
    return out


#: The H200 A/B of the expanded GQA backward (benchmarks/gqa_expand_ab.py): fwd+bwd GPU time of
#: full-attention stage-shaped calls, expanded and grouped, measured after the calibration file.
EXPAND_AB = os.path.join(RESULTS, "gqa_expand_ab.json")


def validate_kv_expansion(path: str = EXPAND_AB) -> list[Point]:
    """Held-out check of the per-program model on a change it was not fitted on: the fwd+bwd GPU
    time of each A/B call with the backward grouped and with K/V expanded (the calibration was
    measured with the grouped backward only), from the GQA calibration."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    cost = load_cost("flashmask3", True)
    pts = []
    for r in rows:
        pts += _expansion_points(cost, r, None, f"{r['Sq'] // 1024}K rows x {r['Sk']} keys, {r['Hq']}/{r['Hk']} heads",
                                 "full attention; GPU time (host hidden)")
    stages = data.get("stages")
    if stages:  # real stage calls, each mask rebuilt from its plan (the shape set file)
        from benchmarks.gqa_expand_ab import load_cases

        cases = load_cases(os.path.join(os.path.dirname(os.path.dirname(RESULTS)), stages["shapes"]))
        for r, c in zip(stages["rows"], cases):
            name = (f"{c['dataset']} cp 16 rank {c['rank']} stage {c['stage']}: {c['Sq'] // 1024}K rows x "
                    f"{c['Sk']} keys, {c['Hq']}/{c['Hk']} heads")
            pts += _expansion_points(cost, r, c["mask"], name, "stage call of the paper setting; GPU time")
    return pts


def _expansion_points(cost, r: dict, mask, name: str, note: str) -> list[Point]:
    """The grouped and the expanded arm of one A/B row (``mask``: its FlashMask, None = full)."""
    from .calibrate import program_work, tile_counts

    sq, sk, h, hk = r["Sq"], r["Sk"], r["Hq"], r["Hk"]
    cols = None if mask is None else mask.startend_row_indices
    t = tile_counts(cols, False, sq, sk)
    w = program_work(cols, False, sq, sk)
    out = []
    for arm, expanded in (("grouped", False), ("expanded", True)):
        tt = replace(t, work=w, kv_expanded=expanded)
        pred = cost.gpu_forward(tt, h, hk) + cost.gpu_backward(tt, h, hk)
        out.append(Point(f"{name}, {arm}", r[f"{arm}_ms"] * 1e-3, pred, True, note))
    return out


# -- the multi-GPU file -----------------------------------------------------------------------------

METHODS = {"dual_chunk+allgather": ("dual_chunk", "allgather"), "sparse+allgather": ("sparse", "allgather"),
           "sparse+overlap": ("sparse", "overlap")}


def _synthetic_view(run: dict, world: int, kv_bytes_per_token: int, overlap: bool) -> PlanView:
    """A two-level view from a run's recorded totals, when its mask cannot be rebuilt here:
    total live tiles from its FLOPs (pairs / 128^2 + S/256 diagonal halves), the slowest rank at
    ``imbalance x`` mean, the others sharing the rest; with ``overlap`` each rank's tiles split
    between its own and the remote stage in proportion to own vs moved keys (estimated)."""
    s, heads, d = run["tokens"], run["heads"], run["head_dim"]
    pairs = run["flops_fwd_bwd"] / (3.5 * 4 * heads * d)
    live = pairs / 128 ** 2 + s / 256
    part_total = s / 128 + 2 * run.get("docs", 1)
    rows = s // world
    mean = live / world
    works = [run["imbalance"] * mean] + [(live - run["imbalance"] * mean) / max(world - 1, 1)] * (world - 1)
    moved = run.get("kv_bytes_fwd", 0) / kv_bytes_per_token / world if overlap else 0
    stages, sorted_tiles, chunks = [], [], []
    cs = run["chunk_size"]
    for w in works:
        part = part_total / world
        sorted_tiles.append(TileCounts(int(w - part), int(part), rows, s))
        if overlap:
            own_keys, rem_keys = rows, moved
            f_rem = rem_keys / (own_keys + rem_keys)
            stages.append([TileCounts(int((w - part) * (1 - f_rem)), int(part), rows, own_keys),
                           TileCounts(int((w - part) * f_rem), 0, rows, int(rem_keys))])
            chunks.append([rows // cs, int(rem_keys // cs)])
        else:
            stages.append([sorted_tiles[-1]])
            chunks.append([rows // cs])
    rnd = [RoundView(tuple((src, (src + 1) % world, int(moved // cs)) for src in range(world)), False, None)] \
        if overlap else []
    return PlanView(world, 1, s, cs, "?", run["imbalance"], [int(w) for w in works], stages, chunks,
                    sorted_tiles, rnd, 0.0)


def _run_view(run: dict, world: int, balance: str, shape: AttnShape, overlap: bool,
              tolerance: Optional[float] = None) -> tuple[PlanView, str]:
    lens = _spread_lengths(run["mask"], run["tokens"]) if run["mask"] != "causal" else [run["tokens"]]
    if lens is not None and len(lens) == run.get("docs", len(lens)) \
            and abs(mask_sparsity(lens) - run["sparsity"]) < 1e-6:
        v = document_plan_view(lens, world, balance, tolerance=tolerance)
        return v, f"exact mask; today's plan (imbalance {v.imbalance:.3f} vs recorded {run['imbalance']:.3f})"
    return (_synthetic_view(run, world, shape.kv_bytes(1), overlap),
            "mask not reproducible here (corpus = this machine's files): view from the recorded totals")


def validate_multigpu(path: str = MULTI, cost: Optional[AttentionCost] = None,
                      flex: Optional[AttentionCost] = None, cluster: Cluster = TWO_H200) -> list[Point]:
    """Predict every measured attention run of a ``cp_multigpu.json``-format file."""
    with open(path) as f:
        res = json.load(f)
    att = res["attention"]
    a, env = att["args"], att["env"]
    world = env.get("world_size", 2)
    shape = AttnShape(a["heads"], a["kv_heads"], a["head_dim"])
    cost = cost or per_rank_calibration()[0]
    flex = flex or cost_for("flex", a["heads"], a["kv_heads"])
    points = []
    for run in att["runs"]:
        if "seconds" not in run:
            continue
        run = dict(run, heads=a["heads"], head_dim=a["head_dim"])
        method = run["method"]
        if method == "flex_cp":  # torch's placement: PTRR (= balance="ptrr") or head-tail
            ptrr = run.get("balancer") == "PTRR"
            v, note = _run_view(dict(run, imbalance=1.0, chunk_size=run["tokens"] // world // 2,
                                     kv_bytes_fwd=0), world, "ptrr" if ptrr else "dual_chunk", shape, False)
            if ptrr and note.startswith("exact"):
                note += "; FlexAttention tables, torch's PTRR placement rebuilt (balance='ptrr')"
            else:
                v.imbalance = 1.0
                note += "; FlexAttention tables, PTRR balance taken as perfect"
            c, comm = flex, "allgather"
        elif method in METHODS:
            balance, comm = METHODS[method]
            v, note = _run_view(run, world, balance, shape, comm == "overlap", file_tolerance(a))
            c = cost
        else:
            continue
        # the runtime as the run ran it: files before session 21 record neither field (one
        # backward call per stage, K/V fetched again in the backward)
        rt = Runtime("current", bwd_calls=run.get("backward_calls", "stage"), keep_kv=run.get("keep_kv", False))
        lr = simulate_layer(v, c, cluster, shape, comm, rt)
        points.append(Point(f"{run['tokens']} {run['mask']} {method}", run["seconds"], lr.time, True, note))
    return points


def summary(points: list[Point], held_only: bool = True) -> dict:
    held = [p for p in points if p.held_out or not held_only]
    errs = [abs(p.error) for p in held]
    return {"points": len(held), "max_abs_error": max(errs) if errs else math.nan,
            "mean_abs_error": float(np.mean(errs)) if errs else math.nan,
            "within_target": sum(e <= TARGET for e in errs)}


def validate_training(path: str = MULTI, attention_points: Optional[list[Point]] = None) -> list[Point]:
    """The end-to-end training pair of a ``cp_multigpu.json`` file (baseline vs ours).

    The training masks come from the machine's corpus and change every step, so they cannot be
    rebuilt here; this check takes the baseline's measured step time and attention share as
    given and predicts ours from the two terms the model adds: the work imbalance of each run
    (``cp_imbalance``, live tiles) and the overlapped exchange's cost relative to an all-gather
    call at equal balance (the model's sparse+overlap / sparse+allgather attention times on the
    same file). A weak check: it tests those two terms, not the non-attention model."""
    with open(path) as f:
        res = json.load(f)
    train = res.get("train") or {}
    base, ours = train.get("baseline"), train.get("ours")
    if not base or not ours or "step_time_s" not in base or "step_time_s" not in ours:
        return []
    pts = attention_points if attention_points is not None else validate_multigpu(path)
    by = {p.name.split()[-1]: p.predicted for p in pts}
    ratio = by["sparse+overlap"] / by["sparse+allgather"] if {"sparse+overlap", "sparse+allgather"} <= set(by) else 1.0
    if ours.get("comm") != "overlap":
        ratio = 1.0
    share = base["attention_share"]
    pred = base["step_time_s"] * ((1 - share) + share * ours["cp_imbalance"] / base["cp_imbalance"] * ratio)
    note = (f"baseline step and attention share ({share:.1%}) taken as measured; imbalance "
            f"{base['cp_imbalance']:.3f} -> {ours['cp_imbalance']:.3f}, overlap/allgather x{ratio:.3f} (model)")
    return [Point(f"training step, {ours.get('balance')}+{ours.get('comm')}", ours["step_time_s"], pred, True, note)]


# -- the CP runtime on one GPU, per rank (cp_single_gpu.py --breakdown) ------------------------------

#: The runtime's layer on one H200 with every rank's kernels profiled (sessions 28-29).
CP_RUNTIME_BREAKDOWN = os.path.join(RESULTS, "cp_runtime_breakdown.json")
#: another --breakdown file: sparse vs PTRR ranks (benchmarks/gpu/cp-ptrr.sh), checked with the
#: bandwidths fitted on CP_RUNTIME_BREAKDOWN (every point held out)
CP_PTRR = os.path.join(RESULTS, "cp_ptrr.json")
#: ``cp_single_gpu.py --graph``: each rank's layer also replayed from a CUDA graph (no host gaps).
CP_GRAPH = os.path.join(RESULTS, "cp_graph.json")

def rank_kernel_seconds(view: PlanView, r: int, cost: AttentionCost, shape: AttnShape, comm: str,
                        bwd_calls: str) -> float:
    """GPU seconds of rank ``r``'s attention kernels in one layer (forward and backward, host
    hidden), as the runtime calls them: one call per live stage forward; backward ``"stage"``: one
    staged call per live stage plus the layer's one query-block pass (pre-pass, dQ scaling),
    ``"one"``: one call over every stage's keys; all-gather: one call per pass."""
    h, hk = shape.heads, shape.kv_heads
    if comm == "allgather":
        t = view.sorted_tiles[r]
        return cost.gpu_forward(t, h, hk) + cost.gpu_backward(t, h, hk) if t.live else 0.0
    live = [t for t in view.stages[r] if t.live]
    if not live:
        return 0.0
    fwd = sum(cost.gpu_forward(t, h, hk) for t in live)
    if bwd_calls == "one":
        return fwd + cost.gpu_backward(merge_calls(view.stages[r]), h, hk)
    staged = sum(cost.gpu_backward_stage(t, h, hk) for t in live)
    return fwd + staged + cost.backward_query_blocks(live[0], h)


#: flashmask3 kernels of a CP layer that are the runtime's own work, not attention (the merge,
#: the key gather, the wire packing, the gradient sum: kernels/merge.py, gather.py, returns.py).
RUNTIME_KERNELS = ("_merge_kernel", "_gather_keys_kernel", "_pack_wire_kernel", "_add_returns_kernel")

#: Host µs per op of a CP layer on the H200 machine's VM, from benchmarks/results/
#: host_breakdown.json (session 27, another day than any breakdown file): a prepared forward call
#: 45 (``bound_ab`` call.forward); the backward body 168 (``bound_ab`` call.backward) = the
#: pre-pass launch (24) and the dQ scaling launch (20) each with its Python, and the stage call;
#: a Triton launch through the launcher 21; a torch op 23 (``x.add_(1)``); the autograd engine's
#: hand-off to its device thread 219 (``handoff``, 0 µs backward), once per backward.
HOST_US = {"forward": 45.0, "backward_prepare": 35.0, "backward_stage": 105.0, "backward_finish": 28.0,
           "backward": 168.0, "kernel": 21.0, "torch": 23.0, "emulated": 23.0, "engine": 219.0}

#: GPU floor of one small launch (a kernel's fixed cost on the H200, the order of the emptiest
#: kernels in the profiles: 2-5 µs).
LAUNCH_FLOOR = 3e-6

#: cp sizes whose ranks fit the runtime ops' bandwidths (params.RUNTIME_FITS), per file; the
#: others are held out.
COPY_FIT_CP = (8, 32)
PTRR_FIT_CP = (32,)


def _attention_op_seconds(op, view: PlanView, r: int, cost: AttentionCost, shape: AttnShape, comm: str,
                          calls: str) -> float:
    """GPU seconds of one recorded attention call (runtime_ops.Op) by the attention cost model:
    a stage's forward or staged backward on its tiles, the merged call on the merged stages'
    tiles, the all-gather calls on the sorted keys; the backward's query-row passes (pre-pass,
    dQ scaling) split between its prepare and finish."""
    h, hk = shape.heads, shape.kv_heads
    stages = view.stages[r]
    live = [t for t in stages if t.live]
    if op.name in ("backward_prepare", "backward_finish"):
        return cost.backward_query_blocks(live[0], h) / 2 if live else 0.0
    if comm == "allgather":
        t = view.sorted_tiles[r]
        return (cost.gpu_forward if op.name == "forward" else cost.gpu_backward)(t, h, hk) if t.live else 0.0
    if op.stage == MERGED:
        t = merge_calls(next(ts for s, ts in backward_calls_of(stages, calls) if s == MERGED))
        return cost.gpu_backward_stage(t, h, hk) if t is not None and t.live else 0.0
    t = stages[op.stage]
    if not t.live:
        return 0.0
    return (cost.gpu_forward if op.name == "forward" else cost.gpu_backward_stage)(t, h, hk)


def emulated_layer_seconds(ops, attn_seconds: list, bandwidths: dict, host_scale: float = 1.0) -> tuple:
    """``(layer, host)`` seconds of one rank's layer on the emulation, from its recorded op
    sequence: the host issues the ops in order (:data:`HOST_US` each, x ``host_scale``; the
    autograd engine's hand-off before the backward's first op, not scaled: see
    :func:`host_scale_of`), the GPU runs each as soon as it is issued and the previous one
    finished (attention ops: ``attn_seconds`` in order; the others: runtime_ops.op_seconds at
    ``bandwidths`` plus :data:`LAUNCH_FLOOR`). The layer ends when both are done (the timer's
    stop event is recorded after the host returns)."""
    host = gpu = 0.0
    attn = iter(attn_seconds)
    backward = False
    for op in ops:
        if op.pass_ == "bwd" and not backward:
            backward = True
            host += HOST_US["engine"] * 1e-6
        host += HOST_US[op.name if op.kind == "attention" else op.kind] * 1e-6 * host_scale
        g = next(attn) if op.kind == "attention" else op_seconds(op, bandwidths, LAUNCH_FLOOR)
        if g > 0:
            gpu = max(gpu, host) + g
    return max(gpu, host), host


def host_scale_of(ops, measured_host: float) -> float:
    """The factor on :data:`HOST_US`'s per-op costs that gives a rank's measured host time: the
    ops' Python and dispatch run 2-4x slower in a layer than in the warm micro-benchmarks the
    costs come from (a cold working set; benchmarks/NOTES.md, sessions 20 and 34) and this VM's
    speed drifts between runs. The engine's hand-off to its device thread (a thread wake-up,
    once per backward) is taken as measured and left out of the factor: scaling it too put
    its 0.2 ms x 2-3.5 in front of the backward's first launch and over-predicted host-heavy
    layers (session 40: the layer check's mean error 3.7 -> 2.8% on the H200's file, worst
    15.1 -> 12.3%; 3.1 -> 2.5% on the H100's, worst 22.1 -> 19.1%; the host-heavy layouts
    better by up to 4 points, a few GPU-bound ones worse by up to 1.3)."""
    engine = HOST_US["engine"] * 1e-6 if any(o.pass_ == "bwd" for o in ops) else 0.0
    per_op = sum(HOST_US[o.name if o.kind == "attention" else o.kind] for o in ops) * 1e-6
    return max(measured_host - engine, 0.0) / per_op if per_op > 0 else 1.0


def median_iteration(r: dict) -> tuple[float, float]:
    """``(layer, host)`` seconds of a timed rank for the layer check: its median iteration (the
    one whose layer time is the median, lower of the two middle ones) with that iteration's own
    host time, where the file records every iteration (``iterations``, cp_single_gpu.py from
    session 50 on); else the two medians (``seconds``, ``host_seconds``), which may come from
    different iterations. The model takes the host as an input, so pairing each layer with its
    own host tests how host and GPU interleave, not the host's scatter between iterations (the
    layer check's analogue of the stream's ``its own host``)."""
    its = r.get("iterations")
    if not its:
        return r["seconds"], r["host_seconds"]
    layer, host = sorted(its)[(len(its) - 1) // 2]
    return float(layer), float(host)


def _measured_runtime_seconds(b: dict) -> float:
    """A profiled layer's non-attention device time: torch ops plus the runtime's own kernels."""
    return (b["torch_ms"] + sum(ms for n, ms in b["own"] if n in RUNTIME_KERNELS)) * 1e-3


def fit_runtime_bandwidths(samples, prior: Optional[dict] = None) -> dict:
    """Bandwidths by rate class (runtime_ops.RATE_CLASSES) that make ``sum(bytes / bw) + launches
    x floor`` closest to the measured times in relative terms (least squares, one fit over all
    classes): ``samples`` = ``(bytes by rate class, launches, measured seconds)``. Where the
    samples cannot tell classes apart (their bytes move together), the fit is the one closest to
    ``prior`` (the GPU's committed fit, params.RUNTIME_FITS; default the cluster's: the minimum-norm
    change of their times per byte); a class no sample moves bytes of keeps its prior."""
    samples = [s for s in samples if s[2] > 0]
    seen = [c for c in RATE_CLASSES if any(b[c] for b, _, _ in samples)]
    out = dict(prior or Cluster().runtime_bandwidths())
    if not seen:
        return out
    prior = np.array([1.0 / out[c] for c in seen])  # seconds per byte
    a = np.array([[b[c] / m for c in seen] for b, _, m in samples])
    y = np.array([1 - n * LAUNCH_FLOOR / m for _, n, m in samples])
    change, *_ = np.linalg.lstsq(a * prior, y - a @ prior, rcond=None)
    per_byte = prior * (1 + change)
    if (per_byte <= 0).any():
        raise ValueError(f"runtime op fit gave a non-positive time per byte for "
                         f"{[c for c, x in zip(seen, per_byte) if x <= 0]}: the samples do not separate the classes")
    out.update({c: float(1.0 / x) for c, x in zip(seen, per_byte)})
    return out


def _recorded_ranks(res: dict, cost: AttentionCost, shape: AttnShape, need: str = "breakdown") -> list[tuple]:
    """Every rank of a ``cp_single_gpu.py`` file with the key ``need`` (``breakdown``: profiled;
    ``graph_seconds``: replayed from a CUDA graph) whose rebuilt plan reproduces its recorded
    work: ``(config name, cp, rank entry, view, recorded ops, attention seconds per attention
    op, backward calls, comm)``."""
    from benchmarks.cp_single_gpu import hidden_functions

    from .runtime_ops import record_layer

    a, lens = res["args"], res["lengths"]
    rows = []
    tol = file_tolerance(a)
    for cp, configs in res["cp"].items():
        for e in configs.values():
            view = document_plan_view(lens, int(cp), e["balance"], e["nodes"], tolerance=tol)
            # (kept in memory by the view's build when it planned: one planning per layout)
            p, _ = document_plan(lens, int(cp), e["balance"], e["nodes"], tol)
            comm, name = e["comm"], f"cp {cp} {e['config']}"
            for r in e["ranks"]:
                if r.get(need) is None or view.works[r["rank"]] != r["work"]:
                    continue  # not measured so, or the plan does not reproduce the recorded work
                calls = r.get("backward_calls", "stage") if comm == "overlap" else "stage"
                ops = record_layer(p, r["rank"], comm, calls, a["heads"], a["kv_heads"], a["head_dim"],
                                   hide=hidden_functions(e["config"]))  # an A/B layout's own path
                attn = [_attention_op_seconds(o, view, r["rank"], cost, shape, comm, calls)
                        for o in ops if o.kind == "attention"]
                rows.append((name, int(cp), r, view, ops, attn, calls, comm))
    return rows


def _gpu_fit(res: dict) -> dict:
    """The committed runtime op bandwidths of the GPU a results file was measured on
    (params.RUNTIME_FITS), or the cluster's for a GPU without a fit."""
    try:
        return runtime_fit_of(res["env"].get("gpu", ""))
    except ValueError:
        return Cluster().runtime_bandwidths()


def _runtime_file(path: str, cost: Optional[AttentionCost], need: str = "breakdown"):
    """``(file, its args, its attention shape, the attention cost, :func:`_recorded_ranks` of its
    ranks with the key ``need``)`` of a ``cp_single_gpu.py`` results file, or None for a missing file or one without
    the document lengths (recorded from session 28 on: the corpus is machine-dependent)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        res = json.load(f)
    if res.get("lengths") is None:
        return None
    a = res["args"]
    shape = AttnShape(a["heads"], a["kv_heads"], a["head_dim"])
    cost = cost or on_file_gpu(cost_for("flashmask3", a["heads"], a["kv_heads"]), res["env"])
    return res, a, shape, cost, _recorded_ranks(res, cost, shape, need)


def validate_cp_runtime(path: str = CP_RUNTIME_BREAKDOWN, cost: Optional[AttentionCost] = None,
                        fit_cp: tuple = COPY_FIT_CP, bandwidths: Optional[dict] = None) -> dict:
    """The model against the context-parallel runtime on one GPU, per timed rank of a
    ``cp_single_gpu.py --breakdown`` file: every rank's plan rebuilt from the recorded document
    lengths (checked against the recorded work) and its layer's op sequence recorded from the
    real runtime (runtime_ops.record_layer). Checks (the attention calibration never saw this
    head layout nor the runtime):

    ``kernels``  the model's GPU time of the rank's attention calls (:func:`rank_kernel_seconds`)
                 vs the profiled time of flashmask3's attention kernels in the layer;
    ``runtime``  the runtime's own device work (its torch ops, the emulated exchange's copies, the
                 merge / gather / pack / gradient-sum kernels): the recorded ops' bytes at the
                 bandwidth of their rate class (runtime_ops.RATE_CLASSES) plus a launch floor
                 each, the bandwidths fitted on the ranks of cp ``fit_cp`` (their points
                 ``held_out`` False, :func:`fit_runtime_bandwidths`), vs the profiled time;
    ``busy``     the two together vs the GPU's profiled busy time;
    ``layer``    the emulated layer (:func:`emulated_layer_seconds`: host and GPU take the
                 recorded ops in order), the host per op scaled to the rank's measured host time
                 (:func:`host_scale_of`),
                 vs the measured layer time;
    ``layer_host_model``  the same with the host per op as :data:`HOST_US` says (another day's
                 measurement: this VM's host speed drifts by tens of percent between runs).

    Each layer point keeps the measured composition (torch ops, GPU idle, host) in its note.
    ``bandwidths``: use these (another file's fit) instead of fitting: every point held out. The
    fit starts from the committed fit of the file's GPU (params.runtime_fit_of), where there is one."""
    loaded = _runtime_file(path, cost)
    if loaded is None:
        return {}
    res, a, shape, cost, rows = loaded
    if bandwidths is not None:
        bw, fit_cp = bandwidths, ()
    else:
        bw = fit_runtime_bandwidths([(bytes_by_rate(o for o in ops if o.kind != "attention"),
                                      sum(o.kind != "attention" for o in ops),
                                      _measured_runtime_seconds(r["breakdown"]))
                                     for _, cp, r, _, ops, _, _, _ in rows if cp in fit_cp], _gpu_fit(res))
    checks = ("kernels", "runtime", "busy", "layer", "layer_host_model")
    by_config: dict = {}
    host_ratios: list = []  # measured host / HOST_US's, per rank
    for name, cp, r, view, ops, attn, calls, comm in rows:
        b, rank, held = r["breakdown"], r["rank"], cp not in fit_cp
        entry = by_config.setdefault(name, {k: [] for k in checks + ("torch", "idle")})
        label = f"{name} rank {rank}"
        measured_attn = sum(ms for n, ms in b["own"] if n not in RUNTIME_KERNELS) * 1e-3
        runtime = ops_seconds(ops, bw, LAUNCH_FLOOR)
        _, host_model = emulated_layer_seconds(ops, attn, bw)
        host_ratios.append(r["host_seconds"] / host_model)
        seconds, host = median_iteration(r)
        note = (f"measured layer {seconds * 1e3:.2f} ms, host {host * 1e3:.2f} ms: attention "
                f"kernels {measured_attn * 1e3:.2f}, runtime ops {_measured_runtime_seconds(b) * 1e3:.2f}, GPU "
                f"idle inside {b['idle_ms']:.2f} (profiled step)")
        entry["kernels"].append(Point(label, measured_attn, rank_kernel_seconds(view, rank, cost, shape, comm, calls)))
        entry["runtime"].append(Point(label, _measured_runtime_seconds(b), runtime, held))
        entry["busy"].append(Point(label, b["busy_ms"] * 1e-3, sum(attn) + runtime, held))
        layer, _ = emulated_layer_seconds(ops, attn, bw, host_scale_of(ops, host))
        entry["layer"].append(Point(label, seconds, layer, held, note))
        entry["layer_host_model"].append(Point(label, seconds, emulated_layer_seconds(ops, attn, bw)[0],
                                               held, note))
        entry["torch"].append(b["torch_ms"] * 1e-3)
        entry["idle"].append(b["idle_ms"] * 1e-3)
    return {**{k: [p for e in by_config.values() for p in e[k]] for k in checks},
            "by_config": by_config, "env": res["env"], "args": a, "bandwidths": bw, "copy_fit_cp": fit_cp,
            "host_ratio": statistics.median(host_ratios) if host_ratios else None}


def validate_cp_graph(path: str = CP_GRAPH, bandwidths: Optional[dict] = None,
                      cost: Optional[AttentionCost] = None) -> dict:
    """The model's GPU-only layer against each rank's layer replayed from a CUDA graph
    (``cp_single_gpu.py --graph``: the host issues one graph launch, so the layer is the GPU's
    work back to back): the rank's attention calls by the cost model plus its recorded runtime
    ops at ``bandwidths`` (by rate class: those :func:`validate_cp_runtime` fitted on cp 8/32
    profiles of another run; every point here is held out) vs the replay time. No host term and no profiler:
    a check of the GPU side that this VM's host noise cannot touch. ``eager``: the same ranks'
    eager layers (timed in the same run) against :func:`emulated_layer_seconds` with the host
    per op of :data:`HOST_US` unscaled (another day's host measurement), a second file for the
    breakdown's ``layer_host_model`` check."""
    loaded = _runtime_file(path, cost, need="graph_seconds")
    if loaded is None:
        return {}
    res, a, _, cost, rows = loaded
    bw = bandwidths or _gpu_fit(res)
    points, eager, host_ratios, by_config = [], [], [], {}
    for name, cp, r, _, ops, attn, _, _ in rows:
        note = f"eager layer {r['seconds'] * 1e3:.2f} ms (host {r['host_seconds'] * 1e3:.2f} ms)"
        pt = Point(f"{name} rank {r['rank']}", r["graph_seconds"], sum(attn) + ops_seconds(ops, bw, LAUNCH_FLOOR),
                   True, note)
        points.append(pt)
        layer, host_model = emulated_layer_seconds(ops, attn, bw)
        eager.append(Point(pt.name, r["seconds"], layer, True, note))
        host_ratios.append(r["host_seconds"] / host_model)
        entry = by_config.setdefault(name, {"graph": [], "eager": []})
        entry["graph"].append(pt)
        entry["eager"].append(r["seconds"])
    return {"graph": points, "eager_host_model": eager, "by_config": by_config, "env": res["env"], "args": a,
            "bandwidths": bw, "host_ratio": statistics.median(host_ratios) if host_ratios else None}

