"""Rank-local masks (docs/context-parallel.md, "Rank-local masks").

A rank computes attention of its query rows ``R`` (sorted global indices) against a subset of
keys ``K`` (global indices, in the order the K/V chunks arrive). The global mask is a set of
masked row intervals per key column; since ``v -> #{i in R : i < v}`` is monotone, mapping every
interval bound through it turns "global row i in [a, b)" into "local row in [map(a), map(b))"
exactly. The causal diagonal (row i < column j is masked, S_q == S_k) becomes the upper interval
``[0, map(j))``, so local masks are always non-causal:

=====================  ==================================================
global (causal, C)     local columns (causal=False)
=====================  ==================================================
None, full             C=2  [LTS=|R|, UTE=0]
None, causal           C=2  [LTS=|R|, UTE=map(j)]
True, 1  [LTS]         C=2  [map(LTS), map(j)]
True, 2  [LTS, LTE]    C=4  [map(LTS), map(LTE), 0, map(j)]
False, 2 [LTS, UTE]    C=2  [map(LTS), map(UTE)]
False, 4               C=4  map of all four
=====================  ==================================================
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

#: A CPU count uses a lookup table over every position up to the rank's last row when that
#: table is at most this many times the bounds to look up (plus :data:`_TABLE_SLACK`): one
#: gather per bound instead of a binary search (benchmarks/NOTES.md, session 49).
_TABLE_PER_BOUND = 8
_TABLE_SLACK = 1 << 16


def count_below(rows: torch.Tensor, bounds: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """``#{i in rows : i < v}`` for every ``v`` in ``bounds`` (``rows`` sorted ascending), int64.

    ``chunk_size``: ``rows`` may be whole aligned chunks of that many tokens (a plan's rank
    rows), which builds the CPU lookup table faster (:func:`_below`)."""
    return _below(rows, bounds.numel(), chunk_size)(bounds).to(torch.int64)


def _below(rows: torch.Tensor, n_bounds: int, chunk_size: Optional[int] = None) -> Callable:
    """``count(bounds) -> int32 #{i in rows : i < v}`` per bound, for about ``n_bounds`` bounds.

    One contiguous run of rows is a clamp; CPU rows use a table ``t[v]`` over every position up
    to the last row (bounds outside it clip to its ends, where the count is 0 or ``len(rows)``)
    when it is small next to the bounds; otherwise, and on a GPU, a binary search."""
    n = rows.numel()
    if n and int(rows[-1]) - int(rows[0]) + 1 == n:  # one contiguous run: a clamp suffices
        first = int(rows[0])
        return lambda b: (b.to(torch.int64) - first).clamp_(0, n).to(torch.int32)
    if n and rows.device.type == "cpu" and int(rows[-1]) < _TABLE_PER_BOUND * n_bounds + _TABLE_SLACK:
        table = _below_table(rows.numpy(), chunk_size)
        return lambda b: torch.from_numpy(np.take(table, b.numpy(), mode="clip"))
    rows = rows.contiguous()
    return lambda b: torch.searchsorted(rows, b.to(rows.dtype).contiguous(), right=False, out_int32=True)


def _below_table(rows: np.ndarray, chunk_size: Optional[int]) -> np.ndarray:
    """int32 ``t`` of ``rows[-1] + 2`` entries with ``t[v] = #{i in rows : i < v}`` (rows sorted,
    non-negative). Whole aligned chunks of ``chunk_size`` (a plan's rank rows) fill it chunk by
    chunk, 2-3x faster than counting every row."""
    last = int(rows[-1])
    if chunk_size and _whole_chunks(rows, chunk_size):
        held = np.zeros(last // chunk_size + 1, dtype=np.int32)
        held[rows[::chunk_size] // chunk_size] = 1
        before = np.cumsum(held, dtype=np.int32)
        before -= held
        before *= chunk_size
        table = np.empty(held.size * chunk_size + 1, dtype=np.int32)
        np.add(before[:, None], np.arange(chunk_size, dtype=np.int32)[None, :] * held[:, None],
               out=table[:-1].reshape(held.size, chunk_size))
        table[-1] = rows.size
        return table
    table = np.zeros(last + 2, dtype=np.int32)
    np.cumsum(np.bincount(rows, minlength=last + 1), out=table[1:])
    return table


def _whole_chunks(rows: np.ndarray, chunk_size: int) -> bool:
    """Whether sorted unique ``rows`` are whole chunks ``[c * chunk_size, (c + 1) * chunk_size)``."""
    if rows.size % chunk_size:
        return False
    runs = rows.reshape(-1, chunk_size)
    return bool(((runs[:, 0] % chunk_size == 0) & (runs[:, -1] - runs[:, 0] == chunk_size - 1)).all())


def local_columns_shape(startend_row_indices: Optional[torch.Tensor], causal: bool, n_keys: int) -> tuple:
    """The shape of :func:`rank_local_columns`' result for ``n_keys`` local keys (the module
    table: the causal diagonal adds an upper interval per lower one), without computing it."""
    if startend_row_indices is None:
        return (1, 1, n_keys, 2)
    b, h, _, c = startend_row_indices.shape
    return (b, h, n_keys, 2 * c if causal else c)


def rank_local_columns(startend_row_indices: Optional[torch.Tensor], causal: bool,
                       rows: torch.Tensor, keys: torch.Tensor,
                       chunk_size: Optional[int] = None) -> torch.Tensor:
    """Local non-causal ``[B, Hm, len(keys), C']`` int32 columns for rows ``rows``.

    ``rows``: sorted global query rows of the rank; ``keys``: global key positions of the local
    key axis, in local order; ``chunk_size``: ``rows`` may be whole chunks of that size
    (:func:`count_below`). See the module table for the layouts.
    """
    device = startend_row_indices.device if startend_row_indices is not None else rows.device
    rows = rows.to(device=device, dtype=torch.int64)
    keys = keys.to(device=device, dtype=torch.int64)
    n_rows, n_keys = rows.numel(), keys.numel()
    bounds = n_keys if startend_row_indices is None else n_keys * (1 + startend_row_indices.shape[-1])
    below = _below(rows, bounds, chunk_size)
    diag = below(keys)  # map(j): rows strictly before key j
    if startend_row_indices is None:
        lts = torch.full((n_keys,), n_rows, dtype=torch.int32, device=device)
        ute = diag if causal else torch.zeros(n_keys, dtype=torch.int32, device=device)
        return torch.stack([lts, ute], -1).view(1, 1, n_keys, 2)
    mapped = below(_gather_keys(startend_row_indices, keys))
    if not causal:
        return mapped
    diag = diag.view(1, 1, n_keys).expand(mapped.shape[:3])
    if mapped.shape[-1] == 1:
        return torch.stack([mapped[..., 0], diag], -1)
    zero = torch.zeros_like(diag)
    return torch.stack([mapped[..., 0], mapped[..., 1], zero, diag], -1)


def _gather_keys(startend_row_indices: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The columns of ``keys`` (numpy's gather on the CPU: ~5x torch's ``index_select`` there)."""
    if startend_row_indices.device.type == "cpu":
        return torch.from_numpy(np.take(startend_row_indices.numpy(), keys.numpy(), axis=2))
    return startend_row_indices.index_select(2, keys)
