"""Gluon (``triton.experimental.gluon``) dQ kernel for Hopper (sm_90): the asynchronous-wgmma
twin of the ``tl`` ``_dq_kernel`` (split backward). Opt-in only: ``FLASHMASK3_TRITON_DQ=gluon``
(``triton_flashmask._dq_impl``); the default dQ kernel stays ``tl``.

What it computes: exactly what ``_dq_kernel`` computes, dQ (multiplied by ``softmax_scale``)
of one query block per program, from the same :class:`Plan` (built by query block for the same
``block_m``/``block_n``), ``lse2`` (log2-domain LSE, +inf on fully masked rows) and ``delta``
from ``triton_flashmask._bwd_pre``. Same grid (query block reversed for causal, batch * query
head), same live ranges, same three loops per range (masked [lo, flo), mask-free [flo, fhi)
compiled without mask code, masked [fhi, hi)), same arithmetic order:

* S = Q Kᵀ and dP = dO Vᵀ with a zero accumulator (use_acc=False), K = D in 16-wide wgmma
  k-steps, as ``tl.dot`` lowers them (the ``tl`` kernel's TTGIR has the same NVMMA layouts:
  warps [num_warps, 1], instr [16, BLOCK_N, 16] and [16, D, 16], Q and dO in shared memory);
* P = exp2(S * scale_log2 - lse2), then ``where(masked, 0, P)`` on tiles that need the mask;
* dS = P * (dP - delta), rounded to the input dtype, dQ += dS K chained on the fp32 register
  accumulator (K = BLOCK_N);
* dQ * softmax_scale rounded to the input dtype, stored for rows < Sq.

So dQ should be bitwise equal to the ``tl`` kernel's at the same (block_m, block_n) (as the
Gluon dK/dV kernel is to its ``tl`` twin). Where it might not be: (1) a different tile shape
than the ``tl`` kernel's changes the k-step grouping of dQ += dS K (the chain over key tiles)
and hence the rounding; compare at equal block_m, block_n; (2) ptxas contracting
``S * scale_log2 - lse2`` into an FMA differently in the two kernels (it did not in the dK/dV
pair); (3) rows past Sq and columns past Sk read other batches' data through TMA, exactly as
the ``tl`` kernel with TMA does; those rows are never stored and those columns get P = 0.

Why: the ``tl`` dQ kernel's SASS waits for every wgmma right after issuing it
(``WARPGROUP.DEPBAR.LE gsb0, 0x0``). Here, per key tile (:func:`_tile`): S and dP are issued
together, asynchronously; P = exp2(...) and the mask are computed while dP runs (wait with one
group in flight: ``DEPBAR.LE gsb0, 0x1``); dS, then dQ += dS K asynchronously, waited before
the slot is refilled.

PIPE=True (``launch_dq_gluon(..., pipe=True)``): the dQ wgmma of tile n is issued after
the S wgmma of tile n+1 and before its dP, so per tile the groups in flight are S_{n+1},
dQ_n, dP_{n+1}: P_{n+1} (exp2 and the mask) is computed while dQ_n and dP_{n+1} run (SASS
``DEPBAR.LE gsb0, 0x2``), and the slot of tile n is refilled once dQ_n has retired. The first
tile of each live range is peeled (no dQ to issue), the last tile's dQ is flushed at the range
end. The dQ chain still adds the tiles in order, so PIPE is bitwise equal to plain.

Measured (H200, ``benchmarks/gluon_dq_ab.py --budget-s 170``, one run): dQ is **bitwise
equal** to the ``tl`` kernel's in every case run (66 GPU tests of tests/kernels/test_gluon_dq.py:
every (causal, C), Hm in {1, Hq}, GQA, Sq != Sk, fp16, D=64, plain and PIPE; the 13 small A/B
cases; the 6 timed 32K cases), but it is **not faster**: at 32K D=128 bf16 (6 masks) the tl
shape 128x64 w8 s3 runs at 0.90-0.94x of the tl kernel (PIPE 0.87-0.94x, 2 stages worse),
64x64 w4 s2 PIPE (two programs per SM) at 0.96-1.02x. Hence opt-in only.

Design (one program per (query block of BLOCK_M rows, batch * query head)):

* Q and dO of the block: one TMA load each into shared memory (wgmma A operands, no registers;
  ``A_REGS=True`` loads them once into registers as DotOperand A operands instead: measured
  by the offline report, see :data:`REPORT_CONFIGS`).
* K and V tiles: a NUM_STAGES-deep shared-memory ring filled by TMA, one mbarrier per slot
  (expect-tx = bytes of both tiles; parity = (tile counter // NUM_STAGES) & 1), the ring helper
  ``gluon_dkdv._issue_tile``. Each live range issues its first NUM_STAGES tiles up front; a slot
  is refilled with the tile NUM_STAGES further on once the wgmmas reading it have retired and
  every warp has passed a CTA barrier.
* dQ: fp32 accumulator in registers, NVMMA v3 layout with warps along the queries, so
  BLOCK_M == 16 * num_warps (64 rows per warpgroup).
* Masked tiles: the key tile's 8 block statistics and its column intervals are loaded (global,
  L1/L2 hits) before S is waited for; the scalar test ``gluon_dkdv._needs_mask`` (the twin of
  ``_clipped_tile_class(...) != 2``) decides whether the element mask is applied.

The module imports on a CPU-only machine and without gluon (``gluon_dkdv`` provides the
fallbacks); :func:`compile_sm90` / :func:`compile_report` compile offline for sm_90.
"""

from __future__ import annotations

import re
import torch
import triton

from . import gluon_dkdv as _G
from .gluon_dkdv import (_column_interval_words, _element_masked, _issue_tile, _jit,
                         _load_stats, _needs_mask, _query_block_ranges, unavailable_reason)
from .triton_flashmask import _NO_SPEC, LOG2E

gl = _G.gl
if gl is not None:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                   tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@_jit
def _tile_column_intervals(col_ptr, cols, Sq, Sk, CAUSAL: gl.constexpr, C: gl.constexpr):
    """``gluon_dkdv._column_interval_words`` as ``[1, BN]`` rows (the dQ kernel's score
    tiles); the columns change with every key tile, so this runs per masked tile."""
    s0, e0, s1, e1 = _column_interval_words(col_ptr, cols, Sq, Sk, CAUSAL, C)
    return s0[None, :], e0[None, :], s1[None, :], e1[None, :]


@_jit
def _tile(dq, it, n, hi, q_a, do_a, k_ring, v_ring, ready, k_desc, v_desc, kv_row0, kv_col,
          rows, lse2, delta, offs_nb, col_ptr, sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2,
          s_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
          C: gl.constexpr, NI: gl.constexpr, MASKED: gl.constexpr):
    """dQ += one key tile (block n, ring counter it); refills its slot with tile n + NUM_STAGES
    when that is still in [.., hi). Returns (dq, it + 1).

    Schedule: issue S = Q Kᵀ and dP = dO Vᵀ (async); masked loops load the tile's statistics and
    column intervals meanwhile; wait for S only (dP stays in flight), P = exp2(S·scale_log2 −
    lse2) and the mask; wait for dP, dS = P ⊙ (dP − delta); issue dQ += dS K (dS a register A
    operand), wait, CTA barrier (every warpgroup is done with the slot), refill."""
    dtype: gl.constexpr = k_desc.dtype
    slot = it % NUM_STAGES
    mbarrier.wait(ready.index(slot), (it // NUM_STAGES) & 1)
    k_s = k_ring.index(slot)
    v_s = v_ring.index(slot)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_a, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_a, v_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    if MASKED:
        cols = n * BLOCK_N + offs_nb
        stats = _load_stats(sum_ptr, mbh, n, NKB, NI)
        ivals = _tile_column_intervals(col_ptr, cols, Sq, Sk, CAUSAL, C)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    if MASKED:
        if _needs_mask(m_blk, n, Sq, Sk, stats, BLOCK_M, BLOCK_N, CAUSAL, NI):
            masked = _element_masked(rows[:, None], cols[None, :], ivals, Sq, Sk, CAUSAL, C)
            p = gl.where(masked, 0.0, p)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
    ds = p * (dp - delta[:, None])
    ds16 = gl.convert_layout(ds.to(dtype), a_layout)
    dq_tok = warpgroup_mma(ds16, k_s, dq, is_async=True)
    dq, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ds16))
    gl.thread_barrier()  # every warpgroup is done with the slot before TMA overwrites it
    nxt = n + NUM_STAGES
    _issue_tile(k_desc, v_desc, k_ring, v_ring, ready, slot, kv_row0 + nxt * BLOCK_N, kv_col,
                nxt < hi)
    return dq, it + 1


@_jit
def _range(dq, it, lo, flo, fhi, hi, q_a, do_a, k_ring, v_ring, ready, k_desc, v_desc,
           kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr, sum_ptr, mbh, m_blk, Sq, Sk,
           NKB, scale_log2, s_layout: gl.constexpr, a_layout: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
           CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr):
    """One live range [lo, hi) of key blocks: fill the ring, then masked [lo, flo), mask-free
    [flo, fhi), masked [fhi, hi) (the ``tl`` ``_dq_range`` with SPLIT_UNMASKED; tiles in
    order, so the ring order holds; flo, fhi clamped into [lo, hi] as in ``gluon_dkdv``)."""
    flo = gl.minimum(gl.maximum(flo, lo), hi)
    fhi = gl.minimum(gl.maximum(fhi, flo), hi)
    for j in gl.static_range(NUM_STAGES):
        _issue_tile(k_desc, v_desc, k_ring, v_ring, ready, (it + j) % NUM_STAGES,
                    kv_row0 + (lo + j) * BLOCK_N, kv_col, lo + j < hi)
    for n in range(lo, flo):
        dq, it = _tile(dq, it, n, hi, q_a, do_a, k_ring, v_ring, ready, k_desc, v_desc, kv_row0,
                       kv_col, rows, lse2, delta, offs_nb, col_ptr, sum_ptr, mbh, m_blk, Sq, Sk,
                       NKB, scale_log2, s_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CAUSAL, C, NI, True)
    for n in range(flo, fhi):
        dq, it = _tile(dq, it, n, hi, q_a, do_a, k_ring, v_ring, ready, k_desc, v_desc, kv_row0,
                       kv_col, rows, lse2, delta, offs_nb, col_ptr, sum_ptr, mbh, m_blk, Sq, Sk,
                       NKB, scale_log2, s_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CAUSAL, C, NI, False)
    for n in range(fhi, hi):
        dq, it = _tile(dq, it, n, hi, q_a, do_a, k_ring, v_ring, ready, k_desc, v_desc, kv_row0,
                       kv_col, rows, lse2, delta, offs_nb, col_ptr, sum_ptr, mbh, m_blk, Sq, Sk,
                       NKB, scale_log2, s_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CAUSAL, C, NI, True)
    return dq, it


@_jit
def _scores(it, n, q_a, do_a, k_ring, v_ring, ready, rows, lse2, offs_nb, col_ptr, sum_ptr, mbh,
            m_blk, Sq, Sk, NKB, scale_log2, ds16, prev_slot, dq,
            s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
            MASKED: gl.constexpr, HAS_PREV: gl.constexpr):
    """PIPE front half of key tile n (ring counter it): wait for its K/V slot, issue S = Q Kᵀ,
    then (HAS_PREV) the previous tile's dQ += dS K from ``prev_slot``, then dP = dO Vᵀ, all
    asynchronous; P = exp2(S·scale_log2 − lse2) and the mask while dQ and dP run. Returns
    (p, dp token, dq token or dq, ds16): with HAS_PREV the dQ wgmma is still in flight."""
    slot = it % NUM_STAGES
    mbarrier.wait(ready.index(slot), (it // NUM_STAGES) & 1)
    k_s = k_ring.index(slot)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_a, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    if HAS_PREV:
        dq = warpgroup_mma(ds16, k_ring.index(prev_slot), dq, is_async=True)
    dp_tok = warpgroup_mma(do_a, v_ring.index(slot).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
    if MASKED:
        cols = n * BLOCK_N + offs_nb
        stats = _load_stats(sum_ptr, mbh, n, NKB, NI)
        if NI < 2:  # one interval: loaded while S runs (two: after, fewer live registers)
            ivals = _tile_column_intervals(col_ptr, cols, Sq, Sk, CAUSAL, C)
    if HAS_PREV:
        s = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok, ))
    else:
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    if MASKED:
        if _needs_mask(m_blk, n, Sq, Sk, stats, BLOCK_M, BLOCK_N, CAUSAL, NI):
            if NI >= 2:
                ivals = _tile_column_intervals(col_ptr, cols, Sq, Sk, CAUSAL, C)
            masked = _element_masked(rows[:, None], cols[None, :], ivals, Sq, Sk, CAUSAL, C)
            p = gl.where(masked, 0.0, p)
    return p, dp_tok, dq, ds16


@_jit
def _ptile(dq, ds16, prev_slot, prev_row, prev_pred, it, n, hi, q_a, do_a, k_ring, v_ring, ready,
           k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr, sum_ptr, mbh,
           m_blk, Sq, Sk, NKB, scale_log2, s_layout: gl.constexpr, a_layout: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
           CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr, MASKED: gl.constexpr,
           HAS_PREV: gl.constexpr):
    """PIPE: key tile n with the previous tile's dQ += dS K overlapped (software-pipelined by
    one tile; the dQ chain keeps its order, tile after tile, so the sums are the same). Order
    of wgmma groups: S_n, dQ_{n-1}, dP_n; wait for S_n (2 in flight) and compute P_n; wait for
    dQ_{n-1} (1 in flight), CTA barrier, refill the previous tile's slot (``prev_row`` if
    ``prev_pred``); wait for dP_n, dS_n. Returns the state (dq, ds16, slot, row and predicate
    of this tile's refill, it + 1); dS_n K_n is issued by the next tile or :func:`_pflush`.
    HAS_PREV=False: a range's first tile (no dQ to issue, nothing to refill)."""
    dtype: gl.constexpr = k_desc.dtype
    p, dp_tok, dq, ds16 = _scores(it, n, q_a, do_a, k_ring, v_ring, ready, rows, lse2, offs_nb,
                                  col_ptr, sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, ds16,
                                  prev_slot, dq, s_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
                                  C, NI, MASKED, HAS_PREV)
    if HAS_PREV:
        dq, ds16 = warpgroup_mma_wait(num_outstanding=1, deps=(dq, ds16))
        gl.thread_barrier()  # every warpgroup's dQ_{n-1} has read the previous slot
        _issue_tile(k_desc, v_desc, k_ring, v_ring, ready, prev_slot, prev_row, kv_col,
                    prev_pred)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
    ds = p * (dp - delta[:, None])
    ds16 = gl.convert_layout(ds.to(dtype), a_layout)
    nxt = n + NUM_STAGES
    return dq, ds16, it % NUM_STAGES, kv_row0 + nxt * BLOCK_N, nxt < hi, it + 1


@_jit
def _pflush(dq, ds16, prev_slot, prev_row, prev_pred, k_ring, v_ring, ready, k_desc, v_desc,
            kv_col):
    """PIPE: the last tile's dQ += dS K of a non-empty range, waited; CTA barrier; its slot's
    refill (if still in the range)."""
    tok = warpgroup_mma(ds16, k_ring.index(prev_slot), dq, is_async=True)
    dq, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ds16))
    gl.thread_barrier()
    _issue_tile(k_desc, v_desc, k_ring, v_ring, ready, prev_slot, prev_row, kv_col, prev_pred)
    return dq


@_jit
def _prange(dq, it, lo, flo, fhi, hi, q_a, do_a, k_ring, v_ring, ready, k_desc, v_desc,
            kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr, sum_ptr, mbh, m_blk, Sq, Sk,
            NKB, scale_log2, s_layout: gl.constexpr, a_layout: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
            CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr):
    """PIPE twin of :func:`_range`: fill the ring; tile lo peeled (masked variant, no previous
    dQ); then masked [lo+1, flo), mask-free [flo, fhi), masked [fhi, hi) with each tile's dQ
    issued under the next tile's S (:func:`_ptile`); the last dQ flushed (:func:`_pflush`).
    The same tiles in the same order as :func:`_range` (the peeled tile's mask test is the
    scalar one every masked tile runs, so a tile of the UNMASKED run is not masked there)."""
    dtype: gl.constexpr = k_desc.dtype
    flo = gl.minimum(gl.maximum(flo, lo + 1), hi)
    fhi = gl.minimum(gl.maximum(fhi, flo), hi)
    for j in gl.static_range(NUM_STAGES):
        _issue_tile(k_desc, v_desc, k_ring, v_ring, ready, (it + j) % NUM_STAGES,
                    kv_row0 + (lo + j) * BLOCK_N, kv_col, lo + j < hi)
    ds16 = gl.zeros([BLOCK_M, BLOCK_N], dtype, a_layout)
    prev_slot = it * 0
    prev_row = kv_row0
    prev_pred = lo < 0
    if lo < hi:
        dq, ds16, prev_slot, prev_row, prev_pred, it = _ptile(
            dq, ds16, prev_slot, prev_row, prev_pred, it, lo, hi, q_a, do_a, k_ring, v_ring,
            ready, k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
            sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout, BLOCK_M, BLOCK_N,
            NUM_STAGES, CAUSAL, C, NI, True, False)
    for n in range(lo + 1, flo):
        dq, ds16, prev_slot, prev_row, prev_pred, it = _ptile(
            dq, ds16, prev_slot, prev_row, prev_pred, it, n, hi, q_a, do_a, k_ring, v_ring,
            ready, k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
            sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout, BLOCK_M, BLOCK_N,
            NUM_STAGES, CAUSAL, C, NI, True, True)
    for n in range(flo, fhi):
        dq, ds16, prev_slot, prev_row, prev_pred, it = _ptile(
            dq, ds16, prev_slot, prev_row, prev_pred, it, n, hi, q_a, do_a, k_ring, v_ring,
            ready, k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
            sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout, BLOCK_M, BLOCK_N,
            NUM_STAGES, CAUSAL, C, NI, False, True)
    for n in range(fhi, hi):
        dq, ds16, prev_slot, prev_row, prev_pred, it = _ptile(
            dq, ds16, prev_slot, prev_row, prev_pred, it, n, hi, q_a, do_a, k_ring, v_ring,
            ready, k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
            sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout, BLOCK_M, BLOCK_N,
            NUM_STAGES, CAUSAL, C, NI, True, True)
    if lo < hi:
        dq = _pflush(dq, ds16, prev_slot, prev_row, prev_pred, k_ring, v_ring, ready, k_desc,
                     v_desc, kv_col)
    return dq, it


@_jit(do_not_specialize=_NO_SPEC)
def _dq_gluon_kernel(q_desc, do_desc, k_desc, v_desc, dq_ptr, lse2_ptr, delta_ptr,
                     mask_ptr, sum_ptr, rng_ptr, sm_scale, scale_log2,
                     Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
                     D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                     NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                     A_REGS: gl.constexpr = False, PIPE: gl.constexpr = False):
    """One program per (query block, batch * query head): dQ of BLOCK_M rows (the ``tl``
    ``_dq_kernel``'s grid). A_REGS: Q and dO as register A operands (else shared memory).
    PIPE: each tile's dQ += dS K overlaps the next tile's S, P and dP (:func:`_prange`)."""
    gl.static_assert(BLOCK_M == 16 * NUM_WARPS, "wgmma M: 16 rows per warp, warps along queries")
    dtype: gl.constexpr = q_desc.dtype
    # S, dP: [BLOCK_M queries, BLOCK_N keys]; dQ: [BLOCK_M, D]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                         warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    pid = gl.program_id(0)
    if CAUSAL:
        m_blk = NQB - 1 - pid  # heavy (late) query blocks first, as the tl kernel
    else:
        m_blk = pid
    bh = gl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hk)
    hm = h // (Hq // Hm)
    b64 = b.to(gl.int64)
    r0 = m_blk * BLOCK_M

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], do_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qd_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(qd_bar, count=1)
    fence_async_shared()

    mbarrier.expect(qd_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b * Sq + r0, h * D], qd_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [b * Sq + r0, h * D], qd_bar, do_smem)

    rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_nb = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    rvalid = rows < Sq
    stat_row = (b64 * Hq + h) * Sq + rows
    lse2 = gl.load(lse2_ptr + stat_row, mask=rvalid, other=float("inf"))
    delta = gl.load(delta_ptr + stat_row, mask=rvalid, other=0.0)

    mbh = b64 * mask_b_stride + hm
    col_ptr = mask_ptr + mbh * Sk * C
    lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1 = _query_block_ranges(
        rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
    kv_row0 = b * Sk
    kv_col = hk * D
    dq = gl.zeros([BLOCK_M, D], gl.float32, acc_layout)

    mbarrier.wait(qd_bar, 0)
    if A_REGS:
        qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout,
                                                      k_width=2)
        q_a = q_smem.load(qa_layout)
        do_a = do_smem.load(qa_layout)
    else:
        q_a = q_smem
        do_a = do_smem
    it = m_blk * 0  # ring counter: tile t sits in slot t % NUM_STAGES, parity (t // S) & 1
    if PIPE:
        dq, it = _prange(dq, it, lo0, flo0, fhi0, hi0, q_a, do_a, k_ring, v_ring, ready,
                         k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
                         sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout,
                         BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI)
        dq, it = _prange(dq, it, lo1, flo1, fhi1, hi1, q_a, do_a, k_ring, v_ring, ready,
                         k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
                         sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout,
                         BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI)
    else:
        dq, it = _range(dq, it, lo0, flo0, fhi0, hi0, q_a, do_a, k_ring, v_ring, ready,
                        k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
                        sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout,
                        BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI)
        dq, it = _range(dq, it, lo1, flo1, fhi1, hi1, q_a, do_a, k_ring, v_ring, ready,
                        k_desc, v_desc, kv_row0, kv_col, rows, lse2, delta, offs_nb, col_ptr,
                        sum_ptr, mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, a_layout,
                        BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(qd_bar)

    offs_m = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    q_off = ((b64 * Sq + offs_m) * (Hq * D) + h * D)[:, None] + offs_d[None, :]
    omask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D)
    gl.store(dq_ptr + q_off, (dq * sm_scale).to(dtype), mask=omask)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def check_config(d: int, block_m: int, block_n: int, num_warps: int, num_stages: int) -> None:
    """Raise ValueError on a configuration the kernel cannot compile: one wgmma row of 16
    queries per warp (block_m == 16 * num_warps: 64 per warpgroup), D 64 or 128 (D=256: Q, dO
    and a K/V ring do not fit in shared memory next to each other), power-of-two tiles."""
    if d not in (64, 128):
        raise ValueError(f"gluon dQ: head dim {d} (64 or 128)")
    if block_m != 16 * num_warps:
        raise ValueError(f"gluon dQ: block_m={block_m} must be 16 * num_warps ({num_warps})")
    if block_n not in (16, 32, 64, 128):
        raise ValueError(f"gluon dQ: block_n={block_n} (16, 32, 64 or 128)")
    if num_stages < 1:
        raise ValueError(f"gluon dQ: num_stages={num_stages} (>= 1)")


def shared_bytes(d: int, block_m: int, block_n: int, num_stages: int, elem: int = 2) -> int:
    """Shared memory of one program: Q and dO tiles plus the K/V ring (barriers aside)."""
    return elem * d * (2 * block_m + 2 * num_stages * block_n)


def launch_dq_gluon(q, k, v, dout, lse2, delta, causal, softmax_scale, plan, block_m: int,
                    block_n: int, num_warps: int, num_stages: int, a_regs: bool = False,
                    pipe: bool = False):
    """dQ like ``triton_flashmask._launch_dq`` (already multiplied by ``softmax_scale``, in q's
    dtype); ``plan`` must come from ``make_plan(mask, causal, Sq, Sk, block_m, block_n,
    by_key=False, device)``. ``a_regs``: the A_REGS kernel (Q, dO as register A operands);
    ``pipe``: the PIPE kernel (each tile's dQ wgmma overlapped with the next tile's S and dP)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    check_config(d, block_m, block_n, num_warps, num_stages)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gluon dQ: dtype {q.dtype} (bf16 or fp16)")
    q, k, v, dout = (x.contiguous() for x in (q, k, v, dout))
    if sq == 0 or sk == 0:
        return torch.zeros_like(q)
    nqb, nkb = triton.cdiv(sq, block_m), triton.cdiv(sk, block_n)
    if plan.c > 0 and (plan.ranges.shape[1] != nqb or plan.summary.shape[1] != nkb):
        raise ValueError("gluon dQ: the plan was built for another tile shape (or by key)")
    dq = torch.empty_like(q)
    ql = _G._smem_layout(block_m, d, q.dtype)
    kl = _G._smem_layout(block_n, d, q.dtype)
    desc = _G.GluonDescriptor.from_tensor
    q_desc = desc(q.view(b * sq, hq * d), [block_m, d], ql)
    do_desc = desc(dout.view(b * sq, hq * d), [block_m, d], ql)
    k_desc = desc(k.view(b * sk, hk * d), [block_n, d], kl)
    v_desc = desc(v.view(b * sk, hk * d), [block_n, d], kl)
    kwargs = dict(A_REGS=True) if a_regs else {}
    if pipe:
        kwargs["PIPE"] = True
    _dq_gluon_kernel[(nqb, b * hq)](
        q_desc, do_desc, k_desc, v_desc, dq, lse2, delta, plan.mask, plan.summary, plan.ranges,
        softmax_scale, softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb,
        plan.mask_b_stride, D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, C=plan.c,
        NI=plan.ni, NUM_STAGES=num_stages, NUM_WARPS=num_warps, num_warps=num_warps, **kwargs)
    return dq


# ---------------------------------------------------------------------------------------------
# Offline compile report (no GPU needed)
# ---------------------------------------------------------------------------------------------

from .triton_report import compile_gluon_sm90, cuobjdump  # noqa: E402  (one compile toolkit)


def compile_sm90(d: int = 128, block_m: int = 128, block_n: int = 64, num_warps: int = 8,
                 num_stages: int = 3, causal: bool = True, c: int = 1, dtype: str = "bf16",
                 a_regs: bool = False, pipe: bool = False):
    """Compile the kernel for sm_90 without a GPU (the launcher's signature: descriptors with
    the NVMMA layouts, 16-divisible pointers, unspecialised lengths); returns the
    CompiledKernel. Twin of ``gluon_dkdv.compile_sm90``."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    check_config(d, block_m, block_n, num_warps, num_stages)
    descs = _G.offline_descriptor_types(dtype, d, q_desc=block_m, do_desc=block_m,
                                        k_desc=block_n, v_desc=block_n)
    ptrs = {"dq_ptr": f"*{dtype}", "lse2_ptr": "*fp32", "delta_ptr": "*fp32",
            "mask_ptr": "*i32", "sum_ptr": "*i32", "rng_ptr": "*i32"}
    consts = _G.offline_constexprs(d, block_m, block_n, num_warps, num_stages, causal, c,
                                   A_REGS=a_regs, PIPE=pipe)
    return compile_gluon_sm90(_dq_gluon_kernel, ptrs, descs, consts, num_warps, num_stages)


ASYNC_WAIT = "WARPGROUP.DEPBAR.LE gsb0, 0x1"


def sass_report(cubin: bytes) -> dict:
    """Registers, spills (whole kernel and inside the tile loops, ``gluon_dkdv.tile_loop_spills``),
    HGMMA count and wgmma waits of a cubin; ``async_waits``: the ``DEPBAR.LE gsb0, 0x1`` waits
    (one wgmma group left in flight), ``sync_waits`` the ``0x0`` ones."""
    usage, sass = cuobjdump(cubin)
    loops, in_loops = _G.tile_loop_spills(sass)
    return dict(regs=usage["regs"], stack=usage["stack"], local=usage["local"],
                hgmma=sass.count("HGMMA"), ldl_stl=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
                tile_loops=len(loops), ldl_stl_in_tile_loops=len(in_loops),
                async_waits=sass.count(ASYNC_WAIT),
                sync_waits=sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"),
                bar_sync=sass.count("BAR.SYNC"), tma_load=sass.count("UTMALDG"),
                mufu_ex2=sass.count("MUFU.EX2"))


def compile_report(d=128, block_m=128, block_n=64, num_warps=8, num_stages=3, causal=True, c=1,
                   dtype="bf16", a_regs=False, pipe=False) -> dict:
    """One configuration's offline sm_90 report (or its error)."""
    row = dict(D=d, block_m=block_m, block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, causal=causal, C=c, dtype=dtype, a_regs=a_regs, pipe=pipe,
               smem_kb=shared_bytes(d, block_m, block_n, num_stages) / 1024)
    try:
        ck = compile_sm90(d, block_m, block_n, num_warps, num_stages, causal, c, dtype, a_regs,
                          pipe)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        return row
    row["shared"] = ck.metadata.shared
    row.update(sass_report(ck.asm["cubin"]))
    return row


#: (block_m, block_n, num_warps, num_stages) tried at D=128 by the report; the first is the
#: ``tl`` dQ default at D=128 (``CANDIDATES[("dq", 128)][0]``).
REPORT_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                  (64, 128, 4, 2), (128, 128, 8, 2)]


def main(argv=None):
    import argparse
    import json

    ap = argparse.ArgumentParser(description="offline sm_90 report of the Gluon dQ kernel")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--layouts", default="1:1,1:2,0:2,0:4,1:0,0:0", help="causal:C pairs")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--a-regs", default="0", help="comma list of 0/1: A operands in registers")
    ap.add_argument("--configs", default=None, help="e.g. 128x64w8s3,64x64w4s2")
    ap.add_argument("--pipe", default="0", help="comma list of 0/1: the PIPE kernel")
    args = ap.parse_args(argv)
    configs = REPORT_CONFIGS
    if args.configs:
        configs = [tuple(int(x) for x in lab.replace("x", " ").replace("w", " ")
                         .replace("s", " ").split()) for lab in args.configs.split(",")]
    for d in (int(x) for x in args.dims.split(",")):
        for cfg in configs:
            for a_regs, pipe in ((bool(int(a)), bool(int(p))) for a in args.a_regs.split(",")
                                 for p in args.pipe.split(",")):
                for causal, c in ((bool(int(a)), int(b)) for a, b in
                                  (x.split(":") for x in args.layouts.split(","))):
                    print(json.dumps(compile_report(d, *cfg, causal=causal, c=c,
                                                    dtype=args.dtype, a_regs=a_regs,
                                                    pipe=pipe)), flush=True)


if __name__ == "__main__":
    main()
