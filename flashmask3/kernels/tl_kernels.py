"""The portable ``tl`` (Triton language) kernels and their launchers.

Forward, dK/dV and dQ attention kernels over the live ranges of :mod:`.tiles`, plus the two
small passes every backward runs: the delta pre-pass (``rowsum(dO * O) - dlse`` and the base-2
LSE) and the dQ scale of the fused backward. They run on every GPU Triton supports (and on CPU
tensors under ``TRITON_INTERPRET=1``); on Hopper the streamed tiles are read through TMA
descriptors. Which kernel runs at which tile is decided in :mod:`.dispatch`, not here.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

from .launcher import TENSOR, cached_bound, cdiv, descriptor, launch
from .tiles import (LOG2E, NSTAT, PARTIAL, RANGE_WORDS, SKIP, UNMASKED, _NO_SPEC,  # noqa: F401
                    Config, Plan, _classify_rule, _clipped_tile_class, _column_intervals,
                    _element_masked, _key_block_ranges, _load_stats, _query_block_ranges,
                    _stored_ranges, _tile_class, _unmasked, _unmasked_run, _kv_tile,
                    _classes_along)

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


@triton.jit
def _query_block_program(NQB, Hq, Hk, Hm, CAUSAL: tl.constexpr):
    """This program's query block and heads on the (query block, batch*query head) grid of the
    forward and dQ kernels: ``(m_blk, b, h, hk, hm, b64)``. Causal masks run the heavy (late)
    query blocks first."""
    pid = tl.program_id(0)
    if CAUSAL:
        m_blk = NQB - 1 - pid
    else:
        m_blk = pid
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    return m_blk, b, h, h // (Hq // Hk), h // (Hq // Hm), b.to(tl.int64)


@triton.jit
def _mask_head(mask_ptr, sum_ptr, b64, hm, mask_b_stride, Sk, NKB, C: tl.constexpr):
    """``(mbh, sptr, col_ptr)`` of mask head ``hm`` of batch ``b64``: its row in the plan's
    range table, its block summaries and its ``C`` column vectors."""
    mbh = b64 * mask_b_stride + hm
    return mbh, sum_ptr + mbh * NKB * 8, mask_ptr + mbh * Sk * C


@triton.jit(do_not_specialize=_NO_SPEC)
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, mask_ptr, sum_ptr, rng_ptr,
                k_desc, v_desc, q_desc,
                scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                USE_TMA: tl.constexpr, PREC: tl.constexpr, A_SMEM: tl.constexpr,
                SPLIT_UNMASKED: tl.constexpr):
    """One program per (query block, batch*query head): O and LSE of BLOCK_M query rows."""
    m_blk, b, h, hk, hm, b64 = _query_block_program(NQB, Hq, Hk, Hm, CAUSAL)
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_off = (b64 * Sq + offs_m)[:, None] * (Hq * D) + h * D + offs_d[None, :]
    if USE_TMA and A_SMEM:  # Q stays in shared memory as the wgmma A operand (saves registers)
        q = q_desc.load([b * Sq + m_blk * BLOCK_M, h * D])
    else:
        q = tl.load(q_ptr + q_off, mask=(offs_m < Sq)[:, None], other=0.0)

    mbh, sptr, col_ptr = _mask_head(mask_ptr, sum_ptr, b64, hm, mask_b_stride, Sk, NKB, C)
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


@triton.jit(do_not_specialize=["Sq", "Hq", "Sq_pad"])
def _bwd_pre_kernel(o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, lse2_ptr, dq_ptr, Sq, Hq,
                    Sq_pad, D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
                    ZERO_DQ: tl.constexpr):
    """delta = rowsum(dO * O) - dlse and lse2 = lse * log2(e) (+inf on fully masked rows);
    with ``ZERO_DQ`` also zeroes this block's rows of the fused backward's fp32 dQᵀ
    accumulator ``[B, Hq, D, Sq_pad]`` (rows < Sq: the padding is never read), which saves
    the memset launch of a ``torch.zeros``."""
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
    if ZERO_DQ:  # [16, BLOCK_M] tiles, their last axis (the rows) contiguous in memory
        offs_c = tl.arange(0, 16)
        for c0 in tl.static_range(0, D, 16):
            dq_off = ((b * Hq + h) * D + c0 + offs_c[:, None]) * Sq_pad + offs_m[None, :]
            tl.store(dq_ptr + dq_off, tl.zeros([16, BLOCK_M], dtype=tl.float32),
                     mask=rmask[None, :])


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
def _sum_kv_split_kernel(part_ptr, dk_ptr, dv_ptr, rows, SPLIT: tl.constexpr, D: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """dK and dV of a KV_SPLIT dK/dV launch: ``part`` fp32 ``[2, rows, SPLIT, D]`` (dK's and
    dV's partials, ``rows`` = B * Sk * Hk) summed over SPLIT in fp32 and rounded once into the
    contiguous ``[rows, D]`` outputs (program axis 1: 0 for dK, 1 for dV)."""
    r_blk = tl.program_id(0)
    which = tl.program_id(1)
    offs_r = (r_blk * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, D)
    rmask = (offs_r < rows)[:, None]
    src = part_ptr + ((which * rows + offs_r[:, None]) * SPLIT) * D + offs_d[None, :]
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(src + s * D, mask=rmask, other=0.0)
    dst = offs_r[:, None] * D + offs_d[None, :]
    if which == 0:
        tl.store(dk_ptr + dst, acc.to(dk_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.store(dv_ptr + dst, acc.to(dv_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _dkdv_inner(dk, dv, k, v, lo, hi, q_ptr, do_ptr, q_desc, do_desc, lse2_ptr, delta_ptr,
                q_row0, q_col, q_stride, stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                USE_TMA: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dK, dV of one key block over query blocks [lo, hi) of one query head.

    MASKED=False compiles a loop with no mask code (fewer live registers: the caller passes
    only runs of UNMASKED tiles); MASKED=True classifies each tile and masks the PARTIAL ones.
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
    return dk, dv


@triton.jit
def _dkdv_range(dk, dv, k, v, lo, flo, fhi, hi, q_ptr, do_ptr, q_desc, do_desc, lse2_ptr,
                delta_ptr, q_row0, q_col, q_stride, stat_row0, sptr, col_ptr,
                n_blk, Sq, Sk, scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                USE_TMA: tl.constexpr, PREC: tl.constexpr, SPLIT_UNMASKED: tl.constexpr):
    """One live range [lo, hi) of query blocks: a masked loop over all of it, or (SPLIT_UNMASKED)
    masked [lo, flo), mask-free [flo, fhi), masked [fhi, hi)."""
    if SPLIT_UNMASKED:
        dk, dv = _dkdv_inner(dk, dv, k, v, lo, flo, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, True)
        dk, dv = _dkdv_inner(dk, dv, k, v, flo, fhi, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, False)
        dk, dv = _dkdv_inner(dk, dv, k, v, fhi, hi, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, True)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, lo, hi, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, q_row0, q_col, q_stride,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, True)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPEC)
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse2_ptr, delta_ptr,
                 mask_ptr, sum_ptr, rng_ptr, q_desc, do_desc, k_desc, v_desc, dq_ptr,
                 sm_scale, scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, C: tl.constexpr, NI: tl.constexpr,
                 USE_TMA: tl.constexpr, PREC: tl.constexpr, A_SMEM: tl.constexpr,
                 SPLIT_UNMASKED: tl.constexpr, KV_SPLIT: tl.constexpr = 1):
    """One program per (key block, batch*KV head); loops over the query heads of its group.
    ``dq_ptr`` is unused (the deleted tl fused backward's dQ buffer; kept so that the compiled
    kernel's parameter list, hence its machine code, stays the GPU-verified one).
    SPLIT_UNMASKED: visit each range's run of UNMASKED tiles in a loop without mask code.
    KV_SPLIT > 1: each KV head's group of query heads is split over KV_SPLIT programs (one per
    (key block, batch * KV head * KV_SPLIT)), each writing its partial dK, dV as an output head
    of its own: dK/dV ``[B, Sk, Hk * KV_SPLIT, D]``, summed by :func:`sum_kv_split`."""
    n_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // (Hk * KV_SPLIT)
    hk = bh % (Hk * KV_SPLIT)  # the program's head: KV head hk // KV_SPLIT, its part
    kv_head = hk // KV_SPLIT
    b64 = b.to(tl.int64)
    group = Hq // (Hk * KV_SPLIT)
    offs_n = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kv_off = (b64 * Sk + offs_n)[:, None] * (Hk * D) + kv_head * D + offs_d[None, :]
    nmask = (offs_n < Sk)[:, None]
    if USE_TMA and A_SMEM:  # K, V stay in shared memory as wgmma A operands (saves registers)
        k = k_desc.load([b * Sk + n_blk * BLOCK_N, kv_head * D])
        v = v_desc.load([b * Sk + n_blk * BLOCK_N, kv_head * D])
    else:
        k = tl.load(k_ptr + kv_off, mask=nmask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=nmask, other=0.0)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for g in range(0, group):
        h = hk * group + g
        hm = h // (Hq // Hm)
        mbh, sptr, col_ptr = _mask_head(mask_ptr, sum_ptr, b64, hm, mask_b_stride, Sk, NKB, C)
        lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1 = _key_block_ranges(
            rng_ptr, mbh, n_blk, Sq, Sk, NQB, NKB, BLOCK_M, BLOCK_N, CAUSAL, C)
        stat_row0 = (b64 * Hq + h) * Sq
        q_row0 = b * Sq
        q_col = h * D
        dk, dv = _dkdv_range(dk, dv, k, v, lo0, flo0, fhi0, hi0, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, q_row0, q_col, Hq * D,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, SPLIT_UNMASKED)
        dk, dv = _dkdv_range(dk, dv, k, v, lo1, flo1, fhi1, hi1, q_ptr, do_ptr, q_desc, do_desc,
                             lse2_ptr, delta_ptr, q_row0, q_col, Hq * D,
                             stat_row0, sptr, col_ptr, n_blk, Sq, Sk, scale_log2, D, BLOCK_M,
                             BLOCK_N, CAUSAL, C, NI, USE_TMA, PREC, SPLIT_UNMASKED)
    out_off = (b64 * Sk + offs_n)[:, None] * (Hk * KV_SPLIT * D) + hk * D + offs_d[None, :]
    tl.store(dk_ptr + out_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=nmask)
    tl.store(dv_ptr + out_off, dv.to(dv_ptr.dtype.element_ty), mask=nmask)


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
    m_blk, b, h, hk, hm, b64 = _query_block_program(NQB, Hq, Hk, Hm, CAUSAL)
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

    mbh, sptr, col_ptr = _mask_head(mask_ptr, sum_ptr, b64, hm, mask_b_stride, Sk, NKB, C)
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
# Launchers
# ---------------------------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dim_class(d: int) -> int:
    """Head dims are padded to a power of two >= 16 for tl.arange; the tile class of ``d``."""
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def use_tma(x: torch.Tensor) -> bool:
    """TMA descriptors for the streamed tiles: on CUDA devices of compute capability >= 9."""
    if TensorDescriptor is None or not x.is_cuda:
        return False
    return _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())[0] >= 9


_CAPABILITY: dict = {}


def _capability(index: int) -> tuple:
    """The compute capability of CUDA device ``index`` (asked once per device)."""
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


#: Whether the loop-invariant wgmma A operands (Q in the forward; K, V in dK/dV; Q, dO in dQ)
#: are read through TMA into shared memory (True) or loaded into registers (False). Measured
#: on the H200 (benchmarks/NOTES.md, v1 vs v2): shared memory helps the forward (+7% at 32K),
#: registers are faster in both backward kernels (v2 backward was ~10% slower).
A_OPERAND_IN_SMEM = {"fwd": True, "dkdv": False, "dq": False}
#: Exceptions to :data:`A_OPERAND_IN_SMEM` per (kernel, head-dim class): the D=256 dQ kernel's
#: 128x32 tile needs Q, dO in shared memory (128 registers per thread otherwise) and is 1.7x
#: faster than the 64x64 one with them in registers (benchmarks/NOTES.md, v6.3).
A_OPERAND_IN_SMEM_BY_DIM = {("dq", 256): True}

#: Whether a kernel visits each live range's run of UNMASKED tiles in a separate loop compiled
#: without mask code. On for every kernel: measured on the H200 (NOTES.md v4 for dK/dV, v5 for
#: the forward, 5-11% faster on 13 masks at 32K, and dQ).
SPLIT_UNMASKED_LOOP = {"fwd": True, "dkdv": True, "dq": True}


def a_smem(kind: str, d: int) -> bool:
    """Whether kernel ``kind`` at head dim ``d`` reads its A operands from shared memory."""
    return A_OPERAND_IN_SMEM_BY_DIM.get((kind, dim_class(d)), A_OPERAND_IN_SMEM[kind])


def _desc(x2d: torch.Tensor, rows: int, d: int):
    return descriptor(TensorDescriptor, x2d, [rows, d])


def dot_precision(dtype: torch.dtype) -> str:
    """The tl.dot input precision: exact for float32 inputs, else tf32 (unused by 16-bit)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_fwd(q, k, v, causal, softmax_scale, cfg: Config, plan: Plan):
    """(out, lse) of the tl forward kernel at tile ``cfg``; ``plan`` built by query block for
    ``cfg``'s tile (:func:`flashmask3.kernels.tiles.make_plan`)."""
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    nqb, nkb = cdiv(sq, cfg.block_m), cdiv(sk, cfg.block_n)
    tma = use_tma(q)
    k_desc = _desc(k.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    v_desc = _desc(v.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    q_desc = _desc(q.view(b * sq, hq * d), cfg.block_m, d) if tma and a_smem("fwd", d) else None
    launch(_fwd_kernel, (nqb, b * hq),
        q, k, v, out, lse, plan.mask, plan.summary, plan.ranges, k_desc, v_desc, q_desc,
        softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb, plan.mask_b_stride,
        D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, C=plan.c, NI=plan.ni,
        USE_TMA=tma, PREC=dot_precision(q.dtype), A_SMEM=a_smem("fwd", d),
        SPLIT_UNMASKED=SPLIT_UNMASKED_LOOP["fwd"], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out, lse


def backward_prepass(out, dout, lse, dlse, dq_t: Optional[torch.Tensor] = None):
    """(delta, lse2) of the backward: ``rowsum(dO * O) - dlse`` and the LSE in base 2 with
    ``+inf`` on fully masked rows, both fp32 ``[B, Hq, Sq]``. ``dq_t``: the fused backward's
    fp32 dQᵀ accumulator ``[B, Hq, D, Sq_pad]`` (contiguous, :func:`dq_accumulator`), zeroed
    here on its first Sq columns (one launch instead of two)."""
    b, sq, hq, d = out.shape
    # one allocation for both (a host allocation costs as much as a small launch)
    delta, lse2 = torch.empty((2, b, hq, sq), dtype=torch.float32, device=out.device).unbind(0)
    bm = 64 if d <= 128 else 32
    has_dlse = dlse is not None
    dl = dlse.to(torch.float32).contiguous() if has_dlse else delta
    zero_dq = dq_t is not None
    if zero_dq and (dq_t.shape[:3] != (b, hq, d) or dq_t.shape[3] < sq
                    or dq_t.dtype != torch.float32 or not dq_t.is_contiguous()):
        raise ValueError(f"dq_t must be a contiguous fp32 [B, Hq, D, >= Sq] = [{b}, {hq}, {d}, "
                         f">= {sq}] tensor, got {dq_t.dtype} {tuple(dq_t.shape)}")
    pad = dq_t.shape[3] if zero_dq else 0
    # bound once per configuration (launcher.cached_bound): a key of a few ints, not launch()'s
    # walk over every argument
    key = (_bwd_pre_kernel, b, sq, hq, d, has_dlse, zero_dq, pad, out.dtype, out.device)
    bound = cached_bound(key, lambda: (
        _bwd_pre_kernel, (cdiv(sq, bm), b * hq), (TENSOR,) * 7 + (sq, hq, pad),
        dict(D=d, BLOCK_M=bm, HAS_DLSE=has_dlse, ZERO_DQ=zero_dq, num_warps=4)))
    bound(out, dout, lse.contiguous(), dl, delta, lse2, dq_t if zero_dq else delta)
    return delta, lse2


def dq_accumulator(b: int, sq: int, hq: int, d: int, device) -> torch.Tensor:
    """An uninitialised fp32 dQᵀ accumulator ``[B, Hq, D, Sq_pad]`` of the fused backward
    (Sq_pad: Sq rounded up to 4, a 16-byte row stride for TMA), to be zeroed by
    :func:`backward_prepass`."""
    return torch.empty((b, hq, d, cdiv(sq, 4) * 4), dtype=torch.float32, device=device)


def kv_split_partials(k: torch.Tensor, kv_split: int) -> torch.Tensor:
    """The fp32 buffer of a KV_SPLIT dK/dV launch's partial sums: ``[2, B, Sk, Hk * kv_split,
    D]`` (dK's, then dV's; one allocation), for :func:`sum_kv_split`."""
    b, sk, hk, d = k.shape
    return torch.empty((2, b, sk, hk * kv_split, d), dtype=torch.float32, device=k.device)


def sum_kv_split(part: torch.Tensor, k: torch.Tensor):
    """(dk, dv) like ``k`` from a :func:`kv_split_partials` buffer: each KV head's partials
    summed in fp32 and rounded once (one launch for both)."""
    b, sk, hk, d = k.shape
    split = part.shape[3] // hk
    dk, dv = torch.empty_like(k), torch.empty_like(k)
    rows = b * sk * hk
    block_r = max(1, 4096 // d)
    launch(_sum_kv_split_kernel, (cdiv(rows, block_r), 2), part, dk, dv, rows, SPLIT=split,
           D=d, BLOCK_R=block_r, num_warps=4)
    return dk, dv


def check_kv_split(kv_split: int, hq: int, hk: int) -> None:
    """Raise ValueError unless ``kv_split`` divides the ``hq // hk`` query heads of a group."""
    if not isinstance(kv_split, int) or kv_split < 1 or (hq // hk) % kv_split:
        raise ValueError(f"kv_split must be a positive divisor of the {hq // hk} query heads per "
                         f"KV head, got {kv_split!r}")


def dkdv_outputs(k: torch.Tensor, v: torch.Tensor, hq: int, kv_split: int):
    """``(dk, dv, part)``: what a dK/dV launch writes into. Grouped (``kv_split`` 1): dK, dV
    like k, v, ``part`` None. Split: the two halves of a :func:`kv_split_partials` buffer
    (``part``), which :func:`finish_dkdv` sums."""
    if kv_split == 1:
        return torch.empty_like(k), torch.empty_like(v), None
    check_kv_split(kv_split, hq, k.shape[2])
    part = kv_split_partials(k, kv_split)
    dk, dv = part.unbind(0)
    return dk, dv, part


def finish_dkdv(dk: torch.Tensor, dv: torch.Tensor, part, k: torch.Tensor):
    """(dk, dv) of a launch into :func:`dkdv_outputs`: as written, or the split's parts summed."""
    return (dk, dv) if part is None else sum_kv_split(part, k)


def launch_dkdv(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg: Config, plan: Plan,
                kv_split: int = 1):
    """(dk, dv) of the tl dK/dV kernel at tile ``cfg`` (``plan`` by key block). ``kv_split``
    > 1: each KV head's query heads split over that many programs (a GQA call with few key
    blocks: more programs for the SMs), their partials summed by :func:`sum_kv_split`."""
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    kind = "dkdv"
    dk, dv, part = dkdv_outputs(k, v, hq, kv_split)
    split = {} if part is None else dict(KV_SPLIT=kv_split)
    nqb, nkb = cdiv(sq, cfg.block_m), cdiv(sk, cfg.block_n)
    tma = use_tma(q)
    q_desc = _desc(q.view(b * sq, hq * d), cfg.block_m, d) if tma else None
    do_desc = _desc(dout.view(b * sq, hq * d), cfg.block_m, d) if tma else None
    k_desc = _desc(k.view(b * sk, hk * d), cfg.block_n, d) if tma and a_smem(kind, d) else None
    v_desc = _desc(v.view(b * sk, hk * d), cfg.block_n, d) if tma and a_smem(kind, d) else None
    launch(_dkdv_kernel, (nkb, b * hk * kv_split),
        q, k, v, dout, dk, dv, lse2, delta, plan.mask, plan.summary, plan.ranges, q_desc, do_desc,
        k_desc, v_desc, dk,  # (dk: the unused dq_ptr)
        softmax_scale, softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb,
        plan.mask_b_stride, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        C=plan.c, NI=plan.ni, USE_TMA=tma, PREC=dot_precision(q.dtype), A_SMEM=a_smem(kind, d),
        SPLIT_UNMASKED=SPLIT_UNMASKED_LOOP[kind],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **split)
    return finish_dkdv(dk, dv, part, k)


def launch_dq(q, k, v, dout, lse2, delta, causal, softmax_scale, cfg: Config, plan: Plan):
    """dQ of the tl dQ kernel at tile ``cfg`` (``plan`` by query block)."""
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    dq = torch.empty_like(q)
    nqb, nkb = cdiv(sq, cfg.block_m), cdiv(sk, cfg.block_n)
    tma = use_tma(q)
    k_desc = _desc(k.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    v_desc = _desc(v.view(b * sk, hk * d), cfg.block_n, d) if tma else None
    q_desc = _desc(q.view(b * sq, hq * d), cfg.block_m, d) if tma and a_smem("dq", d) else None
    do_desc = _desc(dout.view(b * sq, hq * d), cfg.block_m, d) if tma and a_smem("dq", d) else None
    launch(_dq_kernel, (nqb, b * hq),
        q, k, v, dout, dq, lse2, delta, plan.mask, plan.summary, plan.ranges, k_desc, v_desc,
        q_desc, do_desc,
        softmax_scale, softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb,
        plan.mask_b_stride, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        C=plan.c, NI=plan.ni, USE_TMA=tma, PREC=dot_precision(q.dtype), A_SMEM=a_smem("dq", d),
        SPLIT_UNMASKED=SPLIT_UNMASKED_LOOP["dq"], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return dq


def scale_dq(dq_acc: torch.Tensor, softmax_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dQ = softmax_scale * dq_acc as a new contiguous ``dtype`` tensor: the fused backward's
    last step. ``dq_acc`` [B, Sq, Hq, D] fp32 with any strides (the Gluon kernel's is a
    transposed view). The kernel reads it along its contiguous axis and writes dQ along D
    (``torch.mul(dq_acc, scale, out=dq)`` walks dQ's order: one element per D step of a
    transposed view, measured slower, benchmarks/NOTES.md)."""
    b, sq, hq, d = dq_acc.shape
    dq = torch.empty((b, sq, hq, d), dtype=dtype, device=dq_acc.device)
    if dq.numel() == 0:
        return dq
    block_q = 64 if d <= 128 else 32
    strides = dq_acc.stride()
    key = (_scale_dq_kernel, b, sq, hq, d, strides, softmax_scale, dtype, dq.device)
    bound = cached_bound(key, lambda: (
        _scale_dq_kernel, (cdiv(sq, block_q), b * hq), (TENSOR, TENSOR, softmax_scale, sq, hq, *strides),
        dict(D=d, BLOCK_Q=block_q, num_warps=4)))
    bound(dq_acc, dq)
    return dq
