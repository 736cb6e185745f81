"""Gluon (``triton.experimental.gluon``) dK/dV kernel for Hopper (sm_90): the default dK/dV
kernel of the split backward at D=64 and D=128 on Hopper GPUs (the dispatch table (``dispatch.py``);
at D=128 at 64x128 w8 with STATS_SMEM), and with FUSE_DQ + DS_SHARED the default (fused)
backward at D=64 and D=128 (the dispatch table); the ``tl`` kernels elsewhere.

What it computes: exactly what the ``tl`` ``_dkdv_kernel`` computes (split backward), dK
(already multiplied by ``softmax_scale``) and dV, from the same :class:`Plan` (built by key
block for the same ``block_m``/``block_n``), ``lse2`` (log2-domain LSE, +inf on fully masked
rows) and ``delta`` from ``tl_kernels.backward_prepass``. On the H200 its dK, dV are bitwise
equal to the ``tl`` kernel's (same wgmma k-steps in the same order), and it is 1.08-1.21x faster
(32K, D=128, 6 masks, MHA and GQA: benchmarks/NOTES.md v6);
with WARP_SPEC 1.17-1.24x at D=128 and 1.27-1.49x at D=64 (
NOTES.md v6.2, v6.3); with STATS_SMEM at 64x128 w8 1.31-1.40x at
D=128 (NOTES.md v6.4). The DS_SHARED fused backward is 1.11-1.18x that split
backward (NOTES.md v6.5); at D=64 its 64x64 w4 tile (one compute warpgroup)
1.05-1.15x (NOTES.md v6.6).

Why: the ``tl`` dK/dV kernel's SASS waits for every wgmma right after issuing it
(``WARPGROUP.DEPBAR.LE gsb0, 0x0``), so the tensor cores and the exp/mask arithmetic never
overlap. Gluon lets us write the schedule.

Design (one program per (key block of BLOCK_N keys, batch * KV head), looping over the query
heads of its group):

* K and V: one TMA load each into shared memory, the wgmma A operands of Sᵀ = K Qᵀ and
  dPᵀ = V dOᵀ (A from shared memory costs no registers).
* Q and dO: a NUM_STAGES-deep shared-memory ring filled by TMA, one mbarrier per slot
  (expect-tx = bytes of both tiles, parity = (tile counter // NUM_STAGES) & 1). Each live range
  issues its first NUM_STAGES tiles up front; a slot is refilled with the tile NUM_STAGES further
  on once the wgmmas reading it have retired. TMA zero-fills only past the end of the
  ``[B*Sq, H*D]`` view: rows of the next batch that a clipped tile reads get P = 0 through
  ``lse2 = +inf``, as in the ``tl`` kernel; key columns past Sk are cut by the element mask and
  never stored.
* dK, dV: fp32 accumulators in registers in the wgmma (NVMMADistributedLayout v3) layout with
  warps along the keys, so BLOCK_N == 16 * num_warps. At D=256 a 64-key tile with 8 warps
  (session 15) has its two warpgroups split the head dim instead (each holds 64 x 128 of dK
  and dV, and 64 x BLOCK_M/2 of Sᵀ and dPᵀ); Pᵀ and dSᵀ, the A operands of dV and dK, then
  reach the other warpgroup through shared memory (the layout conversion).
* Per query tile (``_tile``), asynchronous wgmma: issue Sᵀ and dPᵀ, load lse2/delta, wait for
  Sᵀ only, Pᵀ = exp2(Sᵀ·scale_log2 − lse2) (+ element mask) while dPᵀ runs, issue dV += Pᵀ dO
  (Pᵀ as a register A operand), wait for dPᵀ only, dSᵀ = Pᵀ ⊙ (dPᵀ − delta) while dV runs, issue
  dK += dSᵀ Q, wait, CTA barrier, refill the slot. The SASS waits are ``DEPBAR.LE gsb0, 0x1``
  (one wgmma group stays in flight) where the ``tl`` kernel has ``0x0``.
* Three loops per live range, as in the ``tl`` kernel: masked [lo, flo), mask-free [flo, fhi)
  compiled without mask code, masked [fhi, hi). The key block's 8 statistics and column
  intervals are loaded once per query head; each tile of a masked loop is classified with
  scalar compares.

Offline sm_90 report (``python -m flashmask3.kernels.compile_tools bwd``; D=128 bf16): every config
sits at 255 registers; 32x64 w4 s3 (the default) has 22-36 LDL/STL, all in the per-head setup
between live ranges, none inside a tile loop; BLOCK_M=64 configs spill inside the loops (~340).
A variant that leaves dK in flight under the next tile's first wgmmas was measured 0-2% slower
and removed (NOTES.md v6).

Fused dQ (constexpr FUSE_DQ; at 32x64 measured 0.85-0.94x of split, v6.1/v6.4: used by
default only with DS_SHARED, below; :func:`fused_backward_gluon` runs any fused config for the
A/B, NOTES.md v6.1): after dSᵀ each tile also computes dQᵀ = Kᵀ dSᵀ ([D, BLOCK_M]: wgmma M = D, since
BLOCK_M < 64; A = the transposed view of the K tile, B = dSᵀ stored to shared memory as
bf16/fp16), stores the fp32 accumulator unchanged to a [D, BLOCK_M] shared tile and TMA
reduce-adds it (``cp.reduce.async.bulk.tensor .add``, SASS UTMAREDG) into an fp32 dQᵀ buffer
[B, Hq, D, Sq_pad] through its [B*Hq*D, Sq] view: TMA clips the query columns at Sq, each query
head of a GQA group adds into its own head, and the host returns dQ = softmax_scale * dQᵀ
transposed back. The [D, BLOCK_M] orientation is what keeps the kernel near the split one's
registers: a [BLOCK_M, D] staging tile needs a transposing, many-address store (more spills).
Two CTA barriers per tile (dSᵀ visible to the wgmma; dQ tile visible to the TMA unit, which
doubles as the slot barrier); the previous tile's reduce is waited for (``tma.store_wait``)
before the first. The non-causal masked loops re-read the key block's column intervals
(global memory, L1 hits) in each masked tile instead of holding them in registers. Offline
report (``--fused``, D=128 bf16): 32x64 w4 s3 at 255 registers, 62-115 LDL/STL in the kernel,
inside the tile loops 2 (causal C=0/1), 8 (causal C=2), 18-22 (non-causal C=4/C=2), mostly
LDL reloads of loop invariants, at most 9 per loop; 16x64 w4 none inside the loops; 32x128 w8
up to 75 (causal C=0); D=64 no spills at all. Every (tile, key block) pair reduce-adds a
BLOCK_M x D fp32 tile, so the dQ traffic into L2 is Sq*Sk*D*4/BLOCK_N bytes per head (halved
for causal): at BLOCK_N=64, twice a BLOCK_N=128 kernel's per FLOP (~550 GB for causal 32K,
B=4, H=32, D=128). With FUSE_DQ=False the kernel's SASS is unchanged (``dq_desc`` is None,
a constexpr, so even the parameter list is; checked against the pre-FUSE_DQ source).

Warp specialisation (constexpr WARP_SPEC, default False in the kernel; ``launch_dkdv_gluon(...,
warp_spec=True)``; the library's default dK/dV at D=64 and D=128 on sm_90, measured bitwise
equal to the tl kernel on the H200, NOTES.md v6.2, v6.3): ``gl.warp_specialize`` splits
the program into the compute partition (the NUM_WARPS warps: :func:`_compute_partition`, the
same ``_heads``/``_range``/``_tile`` code, so the same wgmmas in the same order and dK, dV
should be bitwise equal) and a 1-warp producer partition (:func:`_producer_partition`, 24
registers) that walks the same heads and live ranges and TMA-loads every Q/dO tile into the
ring. Each slot has a ``ready`` mbarrier (expect-tx, as before) and an ``empty`` one: the
compute partition arrives on ``empty`` when the tile's wgmmas have retired (:func:`_release_slot`),
the producer waits on it before refilling. The compute warps issue no TMA and no expect-arrive
any more, and their barriers are partition-wide (128 threads), not CTA-wide: per tile 2
``BAR.SYNC`` (Gluon's, before the ready wait and before the empty arrive) instead of 4 plus 2
``UTMALDG``. Registers: allocation is per warpgroup, so the launch has NUM_WARPS + 4 warps; to
keep the non-WS kernel's residency (2 programs per SM at 4 warps, 1 at 8) the kernel is
launched with ``maxnreg`` = :func:`ws_maxnreg` (128 at 4 warps, 168 at 8) and the compute
partition raises itself (setmaxnreg) to what the producer warpgroup gives back: 232 at 4 warps,
240 at 8, i.e. fewer than the non-WS kernel's 255 (no thread holds more than 255, so warp
specialisation cannot give the compute warps more registers at equal residency). Offline
report (``--warp-spec``, D=128 bf16): 32x64 w4 s3/s2 touch 230 registers, 0-50 LDL/STL in the
setup, none in a tile loop, HGMMA as the non-WS kernel; 64x128 w8 s2 spills 46-360 in its loops
(non-WS 42-273; STATS_SMEM, below, removes them); FUSE_DQ + WARP_SPEC at 32x64 w4 (``--fused --warp-spec``) has no spill in its
tile loops (non-WS fused: 2-22). WARP_SPEC=False compiles to the SASS of the kernel before
WARP_SPEC existed, byte for byte (the 30 split and 25 fused variants of both reports, 5 mask
layouts; the tests pin 6 of them by hash). Fragile: ptxas sees the debug-scope labels of the
inlined helpers, and a draft of this refactor renumbered registers in one fused variant.

Stats in shared memory (constexpr STATS_SMEM, default False, WARP_SPEC only;
``launch_dkdv_gluon(..., warp_spec=True, stats_smem=True)``, A/B label suffix ``wsm``; the
D=128 default since v6.4, bitwise equal to tl on the H200): why 64x128 w8 spilled: each tile loaded lse2 and delta
(16 + 16 fp32 per thread in the Sᵀ column slice, 32 scalar predicated LDGs) while Sᵀ ran, and
delta stayed live across both wgmma waits next to dK, dV (128), Sᵀ/Pᵀ (32) and dPᵀ in flight
(32): over the 240 registers, so ptxas spilled them (and the interval words) in every masked
tile. With STATS_SMEM the producer loads the tile's lse2/delta (same masked loads: +inf / 0
past Sq) into a [NUM_STAGES, BLOCK_M] fp32 ring per statistic, under the slot's TMA loads, and
arrives on ``ready`` a second time after storing them (count 2), and ``_tile`` reads lse2 after the Sᵀ wait and delta after the dPᵀ wait (as FA3
reads LSE/dPsum from shared memory); ``_compute_partition`` gets the rings in place of the
pointers and the helpers dispatch on the argument's type, so no shared helper's signature
changed. The masked path also: reloads the non-causal column-interval words per masked tile
(as FUSE_DQ), masks Sᵀ before exp2 (-inf; exp2 gives the +0 the where gave) and classifies the
tile from 4 of the 8 statistics (:func:`_needs_mask` with LEAN, same answer). dK, dV should
stay bit for bit equal. Offline (D=128 bf16): 64x128 w8 s2 and s3 WS have no LDL/STL in their tile loops
for causal C=0/1/2 and non-causal C=0/2/4 (without it 1-360); 64x64 w4 s2 WS 0-40 (was
16-562). A non-WS variant (compute warps staging the next tile's statistics) is not written.

Fused dQ at 64x128 (constexpr DS_SHARED, default False; FUSE_DQ + WARP_SPEC + STATS_SMEM at
BLOCK_M=64, BLOCK_N=128, 8 warps only; ``launch_dkdv_gluon(..., fuse_dq=True, warp_spec=True,
stats_smem=True, ds_shared=True)``, ``fused_backward_gluon`` config ``(64, 128, 8, S, True,
True, True)``, A/B label suffix ``wsmds``; the default backward at D=128 on Hopper since v6.5,
``FUSED_VARIANT``; at D=64 since v6.6 at 64x64 w4, below): FA3's backward tile. dQ is computed once per tile: dQᵀ [D, 64] = Kᵀ dSᵀ with wgmma M = D split over
the two compute warpgroups (each M = 64 of the D rows, N = 64 queries, K = all 128 keys, so
both warpgroups' dSᵀ rows: a partition barrier between them), 32 fp32 registers per thread,
stored to a [D, 64] fp32 tile and TMA reduce-added as two [D, 32] boxes (the existing FUSE_DQ
path already splits dQᵀ's D rows over the warpgroups at 8 warps; at 32x128 its tile is
[D, 32], so 64x128 has the same reduce bytes per FLOP as 32x128 and half those of 32x64).
Its own tile function (:func:`_tile_ds_shared`, :func:`_fused_dq_tail_ds_shared`): Sᵀ and dPᵀ
as the STATS_SMEM path, then Pᵀ and dSᵀ go to shared memory (bf16/fp16, [BLOCK_N, BLOCK_M] each)
and dQᵀ, dV += Pᵀ dO, dK += dSᵀ Q are issued back to back with both A operands from shared
memory (the split kernel has Pᵀ, dSᵀ as register operands: same values, same k-steps, so dK,
dV should stay bit for bit equal); dQᵀ is waited for alone and reduce-added under dV and dK.
What made it fit in 240 registers: (1) no bf16 Pᵀ/dSᵀ operand held in registers (the
register-operand tail spilled 108-222 per kernel in the tile loops); (2) every shared operand
indexed with an opaque copy of the slot or of 0 (inline-asm ``mov``), so the ~30 wgmma
descriptors (64-bit each) are recomputed per tile instead of hoisted as loop invariants that
ptxas kept in local memory (20-55 LDL/STL per loop without it). Offline (D=128 bf16, 6 mask
layouts, s2 and s3): no LDL/STL in the tile loops (0-23 in the per-head setup), 32 HGMMA and
2 UTMAREDG per tile, 5 BAR.SYNC per tile (as the 32x64 fused WS kernel), shared memory
197,868 B at s2 and 231,180 B at s3 (limit 232,448).

FUSE_DQ at BLOCK_M = 64 (found with DS_SHARED): a [D, 64] fp32 tile is 256 bytes wide, a
128-byte-swizzled TMA box at most 128, and Triton lowers one reduce op to one message: the
descriptor's box became [D, 32] (the host-side descriptor of a [D, 64] block too) and one
reduce added only the first 32 queries of each tile. The dQᵀ descriptor is now [D,
min(BLOCK_M, 32)] (:func:`dq_reduce_block`) and a 64-query tile issues two reduces
(:func:`_reduce_dq_tile`); BLOCK_M <= 32 (every config so far) is unchanged.

Fused dQ at D=64 (DS_SHARED at 64x64 w4; :data:`DS_SHARED_TILES`; A/B label ``64x64w4s2wsmds``;
the default backward at D=64 on Hopper since v6.6: on the H200 its dK, dV are bitwise equal to
split's and it is 1.05-1.15x the split backward, NOTES.md v6.6): the same
code as at D=128 (:func:`_tile_ds_shared`, :func:`_fused_dq_tail_ds_shared`,
:func:`_reduce_dq_tile`) with one compute warpgroup: 64 queries x 64 keys, 4 compute warps and
the 1-warp producer. The kernel's one rule for DS_SHARED is D = 16 * NUM_WARPS (one 16-row slice
of dQᵀ per warp; static_assert and :func:`check_config`), which both tiles meet. dQᵀ [64, 64] =
Kᵀ dSᵀ is one wgmma chain per tile, M = D = 64, N = 64 queries, K = the warpgroup's own 64 keys;
B1 and B2 are barriers over the 4 compute warps only (every warp still reads the other warps'
dSᵀ rows; there is no second warpgroup to wait for). 64x128 w8 is not possible at D=64: two
warpgroups would each get M = 32 of dQᵀ's 64 rows, below wgmma's 64 (``check_config`` refuses
it). Offline (``--ds-shared --dims 64 --layouts 1:0,1:1,1:2,0:0,0:2,0:4``: D=64 bf16, causal
C=0/1/2, non-causal C=0/2/4, s2 and s3): no LDL/STL anywhere in the kernel (stack 0), 20 HGMMA
per tile (Sᵀ, dPᵀ, dQᵀ, dV, dK: 4 k-steps of 64x64x16 each; the split 64x64 w4 s2 WS kernel:
16), 2 UTMAREDG per tile ([64, 32] boxes), 5 BAR.SYNC per tile (as at D=128; the split kernel:
2), one ready wait and one empty arrive per tile, no TMA load in the tile loops; the compute
partition at setmaxnreg 232 (maxnreg 128) touches 171-211 registers (split WS kernel: 182-230);
shared memory 83,164-83,180 B at s2 and 100,092-100,108 B at s3 (split: 49,308-49,340), so two
programs per SM as the split kernel (registers: 2 x 8 warps x 128). Generalising the code left
the SASS instruction text of the D=128 DS_SHARED kernel (s2, s3), the D=128 split default
(64x128 w8 s2 WS + STATS_SMEM), the D=64 split default (64x64 w4 s2 WS), 32x64 w4 s3 WS and
fused WS at D=128 and the D=64 FUSE_DQ 64x64 w4 kernel byte for byte unchanged (6 mask layouts
each). As at D=128 the compiler puts the dPᵀ wait before the exp2s of Pᵀ (the source waits after
them), so dPᵀ does not run under that arithmetic in either DS_SHARED kernel. Storing Pᵀ before the
dPᵀ wait keeps ptxas from hoisting it (the DP_LATE_WAIT variant) but measured 0.99-1.01x (the
other warpgroup keeps the tensor cores busy) and was deleted (benchmarks/NOTES.md).

Prediction for the D=64 GPU A/B (session 9; outcome in session 10: 1.05-1.15x split, causal
234 vs 261 ms, full 1.05x, NOTES.md v6.6): split at D=64, causal 32K (Hq=64) is ~252 ms
(Gluon WS dK/dV ~161 ms at ~44% of the tensor-core peak + tl dQ ~89 ms, v6.3 table and
NOTES.md v6.3). The fused kernel does 5 of split's 7 matmuls and one of its two
exp2/mask passes; at D=128 it ran at ~52% of peak, and the D=64 dK/dV kernel runs at ~0.7x
the utilisation of the D=128 one (exp2 work per FLOP doubles at half the head dim), which puts
it at ~215-250 ms: 1.00-1.15x split, ~1.07x most likely, similar on the document masks. Two
programs per SM (independent warpgroups, no cross-warpgroup barrier) are in its favour; the
main risk is the dQ reduce traffic, twice D=128's per FLOP ([64, 64] fp32 per 64x64 tile:
~550 GB for causal 32K B=4, Hq=64, ~2.4 TB/s into L2 at the predicted time, where D=128 ran at
~1.6 TB/s); if that saturates, the fused backward may be slower than split. dK, dV should be
bitwise equal to the tl kernel's and split's (same bf16 values, same 16-query k-steps).

Triton 3.9 (:data:`OPAQUE_INVARIANTS`): its ptxas (CUDA 13) spilled loop invariants in the
tile loops where Triton 3.6-3.8's did not: the per-thread query-row offsets and the hoisted wgmma
descriptors of the shared operands (offline, D=128: DS_SHARED s2 0-108 LDL/STL per kernel in
its tile loops, STATS_SMEM 64x128 0-115, D=256 15-119, fused 32x64 17-166). From 3.9 on, every
tile rebuilds them from opaque values (an inline-asm ``mov`` LLVM cannot see through, as the
DS_SHARED tile always did for its descriptors): K and V from one [2, BLOCK_N, D] buffer in
every variant, the row offsets from one opaque per-thread base (:func:`_tile_rows`), lse2 read
after the mask; and causal C=1 masks (causal documents, sliding windows: one unmasked row
interval per column) test each element with one unsigned compare
(``gluon_common._causal_c1_masked``), where three compares made CUDA 13's ptxas keep the
predicates in general registers. Same values and wgmmas; before 3.9 the constexpr is False and
the kernels are the code checked on the GPU, SASS unchanged.

Not done: prefetching across live ranges / query heads (one TMA latency per range; the
WARP_SPEC producer does run ahead across them), dK left in flight across tiles, two consumer
warpgroups (ping-pong), a Gluon forward and dQ.

The module imports on a CPU-only machine and without gluon: the kernel compiles on first
launch or in :func:`compile_report`; :func:`unavailable_reason` says why it cannot be used.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from .gluon_common import (  # noqa: F401  (the shared Gluon helpers)
    GLUON_IMPORT_ERROR,
    GluonDescriptor,
    _gluon_builtin,
    _jit,
    _opaque_i32,
    _triton_ir,
    gl,
    gluon,
    MAX_THREAD_REGS,
    PRODUCER_REGS,
    PRODUCER_WARPS,
    SM_REGISTERS,
    _column_interval_words,
    _column_intervals,
    _element_masked,
    _gl_dtype,
    _key_block_ranges,
    _load_stats,
    _needs_mask,
    _query_block_ranges,
    _smem_layout,
    thread_barrier,
    tma_load,
    unavailable_reason,
    ws_compute_regs,
    ws_maxnreg,
    ws_programs_per_sm)
from .launcher import TENSOR, Bound, Desc, cdiv, descriptor, launch
from .tiles import _NO_SPEC, LOG2E, _num_intervals  # noqa: F401
from .tl_kernels import check_kv_split, dkdv_outputs, dq_accumulator, finish_dkdv, scale_dq

if GLUON_IMPORT_ERROR is None:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,  # noqa: F401
                                                                   tma, warpgroup_mma,
                                                                   warpgroup_mma_wait, warpgroup_mma_init)


def _triton_at_least(major: int, minor: int, version: str = triton.__version__) -> bool:
    """Whether ``version`` (a Triton version string, e.g. ``3.9.0`` or ``3.9.0+git1234``) is
    ``major.minor`` or later."""
    parts = version.split("+")[0].split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in parts[:2]) >= (major, minor)


#: Triton >= 3.9 assembles sm_90 with CUDA 13's ptxas, which keeps loop invariants of the tile
#: loops in local memory (LDL in every masked tile) where the ptxas of Triton 3.6-3.8 kept
#: them in registers: the 16 query-row offsets of a thread (``offs_mb``, 64-query tiles) and
#: the 64-bit wgmma descriptors of the shared operands that LLVM hoists out of the loops.
#: When set, the tiles rebuild both per tile from opaque values (:func:`_opaque_i32`,
#: :func:`_tile_rows`, :func:`_tile_operands`), read lse2 after the element mask and mask
#: causal C=1 tiles with one compare per element (``_element_masked``'s SHIFT_COLS; same
#: values, same wgmmas). A constexpr that older Triton traces as False, so their kernels
#: are the code they were checked with, unchanged.
OPAQUE_INVARIANTS = gl.constexpr(_triton_at_least(3, 9)) if gl is not None else False




# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@_gluon_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Asynchronous TMA reduce-add of the shared-memory tile ``src`` into the global tile of
    ``tensor_desc`` at ``coord`` (``cp.reduce.async.bulk.tensor ... .add``; one bulk group per
    call, so ``tma.store_wait`` waits for it like for a TMA store). The installed gluon has the
    op in its builder (``create_async_tma_reduce``) but no Python wrapper in ``hopper.tma``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_triton_ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                              tensor_desc.handle, coord, src.handle)


@_jit
def _tile_rows(m, offs_mb, BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
    """The query rows ``m * BLOCK_M + offs_mb`` of tile m (:data:`OPAQUE_INVARIANTS`), the same
    values built per tile from one opaque per-thread base: ``offs_mb`` splits into a thread part
    (the lane and warp bits of the wgmma layout's column index: bits 1-2, and those above the
    instruction's N when warps split the queries) and a register part (the rest: a constant per
    register of the thread), ``(x & T) + (x & R) == x`` for disjoint T, R covering x. Written
    ``m * BLOCK_M + offs_mb`` LLVM reassociates it to ``m * BLOCK_M | (lane part | constant)``
    and hoists the 16 ``lane part | constant`` values of a 64-query tile out of the loop, where
    CUDA 13's ptxas keeps them in local memory (16 LDL per masked tile); behind the opaque
    base each row is one add of a constant inside the tile (compare the rows with nothing but
    loop-variant values: ``_element_masked``'s SHIFT_COLS). (The split is exact for any masks: a
    wrong guess of the layout would only cost the optimisation.)"""
    COL_N: gl.constexpr = s_layout.instr_shape[1]
    REG_BITS: gl.constexpr = (COL_N - 1) - ((COL_N - 1) & 6)
    THREAD_BITS: gl.constexpr = (BLOCK_M - 1) - REG_BITS
    base = _opaque_i32(m * BLOCK_M + (offs_mb & THREAD_BITS), True)
    return base + (offs_mb & REG_BITS)


@_gluon_builtin
def _opaque_zero(like, _semantic=None):
    """0 (int32) through an inline-asm ``mov`` that LLVM cannot see through, as
    :func:`_opaque_i32` (not pure: a new value per call); ``like`` (int32) is only the asm's
    operand (the elementwise asm needs one)."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [like], dtype=gl.int32,
                                     is_pure=False, pack=1, _semantic=_semantic)


@_gluon_builtin
def _tile_operands(slot, q_ring, do_ring, kv_smem, _semantic=None):
    """(oz, q_s, do_s, k_s, v_s) of one tile: an opaque 0 (:func:`_opaque_zero`) and the slot's
    Q and dO tiles and the K and V tiles of the kernel's [2, BLOCK_N, D] K/V buffer, indexed
    with it and an opaque copy of the ring slot (:func:`_opaque_i32`), so that their wgmma
    descriptors are recomputed per tile (why: :func:`_tile_ds_shared`); ``oz`` indexes the
    caller's other shared operands the same way. Used by :func:`_tile_ds_shared` always and by
    :func:`_tile` under :data:`OPAQUE_INVARIANTS`.

    A builtin (as the two above), not a jitted function, so that its ops land in the caller's
    debug scope: a jitted helper is inlined with a scope of its own, which LLVM brackets with
    labels in the PTX, and ptxas schedules across those labels differently (a jitted version
    gave the DS_SHARED kernels other register assignments on Triton 3.6-3.8 for non-causal
    masks; as builtins their SASS is that of these ops written out in the tile)."""
    def index(buf, i):
        return buf.index(i, _semantic=_semantic)

    oslot = _opaque_i32(slot, _semantic=_semantic)
    oz = _opaque_zero(slot, _semantic=_semantic)
    return (oz, index(q_ring, oslot), index(do_ring, oslot), index(kv_smem, oz),
            index(kv_smem, oz.__add__(1, _semantic=_semantic)))


@_jit
def _issue_tile(q_desc, do_desc, q_ring, do_ring, ready, slot, row, col, pred):
    """TMA loads of one Q tile and one dO tile into ring slot ``slot`` (skipped unless pred)."""
    bar = ready.index(slot)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
    tma_load(q_desc, [row, col], bar, q_ring.index(slot), pred=pred)
    tma_load(do_desc, [row, col], bar, do_ring.index(slot), pred=pred)


@_jit
def _fused_dq_tail(dv_tok, p16, dsT, dk, q_s, k_smem, ds_smem, dq_smem, dq_desc, dq_row, dq_col,
                   s_layout: gl.constexpr, a_layout: gl.constexpr):
    """The FUSE_DQ end of a tile (dV += Pᵀ dO in flight): dK += dSᵀ Q and dQᵀ = Kᵀ dSᵀ
    (A = Kᵀ, the transposed view of the K tile: an MN-major 16-bit operand; B = dSᵀ from
    ``ds_smem``), then the [D, BLOCK_M] dQᵀ tile goes to ``dq_smem`` (the wgmma layout stored
    as is, no transpose) and is TMA reduce-added at (dq_row, dq_col) of the dQᵀ view. Returns
    (dv, dk) with every wgmma retired and all warps past a CTA barrier (the slot may be refilled).

    Barriers: B1 after dSᵀ is in ``ds_smem`` (the wgmma reads what every warp wrote; it also
    orders this tile's ``dq_smem`` writes after the previous tile's reduce has read it: the
    issuing thread waits for that read, ``tma.store_wait(0)``, before B1); B2 after dQ is in
    ``dq_smem`` (the reduce reads every warp's part; it doubles as the slot barrier)."""
    dtype: gl.constexpr = q_s.dtype
    D: gl.constexpr = k_smem.shape[1]
    BLOCK_M: gl.constexpr = q_s.shape[0]
    ds_t = dsT.to(dtype)
    ds16 = gl.convert_layout(ds_t, a_layout)
    dk_tok = warpgroup_mma(ds16, q_s, dk, is_async=True)
    ds_smem.store(ds_t)
    tma.store_wait(0)  # the previous tile's reduce has read dq_smem
    fence_async_shared()
    thread_barrier()  # B1
    dq_zero = gl.zeros([D, BLOCK_M], gl.float32, s_layout)
    dq_tok = warpgroup_mma(k_smem.permute((1, 0)), ds_smem, dq_zero, use_acc=False,
                           is_async=True)
    dv, dk, p16, ds16, dqT = warpgroup_mma_wait(num_outstanding=0,
                                                deps=(dv_tok, dk_tok, p16, ds16, dq_tok))
    dq_smem.store(dqT)
    fence_async_shared()
    thread_barrier()  # B2
    if dq_desc.block_type.shape[1] == BLOCK_M:  # one TMA message (BLOCK_M <= 32)
        _tma_reduce_add(dq_desc, [dq_row, dq_col], dq_smem)
    else:
        _reduce_dq_tile(dq_desc, dq_row, dq_col, dq_smem)
    return dv, dk


@_jit
def _reduce_dq_tile(dq_desc, dq_row, dq_col, dq_smem):
    """TMA reduce-add of the [D, BLOCK_M] fp32 tile ``dq_smem`` at (dq_row, dq_col) of the dQᵀ
    view: one reduce per [D, CHUNK] column block of the descriptor (CHUNK = min(BLOCK_M, 32):
    a 128-byte-swizzled TMA box is at most 128 bytes wide and Triton's reduce lowering issues
    one message, so BLOCK_M = 64 needs two; the shared tile is two [D, 32] blocks)."""
    BLOCK_M: gl.constexpr = dq_smem.shape[1]
    CHUNK: gl.constexpr = dq_desc.block_type.shape[1]
    if CHUNK == BLOCK_M:
        _tma_reduce_add(dq_desc, [dq_row, dq_col], dq_smem)
    else:
        for j in gl.static_range(BLOCK_M // CHUNK):
            _tma_reduce_add(dq_desc, [dq_row, dq_col + j * CHUNK],
                            dq_smem.slice(j * CHUNK, CHUNK, dim=1))


@_jit
def _fused_dq_tail_ds_shared(dv, pT, dsT, dk, q_s, do_s, k_smem, ds_s, p_s, dq_smem, dq_desc,
                             dq_row, dq_col, s_layout: gl.constexpr,
                             ):
    """The DS_SHARED end of a tile (FUSE_DQ + WARP_SPEC + STATS_SMEM, 64 queries, D = 16 *
    NUM_WARPS: 64x128 w8 at D=128, 64x64 w4 at D=64; Pᵀ and dSᵀ in fp32 registers, no wgmma in
    flight): Pᵀ and dSᵀ go to shared memory as bf16/fp16 (``p_s``, ``ds_s``: two [BLOCK_N,
    BLOCK_M] buffers of the kernel), then three wgmmas read them from there:

    * dQᵀ = Kᵀ dSᵀ ([D, 64]: each warpgroup M = 64 of the D rows, N = 64 queries, K = all
      BLOCK_N keys, i.e. every warpgroup's dSᵀ rows; 32 fp32 registers per thread), issued
      first. At D=128 (two warpgroups) each computes half of dQᵀ from both warpgroups' keys; at
      D=64 (one warpgroup) it computes all of dQᵀ from its own 64 keys;
    * dV += Pᵀ dO and dK += dSᵀ Q (A = this warpgroup's 64 rows of the tile: the same bf16
      values and k-steps as the register operands of the split kernel, so dK and dV should stay
      bit for bit equal).

    dQᵀ is waited for alone (dV, dK stay in flight), stored to ``dq_smem`` and reduce-added,
    [D, 32] per TMA message (:func:`_reduce_dq_tile`), under dV and dK. No register holds a
    bf16 Pᵀ or dSᵀ operand: the most a thread holds is dK, dV (128 at D=128, 64 at D=64) and
    Sᵀ, dPᵀ (64) in the score phase. Returns (dv, dk) with every wgmma retired (the caller
    hands the slot back behind a partition barrier).

    Barriers (partition-wide: both warpgroups at D=128, the one at D=64): B1 after Pᵀ and dSᵀ
    are in shared memory (the dQ wgmma reads every warp's dSᵀ rows, the other warpgroup's too
    at D=128; the issuing thread first waits, ``tma.store_wait(0)``, until the previous tile's
    reduces have read ``dq_smem``, which this tile overwrites after B1); B2 after dQᵀ is in
    ``dq_smem`` (the reduce reads every warp's part). ``ds_s`` and ``p_s`` are overwritten by
    the next tile only after B2 (every dQ wgmma retired) and the slot barrier (every dV, dK
    wgmma retired)."""
    dtype: gl.constexpr = q_s.dtype
    D: gl.constexpr = k_smem.shape[1]
    BLOCK_M: gl.constexpr = q_s.shape[0]
    p_s.store(pT.to(dtype))
    ds_s.store(dsT.to(dtype))
    tma.store_wait(0)  # the previous tile's reduces have read dq_smem
    fence_async_shared()
    thread_barrier()  # B1
    dq_zero = gl.zeros([D, BLOCK_M], gl.float32, s_layout)
    dq_tok = warpgroup_mma(k_smem.permute((1, 0)), ds_s, dq_zero, use_acc=False,
                           is_async=True)
    dv_tok = warpgroup_mma(p_s, do_s, dv, is_async=True)
    dk_tok = warpgroup_mma(ds_s, q_s, dk, is_async=True)
    dqT = warpgroup_mma_wait(num_outstanding=2, deps=(dq_tok, ))
    dq_smem.store(dqT)
    fence_async_shared()
    thread_barrier()  # B2
    _reduce_dq_tile(dq_desc, dq_row, dq_col, dq_smem)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok))
    return dv, dk


@_jit
def _tile(dk, dv, it, m, hi, k_smem, v_smem, q_ring, do_ring, ready, empty, q_desc, do_desc,
          lse2_ptr, delta_ptr, stat_row0, q_row0, q_col, offs_mb, cols, ivals, stats, n_blk,
          Sq, Sk, scale_log2, ds_smem, dq_smem, dq_desc, dq_row0, s_layout: gl.constexpr,
          a_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
          MASKED: gl.constexpr, FUSE_DQ: gl.constexpr, WARP_SPEC: gl.constexpr):
    """dK, dV += one query tile (block m, ring counter it); refills its slot with tile
    m + NUM_STAGES when that is still in [.., hi). Returns (dk, dv, it + 1).

    WARP_SPEC: the slot is not refilled here but handed back to the producer partition
    (:func:`_release_slot` on ``empty``); the math is the same, instruction for instruction.

    FUSE_DQ: also dQ[tile] += dS K, as dQᵀ = Kᵀ dSᵀ (wgmma M = D: BLOCK_M is below the
    64-row minimum), reduce-added (unscaled fp32) into ``dq_desc`` (:func:`_fused_dq_tail`).
    Without it, ds_smem/dq_smem/dq_desc/dq_row0 are None and the code is the split kernel's."""
    dtype: gl.constexpr = q_desc.dtype
    slot = it % NUM_STAGES
    mbarrier.wait(ready.index(slot), (it // NUM_STAGES) & 1)
    if OPAQUE_INVARIANTS:  # k_smem = v_smem: the [2, BLOCK_N, D] K/V buffer
        oz, q_s, do_s, k_smem, v_smem = _tile_operands(slot, q_ring, do_ring, k_smem)
        if FUSE_DQ:  # the [1, BLOCK_N, BLOCK_M] dSᵀ buffer
            ds_smem = ds_smem.index(oz)
    else:
        q_s = q_ring.index(slot)
        do_s = do_ring.index(slot)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    s_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    if OPAQUE_INVARIANTS:
        rows = _tile_rows(m, offs_mb, BLOCK_M, s_layout)
    else:
        rows = m * BLOCK_M + offs_mb
    if isinstance(lse2_ptr, gl.shared_memory_descriptor):
        # STATS_SMEM: lse2/delta of this tile sit in ring slot ``slot`` (the producer loaded
        # them); read each where it is used, so neither is live across the wgmmas
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        if not OPAQUE_INVARIANTS:
            lse2 = lse2_ptr.index(slot).load(gl.SliceLayout(0, s_layout))
    else:
        rvalid = rows < Sq
        lse2 = gl.load(lse2_ptr + stat_row0 + rows, mask=rvalid, other=float("inf"))
        delta = gl.load(delta_ptr + stat_row0 + rows, mask=rvalid, other=0.0)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    if MASKED and isinstance(lse2_ptr, gl.shared_memory_descriptor):
        # STATS_SMEM: mask the scores before exp2 (exp2(-inf) = +0, the 0.0 of the where below)
        if _needs_mask(m, n_blk, Sq, Sk, stats, BLOCK_M, BLOCK_N, CAUSAL, NI, True):
            if not CAUSAL:
                iv = _column_intervals(ivals, cols, Sq, Sk, CAUSAL, C)
            else:
                iv = ivals
            masked = _element_masked(rows[None, :], cols[:, None], iv, Sq, Sk, CAUSAL, C,
                                     OPAQUE_INVARIANTS)
            sT = gl.where(masked, float("-inf"), sT)
    if OPAQUE_INVARIANTS and isinstance(lse2_ptr, gl.shared_memory_descriptor):
        lse2 = lse2_ptr.index(slot).load(gl.SliceLayout(0, s_layout))  # not live in the mask
    pT = gl.exp2(sT * scale_log2 - lse2[None, :])
    if MASKED and not isinstance(lse2_ptr, gl.shared_memory_descriptor):
        if _needs_mask(m, n_blk, Sq, Sk, stats, BLOCK_M, BLOCK_N, CAUSAL, NI):
            if (FUSE_DQ or isinstance(lse2_ptr, gl.shared_memory_descriptor)) and not CAUSAL:
                # ivals: the column pointer (see _heads)
                iv = _column_intervals(ivals, cols, Sq, Sk, CAUSAL, C)
            else:
                iv = ivals
            masked = _element_masked(rows[None, :], cols[:, None], iv, Sq, Sk, CAUSAL, C,
                                     OPAQUE_INVARIANTS)
            pT = gl.where(masked, 0.0, pT)
    p16 = gl.convert_layout(pT.to(dtype), a_layout)
    dv_tok = warpgroup_mma(p16, do_s, dv, is_async=True)
    dpT, p16 = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, p16))
    if isinstance(delta_ptr, gl.shared_memory_descriptor):
        delta = delta_ptr.index(slot).load(gl.SliceLayout(0, s_layout))
    dsT = pT * (dpT - delta[None, :])
    if FUSE_DQ:
        dv, dk = _fused_dq_tail(dv_tok, p16, dsT, dk, q_s, k_smem, ds_smem, dq_smem, dq_desc,
                                dq_row0, m * BLOCK_M, s_layout, a_layout)
    else:
        ds16 = gl.convert_layout(dsT.to(dtype), a_layout)
        dk_tok = warpgroup_mma(ds16, q_s, dk, is_async=True)
        dv, dk, p16, ds16 = warpgroup_mma_wait(num_outstanding=0,
                                               deps=(dv_tok, dk_tok, p16, ds16))
        thread_barrier()  # every warpgroup is done with the slot before TMA overwrites it
    if WARP_SPEC:
        _release_slot(empty, slot)
    else:
        nxt = m + NUM_STAGES
        _issue_tile(q_desc, do_desc, q_ring, do_ring, ready, slot, q_row0 + nxt * BLOCK_M,
                    q_col, nxt < hi)
    return dk, dv, it + 1


@_jit
def _tile_ds_shared(dk, dv, it, m, k_smem, v_smem, q_ring, do_ring, ready, empty, lse_ring,
                    delta_ring, offs_mb, cols, ivals, stats, n_blk, Sq, Sk, scale_log2, ds_smem,
                    dq_smem, dq_desc, dq_row0, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    C: gl.constexpr, NI: gl.constexpr, MASKED: gl.constexpr):
    """DS_SHARED twin of :func:`_tile` (FUSE_DQ + WARP_SPEC + STATS_SMEM at 64x128 w8, D=128,
    or 64x64 w4, D=64; the kernel maps DS_SHARED to FUSE_DQ = 2 for the shared helpers): the
    same Sᵀ, Pᵀ, dPᵀ, dSᵀ arithmetic as the STATS_SMEM path of :func:`_tile` (masked scores
    set to -inf before exp2, lse2 read after the Sᵀ wait, delta after the dPᵀ wait), then
    :func:`_fused_dq_tail_ds_shared` (dV, dK and dQ from Pᵀ and dSᵀ in shared memory) and the
    slot handed back. Returns (dk, dv, it + 1).

    dPᵀ runs under the Pᵀ arithmetic as in :func:`_tile`, but dV is issued only in the tail
    (with dK and dQ): no bf16 Pᵀ operand sits in registers while dSᵀ is computed.

    Every shared operand is indexed with an opaque copy of the slot or of 0 (an inline-asm
    ``mov`` that LLVM cannot see through: :func:`_tile_operands`; so it is the kernel's K/V
    buffer ``k_smem`` = [2, BLOCK_N, D] and the tuple ``ds_smem`` = ([1, BLOCK_N, BLOCK_M]
    for dSᵀ, [1, BLOCK_N, BLOCK_M] for Pᵀ) that come in here): the wgmma descriptors are then
    recomputed per tile (a few integer ops) instead of being hoisted out of the tile loops as
    ~30 64-bit loop invariants, which ptxas kept in local memory (20-55 LDL/STL per tile loop;
    0 with the opaque indices). dSᵀ and Pᵀ are two allocations, not one [2, ...] buffer: with
    an opaque index into one buffer Triton's barrier analysis cannot tell the two stores apart
    and puts a CTA barrier between them (6 BAR.SYNC per tile instead of 5)."""
    dtype: gl.constexpr = k_smem.dtype
    slot = it % NUM_STAGES
    mbarrier.wait(ready.index(slot), (it // NUM_STAGES) & 1)
    oz, q_s, do_s, k_smem, v_smem = _tile_operands(slot, q_ring, do_ring, k_smem)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    s_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    sT = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    if not OPAQUE_INVARIANTS:
        lse2 = lse_ring.index(slot).load(gl.SliceLayout(0, s_layout))
    if MASKED:
        if OPAQUE_INVARIANTS:
            rows = _tile_rows(m, offs_mb, BLOCK_M, s_layout)
        else:
            rows = m * BLOCK_M + offs_mb
        if _needs_mask(m, n_blk, Sq, Sk, stats, BLOCK_M, BLOCK_N, CAUSAL, NI, True):
            if not CAUSAL:
                iv = _column_intervals(ivals, cols, Sq, Sk, CAUSAL, C)
            else:
                iv = ivals
            masked = _element_masked(rows[None, :], cols[:, None], iv, Sq, Sk, CAUSAL, C,
                                     OPAQUE_INVARIANTS)
            sT = gl.where(masked, float("-inf"), sT)
    if OPAQUE_INVARIANTS:  # read after the mask: not live across it
        lse2 = lse_ring.index(slot).load(gl.SliceLayout(0, s_layout))
    pT = gl.exp2(sT * scale_log2 - lse2[None, :])
    dpT = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
    delta = delta_ring.index(slot).load(gl.SliceLayout(0, s_layout))
    dsT = pT * (dpT - delta[None, :])
    dv, dk = _fused_dq_tail_ds_shared(dv, pT, dsT, dk, q_s, do_s, k_smem,
                                      ds_smem[0].index(oz), ds_smem[1].index(oz), dq_smem,
                                      dq_desc, dq_row0, m * BLOCK_M, s_layout)
    _release_slot(empty, slot)
    return dk, dv, it + 1


@_jit
def _tile_of_variant(dk, dv, it, m, hi, k_smem, v_smem, q_ring, do_ring, ready, empty, q_desc,
                     do_desc, lse2_ptr, delta_ptr, stat_row0, q_row0, q_col, offs_mb, cols,
                     ivals, stats, n_blk, Sq, Sk, scale_log2, ds_smem, dq_smem, dq_desc,
                     dq_row0, s_layout: gl.constexpr, a_layout: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                     MASKED: gl.constexpr, FUSE_DQ: gl.constexpr, WARP_SPEC: gl.constexpr):
    """One query tile of the kernel variant: :func:`_tile_ds_shared` for DS_SHARED (FUSE_DQ
    == 2), else :func:`_tile`."""
    if FUSE_DQ == 2:
        dk, dv, it = _tile_ds_shared(dk, dv, it, m, k_smem, v_smem, q_ring, do_ring, ready,
                                     empty, lse2_ptr, delta_ptr, offs_mb, cols, ivals, stats,
                                     n_blk, Sq, Sk, scale_log2, ds_smem, dq_smem, dq_desc,
                                     dq_row0, s_layout, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C,
                                     NI, MASKED)
    else:
        dk, dv, it = _tile(dk, dv, it, m, hi, k_smem, v_smem, q_ring, do_ring, ready, empty,
                           q_desc, do_desc, lse2_ptr, delta_ptr, stat_row0, q_row0, q_col,
                           offs_mb, cols, ivals, stats, n_blk, Sq, Sk, scale_log2, ds_smem,
                           dq_smem, dq_desc, dq_row0, s_layout, a_layout, BLOCK_M, BLOCK_N,
                           NUM_STAGES, CAUSAL, C, NI, MASKED, FUSE_DQ, WARP_SPEC)
    return dk, dv, it


@_jit
def _segment(lo, flo, fhi, hi, SEG: gl.constexpr):
    """Bounds of segment ``SEG`` of a clamped live range: 0 = masked [lo, flo), 1 = mask-free
    [flo, fhi), 2 = masked [fhi, hi)."""
    first = lo
    last = flo
    if SEG == 1:
        first = flo
        last = fhi
    if SEG == 2:
        first = fhi
        last = hi
    return first, last


@_jit
def _range(dk, dv, it, lo, flo, fhi, hi, k_smem, v_smem, q_ring, do_ring, ready, empty, q_desc,
           do_desc, lse2_ptr, delta_ptr, stat_row0, q_row0, q_col, offs_mb, cols, ivals, stats,
           n_blk, Sq, Sk, scale_log2, ds_smem, dq_smem, dq_desc, dq_row0,
           s_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
           C: gl.constexpr, NI: gl.constexpr, FUSE_DQ: gl.constexpr,
           WARP_SPEC: gl.constexpr = False):
    """One live range [lo, hi) of query blocks: fill the ring (WARP_SPEC: the producer
    partition does), then masked [lo, flo), mask-free [flo, fhi), masked [fhi, hi) (tiles in
    order, so the ring order holds: ``hi - lo`` tiles, none when hi <= lo, as the producer's
    :func:`_produce_range` counts them)."""
    flo = gl.minimum(gl.maximum(flo, lo), hi)
    fhi = gl.minimum(gl.maximum(fhi, flo), hi)
    if not WARP_SPEC:
        for j in gl.static_range(NUM_STAGES):
            _issue_tile(q_desc, do_desc, q_ring, do_ring, ready, (it + j) % NUM_STAGES,
                        q_row0 + (lo + j) * BLOCK_M, q_col, lo + j < hi)
    for seg in gl.static_range(3):  # masked [lo, flo), mask-free [flo, fhi), masked [fhi, hi)
        first, last = _segment(lo, flo, fhi, hi, seg)
        for m in range(first, last):
            dk, dv, it = _tile_of_variant(dk, dv, it, m, hi, k_smem, v_smem, q_ring, do_ring,
                                          ready, empty, q_desc, do_desc, lse2_ptr, delta_ptr,
                                          stat_row0, q_row0, q_col, offs_mb, cols, ivals, stats,
                                          n_blk, Sq, Sk, scale_log2, ds_smem, dq_smem, dq_desc,
                                          dq_row0, s_layout, a_layout, BLOCK_M, BLOCK_N,
                                          NUM_STAGES, CAUSAL, C, NI, seg != 1, FUSE_DQ,
                                          WARP_SPEC)
    return dk, dv, it


@_jit
def _release_slot(empty, slot):
    """WARP_SPEC: hand ring slot ``slot`` back to the producer (one arrive on its ``empty``
    barrier, count 1). Gluon lowers the arrive to one thread of the compute partition behind a
    partition-wide barrier (``bar.sync`` over the compute warps only, not the producer), so
    every compute warp has retired the wgmmas that read the slot before it may be refilled."""
    mbarrier.arrive(empty.index(slot))


@_jit
def _produce_range(q_desc, do_desc, q_ring, do_ring, ready, empty, it, lo, hi, q_row0, q_col,
                   BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """WARP_SPEC producer: the Q and dO tiles of live range [lo, hi) into the ring, in the
    order the compute partition consumes them (ring counter ``it``: slot it % NUM_STAGES).
    Waits until the slot's previous tile was released (``empty``, parity one behind: a fresh
    barrier counts as released), then issues both TMA loads on the slot's ``ready`` barrier."""
    for m in range(lo, hi):
        slot = it % NUM_STAGES
        mbarrier.wait(empty.index(slot), ((it // NUM_STAGES) & 1) ^ 1)
        _issue_tile(q_desc, do_desc, q_ring, do_ring, ready, slot, q_row0 + m * BLOCK_M, q_col,
                    True)
        it += 1
    return it


@_jit
def _producer_partition(n_blk, b, hk, b64, group, q_desc, do_desc, q_ring, do_ring, ready, empty,
                        rng_ptr, Sq, Sk, Hq, Hm, NQB, NKB, mask_b_stride, lse2_ptr, delta_ptr,
                        lse_ring, delta_ring, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr):
    """WARP_SPEC worker (1 warp, few registers): the Q/dO (and with STATS_SMEM lse2/delta)
    tiles of one key block (:func:`_produce_heads`)."""
    _produce_heads(n_blk * 0, n_blk, b, hk, b64, group, q_desc, do_desc, q_ring, do_ring, ready,
                   empty, rng_ptr, Sq, Sk, Hq, Hm, NQB, NKB, mask_b_stride, lse2_ptr, delta_ptr,
                   lse_ring, delta_ring, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C)


@_jit
def _produce_heads(it, n_blk, b, hk, b64, group, q_desc, do_desc, q_ring, do_ring, ready, empty,
                   rng_ptr, Sq, Sk, Hq, Hm, NQB, NKB, mask_b_stride, lse2_ptr, delta_ptr,
                   lse_ring, delta_ring, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, C: gl.constexpr):
    """The producer's walk over one key block: the same query heads and live ranges as
    :func:`_heads` (same ``_key_block_ranges``), loading their tiles into the ring from ring
    counter ``it`` on; scalars only. With STATS_SMEM (``lse_ring`` a shared ring, else a
    placeholder 0) also each tile's lse2/delta (:func:`_produce_range_stats`). Returns the
    ring counter after the key block's last tile."""
    for g in range(0, group):
        h = hk * group + g
        mbh = b64 * mask_b_stride + h // (Hq // Hm)
        lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1 = _key_block_ranges(
            rng_ptr, mbh, n_blk, Sq, Sk, NQB, BLOCK_M, BLOCK_N, CAUSAL, C, NKB)
        if isinstance(lse_ring, gl.shared_memory_descriptor):
            stat_row0 = (b64 * Hq + h) * Sq
            it = _produce_range_stats(q_desc, do_desc, q_ring, do_ring, ready, empty, it, lo0,
                                      hi0, b * Sq, h * (q_desc.block_type.shape[1]), lse2_ptr,
                                      delta_ptr, stat_row0, lse_ring, delta_ring, Sq, BLOCK_M,
                                      NUM_STAGES)
            it = _produce_range_stats(q_desc, do_desc, q_ring, do_ring, ready, empty, it, lo1,
                                      hi1, b * Sq, h * (q_desc.block_type.shape[1]), lse2_ptr,
                                      delta_ptr, stat_row0, lse_ring, delta_ring, Sq, BLOCK_M,
                                      NUM_STAGES)
        else:
            it = _produce_range(q_desc, do_desc, q_ring, do_ring, ready, empty, it, lo0, hi0,
                                b * Sq, h * (q_desc.block_type.shape[1]), BLOCK_M, NUM_STAGES)
            it = _produce_range(q_desc, do_desc, q_ring, do_ring, ready, empty, it, lo1, hi1,
                                b * Sq, h * (q_desc.block_type.shape[1]), BLOCK_M, NUM_STAGES)
    return it


@_jit
def _produce_range_stats(q_desc, do_desc, q_ring, do_ring, ready, empty, it, lo, hi, q_row0,
                         q_col, lse2_ptr, delta_ptr, stat_row0, lse_ring, delta_ring, Sq,
                         BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """STATS_SMEM twin of :func:`_produce_range`: also loads the tile's lse2 (+inf past Sq) and
    delta (0 past Sq), the ``tl`` kernel's masked loads, into the slot's fp32 rows of
    ``lse_ring``/``delta_ring``. The ``ready`` barriers count 2 arrivals here: the
    expect-arrive that starts the TMA loads, then (the global loads of the statistics in flight
    under the TMA) a plain arrive after the shared stores (release: the compute partition's
    wait on ``ready`` sees them)."""
    st_layout: gl.constexpr = gl.BlockedLayout([(BLOCK_M + 31) // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK_M, layout=st_layout)
    for m in range(lo, hi):
        slot = it % NUM_STAGES
        mbarrier.wait(empty.index(slot), ((it // NUM_STAGES) & 1) ^ 1)
        _issue_tile(q_desc, do_desc, q_ring, do_ring, ready, slot, q_row0 + m * BLOCK_M, q_col,
                    True)
        rows = m * BLOCK_M + offs
        rvalid = rows < Sq
        lse2 = gl.load(lse2_ptr + stat_row0 + rows, mask=rvalid, other=float("inf"))
        delta = gl.load(delta_ptr + stat_row0 + rows, mask=rvalid, other=0.0)
        lse_ring.index(slot).store(lse2)
        delta_ring.index(slot).store(delta)
        thread_barrier()  # every lane's stores before the (one-thread) arrive
        mbarrier.arrive(ready.index(slot))
        it += 1
    return it


@_jit
def _heads(dk, dv, it, n_blk, b, hk, b64, group, k_smem, v_smem, q_ring, do_ring, ready, empty,
           q_desc, do_desc, lse2_ptr, delta_ptr, mask_ptr, sum_ptr, rng_ptr, scale_log2, Sq, Sk,
           Hq, Hk, Hm, NQB, NKB, mask_b_stride, ds_smem, dq_smem, dq_desc, cols, offs_mb,
           s_layout: gl.constexpr, a_layout: gl.constexpr, D: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
           CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr, FUSE_DQ: gl.constexpr,
           WARP_SPEC: gl.constexpr):
    """dK, dV of key block ``n_blk`` (batch b, KV head hk, ``group`` query heads) over the
    query heads of its group: per head the key block's ranges, statistics and column
    intervals, then its two live ranges (:func:`_range`), from ring counter ``it`` on (tile t
    sits in slot t % NUM_STAGES, parity (t // NUM_STAGES) & 1). Returns (dk, dv, it). (The
    program indices come from the kernel, computed where the split kernel always computed
    them: the WARP_SPEC=False kernel's instruction order, hence its SASS, is the pre-WARP_SPEC
    one.)"""
    for g in range(0, group):
        h = hk * group + g
        hm = h // (Hq // Hm)
        mbh = b64 * mask_b_stride + hm
        lo0, flo0, fhi0, hi0, lo1, flo1, fhi1, hi1 = _key_block_ranges(
            rng_ptr, mbh, n_blk, Sq, Sk, NQB, BLOCK_M, BLOCK_N, CAUSAL, C, NKB)
        stats = _load_stats(sum_ptr, mbh, n_blk, NKB, NI)
        if (FUSE_DQ or isinstance(lse2_ptr, gl.shared_memory_descriptor)) and not CAUSAL:
            # the fused and the STATS_SMEM kernels' non-causal masked loops reload the column
            # intervals per masked tile (L1 hits) instead of holding them: fewer spills inside
            # the loops
            ivals = mask_ptr + mbh * Sk * C
        else:
            ivals = _column_intervals(mask_ptr + mbh * Sk * C, cols, Sq, Sk, CAUSAL, C)
        stat_row0 = (b64 * Hq + h) * Sq
        if FUSE_DQ:
            dq_row0 = (b * Hq + h) * D  # this head's D rows of the [B*Hq*D, Sq] dQᵀ view
        else:
            dq_row0 = None
        q_row0 = b * Sq
        q_col = h * D
        dk, dv, it = _range(dk, dv, it, lo0, flo0, fhi0, hi0, k_smem, v_smem, q_ring, do_ring,
                            ready, empty, q_desc, do_desc, lse2_ptr, delta_ptr, stat_row0,
                            q_row0, q_col, offs_mb, cols, ivals, stats, n_blk, Sq, Sk,
                            scale_log2, ds_smem, dq_smem, dq_desc, dq_row0, s_layout, a_layout,
                            BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI, FUSE_DQ, WARP_SPEC)
        dk, dv, it = _range(dk, dv, it, lo1, flo1, fhi1, hi1, k_smem, v_smem, q_ring, do_ring,
                            ready, empty, q_desc, do_desc, lse2_ptr, delta_ptr, stat_row0,
                            q_row0, q_col, offs_mb, cols, ivals, stats, n_blk, Sq, Sk,
                            scale_log2, ds_smem, dq_smem, dq_desc, dq_row0, s_layout, a_layout,
                            BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI, FUSE_DQ, WARP_SPEC)
    return dk, dv, it


@_jit
def _compute_partition(n_blk, b, hk, b64, group, k_smem, v_smem, q_ring, do_ring, ready, empty,
                       kv_bar, q_desc, do_desc, lse2_ptr, delta_ptr, mask_ptr, sum_ptr, rng_ptr,
                       scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride, ds_smem, dq_smem,
                       dq_desc,
                       s_layout: gl.constexpr, acc_layout: gl.constexpr,
                       a_layout: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       C: gl.constexpr, NI: gl.constexpr, FUSE_DQ: gl.constexpr):
    """WARP_SPEC default partition (the kernel's NUM_WARPS warps): the split kernel's compute
    from K/V's arrival to the accumulators, with the ring filled by the producer. Returns a
    tuple (dk, dv) (``gl.warp_specialize`` flattens the default partition's results)."""
    c0 = n_blk * BLOCK_N
    cols = c0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_mb = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    dk = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    dk, dv, _ = _heads(dk, dv, n_blk * 0, n_blk, b, hk, b64, group, k_smem, v_smem, q_ring,
                       do_ring, ready, empty, q_desc, do_desc, lse2_ptr, delta_ptr, mask_ptr,
                       sum_ptr, rng_ptr, scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride,
                       ds_smem, dq_smem, dq_desc, cols, offs_mb, s_layout, a_layout, D, BLOCK_M,
                       BLOCK_N, NUM_STAGES, CAUSAL, C, NI, FUSE_DQ, True)
    if FUSE_DQ:
        tma.store_wait(0)  # the last reduce has read dq_smem
    return (dk, dv)


@_jit(do_not_specialize=_NO_SPEC)
def _dkdv_gluon_kernel(q_desc, do_desc, k_desc, v_desc, dk_ptr, dv_ptr, lse2_ptr, delta_ptr,
                       mask_ptr, sum_ptr, rng_ptr, sm_scale, scale_log2,
                       Sq, Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride, dq_desc,
                       D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       CAUSAL: gl.constexpr, C: gl.constexpr, NI: gl.constexpr,
                       NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                       FUSE_DQ: gl.constexpr = False, WARP_SPEC: gl.constexpr = False,
                       STATS_SMEM: gl.constexpr = False, DS_SHARED: gl.constexpr = False,
                       KV_SPLIT: gl.constexpr = 1):
    """One program per (key block, batch * KV head); loops over the query heads of its group.
    KV_SPLIT > 1: the group is split over KV_SPLIT programs (one per (key block, batch * KV head
    * KV_SPLIT)); each writes its partial dK, dV as an output head of its own (dK/dV ``[B, Sk,
    Hk * KV_SPLIT, D]``, summed by ``tl_kernels.sum_kv_split``); dQ is unchanged.
    FUSE_DQ: also reduce-adds dQ (unscaled, fp32) through ``dq_desc``: the [B*Hq*D, Sq] view of
    a dQᵀ buffer [B, Hq, D, Sq_pad] (block [D, BLOCK_M]: a wgmma accumulator tile as it sits
    in registers; TMA clips the query columns at Sq). Without it ``dq_desc`` is None (a
    constexpr: the kernel's parameters and code are the split kernel's).

    WARP_SPEC: ``gl.warp_specialize`` into the compute partition (the NUM_WARPS warps,
    :func:`_compute_partition`) and a 1-warp TMA producer (:func:`_producer_partition`, 24
    registers) joined by a ready/empty mbarrier pair per ring slot; same math in the same
    order. Launch it with ``maxnreg`` (see :func:`ws_maxnreg`): the compute partition gets the
    registers the producer's warpgroup gives back."""
    # wgmma M: 16 key rows per warp; warps beyond BLOCK_N // 16 split the head dim (and the
    # queries of Sᵀ, dPᵀ): D=256, where one warpgroup cannot hold BLOCK_N x 256 dK and dV
    KEY_WARPS: gl.constexpr = BLOCK_N // 16
    D_WARPS: gl.constexpr = NUM_WARPS // KEY_WARPS
    gl.static_assert(KEY_WARPS * D_WARPS == NUM_WARPS and KEY_WARPS % 4 == 0,
                     "wgmma M: 16 key rows per warp, whole warpgroups along the keys")
    gl.static_assert(D_WARPS == 1 or not FUSE_DQ, "FUSE_DQ: warps along the keys only")
    dtype: gl.constexpr = q_desc.dtype
    # S^T, dP^T: [BLOCK_N keys, BLOCK_M queries]; dK, dV: [BLOCK_N, D]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[KEY_WARPS, D_WARPS],
                                                       instr_shape=[16, BLOCK_M // D_WARPS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                         warps_per_cta=[KEY_WARPS, D_WARPS],
                                                         instr_shape=[16, D // D_WARPS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    n_blk = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // (Hk * KV_SPLIT)
    hk = bh % (Hk * KV_SPLIT)  # the program's head: KV head hk // KV_SPLIT, its part
    kv_head = hk // KV_SPLIT
    b64 = b.to(gl.int64)
    group = Hq // (Hk * KV_SPLIT)
    c0 = n_blk * BLOCK_N

    if DS_SHARED or OPAQUE_INVARIANTS:  # K, V as one [2, BLOCK_N, D] buffer (opaque index:
        # _tile_operands)
        kv_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], k_desc.layout)
        k_smem = kv_smem.index(0)
        v_smem = kv_smem.index(1)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, D], do_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if WARP_SPEC:
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    else:
        empty = None
    for i in gl.static_range(NUM_STAGES):
        if STATS_SMEM:  # the producer's expect-arrive (TMA) and its arrive after the stats
            mbarrier.init(ready.index(i), count=2)
        else:
            mbarrier.init(ready.index(i), count=1)
        if WARP_SPEC:
            mbarrier.init(empty.index(i), count=1)
    mbarrier.init(kv_bar, count=1)
    if FUSE_DQ:
        gl.static_assert(D >= 16 * NUM_WARPS, "fused dQ^T: wgmma M = D, 16 rows per warp")
        if DS_SHARED:  # (dSᵀ, Pᵀ): both wgmma A operands from shared memory
            ds_smem = (gl.allocate_shared_memory(
                dtype, [1, BLOCK_N, BLOCK_M],
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)),
                gl.allocate_shared_memory(
                dtype, [1, BLOCK_N, BLOCK_M],
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)))
        elif OPAQUE_INVARIANTS:  # dSᵀ as [1, BLOCK_N, BLOCK_M]: opaque index (_tile)
            ds_smem = gl.allocate_shared_memory(
                dtype, [1, BLOCK_N, BLOCK_M],
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
        else:
            ds_smem = gl.allocate_shared_memory(
                dtype, [BLOCK_N, BLOCK_M],
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
        dq_smem = gl.allocate_shared_memory(gl.float32, [D, BLOCK_M], dq_desc.layout)
    else:
        ds_smem = None
        dq_smem = None
    fence_async_shared()

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b * Sk + c0, kv_head * D], kv_bar, k_smem)
    tma_load(v_desc, [b * Sk + c0, kv_head * D], kv_bar, v_smem)

    if WARP_SPEC:
        if not FUSE_DQ:  # placeholders: a None cannot travel in warp_specialize's arguments
            ds_smem = 0
            dq_smem = 0
            dq_desc = 0
        if DS_SHARED:
            # one 16-row slice of dQᵀ's D rows per compute warp (D=128 at 8 warps, D=64 at 4)
            gl.static_assert(FUSE_DQ and STATS_SMEM and BLOCK_M == 64 and D == 16 * NUM_WARPS,
                             "DS_SHARED: FUSE_DQ + WARP_SPEC + STATS_SMEM, 64 queries, "
                             "D = 16 * NUM_WARPS (64x128 w8 at D=128, 64x64 w4 at D=64)")
            # what the helpers see as FUSE_DQ: the DS_SHARED tail
            FUSE_MODE: gl.constexpr = 2
        else:
            FUSE_MODE: gl.constexpr = FUSE_DQ
        if STATS_SMEM:  # the compute partition reads the statistics from these rings
            st_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            lse_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], st_smem)
            delta_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], st_smem)
            lse_src = lse_ring
            delta_src = delta_ring
            if DS_SHARED:  # the compute partition gets the [2, BLOCK_N, D] K/V buffer
                k_smem = kv_smem
                v_smem = kv_smem
        else:  # placeholders for the producer (a None cannot travel in the arguments)
            lse_ring = 0
            delta_ring = 0
            lse_src = lse2_ptr
            delta_src = delta_ptr
        if OPAQUE_INVARIANTS:  # the compute partition gets the [2, BLOCK_N, D] K/V buffer
            k_smem = kv_smem
            v_smem = kv_smem
        dk, dv = gl.warp_specialize([
            (_compute_partition,
             (n_blk, b, hk, b64, group, k_smem, v_smem, q_ring, do_ring, ready, empty, kv_bar,
              q_desc, do_desc, lse_src, delta_src, mask_ptr, sum_ptr, rng_ptr, scale_log2, Sq,
              Sk, Hq, Hk, Hm, NQB, NKB, mask_b_stride, ds_smem, dq_smem, dq_desc, s_layout,
              acc_layout, a_layout, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI, FUSE_MODE)),
            (_producer_partition,
             (n_blk, b, hk, b64, group, q_desc, do_desc, q_ring, do_ring, ready, empty, rng_ptr,
              Sq, Sk, Hq, Hm, NQB, NKB, mask_b_stride, lse2_ptr, delta_ptr, lse_ring,
              delta_ring, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C)),
        ], [1], [24])  # PRODUCER_WARPS, PRODUCER_REGS
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(empty.index(i))
    else:
        cols = c0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        offs_mb = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        dk = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
        mbarrier.wait(kv_bar, 0)
        if OPAQUE_INVARIANTS:  # the tiles get the [2, BLOCK_N, D] K/V buffer
            k_smem = kv_smem
            v_smem = kv_smem
        dk, dv, _ = _heads(dk, dv, n_blk * 0, n_blk, b, hk, b64, group, k_smem, v_smem, q_ring,
                           do_ring, ready, empty, q_desc, do_desc, lse2_ptr, delta_ptr, mask_ptr,
                           sum_ptr, rng_ptr, scale_log2, Sq, Sk, Hq, Hk, Hm, NQB, NKB,
                           mask_b_stride, ds_smem, dq_smem, dq_desc, cols, offs_mb, s_layout,
                           a_layout, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, C, NI, FUSE_DQ,
                           False)
        if FUSE_DQ:
            tma.store_wait(0)  # the last reduce has read dq_smem
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(kv_bar)

    # the store inline: called as a function these lines renumber the registers of the
    # GPU-verified non-WS kernel (C=4 layout; its SASS is pinned by the tests)
    offs_n = c0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    row_off = (b64 * Sk + offs_n) * (Hk * KV_SPLIT * D) + hk * D
    kv_off = row_off[:, None] + offs_d[None, :]
    nmask = (offs_n[:, None] < Sk) & (offs_d[None, :] < D)
    gl.store(dk_ptr + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=nmask)
    gl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=nmask)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _dq_smem_layout(block_m: int, d: int):
    """The shared layout of the fused kernel's fp32 [d, block_m] dQᵀ tile (TMA reduce source;
    at block_m=32 one 128-byte swizzled row per head-dim index; at 64 two [d, 32] blocks)."""
    return gl.NVMMASharedLayout.get_default_for([d, block_m], gl.float32)


#: Query columns of one TMA reduce of the fused dQᵀ tile: a 128-byte-swizzled box is at most
#: 128 bytes (32 fp32) wide, and Triton's reduce lowering issues one message per op.
DQ_REDUCE_COLS = 32


def dq_reduce_block(block_m: int, d: int) -> list:
    """Block shape of the fused kernel's dQᵀ descriptor: [d, min(block_m, 32)] (BLOCK_M=64: two
    reduces per tile, :func:`_reduce_dq_tile`)."""
    return [d, min(block_m, DQ_REDUCE_COLS)]


#: The DS_SHARED (fused, FA3-style) tiles, head dim -> (block_m, block_n, num_warps, most
#: stages): 64 queries and D = 16 * num_warps, so dQᵀ's D rows are one 16-row slice per compute
#: warp (two warpgroups at D=128, one at D=64; at D=64 and 8 warps each warpgroup would get
#: M = 32 of dQᵀ, below wgmma's 64). The most stages: what fits in shared memory (D=128: s3 is
#: 231,180 B of the 232,448; D=64: s3 is 100,108 B, two programs per SM; s4 would fit one
#: program per SM only and was not compiled or measured).
DS_SHARED_TILES = {128: (64, 128, 8, 3), 64: (64, 64, 4, 3)}


#: The fused backward's variant flags: FA3's tile, warp-specialised, the statistics and Pᵀ/dSᵀ
#: in shared memory, dQ reduce-added once per tile (the table's ``gluon_fused`` kernel).
FUSED_VARIANT = dict(fuse_dq=True, warp_spec=True, stats_smem=True, ds_shared=True)


def d_warps(d: int, block_n: int, num_warps: int) -> int:
    """How many warpgroups split the head dim of dK/dV: 2 at D=256 when the warps hold only
    half of 16 * num_warps key rows (64 keys at 8 warps: one warpgroup's 64 x 256 fp32 dK and
    dV would need 256 registers a thread), else 1 (warps along the keys)."""
    return 2 if d == 256 and 2 * block_n == 16 * num_warps else 1


def check_config(d: int, block_m: int, block_n: int, num_warps: int, num_stages: int,
                 fuse_dq: bool = False, warp_spec: bool = False, stats_smem: bool = False,
                 ds_shared: bool = False) -> None:
    """Raise ValueError on a configuration the kernel cannot compile: one warpgroup row of 16
    keys per warp (block_n == 16 * num_warps; at D=256 also 8 * num_warps, two warpgroups
    splitting the head dim, :func:`d_warps`), power-of-two tiles; with ``fuse_dq`` also
    d >= 16 * num_warps (dQᵀ = Kᵀ dSᵀ has M = d rows, 16 per warp); ``ds_shared`` only with
    fuse_dq + warp_spec + stats_smem at a :data:`DS_SHARED_TILES` tile."""
    if d not in (64, 128, 256):
        raise ValueError(f"gluon dK/dV: head dim {d} (64, 128 or 256)")
    if num_warps not in (4, 8):
        raise ValueError(f"gluon dK/dV: num_warps={num_warps} (4 or 8: whole warpgroups)")
    if block_n * d_warps(d, block_n, num_warps) != 16 * num_warps:
        raise ValueError(f"gluon dK/dV: block_n={block_n} must be 16 * num_warps ({num_warps}), "
                         f"or 8 * num_warps at D=256 (two warpgroups split the head dim)")
    if d_warps(d, block_n, num_warps) > 1 and fuse_dq:
        raise ValueError("gluon fused dQ: the head-dim split (D=256, block_n = 8 * num_warps) "
                         "is a split-backward shape")
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"gluon dK/dV: block_m={block_m} (16, 32, 64 or 128)")
    if num_stages < 1:
        raise ValueError(f"gluon dK/dV: num_stages={num_stages} (>= 1)")
    if fuse_dq and d < 16 * num_warps:
        raise ValueError(f"gluon fused dQ: d={d} < 16 * num_warps ({num_warps})")
    if stats_smem and not warp_spec:
        raise ValueError("gluon dK/dV: stats_smem needs warp_spec (the producer stages them)")
    if ds_shared:
        _check_ds_shared(d, block_m, block_n, num_warps, num_stages, fuse_dq, warp_spec,
                         stats_smem)


def _check_ds_shared(d, block_m, block_n, num_warps, num_stages, fuse_dq, warp_spec,
                     stats_smem) -> None:
    """:func:`check_config`'s DS_SHARED rule: the FUSE_DQ + WARP_SPEC + STATS_SMEM kernel at
    its head dim's :data:`DS_SHARED_TILES` tile, at most that many stages."""
    tiles = ", ".join(f"D={k} {bm}x{bn} w{w} s1-s{st}"
                      for k, (bm, bn, w, st) in DS_SHARED_TILES.items())
    what = f"gluon fused dQ: ds_shared is the FUSE_DQ + WARP_SPEC + STATS_SMEM variant at {tiles}"
    if not (fuse_dq and warp_spec and stats_smem):
        raise ValueError(f"{what} (got fuse_dq={fuse_dq}, warp_spec={warp_spec}, "
                         f"stats_smem={stats_smem})")
    tile = DS_SHARED_TILES.get(d)
    if tile is None or (block_m, block_n, num_warps) != tile[:3] or num_stages > tile[3]:
        raise ValueError(f"{what} (got D={d} {block_m}x{block_n} w{num_warps} s{num_stages})")


def new_dq_accumulator(b: int, sq: int, hq: int, d: int, device) -> torch.Tensor:
    """A zeroed fp32 dQᵀ buffer ``[B, Hq, D, Sq_pad]`` for the FUSE_DQ kernel's reduce-adds
    (``Sq_pad``: Sq rounded up to a multiple of 4, TMA's 16-byte row stride)."""
    return dq_accumulator(b, sq, hq, d, device).zero_()


def dq_accumulator_view(dq_t: torch.Tensor, sq: int) -> torch.Tensor:
    """The unscaled fp32 dQ ``[B, Sq, Hq, D]`` held by a :func:`new_dq_accumulator` buffer."""
    return dq_t[..., :sq].permute(0, 3, 1, 2)


#: :func:`check_config` once per configuration (it raises on a bad one, so only good ones are
#: kept; an ``lru_cache`` hit is no Python call).
_checked_config = functools.lru_cache(maxsize=None)(check_config)


class GluonDkdv:
    """The Gluon dK/dV launch (:func:`_dkdv_gluon_kernel`) of one call signature, decided
    once: its checks, constexprs, scalars, grid and TMA descriptor templates (a
    :class:`~.launcher.Bound` launch). Calling it with tensors of that signature and a plan
    of the same mask layout (its ``c``, ``ni``, ``hm``, ``mask_b_stride``) allocates dK, dV
    (or the split's partials) and launches; a prepared call (``triton_backend.PreparedCall``)
    keeps one per mask layout. The variants and ``kv_split``: :func:`launch_dkdv_gluon`.
    With ``fuse_dq`` the call takes the zeroed dQᵀ accumulator ``dq_t`` and adds into it."""

    __slots__ = ("bound", "hq", "kv_split", "fuse_dq")

    def __init__(self, q, k, plan, causal: bool, softmax_scale: float, block_m: int,
                 block_n: int, num_warps: int, num_stages: int, fuse_dq: bool = False,
                 warp_spec: bool = False, stats_smem: bool = False, ds_shared: bool = False,
                 kv_split: int = 1):
        b, sq, hq, d = q.shape
        _, sk, hk, _ = k.shape
        _checked_config(d, block_m, block_n, num_warps, num_stages, fuse_dq, warp_spec,
                        stats_smem, ds_shared)
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"gluon dK/dV: dtype {q.dtype} (bf16 or fp16)")
        if kv_split != 1:
            check_kv_split(kv_split, hq, hk)
        nqb, nkb = cdiv(sq, block_m), cdiv(sk, block_n)
        if plan.c > 0 and (plan.ranges.shape[1] != nkb or plan.summary.shape[1] != nkb):
            raise ValueError("gluon dK/dV: the plan was built for another block_n (or by query)")
        ql = _smem_layout(block_m, d, q.dtype)
        kl = _smem_layout(block_n, d, q.dtype)
        q_view = lambda t: t.view(b * sq, hq * d)  # noqa: E731
        kv_view = lambda t: t.view(b * sk, hk * d)  # noqa: E731
        dq_desc = None  # None: a constexpr, the split kernel's parameter list
        if fuse_dq:
            # dQᵀ per (batch, head): [B, Hq, D, Sq_pad], Sq_pad a multiple of 4 (TMA: 16-byte
            # row stride); the descriptor's [B*Hq*D, Sq] view clips each tile's query columns
            sq_pad = cdiv(sq, 4) * 4
            dq_desc = Desc(GluonDescriptor, lambda t: t.view(b * hq * d, sq_pad)[:, :sq],
                           dq_reduce_block(block_m, d), _dq_smem_layout(block_m, d))
        args = (Desc(GluonDescriptor, q_view, [block_m, d], ql),
                Desc(GluonDescriptor, q_view, [block_m, d], ql),
                Desc(GluonDescriptor, kv_view, [block_n, d], kl),
                Desc(GluonDescriptor, kv_view, [block_n, d], kl),
                TENSOR, TENSOR, TENSOR, TENSOR, TENSOR, TENSOR, TENSOR,
                softmax_scale, softmax_scale * LOG2E, sq, sk, hq, hk, plan.hm, nqb, nkb,
                plan.mask_b_stride, dq_desc)
        kwargs = dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, C=plan.c,
                      NI=plan.ni, NUM_STAGES=num_stages, NUM_WARPS=num_warps,
                      num_warps=num_warps)
        if fuse_dq:
            kwargs.update(FUSE_DQ=True)
        if warp_spec:
            kwargs.update(WARP_SPEC=True, maxnreg=ws_maxnreg(num_warps))
        if stats_smem:
            kwargs.update(STATS_SMEM=True)
        if ds_shared:
            kwargs.update(DS_SHARED=True)
        if kv_split != 1:
            kwargs.update(KV_SPLIT=kv_split)
        self.bound = Bound(_dkdv_gluon_kernel, (nkb, b * hk * kv_split), args, kwargs)
        self.hq, self.kv_split, self.fuse_dq = hq, kv_split, fuse_dq

    def _tensors(self, q, k, v, dout, lse2, delta, plan, dq_t, dk, dv) -> tuple:
        if self.fuse_dq != (dq_t is not None):
            raise ValueError("gluon dK/dV: dq_t is required with fuse_dq and only with it")
        head = (q, dout, k, v, dk, dv, lse2, delta, plan.mask, plan.summary, plan.ranges)
        return head if dq_t is None else head + (dq_t,)

    def __call__(self, q, k, v, dout, lse2, delta, plan, dq_t: Optional[torch.Tensor] = None):
        """``(dk, dv)`` of these inputs (non-empty, the signature's, contiguous); with
        ``fuse_dq``, dQ added into ``dq_t``."""
        dk, dv, part = dkdv_outputs(k, v, self.hq, self.kv_split)
        self.bound(*self._tensors(q, k, v, dout, lse2, delta, plan, dq_t, dk, dv))
        return finish_dkdv(dk, dv, part, k)

    def once(self, q, k, v, dout, lse2, delta, plan, dq_t: Optional[torch.Tensor] = None):
        """:meth:`__call__` for a launch not repeated (no fast-path parts built)."""
        dk, dv, part = dkdv_outputs(k, v, self.hq, self.kv_split)
        self.bound.once(*self._tensors(q, k, v, dout, lse2, delta, plan, dq_t, dk, dv))
        return finish_dkdv(dk, dv, part, k)


def launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, softmax_scale, plan, block_m: int,
                      block_n: int, num_warps: int, num_stages: int, fuse_dq: bool = False,
                      warp_spec: bool = False, stats_smem: bool = False,
                      ds_shared: bool = False, dq_t: Optional[torch.Tensor] = None,
                      kv_split: int = 1):
    """(dk, dv) like ``_launch_dkdv(..., fuse_dq=False)[:2]``, one call (:class:`GluonDkdv` is
    the prepared form); ``plan`` must come from ``make_plan(mask, causal, Sq, Sk, block_m,
    block_n, by_key=True, device)``.

    ``warp_spec=True`` (the WARP_SPEC kernel, the library default): the same results from a
    kernel whose Q/dO ring is filled by a 1-warp TMA producer partition, launched with
    ``maxnreg=ws_maxnreg(num_warps)``; the default (False) launches exactly the kernel it
    always did.

    ``stats_smem=True`` (with ``warp_spec`` only; the STATS_SMEM kernel, the D=128 default):
    the producer also stages each tile's lse2/delta in shared memory
    (what lets 64x128 w8 run without spills in its tile loops); same dK, dV bit for bit.

    ``ds_shared=True`` (with ``fuse_dq``, ``warp_spec``, ``stats_smem`` at a
    :data:`DS_SHARED_TILES` tile only: 64x128 w8 at D=128, the D=128 fused default; 64x64 w4
    at D=64, offline-checked, not yet run on a GPU): FA3's backward tile, dQ once per tile; Pᵀ
    and dSᵀ staged in shared memory as the A operands of dV, dK and dQ.

    ``fuse_dq=True`` (the FUSE_DQ kernel): (dk, dv, dq_acc), dq_acc the
    unscaled fp32 dQ accumulated by TMA reduce-adds, shape [B, Sq, Hq, D] (a permuted view of
    the kernel's [B, Hq, D, Sq_pad] dQᵀ buffer, zero-initialised here); multiply by
    ``softmax_scale`` for dQ (:func:`fused_backward_gluon`). Its rounding order varies between
    runs (atomics). ``dq_t`` (with ``fuse_dq``): an existing dQᵀ buffer to add into, already
    zeroed (``tl_kernels.dq_accumulator`` zeroed by ``backward_prepass``: one launch less; or
    :func:`new_dq_accumulator`, shared by every stage of a context-parallel layer's staged
    backward), else a new zeroed one is allocated here. With ``dq_t`` given, dq_acc is None:
    the caller holds the buffer (:func:`dq_accumulator_view` of it is the same dQ).

    ``kv_split`` > 1 (GQA; a divisor of the query heads per KV head): each KV head's group is
    split over that many programs (a call with few key blocks gets more programs for the SMs),
    whose fp32 partial dK, dV ``tl_kernels.sum_kv_split`` sums (one launch, no copies of K/V)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    _checked_config(d, block_m, block_n, num_warps, num_stages, fuse_dq, warp_spec, stats_smem,
                    ds_shared)
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    if sq == 0 or sk == 0:
        zeros = (torch.zeros_like(k), torch.zeros_like(v))
        if fuse_dq:
            zeros += (torch.zeros((b, sq, hq, d), dtype=torch.float32, device=q.device), )
        return zeros
    run = GluonDkdv(q, k, plan, causal, softmax_scale, block_m, block_n, num_warps,
                    num_stages, fuse_dq, warp_spec, stats_smem, ds_shared, kv_split)
    dq_acc = None
    if fuse_dq:
        sq_pad = cdiv(sq, 4) * 4
        allocated = dq_t is None
        if allocated:
            dq_t = new_dq_accumulator(b, sq, hq, d, q.device)
        elif dq_t.shape != (b, hq, d, sq_pad) or dq_t.dtype != torch.float32:
            raise ValueError(f"gluon fused dQ: dq_t must be fp32 [{b}, {hq}, {d}, {sq_pad}], "
                             f"got {dq_t.dtype} {tuple(dq_t.shape)}")
        # a given dq_t is the caller's to view (a context-parallel stage only adds into it)
        dq_acc = dq_accumulator_view(dq_t, sq) if allocated else None
    dk, dv = run.once(q, k, v, dout, lse2, delta, plan, dq_t if fuse_dq else None)
    if fuse_dq:
        return dk, dv, dq_acc
    return dk, dv


def fused_backward_gluon(q, k, v, dout, lse2, delta, causal, softmax_scale, plan, cfg_tuple):
    """(dq, dk, dv) of the fused Gluon backward at any FUSE_DQ config (tests; the library's
    default, ``triton_backend.backward``, launches the DS_SHARED one itself): one launch of the dK/dV kernel that also reduce-adds dQ,
    then dQ = softmax_scale * dq_acc cast to q's dtype (``tl_kernels.scale_dq``).
    ``lse2``, ``delta`` from ``tl_kernels.backward_prepass``; ``plan`` a by-key plan for
    ``cfg_tuple`` = (block_m, block_n, num_warps, num_stages[, warp_spec[, stats_smem[,
    ds_shared]]]); a later element, if any, must be falsy."""
    block_m, block_n, num_warps, num_stages = cfg_tuple[:4]
    warp_spec, stats_smem, ds_shared = (
        bool(cfg_tuple[i]) if len(cfg_tuple) > i else False for i in (4, 5, 6))
    dk, dv, dq_acc = launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, softmax_scale, plan,
                                       block_m, block_n, num_warps, num_stages, fuse_dq=True,
                                       warp_spec=warp_spec, stats_smem=stats_smem,
                                       ds_shared=ds_shared)
    return scale_dq(dq_acc, softmax_scale, q.dtype), dk, dv


# ---------------------------------------------------------------------------------------------
