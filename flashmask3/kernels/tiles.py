"""Mask and tile helpers shared by the ``tl`` and Gluon kernels.

Device side: the tile rule (``_classify_rule``, the ``@jit`` twin of
:func:`flashmask3.masks.blocks.classify_tiles`), the element-wise mask rule, and the two
preprocessing kernels every attention kernel reads: per key block **summaries**
(:func:`block_summaries`, 8 int32 per block: min/max start and end of each masked interval) and
per query (or key) block **live ranges** (:func:`live_ranges`: at most two half-open runs of
non-SKIP blocks, each with its first run of UNMASKED blocks). Host side: :class:`Config` (a
tile shape and launch parameters) and :class:`Plan` (the preprocessed mask for one tile shape,
:func:`make_plan`). docs/kernels.md explains the algorithm; docs/masks.md the mask semantics.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launcher import cdiv, launch
from .static_masks import STATIC_PLANS
from .static_masks import capturing as _capturing  # (module names: tests replace them)
from .static_masks import warming_up as _warming_up

LOG2E = 1.4426950408889634
SKIP, PARTIAL, UNMASKED = 0, 1, 2
#: int32 statistics per key block: for interval 0 and 1, max/min of start and max/min of end.
NSTAT = 8
#: int32 words per block in a live-range table: two live ranges and the first run of
#: UNMASKED tiles inside each (see ``_range_kernel``).
RANGE_WORDS = tl.constexpr(8)
#: Integer arguments not specialised on (divisibility by 16): one compile serves every length.
_NO_SPEC = ["Sq", "Sk", "Hq", "Hk", "Hm", "NQB", "NKB", "mask_b_stride"]


# ---------------------------------------------------------------------------------------------
# The tile rule (twin of flashmask3.masks.blocks.classify_tiles) and the element-wise rule
# ---------------------------------------------------------------------------------------------


@triton.jit
def _classify_rule(r0, r1, c0, c1, Sq, Sk,
                   s0max, s0min, e0max, e0min, s1max, s1min, e1max, e1min,
                   CAUSAL: tl.constexpr, NI: tl.constexpr):
    """Class of tile rows [r0, r1) x cols [c0, c1) (both clipped): 0 SKIP, 1 PARTIAL, 2 UNMASKED.

    ``NI`` is the number of masked row intervals per column (0, 1 or 2); the statistics are
    the block's min/max of each interval's start and end. Works on scalars and on vectors.
    """
    skip = r0 < 0  # all-False of the right shape
    part = r0 < 0
    if CAUSAL:
        skip = skip | (c0 > r1 - 1 + (Sk - Sq))
        part = part | (c1 - 1 > r0 + (Sk - Sq))
    if NI >= 1:
        skip = skip | ((r0 >= s0max) & (r1 <= e0min))
        part = part | ((r0 < e0max) & (r1 > s0min))
    if NI >= 2:
        skip = skip | ((r0 >= s1max) & (r1 <= e1min))
        part = part | ((r0 < e1max) & (r1 > s1min))
    return tl.where(skip, 0, tl.where(part, 1, 2))


@triton.jit
def _load_stats(sum_ptr, n, valid):
    """The 8 block statistics of key block(s) ``n`` (scalar or vector), ``valid`` masks lanes."""
    p = sum_ptr + n * 8
    s0max = tl.load(p + 0, mask=valid, other=0)
    s0min = tl.load(p + 1, mask=valid, other=0)
    e0max = tl.load(p + 2, mask=valid, other=0)
    e0min = tl.load(p + 3, mask=valid, other=0)
    s1max = tl.load(p + 4, mask=valid, other=0)
    s1min = tl.load(p + 5, mask=valid, other=0)
    e1max = tl.load(p + 6, mask=valid, other=0)
    e1min = tl.load(p + 7, mask=valid, other=0)
    return s0max, s0min, e0max, e0min, s1max, s1min, e1max, e1min


@triton.jit
def _tile_class(sum_ptr, m, n, Sq, Sk, valid,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                NI: tl.constexpr):
    """Class of tile (query block m, key block n) from the summaries (scalars or vectors)."""
    r0 = m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, Sq)
    c0 = n * BLOCK_N
    c1 = tl.minimum(c0 + BLOCK_N, Sk)
    if NI > 0:
        s0max, s0min, e0max, e0min, s1max, s1min, e1max, e1min = _load_stats(sum_ptr, n, valid)
    else:
        s0max = 0
        s0min = 0
        e0max = 0
        e0min = 0
        s1max = 0
        s1min = 0
        e1max = 0
        e1min = 0
    return _classify_rule(r0, r1, c0, c1, Sq, Sk, s0max, s0min, e0max, e0min,
                          s1max, s1min, e1max, e1min, CAUSAL, NI)


@triton.jit
def _kv_tile(k_ptr, v_ptr, k_desc, v_desc, kv_row0, kv_col, kv_stride, c0, Sk,
             D: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """K and V rows [c0, c0 + BLOCK_N) of one KV head: a TMA load, or masked pointer loads
    that read rows past Sk as zeros (TMA may read the next batch's rows: the element mask of a
    clipped tile discards them)."""
    if USE_TMA:
        k = k_desc.load([kv_row0 + c0, kv_col])
        v = v_desc.load([kv_row0 + c0, kv_col])
    else:
        offs_n = c0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        kv_off = (kv_row0 + offs_n).to(tl.int64)[:, None] * kv_stride + kv_col + offs_d[None, :]
        kmask = (offs_n < Sk)[:, None]
        k = tl.load(k_ptr + kv_off, mask=kmask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kmask, other=0.0)
    return k, v


@triton.jit
def _clipped_tile_class(sptr, m, n, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, NI: tl.constexpr):
    """The tile's class, demoted from UNMASKED to PARTIAL when its key block reaches past Sk,
    so the element mask also cuts the tail columns."""
    cls = _tile_class(sptr, m, n, Sq, Sk, True, BLOCK_M, BLOCK_N, CAUSAL, NI)
    if n * BLOCK_N + BLOCK_N > Sk:
        cls = tl.minimum(cls, 1)
    return cls


@triton.jit
def _stored_ranges(rng_ptr, row):
    """Row ``row`` of a preprocessed live-range table (the ``_range_kernel`` layout): lo0, hi0,
    lo1, hi1, flo0, fhi0, flo1, fhi1."""
    rp = rng_ptr + row * RANGE_WORDS
    return (tl.load(rp), tl.load(rp + 1), tl.load(rp + 2), tl.load(rp + 3),
            tl.load(rp + 4), tl.load(rp + 5), tl.load(rp + 6), tl.load(rp + 7))


@triton.jit
def _key_block_ranges(rng_ptr, mbh, n_blk, Sq, Sk, NQB, NKB, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, C: tl.constexpr):
    """The two live query-block ranges [lo0, hi0), [lo1, hi1) of one key block and the first
    run of UNMASKED tiles in each, [flo0, fhi0) and [flo1, fhi1): from the preprocessed table
    with a mask, from the causal diagonal (or everything) without one."""
    if C > 0:
        lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1 = _stored_ranges(rng_ptr, mbh * NKB + n_blk)
    else:
        lo0 = 0
        flo0 = 0
        c0 = n_blk * BLOCK_N
        if CAUSAL:
            first_row = c0 - (Sk - Sq)  # first row that sees this block
            lo0 = tl.minimum(tl.maximum(first_row, 0) // BLOCK_M, NQB)
            last_col = tl.minimum(c0 + BLOCK_N, Sk) - 1  # rows >= this see the whole block
            flo0 = tl.minimum(tl.cdiv(tl.maximum(last_col - (Sk - Sq), 0), BLOCK_M), NQB)
        hi0 = NQB
        fhi0 = hi0
        if c0 + BLOCK_N > Sk:  # the tail columns need the element mask
            flo0 = hi0
        lo1 = hi0
        hi1 = hi0
        flo1 = hi0
        fhi1 = hi0
    return lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1


@triton.jit
def _query_block_ranges(rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, C: tl.constexpr):
    """The two live key-block ranges [lo0, hi0), [lo1, hi1) of one query block and the first
    run of UNMASKED tiles in each, [flo0, fhi0) and [flo1, fhi1): from the preprocessed table
    with a mask, from the causal diagonal (or everything) without one."""
    if C > 0:
        lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1 = _stored_ranges(rng_ptr, mbh * NQB + m_blk)
    else:
        lo0 = 0
        n_whole = Sk // BLOCK_N  # key blocks that end inside Sk
        if CAUSAL:
            r0 = m_blk * BLOCK_M
            r1 = tl.minimum(r0 + BLOCK_M, Sq)
            last = r1 - 1 + (Sk - Sq)  # last visible column of the block
            hi0 = tl.maximum(tl.minimum((last + BLOCK_N) // BLOCK_N, NKB), 0)
            hi0 = tl.where(last < 0, 0, hi0)
            # key blocks whose every column is visible from the block's first row
            fhi0 = tl.maximum(r0 + (Sk - Sq) + 1, 0) // BLOCK_N
        else:
            hi0 = NKB
            fhi0 = NKB
        fhi0 = tl.minimum(tl.minimum(fhi0, n_whole), hi0)
        flo0 = tl.where(fhi0 > 0, 0, hi0)
        fhi0 = tl.where(fhi0 > 0, fhi0, hi0)
        lo1 = hi0
        hi1 = hi0
        flo1 = hi0
        fhi1 = hi0
    return lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1


@triton.jit
def _column_intervals(col_ptr, cols, cvalid, Sq, CAUSAL: tl.constexpr, C: tl.constexpr):
    """Masked row intervals [s0, e0) and [s1, e1) of columns ``cols`` (docs/masks.md)."""
    if C == 0:
        s0 = cols * 0 + Sq
        e0 = s0
        s1 = s0
        e1 = s0
    elif CAUSAL and C == 1:
        s0 = tl.load(col_ptr + cols, mask=cvalid, other=0)
        e0 = cols * 0 + Sq
        s1 = e0
        e1 = e0
    elif CAUSAL:  # C == 2: [LTS, LTE)
        s0 = tl.load(col_ptr + cols * 2, mask=cvalid, other=0)
        e0 = tl.load(col_ptr + cols * 2 + 1, mask=cvalid, other=0)
        s1 = cols * 0 + Sq
        e1 = s1
    elif C == 2:  # non-causal: [LTS, Sq) and [0, UTE)
        s0 = tl.load(col_ptr + cols * 2, mask=cvalid, other=0)
        e0 = cols * 0 + Sq
        s1 = cols * 0
        e1 = tl.load(col_ptr + cols * 2 + 1, mask=cvalid, other=0)
    else:  # C == 4: [LTS, LTE) and [UTS, UTE)
        s0 = tl.load(col_ptr + cols * 4, mask=cvalid, other=0)
        e0 = tl.load(col_ptr + cols * 4 + 1, mask=cvalid, other=0)
        s1 = tl.load(col_ptr + cols * 4 + 2, mask=cvalid, other=0)
        e1 = tl.load(col_ptr + cols * 4 + 3, mask=cvalid, other=0)
    return s0, e0, s1, e1


@triton.jit
def _element_masked(rows, cols, col_ptr, Sq, Sk, CAUSAL: tl.constexpr, C: tl.constexpr):
    """True where (row, col) is masked; ``rows``/``cols`` are broadcastable 2-D index tensors.

    Columns at or beyond ``Sk`` (padding of the last block) are masked too.
    """
    cvalid = cols < Sk
    masked = cols >= Sk
    if C > 0:
        s0, e0, s1, e1 = _column_intervals(col_ptr, cols, cvalid, Sq, CAUSAL, C)
        masked = masked | ((rows >= s0) & (rows < e0))
        if (not CAUSAL) or C == 4:
            masked = masked | ((rows >= s1) & (rows < e1))
    if CAUSAL:
        masked = masked | (cols > rows + (Sk - Sq))
    return masked


# ---------------------------------------------------------------------------------------------
# Preprocessing: block summaries and live ranges
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["Sq", "Sk", "NKB", "mask_bh_stride"])
def _summary_kernel(mask_ptr, sum_ptr, Sq, Sk, NKB, mask_bh_stride,
                    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, C: tl.constexpr):
    """One program per (key block, batch*mask head): min/max of interval starts and ends."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    cvalid = cols < Sk
    col_ptr = mask_ptr + bh * mask_bh_stride
    s0, e0, s1, e1 = _column_intervals(col_ptr, cols, cvalid, Sq, CAUSAL, C)
    big = 2147483647
    out = sum_ptr + (bh * NKB + n) * 8
    tl.store(out + 0, tl.max(tl.where(cvalid, s0, -big), 0))
    tl.store(out + 1, tl.min(tl.where(cvalid, s0, big), 0))
    tl.store(out + 2, tl.max(tl.where(cvalid, e0, -big), 0))
    tl.store(out + 3, tl.min(tl.where(cvalid, e0, big), 0))
    tl.store(out + 4, tl.max(tl.where(cvalid, s1, -big), 0))
    tl.store(out + 5, tl.min(tl.where(cvalid, s1, big), 0))
    tl.store(out + 6, tl.max(tl.where(cvalid, e1, -big), 0))
    tl.store(out + 7, tl.min(tl.where(cvalid, e1, big), 0))


@triton.jit
def _classes_along(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, NI: tl.constexpr,
                   BY_KEY: tl.constexpr):
    """Classes of the tiles pairing block ``fixed`` with blocks ``idx`` of the other axis (a
    key block with query blocks when BY_KEY, else a query block with key blocks)."""
    if BY_KEY:
        cls = _tile_class(sptr, idx, fixed, Sq, Sk, True, BLOCK_M, BLOCK_N, CAUSAL, NI)
    else:
        cls = _tile_class(sptr, fixed, idx, Sq, Sk, valid, BLOCK_M, BLOCK_N, CAUSAL, NI)
    return cls


@triton.jit(do_not_specialize=["Sq", "Sk", "NQB", "NKB"])
def _range_kernel(sum_ptr, rng_ptr, Sq, Sk, NQB, NKB,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  NI: tl.constexpr, BY_KEY: tl.constexpr, CHUNK: tl.constexpr):
    """Live ranges of one query block (BY_KEY=False) or one key block (BY_KEY=True).

    Writes ``[lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1]``: the first run of live blocks is
    ``[lo0, hi0)``, and ``[lo1, hi1)`` runs from the next live block to the last one (it may
    hold SKIP tiles, which the kernels classify again). ``[floR, fhiR)`` is the first run of
    UNMASKED tiles inside range R (empty at its end when there is none): the kernels visit it
    in a loop compiled without any mask code. Vector scans over the other axis.
    """
    fixed = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    sptr = sum_ptr + bh * NKB * 8
    if BY_KEY:
        n_other = NQB
    else:
        n_other = NKB
    offs = tl.arange(0, CHUNK)
    lo = n_other
    hi = 0
    for start in range(0, n_other, CHUNK):
        idx = start + offs
        valid = idx < n_other
        cls = _classes_along(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI, BY_KEY)
        live = valid & (cls != 0)
        lo = tl.minimum(lo, tl.min(tl.where(live, idx, n_other), 0))
        hi = tl.maximum(hi, tl.max(tl.where(live, idx + 1, 0), 0))
    lo = tl.minimum(lo, hi)
    gap = hi
    for start in range(0, n_other, CHUNK):
        idx = start + offs
        valid = (idx > lo) & (idx < hi)
        cls = _classes_along(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI, BY_KEY)
        dead = valid & (cls == 0)
        gap = tl.minimum(gap, tl.min(tl.where(dead, idx, hi), 0))
    lo1 = hi
    for start in range(0, n_other, CHUNK):
        idx = start + offs
        valid = (idx >= gap) & (idx < hi)
        cls = _classes_along(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI, BY_KEY)
        live = valid & (cls != 0)
        lo1 = tl.minimum(lo1, tl.min(tl.where(live, idx, hi), 0))
    flo0, fhi0 = _unmasked_run(sptr, fixed, lo, gap, n_other, Sq, Sk, BLOCK_M, BLOCK_N,
                               CAUSAL, NI, BY_KEY, CHUNK)
    flo1, fhi1 = _unmasked_run(sptr, fixed, lo1, hi, n_other, Sq, Sk, BLOCK_M, BLOCK_N,
                               CAUSAL, NI, BY_KEY, CHUNK)
    if BY_KEY:
        out = rng_ptr + (bh * NKB + fixed) * RANGE_WORDS
    else:
        out = rng_ptr + (bh * NQB + fixed) * RANGE_WORDS
    tl.store(out + 0, lo)
    tl.store(out + 1, gap)
    tl.store(out + 2, lo1)
    tl.store(out + 3, hi)
    tl.store(out + 4, flo0)
    tl.store(out + 5, fhi0)
    tl.store(out + 6, flo1)
    tl.store(out + 7, fhi1)


@triton.jit
def _unmasked_run(sptr, fixed, lo, hi, n_other, Sq, Sk, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, NI: tl.constexpr,
                  BY_KEY: tl.constexpr, CHUNK: tl.constexpr):
    """``[flo, fhi)``: the first run of UNMASKED tiles in ``[lo, hi)`` along the other axis
    (``n_other`` blocks; ``flo == fhi == hi`` when there is none). A tile whose key block
    reaches past ``Sk`` counts as masked: its tail columns need the element mask."""
    offs = tl.arange(0, CHUNK)
    flo = hi
    for start in range(0, n_other, CHUNK):
        idx = start + offs
        valid = (idx >= lo) & (idx < hi)
        full = valid & _unmasked(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL,
                                 NI, BY_KEY)
        flo = tl.minimum(flo, tl.min(tl.where(full, idx, hi), 0))
    fhi = hi
    for start in range(0, n_other, CHUNK):
        idx = start + offs
        valid = (idx > flo) & (idx < hi)
        full = _unmasked(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI, BY_KEY)
        fhi = tl.minimum(fhi, tl.min(tl.where(valid & ~full, idx, hi), 0))
    return flo, fhi


@triton.jit
def _unmasked(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, NI: tl.constexpr, BY_KEY: tl.constexpr):
    """Whether tiles (fixed, idx) along the other axis are UNMASKED and not clipped at Sk."""
    cls = _classes_along(sptr, fixed, idx, valid, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI, BY_KEY)
    if BY_KEY:
        clipped = fixed * BLOCK_N + BLOCK_N > Sk
    else:
        clipped = idx * BLOCK_N + BLOCK_N > Sk
    return (cls == 2) & (~clipped)




@dataclass(frozen=True)
class Config:
    """Tile shape and launch parameters of one kernel (BLOCK_M query rows, BLOCK_N keys)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _num_intervals(causal: bool, c: int) -> int:
    """Masked row intervals per column: causal C=1/2 -> 1, non-causal C=2/4 -> 2, none -> 0."""
    if c == 0:
        return 0
    return 1 if causal else 2


@dataclass
class Plan:
    """Preprocessed mask for one (BLOCK_M, BLOCK_N): block summaries and live ranges."""

    mask: torch.Tensor  # [B, Hm, Sk, C] contiguous int32 (a dummy when there is no mask)
    summary: torch.Tensor  # [Bm*Hm, NKB, 8] int32
    ranges: torch.Tensor  # [Bm*Hm, NQB or NKB, RANGE_WORDS] int32
    c: int
    ni: int
    hm: int
    mask_b_stride: int


def _dummy(device) -> torch.Tensor:
    return torch.zeros(8, dtype=torch.int32, device=device)


def block_summaries(mask: torch.Tensor, causal: bool, seqlen_q: int, block_n: int) -> torch.Tensor:
    """Per key block: max/min start and max/min end of both masked intervals, [Bm*Hm, NKB, 8]."""
    bm, hm, sk, c = mask.shape
    nkb = cdiv(sk, block_n)
    summary = torch.empty((bm * hm, nkb, NSTAT), dtype=torch.int32, device=mask.device)
    if nkb > 0 and bm * hm > 0:
        launch(_summary_kernel, (nkb, bm * hm), mask, summary, seqlen_q, sk, nkb, sk * c,
               BLOCK_N=block_n, CAUSAL=causal, C=c, num_warps=4)
    return summary


def live_ranges(summary: torch.Tensor, causal: bool, ni: int, seqlen_q: int, seqlen_k: int,
                block_m: int, block_n: int, by_key: bool) -> torch.Tensor:
    """Two live ranges per query block (by_key=False) or per key block (by_key=True), and the
    first run of UNMASKED tiles in each: ``[.., RANGE_WORDS]`` (layout in ``_range_kernel``)."""
    nqb = cdiv(seqlen_q, block_m)
    nkb = cdiv(seqlen_k, block_n)
    n_fixed = nkb if by_key else nqb
    nbh = summary.shape[0]
    ranges = torch.empty((nbh, n_fixed, RANGE_WORDS), dtype=torch.int32, device=summary.device)
    if n_fixed > 0 and nbh > 0:
        launch(_range_kernel, (n_fixed, nbh), summary, ranges, seqlen_q, seqlen_k, nqb, nkb,
               BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, NI=ni, BY_KEY=by_key, CHUNK=256, num_warps=4)
    return ranges


def make_plan(mask: Optional[torch.Tensor], causal: bool, seqlen_q: int, seqlen_k: int,
              block_m: int, block_n: int, by_key: bool, device) -> Plan:
    """Everything the attention kernels need to know about the mask for one tile shape."""
    if mask is None:
        d = _dummy(device)
        return Plan(d, d, d, 0, 0, 1, 0)
    mask = mask.contiguous()
    summary = block_summaries(mask, causal, seqlen_q, block_n)
    return _plan_from(mask, summary, causal, seqlen_q, seqlen_k, block_m, block_n, by_key)


def _plan_from(mask, summary, causal, seqlen_q, seqlen_k, block_m, block_n, by_key) -> Plan:
    """The plan of a contiguous ``mask`` whose block summaries (for ``block_n``) are known."""
    bm, hm, _, c = mask.shape
    ni = _num_intervals(causal, c)
    ranges = live_ranges(summary, causal, ni, seqlen_q, seqlen_k, block_m, block_n, by_key)
    return Plan(mask, summary, ranges, c, ni, hm, hm if bm > 1 else 0)


# ---------------------------------------------------------------------------------------------
# Plan reuse: a model calls attention once per layer with the same mask tensor
# ---------------------------------------------------------------------------------------------

#: id(mask) -> _MaskPlans. An entry goes when its mask is freed (weakref callback), so the
#: cache never keeps a mask alive; it holds the plans' summary / range tensors only.
_PLAN_CACHE: dict = {}


class _MaskPlans:
    """The plans of one live mask tensor at one ``_version``: summaries by (causal, Sq,
    block_n) and ranges by (causal, Sq, Sk, block_m, block_n, by_key). ``shared``: an entry of
    :data:`_PLAN_CACHE` (a weak reference to the mask, which drops the entry when the mask is
    freed); otherwise a static mask's own holder, kept on the mask itself
    (:mod:`.static_masks`: it lives exactly as long as the mask, so a CUDA graph that reads the
    mask can read its plans too, and :func:`clear_plan_cache` leaves it)."""

    __slots__ = ("ref", "version", "summaries", "plans")

    def __init__(self, mask: torch.Tensor, shared: bool = True):
        key = id(mask)
        self.ref = weakref.ref(mask, lambda _ref, key=key: _forget(key, _ref)) if shared else None
        self.version = mask._version
        self.summaries: dict = {}
        self.plans: dict = {}


def _forget(key: int, ref) -> None:
    """Drop the cache entry of a freed mask (only if it is still that mask's entry)."""
    entry = _PLAN_CACHE.get(key)
    if entry is not None and entry.ref is ref:
        del _PLAN_CACHE[key]


def _entry_of(mask: torch.Tensor) -> _MaskPlans:
    """This mask's cache entry, new when the mask is new (a recycled id holding another
    tensor included) or was written in place since (its ``_version`` moved)."""
    entry = _PLAN_CACHE.get(id(mask))
    if entry is None or entry.ref() is not mask or entry.version != mask._version:
        entry = _PLAN_CACHE[id(mask)] = _MaskPlans(mask)
    return entry


def _plans_of(mask: torch.Tensor, capturing: bool):
    """The plans holder of ``mask`` for :func:`cached_plan`: a static mask's own (new if it
    has none yet or was written in place since; None then while capturing: a holder made
    during a capture would keep plans only replays fill), the shared cache's entry, or None
    while capturing."""
    if not hasattr(mask, STATIC_PLANS):
        return None if capturing else _entry_of(mask)
    static = getattr(mask, STATIC_PLANS)
    if static is None or static.version != mask._version:
        if capturing:
            return None
        static = _MaskPlans(mask, shared=False)
        setattr(mask, STATIC_PLANS, static)
    return static


def cached_plan(mask: Optional[torch.Tensor], causal: bool, seqlen_q: int, seqlen_k: int,
                block_m: int, block_n: int, by_key: bool, device) -> Plan:
    """:func:`make_plan`, reused while the same mask tensor is unchanged: keyed on the tensor's
    identity (a weak reference) and its ``_version`` (in-place writes through torch bump it),
    plus causal, Sq, Sk and the tile; the block summaries are shared by every plan with the same
    ``block_n`` (the forward's and the backward's). While a CUDA graph is being captured the
    plan is built in the graph (replays may copy new columns in), except for a static mask's
    plans made before the capture (:mod:`.static_masks`: they live on the mask). While
    inductor's CUDA graph trees warm a graph up, cached plans are read but new ones are not kept
    (:func:`.static_masks.warming_up`). Caveat (docs/host-path.md): writes that bypass
    torch's version counter (a custom kernel writing through a raw pointer) are not seen."""
    if mask is None or not mask.is_contiguous():
        return make_plan(mask, causal, seqlen_q, seqlen_k, block_m, block_n, by_key, device)
    capturing = _capturing(mask)
    entry = _plans_of(mask, capturing)
    key = (causal, seqlen_q, seqlen_k, block_m, block_n, by_key)
    plan = None if entry is None else entry.plans.get(key)
    if plan is None:
        if capturing or _warming_up(mask):  # built in the graph or the warm-up, kept nowhere
            return make_plan(mask, causal, seqlen_q, seqlen_k, block_m, block_n, by_key, device)
        skey = (causal, seqlen_q, block_n)
        summary = entry.summaries.get(skey)
        if summary is None:
            summary = entry.summaries[skey] = block_summaries(mask, causal, seqlen_q, block_n)
        plan = _plan_from(mask, summary, causal, seqlen_q, seqlen_k, block_m, block_n, by_key)
        plan.mask = None  # the cache must not hold the mask
        entry.plans[key] = plan
    return Plan(mask, plan.summary, plan.ranges, plan.c, plan.ni, plan.hm, plan.mask_b_stride)


def clear_plan_cache() -> None:
    """Forget every cached plan (tests, benchmarks of the uncached path)."""
    _PLAN_CACHE.clear()
