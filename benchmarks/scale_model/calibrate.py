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
key-block programs in the backward). That is the ``"fill"`` schedule, used where only a call's
total tiles are known (the kernel tables, older measurement files).

Where the tiles of every kernel program are known (:class:`ProgramWork`, recreated from the plans
the measurement built), the ``"greedy"`` schedule charges what the GPU does: the forward launches
one program per (128-row query block, query head), the fused backward one per (128-key block, KV
head) looping over the ``Hq / Hk`` query heads of its group (``gluon_fwd.launch_fwd_gluon``,
``gluon_bwd.launch_dkdv_gluon``); a program costs ``a_program + group x (a_full x its full tiles +
a_partial x its partial tiles)`` on one SM, the block scheduler hands programs in launch order to
whichever of the 132 SMs frees first (one resident program per SM: both kernels' shared-memory
rings exceed half an SM's 228 KB), and

    gpu = call + makespan(programs) + heads * (a_qblock * q_blocks + a_kblock * k_blocks)

where the block terms are now the passes over all rows that fill the whole GPU (the backward's
delta/lse pre-pass and dQ scaling). Under document masks the work per query block is very
uneven, so with few programs per call the slowest SM, not the total, sets the time.

Forward and backward (= fwd+bwd - fwd) apart, per head dim and GQA class, fitted by least
squares on relative error from:

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
from dataclasses import replace, asdict, dataclass, field
from typing import Iterable, Optional

import numpy as np

from .params import MATMUL_EFFICIENCY

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
MEASURED_FILE = os.path.join(RESULTS, "scale_model_attention.json")
TILE = 128
N_SM = 132
#: Per-call GPU overhead assumed when the data cannot separate it (launch tail, prologue).
ASSUMED_CALL = {"fwd": 20e-6, "bwd": 50e-6}
#: (query rows, keys) of one program's tile at D=128 bf16 on Hopper (``dispatch.TABLE``, mask
#: without a row-span hint, as the CP runtime and the measurement call it): forward 128x128,
#: fused backward 64x128. One program per (query block, query head) forward, per (key block, KV
#: head) backward.
FWD_TILE, BWD_TILE = (128, 128), (64, 128)
#: Programs resident per SM: one (forward: Q + 2-stage K/V rings = 160 KB of shared memory;
#: fused backward: K, V, Q/dO rings, P and dS = 160 KB+; an SM has 228 KB).
PROGRAMS_PER_SM = 1
SLOTS = N_SM * PROGRAMS_PER_SM


@dataclass(frozen=True)
class ProgramWork:
    """Live tiles of every kernel program of one call (one mask head, batch 1).

    ``fwd_*``: per 128-row query block, its live 128x128 tiles (what one forward program, one
    query head, runs); ``bwd_*``: per 128-key block, its live 64x128 tiles (what one fused
    backward program runs per query head of its group). In launch order (local row / key order)."""

    fwd_full: np.ndarray
    fwd_partial: np.ndarray
    bwd_full: np.ndarray
    bwd_partial: np.ndarray

    def totals(self) -> tuple[int, int]:
        """(full, partial) 128x128 tiles of the call: the forward's per-block counts summed."""
        return int(self.fwd_full.sum()), int(self.fwd_partial.sum())


def _per_program(startend_row_indices, causal: bool, q_rows: int, keys: int, tile, axis: int):
    from flashmask3.masks import PARTIAL, UNMASKED, classify_tiles

    cls = classify_tiles(startend_row_indices, causal, q_rows, keys, *tile)
    if cls.shape[0] * cls.shape[1] != 1:
        raise ValueError("per-program work: batch 1 and one mask head only")
    cls = cls[0, 0]
    return ((cls == UNMASKED).sum(axis).numpy().astype(np.int32),
            (cls == PARTIAL).sum(axis).numpy().astype(np.int32))


def program_work(startend_row_indices, causal: bool, q_rows: int, keys: int) -> ProgramWork:
    """Per-program live tiles of one call's mask (the mask layer's tile rule at the kernels'
    tiles, :data:`FWD_TILE` summed over keys, :data:`BWD_TILE` summed over queries)."""
    ff, fp = _per_program(startend_row_indices, causal, q_rows, keys, FWD_TILE, 1)
    bf, bp = _per_program(startend_row_indices, causal, q_rows, keys, BWD_TILE, 0)
    return ProgramWork(ff, fp, bf, bp)


def _waves(programs: int, sms: int) -> int:
    return -(-programs // sms)


#: The GQA K/V expansion rules the model can apply (``PassCost.kv_rule``), each a function of
#: ``(grouped programs P, group g, SMs)`` like ``dispatch.kv_expansion``: ``"library"`` is that
#: rule ("waves" below, for grouped grids of at most 4 waves); ``"half"`` the library's rule
#: before session 20 (expanded waves at most half the group: ``2 ceil(Pg/SMs) <= g``); ``"lt_group"``: the
#: expanded grid needs fewer waves than the grouped programs have heads (``ceil(Pg/SMs) < g``);
#: ``"waves"``: fewer waves of one head than the grouped grid's waves of ``g`` heads
#: (``ceil(Pg/SMs) < g ceil(P/SMs)``, which also expands grids of a few waves with a ragged
#: tail); ``"never"`` / ``"always"``. Two more are chosen per call by :class:`PassCost` from its
#: own costs: ``"best"`` (grouped or expanded, whichever the model predicts faster, copies and
#: their launches included: an oracle no shape rule beats) and ``"split"`` (the same over every
#: partial expansion, K/V repeated to ``e`` heads per KV head, ``e`` dividing ``g``).
def _library_rule(**kwargs):
    """``dispatch.kv_expansion`` with ``kwargs`` (imported when first used)."""
    def rule(p, g, sms):
        from flashmask3.kernels.dispatch import kv_expansion

        return kv_expansion(p, g, sms, **kwargs)
    return rule


KV_RULES = {
    "library": _library_rule(),
    "half": lambda p, g, sms: g > 1 and 2 * _waves(p * g, sms) <= g,  # the library's rule until session 20
    "lt_group": lambda p, g, sms: g > 1 and _waves(p * g, sms) < g,
    "waves": _library_rule(max_waves=None),
    "never": lambda p, g, sms: False,
    "always": lambda p, g, sms: g > 1,
}
KV_CHOSEN = ("best", "split")


def expansion_factor(t: "TileCounts", w: ProgramWork, heads: int, kv_heads: int, rule: str = "library") -> int:
    """K/V heads per KV head the backward runs with under a shape rule of :data:`KV_RULES`: the
    group ``g`` (expanded to the query heads) or 1 (grouped); a measured call as it ran
    (``t.kv_expanded``)."""
    group = max(1, heads // kv_heads)
    if group == 1:
        return 1
    if t.kv_expanded is not None:
        return group if t.kv_expanded else 1
    return group if KV_RULES[rule](t.batch * kv_heads * len(w.bwd_full), group, N_SM) else 1


def backward_grid(t: "TileCounts", w: ProgramWork, heads: int, kv_heads: int, rule: str = "library",
                  factor: Optional[int] = None) -> tuple[int, int, bool]:
    """``(query heads per program, sweeps over the key blocks, expanded)`` of a call's fused
    backward: one program per (key block, KV head) looping over its group, or, where the
    library expands K/V (``dispatch.kv_expansion``, another rule of :data:`KV_RULES`, or as
    ``t.kv_expanded`` records a measured call), one per (key block, query head). ``factor``
    (a divisor of the group) forces K/V repeated to ``factor`` heads per KV head."""
    group = max(1, heads // kv_heads)
    e = expansion_factor(t, w, heads, kv_heads, rule) if factor is None else factor
    if group % e:
        raise ValueError(f"expansion factor {e} does not divide the GQA group {group}")
    return group // e, kv_heads * e * t.batch, e > 1


def program_grid(t: "TileCounts", kind: str, heads: int, kv_heads: int, rule: str = "library",
                 factor: Optional[int] = None):
    """``(full tiles, partial tiles of each program of one sweep, heads per program, sweeps)``
    of a call of pass ``kind``: the forward sweeps its query blocks once per query head, the
    backward its key blocks per :func:`backward_grid`."""
    w = t.work if t.work is not None else uniform_work(t)
    if kind == "fwd":
        return w.fwd_full, w.fwd_partial, 1, heads * t.batch
    group, sweeps, _ = backward_grid(t, w, heads, kv_heads, rule, factor)
    return w.bwd_full, w.bwd_partial, group, sweeps


#: The split backward's extra work per call (each GQA group over one program per query head,
#: the kernels' KV_SPLIT): the one launch that sums the fp32 partial dK and dV, reading them
#: (bytes ~ 2 x keys x query heads x D x 4 at the measured HBM bandwidth, D=128; the kernel's
#: own partial stores happen at each program's end, overlapped with other programs' compute,
#: and are not counted), and that launch on the host (the H200 host's bare launch, 19-25 us:
#: benchmarks/results/host_breakdown.md). On the session-26 A/B (gqa_expand_ab.json) the
#: expanded arms' mean error is +5.4% with this count, +2.9% counting nothing, +7.9% counting
#: the stores too (grouped arms: +2.2%). Until session 26 the library copied K/V to the query
#: heads and summed dK, dV with torch: four launches, 4 x keys x heads x D x 2 bytes.
EXPAND_HOST_S = 1 * 22e-6
#: A fit's expanded backward host: the measured difference between the expanded and the grouped
#: host-relevant calls (:func:`measured_host`) where each side has at least this many rows, else
#: :data:`EXPAND_HOST_S`.
MIN_EXPAND_ROWS = 5
EXPAND_BYTES_PER_KEY_HEAD = 2 * 128 * 4
HBM_BYTES_S = 4.3e12


def uniform_work(t: "TileCounts") -> ProgramWork:
    """A call's tiles spread evenly over its programs: the stand-in where only totals are known
    (a backward 128x128 tile = two 64x128 tiles)."""
    nq, nk = max(1, math.ceil(t.q_rows / FWD_TILE[0])), max(1, math.ceil(t.keys / BWD_TILE[1]))
    return ProgramWork(np.full(nq, t.full / nq), np.full(nq, t.partial / nq),
                       np.full(nk, 2 * t.full / nk), np.full(nk, 2 * t.partial / nk))


_MAKESPAN_CACHE: dict = {}
#: fewer SMs than this: the heap loop is faster than :func:`greedy_makespan`'s rounds in numpy
_ROUNDS_MIN_SLOTS = 64
#: sorts one round may take before it goes to the heap (short programs chained on one SM)
_ROUND_PASSES = 8


def greedy_makespan(costs: np.ndarray, repeats: int, slots: int = SLOTS) -> float:
    """Finish time of ``repeats`` sweeps of programs of ``costs`` (seconds each, launch order)
    when each program goes to the SM that frees first: the block scheduler's greedy list
    schedule over ``slots`` identical SMs (memoised: the timeline asks for the same call often).

    Bit for bit the float of the heap loop it replaced (per program: pop the earliest free time
    ``t``, push ``t + c``; the makespan is the latest free time at the end), 2.5-3x faster by
    scheduling a round of ``slots`` programs per numpy sort. Costs are >= 0, so the pops never
    decrease; then the starts ``s`` (ascending) of a round of ``w`` programs ``c`` from free
    times ``F`` are the fixed point of ``s = sort(F, s + c)[:w]`` (program ``i`` takes the
    ``i``-th smallest of ``F`` and the round's finishes: later programs finish at >= ``s[i]``).
    From ``s = F[:w]`` (>= the true starts) each sort lowers ``s`` towards it and gets at least
    one more start right; an unchanged result is the fixed point (1-3 sorts for most rounds),
    and the rest of that sort is the free times after the round. Every value is a ``start + c``,
    the heap's own float addition, and which of equal free times an SM takes changes no value.
    A round still changing after ``_ROUND_PASSES`` sorts (short programs chained on one SM) goes
    to the heap, as do the next 1, 2, 4, ... rounds while that repeats; with fewer than
    ``_ROUNDS_MIN_SLOTS`` SMs or a negative or NaN cost, all of it does."""
    n = len(costs) * repeats
    if n == 0:
        return 0.0
    if n <= slots:
        return float(np.max(costs))
    key = (costs.tobytes(), repeats, slots)
    hit = _MAKESPAN_CACHE.get(key)
    if hit is None:
        jobs = np.tile(np.asarray(costs, dtype=np.float64), repeats)
        if slots < _ROUNDS_MIN_SLOTS or not jobs.min() >= 0:
            hit = max(_heap_schedule([0.0] * slots, jobs.tolist()))
        else:
            hit = _rounds_makespan(jobs, slots)
        _MAKESPAN_CACHE[key] = hit
        if len(_MAKESPAN_CACHE) > 200_000:
            _MAKESPAN_CACHE.clear()
    return hit


def _heap_schedule(free: list, jobs: list) -> list:
    """``free`` (a heap of the SMs' free times) after each of ``jobs`` in turn went to the SM
    that frees first."""
    import heapq

    rep = heapq.heapreplace
    for c in jobs:
        rep(free, free[0] + c)
    return free


def _rounds_makespan(jobs: np.ndarray, slots: int) -> float:
    """:func:`greedy_makespan` of the programs ``jobs`` (costs >= 0), a round at a time."""
    free = np.zeros(slots)  # the SMs' free times, ascending
    buf = np.empty(2 * slots)  # free times, then the round's finishes
    add = np.add
    i, backoff = 0, 1
    while i < len(jobs):
        c = jobs[i:i + slots]
        w = len(c)
        b = buf if w == slots else buf[:slots + w]
        finishes = b[slots:]
        start = free[:w]
        last = start.tobytes()
        for _ in range(_ROUND_PASSES):
            add(start, c, finishes)
            b[:slots] = free
            b.sort()
            start = b[:w]
            now = start.tobytes()
            if now == last:
                break
            last = now
        else:
            j = min(len(jobs), i + backoff * slots)
            free = np.sort(_heap_schedule(free.tolist(), jobs[i:j].tolist()))
            i, backoff = j, 2 * backoff
            continue
        free = b[w:].copy()
        i, backoff = i + w, 1
    return float(free[-1])


def critical_features(features: np.ndarray, theta: np.ndarray, repeats: int, slots: int = SLOTS) -> np.ndarray:
    """The summed feature rows of the programs on the SM that finishes last under
    :func:`greedy_makespan` with program costs ``features @ theta`` (the linear form of the
    makespan for that schedule: what the fit solves for, then reschedules)."""
    f = np.tile(features, (repeats, 1))
    costs = f @ theta
    if len(costs) <= slots:
        return f[int(np.argmax(costs))]
    import heapq

    # integer heap: time in ns << 8 | SM index (the SM rides along in the low bits)
    assert slots <= 256
    ticks = (np.maximum(np.rint(costs * 1e9), 0).astype(np.int64) << 8).tolist()
    heap = list(range(slots))
    rep = heapq.heapreplace
    slot = []
    for c in ticks:
        top = heap[0]
        slot.append(top & 255)
        rep(heap, top + c)
    sums = np.zeros((slots, f.shape[1]))
    np.add.at(sums, np.array(slot), f)
    return sums[int(np.argmax(sums @ theta))]


@dataclass(frozen=True)
class TileCounts:
    """Live tiles of one attention call (per mask head, summed over batch) and its shape."""

    full: int
    partial: int
    q_rows: int
    keys: int
    batch: int = 1
    #: per-program tiles where known (else None: the "greedy" schedule spreads the totals evenly)
    work: Optional[ProgramWork] = field(default=None, compare=False, repr=False)
    #: whether the backward ran with K/V expanded to the query heads (``dispatch.kv_expansion``):
    #: None = as the library decides now (predictions), False/True = as a measured call ran
    kv_expanded: Optional[bool] = field(default=None, compare=False)

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
    """Fitted cost of one pass (forward or backward) of one kernel family.

    ``schedule="fill"``: ``a_full`` / ``a_partial`` are seconds per tile and query head of the
    whole GPU, stretched by ``fill`` for calls with fewer programs than SMs. ``schedule="greedy"``:
    they are seconds per tile on one SM (one program), ``a_program`` the fixed cost of a program,
    and the call takes the greedy makespan of its programs (module docstring)."""

    a_full: float      # seconds per full tile (per query head; "greedy": on one SM)
    a_partial: float   # seconds per partial tile (likewise)
    call: float        # seconds of GPU time per call
    rms_rel_err: float
    points: int
    floor: float = 0.0  # seconds: host time per call (a stream of calls costs max(host, GPU))
    a_qblock: float = 0.0  # seconds per query block per query head
    a_kblock: float = 0.0  # seconds per key block per query head
    host_measured: bool = False  # floor = measured host time per call (else fitted or none)
    fitted_on: str = "do_bench"  # the time the GPU part was fitted on: "gpu" or "do_bench"
    a_program: float = 0.0  # "greedy": seconds per program whatever its tiles (prologue/epilogue)
    schedule: str = "fill"  # "fill", "greedy", or "filled" (greedy's programs spread evenly over
    #                         every SM: the attribution's "no SM underfill" case, not a fit)
    # kernel variants the model can predict (greedy/filled schedules; the fit is on the kernels
    # as they are: "library" rule, launch order): the backward's GQA K/V expansion rule
    # (KV_RULES / KV_CHOSEN) and the programs' launch order ("launch" or "longest")
    kv_rule: str = "library"
    order: str = "launch"
    # backward: the host time an expanded GQA backward adds to ``floor`` (measured by
    # :func:`measured_host` where the file can tell, else the one launch of EXPAND_HOST_S)
    expand_host: float = EXPAND_HOST_S

    def gpu_seconds(self, tiles: TileCounts, heads: int, programs: int) -> float:
        """GPU time of one call (host work hidden), ``"fill"`` schedule."""
        if tiles.live == 0:
            return 0.0
        fill = max(1.0, N_SM / max(programs, 1))
        return self.call + heads * ((self.a_full * tiles.full + self.a_partial * tiles.partial) * fill
                                    + self.a_qblock * tiles.q_blocks + self.a_kblock * tiles.k_blocks)

    def program_costs(self, tiles: TileCounts, kind: str, heads: int, kv_heads: int,
                      factor: Optional[int] = None) -> tuple[np.ndarray, int]:
        """``(seconds of each program of one sweep, sweeps)``: the forward sweeps its query
        blocks once per query head, the backward its key blocks once per KV head, each backward
        program looping over the ``heads / kv_heads`` query heads of its group (over
        ``heads / kv_heads / factor`` with K/V expanded ``factor``-fold: :meth:`bwd_factor`)."""
        if kind != "fwd" and factor is None:
            factor = self.bwd_factor(tiles, heads, kv_heads)
        full, part, group, sweeps = program_grid(tiles, kind, heads, kv_heads, self.kv_rule, factor)
        return self.a_program + group * (self.a_full * full + self.a_partial * part), sweeps

    def span(self, costs: np.ndarray, sweeps: int) -> float:
        """Makespan of ``sweeps`` sweeps of programs of ``costs`` under this schedule and launch
        :attr:`order`: ``"launch"`` (program ids in grid order, what the kernels do now),
        ``"longest"`` (ids permuted by descending cost, every sweep of a block together: the
        longest-processing-time-first list schedule, as FA3's causal scheduler orders its
        blocks); ``"filled"``: the total over every SM."""
        if self.schedule == "filled":
            return float(costs.sum()) * sweeps / SLOTS
        if self.order == "longest":
            return greedy_makespan(np.repeat(np.sort(costs)[::-1], sweeps), 1)
        if self.order != "launch":
            raise ValueError(f"order must be 'launch' or 'longest', got {self.order!r}")
        return greedy_makespan(costs, sweeps)

    def gpu_time(self, tiles: TileCounts, kind: str, heads: int, kv_heads: int,
                 factor: Optional[int] = None) -> float:
        """GPU time of one call of pass ``kind`` ("fwd"/"bwd") under this cost's schedule
        (``factor``: the backward's K/V expansion, default :meth:`bwd_factor`)."""
        if self.schedule not in ("greedy", "filled"):
            return self.gpu_seconds(tiles, heads, _programs(kind, tiles, heads))
        if tiles.live == 0:
            return 0.0
        if kind != "fwd" and factor is None:
            factor = self.bwd_factor(tiles, heads, kv_heads)
        costs, sweeps = self.program_costs(tiles, kind, heads, kv_heads, factor)
        return (self.call + self.span(costs, sweeps)
                + heads * (self.a_qblock * tiles.q_blocks + self.a_kblock * tiles.k_blocks)
                + self._expansion_gpu(tiles, kind, kv_heads, factor))

    def _expansion_gpu(self, tiles: TileCounts, kind: str, kv_heads: int, factor: Optional[int]) -> float:
        """GPU seconds of a split backward's partial dK/dV traffic (:data:`EXPAND_BYTES_PER_KEY_HEAD`
        per key and expanded head)."""
        if kind == "fwd" or not factor or factor <= 1:
            return 0.0
        return tiles.keys * tiles.batch * kv_heads * factor * EXPAND_BYTES_PER_KEY_HEAD / HBM_BYTES_S

    def bwd_factor(self, tiles: TileCounts, heads: int, kv_heads: int) -> int:
        """K/V heads per KV head of this call's backward (1: grouped, the group: expanded to
        the query heads) under :attr:`kv_rule` (:data:`KV_RULES`, or chosen per call from these
        costs for ``"best"`` / ``"split"``, a measured call's ``kv_expanded`` first)."""
        group = heads // kv_heads if kv_heads else 1
        if self.schedule not in ("greedy", "filled") or group <= 1:
            return 1
        w = tiles.work if tiles.work is not None else uniform_work(tiles)
        if tiles.kv_expanded is not None or self.kv_rule not in KV_CHOSEN:
            return expansion_factor(tiles, w, heads, kv_heads, self.kv_rule)
        opts = [1, group] if self.kv_rule == "best" else [e for e in range(1, group + 1) if group % e == 0]
        return min(opts, key=lambda e: (self.time(tiles, "bwd", heads, kv_heads, factor=e), e))

    def _expanded(self, tiles: TileCounts, heads: int, kv_heads: int) -> bool:
        return self.bwd_factor(tiles, heads, kv_heads) > 1

    def seconds(self, tiles: TileCounts, heads: int, programs: int) -> float:
        """Time of one call in a stream of calls: the slower of its host and its GPU work
        (``"fill"`` schedule; :meth:`time` for either)."""
        if tiles.live == 0:
            return 0.0
        return max(self.floor, self.gpu_seconds(tiles, heads, programs))

    def time(self, tiles: TileCounts, kind: str, heads: int, kv_heads: int,
             factor: Optional[int] = None) -> float:
        """Time of one call in a stream of calls: ``max(host, GPU)`` (an expanded backward's
        host pays :attr:`expand_host` more: the partials' sum launch and its Python)."""
        if tiles.live == 0:
            return 0.0
        if kind != "fwd" and factor is None:
            factor = self.bwd_factor(tiles, heads, kv_heads)
        host = self.floor
        if kind != "fwd" and host and factor > 1:
            host += self.expand_host
        return max(host, self.gpu_time(tiles, kind, heads, kv_heads, factor))

    def describe(self) -> str:
        """The coefficients in words (units depend on the schedule)."""
        if self.schedule in ("greedy", "filled"):
            return (f"{self.a_program * 1e6:.2f} us per program + {self.a_full * 1e6:.2f}/{self.a_partial * 1e6:.2f} "
                    f"us per full/partial tile on one SM, greedy over {SLOTS} SMs, + {self.a_qblock * 1e9:.0f} ns per "
                    f"query block-head + {self.call * 1e6:.0f} us/call GPU")
        return (f"{self.a_full * 1e9:.2f}/{self.a_partial * 1e9:.2f} ns per full/partial tile-head + "
                f"{self.a_qblock * 1e9:.0f}/{self.a_kblock * 1e9:.0f} ns per query/key block-head + "
                f"{self.call * 1e6:.0f} us/call GPU")


@dataclass(frozen=True)
class AttentionCost:
    """Forward and backward cost of one kernel family at one head dim / GQA class.

    ``kv_heads`` (default ``heads``) matters to the ``"greedy"`` backward only: its programs are
    per KV head."""

    fwd: PassCost
    bwd: PassCost
    source: str
    head_dim: int
    gqa: bool
    group: int = 1  # query heads per KV head of the calls it was fitted on (or interpolated to)
    interpolated: bool = False  # made by :func:`between` from two fits, not fitted itself

    def forward(self, tiles: TileCounts, heads: int, kv_heads: Optional[int] = None) -> float:
        return self.fwd.time(tiles, "fwd", heads, kv_heads or heads)

    def backward(self, tiles: TileCounts, heads: int, kv_heads: Optional[int] = None) -> float:
        return self.bwd.time(tiles, "bwd", heads, kv_heads or heads)

    def backward_stage(self, tiles: TileCounts, heads: int, kv_heads: Optional[int] = None) -> float:
        """One staged ``backward_stage`` call (overlap mode): tiles, key blocks and the per-call
        cost, without the per-query-block term, which the runtime pays once per layer in
        ``backward_prepare`` / ``backward_finish`` (:meth:`backward_query_blocks`)."""
        return self._staged_bwd().time(tiles, "bwd", heads, kv_heads or heads)

    def gpu_backward_stage(self, tiles: TileCounts, heads: int, kv_heads: Optional[int] = None) -> float:
        """:meth:`backward_stage`'s GPU part alone (host hidden)."""
        return self._staged_bwd().gpu_time(tiles, "bwd", heads, kv_heads or heads)

    def _staged_bwd(self) -> PassCost:
        """The backward's cost without its per-query-block term (charged once per layer)."""
        return replace(self.bwd, a_qblock=0.0)

    def backward_query_blocks(self, tiles: TileCounts, heads: int) -> float:
        """The backward's per-query-block GPU time (delta/lse pre-pass, dQ zeroing and scaling),
        charged once per layer in overlap mode (``tiles``: any stage over all local query rows)."""
        return self.bwd.a_qblock * tiles.q_blocks * heads

    def gpu_forward(self, tiles: TileCounts, heads: int, kv_heads: Optional[int] = None) -> float:
        return self.fwd.gpu_time(tiles, "fwd", heads, kv_heads or heads)

    def gpu_backward(self, tiles: TileCounts, heads: int, kv_heads: Optional[int] = None) -> float:
        return self.bwd.gpu_time(tiles, "bwd", heads, kv_heads or heads)

    def describe(self) -> str:
        f, b = self.fwd, self.bwd
        return (f"{self.source}; D={self.head_dim} {'GQA' if self.gqa else 'MHA'}: fwd {f.describe()}, "
                f"host {f.floor * 1e6:.0f} us/call ({_host_kind(f)}; "
                f"rms rel. err {f.rms_rel_err:.1%} on {f.fitted_on} time, {f.points} pts); bwd {b.describe()}, "
                f"host {b.floor * 1e6:.0f} us/call ({_host_kind(b)}; rms "
                f"{b.rms_rel_err:.1%} on {b.fitted_on} time, {b.points} pts)")


def _host_kind(p: PassCost) -> str:
    if p.host_measured:
        return "measured"
    return "fitted floor of do_bench times" if p.floor > 0 else "none"



# -- fitting -------------------------------------------------------------------------------------


def _programs(kind: str, t: TileCounts, heads: int) -> int:
    rows = t.q_rows if kind == "fwd" else t.keys
    return math.ceil(rows / TILE) * heads * t.batch


def _fit_columns(cols: list, y, use, call: Optional[float],
                 weights: Optional[np.ndarray] = None) -> tuple[list[float], float]:
    """Least squares on the relative error of the ``use`` rows: the coefficients of ``cols``
    (``[full, partial, *extra]``) and the per-call term (fitted when ``call`` is None);
    ``weights`` (one per row, default 1) weight each row's squared relative error.

    A negative partial-tile coefficient merges partial into full tiles (one cost for both: not
    identifiable apart); any other negative coefficient (block terms, per-call term) is held at
    zero and the rest refitted: a cost is never negative."""
    y = y[use]
    w = (1.0 if weights is None else np.sqrt(weights[use])) / y
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


#: Start of the "greedy" fit (seconds: per program, per full / partial tile on one SM) and its
#: rounds (rescheduling and reweighting: the critical SM's programs change little, the weights
#: settle in a few tens).
GREEDY_START, GREEDY_ROUNDS = (5e-6, 1.5e-6, 3e-6), 60
#: The norms of the relative errors the "greedy" fit tries, by iteratively reweighted least
#: squares (row weight |error|^(p-2)): p = 2 is least squares, a large p approaches the largest
#: error, the quantity the validation's target bounds. The reweighting interleaves with the
#: rescheduling and does not settle on one optimum, so each norm is a restart; the fit keeps the
#: one whose worst relative error on its own points is smallest (benchmarks/NOTES.md, session 22).
FIT_NORMS = (2.0, 4.0, 8.0, 12.0, 16.0)


def _program_features(t: TileCounts, kind: str, heads: int, kv_heads: int) -> tuple[np.ndarray, int]:
    """``([programs, 3] = (1, group x full, group x partial), sweeps)`` of one call's programs."""
    full, part, group, sweeps = program_grid(t, kind, heads, kv_heads)
    f = np.stack([np.ones(len(full)), group * np.asarray(full, float), group * np.asarray(part, float)], 1)
    return f, sweeps


def _lp_weights(rel_err: np.ndarray, previous: Optional[np.ndarray], p: float) -> np.ndarray:
    """Next IRLS row weights toward the L_p norm of ``rel_err`` (mean 1; damped by averaging with
    ``previous`` so the iteration does not oscillate between its worst rows)."""
    w = np.maximum(np.abs(rel_err), 1e-3) ** (p - 2.0)
    w = w / w.mean()
    return w if previous is None else 0.5 * (previous + w)


def fit_pass_greedy(points: Iterable[tuple[TileCounts, int, int, float]], kind: str, host: float,
                    blocks: bool = True, norms: tuple = FIT_NORMS) -> PassCost:
    """Fit the ``"greedy"`` schedule on GPU times ``(tiles with work, heads, kv_heads, seconds)``:
    :func:`_fit_greedy_lp` once per norm of ``norms``, keeping the fit with the smallest worst
    relative error on these points (ties: the earlier norm). ``host``: the measured host time
    per call."""
    pts = [q for q in points if q[3] > 0 and q[0].live > 0]
    if not pts:
        raise ValueError(f"no {kind} points to fit")
    if not norms or min(norms) < 2:
        raise ValueError(f"norms must be a non-empty tuple of numbers >= 2, got {norms!r}")
    fits = [_fit_greedy_lp(pts, kind, host, blocks, float(p)) for p in norms]
    return min(fits, key=lambda f: f[1])[0]


def _fit_greedy_lp(pts, kind: str, host: float, blocks: bool, p: float) -> tuple[PassCost, float]:
    """One ``"greedy"`` fit and its worst relative error. The makespan of a fixed schedule is
    linear in the costs: schedule the programs with the current coefficients, take the summed
    features of the SM that finishes last, solve a weighted least squares on relative error
    (``_fit_columns``: no negative cost) for ``call``, ``a_program``, ``a_full``, ``a_partial``
    (and, backward with ``blocks``, ``a_qblock``: the whole-GPU passes over the query rows),
    reschedule, reweight toward the L_``p`` norm (``p=2``: plain least squares, stops once the
    schedule settles), repeat; keep the round whose real makespans have the smallest worst error."""
    y = np.array([q[3] for q in pts])
    feats = [_program_features(t, kind, h, hk) for t, h, hk, _ in pts]
    qcol = np.array([h * t.q_blocks for t, h, _, _ in pts], dtype=np.float64)
    use = np.ones(len(y), dtype=bool)
    theta, weights = np.array(GREEDY_START), None
    best, best_worst = None, np.inf
    for _ in range(GREEDY_ROUNDS):
        crit = np.array([critical_features(f, theta, sw) for f, sw in feats])
        cols = [crit[:, 1], crit[:, 2], crit[:, 0]] + ([qcol] if blocks and kind == "bwd" else [])
        coef, call = _fit_columns(cols, y, use, None, weights)
        cost = PassCost(coef[0], coef[1], call, 0.0, len(pts), float(host),
                        a_qblock=coef[3] if len(coef) > 3 else 0.0, host_measured=True, fitted_on="gpu",
                        a_program=coef[2], schedule="greedy")
        err = np.array([cost.gpu_time(t, kind, h, hk) for t, h, hk, _ in pts]) / y - 1.0
        worst = float(np.max(np.abs(err)))
        if worst < best_worst:
            best, best_worst = replace(cost, rms_rel_err=float(np.sqrt(np.mean(err ** 2)))), worst
        new = np.maximum(np.array([coef[2], coef[0], coef[1]]), 1e-12)
        if p == 2.0 and np.allclose(new, theta, rtol=1e-3):
            break
        theta = new
        if p != 2.0:
            weights = _lp_weights(err, weights, p)
    return best, best_worst


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
    group = _table_group(os.path.join(RESULTS, fwd_file), head_dim) if gqa else 1
    return AttentionCost(parts["fwd"], parts["bwd"], src, head_dim, gqa, group)


def _table_group(path: str, head_dim: int) -> int:
    """Query heads per KV head of a kernel table's GQA rows at ``head_dim`` (1 without any)."""
    with open(path) as f:
        groups = sorted(r["Hq"] // r["Hk"] for r in json.load(f)["results"]
                        if r["D"] == head_dim and r["Hq"] != r["Hk"])
    return groups[len(groups) // 2] if groups else 1


def measured_rows(path: str = MEASURED_FILE, head_dim: int = 128, gqa: bool = True) -> tuple[list[dict], dict]:
    """The timed attention rows of a ``scale_model_attention.json`` at one head dim / GQA
    class, and the file's environment. Rows with GPU times also carry ``"_work"``: their
    per-program tiles rebuilt from the plans (:func:`attach_program_work`; None where the call
    cannot be rebuilt here)."""
    rows, env = _load_measured(path)
    return [r for r in rows if r["head_dim"] == head_dim and (r["heads"] != r["kv_heads"]) == gqa], env


_MEASURED_CACHE: dict = {}


def _load_measured(path: str) -> tuple[list[dict], dict]:
    """Every timed row of a measurement file (per-program tiles attached), cached per file
    version: rebuilding the plans' calls takes a second or two."""
    key = (os.path.abspath(path), os.path.getmtime(path))
    if key not in _MEASURED_CACHE:
        with open(path) as f:
            data = json.load(f)
        rows = [r for r in data["attention"] if "error" not in r and ("fwd_ms" in r or "gpu_fwd_ms" in r)]
        if has_gpu_times(rows):
            attach_program_work(rows, data)
        _MEASURED_CACHE[key] = (rows, data.get("env", {}))
    return _MEASURED_CACHE[key]


def attach_program_work(rows: list[dict], data: dict) -> None:
    """Set ``r["_work"]`` of every row to the :class:`ProgramWork` of its call, rebuilt the way
    ``measure.py`` built it (``measure.plan_calls``: same document lengths, cp, balance, nodes,
    rank and stage), or None where it cannot be rebuilt: no such call in today's plan, or its
    tile totals differ from the row's ``full_tiles`` / ``partial_tiles`` (a changed planner, or
    the ``corpus`` spread of a file without ``spreads``: that one is packed from the measuring
    machine's files)."""
    from benchmarks.corpus import document_spreads
    from benchmarks.scale_model.layout import file_tolerance
    from benchmarks.scale_model.measure import plan_calls

    tokens = data.get("args", {}).get("tokens", 131072)
    stored = data.get("spreads") or {}
    here = None
    groups: dict = {}
    for r in rows:
        r["_work"] = None
        if all(k in r for k in ("spread", "cp", "balance", "rank", "stage")):
            groups.setdefault((r["spread"], r["cp"], r["balance"]), []).append(r)
    for (spread, cp, balance), rs in groups.items():
        lens = stored.get(spread)
        if lens is None:
            here = here if here is not None else document_spreads(tokens, seed=0)
            lens = here.get(spread)
        calls = {}
        if lens is not None and sum(lens) == tokens:
            try:
                for meta, fm, keys in plan_calls(lens, spread, cp, balance,
                                                 tolerance=file_tolerance(data.get("args"))):
                    calls[(meta["rank"], str(meta["stage"]))] = (fm, keys)
            except ValueError:  # a cp the planner rejects for these lengths
                calls = {}
        works: dict = {}
        for r in rs:
            k = (r["rank"], str(r["stage"]))
            if k not in calls or calls[k][1] != r["keys"] or calls[k][0].seqlen_q != r["q_rows"]:
                continue
            if k not in works:
                fm, keys = calls[k]
                works[k] = program_work(fm.startend_row_indices, False, fm.seqlen_q, keys)
            if works[k].totals() == (r["full_tiles"], r["partial_tiles"]):
                r["_work"] = works[k]


def work_summary(rows: list[dict]) -> tuple[int, dict]:
    """``(rows with per-program tiles, {spread: rows without})``."""
    missing: dict = {}
    for r in rows:
        if r.get("_work") is None:
            missing[r.get("spread", "?")] = missing.get(r.get("spread", "?"), 0) + 1
    return sum(r.get("_work") is not None for r in rows), missing


def measured_env(path: Optional[str] = None) -> dict:
    """The environment (GPU, date, versions, command) recorded in a measurement file."""
    path = path or MEASURED_FILE
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("env", {})


def row_tiles(r: dict) -> TileCounts:
    # (calls measured before the expanded GQA backward existed, 2026-12-02 01:37, ran grouped)
    return TileCounts(r["full_tiles"], r["partial_tiles"], r["q_rows"], r["keys"], 1, work=r.get("_work"),
                      kv_expanded=r.get("kv_expanded", False))


#: Fit the per-block terms on the per-rank measurements (the kernel tables cannot separate them).
MEASURED_BLOCKS = True


def has_gpu_times(rows: list[dict]) -> bool:
    """Whether measured rows carry GPU and host times (scale-model.sh since session 18)."""
    return bool(rows) and all(k in r for r in rows for k in ("gpu_fwd_ms", "gpu_fwd_bwd_ms",
                                                               "host_fwd_us", "host_fwd_bwd_us"))


#: Fewest host-relevant rows (those with repeated stream samples) the host terms are taken from;
#: a file with fewer (before session 48) gives every row's host.
MIN_HOST_ROWS = 8


def host_rows(rows: list[dict]) -> list[dict]:
    """The rows whose host time sets the host terms: the host-relevant calls, which
    ``measure.repeat_streams`` sampled again over the whole run (their GPU time under twice
    their host time), where the file has at least :data:`MIN_HOST_ROWS`; else every row.

    Why not every row: the model's host term only matters where it binds, and a GPU-bound
    stream's host is measured while the GPU's queue is full: in the session-48 file its
    forward+backward host per call is a median 490 us against 410-465 us for the host-relevant
    calls (benchmarks/NOTES.md, session 50)."""
    rep = [r for r in rows if "stream_host_fwd_bwd_us_repeats" in r]
    return rep if len(rep) >= MIN_HOST_ROWS else rows


def measured_host(rows: list[dict]) -> tuple[float, float, float]:
    """``(forward, backward, expansion)`` host seconds per call from :func:`host_rows`: the
    median over the rows of each row's host time (forward; backward = fwd+bwd - fwd of the
    grouped calls) and what a GQA backward with K/V expanded adds (the median expanded call's
    fwd+bwd minus the grouped one's; :data:`EXPAND_HOST_S` where either side has fewer than
    :data:`MIN_EXPAND_ROWS` rows). A row's time: where every row has it, the host's CPU time per
    call of the stream of back-to-back calls the row timed (``stream_host_*``, per row the mean
    of its samples where it has repeats: what a rank's stream of stage calls pays, the quantity
    the model predicts; session 20 on), else the separate host loop's (``host_*``: the call
    alone, whose Python runs colder: a median of 109 against 69 us per forward in the same
    file)."""
    rows = host_rows(rows)
    stream = all("stream_host_fwd_us" in r and "stream_host_fwd_bwd_us" in r for r in rows)
    fk, fbk = ("stream_host_fwd_us", "stream_host_fwd_bwd_us") if stream else ("host_fwd_us", "host_fwd_bwd_us")
    fwd = float(np.median([sample_mean(r, fk) for r in rows])) * 1e-6
    grouped = [sample_mean(r, fbk) for r in rows if not r.get("kv_expanded")]
    expanded = [sample_mean(r, fbk) for r in rows if r.get("kv_expanded")]
    if min(len(grouped), len(expanded)) >= MIN_EXPAND_ROWS:
        fb = float(np.median(grouped)) * 1e-6
        expand = max(0.0, float(np.median(expanded)) * 1e-6 - fb)
    else:
        fb, expand = float(np.median(grouped + expanded)) * 1e-6, EXPAND_HOST_S
    return fwd, max(0.0, fb - fwd), expand


def sample_mean(r: dict, key: str) -> float:
    """A measured row's ``key``: the mean of its sample and its repeats where it has them
    (``measure.repeat_streams``, ``key + "_repeats"``), else its one sample. The mean, not the
    median: the model predicts throughput, a time average, and the H200 host's time per call
    switches between two levels from round to round (session 48's file: a forward's samples
    near 40 us or near 55-78 us), so a median of 16 samples picks one level (with it the
    repeated check was 508 of 522 within 15%, with the mean 518; benchmarks/NOTES.md, session 49)."""
    return float(np.mean([r[key]] + list(r.get(key + "_repeats", []))))


def fit_rows(rows: list[dict], source: str, head_dim: int = 128, gqa: bool = True,
             blocks: bool = MEASURED_BLOCKS, use_gpu_times: Optional[bool] = None,
             schedule: Optional[str] = None) -> AttentionCost:
    """Forward and backward (= fwd+bwd - fwd) fits of measured rows.

    With GPU and host times in the rows (default when present): the GPU part on the GPU time,
    the host time per call measured (median of every row); where rows carry per-program tiles
    (``"_work"``) the ``"greedy"`` schedule on those rows (``schedule="fill"`` forces the
    total-tiles model). Without GPU times: the do_bench time with a fitted host floor."""
    gpu = has_gpu_times(rows) if use_gpu_times is None else use_gpu_times
    group = int(np.median([r["heads"] // r.get("kv_heads", r["heads"]) for r in rows])) if gqa and rows else 1
    fk, fbk = ("gpu_fwd_ms", "gpu_fwd_bwd_ms") if gpu else ("fwd_ms", "fwd_bwd_ms")
    with_work = [r for r in rows if r.get("_work") is not None]
    if gpu and with_work and schedule != "fill":
        hf, hb, he = measured_host(rows)
        fwd = [(row_tiles(r), r["heads"], r["kv_heads"], r[fk] * 1e-3) for r in with_work]
        bwd = [(row_tiles(r), r["heads"], r["kv_heads"], (r[fbk] - r[fk]) * 1e-3) for r in with_work]
        src = f"{source}; greedy schedule fitted on {len(with_work)} of {len(rows)} calls (per-program tiles rebuilt)"
        return AttentionCost(fit_pass_greedy(fwd, "fwd", hf, blocks),
                             replace(fit_pass_greedy(bwd, "bwd", hb, blocks), expand_host=he), src, head_dim, gqa,
                             group)
    pts = {"fwd": [], "bwd": []}
    for r in rows:
        t = row_tiles(r)
        pts["fwd"].append((t, r["heads"], r[fk] * 1e-3))
        if fbk in r:
            pts["bwd"].append((t, r["heads"], (r[fbk] - r[fk]) * 1e-3))
    if gpu:
        hf, hb, he = measured_host(rows)
        return AttentionCost(fit_pass(pts["fwd"], "fwd", blocks=blocks, host=hf),
                             replace(fit_pass(pts["bwd"], "bwd", blocks=blocks, host=hb), expand_host=he),
                             source, head_dim, gqa, group)
    return AttentionCost(fit_pass(pts["fwd"], "fwd", floor=True, blocks=blocks),
                         fit_pass(pts["bwd"], "bwd", floor=True, blocks=blocks), source, head_dim, gqa, group)


def fit_from_measured(path: str = MEASURED_FILE, head_dim: int = 128, gqa: bool = True,
                      balance: Optional[str] = None) -> AttentionCost:
    """Fit from the per-rank-shape measurements of ``benchmarks/gpu/scale-model.sh``
    (``balance``: only the calls of that balance's plans, the validation's hold-out fit)."""
    rows, env = measured_rows(path, head_dim, gqa)
    if balance is not None:
        rows = [r for r in rows if r["balance"] == balance]
    src = (f"measured: per-rank shapes on {env.get('gpu', '?')} ({env.get('date', '?')}), "
           f"{os.path.basename(path)}" + (f", {balance} calls only" if balance else ""))
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
    efficiency. ``shape_key`` = ``"{tokens}x{hidden}x{ffn}"``. A measured throughput is scaled
    by ``cluster.matmul_efficiency`` over its default (:data:`params.MATMUL_EFFICIENCY`: x1 as
    measured), so the sensitivity sweep of ``matmul_efficiency`` moves the non-attention time on
    both paths."""
    if shape_key and os.path.exists(MATMUL_FILE):
        with open(MATMUL_FILE) as f:
            data = json.load(f)
        tokens, dims = shape_key.split("x", 1)
        same = [r for r in data.get("matmul", []) if r.get("key", "").split("x", 1)[-1] == dims]
        if same:
            best = min(same, key=lambda r: abs(math.log(int(r["key"].split("x")[0]) / int(tokens))))
            scale = cluster.matmul_efficiency.value / MATMUL_EFFICIENCY
            note = "" if scale == 1.0 else f" x{scale:g} (matmul_efficiency)"
            return (best["tflops"] * scale,
                    f"measured ({os.path.basename(MATMUL_FILE)}, {best['key']}){note}")
    eff = cluster.matmul_tflops.value * cluster.matmul_efficiency.value
    return eff, "measured dense ceiling x assumed efficiency"


def as_dict(cost: AttentionCost) -> dict:
    return asdict(cost)


# -- the cached fits the CLI uses ----------------------------------------------------------------

CALIBRATION_FILE = os.path.join(RESULTS, "scale_model_calibration.json")
#: name -> how to fit it. "flashmask3": the current kernels; "flex": FlexAttention (the torch
#: context_parallel style baseline); "flashmask3_old": the kernel of the committed CP runs;
#: "flashmask3_dual_chunk": the current kernels fitted on the dual_chunk plans' calls only (the
#: validation's hold-out fit, cached here because the greedy fit takes seconds).
FITS = {
    "flashmask3": lambda gqa: attention_cost("flashmask3", 128, gqa),
    "flashmask3_dual_chunk": lambda gqa: fit_from_measured(MEASURED_FILE, 128, gqa, balance="dual_chunk"),
    "flex": lambda gqa: fit_from_kernel_tables("flex", 128, gqa),
    "flashmask3_old": lambda gqa: old_kernel_cost(gqa),
}


def _code_digest() -> str:
    """Digest of this module's source: a cached fit is used only by the code that made it."""
    import hashlib

    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def build_calibration(path: str = CALIBRATION_FILE, progress=None) -> dict:
    """Fit every kernel family (slow: builds the kernel tables' masks) and write ``path``
    (with the fitting code's digest, :func:`_code_digest`)."""
    out = {"_code": _code_digest()}
    for name, fn in FITS.items():
        for gqa in (False, True):
            out[f"{name}:{'gqa' if gqa else 'mha'}"] = asdict(fn(gqa))
            if progress is not None:
                progress.update(1)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def _from_dict(d: dict) -> AttentionCost:
    return AttentionCost(PassCost(**d["fwd"]), PassCost(**d["bwd"]), d["source"], d["head_dim"], d["gqa"],
                         d.get("group", 1))


def load_cost(name: str = "flashmask3", gqa: bool = True, path: str = CALIBRATION_FILE) -> AttentionCost:
    """A fitted cost from the cached calibration, fitted now when the cache lacks it, is older
    than the measurements or was made by other fitting code (a stale cache once kept an older
    fit's numbers in the report)."""
    key = f"{name}:{'gqa' if gqa else 'mha'}"
    fresh = os.path.exists(path) and (not os.path.exists(MEASURED_FILE)
                                      or os.path.getmtime(path) >= os.path.getmtime(MEASURED_FILE))
    if fresh:
        with open(path) as f:
            data = json.load(f)
        if key in data and data.get("_code") == _code_digest():
            return _from_dict(data[key])
    if name not in FITS:
        raise ValueError(f"unknown kernel family {name!r}; choose from {sorted(FITS)}")
    return FITS[name](gqa)


#: PassCost's fitted numbers, which :func:`between` interpolates (the rest comes from the GQA fit).
FITTED_TERMS = ("a_full", "a_partial", "call", "floor", "a_qblock", "a_kblock", "a_program", "expand_host")


def between(mha: AttentionCost, gqa: AttentionCost, group: int) -> AttentionCost:
    """The cost of calls with ``group`` query heads per KV head, between the MHA fit (group 1)
    and the GQA fit (its :attr:`AttentionCost.group`): every fitted term linear in log2(group)
    between the two. An assumption of the model with two calibrated groups only; the CP runtime
    checks on Hq=16 / Hk=8 (group 2, a layout neither fit saw) test it: with the GQA 8:1 fit
    their kernels came out a mean +7.5% (H200) and +8.3% (H100) high, interpolated +4.6% and +5.5%
    (benchmarks/NOTES.md, session 50). Groups at or beyond the GQA fit's take the GQA fit (no
    extrapolation)."""
    if group <= 1:
        return mha
    if group >= gqa.group or gqa.group <= 1:
        return gqa
    t = math.log2(group) / math.log2(gqa.group)

    def mix(a: PassCost, b: PassCost) -> PassCost:
        return replace(b, **{f: (1 - t) * getattr(a, f) + t * getattr(b, f) for f in FITTED_TERMS})

    return replace(gqa, fwd=mix(mha.fwd, gqa.fwd), bwd=mix(mha.bwd, gqa.bwd), group=group, interpolated=True,
                   source=f"{gqa.source}; interpolated to {group}:1 GQA between the MHA and "
                          f"{gqa.group}:1 fits (log2 of the group)")


def gqa_group(heads: int, kv_heads: int) -> int:
    """Query heads per KV head; a ValueError unless ``heads`` is a positive multiple of ``kv_heads``."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    return heads // kv_heads


def cost_for(name: str, heads: int, kv_heads: int) -> AttentionCost:
    """The kernel family's cost for calls of ``heads`` query and ``kv_heads`` KV heads: the MHA
    or GQA fit, or :func:`between` them for a group neither was fitted on."""
    return between(load_cost(name, False), load_cost(name, True), gqa_group(heads, kv_heads))


def filled(cost: AttentionCost) -> AttentionCost:
    """``cost`` with every call's programs spread evenly over all SMs (total work / SMs instead
    of the greedy makespan): what a call would cost if it filled the GPU whatever its grid and
    however uneven its programs (the attribution's "no SM underfill"; greedy costs only)."""
    if cost.fwd.schedule != "greedy":
        return cost
    return replace(cost, fwd=replace(cost.fwd, schedule="filled"), bwd=replace(cost.bwd, schedule="filled"),
                   source=f"{cost.source}; every call filling the SMs")


def variant(cost: AttentionCost, kv_rule: Optional[str] = None, order: Optional[str] = None) -> AttentionCost:
    """``cost`` with another GQA expansion rule (:data:`KV_RULES`, :data:`KV_CHOSEN`) and/or
    launch order (``"launch"`` / ``"longest"``, both passes): a kernel-side change predicted by
    the same fitted coefficients (greedy costs only; None keeps the current one)."""
    if cost.fwd.schedule not in ("greedy", "filled") or (kv_rule is None and order is None):
        return cost
    if kv_rule is not None and kv_rule not in KV_RULES and kv_rule not in KV_CHOSEN:
        raise ValueError(f"unknown kv_rule {kv_rule!r}; choose from {sorted(KV_RULES) + list(KV_CHOSEN)}")
    if order is not None and order not in ("launch", "longest"):
        raise ValueError(f"order must be 'launch' or 'longest', got {order!r}")
    fwd = replace(cost.fwd, order=order or cost.fwd.order)
    bwd = replace(cost.bwd, order=order or cost.bwd.order, kv_rule=kv_rule or cost.bwd.kv_rule)
    label = ", ".join(x for x in (kv_rule and f"GQA expansion rule {kv_rule}", order and f"{order} launch order") if x)
    return replace(cost, fwd=fwd, bwd=bwd, source=f"{cost.source}; {label}")


def with_host(cost: AttentionCost, fwd_s: float, bwd_s: float, label: str) -> AttentionCost:
    """``cost`` with another host time per call (seconds; forward, backward = fwd+bwd - fwd): the
    host-path sweep (today's measured host cost, issue 25's targets, zero)."""
    from dataclasses import replace

    return replace(cost, fwd=replace(cost.fwd, floor=fwd_s), bwd=replace(cost.bwd, floor=bwd_s),
                   source=f"{cost.source}; host per call {label}")
