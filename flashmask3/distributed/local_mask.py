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

import torch


def count_below(rows: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``#{i in rows : i < v}`` for every ``v`` in ``bounds`` (``rows`` sorted ascending)."""
    n = rows.numel()
    if n and int(rows[-1]) - int(rows[0]) + 1 == n:  # one contiguous run: a clamp suffices
        return (bounds.to(torch.int64) - int(rows[0])).clamp(0, n)
    return torch.searchsorted(rows, bounds.contiguous(), right=False)


def rank_local_columns(startend_row_indices: Optional[torch.Tensor], causal: bool,
                       rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Local non-causal ``[B, Hm, len(keys), C']`` int32 columns for rows ``rows``.

    ``rows``: sorted global query rows of the rank; ``keys``: global key positions of the local
    key axis, in local order. See the module table for the layouts.
    """
    device = startend_row_indices.device if startend_row_indices is not None else rows.device
    rows = rows.to(device=device, dtype=torch.int64)
    keys = keys.to(device=device, dtype=torch.int64)
    n_rows, n_keys = rows.numel(), keys.numel()
    diag = count_below(rows, keys)  # map(j): rows strictly before key j
    if startend_row_indices is None:
        lts = torch.full((n_keys,), n_rows, dtype=torch.int64, device=device)
        ute = diag if causal else torch.zeros(n_keys, dtype=torch.int64, device=device)
        return torch.stack([lts, ute], -1).view(1, 1, n_keys, 2).to(torch.int32)
    cols = startend_row_indices.index_select(2, keys).to(torch.int64)
    mapped = count_below(rows, cols)
    if not causal:
        return mapped.to(torch.int32)
    diag = diag.view(1, 1, n_keys).expand(cols.shape[:3])
    if cols.shape[-1] == 1:
        out = torch.stack([mapped[..., 0], diag], -1)
    else:
        zero = torch.zeros_like(diag)
        out = torch.stack([mapped[..., 0], mapped[..., 1], zero, diag], -1)
    return out.to(torch.int32).contiguous()
