"""Communication-aware placement of chunks on ranks (``balance="sparse"``).

Every rank owns the same number ``k = n / P`` of the ``n`` chunks (equal tokens, so the
non-attention layers stay balanced). The placement must also balance attention work and keep
small the K/V each rank has to receive: the key chunks its rows need that it does not own
("remote K/V"). Scattering a document over many ranks balances work but makes every one of
them fetch the document's keys; keeping it on consecutive ranks keeps the keys local but
loads the ranks that hold the document's heavy tail (causal attention: a row's work grows
with its position in the document). Lower bound: the owner of chunk ``q`` needs all of ``q``'s
live key chunks and owns at most ``k``, so some rank receives ``max_q |live(q)| - k`` chunks.

Algorithm (docs/context-parallel.md, "Placement"):

1. **Fold start** (:func:`folded_owner`): contiguous fill in document order, each document
   longer than a rank's share folded head / tail / second / second-to-last ..., so the ranks
   inside a long document are balanced among themselves and need only its keys; the owner of
   its last chunk owns ``k`` of its chunks (at the lower bound).
2. **Swaps under a cap on remote K/V**: while the heaviest rank ``h`` is more than
   ``tolerance`` above the mean, it exchanges a chunk ``a`` for a lighter chunk ``b`` of a
   lighter rank ``o`` (equal token counts kept; both new loads below ``h``'s old one). Eligible:
   both ranks' remote K/V stays within the cap, by the bound ``remote + new keys + 1`` where new
   keys are counted from each chunk's live key-chunk hull against prefix sums of each rank's
   need set (a rank that already needs a chunk's keys takes it for free); when none is
   eligible the best few are checked exactly, and only then the cap grows by 1/16 (it starts at
   ``max(lower bound, remote K/V of the fold start)``). Choice, by a cost in time
   (:class:`PlacementCost`): least predicted compute time of the pair's new maximum (tiles x
   time per tile, to 1/512 of the mean rank's), then least link time of the K/V the two ranks
   newly need (bytes x intra-node or cross-node time per byte, nodes of ``gpus_per_node``).

Every quantity is an integer and every tie goes to the lowest index, so all ranks compute the
same layout. Complexity: the fold start O(n); one exchange O(k n) to score all candidates
(numpy over the whole ``[k, m]`` grid, with the exact shortcuts of :func:`_best_capped_swap`),
O(k P) for the hull overlaps, O(n) to update the two ranks' need counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

#: Stop rebalancing when the heaviest rank is within this fraction of the mean work.
DEFAULT_TOLERANCE = 0.04

#: Chunks per rank of the coarse placement that seeds the fine one.
COARSE_CHUNKS_PER_RANK = 4


@dataclass(frozen=True)
class PlacementCost:
    """Time model of the placement's cost (a model's prediction, not a measurement).

    Defaults: an H200 at ~600 TFLOP/s on a 128 x 128 tile's forward + backward
    (3.5 x 4 * 128^2 * D FLOP) for 32 query heads of D = 128 (~1.6 us); K/V of 8 KV heads x
    128 x 2 bytes per token, moved three times a step (forward, backward refetch, gradient
    return); NVLink ~450 GB/s (2 ps/B) inside a node of 8 GPUs, InfiniBand ~50 GB/s (20 ps/B)
    across nodes.
    """

    tile_ps: int = 1_600_000
    kv_bytes_per_token: int = 3 * 2 * 8 * 128 * 2
    intra_ps_per_byte: int = 2
    cross_ps_per_byte: int = 20
    gpus_per_node: int = 8

    def __post_init__(self):
        for name in ("tile_ps", "kv_bytes_per_token", "intra_ps_per_byte", "cross_ps_per_byte",
                     "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlacementCost.{name} must be a positive int, got {value!r}")


def live_hull(live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query chunk the hull ``[lo, hi)`` of its live key chunks (``lo == hi`` if none)."""
    n = live.shape[1]
    anyl = live.any(1)
    lo = np.where(anyl, live.argmax(1), 0)
    hi = np.where(anyl, n - live[:, ::-1].argmax(1), 0)
    return lo.astype(np.int64), hi.astype(np.int64)


def remote_lower_bound(live: np.ndarray, chunks_per_rank: int) -> int:
    """Remote key chunks that some rank must receive under any placement."""
    return max(0, int(live.sum(1).max(initial=0)) - chunks_per_rank)


def contiguous_owner(n: int, cp_size: int) -> np.ndarray:
    return np.repeat(np.arange(cp_size, dtype=np.int64), n // cp_size)


def folded_owner(lo: np.ndarray, cp_size: int) -> np.ndarray:
    """Contiguous fill of the chunks in document order, each long document folded.

    A run is a maximal stretch of consecutive chunks with the same first live key chunk
    (``lo``): the chunks of one document at chunk granularity. The fill walks the runs in
    order. A run that does not fit in the current rank first tops that rank up with its head
    chunks; the rest is laid out head, tail, second, second to last, ... so that every full
    rank it covers gets light head and heavy tail chunks of that one document (balanced, and it
    needs only that document's keys), and the middle chunks left over start the next rank.
    """
    n = len(lo)
    k = n // cp_size
    starts = np.flatnonzero(np.r_[True, lo[1:] != lo[:-1]])
    ends = np.r_[starts[1:], n]
    order = []
    pos = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        free = (-pos) % k
        if e - s <= max(free, k):
            order.append(np.arange(s, e))
        else:
            order.append(np.arange(s, s + free))
            m = e - s - free
            z = np.empty(m, dtype=np.int64)
            z[0::2] = np.arange(s + free, s + free + (m + 1) // 2)
            z[1::2] = np.arange(e - 1, s + free + (m + 1) // 2 - 1, -1)
            order.append(z)
        pos += e - s
    owner = np.empty(n, dtype=np.int64)
    owner[np.concatenate(order)] = np.arange(n) // k
    return owner


class _State:
    """Ownership with incrementally kept per-rank loads, need counts and remote K/V."""

    def __init__(self, work: np.ndarray, live: np.ndarray, owner: np.ndarray, cp_size: int):
        n, p = len(work), cp_size
        self.work, self.live = work, live.astype(np.int32)
        self.owner = owner.copy()
        self.members = np.stack([np.flatnonzero(owner == r) for r in range(p)])
        self.loads = work[self.members].sum(1).astype(np.int64)
        self.count = np.stack([self.live[m].sum(0) for m in self.members])  # [P, n]
        self.owns = np.zeros((p, n), dtype=bool)
        self.owns[owner, np.arange(n)] = True
        self.prefix = np.zeros((p, n + 1), dtype=np.int64)
        self.remote = np.zeros(p, dtype=np.int64)
        for r in range(p):
            self._recount(r)

    def _recount(self, r: int) -> None:
        need = self.count[r] > 0
        np.cumsum(need, out=self.prefix[r, 1:])
        self.remote[r] = int((need & ~self.owns[r]).sum())

    def remote_after(self, rank: int, lose: np.ndarray, gain: np.ndarray) -> np.ndarray:
        """Exact remote K/V (chunks) of ``rank`` after losing chunks ``lose[i]`` and gaining
        ``gain[i]``, for every candidate ``i``."""
        m = len(lose)
        idx = np.arange(m)
        need = (self.count[rank][None] - self.live[lose] + self.live[gain]) > 0
        owns = np.repeat(self.owns[rank][None], m, axis=0)
        owns[idx, lose] = False
        owns[idx, gain] = True
        return (need & ~owns).sum(1)

    def swap(self, h: int, slot: int, b: int) -> None:
        """Exchange chunk ``members[h][slot]`` of rank ``h`` with chunk ``b``."""
        a, o = int(self.members[h][slot]), int(self.owner[b])
        self.owner[a], self.owner[b] = o, h
        self.members[h][slot] = b
        self.members[o][self.members[o] == b] = a
        d = int(self.work[a]) - int(self.work[b])
        self.loads[h] -= d
        self.loads[o] += d
        self.owns[h, a] = self.owns[o, b] = False
        self.owns[h, b] = self.owns[o, a] = True
        delta = self.live[b] - self.live[a]
        self.count[h] += delta
        self.count[o] -= delta
        self._recount(h)
        self._recount(o)


def sparse_placement(work: np.ndarray, live: np.ndarray, cp_size: int, *, chunk_tokens: int,
                     tile_scale: float = 1.0, nodes: int = 1,
                     cost: PlacementCost = PlacementCost(),
                     tolerance: float = DEFAULT_TOLERANCE, exact_checks: int = 32) -> np.ndarray:
    """Owner (int64 ``[n]``) of every chunk: equal chunk counts, balanced work, small remote
    K/V (module docstring). ``tile_scale``: a work unit's share of a 128 x 128 tile."""
    n = len(work)
    k = n // cp_size
    lo, hi = live_hull(live)
    if cp_size == 1 or int(work.sum()) == 0:
        return contiguous_owner(n, cp_size)
    gpn = cp_size // nodes if nodes > 1 else min(cost.gpus_per_node, cp_size)
    node = np.arange(cp_size, dtype=np.int64) // gpn
    chunk_bytes = cost.kv_bytes_per_token * chunk_tokens
    intra, cross = cost.intra_ps_per_byte * chunk_bytes, cost.cross_ps_per_byte * chunk_bytes
    limit = int(work.sum()) * (1 + tolerance) / cp_size
    owner = folded_owner(lo, cp_size)
    st = _State(work.astype(np.int64), live, owner, cp_size)
    span = hi - lo
    tile_ps = max(1, int(round(cost.tile_ps * tile_scale)))
    cap = max(remote_lower_bound(live, k), int(st.remote.max()))
    bucket = max(1, tile_ps * int(st.loads.sum()) // (512 * cp_size))
    big = np.iinfo(np.int64).max
    # int32 arithmetic on the [k, m] candidate grids whenever the loads fit (twice as fast).
    wdt = np.int32 if 2 * int(work.sum()) < np.iinfo(np.int32).max else np.int64
    wk = st.work.astype(wdt)
    for _ in range(64 * n):
        h = int(np.argmax(st.loads))
        if st.loads[h] <= limit:
            break
        slots = st.members[h]
        # Candidates b: chunks lighter than h's heaviest, of ranks lighter than h.
        cols = np.flatnonzero((st.work < st.work[slots].max()) & (st.loads[st.owner] < st.loads[h]))
        if not len(cols):
            break
        found = _best_capped_swap(st, h, cols, wk, lo, hi, span, node, intra, cross, tile_ps, bucket, cap)
        if found is None:  # none passes the bound (or none lowers the pair's maximum at all)
            o = st.owner[cols]
            d = st.work[slots][:, None] - st.work[cols][None, :]
            ok = (d > 0) & (d < (st.loads[h] - st.loads[o])[None, :])
            if not ok.any():
                break
            # check the best few exactly, else raise the cap
            compute = tile_ps * np.maximum(st.loads[h] - d, st.loads[o][None, :] + d) // bucket
            best = _exact_pick(st, h, cols, np.where(ok, compute, big), cap, exact_checks)
            if best < 0:
                if cap >= n:
                    break
                cap += max(1, cap // 16)
                continue
            slot, j = divmod(best, len(cols))
            found = slot, int(cols[j])
        st.swap(h, *found)
    return st.owner


def _best_capped_swap(st: _State, h: int, cols: np.ndarray, wk: np.ndarray, lo: np.ndarray,
                      hi: np.ndarray, span: np.ndarray, node: np.ndarray, intra: int, cross: int,
                      tile_ps: int, bucket: int, cap: int) -> Optional[tuple[int, int]]:
    """The exchange of a chunk of rank ``h`` (a slot of ``members[h]``) for a chunk of ``cols``
    chosen by the rule of the module docstring among those whose remote K/V bound stays
    within ``cap``, as ``(slot, b)``; None if there is none.

    Exchange (a, b), b of a rank o lighter than h, lowers the pair's maximum iff
    ``0 < d < L_h - L_o`` (``d = w_a - w_b``), that is iff its new maximum
    ``X = max(L_h - d, L_o + d)`` is below ``L_h``, so X alone marks them. The bound
    ``max(remote_h + gain_h(b), remote_o + gain_o(a)) + 1 <= cap`` splits into a test on b
    alone (it filters the columns of the ``[k, m]`` grid) and one on (a, o) (a penalty added
    to X). The compute key ``tile_ps * X // bucket`` is monotone in X: the tied set is
    ``X < ceil((key(X_min) + 1) * bucket / tile_ps)``, one exact integer threshold.
    """
    slots = st.members[h]
    load_h, rem_h = int(st.loads[h]), int(st.remote[h])
    pre_h = st.prefix[h]
    gain_h = span[cols] - (pre_h[hi[cols]] - pre_h[lo[cols]])
    fits_h = gain_h <= cap - 1 - rem_h
    sel, gain_h = cols[fits_h], gain_h[fits_h]
    if not len(sel):
        return None
    pre = st.prefix
    gain_o = span[slots][:, None] - (pre[:, hi[slots]] - pre[:, lo[slots]]).T   # [k, P]
    # An exchange that breaks the cap on o's side costs more than any new maximum.
    never = np.iinfo(wk.dtype).max // 2
    penalty = np.where(gain_o <= (cap - 1 - st.remote)[None, :], 0, never).astype(wk.dtype)  # [k, P]
    o = st.owner[sel]
    wa, wb = wk[slots], wk[sel]
    # X = max(L_h - d, L_o + d) with d = w_a - w_b; X < L_h exactly when 0 < d < L_h - L_o.
    new_max = (wb + load_h)[None, :] - wa[:, None]                              # [k, m']
    np.maximum(new_max, (st.loads[o].astype(wk.dtype) - wb)[None, :] + wa[:, None], out=new_max)
    new_max += np.take(penalty, o, axis=1)
    x_min = int(new_max.min())
    if x_min >= load_h:
        return None
    key = tile_ps * x_min // bucket
    threshold = min(load_h, -(-(key + 1) * bucket // tile_ps))
    tied = np.flatnonzero(new_max < threshold)   # ascending flat index
    slot, jj = np.divmod(tied, len(sel))
    link = np.where(node[o[jj]] != node[h], cross, intra)
    # among equally good swaps, the one whose new K/V takes the least link time
    score = link * (gain_h[jj] + gain_o[slot, o[jj]])
    t = int(np.argmin(score))
    return int(slot[t]), int(sel[jj[t]])


def _exact_pick(st: _State, h: int, cols: np.ndarray, score: np.ndarray, cap: int, m: int) -> int:
    """The best of the ``m`` best-scored swaps (``score``: ``[k, len(cols)]``) whose exact
    remote K/V stays within the cap (flat index into ``score``), or -1."""
    flat = score.ravel()
    valid = int((flat < np.iinfo(np.int64).max).sum())
    if valid == 0:
        return -1
    m = min(m, valid)
    idx = np.argpartition(flat, m - 1)[:m]
    idx = idx[np.lexsort((idx, flat[idx]))]
    slot, j = np.divmod(idx, len(cols))
    a, b = st.members[h][slot], cols[j]
    o = st.owner[b]
    rh = st.remote_after(h, a, b)
    ro = np.array([st.remote_after(int(r), np.array([bb]), np.array([aa]))[0] for r, aa, bb in zip(o, a, b)])
    fits = np.flatnonzero(np.maximum(rh, ro) <= cap)
    return int(idx[fits[0]]) if len(fits) else -1
