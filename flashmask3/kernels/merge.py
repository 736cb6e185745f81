"""One launch that merges partial attentions: the context-parallel forward's last step.

A rank's forward runs one attention call per stage, each over a disjoint set of keys, and
combines them with the log-sum-exp weights ``w_s = exp(lse_s - lse)``, ``lse = log sum_s
exp(lse_s)``, ``out = sum_s w_s out_s``. In torch that is about fifteen launches (stacks,
casts, a max, exps, sums, a log, a division; ``distributed.runtime.merge_stages``, which
stays the reference and the CPU / float64 path) and their host work; :func:`merge_stages`
does it in one kernel that reads each stage's output once and writes the merged output in
the queries' dtype and the fp32 LSE.

Rows masked in every stage (every ``lse_s = -inf``) get ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import TENSOR, cached_bound, cdiv
from .tl_kernels import interpreting

#: Stage outputs one launch reads; more are merged in groups (fp32 partial results).
MAX_PARTS = 8


@triton.jit
def _part_lse(lse_ptr, row, rmask):
    return tl.load(lse_ptr + row, mask=rmask, other=float("-inf")).to(tl.float32)


@triton.jit
def _add_part(acc, den, o_ptr, lse_ptr, row, off, rmask, top):
    """One part's weighted output added into ``acc`` and its weight into ``den``."""
    w = tl.exp(_part_lse(lse_ptr, row, rmask) - top)  # 0 where the part is masked
    o = tl.load(o_ptr + off, mask=rmask[:, None], other=0.0).to(tl.float32)
    return acc + o * w[:, None], den + w


@triton.jit(do_not_specialize=["S", "H"])
def _merge_kernel(o0, o1, o2, o3, o4, o5, o6, o7, l0, l1, l2, l3, l4, l5, l6, l7,
                  out_ptr, lse_ptr, S, H, N: tl.constexpr, D: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """Rows ``[r0, r0 + BLOCK_R)`` of head ``h`` of batch ``b``: outs ``[B, S, H, D]``, lses
    ``[B, H, S]`` (all contiguous), parts 0..N-1 (the unused pointers are None)."""
    r_blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_r = r_blk * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < S
    row = (b * H + h) * S + offs_r
    off = ((b * S + offs_r) * H + h)[:, None] * D + tl.arange(0, D)[None, :]
    top = _part_lse(l0, row, rmask)
    if N > 1:
        top = tl.maximum(top, _part_lse(l1, row, rmask))
    if N > 2:
        top = tl.maximum(top, _part_lse(l2, row, rmask))
    if N > 3:
        top = tl.maximum(top, _part_lse(l3, row, rmask))
    if N > 4:
        top = tl.maximum(top, _part_lse(l4, row, rmask))
    if N > 5:
        top = tl.maximum(top, _part_lse(l5, row, rmask))
    if N > 6:
        top = tl.maximum(top, _part_lse(l6, row, rmask))
    if N > 7:
        top = tl.maximum(top, _part_lse(l7, row, rmask))
    top = tl.where(top == float("-inf"), 0.0, top)  # finite: exp(-inf - top) = 0
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc, den = _add_part(acc, den, o0, l0, row, off, rmask, top)
    if N > 1:
        acc, den = _add_part(acc, den, o1, l1, row, off, rmask, top)
    if N > 2:
        acc, den = _add_part(acc, den, o2, l2, row, off, rmask, top)
    if N > 3:
        acc, den = _add_part(acc, den, o3, l3, row, off, rmask, top)
    if N > 4:
        acc, den = _add_part(acc, den, o4, l4, row, off, rmask, top)
    if N > 5:
        acc, den = _add_part(acc, den, o5, l5, row, off, rmask, top)
    if N > 6:
        acc, den = _add_part(acc, den, o6, l6, row, off, rmask, top)
    if N > 7:
        acc, den = _add_part(acc, den, o7, l7, row, off, rmask, top)
    masked = den == 0.0
    inv = tl.where(masked, 0.0, 1.0 / tl.where(masked, 1.0, den))
    tl.store(out_ptr + off, (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])
    lse = tl.where(masked, float("-inf"), top + tl.log(tl.where(masked, 1.0, den)))
    tl.store(lse_ptr + row, lse, mask=rmask)


def _check_parts(outs, lses) -> None:
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty lists of one length, got {len(outs)} "
                         f"and {len(lses)}")
    b, s, h, d = outs[0].shape
    for o, l in zip(outs, lses):
        if o.shape != outs[0].shape or tuple(l.shape) != (b, h, s):
            raise ValueError(f"every out must be [B, S, H, D] = {tuple(outs[0].shape)} and every "
                             f"lse [B, H, S] = {(b, h, s)}, got {tuple(o.shape)} and "
                             f"{tuple(l.shape)}")
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"the merge kernel supports head dims 16..256 powers of two, got {d}")


def usable(q: torch.Tensor) -> bool:
    """Whether :func:`merge_stages` runs for queries like ``q``: on a GPU (or Triton's CPU
    interpreter) in a 16- or 32-bit float dtype (float64 takes the torch path)."""
    return (q.is_cuda or interpreting()) and q.dtype in (torch.float16, torch.bfloat16, torch.float32)


def merge_stages(outs: list[torch.Tensor], lses: list[torch.Tensor], out_dtype: torch.dtype):
    """``(out, lse)`` of attentions over disjoint key sets merged: ``out [B, S, H, D]`` in
    ``out_dtype``, ``lse [B, H, S]`` fp32 (one launch per :data:`MAX_PARTS` parts). The
    Triton counterpart of ``distributed.runtime.merge_stages`` (module docstring)."""
    _check_parts(outs, lses)
    if len(outs) > MAX_PARTS:  # merge the first ones into one fp32 part, then the rest
        o, l = merge_stages(outs[:MAX_PARTS], lses[:MAX_PARTS], torch.float32)
        return merge_stages([o, *outs[MAX_PARTS:]], [l, *lses[MAX_PARTS:]], out_dtype)
    b, s, h, d = outs[0].shape
    out = torch.empty((b, s, h, d), dtype=out_dtype, device=outs[0].device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=outs[0].device)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    n = len(outs)
    block_r = 64 if d <= 128 else 32
    parts = [o.contiguous() for o in outs] + [x.contiguous() for x in lses]
    # bound once per configuration (launcher.cached_bound); the absent parts are None
    key = (_merge_kernel, b, s, h, d, tuple(o.dtype for o in parts), out_dtype, out.device)
    slots = (TENSOR,) * n + (None,) * (MAX_PARTS - n)
    cached_bound(key, lambda: (_merge_kernel, (cdiv(s, block_r), h, b), slots + slots + (TENSOR, TENSOR, s, h),
                               dict(N=n, D=d, BLOCK_R=block_r, num_warps=4)))(*parts, out, lse)
    return out, lse
