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

from typing import Optional

import numpy as np
import torch


def count_below(rows: torch.Tensor, bounds: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """``#{i in rows : i < v}`` for every ``v`` in ``bounds`` (``rows`` sorted ascending, int64).

    ``chunk_size``: ``rows`` may be whole aligned chunks of that many tokens (a plan's rank
    rows); then each bound is one table lookup (rows in the chunks before its chunk, plus its
    offset if its own chunk is held) instead of a binary search: a rank's local columns 1.6-2.6x
    faster on the CPU at 128K-512K tokens (benchmarks/NOTES.md, session 48). Other rows, and
    rows on a GPU, use the binary search."""
    n = rows.numel()
    if n and int(rows[-1]) - int(rows[0]) + 1 == n:  # one contiguous run: a clamp suffices
        return (bounds.to(torch.int64) - int(rows[0])).clamp(0, n)
    if chunk_size and n and rows.device.type == "cpu" and _whole_chunks(rows, chunk_size):
        return _count_below_chunks(rows, bounds, chunk_size)
    return torch.searchsorted(rows, bounds.to(rows.dtype).contiguous(), right=False)


def _whole_chunks(rows: torch.Tensor, chunk_size: int) -> bool:
    """Whether sorted unique ``rows`` are whole chunks ``[c * chunk_size, (c + 1) * chunk_size)``."""
    if rows.numel() % chunk_size:
        return False
    runs = rows.view(-1, chunk_size)
    return bool(((runs[:, 0] % chunk_size == 0) & (runs[:, -1] - runs[:, 0] == chunk_size - 1)).all())


def _count_below_chunks(rows: torch.Tensor, bounds: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """:func:`count_below` of CPU rows made of whole chunks: per bound ``v`` in chunk ``c = v //
    chunk_size``, the rows held before chunk ``c`` plus ``v``'s offset in ``c`` if ``c`` is held
    (in numpy, where torch's integer gathers are several times slower; the bounds keep their
    dtype until the last add, which is int64). Rows on a GPU keep the binary search."""
    held = rows.view(-1, chunk_size)[:, 0].numpy() // chunk_size
    own = np.zeros(int(held[-1]) + 2, dtype=np.int64)  # one past the last held chunk: none held there
    own[held] = chunk_size
    before = np.cumsum(own) - own  # rows held before each chunk
    v = np.clip(bounds.numpy(), 0, (len(own) - 1) * chunk_size)  # a copy: worked on in place below
    if chunk_size & (chunk_size - 1) == 0:  # a power of two: shift and mask
        c = v >> (chunk_size.bit_length() - 1)
        np.bitwise_and(v, chunk_size - 1, out=v)
    else:
        c = v // chunk_size
        v -= c * chunk_size
    out = before[c]
    out += np.minimum(v, own[c].astype(v.dtype, copy=False), out=v)
    return torch.from_numpy(out)


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
    diag = count_below(rows, keys, chunk_size)  # map(j): rows strictly before key j
    if startend_row_indices is None:
        lts = torch.full((n_keys,), n_rows, dtype=torch.int64, device=device)
        ute = diag if causal else torch.zeros(n_keys, dtype=torch.int64, device=device)
        return torch.stack([lts, ute], -1).view(1, 1, n_keys, 2).to(torch.int32)
    cols = startend_row_indices.index_select(2, keys)
    mapped = count_below(rows, cols, chunk_size)
    if not causal:
        return mapped.to(torch.int32)
    diag = diag.view(1, 1, n_keys).expand(cols.shape[:3])
    if cols.shape[-1] == 1:
        out = torch.stack([mapped[..., 0], diag], -1)
    else:
        zero = torch.zeros_like(diag)
        out = torch.stack([mapped[..., 0], mapped[..., 1], zero, diag], -1)
    return out.to(torch.int32).contiguous()
