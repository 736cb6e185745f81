"""Triton FlashMask kernels (forward and backward) for Hopper, behind ``flashmask3.kernels``.

Backend contract (docs/ARCHITECTURE.md): :func:`forward` and :func:`backward`. Layout is
q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hk, D]`` (GQA without repeating K/V), mask
``startend_row_indices`` int32 ``[B, Hm, Sk, C]`` or ``None``, LSE fp32 ``[B, Hq, Sq]``.

How the work is organised (DESIGN.md §2):

1. **Block summaries** (:func:`_summary_kernel`, O(Sk)): for every key block of ``BLOCK_N``
   columns, the min/max start and end of each masked row interval, 8 int32 per block.
2. **Live ranges** (:func:`_range_kernel`, per mask head, not per query head): for every query
   block the key blocks that are not SKIP, as at most two half-open ranges (a sliding window
   plus global tokens is two runs of live blocks); and the same per key block over query
   blocks for the dK/dV pass. The attention loops visit only these ranges. Each range also
   records its first run of UNMASKED tiles (:data:`RANGE_WORDS` = 8 int32 per block).
3. **Attention loops** classify each visited tile with :func:`_classify_rule` (the ``@jit``
   twin of :func:`flashmask3.masks.blocks.classify_tiles`): UNMASKED tiles run with no mask
   work; PARTIAL tiles (and the causal diagonal) apply the element-wise rule of DESIGN.md §1.
   With :data:`SPLIT_UNMASKED_LOOP` a kernel visits a range's UNMASKED run in a separate loop
   compiled without any mask code (fewer instructions and live registers in the hot loop).
   Tiles outside the ranges are never loaded nor computed. The first range is exactly one run
   of live tiles; a SKIP tile inside the second range (a mask with three or more separate
   runs of live key blocks for one query block, e.g. random per-column masks) is computed and
   then fully masked by the element rule: correct, and kept off the hot path so that the loop
   body has no data-dependent branch around its loads and matrix products (which would stop
   Triton from pipelining them).
4. **Backward**: a delta pre-pass (``rowsum(dO*O) - dlse``, plus ``lse`` in base 2 with
   ``+inf`` on fully masked rows), a dK/dV pass with one program per key block and KV head
   that loops over the query heads of its GQA group, and a dQ pass with one program per query
   block. No atomics, so this ("split") backward is deterministic; the opt-in "fused" one
   (:func:`backward_mode`) adds dQ into an fp32 buffer with atomics from the dK/dV pass.

Hopper specifics: the tiles streamed by each loop (K/V in the forward and dQ passes, Q/dO in
the dK/dV pass) are read through host-side tensor descriptors (TMA) when the GPU has compute
capability >= 9, and the loop-invariant A operands optionally too (:data:`A_OPERAND_IN_SMEM`);
the loops are software pipelined (``num_stages``); block shapes and warps come from a small
per-(kernel, D) candidate table (:data:`CANDIDATES`, chosen from the sm_90 register/spill
report, :mod:`flashmask3.kernels.triton_report`) that :func:`autotune` refines on the device,
keyed on (kernel, D, causal, C, dtype). Measurements and their history: benchmarks/NOTES.md.

The module imports without a GPU; under ``TRITON_INTERPRET=1`` it runs on CPU tensors
(fp32/fp16), which is how CI tests it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

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
    """Masked row intervals [s0, e0) and [s1, e1) of columns ``cols`` (DESIGN.md §1 table)."""
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


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, offs_m, lo, hi,
               k_ptr, v_ptr, k_desc, v_desc, kv_row0, kv_col, kv_stride,
               sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
               USE_TMA: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """Online-softmax accumulation of key blocks [lo, hi) into (acc, l_i, m_i).

    MASKED=False: a loop with no mask code, for runs of UNMASKED tiles (every score is finite,
    so the running max is too)."""
    offs_nb = tl.arange(0, BLOCK_N)
    for n in tl.range(lo, hi):
        c0 = n * BLOCK_N
        k, v = _kv_tile(k_ptr, v_ptr, k_desc, v_desc, kv_row0, kv_col, kv_stride, c0, Sk, D,
                        BLOCK_N, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        if MASKED:
            cls = _clipped_tile_class(sptr, m_blk, n, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI)
            if cls != 2:
                cols = (c0 + offs_nb)[None, :]
                masked = _element_masked(offs_m[:, None], cols, col_ptr, Sq, Sk, CAUSAL, C)
                qk = tl.where(masked, float("-inf"), qk)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_range(acc, l_i, m_i, q, offs_m, lo, flo, fhi, hi, k_ptr, v_ptr, k_desc, v_desc,
               kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
               USE_TMA: tl.constexpr, PREC: tl.constexpr, SPLIT_UNMASKED: tl.constexpr):
    """One live range [lo, hi) of key blocks: a masked loop over all of it, or (SPLIT_UNMASKED)
    masked [lo, flo), mask-free [flo, fhi), masked [fhi, hi)."""
    if SPLIT_UNMASKED:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, lo, flo, k_ptr, v_ptr, k_desc,
                                   v_desc, kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq,
                                   Sk, scale_log2, D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA,
                                   PREC, True)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, flo, fhi, k_ptr, v_ptr, k_desc,
                                   v_desc, kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq,
                                   Sk, scale_log2, D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA,
                                   PREC, False)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, fhi, hi, k_ptr, v_ptr, k_desc,
                                   v_desc, kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq,
                                   Sk, scale_log2, D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA,
                                   PREC, True)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, lo, hi, k_ptr, v_ptr, k_desc,
                                   v_desc, kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq,
                                   Sk, scale_log2, D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA,
                                   PREC, True)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_NO_SPEC)
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, mask_ptr, sum_ptr, rng_ptr,
                k_desc, v_desc, q_desc,
                scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                USE_TMA: tl.constexpr, PREC: tl.constexpr, A_SMEM: tl.constexpr,
                SPLIT_UNMASKED: tl.constexpr):
    """One program per (query block, batch*query head): O and LSE of BLOCK_M query rows."""
    pid = tl.program_id(0)
    if CAUSAL:
        m_blk = NQB - 1 - pid  # heavy (late) query blocks first
    else:
        m_blk = pid
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hk)
    hm = h // (Hq // Hm)
    b64 = b.to(tl.int64)
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_off = (b64 * Sq + offs_m)[:, None] * (Hq * D) + h * D + offs_d[None, :]
    if USE_TMA and A_SMEM:  # Q stays in shared memory as the wgmma A operand (saves registers)
        q = q_desc.load([b * Sq + m_blk * BLOCK_M, h * D])
    else:
        q = tl.load(q_ptr + q_off, mask=(offs_m < Sq)[:, None], other=0.0)

    mbh = b64 * mask_b_stride + hm
    sptr = sum_ptr + mbh * NKB * 8
    col_ptr = mask_ptr + mbh * Sk * C
    lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1 = _query_block_ranges(
        rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    kv_row0 = b * Sk
    kv_col = hk * D
    kv_stride = Hk * D
    acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, offs_m, lo0, flo0, fhi0, hi0, k_ptr, v_ptr,
                               k_desc, v_desc, kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk,
                               Sq, Sk, scale_log2, D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA,
                               PREC, SPLIT_UNMASKED)
    acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, offs_m, lo1, flo1, fhi1, hi1, k_ptr, v_ptr,
                               k_desc, v_desc, kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk,
                               Sq, Sk, scale_log2, D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA,
                               PREC, SPLIT_UNMASKED)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=(offs_m < Sq)[:, None])
    tl.store(lse_ptr + (b64 * Hq + h) * Sq + offs_m, lse, mask=offs_m < Sq)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["Sq", "Hq"])
def _bwd_pre_kernel(o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, lse2_ptr, Sq, Hq,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) - dlse and lse2 = lse * log2(e) (+inf on fully masked rows)."""
    m_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rmask = offs_m < Sq
    off = (b * Sq + offs_m)[:, None] * (Hq * D) + h * D + offs_d[None, :]
    o = tl.load(o_ptr + off, mask=rmask[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off, mask=rmask[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    row = (b * Hq + h) * Sq + offs_m
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row, mask=rmask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row, mask=rmask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(delta_ptr + row, delta, mask=rmask)
    tl.store(lse2_ptr + row, lse2, mask=rmask)


@triton.jit(do_not_specialize=["Sq", "Hq"])
def _scale_dq_kernel(src_ptr, dst_ptr, scale, Sq, Hq, s_b, s_q, s_h, s_d,
                     D: tl.constexpr, BLOCK_Q: tl.constexpr):
    """dst[b, q, h, :] = scale * src[b, q, h, :] cast to dst's dtype, dst contiguous, src any
    strides: the fused backward's fp32 dQ accumulator (a [B, Sq, Hq, D] view of the Gluon
    kernel's dQᵀ buffer [B, Hq, D, Sq_pad], q contiguous) read along q and written along D."""
    q_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    offs_q = q_blk * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, D)
    qmask = (offs_q < Sq)[:, None]
    src = src_ptr + b * s_b + h * s_h + offs_q[:, None].to(tl.int64) * s_q + offs_d[None, :] * s_d
    x = tl.load(src, mask=qmask, other=0.0)
    dst = dst_ptr + ((b * Sq + offs_q[:, None]) * Hq + h) * D + offs_d[None, :]
    tl.store(dst, (x * scale).to(dst_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _dkdv_inner(dk, dv, k, v, lo, hi, q_ptr, do_ptr, q_desc, do_desc, lse2_ptr, delta_ptr,
                dq_ptr, dq_desc,
                q_row0, q_col, q_stride, stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                USE_TMA: tl.constexpr, PREC: tl.constexpr, FUSE_DQ: tl.constexpr,
                DQ_TMA: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dK, dV of one key block over query blocks [lo, hi) of one query head.

    MASKED=False compiles a loop with no mask code (fewer live registers: the caller passes
    only runs of UNMASKED tiles); MASKED=True classifies each tile and masks the PARTIAL ones.

    With FUSE_DQ, also add this key block's share of dQ (unscaled, fp32) into ``dq_ptr`` with
    atomics: a TMA reduce-add of the whole tile (DQ_TMA) or element atomics. Rows past Sq get
    exact zeros (their P is 0), so a tile that spills into the next batch's rows adds nothing.
    """
    offs_d = tl.arange(0, D)
    offs_mb = tl.arange(0, BLOCK_M)
    c0 = n_blk * BLOCK_N
    offs_n = c0 + tl.arange(0, BLOCK_N)
    for m in tl.range(lo, hi):
        r0 = m * BLOCK_M
        offs_m = r0 + offs_mb
        rmask = offs_m < Sq
        off = (q_row0 + offs_m).to(tl.int64)[:, None] * q_stride + q_col + offs_d[None, :]
        if USE_TMA:
            q = q_desc.load([q_row0 + r0, q_col])
            do = do_desc.load([q_row0 + r0, q_col])
        else:
            q = tl.load(q_ptr + off, mask=rmask[:, None], other=0.0)
            do = tl.load(do_ptr + off, mask=rmask[:, None], other=0.0)
        lse2 = tl.load(lse2_ptr + stat_row0 + offs_m, mask=rmask, other=float("inf"))
        delta = tl.load(delta_ptr + stat_row0 + offs_m, mask=rmask, other=0.0)
        qkT = tl.dot(k, tl.trans(q), input_precision=PREC)
        pT = tl.math.exp2(qkT * scale_log2 - lse2[None, :])
        if MASKED:
            cls = _clipped_tile_class(sptr, m, n_blk, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI)
            if cls != 2:
                masked = _element_masked(offs_m[None, :], offs_n[:, None], col_ptr, Sq, Sk,
                                         CAUSAL, C)
                pT = tl.where(masked, 0.0, pT)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
        if FUSE_DQ:
            dq_part = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=PREC)
            if DQ_TMA:
                dq_desc.atomic_add([q_row0 + r0, q_col], dq_part)
            else:
                tl.atomic_add(dq_ptr + off, dq_part, mask=rmask[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_range(dk, dv, k, v, lo, flo, fhi, hi, q_ptr, do_ptr, q_desc, do_desc, lse2_ptr,
                delta_ptr, dq_ptr, dq_desc, q_row0, q_col, q_stride, stat_row0, sptr, col_ptr,
                n_blk, Sq, Sk, scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                USE_TMA: tl.constexpr, PREC: tl.constexpr, FUSE_DQ: tl.constexpr,
                DQ_TMA: tl.constexpr, SPLIT_UNMASKED: tl.constexpr):
    """One live range [lo, hi) of query blocks: a masked loop over all of it, or (SPLIT_UNMASKED)
    masked [lo, flo), mask-free [flo, fhi), masked [fhi, hi)."""
    if SPLIT_UNMASKED:
        dk, dv = _dkdv_inner(dk, dv, k, v, lo, flo, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, dq_ptr, dq_desc, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, FUSE_DQ, DQ_TMA, True)
        dk, dv = _dkdv_inner(dk, dv, k, v, flo, fhi, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, dq_ptr, dq_desc, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, FUSE_DQ, DQ_TMA, False)
        dk, dv = _dkdv_inner(dk, dv, k, v, fhi, hi, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, dq_ptr, dq_desc, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, FUSE_DQ, DQ_TMA, True)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, lo, hi, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, dq_ptr, dq_desc, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, FUSE_DQ, DQ_TMA, True)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPEC)
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse2_ptr, delta_ptr,
                 mask_ptr, sum_ptr, rng_ptr, q_desc, do_desc, k_desc, v_desc, dq_ptr, dq_desc,
                 sm_scale, scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                 USE_TMA: tl.constexpr, PREC: tl.constexpr, A_SMEM: tl.constexpr,
                 FUSE_DQ: tl.constexpr, DQ_TMA: tl.constexpr, SPLIT_UNMASKED: tl.constexpr):
    """One program per (key block, batch*KV head); loops over the query heads of its group.
    FUSE_DQ: also accumulates dQ with atomics (the single-kernel, non-deterministic backward).
    SPLIT_UNMASKED: visit each range's run of UNMASKED tiles in a loop without mask code."""
    n_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hk
    hk = bh % Hk
    b64 = b.to(tl.int64)
    group = Hq // Hk
    offs_n = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kv_off = (b64 * Sk + offs_n)[:, None] * (Hk * D) + hk * D + offs_d[None, :]
    nmask = (offs_n < Sk)[:, None]
    if USE_TMA and A_SMEM:  # K, V stay in shared memory as wgmma A operands (saves registers)
        k = k_desc.load([b * Sk + n_blk * BLOCK_N, hk * D])
        v = v_desc.load([b * Sk + n_blk * BLOCK_N, hk * D])
    else:
        k = tl.load(k_ptr + kv_off, mask=nmask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=nmask, other=0.0)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for g in range(0, group):
        h = hk * group + g
        hm = h // (Hq // Hm)
        mbh = b64 * mask_b_stride + hm
        sptr = sum_ptr + mbh * NKB * 8
        col_ptr = mask_ptr + mbh * Sk * C
        lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1 = _key_block_ranges(
            rng_ptr, mbh, n_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
        stat_row0 = (b64 * Hq + h) * Sq
        q_row0 = b * Sq
        q_col = h * D
        dk, dv = _dkdv_range(dk, dv, k, v, lo0, flo0, fhi0, hi0, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, dq_ptr, dq_desc, q_row0, q_col, Hq * D,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, FUSE_DQ, DQ_TMA,
                             SPLIT_UNMASKED)
        dk, dv = _dkdv_range(dk, dv, k, v, lo1, flo1, fhi1, hi1, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, dq_ptr, dq_desc, q_row0, q_col, Hq * D,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, FUSE_DQ, DQ_TMA,
                             SPLIT_UNMASKED)
    tl.store(dk_ptr + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=nmask)
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, offs_m, lo, hi, k_ptr, v_ptr, k_desc, v_desc,
              kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
              USE_TMA: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dQ of one query block over key blocks [lo, hi) (MASKED=False: a loop with no
    mask code, for runs of UNMASKED tiles)."""
    offs_nb = tl.arange(0, BLOCK_N)
    for n in tl.range(lo, hi):
        c0 = n * BLOCK_N
        k, v = _kv_tile(k_ptr, v_ptr, k_desc, v_desc, kv_row0, kv_col, kv_stride, c0, Sk, D,
                        BLOCK_N, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        p = tl.math.exp2(qk * scale_log2 - lse2[:, None])
        if MASKED:
            cls = _clipped_tile_class(sptr, m_blk, n, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL, NI)
            if cls != 2:
                cols = (c0 + offs_nb)[None, :]
                masked = _element_masked(offs_m[:, None], cols, col_ptr, Sq, Sk, CAUSAL, C)
                p = tl.where(masked, 0.0, p)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _dq_range(dq, q, do, lse2, delta, offs_m, lo, flo, fhi, hi, k_ptr, v_ptr, k_desc, v_desc,
              kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
              USE_TMA: tl.constexpr, PREC: tl.constexpr, SPLIT_UNMASKED: tl.constexpr):
    """One live range [lo, hi) of key blocks: a masked loop over all of it, or (SPLIT_UNMASKED)
    masked [lo, flo), mask-free [flo, fhi), masked [fhi, hi)."""
    if SPLIT_UNMASKED:
        dq = _dq_inner(dq, q, do, lse2, delta, offs_m, lo, flo, k_ptr, v_ptr, k_desc, v_desc,
                       kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
                       D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, True)
        dq = _dq_inner(dq, q, do, lse2, delta, offs_m, flo, fhi, k_ptr, v_ptr, k_desc, v_desc,
                       kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
                       D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, False)
        dq = _dq_inner(dq, q, do, lse2, delta, offs_m, fhi, hi, k_ptr, v_ptr, k_desc, v_desc,
                       kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
                       D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, True)
    else:
        dq = _dq_inner(dq, q, do, lse2, delta, offs_m, lo, hi, k_ptr, v_ptr, k_desc, v_desc,
                       kv_row0, kv_col, kv_stride, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
                       D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, True)
    return dq


@triton.jit(do_not_specialize=_NO_SPEC)
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse2_ptr, delta_ptr,
               mask_ptr, sum_ptr, rng_ptr, k_desc, v_desc, q_desc, do_desc,
               sm_scale, scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
               USE_TMA: tl.constexpr, PREC: tl.constexpr, A_SMEM: tl.constexpr,
               SPLIT_UNMASKED: tl.constexpr):
    """One program per (query block, batch*query head): dQ of BLOCK_M rows."""
    pid = tl.program_id(0)
    if CAUSAL:
        m_blk = NQB - 1 - pid
    else:
        m_blk = pid
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hk)
    hm = h // (Hq // Hm)
    b64 = b.to(tl.int64)
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rmask = offs_m < Sq
    q_off = (b64 * Sq + offs_m)[:, None] * (Hq * D) + h * D + offs_d[None, :]
    if USE_TMA and A_SMEM:  # Q, dO stay in shared memory as wgmma A operands (saves registers)
        q = q_desc.load([b * Sq + m_blk * BLOCK_M, h * D])
        do = do_desc.load([b * Sq + m_blk * BLOCK_M, h * D])
    else:
        q = tl.load(q_ptr + q_off, mask=rmask[:, None], other=0.0)
        do = tl.load(do_ptr + q_off, mask=rmask[:, None], other=0.0)
    row = (b64 * Hq + h) * Sq + offs_m
    lse2 = tl.load(lse2_ptr + row, mask=rmask, other=float("inf"))
    delta = tl.load(delta_ptr + row, mask=rmask, other=0.0)

    mbh = b64 * mask_b_stride + hm
    sptr = sum_ptr + mbh * NKB * 8
    col_ptr = mask_ptr + mbh * Sk * C
    lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1 = _query_block_ranges(
        rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    kv_row0 = b * Sk
    kv_col = hk * D
    dq = _dq_range(dq, q, do, lse2, delta, offs_m, lo0, flo0, fhi0, hi0, k_ptr, v_ptr, k_desc,
                   v_desc, kv_row0, kv_col, Hk * D, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
                   D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, SPLIT_UNMASKED)
    dq = _dq_range(dq, q, do, lse2, delta, offs_m, lo1, flo1, fhi1, hi1, k_ptr, v_ptr, k_desc,
                   v_desc, kv_row0, kv_col, Hk * D, sptr, col_ptr, m_blk, Sq, Sk, scale_log2,
                   D, BLOCK_M, BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, SPLIT_UNMASKED)
    tl.store(dq_ptr + q_off, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=rmask[:, None])


# ---------------------------------------------------------------------------------------------
# Host side: configurations, preprocessing, launches
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Tile shape and launch parameters of one kernel (BLOCK_M query rows, BLOCK_N keys)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: Default configurations per (kernel, head dim) on Hopper, and the candidates that
#: :func:`autotune` times. The D=128 and D=64 backward entries are the measured winners of
#: benchmarks/backward_configs.py (NOTES.md v4, v5.1), the D=64 forward the autotuner's pick on
#: all four mask layouts (results/kernel_v5_d64_256.json), the D=256 forward the autotuner's
#: pick on all four layouts, 1.45-1.58x faster than 128x32 (results/kernel_v63_d256.json,
#: meta.tuned); the others come from the compiler's
#: register report (benchmarks/NOTES.md) and the usual FlashAttention shapes on sm_90. The
#: 64x64 w4 forward tiles are there for short documents: on causal documents of ~1K tokens they
#: are 1.10x (D=128, s3) and 1.26x (D=64, s2) the default tile, and 0.90-0.99x on longer
#: documents and plain causal (results/forward_configs.md), so only the autotuner, which times
#: the candidates on the first call's own mask, picks them.
CANDIDATES: dict[tuple[str, int], list[Config]] = {
    ("fwd", 64): [Config(128, 64, 4, 3), Config(128, 128, 8, 3), Config(64, 64, 4, 2),
                  Config(64, 64, 4, 3)],
    ("fwd", 128): [Config(128, 128, 8, 3), Config(128, 128, 8, 2), Config(128, 64, 8, 3),
                   Config(64, 64, 4, 3)],
    ("fwd", 256): [Config(128, 64, 8, 2), Config(128, 32, 8, 2), Config(64, 64, 4, 2)],
    ("dkdv", 64): [Config(64, 64, 4, 2), Config(32, 64, 4, 3), Config(64, 128, 8, 3)],
    ("dkdv", 128): [Config(32, 64, 4, 3), Config(32, 128, 8, 3), Config(32, 64, 4, 2),
                    Config(64, 128, 8, 2)],
    ("dkdv", 256): [Config(64, 64, 8, 2), Config(32, 64, 8, 2)],
    ("dq", 64): [Config(64, 64, 4, 3), Config(128, 128, 8, 3), Config(128, 64, 8, 3)],
    ("dq", 128): [Config(128, 64, 8, 3), Config(128, 128, 8, 2), Config(64, 64, 4, 2)],
    ("dq", 256): [Config(128, 32, 8, 2), Config(64, 64, 8, 2), Config(64, 32, 4, 2)],
    # the fused backward (dK/dV kernel that also reduce-adds dQ): dQ tiles are BLOCK_M x D fp32
    # (sm_90 compiler report: 128x64 at D=128 needs 242 KB of shared memory; 64x128 spills)
    ("fused", 64): [Config(64, 128, 8, 2), Config(64, 64, 8, 2),
                    Config(64, 64, 4, 2)],  # the last: the Gluon fused kernel's (GLUON_TILE)
    ("fused", 128): [Config(64, 64, 8, 2), Config(64, 64, 8, 1),
                     Config(64, 128, 8, 2)],  # the last: the Gluon fused kernel's (GLUON_TILE)
    ("fused", 256): [Config(64, 64, 8, 1), Config(32, 64, 8, 2)],
}

#: Small tiles for the interpreter (CPU tests): several blocks even on 100-token sequences.
INTERPRETER_CONFIG = Config(32, 16, 4, 1)

#: Test hook / manual override: kernel name -> Config (takes precedence over everything).
CONFIG_OVERRIDE: dict[str, Config] = {}

#: Configurations chosen by :func:`autotune`, keyed on (kernel, D, causal, C, dtype).
_TUNED: dict[tuple, Config] = {}

#: Every candidate's median time in ms (None: failed to compile or run) from the same
#: :func:`autotune` calls, same keys: what the choice was made from, for benchmark reports.
TUNING_TIMES: dict[tuple, dict[Config, Optional[float]]] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _config(kind: str, d: int, causal: bool, c: int, dtype: torch.dtype,
            like: Optional[torch.Tensor] = None, row_span: Optional[float] = None) -> Config:
    """The configuration for one kernel launch (override > interpreter > tuned > short-row
    hint > default). ``like``: a tensor on the launch's device with its dtype (e.g. q); given,
    the split backward's dK/dV and the fused backward's defaults are :data:`GLUON_TILE`'s where
    the Gluon kernel runs them (:func:`_dkdv_impl`, :func:`_fused_impl`): the Gluon and tl
    kernels are fastest at different tiles. ``row_span``: the mask's mean row span, where
    known; the forward takes :data:`SHORT_ROWS_FWD`'s tile below its threshold."""
    if kind in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE[kind]
    if _interpreting():
        return INTERPRETER_CONFIG
    tuned = _TUNED.get((kind, d, causal, c, dtype))
    if tuned is not None:
        return tuned
    return (_short_rows_tile(kind, d, like, c, row_span) or _gluon_tile(kind, d, like, c)
            or CANDIDATES[(kind, _dim_class(d))][0])


#: The forward's tile for masks whose rows attend few keys (short documents), per head dim:
#: (mean row span below which it applies, the tile). The thresholds sit on the edges of
#: ``FlashMask.row_span_bucket``'s half octaves (2 ** (k / 2)), so the bucketed span the
#: public function passes decides as the exact one would. A query block of such a mask has few
#: live key tiles, so each program's fixed cost (Q load, ramp-up, O store) weighs more; a
#: 64-row tile with two programs per SM hides it behind the other program. Measured at 32K
#: (results/gluon_fwd_1c_ab.md, NOTES.md session 16): D=128, the one-warpgroup WS forward
#: at 64x64 s2: causal short documents (span 987) 1.13x the default, document short (1973)
#: 1.01x, causal mixed (2903) 0.86x; D=64, tl at 64x64 w4 s3: 1.20x / 1.10x / 1.045x, causal
#: corpus (4434) 0.95x (the D=64 threshold stays at 2048, where the spans of the masks it was
#: measured on lie, not at the break-even). D=128: 2 ** 10.5 = 1448 (the 8K causal mixed
#: spread, 1575, stays above it). D=256 keeps its tile (not measured).
SHORT_ROWS_FWD = {128: (2.0 ** 10.5, Config(64, 64, 4, 2)), 64: (2.0 ** 11, Config(64, 64, 4, 3))}


def _short_rows_tile(kind: str, d: int, like: Optional[torch.Tensor], c: int,
                     row_span: Optional[float]) -> Optional[Config]:
    """:data:`SHORT_ROWS_FWD`'s forward tile when the mean row span is below its threshold and
    the kernel it was measured with runs here (the WS forward at D=128: :func:`_fwd_impl`
    picks it for this tile; tl at D=64), else None. Env FLASHMASK3_TRITON_FWD set: None (the
    kernel choice is the user's)."""
    rule = SHORT_ROWS_FWD.get(_dim_class(d)) if kind == "fwd" else None
    if rule is None or row_span is None or row_span >= rule[0] or like is None:
        return None
    if _env_choice("FLASHMASK3_TRITON_FWD", FWD_IMPLS):
        return None
    tile = rule[1]
    want = "gluon_ws" if _dim_class(d) in GLUON_FWD_DIMS else "tl"
    return tile if _fwd_impl(like, tile, c) == want else None


def _gluon_tile(kind: str, d: int, like: Optional[torch.Tensor], c: int = 0) -> Optional[Config]:
    """:data:`GLUON_TILE`'s tile of ``kind`` at head dim ``d`` where the Gluon kernel runs it
    on tensors like ``like`` with a mask of ``c`` columns (:data:`_GLUON_IMPL`); None without
    one, or without ``like``."""
    tile = GLUON_TILE.get((kind, _dim_class(d)))
    if tile is None or like is None or _GLUON_IMPL[kind](like, tile, c) == "tl":
        return None
    return tile


def _dim_class(d: int) -> int:
    """Head dims are padded to a power of two >= 16 for tl.arange; pick its config class."""
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def _use_tma(x: torch.Tensor) -> bool:
    """TMA descriptors on Hopper+ (env FLASHMASK3_TRITON_TMA=0 disables; =1 forces on)."""
    flag = os.environ.get("FLASHMASK3_TRITON_TMA", "auto")
    if TensorDescriptor is None or flag == "0":
        return False
    if flag == "1":
        return True
    return x.is_cuda and _capability(x.device)[0] >= 9


#: Compute capability per CUDA device, asked once (a host-side query on every launch otherwise).
_CAPABILITY: dict = {}


def _capability(device: torch.device) -> tuple:
    cap = _CAPABILITY.get(device)
    if cap is None:
        cap = _CAPABILITY[device] = tuple(torch.cuda.get_device_capability(device))
    return cap


#: The Gluon kernel modules, imported on first use (no importlib call per launch).
_GLUON_MODULES: dict = {}


def _gluon_module(module: str):
    mod = _GLUON_MODULES.get(module)
    if mod is None:
        mod = _GLUON_MODULES[module] = importlib.import_module(f"{__package__}.{module}")
    return mod


#: Whether the loop-invariant wgmma A operands (Q in the forward; K, V in dK/dV; Q, dO in dQ)
#: are read through TMA into shared memory (True) or loaded into registers (False). Measured
#: on the H200 (benchmarks/NOTES.md, v1 vs v2): shared memory helps the forward (+7% at 32K),
#: registers are faster in both backward kernels (v2 backward was ~10% slower).
#: Override with FLASHMASK3_TRITON_A_SMEM="fwd,dkdv,dq" (a comma list of kernels) for experiments.
A_OPERAND_IN_SMEM = {"fwd": True, "dkdv": False, "dq": False, "fused": False}
#: Exceptions to :data:`A_OPERAND_IN_SMEM` per (kernel, head-dim class): the D=256 dQ kernel's
#: 128x32 tile needs Q, dO in shared memory (128 registers per thread otherwise) and is 1.7x
#: faster than the 64x64 one with them in registers (results/backward_configs_d256.md).
A_OPERAND_IN_SMEM_BY_DIM = {("dq", 256): True}

#: Whether a kernel visits each live range's run of UNMASKED tiles in a separate loop compiled
#: without mask code. On for every kernel: measured on the H200 (NOTES.md v4 for dK/dV, v5 for
#: the forward, 5-11% faster on 13 masks at 32K, and dQ).
SPLIT_UNMASKED_LOOP = {"fwd": True, "dkdv": True, "fused": True, "dq": True}


def _a_smem(kind: str, d: int) -> bool:
    env = os.environ.get("FLASHMASK3_TRITON_A_SMEM")
    if env is not None:
        return kind in env.split(",")
    return A_OPERAND_IN_SMEM_BY_DIM.get((kind, _dim_class(d)), A_OPERAND_IN_SMEM[kind])


#: The kernels each backward mode launches, in order.
BACKWARD_KERNELS = {"split": ("dkdv", "dq"), "fused": ("fused",)}

#: Whether a kernel's live-range plan is per key block (True) or per query block (False).
PLAN_BY_KEY = {"fwd": False, "dkdv": True, "fused": True, "dq": False}


def _check_backward(mode: str, what: str) -> str:
    if mode not in BACKWARD_KERNELS:
        raise ValueError(f"{what} must be 'fused' or 'split'{' (or auto)' if what == 'mode' else ''}, "
                         f"got {mode!r}")
    return mode


def backward_mode(like: Optional[torch.Tensor] = None) -> str:
    """"split" under ``torch.use_deterministic_algorithms(True)`` (the fused kernel's atomics are
    not reproducible); otherwise env FLASHMASK3_TRITON_BWD ("fused"/"split") or the default:
    "fused" (one kernel; dQ reduce-added with atomics, so its rounding order varies run to run)
    where the Gluon fused kernel runs ``like``, a tensor on the launch's device with its dtype
    and head dim, e.g. q (:func:`_fused_impl`: D=64 and D=128 on Hopper, 16-bit; 1.11-1.18x the
    split backward at D=128, results/gluon_fused64_ab.md, NOTES.md v6.5; 1.05-1.15x at D=64,
    results/gluon_fused_d64_ab.md, v6.6), else "split" (dK/dV kernel, then a
    dQ kernel that recomputes P and dP; bitwise reproducible; the tl fused kernel is 0.4-0.5x
    of it), also when ``like`` is None."""
    if torch.are_deterministic_algorithms_enabled():
        return "split"
    env = os.environ.get("FLASHMASK3_TRITON_BWD", "").strip()
    if env == "":
        d = like.shape[-1] if like is not None else 0
        return "fused" if _gluon_tile("fused", d, like) is not None else "split"
    return _check_backward(env, "FLASHMASK3_TRITON_BWD")


@contextlib.contextmanager
def use_backward(mode: str):
    """FLASHMASK3_TRITON_BWD=``mode`` inside the block (and in processes started from it),
    restored afterwards; "auto" unsets it (the library default, see :func:`backward_mode`);
    deterministic mode still wins (:func:`backward_mode`)."""
    if mode != "auto":
        _check_backward(mode, "mode")
    old = os.environ.get("FLASHMASK3_TRITON_BWD")
    if mode == "auto":
        os.environ.pop("FLASHMASK3_TRITON_BWD", None)
    else:
        os.environ["FLASHMASK3_TRITON_BWD"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASHMASK3_TRITON_BWD", None)
        else:
            os.environ["FLASHMASK3_TRITON_BWD"] = old


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
    nkb = triton.cdiv(sk, block_n)
    summary = torch.empty((bm * hm, nkb, NSTAT), dtype=torch.int32, device=mask.device)
    if nkb > 0 and bm * hm > 0:
        _summary_kernel[(nkb, bm * hm)](mask, summary, seqlen_q, sk, nkb, sk * c,
                                        BLOCK_N=block_n, CAUSAL=causal, C=c, num_warps=4)
    return summary


def live_ranges(summary: torch.Tensor, causal: bool, ni: int, seqlen_q: int, seqlen_k: int,
                block_m: int, block_n: int, by_key: bool) -> torch.Tensor:
    """Two live ranges per query block (by_key=False) or per key block (by_key=True), and the
    first run of UNMASKED tiles in each: ``[.., RANGE_WORDS]`` (layout in ``_range_kernel``)."""
    nqb = triton.cdiv(seqlen_q, block_m)
    nkb = triton.cdiv(seqlen_k, block_n)
    n_fixed = nkb if by_key else nqb
    nbh = summary.shape[0]
    ranges = torch.empty((nbh, n_fixed, RANGE_WORDS), dtype=torch.int32, device=summary.device)
    if n_fixed > 0 and nbh > 0:
        _range_kernel[(n_fixed, nbh)](summary, ranges, seqlen_q, seqlen_k, nqb, nkb,
                                      BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, NI=ni,
                                      BY_KEY=by_key, CHUNK=256, num_warps=4)
    return ranges


def make_plan(mask: Optional[torch.Tensor], causal: bool, seqlen_q: int, seqlen_k: int,
              block_m: int, block_n: int, by_key: bool, device) -> Plan:
    """Everything the attention kernels need to know about the mask for one tile shape."""
    if mask is None:
        d = _dummy(device)
        return Plan(d, d, d, 0, 0, 1, 0)
    mask = mask.contiguous()
    bm, hm, _, c = mask.shape
    ni = _num_intervals(causal, c)
    summary = block_summaries(mask, causal, seqlen_q, block_n)
    ranges = live_ranges(summary, causal, ni, seqlen_q, seqlen_k, block_m, block_n, by_key)
    return Plan(mask, summary, ranges, c, ni, hm, hm if bm > 1 else 0)


def preprocess(mask: Optional[torch.Tensor], causal: bool, seqlen_q: int, seqlen_k: int,
               head_dim: int, dtype: torch.dtype, backward: bool = True,
               row_span: Optional[float] = None) -> list[Plan]:
    """All plans one forward (+ backward) call builds: what the benchmark times as 'mask prep'
    (``row_span``: the mask's mean row span, as the forward gets it)."""
    c = 0 if mask is None else mask.shape[-1]
    device = mask.device if mask is not None else "cpu"
    like = torch.empty((1, 1, 1, head_dim), dtype=dtype, device=device)
    out = []
    for kind in ("fwd",) + (BACKWARD_KERNELS[backward_mode(like=like)] if backward else ()):
        cfg = _config(kind, head_dim, causal, c, dtype, like=like, row_span=row_span)
        out.append(make_plan(mask, causal, seqlen_q, seqlen_k, cfg.block_m, cfg.block_n,
                             PLAN_BY_KEY[kind], device))
    return out


def _desc(x2d: torch.Tensor, rows: int, d: int):
    return TensorDescriptor.from_tensor(x2d, [rows, d])


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def unsupported_reason(q: torch.Tensor) -> Optional[str]:
    """Why these inputs cannot run on the Triton kernels (None when they can); api.py falls
    back to the torch path on ``auto``."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} (the Triton kernels take float16, bfloat16 and float32)"
    if q.shape[-1] not in (16, 32, 64, 128, 256):
        return f"head dim {q.shape[-1]} (the Triton kernels take 16, 32, 64, 128 or 256)"
    if not q.is_cuda and not _interpreting():
        return f"tensors on {q.device} (CUDA, or TRITON_INTERPRET=1 for CPU tensors)"
    return None


def _check_head_dim(d: int) -> None:
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"the Triton FlashMask kernel supports head dims 16..256 powers of two, got {d}")


def _env_choice(name: str, allowed: tuple) -> str:
    """The value of the kernel-choice variable ``name`` ("" when unset); anything outside
    ``allowed`` is a clear error rather than a silent default."""
    env = os.environ.get(name, "").strip()
    if env and env not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)} (or unset), got {env!r}")
    return env


#: Triton versions on which the Gluon kernels were run and checked on a GPU (H200: the gpu
#: tests and the kernel benchmark). Gluon is an experimental language whose layouts and
#: intrinsics change between releases, so on any other version the dispatch takes the
#: portable tl kernels for every launch (docs/host-path.md has the matrix and the CI checks).
GLUON_CHECKED_TRITON = ("3.6.0",)

#: Whether this Triton is one of them: the version guard of the dispatch, decided at import.
GLUON_CHECKED_HERE = triton.__version__ in GLUON_CHECKED_TRITON


def _announce_kernel_path() -> None:
    """Say once (at import) which kernels the CUDA path runs with this Triton: a log line on a
    checked version, a warning on an unchecked one (never a silent change of kernels)."""
    if GLUON_CHECKED_HERE:
        logging.getLogger("flashmask3").info(
            "flashmask3: Triton %s: the Gluon kernels (checked on this version) run on Hopper "
            "where the dispatch picks them, the tl kernels elsewhere", triton.__version__)
    else:
        warnings.warn(
            f"flashmask3: Triton {triton.__version__} is not a version the Gluon kernels were "
            f"checked on ({', '.join(GLUON_CHECKED_TRITON)}): every launch uses the portable tl "
            "kernels (slower on Hopper; see docs/host-path.md)", RuntimeWarning, stacklevel=2)


_announce_kernel_path()


def _gluon_runs(q: torch.Tensor, module: str, cfg: Config, **variant) -> bool:
    """Whether the Gluon kernel of ``flashmask3.kernels.<module>`` can run these inputs with
    this config: a Triton version it was checked on (:data:`GLUON_CHECKED_HERE`), CUDA with
    TMA, a Hopper GPU (wgmma is sm_90 only), 16-bit inputs (its wgmma operands; float32 runs
    tf32 in tl), Gluon available and the config (and ``variant``, the kernel's own check_config
    flags) accepted."""
    if not GLUON_CHECKED_HERE or _interpreting() or not q.is_cuda or not _use_tma(q):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if _capability(q.device)[0] != 9:
        return False
    mod = _gluon_module(module)
    if mod.unavailable_reason() is not None:
        return False
    try:
        mod.check_config(q.shape[-1], cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                         **variant)
    except ValueError:
        return False
    return True


#: The warp-specialised Gluon forward (gluon_fwd._fwd_ws_kernel: a TMA producer warp,
#: separate K and V rings, two consumer warpgroups of 64 query rows) is the default at these
#: head dims, on every mask layout, at its :data:`GLUON_TILE` tile (at D=128 with one
#: warpgroup at 64x64 where the mask's rows see few keys: :data:`SHORT_ROWS_FWD`); elsewhere
#: opt-in (FLASHMASK3_TRITON_FWD=gluon_ws / gluon_wsp).
#: Measured against the tl forward (H200, 32K, benchmarks/NOTES.md sessions 13 and 14), with
#: the producer staging the masked tiles' columns in shared memory (COLS_SMEM, session 14):
#: D=128 at 128x128 s2 1.00-1.20x on every masked layout (causal documents: short 1.00, mixed
#: 1.04, corpus 1.09; random eviction 1.20), 1.04-1.12x on causal and full; D=256 at 128x64 s2
#: 1.13-1.26x. D=64 keeps tl (128x64 0.91x on causal short documents, 128x128 1.00-1.06x on
#: six other layouts, session 15). On causal short documents the two forwards are even at 8K
#: and 128K too, timed in one run (0.98x, 1.005x; NOTES.md session 15).
GLUON_FWD_DIMS: tuple = (128, 256)
#: Whether the WS forward's two warpgroups take turns issuing their matmuls (FA3's ping-pong),
#: per head dim: at D=128 ping-pong measured 0.93-1.04x of without; D=256 was measured with it.
GLUON_FWD_PINGPONG = {256: True, 128: False, 64: True}
#: Whether the WS forward runs persistent (as many programs as fit per SM, taking the query
#: blocks in the grid's order; env FLASHMASK3_TRITON_FWD_PERSISTENT=1 / 0 overrides).
GLUON_FWD_PERSISTENT = False


def _fwd_persistent() -> bool:
    """:data:`GLUON_FWD_PERSISTENT`, or env FLASHMASK3_TRITON_FWD_PERSISTENT (0 or 1)."""
    env = _env_choice("FLASHMASK3_TRITON_FWD_PERSISTENT", ("0", "1"))
    return GLUON_FWD_PERSISTENT if not env else env == "1"


#: The values of env FLASHMASK3_TRITON_FWD (:func:`_fwd_impl`).
FWD_IMPLS = ("tl", "gluon", "gluon_ws", "gluon_wsp")


def _fwd_impl(q: torch.Tensor, cfg: Config, c: int = 0) -> str:
    """"gluon_ws", "gluon_wsp", "gluon" or "tl": the kernel the forward launch uses for a mask of
    ``c`` columns. The warp-specialised Gluon forward (``gluon_wsp``: with ping-pong,
    :data:`GLUON_FWD_PINGPONG`) at :data:`GLUON_FWD_DIMS` where it can run
    (:func:`_gluon_runs`), else tl. Env FLASHMASK3_TRITON_FWD=tl forces tl; =gluon_ws /
    =gluon_wsp the warp-specialised kernel without / with ping-pong at any head dim; =gluon the
    plain Gluon forward (gluon_fwd.py, measured slower than tl)."""
    env = _env_choice("FLASHMASK3_TRITON_FWD", FWD_IMPLS)
    d = q.shape[-1]
    if env == "gluon":
        return "gluon" if _gluon_runs(q, "gluon_fwd", cfg) else "tl"
    if env == "tl":
        return "tl"
    if not env:
        if d not in GLUON_FWD_DIMS:
            return "tl"
        env = "gluon_wsp" if GLUON_FWD_PINGPONG.get(d, False) else "gluon_ws"
    # (col_words: the shared-memory column ring of the masked layouts, gluon_fwd.WS_COLS_SMEM)
    runs = _gluon_runs(q, "gluon_fwd", cfg, warp_spec=True, pingpong=env == "gluon_wsp",
                       col_words=c)
    return env if runs else "tl"


def _launch_fwd(q, k, v, mask, causal, softmax_scale, cfg: Config, plan: Plan):
    """(out, lse): the Gluon forward where :func:`_fwd_impl` picks it, else the tl kernel."""
    impl = _fwd_impl(q, cfg, plan.c)
    if impl != "tl":
        from .gluon_fwd import launch_fwd_gluon

        return launch_fwd_gluon(q, k, v, mask, causal, softmax_scale, plan, cfg.block_m,
                                cfg.block_n, cfg.num_warps, cfg.num_stages,
                                warp_spec=impl != "gluon", pingpong=impl == "gluon_wsp",
                                persistent=impl != "gluon" and _fwd_persistent())
    return _launch_fwd_tl(q, k, v, mask, causal, softmax_scale, cfg, plan)


def _launch_fwd_tl(q, k, v, mask, causal, softmax_scale, cfg: Config, plan: Plan):
    """The tl forward kernel (see :func:`_launch_fwd`)."""
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    nqb, nkb = triton.cdiv(sq, cfg.block_m), triton.cdiv(sk, cfg.block_n)
    tma = _use_tma(q)
    k_desc = _desc(k.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    v_desc = _desc(v.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    q_desc = _desc(q.view(b * sq, hq * d), cfg.block_m, d) if tma and _a_smem("fwd", d) else None
    _fwd_kernel[(nqb, b * hq)](
        q, k, v, out, lse, plan.mask, plan.summary, plan.ranges, k_desc, v_desc, q_desc,
        softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb, plan.mask_b_stride,
        D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, C=plan.c, NI=plan.ni,
        USE_TMA=tma, PREC=_dot_precision(q.dtype), A_SMEM=_a_smem("fwd", d),
        SPLIT_UNMASKED=SPLIT_UNMASKED_LOOP["fwd"], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out, lse


def _contig(*xs):
    return [x.contiguous() for x in xs]


def forward(q, k, v, startend_row_indices: Optional[torch.Tensor], causal: bool,
            softmax_scale: float, row_span: Optional[float] = None):
    """Backend contract: masked attention forward, returns ``(out, lse)``. ``row_span``: the
    mask's mean row span where known (as ``api.kernel_row_span`` gives it: rounded down to its
    half octave), the tile hint of :func:`_config`."""
    q, k, v = _contig(q, k, v)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    _check_head_dim(d)
    if sq == 0 or sk == 0:
        return torch.zeros_like(q), torch.full((b, hq, sq), float("-inf"), device=q.device)
    c = 0 if startend_row_indices is None else startend_row_indices.shape[-1]
    if _autotune_enabled(q) and ("fwd", d, causal, c, q.dtype) not in _TUNED:
        autotune("fwd", q, k, v, startend_row_indices, causal, softmax_scale)
    cfg = _config("fwd", d, causal, c, q.dtype, like=q, row_span=row_span)
    plan = make_plan(startend_row_indices, causal, sq, sk, cfg.block_m, cfg.block_n, False,
                     q.device)
    return _launch_fwd(q, k, v, startend_row_indices, causal, softmax_scale, cfg, plan)


def _bwd_pre(out, dout, lse, dlse):
    b, sq, hq, d = out.shape
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)
    bm = 64 if d <= 128 else 32
    has_dlse = dlse is not None
    dl = dlse.to(torch.float32).contiguous() if has_dlse else delta
    _bwd_pre_kernel[(triton.cdiv(sq, bm), b * hq)](out, dout, lse.contiguous(), dl, delta, lse2,
                                                    sq, hq, D=d, BLOCK_M=bm, HAS_DLSE=has_dlse,
                                                    num_warps=4)
    return delta, lse2


#: Head dims at which the split backward's dK/dV runs the Gluon kernel on Hopper
#: (flashmask3/kernels/gluon_dkdv.py; the warp-specialised kernel measured 1.17-1.24x faster
#: than the tl kernel at D=128 and 1.27-1.49x at D=64, NOTES.md v6.2, v6.3). At D=256 (session
#: 15) its two compute warpgroups split the head dim of dK/dV (two 64 x 256 fp32 accumulators
#: do not fit one warpgroup's registers), as the tl kernel's do: 1.61-1.87x the tl kernel at
#: the same tile, dK/dV bitwise equal (results/gluon_dkdv_d256_ab.md).
GLUON_DKDV_DIMS = (64, 128, 256)

#: Default tiles of the backward kernels where the Gluon kernel runs them (else CANDIDATES'
#: first, the tl kernel's), keyed (kernel, head-dim class). D=128 split dK/dV: 64x128 w8 s2
#: with the statistics in shared memory (STATS_SMEM, which keeps this tile spill-free),
#: 1.12-1.14x the 32x64 w4 s3 WS kernel and 1.31-1.40x tl, dK/dV bitwise equal
#: (results/gluon_dkdv_wsm_ab.md). D=128 fused: the same tile with DS_SHARED (FA3's: Pᵀ, dSᵀ
#: in shared memory, dQ reduce-added once per tile), 1.11-1.18x the split backward
#: (results/gluon_fused64_ab.md); s2 and s3 within 2%. NOTES.md v6.4. D=64 fused: DS_SHARED at
#: 64x64 w4 s2 (one compute warpgroup), 1.05-1.15x the D=64 split backward, s3 within 2%
#: (results/gluon_fused_d64_ab.md, NOTES.md v6.6).
GLUON_TILE = {("dkdv", 128): Config(64, 128, 8, 2), ("fused", 128): Config(64, 128, 8, 2),
              ("fused", 64): Config(64, 64, 4, 2),
              # the warp-specialised forward (two warpgroups of 64 rows; offline, with COLS_SMEM
              # no spill in the tile loops of any layout at D=128, D=64 and D=256)
              ("fwd", 128): Config(128, 128, 8, 2), ("fwd", 64): Config(128, 128, 8, 3),
              ("fwd", 256): Config(128, 64, 8, 2),
              # D=256 split dK/dV: 64 keys, the two warpgroups splitting the head dim (offline,
              # with STATS_SMEM no spill in the tile loops of any layout; 201 KB of shared memory)
              ("dkdv", 256): Config(64, 64, 8, 2)}

#: Head dims at which the warp-specialised Gluon dK/dV stages each tile's lse2/delta in shared
#: memory (STATS_SMEM; at D=128 1.03-1.06x faster at 32x64 too, same results bit for bit; not
#: measured at D=64; at D=256 it halves the spills outside the tile loops, offline, and is
#: 0.99-1.06x the WS kernel without it on the H200).
GLUON_STATS_SMEM_DIMS = (128, 256)


def _dkdv_impl(q: torch.Tensor, cfg: Config) -> str:
    """"gluon_ws", "gluon" or "tl": the kernel the split backward's dK/dV launch uses. The
    default is the warp-specialised Gluon kernel (a 1-warp TMA producer; bitwise equal to the
    others, 1.00-1.07x the plain Gluon kernel on the H200; at GLUON_STATS_SMEM_DIMS with the
    statistics in shared memory) at GLUON_DKDV_DIMS wherever it can run (:func:`_gluon_runs`).
    Env FLASHMASK3_TRITON_DKDV=tl forces the tl kernel, =gluon / =gluon_ws the plain /
    warp-specialised Gluon one at any head dim it supports."""
    env = _env_choice("FLASHMASK3_TRITON_DKDV", ("tl", "gluon", "gluon_ws"))
    if env == "tl" or (not env and q.shape[-1] not in GLUON_DKDV_DIMS):
        return "tl"
    return (env or "gluon_ws") if _gluon_runs(q, "gluon_dkdv", cfg) else "tl"


#: The Gluon fused backward's variant flags (gluon_dkdv.py): FA3's tile, warp-specialised, the
#: statistics and Pᵀ/dSᵀ in shared memory, dQ reduce-added once per tile.
GLUON_FUSED_VARIANT = dict(fuse_dq=True, warp_spec=True, stats_smem=True, ds_shared=True)


#: Head dims at which the fused backward runs the Gluon DS_SHARED kernel unless told otherwise
#: (measured faster than the split backward at both: D=128 NOTES.md v6.5, D=64 v6.6). D=256 has
#: no DS_SHARED tile (dK, dV accumulators of BLOCK_N x 256 fp32 do not fit one warpgroup).
GLUON_FUSED_DIMS = (64, 128)


def _fused_impl(q: torch.Tensor, cfg: Config) -> str:
    """"gluon" or "tl": the kernel of the fused backward. The Gluon DS_SHARED kernel
    (:data:`GLUON_FUSED_VARIANT`, at a ``gluon_dkdv.DS_SHARED_TILES`` tile) at
    :data:`GLUON_FUSED_DIMS` wherever it can run (:func:`_gluon_runs`), else the tl kernel.
    Env FLASHMASK3_TRITON_FUSED=tl forces tl; =gluon the Gluon kernel at any head dim it
    supports."""
    env = _env_choice("FLASHMASK3_TRITON_FUSED", ("tl", "gluon"))
    if env == "tl" or (not env and q.shape[-1] not in GLUON_FUSED_DIMS):
        return "tl"
    return "gluon" if _gluon_runs(q, "gluon_dkdv", cfg, **GLUON_FUSED_VARIANT) else "tl"


def _launch_dkdv(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg: Config, plan: Plan,
                 fuse_dq: bool = False):
    """dK, dV (and, with ``fuse_dq``, the unscaled fp32 dQ accumulated by atomics, [B, Sq, Hq,
    D], possibly a strided view; else None): the Gluon kernel where :func:`_dkdv_impl` (or, fused,
    :func:`_fused_impl`) picks it, else the tl kernel."""
    if fuse_dq:
        if _fused_impl(q, cfg) == "gluon":
            from .gluon_dkdv import launch_dkdv_gluon

            return launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, softmax_scale, plan,
                                     cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                                     **GLUON_FUSED_VARIANT)
        return _launch_dkdv_tl(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg, plan, True)
    impl = _dkdv_impl(q, cfg)
    if impl != "tl":
        from .gluon_dkdv import launch_dkdv_gluon

        dk, dv = launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, softmax_scale, plan,
                                   cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                                   warp_spec=impl == "gluon_ws",
                                   stats_smem=impl == "gluon_ws"
                                   and q.shape[-1] in GLUON_STATS_SMEM_DIMS)
        return dk, dv, None
    return _launch_dkdv_tl(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg, plan)


#: The kernel choice of each kernel kind that has a Gluon default tile (:data:`GLUON_TILE`).
#: (kernel kind -> its choice given (q, tile, the mask's C); the plain Gluon forward keeps the
#: tl tile: only the WS forward has its own)
_GLUON_IMPL = {"dkdv": lambda q, cfg, c: _dkdv_impl(q, cfg),
               "fused": lambda q, cfg, c: _fused_impl(q, cfg),
               "fwd": lambda q, cfg, c: "tl" if _fwd_impl(q, cfg, c) in ("tl", "gluon") else "ws"}


def _launch_dkdv_tl(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg: Config, plan: Plan,
                    fuse_dq: bool = False):
    """The tl dK/dV kernel (see :func:`_launch_dkdv`)."""
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    kind = "fused" if fuse_dq else "dkdv"
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq_acc = torch.zeros((b, sq, hq, d), dtype=torch.float32, device=q.device) if fuse_dq else None
    nqb, nkb = triton.cdiv(sq, cfg.block_m), triton.cdiv(sk, cfg.block_n)
    tma = _use_tma(q)
    dq_tma = fuse_dq and tma and not _interpreting()  # the interpreter has no TMA reduce
    q_desc = _desc(q.view(b * sq, hq * d), cfg.block_m, d) if tma else None
    do_desc = _desc(dout.view(b * sq, hq * d), cfg.block_m, d) if tma else None
    k_desc = _desc(k.view(b * sk, hk * d), cfg.block_n, d) if tma and _a_smem(kind, d) else None
    v_desc = _desc(v.view(b * sk, hk * d), cfg.block_n, d) if tma and _a_smem(kind, d) else None
    dq_desc = _desc(dq_acc.view(b * sq, hq * d), cfg.block_m, d) if dq_tma else None
    _dkdv_kernel[(nkb, b * hk)](
        q, k, v, dout, dk, dv, lse2, delta, plan.mask, plan.summary, plan.ranges, q_desc, do_desc,
        k_desc, v_desc, dq_acc if fuse_dq else dk, dq_desc,  # (dk: an unused placeholder)
        softmax_scale, softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb,
        plan.mask_b_stride, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        C=plan.c, NI=plan.ni, USE_TMA=tma, PREC=_dot_precision(q.dtype), A_SMEM=_a_smem(kind, d),
        FUSE_DQ=fuse_dq, DQ_TMA=dq_tma, SPLIT_UNMASKED=SPLIT_UNMASKED_LOOP[kind],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dk, dv, dq_acc


def _dq_impl(q: torch.Tensor, cfg: Config) -> str:
    """"tl" (the default) or "gluon": the kernel the split backward's dQ launch uses. Env
    FLASHMASK3_TRITON_DQ=gluon opts in to the Gluon dQ kernel (gluon_dq.py, measured slower
    than tl) wherever it can run (:func:`_gluon_runs`); unset or "tl" keeps the tl kernel."""
    env = _env_choice("FLASHMASK3_TRITON_DQ", ("tl", "gluon"))
    return "gluon" if env == "gluon" and _gluon_runs(q, "gluon_dq", cfg) else "tl"


def _launch_dq(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg: Config, plan: Plan):
    """dQ: the Gluon kernel where :func:`_dq_impl` picks it (opt-in), else the tl kernel."""
    if _dq_impl(q, cfg) == "gluon":
        from .gluon_dq import launch_dq_gluon

        return launch_dq_gluon(q, k, v, dout, lse2, delta, causal, softmax_scale, plan,
                               cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    return _launch_dq_tl(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg, plan)


def _launch_dq_tl(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg: Config, plan: Plan):
    """The tl dQ kernel (see :func:`_launch_dq`)."""
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    dq = torch.empty_like(q)
    nqb, nkb = triton.cdiv(sq, cfg.block_m), triton.cdiv(sk, cfg.block_n)
    tma = _use_tma(q)
    k_desc = _desc(k.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    v_desc = _desc(v.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    q_desc = _desc(q.view(b * sq, hq * d), cfg.block_m, d) if tma and _a_smem("dq", d) else None
    do_desc = _desc(dout.view(b * sq, hq * d), cfg.block_m, d) if tma and _a_smem("dq", d) else None
    _dq_kernel[(nqb, b * hq)](
        q, k, v, dout, dq, lse2, delta, plan.mask, plan.summary, plan.ranges, k_desc, v_desc,
        q_desc, do_desc,
        softmax_scale, softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb,
        plan.mask_b_stride, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        C=plan.c, NI=plan.ni, USE_TMA=tma, PREC=_dot_precision(q.dtype), A_SMEM=_a_smem("dq", d),
        SPLIT_UNMASKED=SPLIT_UNMASKED_LOOP["dq"], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return dq


def scale_dq(dq_acc: torch.Tensor, softmax_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dQ = softmax_scale * dq_acc as a new contiguous ``dtype`` tensor: the fused backward's
    last step. ``dq_acc`` [B, Sq, Hq, D] fp32 with any strides (the Gluon kernel's is a
    transposed view). The Triton kernel reads it along its contiguous axis and writes dQ
    along D; ``torch.mul(dq_acc, scale, out=dq)`` walks dQ's order, which reads a transposed
    view one element per D step (env FLASHMASK3_TRITON_DQ_SCALE=torch keeps it, for A/B)."""
    b, sq, hq, d = dq_acc.shape
    dq = torch.empty((b, sq, hq, d), dtype=dtype, device=dq_acc.device)
    if _env_choice("FLASHMASK3_TRITON_DQ_SCALE", ("triton", "torch")) == "torch" or dq.numel() == 0:
        torch.mul(dq_acc, softmax_scale, out=dq)
        return dq
    block_q = 64 if d <= 128 else 32
    _scale_dq_kernel[(triton.cdiv(sq, block_q), b * hq)](
        dq_acc, dq, softmax_scale, sq, hq, dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2),
        dq_acc.stride(3), D=d, BLOCK_Q=block_q, num_warps=4)
    return dq


def backward(dout, dlse, q, k, v, out, lse, startend_row_indices: Optional[torch.Tensor],
             causal: bool, softmax_scale: float):
    """Backend contract: gradients ``(dq, dk, dv)``; ``dlse`` (or None) is folded into delta."""
    q, k, v, out, dout = _contig(q, k, v, out, dout)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    _check_head_dim(d)
    if sq == 0 or sk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dout = dout.to(q.dtype)
    c = 0 if startend_row_indices is None else startend_row_indices.shape[-1]
    delta, lse2 = _bwd_pre(out, dout, lse, dlse)
    kinds = BACKWARD_KERNELS[backward_mode(like=q)]
    if _autotune_enabled(q):
        for kind in kinds:
            if (kind, d, causal, c, q.dtype) not in _TUNED:
                autotune(kind, q, k, v, startend_row_indices, causal, softmax_scale,
                         dout=dout, lse2=lse2, delta=delta)
    cfg = _config(kinds[0], d, causal, c, q.dtype, like=q)
    plan = make_plan(startend_row_indices, causal, sq, sk, cfg.block_m, cfg.block_n,
                     PLAN_BY_KEY[kinds[0]], q.device)
    dk, dv, dq_acc = _launch_dkdv(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg, plan,
                                  fuse_dq=kinds[0] == "fused")
    if dq_acc is not None:
        return scale_dq(dq_acc, softmax_scale, q.dtype), dk, dv
    cfg = _config("dq", d, causal, c, q.dtype)
    plan = make_plan(startend_row_indices, causal, sq, sk, cfg.block_m, cfg.block_n,
                     PLAN_BY_KEY["dq"], q.device)
    dq = _launch_dq(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg, plan)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Autotuning (on the device, once per key)
# ---------------------------------------------------------------------------------------------


def _autotune_enabled(x: torch.Tensor) -> bool:
    """Opt-in timing of the candidate configs (env FLASHMASK3_TRITON_AUTOTUNE=1, CUDA only)."""
    return (x.is_cuda and not _interpreting() and not CONFIG_OVERRIDE
            and os.environ.get("FLASHMASK3_TRITON_AUTOTUNE", "0") == "1")


def autotune(kind: str, q, k, v, mask, causal, softmax_scale, dout=None, lse2=None, delta=None):
    """Time every candidate of ``kind`` on these inputs; remember the fastest for the key
    (kernel, D, causal, C, dtype). Candidates that fail to compile (shared memory) are skipped.
    """
    from triton.testing import do_bench

    b, sq, hq, d = q.shape
    sk = k.shape[1]
    c = 0 if mask is None else mask.shape[-1]
    best, best_ms = None, float("inf")
    times = TUNING_TIMES.setdefault((kind, d, causal, c, q.dtype), {})
    for cfg in CANDIDATES[(kind, _dim_class(d))]:
        plan = make_plan(mask, causal, sq, sk, cfg.block_m, cfg.block_n, PLAN_BY_KEY[kind],
                         q.device)
        if kind == "fwd":
            fn = lambda: _launch_fwd(q, k, v, mask, causal, softmax_scale, cfg, plan)  # noqa: E731
        elif kind in ("dkdv", "fused"):
            fn = lambda: _launch_dkdv(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg, plan,  # noqa: E731,E501
                                      fuse_dq=kind == "fused")
        else:
            fn = lambda: _launch_dq(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg, plan)  # noqa: E731,E501
        try:
            ms = do_bench(fn, warmup=5, rep=20, return_mode="median")
        except Exception as exc:  # out of resources: try the next candidate
            print(f"[flashmask3 autotune] {kind} {cfg} failed: {type(exc).__name__}")
            times[cfg] = None
            continue
        times[cfg] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is not None:
        _TUNED[(kind, d, causal, c, q.dtype)] = best
    return best
