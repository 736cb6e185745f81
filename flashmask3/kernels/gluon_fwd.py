"""The warp-specialised Gluon forward for Hopper (sm_90): ``_fwd_ws_kernel``.

What it computes: what the ``tl`` ``_fwd_kernel`` computes, O ``[B, Sq, Hq, D]`` and the LSE
``[B, Hq, Sq]`` (natural log, ``-inf`` on fully masked rows, whose O is 0), from the same
:class:`~flashmask3.kernels.tiles.Plan` (built by query block for the same tile), on the same
grid (one program per (query block, batch * query head)), visiting the same tiles: per live
range a masked loop, a mask-free loop compiled without mask code and a masked loop.

How: a one-warp TMA producer partition fills separate K and V rings (one mbarrier pair per
slot) and, for the tiles that need masking, stages their mask columns in shared memory
(COLS_SMEM); one or two consumer warpgroups of 64 query rows each run FA3's intra-warpgroup
overlap per key tile j: issue S_j = Q K_jᵀ, rescale O while it runs, issue O += P_{j-1} V_{j-1},
wait for S_j only (the PV matmul keeps running), mask and online softmax -> P_j. With
PINGPONG the two warpgroups take turns issuing their matmuls (the D=256 default). The
consumers get the registers the producer's warpgroup gives back (``maxnreg``,
:func:`ws_maxnreg`, :func:`ws_consumer_regs`). Where it runs by default and why:
``dispatch.TABLE`` and docs/kernels.md; measurements: benchmarks/NOTES.md (v6.8-v7.1).

Numerics against ``tl``: the same scores, masked-row guard, rescale-then-accumulate order,
final normalisation and LSE formula; at the same tile and k-steps O is bitwise equal to tl's
on the H200 (tests/kernels/test_gluon_fwd.py).

The module imports on a CPU-only machine and without Gluon (the kernel compiles on first
launch); :func:`unavailable_reason` says why it cannot be used. Offline sm_90 report:
``python -m flashmask3.kernels.compile_tools fwd --warp-spec``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from . import gluon_common as _GD
from .gluon_common import (_gl_dtype, _jit, _load_stats, _needs_mask,  # noqa: F401
                           _query_block_ranges, _smem_layout, gl, thread_barrier, tma_load,
                           unavailable_reason)
from .launcher import TENSOR, Bound, Desc, cdiv
from .tiles import _NO_SPEC, LOG2E

if _GD.GLUON_IMPORT_ERROR is None:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                   tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
else:  # pragma: no cover - older triton
    GluonDescriptor = None

#: Largest dynamic shared memory per block on sm_90 (227 KB), less a margin for barriers.
SMEM_LIMIT = 232448 - 1024


# ---------------------------------------------------------------------------------------------
# Device code: query-major twins of the key-major helpers of gluon_common
# ---------------------------------------------------------------------------------------------


@_jit
def _mask_interval(qk, rows, s, e):
    """-inf where rows [s, e) of the columns (``s``, ``e`` ``[1, BN]``, rows ``[BM, 1]``)."""
    return gl.where((rows >= s) & (rows < e), float("-inf"), qk)


@_jit
def _column_word(col_src, slot, cols, Sk, w: gl.constexpr, C: gl.constexpr):
    """Word ``w`` of the mask columns ``cols`` as a ``[1, BN]`` row (0 past Sk), from global
    memory (``col_src`` the mask row's pointer; ``slot`` unused) or from column slot ``slot``
    of the ring the producer filled (``col_src`` [NUM_STAGES * C, BN] in shared memory,
    :func:`_ws_produce_columns`)."""
    if isinstance(col_src, gl.shared_memory_descriptor):
        word = col_src.index(slot * C + w).load(cols.type.layout)
    else:
        word = gl.load(col_src + cols * C + w, mask=cols < Sk, other=0)
    return word[None, :]


@_jit
def _mask_from(qk, rows, s):
    """-inf where rows >= s of the columns (``s`` ``[1, BN]``): the interval [s, Sq) for the
    rows < Sq that are stored (a row >= Sq of the last block is never stored, so it need not
    be masked: one compare and no [BN] vector of Sq)."""
    return gl.where(rows >= s, float("-inf"), qk)


@_jit
def _mask_below(qk, rows, e):
    """-inf where rows < e of the columns: the interval [0, e)."""
    return gl.where(rows < e, float("-inf"), qk)


@_jit
def _mask_scores(qk, rows, cols, col_src, slot, Sq, Sk, CAUSAL: gl.constexpr,
                 C: gl.constexpr):
    """Scores ``qk`` [BM, BN] with -inf where (row, col) is masked (docs/masks.md); rows
    ``[BM]`` and cols ``[BN]`` are 1-D slices of the score layout; the column words come from
    ``col_src`` (:func:`_column_word`). Query-major twin of
    ``gluon_common._column_intervals`` + ``_element_masked`` (the ``tl`` ``_column_intervals``
    table): the intervals are applied one at a time as they are loaded, because in this
    orientation every thread holds BN/4 columns and holding all four interval words at once
    costs ~BN registers; intervals that end at Sq or start at 0 take one compare each
    (:func:`_mask_from`, :func:`_mask_below`). Columns at or beyond Sk are masked."""
    r = rows[:, None]
    c = cols[None, :]
    qk = gl.where(c >= Sk, float("-inf"), qk)
    if C > 0:
        if CAUSAL and C == 1:  # [LTS, Sq)
            qk = _mask_from(qk, r, _column_word(col_src, slot, cols, Sk, 0, C))
        elif CAUSAL and C == 2:  # [LTS, LTE)
            qk = _mask_interval(qk, r, _column_word(col_src, slot, cols, Sk, 0, C),
                                _column_word(col_src, slot, cols, Sk, 1, C))
        elif C == 2:  # non-causal: [LTS, Sq) and [0, UTE)
            qk = _mask_from(qk, r, _column_word(col_src, slot, cols, Sk, 0, C))
            qk = _mask_below(qk, r, _column_word(col_src, slot, cols, Sk, 1, C))
        else:  # C == 4: [LTS, LTE) and [UTS, UTE)
            qk = _mask_interval(qk, r, _column_word(col_src, slot, cols, Sk, 0, C),
                                _column_word(col_src, slot, cols, Sk, 1, C))
            qk = _mask_interval(qk, r, _column_word(col_src, slot, cols, Sk, 2, C),
                                _column_word(col_src, slot, cols, Sk, 3, C))
    if CAUSAL:
        qk = gl.where(c > r + (Sk - Sq), float("-inf"), qk)
    return qk


@_jit
def _max_fn(a, b):
    """Combine function of a row max (a ``gluon.jit`` one: triton's ``tl.max``/``tl.sum``
    are ``triton.jit`` functions, which a Gluon kernel cannot call under TRITON_INTERPRET=1,
    as the CPU test process sets it)."""
    return gl.maximum(a, b)


@_jit
def _add_fn(a, b):
    """Combine function of a row sum (see :func:`_max_fn`)."""
    return a + b


@_jit
def _softmax_update(qk, m_i, l_i, MASKED: gl.constexpr):
    """Online softmax step of the ``tl`` ``_fwd_inner`` on scores ``qk`` (already scaled to
    log2 units and masked): returns (P, alpha, new row max, new row sum). Masked loops guard
    rows whose max is still -inf (exp2 of 0 offsets, so P = 0 there, never NaN)."""
    m_new = gl.maximum(m_i, gl.reduce(qk, 1, _max_fn))
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(qk - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.reduce(p, 1, _add_fn)
    return p, alpha, m_new, l_i


@_jit
def _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, b64, h, row0, Sq, Hq,
                s_layout: gl.constexpr, o_layout: gl.constexpr, D: gl.constexpr,
                ROWS: gl.constexpr):
    """O = acc / l (0 on rows with l == 0) and LSE = (m + log2 l) / log2(e) (-inf there) of
    query rows [row0, row0 + ROWS), as the ``tl`` kernel stores them; rows >= Sq are not
    stored."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) / 1.4426950408889634)
    rows_s = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + (b64 * Hq + h) * Sq + rows_s, lse, mask=rows_s < Sq)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    off = ((b64 * Sq + rows) * (Hq * D) + h * D)[:, None] + offs_d[None, :]
    gl.store(o_ptr + off, out.to(o_ptr.dtype.element_ty),
             mask=(rows[:, None] < Sq) & (offs_d[None, :] < D))


@_jit
def _ws_item(item, NQB, Hq, Hk, Hm, mask_b_stride, CAUSAL: gl.constexpr):
    """(m_blk, b, h, hk, b64, mbh) of work item ``item``: the non-persistent grid's program
    (item % NQB, item // NQB), in the order the hardware launches that grid (query blocks
    fastest; causal: the heavy late query blocks of a head first)."""
    i = item % NQB
    bh = item // NQB
    if CAUSAL:
        m_blk = NQB - 1 - i
    else:
        m_blk = i
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hk)
    hm = h // (Hq // Hm)
    b64 = b.to(gl.int64)
    mbh = b64 * mask_b_stride + hm
    return m_blk, b, h, hk, b64, mbh


@_jit
def _ws_item_tiles(rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr):
    """The block's live ranges (:func:`_query_block_ranges`) plus len0 (tiles of the first
    range) and T (tiles of both)."""
    lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1 = _query_block_ranges(
        rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
    len0 = gl.maximum(hi0 - lo0, 0)
    T = len0 + gl.maximum(hi1 - lo1, 0)
    return lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, len0, T


@_jit
def _mask_free_span(lo, flo, fhi, hi):
    """The mask-free loop [flo, fhi) of live range [lo, hi), clamped into it: the tiles of
    [lo, flo) and [fhi, hi) take the masked loops."""
    flo = gl.minimum(gl.maximum(flo, lo), hi)
    fhi = gl.minimum(gl.maximum(fhi, flo), hi)
    return flo, fhi


@_jit
def _ws_produce_columns(col_ring, slot, col_ptr, n, Sk, BLOCK_N: gl.constexpr,
                        C: gl.constexpr):
    """COLS_SMEM: the C mask words of key block ``n``'s columns (0 past Sk) into column slot
    ``slot``, so the consumers' masked tiles read them from shared memory instead of waiting
    for global loads after their S wait."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    cols = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
    for w in gl.static_range(C):
        col_ring.index(slot * C + w).store(gl.load(col_ptr + cols * C + w, mask=cols < Sk,
                                                   other=0))


@_jit
def _ws_produce_tiles(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                      col_ring, t, kv_row0, kv_col, col_ptr, Sk, lo0, flo0, fhi0, hi0, len0,
                      lo1, flo1, fhi1, hi1, T, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                      C: gl.constexpr):
    """The producer's loads of one block's T key tiles, ring tiles t .. t + T - 1 (tile j of
    the block: key block lo0 + j, or lo1 + j - len0 in the second range): K into K slot
    t % NUM_STAGES once every consumer released it (``k_empty``, one arrive per consumer
    warpgroup), V likewise into its V slot. K and V have separate rings, so a K slot is
    refilled as soon as the warpgroups' S has been waited for, a tile before the PV that frees
    the V slot. With a
    column ring (COLS_SMEM, else ``col_ring`` is 0) a tile of a masked loop also gets its mask
    columns (:func:`_ws_produce_columns`) in the K slot's column slot, and ``k_ready`` counts
    a second arrive after them. Returns the ring counter after the block."""
    COLS: gl.constexpr = isinstance(col_ring, gl.shared_memory_descriptor)
    if COLS:
        flo0, fhi0 = _mask_free_span(lo0, flo0, fhi0, hi0)
        flo1, fhi1 = _mask_free_span(lo1, flo1, fhi1, hi1)
    for j in range(0, T):
        second = (j >= len0).to(gl.int32)
        n = lo0 + j + second * (lo1 - lo0 - len0)
        slot = t % NUM_STAGES
        free = ((t // NUM_STAGES) & 1) ^ 1  # a fresh barrier counts as released
        row = kv_row0 + n * BLOCK_N
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [row, kv_col], k_ready.index(slot), k_ring.index(slot))
        if COLS:
            f_lo = flo0 + second * (flo1 - flo0)
            f_hi = fhi0 + second * (fhi1 - fhi0)
            if (n < f_lo) | (n >= f_hi):
                _ws_produce_columns(col_ring, slot, col_ptr, n, Sk, BLOCK_N, C)
                thread_barrier()  # every lane's stores before the (one-thread) arrive
            mbarrier.arrive(k_ready.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [row, kv_col], v_ready.index(slot), v_ring.index(slot))
        t += 1
    return t


@_jit
def _ws_load_q(q_desc, q_smem, q_bar, q_row, q_col):
    """The query block's 64-row slices (one per consumer warpgroup, ``q_smem``'s first dim)
    into ``q_smem`` on ``q_bar``."""
    NC: gl.constexpr = q_smem.shape[0]
    WG_M: gl.constexpr = q_smem.shape[1]
    mbarrier.expect(q_bar, NC * q_desc.block_type.nbytes)
    for wg in gl.static_range(NC):
        tma_load(q_desc, [q_row + wg * WG_M, q_col], q_bar, q_smem.index(wg))


@_jit
def _ws_produce(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty,
                v_ready, v_empty, item_smem, next_item_ptr, col_ring, mask_ptr, rng_ptr, Sq, Sk,
                Hq, Hk, Hm, NQB, NKB, mask_b_stride, n_items, kv_row0, kv_col, col_ptr, lo0,
                flo0, fhi0, hi0, len0, lo1, flo1, fhi1, hi1, T, D: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, C: gl.constexpr):
    """Producer partition (1 warp): the block's key tiles (``kv_row0`` .. ``T`` from the kernel
    body, which loaded Q before the partitions forked). ``col_ring``: the column ring
    (COLS_SMEM) or 0; ``item_smem``, ``next_item_ptr``, ``n_items`` are unused (kept so that
    the compiled kernel stays the GPU-verified one)."""
    _ws_produce_tiles(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                      col_ring, lo0 * 0, kv_row0, kv_col, col_ptr, Sk, lo0, flo0, fhi0,
                      hi0, len0, lo1, flo1, fhi1, hi1, T, BLOCK_N, NUM_STAGES, C)


@_jit
def _ws_wait_turn(turn, u, WG: gl.constexpr):
    """PINGPONG: wait until the other warpgroup has issued its matmuls of its step ``u - 1``
    (warpgroup 0 goes first: a fresh barrier passes at parity 1)."""
    if WG == 0:
        mbarrier.wait(turn.index(0), (u & 1) ^ 1)
    else:
        mbarrier.wait(turn.index(1), u & 1)


@_jit
def _ws_pass_turn(turn, WG: gl.constexpr):
    """PINGPONG: this warpgroup's matmuls of the step are issued; the other one's turn."""
    mbarrier.arrive(turn.index(1 - WG))


@_jit
def _ws_tile(acc, m_i, l_i, p_prev, alpha, t, u, j, n, q_s, k_ring, v_ring, k_ready, k_empty,
             v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring, mbh, m_blk, Sq, Sk,
             NKB, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
             a_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
             MASKED: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer warpgroup's tile ``j`` of its block (ring tile ``t``, key block ``n``;
    ``u`` counts its ping-pong turns): :func:`_tile`'s schedule (S_t issued, O rescaled under
    it, PV_{t-1} issued, softmax of S_t under the PV) on its 64 query rows, with the ring
    slots handed back to the producer instead of refilled: K_t's slot once S_t has been
    waited for (in a masked loop with the column ring ``col_ring``: once the tile's mask
    columns have been read from its column slot too), V_{t-1}'s once PV_{t-1} has (the
    block's tile 0 multiplies P = 0 with its own V tile, which tile 1 reads again: it frees
    nothing). ``BLOCK_M`` is the plan's (both warpgroups') query block: the tile's mask class
    is the block's."""
    WG_M: gl.constexpr = q_s.shape[0]
    slot = t % NUM_STAGES
    pv_t = t - (j > 0).to(gl.int32)
    pv_slot = pv_t % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (t // NUM_STAGES) & 1)
    if PINGPONG:
        _ws_wait_turn(turn, u, WG)
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_s, k_ring.index(slot).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_ready.index(pv_slot), (pv_t // NUM_STAGES) & 1)
    o_tok = warpgroup_mma(p_prev, v_ring.index(pv_slot), acc, is_async=True)
    if PINGPONG:
        _ws_pass_turn(turn, WG)
    if MASKED:  # scalar loads under the matmuls
        stats = _load_stats(sum_ptr, mbh, n, NKB, NI)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    COLS: gl.constexpr = MASKED and isinstance(col_ring, gl.shared_memory_descriptor)
    if not COLS:  # (with the column ring the slot is released after its columns are read)
        mbarrier.arrive(k_empty.index(slot))
    qk = s * scale_log2
    if MASKED:
        if _needs_mask(m_blk, n, Sq, Sk, stats, BLOCK_M, BLOCK_N, CAUSAL, NI):
            if COLS:
                col_src = col_ring
            else:
                col_src = col_ptr
            qk = _mask_scores(qk, rows, n * BLOCK_N + offs_nb, col_src, slot, Sq, Sk, CAUSAL,
                              C)
        if COLS:
            mbarrier.arrive(k_empty.index(slot))
    p, alpha, m_i, l_i = _softmax_update(qk, m_i, l_i, MASKED)
    p16 = gl.convert_layout(p.to(q_s.dtype), a_layout)
    acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
    mbarrier.arrive(v_empty.index(pv_slot), pred=j > 0)
    return acc, m_i, l_i, p16, alpha, t + 1, u + 1, j + 1


@_jit
def _ws_loop(acc, m_i, l_i, p_prev, alpha, t, u, j, lo, hi, q_s, k_ring, v_ring, k_ready,
             k_empty, v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring, mbh,
             m_blk, Sq, Sk, NKB, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
             a_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
             MASKED: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Key blocks [lo, hi) in order, one :func:`_ws_tile` each (MASKED: with mask code)."""
    for n in range(lo, hi):
        acc, m_i, l_i, p_prev, alpha, t, u, j = _ws_tile(
            acc, m_i, l_i, p_prev, alpha, t, u, j, n, q_s, k_ring, v_ring, k_ready, k_empty,
            v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring, mbh, m_blk, Sq,
            Sk, NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES,
            CAUSAL, C, NI, MASKED, WG, PINGPONG)
    return acc, m_i, l_i, p_prev, alpha, t, u, j


@_jit
def _ws_range(acc, m_i, l_i, p_prev, alpha, t, u, j, lo, flo, fhi, hi, q_s, k_ring, v_ring,
              k_ready, k_empty, v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring,
              mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
              a_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
              WG: gl.constexpr, PINGPONG: gl.constexpr):
    """One live range [lo, hi) as :func:`_range` walks it: masked, mask-free, masked."""
    flo, fhi = _mask_free_span(lo, flo, fhi, hi)
    acc, m_i, l_i, p_prev, alpha, t, u, j = _ws_loop(
        acc, m_i, l_i, p_prev, alpha, t, u, j, lo, flo, q_s, k_ring, v_ring, k_ready, k_empty,
        v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring, mbh, m_blk, Sq, Sk,
        NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C,
        NI, True, WG, PINGPONG)
    acc, m_i, l_i, p_prev, alpha, t, u, j = _ws_loop(
        acc, m_i, l_i, p_prev, alpha, t, u, j, flo, fhi, q_s, k_ring, v_ring, k_ready, k_empty,
        v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring, mbh, m_blk, Sq, Sk,
        NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C,
        NI, False, WG, PINGPONG)
    acc, m_i, l_i, p_prev, alpha, t, u, j = _ws_loop(
        acc, m_i, l_i, p_prev, alpha, t, u, j, fhi, hi, q_s, k_ring, v_ring, k_ready, k_empty,
        v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring, mbh, m_blk, Sq, Sk,
        NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C,
        NI, True, WG, PINGPONG)
    return acc, m_i, l_i, p_prev, alpha, t, u, j


@_jit
def _ws_consume_block(WG: gl.constexpr, t, u, q_smem, k_ring, v_ring, q_bar, q_phase, q_empty,
                      k_ready, k_empty, v_ready, v_empty, turn, col_ring, o_ptr, lse_ptr, sum_ptr,
                      mask_ptr, b64, h, mbh, m_blk, Sq, Sk, Hq, NKB, scale_log2, lo0, flo0,
                      fhi0, hi0, lo1, flo1, fhi1, hi1, T, D: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                      PINGPONG: gl.constexpr):
    """Consumer warpgroup ``WG``'s share of one block: O and LSE of query rows
    [m_blk * BLOCK_M + WG * 64, + 64) over the block's live ranges, from ring tile ``t`` and
    ping-pong turn ``u`` on. Returns (t, u) after the block."""
    WG_M: gl.constexpr = q_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    col_ptr = mask_ptr + mbh * Sk * C
    row0 = m_blk * BLOCK_M + WG * WG_M
    rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
    offs_nb = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    acc = gl.zeros([WG_M, D], gl.float32, o_layout)
    m_i = gl.full([WG_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([WG_M], gl.float32, gl.SliceLayout(1, s_layout))
    p_prev = gl.zeros([WG_M, BLOCK_N], dtype, a_layout)
    alpha = gl.full([WG_M], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
    q_s = q_smem.index(WG)
    j = t * 0
    mbarrier.wait(q_bar, q_phase)
    acc, m_i, l_i, p_prev, alpha, t, u, j = _ws_range(
        acc, m_i, l_i, p_prev, alpha, t, u, j, lo0, flo0, fhi0, hi0, q_s, k_ring, v_ring,
        k_ready, k_empty, v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring,
        mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N,
        NUM_STAGES, CAUSAL, C, NI, WG, PINGPONG)
    acc, m_i, l_i, p_prev, alpha, t, u, j = _ws_range(
        acc, m_i, l_i, p_prev, alpha, t, u, j, lo1, flo1, fhi1, hi1, q_s, k_ring, v_ring,
        k_ready, k_empty, v_ready, v_empty, turn, rows, offs_nb, sum_ptr, col_ptr, col_ring,
        mbh, m_blk, Sq, Sk, NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N,
        NUM_STAGES, CAUSAL, C, NI, WG, PINGPONG)
    if T > 0:  # the last tile's rescale and PV
        last = (t - 1) % NUM_STAGES
        if PINGPONG:
            _ws_wait_turn(turn, u, WG)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(last), ((t - 1) // NUM_STAGES) & 1)
        o_tok = warpgroup_mma(p_prev, v_ring.index(last), acc, is_async=True)
        if PINGPONG:
            _ws_pass_turn(turn, WG)
            u += 1
        acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(last))
    _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, b64, h, row0, Sq, Hq, s_layout, o_layout, D,
                WG_M)
    return t, u


@_jit
def _ws_consume(WG: gl.constexpr, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty,
                v_ready, v_empty, turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr,
                rng_ptr, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items,
                D: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                PINGPONG: gl.constexpr):
    """Consumer partition ``WG`` (one warpgroup): its 64 rows of the program's block
    (``n_items``, ``item_smem`` unused; ``col_ring`` the column ring or 0)."""
    pid = gl.program_id(0)
    m_blk, b, h, hk, b64, mbh = _ws_item(pid + gl.program_id(1) * NQB, NQB, Hq, Hk, Hm,
                                         mask_b_stride, CAUSAL)
    lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, len0, T = _ws_item_tiles(
        rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
    _ws_consume_block(WG, pid * 0, pid * 0, q_smem, k_ring, v_ring, q_bar, 0, q_empty,
                      k_ready, k_empty, v_ready, v_empty, turn, col_ring, o_ptr, lse_ptr,
                      sum_ptr, mask_ptr, b64, h, mbh, m_blk, Sq, Sk, Hq, NKB, scale_log2, lo0,
                      flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, T, D, BLOCK_M, BLOCK_N, NUM_STAGES,
                      CAUSAL, C, NI, PINGPONG)


@_jit
def _ws_consume_wg0(q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                    turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk,
                    Hq, Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                    PINGPONG: gl.constexpr):
    """Consumer warpgroup 0 (the default partition; the warpgroup index must be a literal:
    warp_specialize passes its arguments as values)."""
    _ws_consume(0, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq,
                Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N,
                NUM_STAGES, CAUSAL, C, NI, PINGPONG)


@_jit
def _ws_consume_wg1(q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                    turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk,
                    Hq, Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                    PINGPONG: gl.constexpr):
    """Consumer warpgroup 1 (a 4-warp worker partition)."""
    _ws_consume(1, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq,
                Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N,
                NUM_STAGES, CAUSAL, C, NI, PINGPONG)


#: WARP_SPEC forward: the producer warp's registers (the dK/dV kernel's).
WS_PRODUCER_REGS = _GD.PRODUCER_REGS
#: WARP_SPEC forward tiles, (block_m, num_warps): two consumer warpgroups of 64 query rows
#: (one program per SM: 12 warp slots), or one (session 16: two programs per SM where the
#: ring fits twice in shared memory, for blocks with few live tiles).
WS_SHAPES = ((128, 8), (64, 4))


def ws_maxnreg(num_warps: int = 8) -> int:
    """The WARP_SPEC forward's ``maxnreg`` for ``num_warps`` consumer warps: the dK/dV
    kernel's rule (:func:`gluon_common.ws_maxnreg`: the consumers plus the producer's warpgroup
    at the residency of the non-WS kernel): 168 at 8 warps (12 warp slots, one program per SM),
    128 at 4 (8 warp slots, two programs per SM)."""
    return _GD.ws_maxnreg(num_warps)


def ws_consumer_regs(num_warps: int = 8) -> int:
    """Registers per thread of each consumer warpgroup: what the producer warpgroup gives back,
    shared equally (240 at 8 consumer warps, 232 at 4), capped at 255."""
    return _GD.ws_compute_regs(num_warps)


@_jit(do_not_specialize=_NO_SPEC + ["n_items"])
def _fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, mask_ptr, sum_ptr, rng_ptr,
                   scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride, n_items,
                   D: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr,
                   NI: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                   PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   COLS_SMEM: gl.constexpr):
    """The WARP_SPEC forward: one program per (query block of BLOCK_M rows, batch * query
    head), same grid, program order, plan and tiles as the tl forward (``n_items`` = NQB * B *
    Hq is unused: kept so that the compiled kernel stays the GPU-verified one).
    Launched with 4 warps (consumer warpgroup 0, the default partition) plus, at BLOCK_M = 128,
    a 4-warp worker (consumer warpgroup 1), and a 1-warp TMA producer; NUM_WARPS counts the
    consumer warps (8 or 4: NC = NUM_WARPS // 4 warpgroups of 64 rows)."""
    gl.static_assert(BLOCK_M == 16 * NUM_WARPS and (NUM_WARPS == 8 or NUM_WARPS == 4),
                     "one or two consumer warpgroups of 64 rows")
    NC: gl.constexpr = NUM_WARPS // 4
    WG_M: gl.constexpr = 64
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NC, WG_M, D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    COLS: gl.constexpr = COLS_SMEM and C > 0
    if COLS:  # K slot s's mask columns in rows s * C .. s * C + C - 1, filled by the producer
        col_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES * C, BLOCK_N],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    else:
        col_ring = 0  # a placeholder (a None cannot travel in the partitions' arguments)
    for i in gl.static_range(NUM_STAGES):
        if COLS:  # K's expect-tx arrive and the producer's arrive after the columns
            mbarrier.init(k_ready.index(i), count=2)
        else:
            mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NC)  # every consumer warpgroup releases a slot
        mbarrier.init(v_empty.index(i), count=NC)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=NC)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()

    m_blk, b, h, hk, b64, mbh = _ws_item(gl.program_id(0) + gl.program_id(1) * NQB, NQB, Hq,
                                         Hk, Hm, mask_b_stride, CAUSAL)
    # Q's two halves first: their load runs under the live ranges' scalar loads
    _ws_load_q(q_desc, q_smem, q_bar, b * Sq + m_blk * BLOCK_M, h * D)
    lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, len0, T = _ws_item_tiles(
        rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
    kv_row0 = b * Sk
    kv_col = hk * D
    col_ptr = mask_ptr + mbh * Sk * C
    item_smem = 0  # placeholders (a None cannot travel in the partitions' arguments)
    claim_ptr = 0
    # Two spelled-out calls for one idea (the partitions, with or without consumer warpgroup
    # 1), because triton 3.6's frontend cannot build them once: held in a tuple variable, the
    # constexprs among the arguments reach the partitions as tensors; a list built at compile
    # time (``[wg0] + ([wg1] if NC == 2 else []) + [producer]``) does not compile either (the
    # concatenation rewraps the partitions' entries: "'int' object has no attribute
    # '_flatten_ir'", tried in session 18).
    if NC == 2:
        gl.warp_specialize([
            (_ws_consume_wg0,
             (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
              item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm,
              NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N, NUM_STAGES,
              CAUSAL, C, NI, PINGPONG)),
            (_ws_consume_wg1,
             (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
              item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm,
              NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N, NUM_STAGES,
              CAUSAL, C, NI, PINGPONG)),
            (_ws_produce,
             (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty,
              v_ready, v_empty, item_smem, claim_ptr, col_ring, mask_ptr, rng_ptr, Sq, Sk, Hq,
              Hk, Hm, NQB, NKB, mask_b_stride, n_items, kv_row0, kv_col, col_ptr, lo0, flo0,
              fhi0, hi0, len0, lo1, flo1, fhi1, hi1, T, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
              C)),
        ], [4, 1], [CONSUMER_REGS, 24])  # consumer warpgroup 1, the producer (WS_PRODUCER_REGS)
    else:
        gl.warp_specialize([
            (_ws_consume_wg0,
             (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
              item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm,
              NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N, NUM_STAGES,
              CAUSAL, C, NI, PINGPONG)),
            (_ws_produce,
             (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty,
              v_ready, v_empty, item_smem, claim_ptr, col_ring, mask_ptr, rng_ptr, Sq, Sk, Hq,
              Hk, Hm, NQB, NKB, mask_b_stride, n_items, kv_row0, kv_col, col_ptr, lo0, flo0,
              fhi0, hi0, len0, lo1, flo1, fhi1, hi1, T, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
              C)),
        ], [1], [24])  # the producer (WS_PRODUCER_REGS)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(q_empty)
    mbarrier.invalidate(turn.index(0))
    mbarrier.invalidate(turn.index(1))


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


#: Whether the WS forward's producer stages the mask columns of masked tiles in shared memory
#: (COLS_SMEM; the default, session 14) rather than the consumers loading them after their S
#: wait; ``launch_fwd_gluon(cols_smem=...)`` overrides it.
WS_COLS_SMEM = True


def _uses_cols_smem(warp_spec: bool, c: int, cols_smem: Optional[bool]) -> bool:
    """Whether a launch stages the mask columns in shared memory: the WS kernel on a mask with
    columns, as ``cols_smem`` asks (None: :data:`WS_COLS_SMEM`)."""
    return warp_spec and c > 0 and (WS_COLS_SMEM if cols_smem is None else cols_smem)


def shared_bytes(d: int, block_m: int, block_n: int, num_stages: int, col_words: int = 0) -> int:
    """Shared memory of the kernel's tiles (16-bit): Q plus num_stages K and V tiles (the same
    for the WARP_SPEC kernel, whose K and V rings are separate), plus, COLS_SMEM, num_stages
    slots of ``col_words`` int32 words per key."""
    return 2 * d * (block_m + 2 * num_stages * block_n) + 4 * num_stages * col_words * block_n


#: Shared memory per SM on sm_90 and what the hardware reserves per resident program.
SM_SHARED = 233472
RESERVED_SHARED_PER_PROGRAM = 1024
#: Barriers and padding the WS kernel allocates beyond :func:`shared_bytes` (offline compiles:
#: 380-1400 bytes; a bound).
WS_SHARED_SLACK = 2048


def ws_programs_per_sm(d: int, block_m: int, block_n: int, num_warps: int, num_stages: int,
                       col_words: int = 0) -> int:
    """WS forward programs resident per SM: what the registers allow at :func:`ws_maxnreg`
    (two at 4 consumer warps, one at 8) and the shared memory (tiles plus a slack for the
    barriers, plus the per-program reservation): 2 for the one-warpgroup 64x64 s2 tile at
    D=128; the persistent kernel's default grid is that many per SM."""
    per = shared_bytes(d, block_m, block_n, num_stages, col_words) + WS_SHARED_SLACK
    by_smem = SM_SHARED // (per + RESERVED_SHARED_PER_PROGRAM)
    return max(1, min(_GD.ws_programs_per_sm(num_warps), by_smem))


def check_config(d: int, block_m: int, block_n: int, num_warps: int, num_stages: int,
                 warp_spec: bool = False, pingpong: bool = False,
                 col_words: int = 0) -> None:
    """Raise ValueError on a configuration the kernel cannot compile or launch: one wgmma row
    of 16 queries per warp (block_m == 16 * num_warps), power-of-two tiles, the ring in
    shared memory (<= 227 KB on sm_90); the WARP_SPEC kernel: a :data:`WS_SHAPES` block (one
    or two consumer warpgroups of 64 query rows); PINGPONG needs two of them, PINGPONG and
    PERSISTENT need WARP_SPEC; ``col_words``: the COLS_SMEM ring's words per key (the mask's
    C), counted in the shared memory."""
    if d not in (64, 128, 256):
        raise ValueError(f"gluon fwd: head dim {d} (64, 128 or 256)")
    if block_m != 16 * num_warps:
        raise ValueError(f"gluon fwd: block_m={block_m} must be 16 * num_warps ({num_warps})")
    if warp_spec and (block_m, num_warps) not in WS_SHAPES:
        raise ValueError(f"gluon fwd warp_spec: block_m={block_m}, num_warps={num_warps} "
                         "(128 and 8: two consumer warpgroups of 64 rows, or 64 and 4: one)")
    if pingpong and not warp_spec:
        raise ValueError("gluon fwd: pingpong needs warp_spec")
    if pingpong and num_warps != 8:
        raise ValueError("gluon fwd: pingpong needs two consumer warpgroups (block_m=128, "
                         f"num_warps=8), got num_warps={num_warps}")
    if block_n not in (16, 32, 64, 128, 256):
        raise ValueError(f"gluon fwd: block_n={block_n} (16..256, a power of two)")
    if num_stages < 2:
        raise ValueError(f"gluon fwd: num_stages={num_stages} (>= 2: slot j-1 is released "
                         "during tile j)")
    smem = shared_bytes(d, block_m, block_n, num_stages, col_words)
    if smem > SMEM_LIMIT:
        raise ValueError(f"gluon fwd: {smem} bytes of shared memory > {SMEM_LIMIT}")


@functools.lru_cache(maxsize=None)
def _launch_params(d: int, block_m: int, block_n: int, num_warps: int, num_stages: int,
                   warp_spec: bool, pingpong: bool, col_words: int) -> tuple:
    """:func:`check_config` (raises on a bad configuration, so an error is never cached) and
    the launch's (CONSUMER_REGS, maxnreg): a function of the configuration only, computed
    once per configuration (an ``lru_cache`` hit is no Python call)."""
    check_config(d, block_m, block_n, num_warps, num_stages, warp_spec, pingpong, col_words)
    return ws_consumer_regs(num_warps), ws_maxnreg(num_warps)


class GluonForward:
    """The warp-specialised forward (:func:`_fwd_ws_kernel`) of one call signature, decided
    once: its checks, constexprs, scalars, grid and TMA descriptor templates (a
    :class:`~.launcher.Bound` launch). Calling it with tensors of that signature (q ``[B, Sq,
    Hq, D]``, k/v ``[B, Sk, Hk, D]`` contiguous, a plan of the same mask layout: its ``c``,
    ``ni``, ``hm`` and ``mask_b_stride``) allocates ``(out, lse)`` and launches; a prepared
    call (``triton_backend.PreparedCall``) keeps one per mask layout. ``pingpong``: two
    consumer warpgroups take turns issuing their matmuls; ``cols_smem``: the producer stages
    the masked tiles' columns in shared memory (None: :data:`WS_COLS_SMEM`)."""

    __slots__ = ("bound", "lse_shape")

    def __init__(self, q, k, plan, causal: bool, softmax_scale: float, block_m: int,
                 block_n: int, num_warps: int, num_stages: int, pingpong: bool = False,
                 cols_smem: Optional[bool] = None):
        b, sq, hq, d = q.shape
        _, sk, hk, _ = k.shape
        cols_smem = _uses_cols_smem(True, plan.c, cols_smem)
        consumer_regs, maxnreg = _launch_params(d, block_m, block_n, num_warps, num_stages,
                                                True, pingpong, plan.c if cols_smem else 0)
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"gluon fwd: dtype {q.dtype} (bf16 or fp16)")
        nqb, nkb = cdiv(sq, block_m), cdiv(sk, block_n)
        if plan.c > 0 and (plan.ranges.shape[1] != nqb or plan.summary.shape[1] != nkb):
            raise ValueError("gluon fwd: the plan was built for another tile shape (or by key)")
        # the WS kernel loads Q per consumer warpgroup of 64 rows; K, V per key block
        ql, kl = _smem_layout(64, d, q.dtype), _smem_layout(block_n, d, q.dtype)
        q_desc = Desc(GluonDescriptor, lambda t: t.view(b * sq, hq * d), [64, d], ql)
        kv_view = lambda t: t.view(b * sk, hk * d)  # noqa: E731
        k_desc = Desc(GluonDescriptor, kv_view, [block_n, d], kl)
        v_desc = Desc(GluonDescriptor, kv_view, [block_n, d], kl)
        args = (q_desc, k_desc, v_desc, TENSOR, TENSOR, TENSOR, TENSOR, TENSOR,
                softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb, plan.mask_b_stride,
                nqb * b * hq)
        consts = dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, C=plan.c,
                      NI=plan.ni, NUM_STAGES=num_stages, NUM_WARPS=num_warps,
                      PINGPONG=pingpong, CONSUMER_REGS=consumer_regs, COLS_SMEM=cols_smem,
                      num_warps=4, maxnreg=maxnreg)
        self.bound = Bound(_fwd_ws_kernel, (nqb, b * hq), args, consts)
        self.lse_shape = (b, hq, sq)

    def __call__(self, q, k, v, plan):
        """``(out, lse)`` of these inputs (non-empty, the signature's)."""
        out = torch.empty_like(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self.bound(q, k, v, out, lse, plan.mask, plan.summary, plan.ranges)
        return out, lse


def launch_fwd_gluon(q, k, v, mask, causal, softmax_scale, plan, block_m: int, block_n: int,
                     num_warps: int, num_stages: int, warp_spec: bool = False,
                     pingpong: bool = False, cols_smem: Optional[bool] = None):
    """(out, lse) like ``tl_kernels.launch_fwd``, one call (:class:`GluonForward` is the
    prepared form); ``plan`` must come from ``make_plan(mask, causal, Sq, Sk, block_m,
    block_n, by_key=False, device)``. ``mask`` is unused (the plan holds it), as in
    ``_launch_fwd``. ``warp_spec`` must be True: the warp-specialised kernel
    (:func:`_fwd_ws_kernel`: a TMA producer warp, separate K and V rings, one consumer
    warpgroup of 64 rows per 4 of ``num_warps``)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    if not warp_spec:  # the one-partition Gluon forward measured 0.87-0.95x tl and was deleted
        raise ValueError("gluon fwd: only the warp-specialised kernel exists (warp_spec=True)")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, sq, hq, _ = q.shape
    if sq == 0 or k.shape[1] == 0:
        return (torch.zeros_like(q),
                torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device))
    run = GluonForward(q, k, plan, causal, softmax_scale, block_m, block_n, num_warps,
                       num_stages, pingpong, cols_smem)
    out = torch.empty_like(q)
    lse = torch.empty(run.lse_shape, dtype=torch.float32, device=q.device)
    run.bound.once(q, k, v, out, lse, plan.mask, plan.summary, plan.ranges)
    return out, lse


# ---------------------------------------------------------------------------------------------
