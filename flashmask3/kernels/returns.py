"""One launch that sums a context-parallel rank's returned gradients into its own dK/dV.

In the overlapped backward a rank gets back, for every chunk of its own K/V that it sent, the
dK/dV that the receiving rank computed for it: one wire row ``[2, B, chunk, Hk, D]`` per
(chunk, destination), so a chunk sent to 70 ranks comes back 70 times. Their sum, plus the
rank's own stage's dK/dV, is the chunk's gradient. In torch that is a cast of every returned
row to fp32 (a buffer twice their size), an ``index_add_`` of it into an fp32 accumulator
(atomics: the order of the additions changes from run to run), and the casts back, 0.6-1 ms
of device time per layer for the heaviest ranks of a cp-128 plan at 128K tokens
(benchmarks/NOTES.md, session 28). :func:`add_returns` reads every row once,
sums in fp32 registers in a fixed order (the rank's own rows, then the returned ones in
buffer order) and writes dK and dV in the key layout ``[B, n_own * chunk, Hk, D]``: one
launch, bitwise reproducible. ``distributed.runtime._Returns.own_grads`` keeps the torch path
as the reference and for CPU tensors and float64.

A relaying rank (hierarchical plans) sums gradients on the way too: what it sends back for a
round is its own stage's dK/dV of that round's chunks plus what the ranks it relayed those
chunks to sent back to it. :func:`sum_wire_rows` is the same kernel writing wire rows instead
of dK/dV (``_Returns.send``).

The rows a chunk sums are given as an index built once per rank program
(``distributed.program.returns_index``): for each own chunk, the rows of a source that add
into it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launcher import TENSOR, cached_bound, cdiv
from .tl_kernels import interpreting

#: Elements of one K (or V) half of a wire row per program.
BLOCK = 1024
#: Dtypes the kernel sums (in fp32); float64 takes the torch path.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def usable(k: torch.Tensor) -> bool:
    """Whether :func:`add_returns` runs for K/V like ``k``: on a GPU (or Triton's CPU
    interpreter) in a 16- or 32-bit float dtype."""
    return (k.is_cuda or interpreting()) and k.dtype in DTYPES


@triton.jit
def _add_rows(acc, src_ptr, starts_ptr, rows_ptr, c, offs, emask, ROW):
    """``acc`` plus every row (``ROW`` elements) of one source that adds into own chunk ``c``
    (fp32; the row offset is 64-bit, ``ROW`` itself fits 32 bits for any real chunk)."""
    lo = tl.load(starts_ptr + c)
    hi = tl.load(starts_ptr + c + 1)
    for j in range(lo, hi):
        row = tl.load(rows_ptr + j).to(tl.int64)
        acc += tl.load(src_ptr + row * ROW + offs, mask=emask, other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["HALF", "CS_HD", "S_HD"])
def _add_returns_kernel(own_ptr, own_starts, own_rows, ret_ptr, ret_starts, ret_rows,
                        dk_ptr, dv_ptr, HALF, CS_HD, S_HD, HAS_OWN: tl.constexpr,
                        HAS_RET: tl.constexpr, WIRE_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(c, blk, kv)``: elements ``[blk * BLOCK, (blk + 1) * BLOCK)`` of the K
    (``kv = 0``) or V half of output chunk ``c``. A wire row is ``[2, B, cs, Hk, D]``
    contiguous (``HALF = B * cs * Hk * D`` elements a half, ``CS_HD = cs * Hk * D``). The
    output is dK and dV ``[B, n_own * cs, Hk, D]`` contiguous (``S_HD = n_own * cs * Hk * D``)
    or, with ``WIRE_OUT``, wire rows ``[n, 2, B, cs, Hk, D]`` at ``dk_ptr``."""
    c = tl.program_id(0)
    blk = tl.program_id(1)
    kv = tl.program_id(2)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    emask = offs < HALF
    src = kv * HALF + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_OWN:
        acc = _add_rows(acc, own_ptr, own_starts, own_rows, c, src, emask, 2 * HALF)
    if HAS_RET:
        acc = _add_rows(acc, ret_ptr, ret_starts, ret_rows, c, src, emask, 2 * HALF)
    if WIRE_OUT:
        tl.store(dk_ptr + c.to(tl.int64) * (2 * HALF) + src, acc.to(dk_ptr.dtype.element_ty), mask=emask)
        return
    b = (offs // CS_HD).to(tl.int64)
    dst = b * S_HD + c.to(tl.int64) * CS_HD + offs % CS_HD
    if kv == 0:
        tl.store(dk_ptr + dst, acc.to(dk_ptr.dtype.element_ty), mask=emask)
    else:
        tl.store(dv_ptr + dst, acc.to(dv_ptr.dtype.element_ty), mask=emask)


def _check_rows(name: str, rows: torch.Tensor, like: torch.Tensor) -> None:
    if rows.dim() != 6 or rows.shape[1] != 2 or rows.shape[2:] != like.shape[2:]:
        raise ValueError(f"{name} must be wire rows [n, 2, B, chunk, Hk, D] like "
                         f"{tuple(like.shape)}, got {tuple(rows.shape)}")


def add_returns(own: Optional[torch.Tensor], own_index: Optional[tuple],
                returned: Optional[torch.Tensor], returned_index: Optional[tuple], n_own: int,
                chunk: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV ``[B, n_own * chunk, Hk, D]`` in ``k``'s dtype: for every own chunk, the sum
    (fp32) of the rows of ``own`` (the own stage's dK/dV wire rows, or None) and of
    ``returned`` (the returned gradients' wire rows, or None) that add into it, as their
    indexes (``distributed.program.returns_index``) say; a chunk no row adds into gets
    zeros."""
    b, _, hk, d = k.shape
    dk = torch.empty((b, n_own * chunk, hk, d), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    _sum_rows(own, own_index, returned, returned_index, n_own, chunk, k, dk, dv, wire_out=False)
    return dk, dv


def sum_wire_rows(own: Optional[torch.Tensor], own_index: Optional[tuple],
                  returned: Optional[torch.Tensor], returned_index: Optional[tuple], n_out: int,
                  chunk: int, k: torch.Tensor) -> torch.Tensor:
    """Wire rows ``[n_out, 2, B, chunk, Hk, D]`` in ``k``'s dtype, row ``i`` the sum (fp32, in a
    fixed order) of the rows of ``own`` and ``returned`` that add into it (indexes as for
    :func:`add_returns`; zeros where none does): a relaying rank's gradient return, its own
    stage's dK/dV plus what the ranks it relayed to sent back, in one launch instead of an fp32
    accumulator, ``index_add_`` per source and the casts."""
    b, _, hk, d = k.shape
    out = torch.empty((n_out, 2, b, chunk, hk, d), dtype=k.dtype, device=k.device)
    _sum_rows(own, own_index, returned, returned_index, n_out, chunk, k, out, out, wire_out=True)
    return out


def _sum_rows(own, own_index, returned, returned_index, n_out: int, chunk: int, k: torch.Tensor,
              dk: torch.Tensor, dv: torch.Tensor, wire_out: bool) -> None:
    """Launch :func:`_add_returns_kernel` over ``n_out`` output chunks (the sources checked)."""
    b, _, hk, d = k.shape
    present = [x for x in (own, returned) if x is not None]
    for name, x in (("own", own), ("returned", returned)):
        if x is not None:
            _check_rows(name, x, present[0])
    if n_out == 0:
        return
    half = b * chunk * hk * d
    if present and present[0].shape[2:] != (b, chunk, hk, d):
        raise ValueError(f"the wire rows {tuple(present[0].shape)} do not hold chunks of "
                         f"{chunk} keys of k {tuple(k.shape)}")
    for name, index in (("own_index", own_index if own is not None else None),
                        ("returned_index", returned_index if returned is not None else None)):
        if index is not None and any(x.device != k.device for x in index):
            raise ValueError(f"{name} must be on k's device {k.device}, got "
                             f"{[str(x.device) for x in index]}")
    dummy = dk  # a pointer for an absent source and its index (never read)
    o_starts, o_rows = own_index if own is not None else (dummy, dummy)
    r_starts, r_rows = returned_index if returned is not None else (dummy, dummy)
    tensors = (own.contiguous() if own is not None else dummy, o_starts, o_rows,
               returned.contiguous() if returned is not None else dummy, r_starts, r_rows, dk, dv)
    has_own, has_ret = own is not None, returned is not None
    # bound once per configuration (launcher.cached_bound): every value the launch fixes besides
    # the tensors, and their dtypes
    key = (_add_returns_kernel, n_out, half, chunk * hk * d, has_own, has_ret, wire_out,
           tuple(t.dtype for t in tensors), k.device)
    cached_bound(key, lambda: (_add_returns_kernel, (n_out, cdiv(half, BLOCK), 2),
                               (TENSOR,) * 8 + (half, chunk * hk * d, n_out * chunk * hk * d),
                               dict(HAS_OWN=has_own, HAS_RET=has_ret, WIRE_OUT=wire_out, BLOCK=BLOCK,
                                    num_warps=4)))(*tensors)
