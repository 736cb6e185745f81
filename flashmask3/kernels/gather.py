"""One launch each way between the context-parallel wire rows and the key layout.

K and V travel between ranks in wire rows ``[rows, 2, B, chunk, Hk, D]`` (one contiguous
message per peer, docs/cp-runtime.md), but an attention call takes contiguous K and V
``[B, keys, Hk, D]``. The runtime keeps one key buffer ``[2, B, keys, Hk, D]`` per pass whose
halves hold every stage's K and V in stage order: a stage's keys are a slice of it and the
merged backward call's keys are all of it. :func:`gather_keys` fills one stage's slice from
the rows of the receive buffer in one launch: each program copies one contiguous block of a
K or V half of one row, so the copy runs at memory bandwidth. In torch the same move is an
``index_select`` on a permuted view (an element-wise gather at about a third of the
bandwidth), done once in the forward and once more in the backward before this kernel
(``benchmarks/NOTES.md``, session 29). :func:`pack_wire` moves the other way: K/V (or dK/dV)
in the key layout into wire rows, optionally in another chunk order, in one launch, where torch
stacks the two halves (one copy) and then reorders the rows (a second). The runtime's
``gather_stage_keys`` / ``pack_wire_rows`` keep the torch paths for CPU tensors and float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import TENSOR, cached_bound, cdiv
from .tl_kernels import interpreting

#: Elements of one K (or V) half of a wire row per program.
BLOCK = 4096


def usable(src: torch.Tensor) -> bool:
    """Whether :func:`gather_keys` runs for wire rows like ``src``: on a GPU or under Triton's
    CPU interpreter (any dtype: it only copies)."""
    return src.is_cuda or interpreting()


@triton.jit(do_not_specialize=["NB", "POS"])
def _gather_keys_kernel(src_ptr, rows_ptr, dst_ptr, HALF, CS_HD, NB, B_STRIDE, KV_STRIDE, POS,
                        BLOCK: tl.constexpr):
    """Program ``(i, blk, kv)``: block ``blk % NB`` (``BLOCK`` elements) of batch row
    ``blk // NB`` of the K (``kv = 0``) or V half of wire row ``rows[i]`` of ``src``
    (``[N, 2, B, cs, Hk, D]`` contiguous: ``HALF = B * cs * Hk * D`` elements a half,
    ``CS_HD = cs * Hk * D`` a batch row's chunk) into key chunk ``POS + i`` of ``dst``
    (``[2, B, keys, Hk, D]`` contiguous: ``B_STRIDE = keys * Hk * D``, ``KV_STRIDE = B *
    B_STRIDE``). Both sides of a block are contiguous; the bases are 64-bit. The sizes are
    specialised (Triton's divisible-by-16 flag: every real shape's are, so the copies are
    128-bit vectors); the block count and position are not (no compile per stage)."""
    i = tl.program_id(0)
    blk = tl.program_id(1)
    kv = tl.program_id(2).to(tl.int64)
    b = (blk // NB).to(tl.int64)
    offs = (blk % NB) * BLOCK + tl.arange(0, BLOCK)
    emask = offs < CS_HD
    row = tl.load(rows_ptr + i).to(tl.int64)
    x = tl.load(src_ptr + ((row * 2 + kv) * HALF + b * CS_HD) + offs, mask=emask)
    dst = kv * KV_STRIDE + b * B_STRIDE + (POS + i).to(tl.int64) * CS_HD
    tl.store(dst_ptr + dst + offs, x, mask=emask)


def check_gather(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, pos: int) -> None:
    """ValueError unless ``src`` are wire rows ``[N, 2, B, chunk, Hk, D]`` and ``dst`` a key
    buffer ``[2, B, keys, Hk, D]`` of the same B, Hk, D and dtype with room for
    ``len(rows)`` chunks from chunk ``pos`` on (both contiguous), ``rows`` a 1-D integer
    index on their device."""
    if src.dim() != 6 or src.shape[1] != 2 or not src.is_contiguous():
        raise ValueError(f"src must be contiguous wire rows [n, 2, B, chunk, Hk, D], got {tuple(src.shape)}")
    b, cs, hk, d = src.shape[2:]
    if dst.dim() != 5 or tuple(dst.shape[:2]) != (2, b) or tuple(dst.shape[3:]) != (hk, d) \
            or not dst.is_contiguous() or dst.dtype != src.dtype:
        raise ValueError(f"dst must be a contiguous key buffer [2, {b}, keys, {hk}, {d}] of "
                         f"{src.dtype}, got {tuple(dst.shape)} {dst.dtype}")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != src.device:
        raise ValueError(f"rows must be a 1-D int32/int64 index on {src.device}, got "
                         f"{tuple(rows.shape)} {rows.dtype} on {rows.device}")
    if pos < 0 or (pos + rows.numel()) * cs > dst.shape[2]:
        raise ValueError(f"{rows.numel()} chunks of {cs} keys from chunk {pos} do not fit the "
                         f"buffer's {dst.shape[2]} keys")


def gather_keys(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, pos: int) -> None:
    """Copy wire rows ``src[rows]`` into ``dst``'s key chunks ``pos, pos + 1, ...``: K halves
    into ``dst[0]``, V halves into ``dst[1]`` (layouts: :func:`check_gather`); one launch."""
    check_gather(src, rows, dst, pos)
    n = rows.numel()
    if n == 0:
        return
    b, cs, hk, d = src.shape[2:]
    row = cs * hk * d
    nb = cdiv(row, BLOCK)
    keys = dst.shape[2]
    # bound once per configuration (launcher.cached_bound): the key holds every value the launch
    # fixes besides the three tensors (their dtypes too, so a call never misses the fast path)
    key = (_gather_keys_kernel, n, b, row, keys * hk * d, pos, src.dtype, rows.dtype, src.device)
    cached_bound(key, lambda: (_gather_keys_kernel, (n, b * nb, 2),
                               (TENSOR,) * 3 + (b * row, row, nb, keys * hk * d, b * keys * hk * d, pos),
                               dict(BLOCK=BLOCK, num_warps=4)))(src, rows, dst)


@triton.jit(do_not_specialize=["NB", "N_SRC"])
def _pack_wire_kernel(k_ptr, v_ptr, rows_ptr, dst_ptr, HALF, CS_HD, NB, N_SRC, HAS_ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program ``(j, blk, kv)``: block ``blk % NB`` of batch row ``blk // NB`` of key chunk
    ``rows[j]`` (``j`` without ``HAS_ROWS``) of K (``kv = 0``) or V (``[B, N_SRC * cs, Hk, D]``
    contiguous, ``CS_HD = cs * Hk * D``) into the K or V half of wire row ``j`` of ``dst``
    (``[n, 2, B, cs, Hk, D]`` contiguous, ``HALF = B * CS_HD``). 64-bit bases, contiguous blocks."""
    j = tl.program_id(0)
    blk = tl.program_id(1)
    kv = tl.program_id(2)
    b = (blk // NB).to(tl.int64)
    offs = (blk % NB) * BLOCK + tl.arange(0, BLOCK)
    emask = offs < CS_HD
    if HAS_ROWS:
        chunk = tl.load(rows_ptr + j).to(tl.int64)
    else:
        chunk = j.to(tl.int64)
    src = (b * N_SRC + chunk) * CS_HD
    if kv == 0:
        x = tl.load(k_ptr + src + offs, mask=emask)
    else:
        x = tl.load(v_ptr + src + offs, mask=emask)
    dst = (j.to(tl.int64) * 2 + kv) * HALF + b * CS_HD
    tl.store(dst_ptr + dst + offs, x, mask=emask)


def check_pack(k: torch.Tensor, v: torch.Tensor, rows, out: torch.Tensor) -> int:
    """ValueError unless ``k`` and ``v`` are contiguous ``[B, S, Hk, D]`` of one shape and dtype
    and ``out`` contiguous wire rows ``[n, 2, B, chunk, Hk, D]`` of that dtype with ``chunk``
    dividing ``S``, ``rows`` (or None: ``n`` = S / chunk) a 1-D integer index on their device;
    returns ``chunk``."""
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"k and v must be contiguous [B, S, Hk, D] of one shape and dtype, got "
                         f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
    b, s, hk, d = k.shape
    if out.dim() != 6 or tuple(out.shape[1:3]) != (2, b) or tuple(out.shape[4:]) != (hk, d) \
            or out.dtype != k.dtype or not out.is_contiguous() or s % max(out.shape[3], 1):
        raise ValueError(f"out must be contiguous wire rows [n, 2, {b}, chunk, {hk}, {d}] of {k.dtype} whose "
                         f"chunk divides {s}, got {tuple(out.shape)} {out.dtype}")
    n = out.shape[0]
    if rows is None:
        if n * out.shape[3] != s:
            raise ValueError(f"without rows, out must hold all {s} keys, got {n} rows of {out.shape[3]}")
    elif rows.dim() != 1 or rows.numel() != n or rows.dtype not in (torch.int32, torch.int64) \
            or rows.device != k.device:
        raise ValueError(f"rows must be a 1-D int32/int64 index of {n} chunks on {k.device}, got "
                         f"{tuple(rows.shape)} {rows.dtype} on {rows.device}")
    return out.shape[3]


def pack_wire(k: torch.Tensor, v: torch.Tensor, rows, out: torch.Tensor) -> None:
    """Wire row ``j`` of ``out`` = key chunk ``rows[j]`` (``j`` when ``rows`` is None) of ``k``
    and of ``v`` (layouts: :func:`check_pack`); one launch. The inverse move of
    :func:`gather_keys`: the CP backward's dK/dV into the wire rows they travel back in, in the
    order of the receive rows, and the own K/V into the rows they are sent in."""
    chunk = check_pack(k, v, rows, out)
    n = out.shape[0]
    if n == 0:
        return
    b, s, hk, d = k.shape
    row = chunk * hk * d
    nb = cdiv(row, BLOCK)
    has_rows = rows is not None
    index = rows if has_rows else out  # (a pointer the kernel never reads without rows)
    key = (_pack_wire_kernel, n, b, row, s // chunk, has_rows, k.dtype, index.dtype, k.device)
    cached_bound(key, lambda: (_pack_wire_kernel, (n, b * nb, 2), (TENSOR,) * 4 + (b * row, row, nb, s // chunk),
                               dict(HAS_ROWS=has_rows, BLOCK=BLOCK, num_warps=4)))(k, v, index, out)
