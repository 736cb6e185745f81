"""Context-parallel FlashMask attention: each rank holds its shard of q, k, v (plan order).

Two communication schemes, both exact and differentiable:

* ``allgather`` (baseline): all-gather K/V, attend over the needed chunks; backward
  all-gathers again and reduce-scatters dK/dV.
* ``overlap`` (ours): only the needed KV chunks travel, by the plan's point-to-point rounds.
  The rank's own chunks are computed first while the remote ones arrive; each stage's partial
  result is merged by log-sum-exp. Backward fetches again the same way, computes each stage
  against the merged output/LSE (exact for a softmax split over key blocks), and returns each
  remote chunk's partial dK/dV to the rank it came from only (summed at relays on the way).

The schedule, the buffers and the per-rank device program live in
:mod:`flashmask3.distributed.runtime` (docs/cp-runtime.md); this module checks the arguments,
resolves the group and owns the autograd. The attention calls go straight to the selected
backend's ``forward``/``backward`` (docs/ARCHITECTURE.md backend contract).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..api import _needs_autograd, _traced, check_qkv, resolve_softmax_scale
from ..kernels import choose_backend, get_backend
from .comm import DistExchange, check_node_layout, ensure_ready, group_of_name, resolve_group
from .handles import name_object, named_object
from .plan import CPPlan, plan_of_token
from .program import prepare_rank, resolve_backward_calls
from .runtime import (acc_dtype, backward_allgather, backward_overlap, forward_allgather, forward_overlap,
                      merge_stages)

COMMS = ("allgather", "overlap")


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two attentions over disjoint key sets: weights ``exp(lse_x - lse)``.

    ``out``: ``[B, S, H, D]``; ``lse``: ``[B, H, S]``. Rows masked in both parts keep
    ``lse = -inf`` and ``out = 0``. Computed in float64 for float64 inputs, float32 otherwise."""
    dtype = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype) else torch.float32
    return merge_stages([out_a, out_b], [lse_a, lse_b], dtype)


class _Call:
    """What one layer's forward and backward share (not tensors autograd must track)."""

    def __init__(self, prog, exchange, backend, scale, keep_kv: bool = True):
        self.prog, self.exchange, self.backend, self.scale = prog, exchange, backend, scale
        self.keep_kv = keep_kv


def _forward(call: _Call, q, k, v, keep: bool):
    """The layer's forward: ``(out, lse, kept)``; ``kept`` is the overlapped forward's key
    buffer when ``keep`` (for the backward), else None."""
    if call.prog.comm == "overlap":
        return forward_overlap(call.prog, call.exchange, call.backend, q, k, v, call.scale, keep)
    return (*forward_allgather(call.prog, call.exchange, call.backend, q, k, v, call.scale), None)


def _backward(call: _Call, dout, dlse, q, k, v, out, lse, kept):
    """The layer's backward: ``(dq, dk, dv)``."""
    args = (call.prog, call.exchange, call.backend, dout.contiguous(), dlse, q, k, v, out, lse, call.scale)
    if call.prog.comm == "overlap":
        return backward_overlap(*args, kept=kept)
    return backward_allgather(*args)


class _CPAttention(torch.autograd.Function):
    """The layer's autograd for eager calls (the traced ones take the custom op below)."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        keep = call.keep_kv and any(ctx.needs_input_grad[:3])  # no backward: nothing to keep
        out, lse, kept = _forward(call, q, k, v, keep)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse, *(() if kept is None else (kept,)))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.call, dout, dlse, q, k, v, out, lse, kept[0] if kept else None)
        return dq, dk, dv, None


def run_layer(q, k, v, prog, exchange, softmax_scale: float, backend=None, keep_kv: bool = True):
    """One differentiable layer of the staged runtime with any exchange (``DistExchange`` for
    a process group; :class:`~flashmask3.distributed.runtime.EmulatedExchange` in one
    process). ``keep_kv``: the overlapped backward reuses the K/V the forward received
    (kept alive until then) instead of fetching them again. Returns ``(out, lse)``."""
    backend = backend or get_backend(choose_backend(q))
    return _CPAttention.apply(q, k, v, _Call(prog, exchange, backend, softmax_scale, keep_kv))


# -- the traced layer: a torch.library custom op ---------------------------------------------------
#
# Under torch.compile (and export, fake modes, functorch transforms) the layer is one opaque op:
# dynamo does not walk the runtime's Python (placement-dependent loops, collectives). Its
# non-tensor inputs name what the eager call passes as objects: the plan by its token
# (CPPlan.op_token, a tensor, so a new plan reuses the graph), the group by its name.


#: Inductor's CUDA graphs (``mode="reduce-overhead"``) must not record the layer: a graph would
#: replay the plan it recorded (its messages and buffer sizes) for every later batch's plan. A
#: graph holding a tagged op is not captured (with inductor's graph partitioning, the op runs
#: between captured parts); the runtime's own capture (docs/cp-runtime.md) serves one plan.
_NOT_IN_CUDA_GRAPHS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def _layout_args(node_layout, nodes: int) -> tuple[Optional[int], Optional[list[int]]]:
    """``node_layout`` as the op's two arguments (GPUs per node, node id per global rank)."""
    if nodes == 1 or node_layout is None:
        return None, None
    if isinstance(node_layout, int) and not isinstance(node_layout, bool):
        return node_layout, None
    if callable(node_layout) or isinstance(node_layout, (str, bytes, bool)):
        raise TypeError("node_layout: under torch.compile pass GPUs per node (int) or a node id per "
                        f"global rank (sequence of ints), got {type(node_layout).__name__}")
    return None, [int(n) for n in node_layout]


def _op_plan(plan_token, window: int) -> CPPlan:
    """The plan an op runs: the token's, windowed where ``window`` >= 0."""
    plan = plan_of_token(plan_token)
    return plan if window < 0 else plan.windowed(window)


def _op_call(plan_token, window: int, group_name: str, q, comm: str, backward_calls: str,
             scale: float) -> _Call:
    """The backward op's call (the forward op's checks were made; the program is cached)."""
    return _rank_call(q, _op_plan(plan_token, window), group_of_name(group_name), comm, backward_calls, scale)


@torch.library.custom_op("flashmask3::cp_attention_forward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def _cp_forward_op(
    q: Tensor, k: Tensor, v: Tensor, plan_token: Tensor, window: int, group_name: str, comm: str,
    backward_calls: str, softmax_scale: float, keep: bool, check_plan: bool,
    gpus_per_node: Optional[int], rank_nodes: Optional[list[int]],
) -> tuple[Tensor, Tensor, Tensor]:
    # returns (out, lse, kept): kept names the key buffer kept for the backward (_kept_handle)
    plan, pg = _op_plan(plan_token, window), group_of_name(group_name)
    layout = gpus_per_node if gpus_per_node is not None else rank_nodes
    q, k, v = (t.contiguous() for t in (q, k, v))
    call = _layer_call(q, plan, pg, comm, backward_calls, layout, check_plan, softmax_scale, keep)
    out, lse, kept = _forward(call, q, k, v, keep)
    return out, lse, _kept_handle(kept)


@_cp_forward_op.register_fake
def _cp_forward_fake(q, k, v, plan_token, window, group_name, comm, backward_calls, softmax_scale, keep,
                     check_plan, gpus_per_node, rank_nodes):
    b, s, h, _ = q.shape
    out = q.new_empty(b, s, h, v.shape[-1])
    lse = q.new_empty(b, h, s, dtype=acc_dtype(q.dtype))
    return out, lse, torch.empty((), dtype=torch.int64, device="cpu")


# The kept K/V reach the backward op by name (handles.py), not as an output: their length
# depends on the plan (data, not shape), and an output of data-dependent size is a graph break
# under torch.compile without fullgraph. The name holds the buffer, so the buffer lives as long
# as autograd keeps the name for the backward.


def _kept_handle(kept: Optional[Tensor]) -> Tensor:
    """A 0-d int64 CPU tensor naming ``kept`` for :func:`_kept_of` (0: nothing kept)."""
    return torch.zeros((), dtype=torch.int64, device="cpu") if kept is None else name_object(kept)


def _kept_of(handle: Tensor) -> Optional[Tensor]:
    """The buffer ``handle`` names, or None where the forward kept nothing. A kept buffer that
    is gone is an error, not a refetch: the other ranks' backwards do not fetch, and the
    exchange rounds of all ranks must match."""
    if not int(handle):
        return None
    kept = named_object(handle)
    if kept is None:
        raise RuntimeError("the K/V that this context-parallel layer's forward kept for its backward "
                           "are gone (their handle was copied or freed by a transform); pass "
                           "keep_kv=False to fetch them again in the backward")
    return kept


@torch.library.custom_op("flashmask3::cp_attention_backward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def _cp_backward_op(
    dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    kept: Tensor, plan_token: Tensor, window: int, group_name: str, comm: str, backward_calls: str,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = (t.contiguous() for t in (q, k, v))
    call = _op_call(plan_token, window, group_name, q, comm, backward_calls, softmax_scale)
    grads = _backward(call, dout, dlse, q, k, v, out, lse, _kept_of(kept))
    return _unaliased(grads)


@_cp_backward_op.register_fake
def _cp_backward_fake(dout, dlse, q, k, v, out, lse, kept, plan_token, window, group_name, comm,
                      backward_calls, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _unaliased(tensors) -> tuple[Tensor, ...]:
    """``tensors``, each sharing no memory with an earlier one (a custom op's outputs must not
    alias each other: the runtime's dK and dV can be views of one buffer)."""
    seen, out = set(), []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return tuple(out)


def _cp_setup_context(ctx, inputs, output):
    q, k, v, plan_token, window, group_name, comm, backward_calls, scale, *_ = inputs
    out, lse, kept = output
    ctx.save_for_backward(q, k, v, out, lse, kept, plan_token)
    ctx.args = (window, group_name, comm, backward_calls, scale)


def _cp_backward_formula(ctx, dout, dlse, _dkept):
    q, k, v, out, lse, kept, plan_token = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    dq, dk, dv = _cp_backward_op(dout, dlse, q, k, v, out, lse, kept, plan_token, *ctx.args)
    return (dq, dk, dv) + (None,) * 10


_cp_forward_op.register_autograd(_cp_backward_formula, setup_context=_cp_setup_context)


def _traced_layer(q, k, v, plan: CPPlan, pg, comm, backward_calls, softmax_scale, keep_kv,
                  check_plan, node_layout, window_size):
    """The layer through the custom op: ``(out, lse)``."""
    keep = keep_kv and comm == "overlap" and _needs_autograd(q, k, v)
    gpus_per_node, rank_nodes = _layout_args(node_layout, plan.nodes)
    window = -1 if window_size is None else window_size
    out, lse, _ = _cp_forward_op(q, k, v, plan.op_token, window, pg.group_name, comm, backward_calls,
                                 softmax_scale, keep, check_plan, gpus_per_node, rank_nodes)
    return out, lse


def _check_batch_and_heads(prog, q) -> None:
    cols = next((c for c in prog.stage_cols if c is not None), None)
    if cols is None:
        return
    if cols.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"the plan's mask has batch {cols.shape[0]} but q has batch {q.shape[0]}")
    if q.shape[2] % cols.shape[1]:
        raise ValueError(f"the plan's mask has {cols.shape[1]} heads, which must divide the "
                         f"{q.shape[2]} query heads")


def _check_same_plan(plan: CPPlan, pg, device) -> None:
    """Raise ValueError on every rank if the ranks' plans differ (one small all-reduce)."""
    fp = plan.fingerprint
    t = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    if int(t[0]) != fp or -int(t[1]) != fp:
        raise ValueError("the ranks of the group hold different CP plans (built from different "
                         "masks or arguments); every rank must plan from the same global mask")


def _layer_call(q, plan: CPPlan, pg, comm: str, backward_calls: str, node_layout, check_plan: bool,
                scale: float, keep_kv: bool) -> _Call:
    """The plan's checks on this group (each a ValueError on every rank, before the layer's
    traffic) and the rank's call: program, exchange, backend."""
    resolve_backward_calls(backward_calls, plan)
    ensure_ready(pg, q.device)
    check_node_layout(pg, plan.nodes, node_layout, q.device)
    if check_plan:
        _check_same_plan(plan, pg, q.device)
    call = _rank_call(q, plan, pg, comm, backward_calls, scale, keep_kv)
    _check_batch_and_heads(call.prog, q)
    return call


def _rank_call(q, plan: CPPlan, pg, comm: str, backward_calls: str, scale: float,
               keep_kv: bool = True) -> _Call:
    """This rank's call of ``plan`` on ``pg``: its program (built once per plan and cached), the
    group's exchange, the backend of ``q``."""
    prog = prepare_rank(plan, dist.get_rank(pg), q.device, comm, backward_calls)
    return _Call(prog, DistExchange(pg), get_backend(choose_backend(q)), scale, keep_kv)


def cp_flashmask_attention(q, k, v, plan: CPPlan, *, group=None, comm: str = "overlap",
                           softmax_scale: Optional[float] = None, return_softmax_lse: bool = False,
                           check_plan: bool = False, node_layout=None, backward_calls: str = "auto",
                           keep_kv: bool = True, window_size: Optional[int] = None):
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
        node_layout: for a plan with ``nodes > 1``, where the group's ranks live: GPUs per node
            (node of global rank g = g // it), a node id per global rank (sequence or callable),
            or ``None`` to read torchrun's ``LOCAL_WORLD_SIZE``. The group must be node-major
            (group rank r on node r // (cp_size // nodes)); otherwise every rank raises
            ValueError (checked once per group and layout).
        backward_calls: how the overlapped backward calls the attention backward: ``"stage"``
            (one call per stage as its K/V arrive), ``"one"`` (one call over every stage once
            all arrived), ``"one+local"`` (the remote keys' call first, then the own keys while their gradients
            travel) or ``"auto"`` (a rule on the plan's shape, the same on every rank:
            :func:`~flashmask3.distributed.program.auto_backward_calls`; docs/cp-runtime.md
            "Backward calls"). Ignored by ``comm="allgather"``.
        keep_kv: the overlapped backward reuses the remote K/V the forward received (kept
            alive until the backward: the needed remote keys x Hk x D x 2 x the dtype's bytes per
            layer, plus the own K/V where the backward makes one call) instead of fetching them
            again; ``False`` frees them after the forward and refetches. Must be the same on
            every rank. Ignored by ``comm="allgather"``.
        window_size: limit a causal plan's mask to a sliding window: query ``i`` keeps only the
            keys ``[i - window_size, i]`` the mask allowed (``flashmask_attention``'s convention).
            The layer runs :meth:`CPPlan.windowed` (the same placement and shards; only the
            chunks inside the windows travel), built on first use. For models that mix
            sliding-window and full layers over one plan.

    Returns the local output ``[B, S/P, Hq, D]`` (or ``(out, lse)``), equal to the matching rows
    of single-process ``flashmask_attention`` on the full sequence.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan must be a CPPlan (from flashmask3.distributed.plan), got {type(plan).__name__}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    if not isinstance(keep_kv, bool):
        raise TypeError(f"keep_kv must be a bool, got {type(keep_kv).__name__}")
    if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int)):
        raise TypeError(f"window_size must be an int or None, got {type(window_size).__name__}")
    if window_size is not None and window_size < 0:
        raise ValueError(f"window_size must be >= 0, got {window_size}")
    check_qkv(q, k, v)
    if q.shape[1] != plan.local_seqlen or k.shape[1] != plan.local_seqlen:
        raise ValueError(f"q and k must hold this rank's {plan.local_seqlen} tokens along dim 1, "
                         f"got {q.shape[1]} and {k.shape[1]}")
    softmax_scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    if world != plan.cp_size:
        raise ValueError(f"group has {world} ranks but the plan was made for cp_size={plan.cp_size}")
    if _traced(q):
        out, lse = _traced_layer(q, k, v, plan, pg, comm, backward_calls, softmax_scale, keep_kv,
                                 check_plan, node_layout, window_size)
    else:
        if window_size is not None:
            plan = plan.windowed(window_size)
        q, k, v = (t.contiguous() for t in (q, k, v))
        call = _layer_call(q, plan, pg, comm, backward_calls, node_layout, check_plan, softmax_scale,
                           keep_kv)
        out, lse = _CPAttention.apply(q, k, v, call)
    return (out, lse) if return_softmax_lse else out
