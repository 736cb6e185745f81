"""Gluon (``triton.experimental.gluon``) forward kernels for Hopper (sm_90): a plain one
(``_fwd_gluon_kernel``, opt-in through ``FLASHMASK3_TRITON_FWD=gluon``, slower than tl) and a
warp-specialised one (``_fwd_ws_kernel``, session 13: a TMA producer warp, separate K and V
rings, two consumer warpgroups of 64 query rows, optional ping-pong and a PERSISTENT mode;
session 14: the producer stages the masked tiles' mask columns in shared memory; session 16:
one consumer warpgroup at 64x64, two programs per SM, for masks whose rows see few keys), the
library's default forward where ``triton_flashmask.GLUON_FWD_DIMS`` lists the head dim
(D=128: every layout, 1.00-1.20x the tl forward at 32K; D=256: 1.13-1.26x),
``triton_flashmask._fwd_impl`` choosing (the one-warpgroup tile through
``triton_flashmask.SHORT_ROWS_FWD``). The rest of this docstring
describes the plain kernel, whose per-tile schedule the WS consumers share; the WS section
below says what it changes.

What it computes: what the ``tl`` ``_fwd_kernel`` computes, O ``[B, Sq, Hq, D]`` and the LSE
``[B, Hq, Sq]`` (natural log, ``-inf`` on fully masked rows, whose O is 0), from the same
:class:`~flashmask3.kernels.tiles.Plan` (built by query block for the same
``block_m``/``block_n``), on the same grid (one program per (query block, batch * query head),
the causal kernel's heavy late query blocks first), visiting the same tiles: per live range a
masked loop [lo, flo), a mask-free loop [flo, fhi) compiled without mask code and a masked loop
[fhi, hi); tiles outside the ranges are never loaded.

Why: benchmarks/NOTES.md ("What limits it"): the ``tl`` forward reaches ~0.65 of the matmul
peak because Triton's pipeliner does not overlap the softmax of one tile with the matmuls of the
next; its SASS waits for every wgmma (``WARPGROUP.DEPBAR.LE gsb0, 0x0``). Here the schedule is
written out (FA3's intra-warpgroup overlap), per key tile j::

    issue S_j = Q K_jᵀ                 (async)
    O *= alpha_{j-1}                   (registers, while S_j runs on the tensor cores)
    issue O += P_{j-1} V_{j-1}         (async, P_{j-1} a register A operand)
    wait for S_j only                  (num_outstanding=1: the PV matmul keeps running)
    mask + online softmax of S_j       -> P_j, row max m_j, alpha_j = exp2(m_{j-1} - m_j), l_j
    wait for O, CTA barrier, refill K/V slot j-1 with tile j-1+NUM_STAGES

and after the last tile one more O *= alpha, O += P_last V_last. The first tile of a program
issues its "previous" PV with P = 0 against its own (already landed) V tile, which adds exact
zeros: one loop body for every tile (no peeled first tile per loop variant) at the cost of one
extra wgmma per program.

Layout: Q (one TMA load) in shared memory, the A operand of S (no registers); K and V tiles go
through a NUM_STAGES-deep ring of shared-memory slots, one mbarrier per slot (expect-tx of both
tiles, parity = (tile counter // NUM_STAGES) & 1). The tile counter runs over both live ranges
of the program, so the prologue's loads and every refill cross the boundary between the
ranges and between the three loops. S and O accumulate in registers in the wgmma layout with
warps along the query rows: BLOCK_M == 16 * num_warps (128x128 w8 = two warpgroups of 64 rows).

Numerics against ``tl``: the same scores (``S * scale_log2``), the same masked-row guard (row
max -inf -> 0 before exp2), the same rescale-then-accumulate order (``O_j = alpha_j O_{j-1} +
P_j V_j``), the same final normalisation and LSE formula (natural log, -inf on empty rows).
Where the wgmma k-steps match the ``tl`` kernel's (the same tile shape, 128x128) O came out
bitwise equal to tl's on the H200 (first run, where the rescale came after the accumulate);
other tile shapes (e.g. 128x64) sum the key blocks in other groupings and differ by bf16
output rounding (max |dO| 2e-3..8e-3 on unit-variance inputs, benchmarks/gluon_fwd_ab.py).
An input V holding inf/NaN would also reach the first tile's zero-P product (0 * inf = NaN)
where ``tl`` never multiplies it.

Measured (H200, 32K, D=128, bf16, benchmarks/results/gluon_fwd_ab.md): correct on every
small case, but SLOWER than the tl forward: 128x128 w8 s3 0.87-0.95x (causal 67.9 vs 64.2 ms),
64x64 w4 s3 (two CTAs per SM) 0.88-0.95x, 128x64 w8 s3 0.88-0.89x, two-stage rings 0.69-0.86x.
The stage count matters most (s2 -> s3: +15-30%), so the K/V loads land late: a slot is only
refilled after the PV that reads its V retired, one tile before the tile that needs it. Not
done (next steps): separate K and V rings (K released right after S_j's wait, so its refill
is issued a tile earlier), a 1-warp TMA producer (gl.warp_specialize) and decoupling the two
warpgroups of the 8-warp CTA (the per-tile CTA barrier keeps them in lockstep, so both do
their softmax while the tensor cores idle: FA3's ping-pong needs them half a tile apart).

The module imports on a CPU-only machine and without gluon (the kernel compiles on first launch
or in :func:`compile_report`); :func:`unavailable_reason` says why it cannot be used.
Offline sm_90 report: ``python -m flashmask3.kernels.gluon_fwd``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from . import gluon_common as _GD
from .gluon_common import (_gl_dtype, _jit, _load_stats, _needs_mask,  # noqa: F401
                           _published_item, _query_block_ranges, _smem_layout, gl,
                           unavailable_reason)
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
# Device code: query-major twins of the key-major helpers of gluon_dkdv
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
    ``gluon_dkdv._column_intervals`` + ``_element_masked`` (the ``tl`` ``_column_intervals``
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
def _issue_kv(k_desc, v_desc, k_ring, v_ring, ready, t, T, lo0, len0, lo1, kv_row0, kv_col,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads of the K and V tiles of the program's tile ``t`` (counted over both live
    ranges: key block lo0 + t, or lo1 + t - len0 in the second range) into ring slot
    t % NUM_STAGES; skipped when t >= T (past the program's last tile)."""
    n = lo0 + t + (t >= len0).to(gl.int32) * (lo1 - lo0 - len0)
    slot = t % NUM_STAGES
    bar = ready.index(slot)
    pred = t < T
    row = kv_row0 + n * BLOCK_N
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, kv_col], bar, k_ring.index(slot), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, kv_col], bar, v_ring.index(slot), pred=pred)


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
def _tile(acc, m_i, l_i, p_prev, alpha, t, n, T, q_smem, k_ring, v_ring, ready, k_desc, v_desc, lo0,
          len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh, m_blk, Sq, Sk, NKB,
          scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr, a_layout: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
          CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr, MASKED: gl.constexpr):
    """Key tile ``t`` (key block ``n``) of the program: S_t issued, O rescaled by the
    previous tile's ``alpha`` while S_t runs, the previous tile's PV issued, softmax of S_t
    under the PV (see the module docstring). ``p_prev`` is P_{t-1} (zeros for t == 0,
    multiplied with tile 0's own V: exact zeros). Returns (acc, m, l, P_t, alpha_t, t + 1);
    P_t's PV (after O *= alpha_t) is issued by the next tile or the epilogue."""
    dtype: gl.constexpr = q_smem.dtype
    slot = t % NUM_STAGES
    pv_t = gl.maximum(t - 1, 0)
    pv_slot = pv_t % NUM_STAGES
    mbarrier.wait(ready.index(slot), (t // NUM_STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    o_tok = warpgroup_mma(p_prev, v_ring.index(pv_slot), acc, is_async=True)
    if MASKED:  # scalar loads under the matmuls
        stats = _load_stats(sum_ptr, mbh, n, NKB, NI)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    qk = s * scale_log2
    if MASKED:
        if _needs_mask(m_blk, n, Sq, Sk, stats, BLOCK_M, BLOCK_N, CAUSAL, NI):
            qk = _mask_scores(qk, rows, n * BLOCK_N + offs_nb, col_ptr, 0, Sq, Sk, CAUSAL, C)
    p, alpha, m_i, l_i = _softmax_update(qk, m_i, l_i, MASKED)
    p16 = gl.convert_layout(p.to(dtype), a_layout)
    acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
    gl.thread_barrier()  # every warpgroup's PV_{t-1} has read slot pv_slot
    _issue_kv(k_desc, v_desc, k_ring, v_ring, ready, pv_t + NUM_STAGES, T * (t > 0).to(gl.int32),
              lo0, len0, lo1, kv_row0, kv_col, BLOCK_N, NUM_STAGES)
    return acc, m_i, l_i, p16, alpha, t + 1


@_jit
def _loop(acc, m_i, l_i, p_prev, alpha, t, lo, hi, T, q_smem, k_ring, v_ring, ready, k_desc, v_desc,
          lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh, m_blk, Sq, Sk,
          NKB, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
          a_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
          MASKED: gl.constexpr):
    """Key blocks [lo, hi) in order, one :func:`_tile` each (MASKED: with mask code)."""
    for n in range(lo, hi):
        acc, m_i, l_i, p_prev, alpha, t = _tile(
            acc, m_i, l_i, p_prev, alpha, t, n, T, q_smem, k_ring, v_ring, ready, k_desc, v_desc,
            lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh, m_blk, Sq, Sk,
            NKB,
            scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C,
            NI, MASKED)
    return acc, m_i, l_i, p_prev, alpha, t


@_jit
def _range(acc, m_i, l_i, p_prev, alpha, t, lo, flo, fhi, hi, T, q_smem, k_ring, v_ring, ready,
           k_desc, v_desc, lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh,
           m_blk,
           Sq, Sk, NKB, scale_log2, s_layout: gl.constexpr, o_layout: gl.constexpr,
           a_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr):
    """One live range [lo, hi): masked [lo, flo), mask-free [flo, fhi), masked [fhi, hi)
    (flo, fhi clamped into the range, so exactly ``hi - lo`` tiles in order)."""
    flo, fhi = _mask_free_span(lo, flo, fhi, hi)
    acc, m_i, l_i, p_prev, alpha, t = _loop(
        acc, m_i, l_i, p_prev, alpha, t, lo, flo, T, q_smem, k_ring, v_ring, ready, k_desc, v_desc,
        lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh, m_blk, Sq, Sk, NKB,
        scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI,
        True)
    acc, m_i, l_i, p_prev, alpha, t = _loop(
        acc, m_i, l_i, p_prev, alpha, t, flo, fhi, T, q_smem, k_ring, v_ring, ready, k_desc, v_desc,
        lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh, m_blk, Sq, Sk,
        NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C,
        NI, False)
    acc, m_i, l_i, p_prev, alpha, t = _loop(
        acc, m_i, l_i, p_prev, alpha, t, fhi, hi, T, q_smem, k_ring, v_ring, ready, k_desc, v_desc,
        lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh, m_blk, Sq, Sk,
        NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C,
        NI, True)
    return acc, m_i, l_i, p_prev, alpha, t


@_jit
def _store_outputs(acc, m_i, l_i, o_ptr, lse_ptr, b64, h, m_blk, Sq, Hq,
                   s_layout: gl.constexpr, o_layout: gl.constexpr, D: gl.constexpr,
                   BLOCK_M: gl.constexpr):
    """O and LSE of query block ``m_blk`` (:func:`_store_rows`)."""
    _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, b64, h, m_blk * BLOCK_M, Sq, Hq, s_layout,
                o_layout, D, BLOCK_M)


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


@_jit(do_not_specialize=_NO_SPEC)
def _fwd_gluon_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, mask_ptr, sum_ptr, rng_ptr,
                      scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
                      D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                      NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """One program per (query block, batch * query head): O and LSE of BLOCK_M query rows
    (grid and program order of the ``tl`` ``_fwd_kernel``)."""
    gl.static_assert(BLOCK_M == 16 * NUM_WARPS, "wgmma M: 16 rows per warp, warps along rows")
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    pid = gl.program_id(0)
    if CAUSAL:
        m_blk = NQB - 1 - pid  # heavy (late) query blocks first
    else:
        m_blk = pid
    bh = gl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hk)
    hm = h // (Hq // Hm)
    b64 = b.to(gl.int64)
    mbh = b64 * mask_b_stride + hm
    col_ptr = mask_ptr + mbh * Sk * C

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b * Sq + m_blk * BLOCK_M, h * D], q_bar, q_smem)

    lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1 = _query_block_ranges(
        rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
    len0 = gl.maximum(hi0 - lo0, 0)
    T = len0 + gl.maximum(hi1 - lo1, 0)
    kv_row0 = b * Sk
    kv_col = hk * D
    t = lo0 * 0  # tile counter over both ranges: tile t in slot t % NUM_STAGES
    for j in gl.static_range(NUM_STAGES):
        _issue_kv(k_desc, v_desc, k_ring, v_ring, ready, t + j, T, lo0, len0, lo1, kv_row0,
                  kv_col, BLOCK_N, NUM_STAGES)

    rows = m_blk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_nb = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    p_prev = gl.zeros([BLOCK_M, BLOCK_N], dtype, a_layout)
    alpha = gl.full([BLOCK_M], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i, p_prev, alpha, t = _range(
        acc, m_i, l_i, p_prev, alpha, t, lo0, flo0, fhi0, hi0, T, q_smem, k_ring, v_ring, ready,
        k_desc, v_desc, lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh,
        m_blk, Sq,
        Sk, NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
        C, NI)
    acc, m_i, l_i, p_prev, alpha, t = _range(
        acc, m_i, l_i, p_prev, alpha, t, lo1, flo1, fhi1, hi1, T, q_smem, k_ring, v_ring, ready,
        k_desc, v_desc, lo0, len0, lo1, kv_row0, kv_col, rows, offs_nb, sum_ptr, col_ptr, mbh,
        m_blk, Sq,
        Sk, NKB, scale_log2, s_layout, o_layout, a_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
        C, NI)
    if T > 0:  # the last tile's rescale and PV
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o_tok = warpgroup_mma(p_prev, v_ring.index((T - 1) % NUM_STAGES), acc, is_async=True)
        acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_prev))
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(q_bar)
    _store_outputs(acc, m_i, l_i, o_ptr, lse_ptr, b64, h, m_blk, Sq, Hq, s_layout, o_layout, D,
                   BLOCK_M)


# ---------------------------------------------------------------------------------------------
# Warp-specialised forward (WARP_SPEC): a TMA producer warp and one or two consumer warpgroups
# ---------------------------------------------------------------------------------------------
#
# What the plain kernel's measurement (session 7) named, changed: (1) K and V share one ring
# slot there, freed only after the PV that reads V, a tile before it is needed; here they have
# separate rings and K_t's slot is freed as soon as S_t has been waited for. (2) Loads were
# issued by the compute warps; here a 1-warp producer partition issues every TMA load. (3) The
# two warpgroups met at a CTA barrier per tile; here each is its own partition (64 query rows,
# 240 registers: maxnreg 168 over 12 warp slots, the producer's warpgroup at 24) and they meet
# only through the ring's barriers, or, PINGPONG, through a pair of mbarriers that make them
# take turns issuing their matmuls (FA3's ping-pong). Measured (H200, 32K, NOTES.md session 13):
# D=128 128x128 s2 without ping-pong 1.04-1.12x tl on causal, full and non-causal C=2 masks,
# 0.90-1.05x on the causal C=1 ones (short documents 0.90); ping-pong 0.93-1.04x of without
# at D=128; D=256 128x64 s2 with ping-pong 1.15-1.26x. (4) Session 14, COLS_SMEM: the consumers
# had loaded a masked tile's mask columns from global memory after their S wait (an L2 round
# trip per PARTIAL tile, which tl's pipeliner issues stages ahead); the producer now stages them
# in a shared-memory ring next to the K slot: the causal C=1 masks 0.90-1.05x -> 1.00-1.20x, no
# spill left in any tile loop. PERSISTENT: one program per SM, the producer claiming blocks from
# a global counter in the grid's order (session 14: 0.88-1.10x, opt-in); a static walk (program
# p took blocks p, p + P, ...) lost in session 13: 0.80-0.96x (D=128), 0.94-1.08x (D=256), as it
# did in the backward (session 12): the blocks in flight drift apart over heads. (5) Session
# 16, one consumer warpgroup (BLOCK_M 64, 4 consumer warps, maxnreg 128 over 8 warp slots, the
# consumer at 232): at 64x64 s2 (83 KB) two programs share an SM, so one's prologue and O store
# run under the other's tiles. On causal short documents (~9 live 128x128 tiles per block)
# 1.11-1.14x the two-warpgroup kernel in the A/B, 1.23x in the kernel table's run; 0.86-0.89x
# on longer documents (results/gluon_fwd_1c_ab.md). Persistent (two programs per SM) 1.03x of
# it on short documents, opt-in.


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
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(slot),
                                        k_ring.index(slot))
        if COLS:
            f_lo = flo0 + second * (flo1 - flo0)
            f_hi = fhi0 + second * (fhi1 - fhi0)
            if (n < f_lo) | (n >= f_hi):
                _ws_produce_columns(col_ring, slot, col_ptr, n, Sk, BLOCK_N, C)
                gl.thread_barrier()  # every lane's stores before the (one-thread) arrive
            mbarrier.arrive(k_ready.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(slot),
                                        v_ring.index(slot))
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
        tma.async_copy_global_to_shared(q_desc, [q_row + wg * WG_M, q_col], q_bar,
                                        q_smem.index(wg))


@_jit
def _ws_produce(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty,
                v_ready, v_empty, item_smem, next_item_ptr, col_ring, mask_ptr, rng_ptr, Sq, Sk,
                Hq, Hk, Hm, NQB, NKB, mask_b_stride, n_items, kv_row0, kv_col, col_ptr, lo0,
                flo0, fhi0, hi0, len0, lo1, flo1, fhi1, hi1, T, D: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, C: gl.constexpr, PERSISTENT: gl.constexpr):
    """Producer partition (1 warp). One-block kernel: the block's key tiles (``kv_row0`` ..
    ``T`` from the kernel body, which loaded Q before the partitions forked); PERSISTENT:
    :func:`_ws_produce_persistent` (those arguments unused; ``item_smem`` and
    ``next_item_ptr`` are placeholders in the one-block kernel). ``col_ring``: the column
    ring (COLS_SMEM) or 0."""
    if PERSISTENT:
        _ws_produce_persistent(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty,
                               k_ready, k_empty, v_ready, v_empty, item_smem, next_item_ptr,
                               col_ring, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm, NQB, NKB,
                               mask_b_stride, n_items, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
                               C)
    else:
        _ws_produce_tiles(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                          col_ring, lo0 * 0, kv_row0, kv_col, col_ptr, Sk, lo0, flo0, fhi0,
                          hi0, len0, lo1, flo1, fhi1, hi1, T, BLOCK_N, NUM_STAGES, C)


@_jit
def _ws_produce_persistent(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty,
                           k_ready, k_empty, v_ready, v_empty, item_smem, next_item_ptr,
                           col_ring, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm, NQB, NKB,
                           mask_b_stride, n_items, D: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                           C: gl.constexpr):
    """Producer partition of the PERSISTENT kernel: claims work items from the global counter
    at ``next_item_ptr`` (zeroed by the launcher: items go out in the non-persistent grid's
    order to whichever program is free, so the blocks in flight stay as close together as
    that grid's and share their K/V rows in L2). The next item is claimed and its live ranges
    loaded as soon as this block's loads are issued, under the consumers' last tiles; once
    every consumer released Q (``q_empty``, after its last S wait) it is published in
    ``item_smem`` and its Q loads on ``q_bar``, then its key tiles; the ring counter runs on
    across items. An item >= n_items is published with a plain arrive on ``q_bar``: the
    consumers' signal to stop."""
    st_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    t = n_items * 0
    k = n_items * 0
    item = gl.atomic_add(next_item_ptr, 1)
    while item < n_items:
        m_blk, b, h, hk, b64, mbh = _ws_item(item, NQB, Hq, Hk, Hm, mask_b_stride, CAUSAL)
        lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, len0, T = _ws_item_tiles(
            rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
        mbarrier.wait(q_empty, (k & 1) ^ 1)
        item_smem.store(gl.full([1], item, gl.int32, st_layout))
        gl.thread_barrier()  # every lane's store before the (one-thread) expect-arrive below
        _ws_load_q(q_desc, q_smem, q_bar, b * Sq + m_blk * BLOCK_M, h * D)
        t = _ws_produce_tiles(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready,
                              v_empty, col_ring, t, b * Sk, hk * D, mask_ptr + mbh * Sk * C, Sk,
                              lo0, flo0, fhi0, hi0, len0, lo1, flo1, fhi1, hi1, T, BLOCK_N,
                              NUM_STAGES, C)
        item = gl.atomic_add(next_item_ptr, 1)
        k += 1
    mbarrier.wait(q_empty, (k & 1) ^ 1)
    item_smem.store(gl.full([1], item, gl.int32, st_layout))
    gl.thread_barrier()
    mbarrier.arrive(q_bar)


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
                      PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr):
    """Consumer warpgroup ``WG``'s share of one block: O and LSE of query rows
    [m_blk * BLOCK_M + WG * 64, + 64) over the block's live ranges, from ring tile ``t`` and
    ping-pong turn ``u`` on; PERSISTENT: hands Q back (``q_empty``) after its last S wait.
    Returns (t, u) after the block."""
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
    if PERSISTENT:  # every S of the block waited for: the producer may load the next Q
        mbarrier.arrive(q_empty)
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
                PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr):
    """Consumer partition ``WG`` (one warpgroup): its 64 rows of the program's block
    (``n_items``, ``item_smem`` unused; ``col_ring`` the column ring or 0), or, PERSISTENT,
    of every work item the producer claims for the program (each published in ``item_smem``
    with its Q on ``q_bar``; an item >= n_items ends the loop), the ring counter and the
    ping-pong turns running on across items."""
    pid = gl.program_id(0)
    if PERSISTENT:
        t = pid * 0
        u = pid * 0
        k = pid * 0
        mbarrier.wait(q_bar, 0)
        item = _published_item(item_smem, 4)
        while item < n_items:
            m_blk, b, h, hk, b64, mbh = _ws_item(item, NQB, Hq, Hk, Hm, mask_b_stride, CAUSAL)
            lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, len0, T = _ws_item_tiles(
                rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
            t, u = _ws_consume_block(
                WG, t, u, q_smem, k_ring, v_ring, q_bar, k & 1, q_empty, k_ready, k_empty,
                v_ready, v_empty, turn, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, b64, h, mbh,
                m_blk,
                Sq, Sk, Hq, NKB, scale_log2, lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, T, D,
                BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI, PINGPONG, True)
            k += 1
            mbarrier.wait(q_bar, k & 1)
            item = _published_item(item_smem, 4)
    else:
        m_blk, b, h, hk, b64, mbh = _ws_item(pid + gl.program_id(1) * NQB, NQB, Hq, Hk, Hm,
                                             mask_b_stride, CAUSAL)
        lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, len0, T = _ws_item_tiles(
            rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
        _ws_consume_block(WG, pid * 0, pid * 0, q_smem, k_ring, v_ring, q_bar, 0, q_empty,
                          k_ready, k_empty, v_ready, v_empty, turn, col_ring, o_ptr, lse_ptr,
                          sum_ptr, mask_ptr, b64, h, mbh, m_blk, Sq, Sk, Hq, NKB, scale_log2, lo0,
                          flo0, fhi0, hi0, lo1, flo1, fhi1, hi1, T, D, BLOCK_M, BLOCK_N, NUM_STAGES,
                          CAUSAL, C, NI, PINGPONG, False)


@_jit
def _ws_consume_wg0(q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                    turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk,
                    Hq, Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                    PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr):
    """Consumer warpgroup 0 (the default partition; the warpgroup index must be a literal:
    warp_specialize passes its arguments as values)."""
    _ws_consume(0, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq,
                Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N,
                NUM_STAGES, CAUSAL, C, NI, PINGPONG, PERSISTENT)


@_jit
def _ws_consume_wg1(q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                    turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk,
                    Hq, Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                    PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr):
    """Consumer warpgroup 1 (a 4-warp worker partition)."""
    _ws_consume(1, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                turn, item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq,
                Hk, Hm, NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N,
                NUM_STAGES, CAUSAL, C, NI, PINGPONG, PERSISTENT)


#: WARP_SPEC forward: the producer warp's registers (the dK/dV kernel's).
WS_PRODUCER_REGS = _GD.PRODUCER_REGS
#: WARP_SPEC forward tiles, (block_m, num_warps): two consumer warpgroups of 64 query rows
#: (one program per SM: 12 warp slots), or one (session 16: two programs per SM where the
#: ring fits twice in shared memory, for blocks with few live tiles).
WS_SHAPES = ((128, 8), (64, 4))


def ws_maxnreg(num_warps: int = 8) -> int:
    """The WARP_SPEC forward's ``maxnreg`` for ``num_warps`` consumer warps: the dK/dV
    kernel's rule (:func:`gluon_dkdv.ws_maxnreg`: the consumers plus the producer's warpgroup
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
                   next_item_ptr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr,
                   NI: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                   PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   PERSISTENT: gl.constexpr, COLS_SMEM: gl.constexpr):
    """The WARP_SPEC forward: one program per (query block of BLOCK_M rows, batch * query
    head), same grid, program order, plan and tiles as :func:`_fwd_gluon_kernel`; PERSISTENT:
    a 1-D grid of programs that claim the ``n_items`` = NQB * B * Hq blocks, in that order, from
    the int32 counter at ``next_item_ptr`` (zeroed per launch; None without PERSISTENT).
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

    if PERSISTENT:  # (the producer claims the items; these are placeholders)
        # the claimed work item, from the producer to the consumers
        item_smem = gl.allocate_shared_memory(gl.int32, [1],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        claim_ptr = next_item_ptr
        kv_row0 = n_items * 0
        kv_col = kv_row0
        col_ptr = mask_ptr
        lo0 = kv_row0
        flo0 = kv_row0
        fhi0 = kv_row0
        hi0 = kv_row0
        len0 = kv_row0
        lo1 = kv_row0
        flo1 = kv_row0
        fhi1 = kv_row0
        hi1 = kv_row0
        T = kv_row0
    else:
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
    # (the consumers' argument lists are spelled out: held in a tuple variable, the
    # constexprs among them reach the partitions as tensors in triton 3.6)
    if NC == 2:
        gl.warp_specialize([
            (_ws_consume_wg0,
             (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
              item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm,
              NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N, NUM_STAGES,
              CAUSAL, C, NI, PINGPONG, PERSISTENT)),
            (_ws_consume_wg1,
             (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
              item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm,
              NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N, NUM_STAGES,
              CAUSAL, C, NI, PINGPONG, PERSISTENT)),
            (_ws_produce,
             (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty,
              v_ready, v_empty, item_smem, claim_ptr, col_ring, mask_ptr, rng_ptr, Sq, Sk, Hq,
              Hk, Hm, NQB, NKB, mask_b_stride, n_items, kv_row0, kv_col, col_ptr, lo0, flo0,
              fhi0, hi0, len0, lo1, flo1, fhi1, hi1, T, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
              C, PERSISTENT)),
        ], [4, 1], [CONSUMER_REGS, 24])  # consumer warpgroup 1, the producer (WS_PRODUCER_REGS)
    else:
        gl.warp_specialize([
            (_ws_consume_wg0,
             (q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
              item_smem, col_ring, o_ptr, lse_ptr, sum_ptr, mask_ptr, rng_ptr, Sq, Sk, Hq, Hk, Hm,
              NQB, NKB, mask_b_stride, scale_log2, n_items, D, BLOCK_M, BLOCK_N, NUM_STAGES,
              CAUSAL, C, NI, PINGPONG, PERSISTENT)),
            (_ws_produce,
             (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, q_empty, k_ready, k_empty,
              v_ready, v_empty, item_smem, claim_ptr, col_ring, mask_ptr, rng_ptr, Sq, Sk, Hq,
              Hk, Hm, NQB, NKB, mask_b_stride, n_items, kv_row0, kv_col, col_ptr, lo0, flo0,
              fhi0, hi0, len0, lo1, flo1, fhi1, hi1, T, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
              C, PERSISTENT)),
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
                 persistent: bool = False, col_words: int = 0) -> None:
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
    if persistent and not warp_spec:
        raise ValueError("gluon fwd: persistent needs warp_spec")
    if block_n not in (16, 32, 64, 128, 256):
        raise ValueError(f"gluon fwd: block_n={block_n} (16..256, a power of two)")
    if num_stages < 2:
        raise ValueError(f"gluon fwd: num_stages={num_stages} (>= 2: slot j-1 is released "
                         "during tile j)")
    smem = shared_bytes(d, block_m, block_n, num_stages, col_words)
    if smem > SMEM_LIMIT:
        raise ValueError(f"gluon fwd: {smem} bytes of shared memory > {SMEM_LIMIT}")


def _descriptors(q, k, v, q_rows: int, block_n: int):
    """TMA descriptors of Q ``[B*Sq, Hq*D]`` (block [q_rows, D]) and K, V ``[B*Sk, Hk*D]``
    (block [block_n, D]), NVMMA-swizzled for the wgmma."""
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    ql, kl = _smem_layout(q_rows, d, q.dtype), _smem_layout(block_n, d, q.dtype)
    q_desc = GluonDescriptor.from_tensor(q.view(b * sq, hq * d), [q_rows, d], ql)
    k_desc = GluonDescriptor.from_tensor(k.view(b * sk, hk * d), [block_n, d], kl)
    v_desc = GluonDescriptor.from_tensor(v.view(b * sk, hk * d), [block_n, d], kl)
    return q_desc, k_desc, v_desc


def launch_fwd_gluon(q, k, v, mask, causal, softmax_scale, plan, block_m: int, block_n: int,
                     num_warps: int, num_stages: int, warp_spec: bool = False,
                     pingpong: bool = False, persistent: bool = False,
                     programs: Optional[int] = None, cols_smem: Optional[bool] = None):
    """(out, lse) like ``tl_kernels.launch_fwd``; ``plan`` must come from
    ``make_plan(mask, causal, Sq, Sk, block_m, block_n, by_key=False, device)``. ``mask`` is
    unused (the plan holds it), as in ``_launch_fwd``. ``warp_spec``: the warp-specialised
    kernel (:func:`_fwd_ws_kernel`: a TMA producer warp, separate K and V rings, one consumer
    warpgroup of 64 rows per 4 of ``num_warps``; ``pingpong`` makes two take turns issuing
    their matmuls;
    ``persistent``: as many programs as fit on the GPU at once (:func:`ws_programs_per_sm`
    per SM), or ``programs``, each claiming query blocks, in the
    non-persistent grid's order, from a counter zeroed per launch; the next block's Q and key
    tiles load under the previous block's last PV and O store; ``cols_smem``: the producer
    stages the masked tiles' columns in shared memory, None: :data:`WS_COLS_SMEM`)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    cols_smem = _uses_cols_smem(warp_spec, plan.c, cols_smem)
    check_config(d, block_m, block_n, num_warps, num_stages, warp_spec, pingpong, persistent,
                 plan.c if cols_smem else 0)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gluon fwd: dtype {q.dtype} (bf16 or fp16)")
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    if sq == 0 or sk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    nqb, nkb = triton.cdiv(sq, block_m), triton.cdiv(sk, block_n)
    if plan.c > 0 and (plan.ranges.shape[1] != nqb or plan.summary.shape[1] != nkb):
        raise ValueError("gluon fwd: the plan was built for another tile shape (or by key)")
    q_rows = 64 if warp_spec else block_m  # the WS kernel loads Q per consumer warpgroup
    q_desc, k_desc, v_desc = _descriptors(q, k, v, q_rows, block_n)
    args = (q_desc, k_desc, v_desc, out, lse, plan.mask, plan.summary, plan.ranges,
            softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb, plan.mask_b_stride)
    consts = dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, C=plan.c, NI=plan.ni,
                  NUM_STAGES=num_stages, NUM_WARPS=num_warps)
    if warp_spec:
        n_items = nqb * b * hq
        next_item = None
        if persistent:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            resident = ws_programs_per_sm(d, block_m, block_n, num_warps, num_stages,
                                          plan.c if cols_smem else 0)
            grid = (max(1, min(n_items, programs or sms * resident)), )
            next_item = torch.zeros(1, dtype=torch.int32, device=q.device)
        else:
            grid = (nqb, b * hq)
        _fwd_ws_kernel[grid](*args, n_items, next_item, **consts, PINGPONG=pingpong,
                             CONSUMER_REGS=ws_consumer_regs(num_warps), PERSISTENT=persistent,
                             COLS_SMEM=cols_smem, num_warps=4, maxnreg=ws_maxnreg(num_warps))
    else:
        _fwd_gluon_kernel[(nqb, b * hq)](*args, **consts, num_warps=num_warps)
    return out, lse


# ---------------------------------------------------------------------------------------------
