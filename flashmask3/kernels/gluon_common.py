"""Gluon helpers shared by the Gluon forward (:mod:`.gluon_fwd`) and backward
(:mod:`.gluon_bwd`): the Gluon imports (the package imports without Gluon), the mask and
live-range helpers in Gluon, shared-memory layouts and the warp-specialisation register budget.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch
import triton

try:  # gluon (triton >= 3.5); the module must import without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                   tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_init
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.experimental.gluon.language._core import builtin as _gluon_builtin
    from triton._C.libtriton import ir as _triton_ir
    GLUON_IMPORT_ERROR: Optional[str] = None
    _jit = gluon.jit
    # the TMA tile load: `async_load` from Triton 3.7 (3.9 removed the older name, which
    # Triton 3.6 has alone); the arguments (descriptor, coordinates, barrier, destination)
    # are the same in both
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # a CTA-wide barrier: `gl.barrier` from Triton 3.9 (`thread_barrier` before it)
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except Exception as exc:  # pragma: no cover - older triton
    gluon = gl = GluonDescriptor = _triton_ir = tma_load = thread_barrier = None
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

    def _gluon_builtin(fn):
        return fn

    def _jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

from .tiles import _NO_SPEC, LOG2E, _num_intervals  # noqa: E402,F401


@_jit
def _needs_mask(m, n_blk, Sq, Sk, stats, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, NI: gl.constexpr, LEAN: gl.constexpr = False):
    """Whether tile (query block m, key block n_blk) is not UNMASKED or is clipped at Sk (the
    scalar twin of ``_clipped_tile_class(...) != 2``). ``LEAN`` (STATS_SMEM: fewer loop
    invariants) reads 4 of the 8 statistics: the terms ``(r0 >= s_max) & (r1 <= e_min)`` it
    drops imply the kept ``(r0 < e_max) & (r1 > s_min)`` (r0 < r1: the tile holds a row below
    Sq; s_min <= s_max, e_min <= e_max), so the answer is the same."""
    r0 = m * BLOCK_M
    r1 = gl.minimum(r0 + BLOCK_M, Sq)
    c0 = n_blk * BLOCK_N
    c1 = gl.minimum(c0 + BLOCK_N, Sk)
    need = c0 + BLOCK_N > Sk
    if CAUSAL:
        need = need | (c1 - 1 > r0 + (Sk - Sq))
    if NI >= 1:
        s0max, s0min, e0max, e0min, s1max, s1min, e1max, e1min = stats
        if not LEAN:
            need = need | ((r0 >= s0max) & (r1 <= e0min))
        need = need | ((r0 < e0max) & (r1 > s0min))
        if NI >= 2:
            if not LEAN:
                need = need | ((r0 >= s1max) & (r1 <= e1min))
            need = need | ((r0 < e1max) & (r1 > s1min))
    return need


@_gluon_builtin
def _opaque_i32(x, pure=False, _semantic=None):
    """``x`` (int32, scalar or tensor) through an inline-asm ``mov`` that LLVM cannot see
    through (``gluon_bwd._tile_operands``, ``gluon_bwd.OPAQUE_INVARIANTS``). Not pure (the
    default): every call is a new value, never hoisted out of a loop or merged with another
    call, so what is computed from it is recomputed where it is used instead of being kept as a
    loop invariant. Pure: equal inputs may share one mov, but LLVM still cannot reassociate what
    is added to the result with what went into it. A builtin, as ``gluon_bwd._tile_operands``
    (why: there)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=pure, pack=1, _semantic=_semantic)


@_jit
def _element_masked(rows, cols, ivals, Sq, Sk, CAUSAL: gl.constexpr, C: gl.constexpr,
                    SHIFT_COLS: gl.constexpr = False):
    """True where (row, col) is masked (docs/masks.md); rows ``[1, BM]``, cols ``[BN, 1]``, the
    column intervals ``ivals`` = (s0, e0, s1, e1) ``[BN, 1]``. Columns >= Sk are masked.

    SHIFT_COLS: the backward's tiles from Triton 3.9 on (``gluon_bwd.OPAQUE_INVARIANTS``), where
    a thread holds 2 key columns and 16 query rows. The causal term is written ``cols - (Sk -
    Sq) > rows`` instead of ``cols > rows + (Sk - Sq)`` (the same integers, far from overflow),
    the shift on the columns: the sums ``row + (Sk - Sq)`` would be hoisted out of the tile loop
    as 16 invariants (which CUDA 13's ptxas keeps in local memory); and causal C=1 masks take
    :func:`_causal_c1_masked` (one compare per element)."""
    if SHIFT_COLS and CAUSAL and C == 1:
        return _causal_c1_masked(rows, cols, ivals, Sq, Sk)
    masked = cols >= Sk
    if C > 0:
        s0, e0, s1, e1 = ivals
        masked = masked | ((rows >= s0) & (rows < e0))
        if (not CAUSAL) or C == 4:
            masked = masked | ((rows >= s1) & (rows < e1))
    if CAUSAL:
        if SHIFT_COLS:
            masked = masked | (cols - (Sk - Sq) > rows)
        else:
            masked = masked | (cols > rows + (Sk - Sq))
    return masked


@_jit
def _causal_c1_masked(rows, cols, ivals, Sq, Sk):
    """:func:`_element_masked` of a causal C=1 mask (causal documents, sliding windows), whose
    columns leave one unmasked row interval ``[lo, hi) = [cols - (Sk - Sq), s0)`` (s0 clamped to
    [0, Sq]; empty for a column >= Sk), as one unsigned compare per element, ``rows - lo >=
    hi - lo``. Equal to :func:`_element_masked` on rows in [0, Sq); rows past Sq (a tile's
    padding, zero Q and dO rows) come out masked. The bounds are loop invariants: they go
    through :func:`_opaque_i32` so that ``rows - lo`` is not split into invariant sums that
    ptxas spills. Why (the backward from Triton 3.9 on): three compares per element made CUDA
    13's ptxas keep the predicates of a thread's 32 elements in general registers (~170 LOP3
    per masked tile of the fused D=128 backward); with one, its masked tile loops have 585
    instructions instead of 741-831, and causal C=1 backwards ran 1-4% faster (H100; the same
    form for non-causal C=2 ran 5-7% slower, benchmarks/NOTES.md session 46)."""
    s0, _, _, _ = ivals
    lo = cols - (Sk - Sq)
    n = gl.where(cols < Sk, gl.maximum(gl.minimum(gl.maximum(s0, 0), Sq) - lo, 0), 0)
    d = rows - _opaque_i32(lo)
    return d.to(gl.uint32, bitcast=True) >= _opaque_i32(n).to(gl.uint32, bitcast=True)


@_jit
def _column_interval_words(col_ptr, cols, Sq, Sk, CAUSAL: gl.constexpr, C: gl.constexpr):
    """Masked row intervals [s0, e0), [s1, e1) of the key columns ``cols`` (1-D each; the ``tl``
    ``_column_intervals`` table): the one Gluon copy, which the dK/dV kernel reads as columns
    (:func:`_column_intervals`) and the dQ kernel as rows."""
    cvalid = cols < Sk
    zero = cols * 0
    if C == 0:
        s0 = zero + Sq
        e0 = s0
        s1 = s0
        e1 = s0
    elif CAUSAL and C == 1:
        s0 = gl.load(col_ptr + cols, mask=cvalid, other=0)
        e0 = zero + Sq
        s1 = e0
        e1 = e0
    elif CAUSAL:
        s0 = gl.load(col_ptr + cols * 2, mask=cvalid, other=0)
        e0 = gl.load(col_ptr + cols * 2 + 1, mask=cvalid, other=0)
        s1 = zero + Sq
        e1 = s1
    elif C == 2:
        s0 = gl.load(col_ptr + cols * 2, mask=cvalid, other=0)
        e0 = zero + Sq
        s1 = zero
        e1 = gl.load(col_ptr + cols * 2 + 1, mask=cvalid, other=0)
    else:
        s0 = gl.load(col_ptr + cols * 4, mask=cvalid, other=0)
        e0 = gl.load(col_ptr + cols * 4 + 1, mask=cvalid, other=0)
        s1 = gl.load(col_ptr + cols * 4 + 2, mask=cvalid, other=0)
        e1 = gl.load(col_ptr + cols * 4 + 3, mask=cvalid, other=0)
    return s0, e0, s1, e1


@_jit
def _column_intervals(col_ptr, cols, Sq, Sk, CAUSAL: gl.constexpr, C: gl.constexpr):
    """:func:`_column_interval_words` as ``[BN, 1]`` columns (the dK/dV kernel's transposed
    tiles); loop invariants of one mask head."""
    s0, e0, s1, e1 = _column_interval_words(col_ptr, cols, Sq, Sk, CAUSAL, C)
    return s0[:, None], e0[:, None], s1[:, None], e1[:, None]


@_jit
def _key_block_ranges(rng_ptr, mbh, n_blk, Sq, Sk, NQB, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NKB):
    """(lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1) of one key block: the stored table with a
    mask, the causal diagonal (or everything) without one (``tl`` ``_key_block_ranges``)."""
    if C > 0:
        rp = rng_ptr + (mbh * NKB + n_blk) * 8
        lo0 = gl.load(rp)
        hi0 = gl.load(rp + 1)
        lo1 = gl.load(rp + 2)
        hi1 = gl.load(rp + 3)
        flo0 = gl.load(rp + 4)
        fhi0 = gl.load(rp + 5)
        flo1 = gl.load(rp + 6)
        fhi1 = gl.load(rp + 7)
    else:
        c0 = n_blk * BLOCK_N
        lo0 = n_blk * 0
        flo0 = lo0
        if CAUSAL:
            first_row = c0 - (Sk - Sq)
            lo0 = gl.minimum(gl.maximum(first_row, 0) // BLOCK_M, NQB)
            last_col = gl.minimum(c0 + BLOCK_N, Sk) - 1
            flo0 = gl.minimum(gl.cdiv(gl.maximum(last_col - (Sk - Sq), 0), BLOCK_M), NQB)
        hi0 = lo0 * 0 + NQB
        fhi0 = hi0
        if c0 + BLOCK_N > Sk:
            flo0 = hi0
        lo1 = hi0
        hi1 = hi0
        flo1 = hi0
        fhi1 = hi0
    return lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1


@_jit
def _query_block_ranges(rng_ptr, mbh, m_blk, Sq, Sk, NQB, NKB, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr):
    """(lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1): the two live key-block ranges of query
    block ``m_blk`` and the first run of UNMASKED tiles in each, for the Gluon dQ and forward
    kernels. Query-major twin of :func:`_key_block_ranges` (and Gluon twin of the ``tl``
    ``_query_block_ranges``, same integer expressions): the stored table with a mask, the causal
    diagonal (or everything) without one.

    Why two copies (tried in session 18, round 2): calling the ``tl`` functions compiles
    offline without the interpreter, but under ``TRITON_INTERPRET=1`` (the CPU test suite,
    which still compiles these kernels offline) ``@triton.jit`` makes interpreter functions,
    which a compiled Gluon kernel cannot reference (wrapped as JITFunctions, 3 of the 6
    recorded-SASS compiles of test_gluon_bwd still failed inside them); and calling them
    changed the SASS of 7 of the 32 Gluon table kernels (the same IR but for SSA value names)."""
    if C > 0:
        rp = rng_ptr + (mbh * NQB + m_blk) * 8
        lo0 = gl.load(rp)
        hi0 = gl.load(rp + 1)
        lo1 = gl.load(rp + 2)
        hi1 = gl.load(rp + 3)
        flo0 = gl.load(rp + 4)
        fhi0 = gl.load(rp + 5)
        flo1 = gl.load(rp + 6)
        fhi1 = gl.load(rp + 7)
    else:
        lo0 = m_blk * 0
        n_whole = Sk // BLOCK_N  # key blocks that end inside Sk
        if CAUSAL:
            r0 = m_blk * BLOCK_M
            r1 = gl.minimum(r0 + BLOCK_M, Sq)
            last = r1 - 1 + (Sk - Sq)  # last visible column of the block
            hi0 = gl.maximum(gl.minimum((last + BLOCK_N) // BLOCK_N, NKB), 0)
            hi0 = gl.where(last < 0, 0, hi0)
            # key blocks whose every column is visible from the block's first row
            fhi0 = gl.maximum(r0 + (Sk - Sq) + 1, 0) // BLOCK_N
        else:
            hi0 = lo0 + NKB
            fhi0 = hi0
        fhi0 = gl.minimum(gl.minimum(fhi0, n_whole), hi0)
        flo0 = gl.where(fhi0 > 0, 0, hi0)
        fhi0 = gl.where(fhi0 > 0, fhi0, hi0)
        lo1 = hi0
        hi1 = hi0
        flo1 = hi0
        fhi1 = hi0
    return lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1


@_jit
def _load_stats(sum_ptr, mbh, n_blk, NKB, NI: gl.constexpr):
    """The key block's 8 statistics (max/min start, max/min end of both intervals)."""
    if NI > 0:
        p = sum_ptr + (mbh * NKB + n_blk) * 8
        stats = (gl.load(p), gl.load(p + 1), gl.load(p + 2), gl.load(p + 3),
                 gl.load(p + 4), gl.load(p + 5), gl.load(p + 6), gl.load(p + 7))
    else:
        z = n_blk * 0
        stats = (z, z, z, z, z, z, z, z)
    return stats


def unavailable_reason() -> Optional[str]:
    """Why the Gluon kernel cannot be used here (None when it can be compiled)."""
    if GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})"
    return None


def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.lru_cache(maxsize=None)
def _smem_layout(block_rows: int, d: int, dtype):
    """The NVMMA (swizzled) shared layout of a [block_rows, d] tile: TMA destination and wgmma
    operand (both orientations: the 16-bit wgmma reads the transposed view as well)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, d], _gl_dtype(dtype))


#: Registers of one Hopper SM, and what one thread may hold at most.
SM_REGISTERS = 65536
MAX_THREAD_REGS = 255
#: WARP_SPEC producer partition: one warp, 24 registers (the setmaxnreg minimum); register
#: allocation is per warpgroup, so it occupies 4 warp slots of the launch.
PRODUCER_WARPS = 1
PRODUCER_REGS = 24


def ws_programs_per_sm(num_warps: int) -> int:
    """Programs of the WARP_SPEC kernel resident per SM: as many as the non-WS kernel has at 255
    registers (register files are allocated in 256-register warp slices): 2 at 4 warps, 1 at
    8."""
    return max(1, SM_REGISTERS // (num_warps * 32 * 256))


@functools.lru_cache(maxsize=None)
def ws_maxnreg(num_warps: int) -> int:
    """The ``maxnreg`` launch option of the WARP_SPEC kernel: the register budget per thread of
    num_warps + 4 warps that keeps as many programs resident per SM as the non-WS kernel has at
    255 registers (2 at 4 warps, 1 at 8: register files are allocated in 256-register warp
    slices), rounded down to a multiple of 8 (setmaxnreg's granularity). The compute warps get
    what the producer warpgroup gives back: (maxnreg * (num_warps + 4) - 24 * 4) / num_warps,
    e.g. 232 at 4 warps, 240 at 8 (:func:`ws_compute_regs`)."""
    per_thread = SM_REGISTERS // (ws_programs_per_sm(num_warps) * (num_warps + 4) * 32)
    return min(256, per_thread // 8 * 8)


def ws_compute_regs(num_warps: int, maxnreg: Optional[int] = None) -> int:
    """Registers per thread the WARP_SPEC compute partition can raise itself to (capped at
    255: no thread holds more, so warp specialisation cannot lift the non-WS kernel's cap)."""
    maxnreg = ws_maxnreg(num_warps) if maxnreg is None else maxnreg
    total = maxnreg * (num_warps + 4) - PRODUCER_REGS * 4
    return min(MAX_THREAD_REGS, total // num_warps // 8 * 8)
