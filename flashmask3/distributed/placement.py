"""Communication-aware placement of chunks on ranks (``balance="sparse"``).

Every rank owns the same number ``k = n / P`` of the ``n`` chunks (equal tokens, so the
non-attention layers stay balanced). The placement must also balance attention work and keep
small the K/V each rank has to receive: the key chunks its rows need that it does not own
("remote K/V"). Scattering a document over many ranks balances work but makes every one of
them fetch the document's keys; keeping it on consecutive ranks keeps the keys local but
loads the ranks that hold the document's heavy tail (causal attention: a row's work grows
with its position in the document).

Algorithm (see docs/context-parallel.md, "Placement"):

1. **Start contiguous**: rank ``r`` owns chunks ``[r k, (r + 1) k)``. A document then lives
   on consecutive ranks, so a rank's remote K/V is about the part of its first document that
   precedes it, close to the lower bound ``max_q |live(q)| - k`` (the owner of chunk ``q``
   needs all of ``q``'s live key chunks and owns at most ``k`` of them).
2. **Rebalance by swaps under a cap** on each rank's remote K/V. Repeatedly, the heaviest rank
   ``h`` swaps one of its chunks ``a`` for a lighter chunk ``b`` of another rank ``o`` (a swap
   keeps token counts equal) such that both new loads stay below ``h``'s old load. Among all
   ``k x n`` such swaps it takes the one of least *time cost*::

       tile_ps * max(new load of h, new load of o)
           + link_ps(h, o) * kv_bytes_per_chunk * (keys h newly needs + keys o newly needs)

   where ``link_ps`` is the intra-node or cross-node time per byte (nodes of ``gpus_per_node``
   ranks). "Keys newly needed" is counted from each chunk's live key-chunk *hull*
   ``[lo, hi)`` against prefix sums of each rank's need set, so an owner that already needs a
   chunk's keys (it holds a later chunk of the same document) takes it for free. Only swaps
   whose conservative bound (``remote + new keys + 1``) keeps both ranks within the cap are
   eligible; when none is, the best few by cost are checked exactly, and only then the cap
   grows by 1/16. It stops when the heaviest rank is within ``tolerance`` of the mean load.

The cap starts at ``max(lower bound, remote K/V of the contiguous start)``, so the rebalanced
layout moves no more K/V per rank than it must. Every quantity is an integer and every tie
is broken by the lowest index, so all ranks compute the same layout.

Complexity: one swap costs O(k n) (candidate loads and costs) + O(k P) (hull overlaps) +
O(n) (the two ranks' need counts, updated incrementally); a few hundred swaps at P = 128.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        self.count[h] += self.live[b] - self.live[a]
        self.count[o] += self.live[a] - self.live[b]
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
    for _ in range(64 * n):
        h = int(np.argmax(st.loads))
        if st.loads[h] <= limit:
            break
        slots = st.members[h]
        # Candidates b: chunks lighter than h's heaviest, of ranks lighter than h.
        cols = np.flatnonzero((st.work < st.work[slots].max()) & (st.loads[st.owner] < st.loads[h]))
        if not len(cols):
            break
        o = st.owner[cols]
        d = st.work[slots][:, None] - st.work[cols][None, :]                 # [k, m]
        ok = (d > 0) & (d < (st.loads[h] - st.loads[o])[None, :])
        if not ok.any():
            break
        pre = st.prefix
        lo_b, hi_b = lo[cols], hi[cols]
        gain_o = span[slots][:, None] - (pre[:, hi[slots]] - pre[:, lo[slots]]).T   # [k, P]
        gain_o = gain_o[:, o]                                                 # [k, m]
        gain_h = (span[cols] - (pre[h, hi_b] - pre[h, lo_b]))[None, :]        # [1, m]
        link = np.where(node[o] != node[h], cross, intra)[None, :]            # [1, m]
        # Compute time of the pair's new maximum, to a 1/512 of the mean rank's; then the
        # predicted time of the K/V the two ranks newly need (intra- or cross-node link).
        compute = tile_ps * np.maximum(st.loads[h] - d, st.loads[o][None, :] + d) // bucket
        bound = np.maximum(st.remote[h] + gain_h, st.remote[o][None, :] + gain_o) + 1
        pick = np.where(ok & (bound <= cap), compute, big)
        best = int(np.argmin(pick))
        if pick.flat[best] == big:
            best = _exact_pick(st, h, cols, np.where(ok, compute, big), cap, exact_checks)
            if best < 0:
                if cap >= n:
                    break
                cap += max(1, cap // 16)
                continue
        else:  # among equally good swaps, the one whose new K/V takes the least link time
            tied = pick == pick.flat[best]
            best = int(np.argmin(np.where(tied, link * (gain_h + gain_o), big)))
        slot, j = divmod(best, len(cols))
        st.swap(h, slot, int(cols[j]))
    return st.owner


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
