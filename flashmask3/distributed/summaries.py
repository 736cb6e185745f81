"""Per-chunk summaries of a global mask: each chunk's work and the key chunks its rows need.

The planner never builds the dense ``(S / tile)^2`` tile grid. It reduces the mask's columns to
their min and max over each key block (:func:`flashmask3.masks.block_summary`, O(S) work), and
turns every key block into the few *query-block ranges* for which its tiles are live under the
mask layer's tile rule (:func:`flashmask3.masks.classify_tiles`): a tile is SKIP when its rows
lie inside one masked interval for every column of the block (``r0 >= max start`` and
``r1 <= min end``), or above the causal diagonal. Per key block and mask head that skip set is
the union of at most three ranges of query blocks, so its complement, the live set, is at most
four disjoint ranges. From those ranges, with difference arrays:

* ``work[c]``: live tiles in chunk ``c``'s query rows, summed over batch and mask heads
  (O(B * Hm * S / tile) range endpoints, one ``bincount``);
* ``live[q, k]``: key chunk ``k`` has a live tile for some row of query chunk ``q``
  (one ``bincount`` over (query chunk range, key chunk) endpoints, a cumulative sum over the
  ``n x n`` chunk grid: O(n^2) with ``n`` = number of chunks, not tiles).

The result equals the tile rule exactly (the same tiles are SKIP), so a key chunk reported
not live is fully masked for those rows: the rule is conservative (a tile fully masked only by
the union of two intervals counts as live), never the other way. With a tile edge of 1 the
tiles are single (query, key) pairs and the work is the exact count of unmasked pairs.

See docs/context-parallel.md ("Summaries").
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..masks import block_summary

#: Largest chunk grid (``num_chunks ** 2``) the liveness summary builds.
MAX_CHUNK_GRID = 1 << 26

#: Most disjoint query ranges per key chunk for which the grid is built range by range.
_MAX_GRID_LAYERS = 8


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def _skip_ranges(col_min: np.ndarray, col_max: np.ndarray, causal: bool, seqlen: int,
                 block: int, nq: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Query-block ranges ``[a, b)`` whose tile with each key block is SKIP by one interval.

    ``col_min``/``col_max``: int64 ``[H, nk, C]`` per-key-block min/max of the columns.
    A range is empty where ``a >= b``. Mirrors :func:`flashmask3.masks.masked_row_intervals`.
    """
    c = col_min.shape[-1]
    lo, hi = [col_min[..., i] for i in range(c)], [col_max[..., i] for i in range(c)]
    full = np.full_like(lo[0], seqlen)
    zero = np.zeros_like(lo[0])
    if causal and c == 1:
        pairs = [((hi[0]), full)]
    elif causal and c == 2:
        pairs = [(hi[0], lo[1])]
    elif not causal and c == 2:
        pairs = [(hi[0], full), (zero, lo[1])]
    elif not causal and c == 4:
        pairs = [(hi[0], lo[1]), (hi[2], lo[3])]
    else:
        raise ValueError(f"unsupported mask layout causal={causal}, C={c}")
    out = []
    for start_max, end_min in pairs:
        # rows [qb*block, min((qb+1)*block, S)) inside [start_max, end_min)
        a = _ceil_div(start_max, block)
        b = np.where(end_min >= seqlen, nq, end_min // block)
        out.append((np.minimum(a, nq), np.clip(b, 0, nq)))
    return out


def _block_min_max(cols: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (batch x head, key block) min and max of the columns, int64 ``[B*Hm, nk, C]``:
    numpy for a CPU mask (no thread-pool start-up), the mask layer's summary on its device
    otherwise (only the summary is copied to the host)."""
    b, hm, s, c = cols.shape
    if cols.device.type == "cpu" and s % block == 0:
        x = cols.numpy().reshape(b * hm, s // block, block, c)
        return x.min(2).astype(np.int64), x.max(2).astype(np.int64)
    summary = block_summary(cols, block)
    nk = summary.col_min.shape[2]
    return (summary.col_min.reshape(b * hm, nk, c).cpu().numpy().astype(np.int64),
            summary.col_max.reshape(b * hm, nk, c).cpu().numpy().astype(np.int64))


def _live_pieces(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int,
                 block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint live query-block ranges of every (mask head, key block).

    Returns ``(start, end, key_block)`` flat int64 arrays of the non-empty ranges.
    """
    nq = -(-seqlen // block)
    kb = np.arange(nq, dtype=np.int64)
    if startend_row_indices is None:
        heads = 1
        skips = []
    else:
        mn, mx = _block_min_max(startend_row_indices, block)
        heads = mn.shape[0]
        skips = _skip_ranges(mn, mx, causal, seqlen, block, nq)
    first = np.broadcast_to(kb if causal else np.zeros_like(kb), (heads, nq))
    pieces = [(first, np.full((heads, nq), nq, dtype=np.int64))]
    for a, b in skips:
        empty = a >= b
        a = np.where(empty, nq + 1, a)  # an empty skip range leaves every piece whole
        b = np.where(empty, nq + 1, b)
        nxt = []
        for p0, p1 in pieces:
            nxt.append((p0, np.minimum(p1, a)))
            nxt.append((np.maximum(p0, b), p1))
        pieces = nxt
    starts = np.stack([p0 for p0, _ in pieces]).reshape(-1)
    ends = np.stack([p1 for _, p1 in pieces]).reshape(-1)
    keys = np.broadcast_to(kb, (len(pieces), heads, nq)).reshape(-1)
    keep = starts < ends
    return starts[keep], ends[keep], keys[keep]


def _per_block_counts(starts: np.ndarray, ends: np.ndarray, nq: int) -> np.ndarray:
    """Number of ranges covering each query block (difference array)."""
    diff = np.bincount(starts, minlength=nq + 1) - np.bincount(ends, minlength=nq + 1)
    return np.cumsum(diff[:nq])


def chunk_summaries(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int,
                    chunk_size: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query chunk its work (live tiles, int64 ``[n]``) and liveness (bool ``[n, n]``).

    Tiles are ``gcd(chunk_size, tile)`` square so that every tile lies in one chunk.
    """
    block = int(np.gcd(chunk_size, tile))
    n, per = seqlen // chunk_size, chunk_size // block
    if n * n > MAX_CHUNK_GRID:
        raise ValueError(f"chunk_size={chunk_size} gives {n} chunks for seqlen={seqlen}; the plan keeps a "
                         f"{n}x{n} chunk grid, at most {MAX_CHUNK_GRID} cells: use chunk_size >= "
                         f"{-(-seqlen // int(MAX_CHUNK_GRID ** 0.5))}")
    nq = seqlen // block
    starts, ends, keys = _live_pieces(startend_row_indices, causal, seqlen, block)
    work = _per_block_counts(starts, ends, nq).reshape(n, per).sum(1)
    live = _live_grid(starts // per, (ends - 1) // per + 1, keys // per, n)
    return work.astype(np.int64), live


def _live_grid(q0: np.ndarray, q1: np.ndarray, kc: np.ndarray, n: int) -> np.ndarray:
    """bool ``[n, n]``: query chunk q, key chunk k is live when some range ``[q0, q1)`` of key
    chunk ``k`` covers q.

    Ranges are merged per key chunk first (sort, running max). Usually a key chunk keeps one
    or a few disjoint ranges (one per document it serves): then the grid is built layer by
    layer, the j-th range of every key chunk tested at once with one unsigned compare
    (``q - start < length``), which is ~20x cheaper than a difference array's cumulative sum
    down the query axis; that sum remains for masks with many ranges per key chunk.
    """
    if not len(q0):
        return np.zeros((n, n), dtype=bool)
    stride = n + 1
    start, end = kc * stride + q0, kc * stride + q1
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    new = np.r_[True, start[1:] > reach[:-1]]
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(start)] - 1
    kc, q_start, q_end = start[first] // stride, start[first] % stride, reach[last] % stride
    # j-th range of its key chunk (ranges are sorted by key chunk, then start)
    head = np.r_[True, kc[1:] != kc[:-1]]
    layer = np.arange(len(kc)) - np.maximum.accumulate(np.where(head, np.arange(len(kc)), 0))
    layers = int(layer.max()) + 1
    if layers <= _MAX_GRID_LAYERS:
        signed, unsigned = (np.int16, np.uint16) if n < (1 << 15) else (np.int32, np.uint32)
        q = np.arange(n, dtype=signed)[:, None]
        live = np.zeros((n, n), dtype=bool)
        for j in range(layers):
            on = layer == j
            lo = np.zeros(n, dtype=signed)
            length = np.zeros(n, dtype=unsigned)
            lo[kc[on]] = q_start[on]
            length[kc[on]] = q_end[on] - q_start[on]
            live |= (q - lo[None, :]).view(unsigned) < length[None, :]
        return live
    diff = np.zeros((n + 1) * n, dtype=np.int8)  # [query + 1, key], query-major
    diff[q_start * n + kc] = 1
    diff[q_end * n + kc] -= 1
    return np.cumsum(diff.reshape(n + 1, n)[:n], axis=0, dtype=np.int8) > 0

def chunk_pair_counts(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int,
                      chunk_size: int) -> np.ndarray:
    """Exact unmasked (query, key) pairs of each query chunk, summed over batch and mask heads:
    the tile summary with 1 x 1 tiles (O(B * Hm * S))."""
    starts, ends, _ = _live_pieces(startend_row_indices, causal, seqlen, 1)
    per_row = _per_block_counts(starts, ends, seqlen)
    return per_row.reshape(seqlen // chunk_size, chunk_size).sum(1).astype(np.int64)
