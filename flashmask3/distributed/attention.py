"""Context-parallel FlashMask attention: each rank holds its shard of q, k, v (plan order).

Two communication schemes, both exact and differentiable:

* ``allgather`` (baseline): all-gather K/V, attend over the needed chunks; backward
  all-gathers again and reduce-scatters dK/dV.
* ``overlap`` (ours): only the needed KV chunks travel, by the plan's point-to-point rounds.
  The rank's own chunks are computed first while the remote ones arrive; each stage's partial
  result is merged by log-sum-exp. Backward fetches again the same way, computes each stage
  against the merged output/LSE (exact for a softmax split over key blocks), and returns each
  remote chunk's partial dK/dV to the rank it came from only (summed at relays on the way).

The attention calls go straight to the selected backend's ``forward``/``backward``
(docs/ARCHITECTURE.md backend contract), so this module owns its autograd.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..api import check_qkv, resolve_softmax_scale
from ..kernels import choose_backend, get_backend
from .comm import (ChunkExchange, all_gather_kv, ensure_ready, reduce_scatter_kv,
                   resolve_group)
from .plan import CPPlan

COMMS = ("allgather", "overlap")


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two attentions over disjoint key sets: weights ``exp(lse_x - lse)``.

    ``out``: fp32 ``[B, S, H, D]``; ``lse``: fp32 ``[B, H, S]``. Rows masked in both parts keep
    ``lse = -inf`` and ``out = 0``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).transpose(1, 2).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


class _Runtime:
    """Per-call state shared by forward and backward (not tensors autograd must track)."""

    def __init__(self, plan: CPPlan, pg, rank: int, comm: str, scale: float, q, k):
        self.plan, self.pg, self.rank, self.comm, self.scale = plan, pg, rank, comm, scale
        self.backend = get_backend(choose_backend(q))
        self.stages = plan.stages(rank)
        self.own = plan.chunks(rank)
        # overlap: key axis in arrival order (stage by stage); allgather: one call, global order.
        order = "arrival" if comm == "overlap" else "sorted"
        self.key_chunks = plan.needed_chunks(rank, order)
        self.cols = self._columns(plan.local_mask(rank, order).startend_row_indices, q)
        b, _, hk, d = k.shape
        self.dtype = k.dtype
        cs = plan.chunk_size
        self.chunk_shape = (2, b, cs, hk, d)
        self.device = q.device
        bounds, start = [], 0
        for stage in self.stages:
            bounds.append((start, start + len(stage) * cs))
            start += len(stage) * cs
        self.bounds = bounds

    @staticmethod
    def _columns(cols, q):
        """The local mask columns on q's device, broadcast over q's batch if the mask has one."""
        cols = cols.to(q.device)
        if cols.shape[0] == 1 and q.shape[0] > 1:
            cols = cols.expand(q.shape[0], -1, -1, -1)
        if cols.shape[0] != q.shape[0]:
            raise ValueError(f"the plan's mask has batch {cols.shape[0]} but q has batch {q.shape[0]}")
        if q.shape[2] % cols.shape[1]:
            raise ValueError(f"the plan's mask has {cols.shape[1]} heads, which must divide the "
                             f"{q.shape[2]} query heads")
        return cols.contiguous()

    # -- helpers -------------------------------------------------------------------------------
    def make_buffer(self, n: int, dtype=None) -> torch.Tensor:
        return torch.empty((n,) + self.chunk_shape, dtype=dtype or self.dtype, device=self.device)

    def own_store(self, kv: torch.Tensor) -> dict[int, torch.Tensor]:
        cs = self.plan.chunk_size
        return {c: kv[:, :, i * cs:(i + 1) * cs] for i, c in enumerate(self.own)}

    def stage_kv(self, store, chunks):
        kv = torch.cat([store[c] for c in chunks], dim=2) if len(chunks) > 1 else store[chunks[0]]
        return kv[0].contiguous(), kv[1].contiguous()

    def stage_cols(self, s: int) -> torch.Tensor:
        a, b = self.bounds[s]
        return self.cols[:, :, a:b].contiguous()

    def split_grads(self, grads, chunks, dk, dv) -> None:
        """Add a stage's dK/dV into the per-chunk fp32 accumulators."""
        cs = self.plan.chunk_size
        for i, c in enumerate(chunks):
            part = torch.stack([dk[:, i * cs:(i + 1) * cs], dv[:, i * cs:(i + 1) * cs]]).float()
            if c in grads:
                grads[c].add_(part)
            else:
                grads[c] = part

    def gathered_store(self, gathered: torch.Tensor) -> dict[int, torch.Tensor]:
        """Chunk id -> ``[2, B, cs, Hk, D]`` view of an all-gathered ``[P, 2, B, S_l, Hk, D]``."""
        cs = self.plan.chunk_size
        store = {}
        for r in range(self.plan.cp_size):
            for i, c in enumerate(self.plan.chunks(r)):
                store[c] = gathered[r, :, :, i * cs:(i + 1) * cs]
        return store


def _empty_result(q, v):
    b, s, h, _ = q.shape
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), -math.inf, dtype=torch.float32, device=q.device)
    return out, lse


# -- forward --------------------------------------------------------------------------------------


def _forward_overlap(rt: _Runtime, q, k, v):
    kv = torch.stack([k, v])
    exch = ChunkExchange(rt.pg, rt.rank, rt.plan.rounds, rt.own_store(kv), rt.make_buffer)
    exch.issue_ready()
    out = lse = None
    for s, chunks in enumerate(rt.stages):
        if s > 0:
            exch.wait_forward(s - 1)
        if chunks:
            ks, vs = rt.stage_kv(exch.store, chunks)
            o, l = rt.backend.forward(q, ks, vs, rt.stage_cols(s), False, rt.scale)
            out, lse = (o.float(), l) if out is None else merge_partials(out, lse, o.float(), l)
    return _empty_result(q, v) if out is None else (out, lse)


def _forward_allgather(rt: _Runtime, q, k, v):
    gathered = all_gather_kv(rt.pg, torch.stack([k, v]), rt.plan.cp_size)
    chunks = rt.key_chunks
    if not chunks:
        return _empty_result(q, v)
    ks, vs = rt.stage_kv(rt.gathered_store(gathered), chunks)
    o, l = rt.backend.forward(q, ks, vs, rt.cols, False, rt.scale)
    return o.float(), l


# -- backward -------------------------------------------------------------------------------------


def _backward_overlap(rt: _Runtime, dout, dlse, q, k, v, out, lse):
    kv = torch.stack([k, v])
    exch = ChunkExchange(rt.pg, rt.rank, rt.plan.rounds, rt.own_store(kv), rt.make_buffer)
    exch.issue_ready()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads: dict[int, torch.Tensor] = {}
    n_rounds = len(rt.plan.rounds)
    for s, chunks in enumerate(rt.stages):
        if s > 0:
            exch.wait_forward(s - 1)
        if chunks:
            ks, vs = rt.stage_kv(exch.store, chunks)
            dq_s, dk_s, dv_s = rt.backend.backward(dout, dlse, q, ks, vs, out, lse,
                                                   rt.stage_cols(s), False, rt.scale)
            dq += dq_s.float()
            rt.split_grads(grads, chunks, dk_s, dv_s)
        if s > 0 and not exch.has_relay:
            # Chunks of round s-1 are final: return their gradients while later stages compute.
            exch.start_reverse(s - 1, grads, k.dtype)
    if exch.has_relay:
        # A relay forwards what it received, so gradients flow back round by round.
        for t in reversed(range(n_rounds)):
            exch.start_reverse(t, grads, k.dtype)
            exch.wait_reverse(t, grads)
    else:
        for t in range(n_rounds):
            exch.wait_reverse(t, grads)
    zero = torch.zeros(rt.chunk_shape, dtype=torch.float32, device=q.device)
    dkv = torch.cat([grads.get(c, zero) for c in rt.own], dim=2)
    return dq, dkv[0], dkv[1]


def _backward_allgather(rt: _Runtime, dout, dlse, q, k, v, out, lse):
    p = rt.plan
    gathered = all_gather_kv(rt.pg, torch.stack([k, v]), p.cp_size)
    chunks = rt.key_chunks
    full = torch.zeros_like(gathered)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if chunks:
        ks, vs = rt.stage_kv(rt.gathered_store(gathered), chunks)
        dq, dk, dv = rt.backend.backward(dout, dlse, q, ks, vs, out, lse, rt.cols, False, rt.scale)
        target, cs = rt.gathered_store(full), p.chunk_size
        for i, c in enumerate(chunks):  # each chunk's gradient to its owner's slot, no fp32 detour
            target[c][0].copy_(dk[:, i * cs:(i + 1) * cs])
            target[c][1].copy_(dv[:, i * cs:(i + 1) * cs])
    mine = reduce_scatter_kv(rt.pg, full)
    return dq, mine[0], mine[1]


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rt: _Runtime):
        fwd = _forward_overlap if rt.comm == "overlap" else _forward_allgather
        out32, lse = fwd(rt, q, k, v)
        out = out32.to(q.dtype)
        ctx.rt = rt
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        rt = ctx.rt
        bwd = _backward_overlap if rt.comm == "overlap" else _backward_allgather
        dq, dk, dv = bwd(rt, dout.contiguous(), dlse, q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _check_same_plan(plan: CPPlan, pg, device) -> None:
    """Raise ValueError on every rank if the ranks' plans differ (one small all-reduce)."""
    fp = plan.fingerprint
    t = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    if int(t[0]) != fp or -int(t[1]) != fp:
        raise ValueError("the ranks of the group hold different CP plans (built from different "
                         "masks or arguments); every rank must plan from the same global mask")


def cp_flashmask_attention(q, k, v, plan: CPPlan, *, group=None, comm: str = "overlap",
                           softmax_scale: Optional[float] = None, return_softmax_lse: bool = False,
                           check_plan: bool = False):
    """Attention of this rank's query shard over the whole (masked) sequence.

    Args:
        q: ``[B, S/P, Hq, D]``, k/v: ``[B, S/P, Hk, D]`` -- this rank's shards in plan order
            (``plan.shard(x, rank)``).
        plan: a :class:`CPPlan` built from the global mask, identical on every rank.
        group: the context-parallel group: ``None`` (world), a ProcessGroup, a 1-D DeviceMesh
            or ``(DeviceMesh, dim)``. Its size must equal ``plan.cp_size``.
        comm: ``"overlap"`` (needed chunks only, point-to-point, overlapped) or
            ``"allgather"`` (baseline).
        softmax_scale: defaults to ``1/sqrt(D)``.
        return_softmax_lse: also return the local LSE ``[B, Hq, S/P]`` (differentiable).
        check_plan: first verify (one all-reduce) that every rank holds the same plan, so a
            rank that planned from a different mask is a ValueError instead of a hang.

    Returns the local output ``[B, S/P, Hq, D]`` (or ``(out, lse)``), equal to the matching rows
    of single-process ``flashmask_attention`` on the full sequence.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan must be a CPPlan (from flashmask3.distributed.plan), got {type(plan).__name__}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    check_qkv(q, k, v)
    if q.shape[1] != plan.local_seqlen or k.shape[1] != plan.local_seqlen:
        raise ValueError(f"q and k must hold this rank's {plan.local_seqlen} tokens along dim 1, "
                         f"got {q.shape[1]} and {k.shape[1]}")
    softmax_scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    if world != plan.cp_size:
        raise ValueError(f"group has {world} ranks but the plan was made for cp_size={plan.cp_size}")
    ensure_ready(pg, q.device)
    if check_plan:
        _check_same_plan(plan, pg, q.device)
    q, k, v = (t.contiguous() for t in (q, k, v))
    rt = _Runtime(plan, pg, dist.get_rank(pg), comm, softmax_scale, q, k)
    out, lse = _CPAttention.apply(q, k, v, rt)
    return (out, lse) if return_softmax_lse else out
