"""Attention and matmul cost, fitted from measurements on one H200.

Attention: one FlashMask call in a stream of calls (a CP rank's stage calls) costs

    t = max(host, gpu)
    gpu = call + heads * ((a_full * full + a_partial * partial) * fill + a_qblock * q_blocks + a_kblock * k_blocks)

``host`` (the field ``floor``) is the CPU time to issue one call: when the host is slower than
the GPU, back-to-back calls wait for it. ``full`` / ``partial`` are the call's live 128x128 tiles
(per mask head, summed over the batch; the mask layer's tile rule), ``q_blocks`` / ``k_blocks``
its 128-row query and key blocks (the programs' prologue / epilogue and the per-block metadata
the kernels read whether the block's tiles are live or not), and ``fill = max(1, SMs /
programs)`` stretches calls too small to fill the GPU (query-block programs in the forward,
key-block programs in the backward). Forward and backward (= fwd+bwd - fwd) apart, per head dim
and GQA class, fitted by least squares on relative error from:

* ``benchmarks/results/scale_model_attention.json`` -- the per-rank shapes measured by
  ``benchmarks/gpu/scale-model.sh``. When its rows carry the GPU time (``gpu_fwd_ms``: host work
  hidden) and the host time per call (``host_fwd_us``), the GPU part is fitted on the GPU time
  and ``host`` is the measured median host time per call (a parameter read from the
  measurement). Older files have only the ``do_bench`` time (host included): then ``host`` is
  fitted as a floor (candidate floors, the GPU part refitted on the calls above it);
* the committed kernel tables (``kernel.json``: 8K-128K tokens, large batches, every call
  milliseconds): the per-call overhead cannot be separated there, so it is held at an assumed
  value, there is no host term, and only the per-tile costs are fitted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace, asdict, dataclass
from typing import Iterable, Optional

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
MEASURED_FILE = os.path.join(RESULTS, "scale_model_attention.json")
TILE = 128
N_SM = 132
#: Per-call GPU overhead assumed when the data cannot separate it (launch tail, prologue).
ASSUMED_CALL = {"fwd": 20e-6, "bwd": 50e-6}


@dataclass(frozen=True)
class TileCounts:
    """Live tiles of one attention call (per mask head, summed over batch) and its shape."""

    full: int
    partial: int
    q_rows: int
    keys: int
    batch: int = 1

    @property
    def live(self) -> int:
        return self.full + self.partial

    @property
    def q_blocks(self) -> int:
        return math.ceil(self.q_rows / TILE) * self.batch

    @property
    def k_blocks(self) -> int:
        return math.ceil(self.keys / TILE) * self.batch


@dataclass(frozen=True)
class PassCost:
    """Fitted cost of one pass (forward or backward) of one kernel family."""

    a_full: float      # seconds per full tile per query head
    a_partial: float   # seconds per partial tile per query head
    call: float        # seconds of GPU time per call
    rms_rel_err: float
    points: int
    floor: float = 0.0  # seconds: host time per call (a stream of calls costs max(host, GPU))
    a_qblock: float = 0.0  # seconds per query block per query head
    a_kblock: float = 0.0  # seconds per key block per query head
    host_measured: bool = False  # floor = measured host time per call (else fitted or none)
    fitted_on: str = "do_bench"  # the time the GPU part was fitted on: "gpu" or "do_bench"

    def gpu_seconds(self, tiles: TileCounts, heads: int, programs: int) -> float:
        """GPU time of one call (host work hidden)."""
        if tiles.live == 0:
            return 0.0
        fill = max(1.0, N_SM / max(programs, 1))
        return self.call + heads * ((self.a_full * tiles.full + self.a_partial * tiles.partial) * fill
                                    + self.a_qblock * tiles.q_blocks + self.a_kblock * tiles.k_blocks)

    def seconds(self, tiles: TileCounts, heads: int, programs: int) -> float:
        """Time of one call in a stream of calls: the slower of its host and its GPU work."""
        if tiles.live == 0:
            return 0.0
        return max(self.floor, self.gpu_seconds(tiles, heads, programs))


@dataclass(frozen=True)
class AttentionCost:
    """Forward and backward cost of one kernel family at one head dim / GQA class."""

    fwd: PassCost
    bwd: PassCost
    source: str
    head_dim: int
    gqa: bool

    def forward(self, tiles: TileCounts, heads: int) -> float:
        programs = math.ceil(tiles.q_rows / TILE) * heads * tiles.batch
        return self.fwd.seconds(tiles, heads, programs)

    def backward(self, tiles: TileCounts, heads: int) -> float:
        programs = math.ceil(tiles.keys / TILE) * heads * tiles.batch
        return self.bwd.seconds(tiles, heads, programs)

    def backward_stage(self, tiles: TileCounts, heads: int) -> float:
        """One staged ``backward_stage`` call (overlap mode): tiles, key blocks and the per-call
        cost, without the per-query-block term, which the runtime pays once per layer in
        ``backward_prepare`` / ``backward_finish`` (:meth:`backward_query_blocks`)."""
        programs = math.ceil(tiles.keys / TILE) * heads * tiles.batch
        staged = replace(self.bwd, a_qblock=0.0)
        return staged.seconds(tiles, heads, programs)

    def backward_query_blocks(self, tiles: TileCounts, heads: int) -> float:
        """The backward's per-query-block GPU time (delta/lse pre-pass, dQ zeroing and scaling),
        charged once per layer in overlap mode (``tiles``: any stage over all local query rows)."""
        return self.bwd.a_qblock * tiles.q_blocks * heads

    def gpu_forward(self, tiles: TileCounts, heads: int) -> float:
        return self.fwd.gpu_seconds(tiles, heads, _programs("fwd", tiles, heads))

    def gpu_backward(self, tiles: TileCounts, heads: int) -> float:
        return self.bwd.gpu_seconds(tiles, heads, _programs("bwd", tiles, heads))

    def describe(self) -> str:
        f, b = self.fwd, self.bwd
        return (f"{self.source}; D={self.head_dim} {'GQA' if self.gqa else 'MHA'}: fwd "
                f"{f.a_full * 1e9:.2f}/{f.a_partial * 1e9:.2f} ns per full/partial tile-head + "
                f"{f.a_qblock * 1e9:.0f}/{f.a_kblock * 1e9:.0f} ns per query/key block-head + "
                f"{f.call * 1e6:.0f} us/call GPU, host {f.floor * 1e6:.0f} us/call ({_host_kind(f)}; "
                f"rms rel. err {f.rms_rel_err:.1%} on {f.fitted_on} time, {f.points} pts); bwd "
                f"{b.a_full * 1e9:.2f}/{b.a_partial * 1e9:.2f} ns + {b.a_qblock * 1e9:.0f}/{b.a_kblock * 1e9:.0f} ns + "
                f"{b.call * 1e6:.0f} us/call GPU, host {b.floor * 1e6:.0f} us/call ({_host_kind(b)}; rms "
                f"{b.rms_rel_err:.1%} on {b.fitted_on} time, {b.points} pts)")


def _host_kind(p: PassCost) -> str:
    if p.host_measured:
        return "measured"
    return "fitted floor of do_bench times" if p.floor > 0 else "none"



# -- fitting -------------------------------------------------------------------------------------


def _programs(kind: str, t: TileCounts, heads: int) -> int:
    rows = t.q_rows if kind == "fwd" else t.keys
    return math.ceil(rows / TILE) * heads * t.batch


def _fit_columns(cols: list, y, use, call: Optional[float]) -> tuple[list[float], float]:
    """Least squares on the relative error of the ``use`` rows: the coefficients of ``cols``
    (``[full, partial, *extra]``) and the per-call term (fitted when ``call`` is None).

    A negative partial-tile coefficient merges partial into full tiles (one cost for both: not
    identifiable apart); any other negative coefficient (block terms, per-call term) is held at
    zero and the rest refitted: a cost is never negative."""
    y = y[use]
    w = 1.0 / y
    fixed = 0.0 if call is None else call
    names = list(range(len(cols))) + (["call"] if call is None else [])
    mats = {i: c[use] for i, c in enumerate(cols)}
    if call is None:
        mats["call"] = np.ones_like(y)
    merged = False
    active = list(names)
    while True:
        a = np.stack([mats[n] + (mats[1] if merged and n == 0 else 0.0) for n in active], 1) * w[:, None]
        coef = dict(zip(active, np.linalg.lstsq(a, (y - fixed) * w, rcond=None)[0]))
        if not merged and 1 in coef and coef[1] <= 0 < coef.get(0, 1):
            merged, active = True, [n for n in active if n != 1]
            continue
        neg = [n for n in active if coef[n] < 0 and n != 0]
        if not neg:
            break
        active.remove(min(neg, key=lambda n: coef[n]))
    out = [float(coef.get(i, 0.0)) for i in range(len(cols))]
    if merged:
        out[1] = out[0]
    return out, (float(coef.get("call", 0.0)) if call is None else call)


def _columns(pts, kind: str, blocks: bool) -> list:
    fill = np.array([max(1.0, N_SM / _programs(kind, t, h)) for t, h, _ in pts])
    cols = [np.array([h * t.full for t, h, _ in pts], dtype=np.float64) * fill,
            np.array([h * t.partial for t, h, _ in pts], dtype=np.float64) * fill]
    if blocks:
        cols += [np.array([h * t.q_blocks for t, h, _ in pts], dtype=np.float64),
                 np.array([h * t.k_blocks for t, h, _ in pts], dtype=np.float64)]
    return cols


def fit_pass(points: Iterable[tuple[TileCounts, int, float]], kind: str,
             call: Optional[float] = None, floor: bool = False, blocks: bool = False,
             host: Optional[float] = None) -> PassCost:
    """Least squares on the relative error of ``(tiles, heads, seconds)`` points.

    ``call=None`` fits the per-call GPU term too; otherwise it is held at ``call``.
    ``blocks=True`` adds the per-query-block and per-key-block terms.
    ``host`` (seconds, measured): the points are GPU times (host hidden), the fit has no floor
    and the result's host time per call is ``host``.
    ``floor=True`` (points are do_bench times, host included) fits the host time as a floor
    (``t = max(floor, gpu)``): candidate floors are zero and quantiles of the measured times, the
    GPU part is refitted on the calls it predicts above the floor, and the floor with the lowest
    rms relative error wins.
    """
    pts = [(t, h, s) for t, h, s in points if s > 0 and t.live > 0]
    if not pts:
        raise ValueError(f"no {kind} points to fit")
    cols = _columns(pts, kind, blocks)
    y = np.array([s for _, _, s in pts])
    if host is not None:
        coef, c = _fit_columns(cols, y, np.ones(len(y), dtype=bool), call)
        lin = c + sum(a * x for a, x in zip(coef, cols))
        rms = float(np.sqrt(np.mean((lin / y - 1.0) ** 2)))
        return PassCost(coef[0], coef[1], c, rms, len(pts), float(host), *(coef[2:4] if blocks else (0.0, 0.0)),
                        host_measured=True, fitted_on="gpu")
    best = None
    for lo in [0.0] + (list(np.quantile(y, np.linspace(0.0, 0.5, 26))) if floor else []):
        use = np.ones(len(y), dtype=bool)
        for _ in range(8):  # refit on the calls above the floor until that set is stable
            coef, c = _fit_columns(cols, y, use, call)
            lin = c + sum(a * x for a, x in zip(coef, cols))
            above = lin >= lo
            if above.sum() < 3 or (above == use).all():
                break
            use = above
        rms = float(np.sqrt(np.mean((np.maximum(lin, lo) / y - 1.0) ** 2)))
        if best is None or rms < best.rms_rel_err - 1e-4:  # a floor must earn its place
            best = PassCost(coef[0], coef[1], c, rms, len(pts), float(lo),
                            *(coef[2:4] if blocks else (0.0, 0.0)))
    return best


def tile_counts(startend_row_indices, causal: bool, q_rows: int, keys: int) -> TileCounts:
    """Live full/partial 128x128 tiles of a mask (summed over batch and mask heads)."""
    from flashmask3.masks import PARTIAL, UNMASKED, classify_tiles

    cls = classify_tiles(startend_row_indices, causal, q_rows, keys, TILE, TILE)
    batch = 1 if startend_row_indices is None else startend_row_indices.shape[0]
    return TileCounts(int((cls == UNMASKED).sum()), int((cls == PARTIAL).sum()), q_rows, keys, batch)


# -- the committed kernel tables ------------------------------------------------------------------

_KERNEL_TILES_CACHE: dict = {}


def _kernel_row_tiles(mask: str, s: int, batch: int) -> TileCounts:
    key = (mask, s, batch)
    if key not in _KERNEL_TILES_CACHE:
        from benchmarks.kernel import build_mask

        fm, causal, _ = build_mask(mask, s, batch)
        cols = None if fm is None else fm.startend_row_indices
        t = tile_counts(cols, causal, s, s)
        if fm is None and batch > 1:
            t = TileCounts(t.full * batch, t.partial * batch, s, s, batch)
        _KERNEL_TILES_CACHE[key] = t
    return _KERNEL_TILES_CACHE[key]


def kernel_table_points(path: str, impl: str, head_dim: int, gqa: bool, passes=("fwd", "bwd"),
                        max_seqlen: int = 131072) -> dict[str, list]:
    """``{pass: [(tiles, heads, seconds)]}`` from a committed ``kernel*.json`` table."""
    with open(path) as f:
        rows = json.load(f)["results"]
    out = {p: [] for p in passes}
    for r in rows:
        if r["D"] != head_dim or (r["Hq"] != r["Hk"]) != gqa or r["S"] > max_seqlen:
            continue
        m = r["impls"].get(impl) or {}
        if not m or m.get("skipped"):
            continue
        try:
            tiles = _kernel_row_tiles(r["mask"], r["S"], r["B"])
        except Exception:  # a mask this checkout cannot build: skip the row
            continue
        for p in passes:
            ms = m.get(f"{p}_ms")
            if ms:
                out[p].append((tiles, r["Hq"], ms * 1e-3))
    return out


def fit_from_kernel_tables(impl: str = "flashmask3", head_dim: int = 128, gqa: bool = True,
                           fwd_file: str = "kernel.json", bwd_file: Optional[str] = None,
                           label: Optional[str] = None) -> AttentionCost:
    """Fit from committed tables (per-call overhead held at :data:`ASSUMED_CALL`).

    Falls back to the other GQA class when a table has no rows of the requested one."""
    bwd_file = bwd_file or fwd_file
    parts = {}
    for kind, fname in (("fwd", fwd_file), ("bwd", bwd_file)):
        path = os.path.join(RESULTS, fname)
        pts = kernel_table_points(path, impl, head_dim, gqa, passes=(kind,))[kind]
        used_gqa = gqa
        if not pts:
            used_gqa = not gqa
            pts = kernel_table_points(path, impl, head_dim, used_gqa, passes=(kind,))[kind]
        parts[kind] = fit_pass(pts, kind, call=ASSUMED_CALL[kind])
    src = label or (f"fitted from committed kernel tables ({impl}: fwd {fwd_file}, bwd {bwd_file}; "
                    "per-call overhead assumed)")
    return AttentionCost(parts["fwd"], parts["bwd"], src, head_dim, gqa)


def measured_rows(path: str = MEASURED_FILE, head_dim: int = 128, gqa: bool = True) -> tuple[list[dict], dict]:
    """The timed attention rows of a ``scale_model_attention.json`` at one head dim / GQA
    class, and the file's environment."""
    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data["attention"] if r["head_dim"] == head_dim
            and (r["heads"] != r["kv_heads"]) == gqa and "fwd_ms" in r]
    return rows, data.get("env", {})


def measured_env(path: Optional[str] = None) -> dict:
    """The environment (GPU, date, versions, command) recorded in a measurement file."""
    path = path or MEASURED_FILE
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("env", {})


def row_tiles(r: dict) -> TileCounts:
    return TileCounts(r["full_tiles"], r["partial_tiles"], r["q_rows"], r["keys"], 1)


#: Fit the per-block terms on the per-rank measurements (the kernel tables cannot separate them).
MEASURED_BLOCKS = True


def has_gpu_times(rows: list[dict]) -> bool:
    """Whether measured rows carry GPU and host times (scale-model.sh since session 18)."""
    return bool(rows) and all(k in r for r in rows for k in ("gpu_fwd_ms", "gpu_fwd_bwd_ms",
                                                               "host_fwd_us", "host_fwd_bwd_us"))


def measured_host(rows: list[dict]) -> tuple[float, float]:
    """Median host seconds per call: forward, and backward (= fwd+bwd - fwd)."""
    fwd = float(np.median([r["host_fwd_us"] for r in rows])) * 1e-6
    fb = float(np.median([r["host_fwd_bwd_us"] for r in rows])) * 1e-6
    return fwd, max(0.0, fb - fwd)


def fit_rows(rows: list[dict], source: str, head_dim: int = 128, gqa: bool = True,
             blocks: bool = MEASURED_BLOCKS, use_gpu_times: Optional[bool] = None) -> AttentionCost:
    """Forward and backward (= fwd+bwd - fwd) fits of measured rows.

    With GPU and host times in the rows (default when present): the GPU part on the GPU time,
    the host time per call measured. Without: the do_bench time with a fitted host floor."""
    gpu = has_gpu_times(rows) if use_gpu_times is None else use_gpu_times
    fk, fbk = ("gpu_fwd_ms", "gpu_fwd_bwd_ms") if gpu else ("fwd_ms", "fwd_bwd_ms")
    pts = {"fwd": [], "bwd": []}
    for r in rows:
        t = row_tiles(r)
        pts["fwd"].append((t, r["heads"], r[fk] * 1e-3))
        if fbk in r:
            pts["bwd"].append((t, r["heads"], (r[fbk] - r[fk]) * 1e-3))
    if gpu:
        hf, hb = measured_host(rows)
        return AttentionCost(fit_pass(pts["fwd"], "fwd", blocks=blocks, host=hf),
                             fit_pass(pts["bwd"], "bwd", blocks=blocks, host=hb), source, head_dim, gqa)
    return AttentionCost(fit_pass(pts["fwd"], "fwd", floor=True, blocks=blocks),
                         fit_pass(pts["bwd"], "bwd", floor=True, blocks=blocks), source, head_dim, gqa)


def fit_from_measured(path: str = MEASURED_FILE, head_dim: int = 128, gqa: bool = True) -> AttentionCost:
    """Fit from the per-rank-shape measurements of ``benchmarks/gpu/scale-model.sh``."""
    rows, env = measured_rows(path, head_dim, gqa)
    src = (f"measured: per-rank shapes on {env.get('gpu', '?')} ({env.get('date', '?')}), "
           f"{os.path.basename(path)}")
    return fit_rows(rows, src, head_dim, gqa)


def attention_cost(impl: str = "flashmask3", head_dim: int = 128, gqa: bool = True,
                   prefer_measured: bool = True) -> AttentionCost:
    """The calibration the model uses: measured per-rank shapes if committed, else the tables."""
    if impl == "flashmask3" and prefer_measured and os.path.exists(MEASURED_FILE):
        try:
            return fit_from_measured(MEASURED_FILE, head_dim, gqa)
        except (ValueError, KeyError):
            pass
    return fit_from_kernel_tables(impl, head_dim, gqa)


def old_kernel_cost(gqa: bool = True) -> AttentionCost:
    """The kernel the committed multi-GPU / per-rank CP runs used (2026-11-29 ~13:00: v2
    forward + v1 backward, commit 234a020): forward from ``kernel_v2_final.json``, backward
    from ``kernel_v1_d128.json``."""
    return fit_from_kernel_tables("flashmask3", 128, gqa, fwd_file="kernel_v2_final.json",
                                  bwd_file="kernel_v1_d128.json",
                                  label="fitted from kernel_v2_final.json (fwd) + kernel_v1_d128.json "
                                        "(bwd): the kernel of the 2026-11-29 CP runs; per-call "
                                        "overhead assumed")


# -- matmuls ----------------------------------------------------------------------------------------

MATMUL_FILE = os.path.join(RESULTS, "scale_model_matmul.json")


def matmul_tflops(cluster, shape_key: Optional[str] = None) -> tuple[float, str]:
    """Achieved bf16 TFLOP/s for the model's matmuls: measured at the shape (the nearest token
    count of the same model dims) if committed, else the measured dense ceiling x an assumed
    efficiency. ``shape_key`` = ``"{tokens}x{hidden}x{ffn}"``."""
    if shape_key and os.path.exists(MATMUL_FILE):
        with open(MATMUL_FILE) as f:
            data = json.load(f)
        tokens, dims = shape_key.split("x", 1)
        same = [r for r in data.get("matmul", []) if r.get("key", "").split("x", 1)[-1] == dims]
        if same:
            best = min(same, key=lambda r: abs(math.log(int(r["key"].split("x")[0]) / int(tokens))))
            return best["tflops"], f"measured ({os.path.basename(MATMUL_FILE)}, {best['key']})"
    eff = cluster.matmul_tflops.value * cluster.matmul_efficiency.value
    return eff, "measured dense ceiling x assumed efficiency"


def as_dict(cost: AttentionCost) -> dict:
    return asdict(cost)


# -- the cached fits the CLI uses ----------------------------------------------------------------

CALIBRATION_FILE = os.path.join(RESULTS, "scale_model_calibration.json")
#: name -> how to fit it. "flashmask3": the current kernels; "flex": FlexAttention (the torch
#: context_parallel style baseline); "flashmask3_old": the kernel of the committed CP runs.
FITS = {
    "flashmask3": lambda gqa: attention_cost("flashmask3", 128, gqa),
    "flex": lambda gqa: fit_from_kernel_tables("flex", 128, gqa),
    "flashmask3_old": lambda gqa: old_kernel_cost(gqa),
}


def build_calibration(path: str = CALIBRATION_FILE, progress=None) -> dict:
    """Fit every kernel family (slow: builds the kernel tables' masks) and write ``path``."""
    out = {}
    for name, fn in FITS.items():
        for gqa in (False, True):
            out[f"{name}:{'gqa' if gqa else 'mha'}"] = asdict(fn(gqa))
            if progress is not None:
                progress.update(1)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def _from_dict(d: dict) -> AttentionCost:
    return AttentionCost(PassCost(**d["fwd"]), PassCost(**d["bwd"]), d["source"], d["head_dim"], d["gqa"])


def load_cost(name: str = "flashmask3", gqa: bool = True, path: str = CALIBRATION_FILE) -> AttentionCost:
    """A fitted cost from the cached calibration (fitted now when the cache lacks it)."""
    key = f"{name}:{'gqa' if gqa else 'mha'}"
    fresh = os.path.exists(path) and (not os.path.exists(MEASURED_FILE)
                                      or os.path.getmtime(path) >= os.path.getmtime(MEASURED_FILE))
    if fresh:
        with open(path) as f:
            data = json.load(f)
        if key in data:
            return _from_dict(data[key])
    if name not in FITS:
        raise ValueError(f"unknown kernel family {name!r}; choose from {sorted(FITS)}")
    return FITS[name](gqa)


def with_host(cost: AttentionCost, fwd_s: float, bwd_s: float, label: str) -> AttentionCost:
    """``cost`` with another host time per call (seconds; forward, backward = fwd+bwd - fwd): the
    host-path sweep (today's measured host cost, issue 25's targets, zero)."""
    from dataclasses import replace

    return replace(cost, fwd=replace(cost.fwd, floor=fwd_s), bwd=replace(cost.bwd, floor=bwd_s),
                   source=f"{cost.source}; host per call {label}")
