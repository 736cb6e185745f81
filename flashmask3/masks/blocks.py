"""Per-block summaries of a column mask and the tile classification rule (docs/kernels.md).

A tile is a block of query rows ``[r0, r1)`` times a block of key columns ``[c0, c1)``. Its
class decides the work every attention path does on it:

* ``SKIP``     — every element is masked: nothing is loaded or computed;
* ``PARTIAL``  — some element may be masked: compute, then mask element-wise;
* ``UNMASKED`` — no element is masked: compute with no mask work at all.

The rule is conservative (a tile that is fully masked only through the union of two different
intervals is called PARTIAL), which costs speed on rare tiles, never correctness. This module is
the one implementation of the rule in Python; the Triton kernels carry a ``@triton.jit`` twin
that the tests compare against :func:`classify_tiles`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .mask import masked_row_intervals

SKIP = 0
PARTIAL = 1
UNMASKED = 2


@dataclass(frozen=True)
class BlockSummary:
    """Min and max of every column vector over each block of ``block_n`` key columns.

    ``col_min``/``col_max``: int32 ``[B, Hm, n_blocks, C]``. O(Sk / block_n) memory.
    """

    col_min: torch.Tensor
    col_max: torch.Tensor
    block_n: int
    seqlen_k: int


def block_summary(startend_row_indices: torch.Tensor, block_n: int) -> BlockSummary:
    """Summarise ``[B, Hm, Sk, C]`` columns per key block (the last block edge-padded)."""
    if block_n <= 0:
        raise ValueError(f"block_n must be positive, got {block_n}")
    b, hm, sk, c = startend_row_indices.shape
    n_blocks = max(1, -(-sk // block_n))
    pad = n_blocks * block_n - sk
    cols = startend_row_indices
    if pad:
        # Repeating the last column leaves each block's min and max unchanged.
        cols = torch.cat([cols, cols[:, :, -1:, :].expand(b, hm, pad, c)], dim=2)
    cols = cols.view(b, hm, n_blocks, block_n, c)
    return BlockSummary(cols.amin(dim=3), cols.amax(dim=3), block_n, sk)


def classify_tiles(
    startend_row_indices: Optional[torch.Tensor],
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    block_m: int,
    block_n: int,
    summary: Optional[BlockSummary] = None,
) -> torch.Tensor:
    """Class of every (query block, key block) tile: int8 ``[B, Hm, n_q_blocks, n_k_blocks]``.

    ``None`` as mask gives ``[1, 1, nq, nk]`` (full or plain causal attention).
    """
    nq = max(1, -(-seqlen_q // block_m))
    nk = max(1, -(-seqlen_k // block_n))
    if startend_row_indices is not None:
        device = startend_row_indices.device
    else:
        device = torch.device("cpu")
    r0 = (torch.arange(nq, device=device, dtype=torch.int64) * block_m).view(nq, 1)
    r1 = torch.clamp(r0 + block_m, max=seqlen_q)
    c0 = (torch.arange(nk, device=device, dtype=torch.int64) * block_n).view(1, nk)
    c1 = torch.clamp(c0 + block_n, max=seqlen_k)

    skip = torch.zeros(1, 1, nq, nk, dtype=torch.bool, device=device)
    partial = torch.zeros_like(skip)
    if startend_row_indices is not None:
        if summary is None:
            summary = block_summary(startend_row_indices, block_n)
        lo = masked_row_intervals(summary.col_min.to(torch.int64), causal, seqlen_q)
        hi = masked_row_intervals(summary.col_max.to(torch.int64), causal, seqlen_q)
        for (start_min, end_min), (start_max, end_max) in zip(lo, hi):
            # start_*/end_*: [B, Hm, nk] -> broadcast against rows [nq, 1]
            smin, emin = start_min.unsqueeze(2), end_min.unsqueeze(2)
            smax, emax = start_max.unsqueeze(2), end_max.unsqueeze(2)
            skip = skip | ((r0 >= smax) & (r1 <= emin))
            partial = partial | ((r0 < emax) & (r1 > smin))
    if causal:
        offset = seqlen_k - seqlen_q
        skip = skip | (c0 > r1 - 1 + offset)
        partial = partial | (c1 - 1 > r0 + offset)
    cls = torch.full(skip.shape, UNMASKED, dtype=torch.int8, device=device)
    cls[partial.expand_as(cls)] = PARTIAL
    cls[skip.expand_as(cls)] = SKIP
    return cls


def live_kv_block_range(tile_classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block, the half-open range ``[lo, hi)`` of key blocks that are not SKIP.

    Reduced over batch and mask heads; a query block with no live tile gets ``lo == hi``.
    """
    return _live_range(tile_classes != SKIP, dim=-1)


def live_q_block_range(tile_classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block, the range ``[lo, hi)`` of query blocks that are not SKIP (backward)."""
    return _live_range(tile_classes != SKIP, dim=-2)


def _live_range(live: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    live = live.flatten(0, 1).any(dim=0)  # [nq, nk]
    n = live.shape[dim]
    idx = torch.arange(n, device=live.device)
    idx = idx.view(1, n) if dim in (-1, 1) else idx.view(n, 1)
    lo = torch.where(live, idx, n).amin(dim=dim)
    hi = torch.where(live, idx + 1, 0).amax(dim=dim)
    hi = torch.maximum(hi, lo)
    return lo, hi
