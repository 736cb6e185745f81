"""The per-layer context-parallel runtime: the staged schedule that runs a rank's program.

A rank's :class:`~flashmask3.distributed.program.RankProgram` (built once per plan by
:func:`~flashmask3.distributed.program.prepare_rank`) holds every index and layout; a layer then
runs :func:`forward_overlap` / :func:`backward_overlap` (or the all-gather baseline's
:func:`forward_allgather` / :func:`backward_allgather`) with a fixed number of tensor operations
that does not grow with the cp size or the number of chunks; see docs/cp-runtime.md for the
schedule, the buffers and the launch budget.

Layouts. K and V travel together in *wire rows*: ``[rows, 2, B, chunk, Hk, D]``, one row per
chunk, so that one message is one contiguous slice of a buffer. A direct message whose chunks are
consecutive own chunks is a view of the rank's own wire rows; the others are packed straight from
K and V by one launch per pass (:func:`pack_wire_rows`). Each pass keeps one *key buffer*
``[2, B, keys, Hk, D]`` whose halves hold the K and V of every stage it computes, in stage order:
a stage's keys are gathered into its slice once, as its round arrives (one launch,
:func:`gather_stage_keys`), the stage calls read slices of it and the merged backward call reads
all of it; with ``keep_kv`` the backward reuses the forward's buffer and gathers nothing.
Gradients travel back in the same wire rows and are summed into the rank's own dK/dV by one launch
(kernels/returns.py) or ``index_add_``.

Backward calls. :func:`backward_overlap` calls the staged backward once per stage (``"stage"``),
once over every stage after all K/V arrived (``"one"``), or once over the remote stages first and
then on the own stage while their gradients travel (``"one+local"``); see
:data:`~.program.BACKWARD_CALLS` and :func:`~.program.auto_backward_calls` (the default rule,
shared with benchmarks/scale_model).

Communication goes through an *exchange* object (:class:`~flashmask3.distributed.comm.DistExchange`
for torch.distributed, :class:`EmulatedExchange` for one-process emulation and launch counting)
with ``start(round, reverse, send, recv)``, ``all_gather(out, inp)`` and
``reduce_scatter(out, inp)``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.staged import staged_functions
from .launches import call_attention, not_counted
from .program import RankProgram, RoundProgram


# -- layouts ----------------------------------------------------------------------------------------


def to_wire(k: torch.Tensor, v: torch.Tensor, chunk: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, n*chunk, Hk, D]`` K and V -> wire rows ``[n, 2, B, chunk, Hk, D]`` (one copy, into
    ``out`` when given)."""
    b, s, h, d = k.shape
    kc = k.view(b, s // chunk, chunk, h, d).transpose(0, 1)
    vc = v.view(b, s // chunk, chunk, h, d).transpose(0, 1)
    if out is None:
        return torch.stack([kc, vc], dim=1)
    return torch.stack([kc, vc], dim=1, out=out)


def from_wire(rows: torch.Tensor, index: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K and V ``[B, n*chunk, Hk, D]`` of wire ``rows`` (selected by ``index``)."""
    n, _, b, cs, h, d = rows.shape
    kv = rows.permute(1, 2, 0, 3, 4, 5)
    kv = kv.index_select(2, index) if index is not None else kv.contiguous()
    m = kv.shape[2]
    return kv[0].view(b, m * cs, h, d), kv[1].view(b, m * cs, h, d)


def _wire_shape(rows: int, k: torch.Tensor, chunk: int) -> tuple[int, ...]:
    return (rows, 2, k.shape[0], chunk, k.shape[2], k.shape[3])


def gather_stage_keys(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, pos: int,
                      backend=None) -> None:
    """Wire rows ``src[rows]`` (``[N, 2, B, chunk, Hk, D]``) into key chunks ``pos, pos + 1,
    ...`` of the key buffer ``dst`` (``[2, B, keys, Hk, D]``: K halves into ``dst[0]``, V halves
    into ``dst[1]``): in one launch where the backend has the kernel (``gather_keys``,
    kernels/gather.py) for these tensors, else by torch ops (the reference, the CPU path)."""
    fused = getattr(backend, "gather_keys", None)
    usable = getattr(backend, "wire_usable", None)
    if fused is not None and usable is not None and usable(src):
        fused(src, rows, dst, pos)
        return
    n, cs = rows.numel(), src.shape[3]
    _, b, _, h, d = dst.shape
    dst[:, :, pos * cs:(pos + n) * cs].view(2, b, n, cs, h, d).copy_(
        src.index_select(0, rows).permute(1, 2, 0, 3, 4, 5))


def pack_wire_rows(k: torch.Tensor, v: torch.Tensor, rows: Optional[torch.Tensor], chunk: int,
                   backend=None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Wire rows ``[n, 2, B, chunk, Hk, D]`` whose row ``j`` is key chunk ``rows[j]`` (``j``
    when ``rows`` is None: every chunk in order) of ``k`` and ``v`` (``[B, S, Hk, D]``), into
    ``out`` when given: in one launch where the backend has the kernel (``pack_wire``,
    kernels/gather.py), else by :func:`to_wire` and ``index_select`` (the reference, the CPU
    path)."""
    n = k.shape[1] // chunk if rows is None else rows.numel()
    if out is None:
        out = k.new_empty(_wire_shape(n, k, chunk))
    fused = getattr(backend, "pack_wire", None)
    usable = getattr(backend, "wire_usable", None)
    if fused is not None and usable is not None and usable(k) and k.is_contiguous() and v.is_contiguous():
        fused(k, v, rows, out)
        return out
    if rows is None:
        return to_wire(k, v, chunk, out=out)
    return torch.index_select(to_wire(k, v, chunk), 0, rows, out=out)


def _key_buffer(k: torch.Tensor, chunks: int, chunk: int) -> torch.Tensor:
    """An empty key buffer ``[2, B, chunks * chunk, Hk, D]`` like ``k``."""
    return k.new_empty((2, k.shape[0], chunks * chunk, k.shape[2], k.shape[3]))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else sums in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- merging partial attentions ----------------------------------------------------------------------


def merge_stages(outs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype):
    """Combine attentions over disjoint key sets (``out [B, S, H, D]``, ``lse [B, H, S]``) in a
    fixed number of operations: weights ``exp(lse_s - lse)``, computed in ``dtype``.

    Rows masked in every part keep ``lse = -inf`` and ``out = 0``."""
    if len(outs) == 1:
        return outs[0], lses[0]
    lse_all = torch.stack(lses).to(dtype)                   # [S, B, H, L]
    top = lse_all.amax(0).clamp_min(torch.finfo(dtype).min)  # finite even where all are -inf
    w = torch.exp(lse_all - top)
    den = w.sum(0)
    lse = top + den.log()                                   # -inf where every part is masked
    w = w / den.clamp_min(torch.finfo(dtype).tiny)
    out = (torch.stack(outs) * w.transpose(2, 3).unsqueeze(-1)).sum(0)
    return out, lse


# -- the per-layer schedule ----------------------------------------------------------------------------


def _round_views(prog: RankProgram, store: torch.Tensor, lead: int) -> dict[int, torch.Tensor]:
    """Each round's receive rows as a view of the pass's K/V ``store`` (``lead`` own rows first)."""
    return {r.index: store[lead + r.recv_offset:lead + r.recv_offset + r.n_recv] for r in prog.rounds}


class _Rounds:
    """Forward traffic of one pass: issues rounds as their payloads become available.

    Every round receives into its rows of one K/V ``store``; where the key buffer holds the own
    stage (``prog.key_first == 0``) the rank's own wire rows lead it, so that every held stage
    is gathered from the store alike. A direct round goes out as one view
    (:attr:`RoundProgram.send_slice`): of the own wire rows where its rows are one run of own
    chunks, else of the packed payload, which one launch builds from K/V for every round."""

    def __init__(self, prog: RankProgram, exchange, k, v, backend=None):
        self.prog, self.exchange = prog, exchange
        cs = prog.chunk_size
        self.pending: dict[int, object] = {}
        self.arrived: set[int] = set()
        lead = prog.n_own if prog.key_first == 0 else 0
        self.store = k.new_empty(_wire_shape(lead + prog.n_recv, k, cs))
        self.bufs = _round_views(prog, self.store, lead)
        wire_own = None
        if lead:
            wire_own = pack_wire_rows(k, v, None, cs, backend, out=self.store[:lead])
        elif prog.sends_own_rows:
            wire_own = pack_wire_rows(k, v, None, cs, backend)
        packed = pack_wire_rows(k, v, prog.pack_rows, cs, backend) if prog.pack_rows is not None else None
        for r in prog.rounds:
            if r.source is None:
                send = None
                if r.send_slice is not None:
                    from_pack, a, b = r.send_slice
                    send = (packed if from_pack else wire_own)[a:b]
                self.pending[r.index] = exchange.start(r, False, send, self.bufs[r.index])

    def arrive(self, t: int) -> torch.Tensor:
        """Make the current stream wait for round ``t`` (its source first); returns its buffer.
        Relay rounds that forward round ``t`` are issued right after it arrives."""
        if t in self.arrived:
            return self.bufs[t]
        r = self.prog.rounds[t]
        if r.source is not None:
            self.arrive(r.source)
        self.pending.pop(t).wait()
        self.arrived.add(t)
        for c in r.children:
            child = self.prog.rounds[c]
            send = self.bufs[t].index_select(0, child.send_rows) if child.n_send else None
            self.pending[c] = self.exchange.start(child, False, send, self.bufs[c])
        return self.bufs[t]


class _Keys:
    """The key buffer of one pass (``RankProgram.key_rows``): each held stage's K and V,
    gathered from the rounds' store once, when the stage is first needed."""

    def __init__(self, prog: RankProgram, k, rounds: Optional[_Rounds], backend):
        self.prog, self.rounds, self.backend = prog, rounds, backend
        self.buf = _key_buffer(k, prog.n_keys, prog.chunk_size)
        self.filled: set[int] = set()

    def arrive(self, t: int) -> None:
        """Round ``t`` arrived (a no-op once the store is released: every round has)."""
        if self.rounds is not None:
            self.rounds.arrive(t)

    def _fill(self, s: int) -> None:
        if s in self.filled:
            return
        a, b = self.prog.key_slice(s)
        if b > a:
            if s > 0:
                self.arrive(s - 1)
            rows = self.prog.stage_key_rows[s - self.prog.key_first]
            gather_stage_keys(self.rounds.store, rows, self.buf, a, self.backend)
        self.filled.add(s)

    def stage(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, keys, Hk, D]`` of held stage ``s`` (slices of the buffer)."""
        self._fill(s)
        a, b = self.prog.key_slice(s)
        cs = self.prog.chunk_size
        return self.buf.narrow(2, a * cs, (b - a) * cs).unbind(0)

    def all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every held stage (the whole buffer: the merged backward call's keys)."""
        for s in range(self.prog.key_first, len(self.prog.stage_chunks)):
            self._fill(s)
        return self.buf.unbind(0)

    def kept(self) -> torch.Tensor:
        """The buffer with every stage gathered, for the backward (:meth:`of`)."""
        self.all()
        self.rounds = None
        return self.buf

    @classmethod
    def of(cls, prog: RankProgram, buf: torch.Tensor) -> "_Keys":
        """A pass's keys from a kept buffer (:meth:`kept`): every stage there, no traffic."""
        self = cls.__new__(cls)
        self.prog, self.rounds, self.backend, self.buf = prog, None, None, buf
        self.filled = set(range(prog.key_first, len(prog.stage_chunks)))
        return self


def _stage_kv(prog, keys: _Keys, s, k, v):
    """Contiguous K and V of stage ``s`` (0: the own chunks; s > 0: round s-1's arrivals):
    slices of the key buffer, or the own K/V where the buffer does not hold the own stage."""
    if s >= prog.key_first:
        return keys.stage(s)
    if prog.own_rows is None:
        return k, v
    b, _, h, d = k.shape
    shape = (b, prog.n_own, prog.chunk_size, h, d)
    return (k.view(shape).index_select(1, prog.own_rows).flatten(1, 2),
            v.view(shape).index_select(1, prog.own_rows).flatten(1, 2))


def forward_overlap(prog: RankProgram, exchange, backend, q, k, v, scale, keep_kv: bool = False):
    """Staged forward: own chunks while the remote ones arrive, then each round's stage;
    partial results merged once at the end. Returns ``(out, lse, kept)``, out in q's dtype;
    ``kept`` (``keep_kv``, else None): the pass's key buffer (every stage's K/V, gathered
    once), for :func:`backward_overlap` to reuse instead of fetching the K/V again."""
    rounds = _Rounds(prog, exchange, k, v, backend)
    keys = _Keys(prog, k, rounds, backend)
    outs, lses = [], []
    for s, chunks in enumerate(prog.stage_chunks):
        if s > 0:
            rounds.arrive(s - 1)
        if not chunks:
            continue
        ks, vs = _stage_kv(prog, keys, s, k, v)
        o, l = call_attention(backend.forward, q, ks, vs, prog.cols(s, q.shape[0]), False, scale)
        outs.append(o)
        lses.append(l)
    return (*_finish_forward(outs, lses, q, v, backend), keys.kept() if keep_kv else None)


def _finish_forward(outs, lses, q, v, backend=None):
    """The stages' partial attentions merged into ``(out, lse)``, out in q's dtype: in one
    launch where the backend has a merge kernel (``merge_stages``) for these tensors
    (``merge_usable``: CUDA or the interpreter, 16/32-bit), else by :func:`merge_stages`."""
    if not outs:
        b, s, h, _ = q.shape
        out = q.new_zeros(b, s, h, v.shape[-1])
        lse = torch.full((b, h, s), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
        return out, lse
    fused = getattr(backend, "merge_stages", None)
    usable = getattr(backend, "merge_usable", None)
    if fused is not None and usable is not None and len(outs) > 1 and usable(q):
        return fused(outs, lses, q.dtype)
    out, lse = merge_stages(outs, lses, acc_dtype(q.dtype))
    return out.to(q.dtype), lse


class _Returns:
    """Backward traffic in reverse: each received chunk's gradient back to where it came from.

    Where a round's return is a sum (its own stage's dK/dV of the round's chunks plus what the
    ranks it relayed them to sent back), one launch makes it (``sum_wire_rows``,
    kernels/returns.py) when the backend has the kernel for these tensors, else torch ops do
    (an fp32 accumulator and ``index_add_``: the reference, the CPU and float64 path). The
    gradients relays send back to this rank land in one buffer per source round
    (:attr:`RoundProgram.child_offset`)."""

    def __init__(self, prog: RankProgram, exchange, k, backend=None):
        self.prog, self.exchange, self.k, self.backend = prog, exchange, k, backend
        self.acc = acc_dtype(k.dtype)
        cs = prog.chunk_size
        self.direct_buf = k.new_empty(_wire_shape(prog.n_direct_send, k, cs))
        usable = getattr(backend, "returns_usable", None)
        self.sum_rows = (getattr(backend, "sum_wire_rows", None)
                         if usable is not None and usable(k) else None)
        self.child_bufs: dict[int, torch.Tensor] = {}  # source round -> its children's returns
        self.grads: dict[int, torch.Tensor] = {}  # accumulators of rounds that relay on
        self.stage_wires: dict[int, torch.Tensor] = {}  # stage dK/dV wire rows awaiting the sum kernel
        self.pending: dict[int, object] = {}

    def stage_grads(self, r: RoundProgram, dk, dv) -> None:
        """Record round ``r``'s stage gradients (its stage's dK/dV): where they go back unchanged,
        packed straight into wire rows in receive order (one move, :func:`pack_wire_rows`)."""
        if r.fast_grad:
            self.grads[r.index] = pack_wire_rows(dk, dv, r.grad_rows, self.prog.chunk_size, self.backend)
            return
        self.stage_wire(r, pack_wire_rows(dk, dv, None, self.prog.chunk_size, self.backend))

    def stage_wire(self, r: RoundProgram, wire: torch.Tensor) -> None:
        """Record round ``r``'s stage gradients as wire rows ``[n_stage, 2, B, cs, Hk, D]`` in
        stage order (kept as they are where they go back unchanged or the sum kernel runs)."""
        if r.fast_grad:
            self.grads[r.index] = wire if r.grad_rows is None else wire.index_select(0, r.grad_rows)
            return
        if self.sum_rows is not None:
            self.stage_wires[r.index] = wire
            return
        g = self.k.new_zeros(_wire_shape(r.n_recv, self.k, self.prog.chunk_size), dtype=self.acc)
        if r.stage_size:
            g.index_add_(0, r.stage_rows, wire.to(self.acc))
        self.grads[r.index] = g

    def _children_buffer(self, source: int) -> torch.Tensor:
        """The buffer the returns of round ``source``'s children land in (made on first use)."""
        buf = self.child_bufs.get(source)
        if buf is None:
            rows = sum(self.prog.rounds[c].n_send for c in self.prog.rounds[source].children)
            buf = self.child_bufs[source] = self.k.new_empty(_wire_shape(rows, self.k, self.prog.chunk_size))
        return buf

    def _summed(self, r: RoundProgram) -> Optional[torch.Tensor]:
        """Round ``r``'s gradient return, summed from its stage rows and its children's returns
        (their returns waited for), in ``k``'s dtype; None if it sends nothing back."""
        for c in r.children:
            self.pending.pop(c).wait()
        children = self.child_bufs.get(r.index) if any(self.prog.rounds[c].n_send for c in r.children) else None
        if self.sum_rows is not None and not r.fast_grad:
            if not r.n_recv:
                return None
            stage_index, children_index = r.sum_index
            stage = self.stage_wires.pop(r.index, None) if stage_index is not None else None
            return self.sum_rows(stage, stage_index, children, children_index, r.n_recv,
                                 self.prog.chunk_size, self.k)
        if r.index not in self.grads and r.n_recv:  # no stage here: only relayed on
            self.grads[r.index] = self.k.new_zeros(_wire_shape(r.n_recv, self.k, self.prog.chunk_size),
                                                   dtype=self.acc)
        g = self.grads.pop(r.index, None)
        if g is not None and children is not None:
            for c in r.children:
                child = self.prog.rounds[c]
                if child.n_send:
                    part = children[child.child_offset:child.child_offset + child.n_send]
                    g.index_add_(0, child.send_rows, part.to(self.acc))
        return None if g is None else g.to(self.k.dtype)

    def send(self, r: RoundProgram) -> None:
        """Issue round ``r``'s gradient return once its gradients are final: children's
        returns summed in first (relays forward what their node's ranks sent back)."""
        send = self._summed(r)
        if r.source is None:
            recv = self.direct_buf[r.direct_offset:r.direct_offset + r.n_send]
        else:
            recv = self._children_buffer(r.source)[r.child_offset:r.child_offset + r.n_send]
        self.pending[r.index] = self.exchange.start(r, True, send, recv)

    def own_grads(self, wire_own: Optional[torch.Tensor], backend=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the direct returns and add them into the rank's own dK/dV: in one launch
        where the backend has the kernel (``add_returns``, kernels/returns.py) for these
        tensors, else by torch ops (an fp32 accumulator, ``index_add_``; the reference, the
        CPU and float64 path)."""
        prog, k = self.prog, self.k
        fused = getattr(backend, "add_returns", None)
        usable = getattr(backend, "returns_usable", None)
        if fused is not None and usable is not None and prog.returns_index is not None and usable(k):
            for t in list(self.pending):
                self.pending.pop(t).wait()
            own_index, direct_index = prog.returns_index
            returned = self.direct_buf if prog.n_direct_send else None
            return fused(wire_own, own_index, returned, direct_index, prog.n_own, prog.chunk_size, k)
        if wire_own is None:
            acc = k.new_zeros(_wire_shape(prog.n_own, k, prog.chunk_size), dtype=self.acc)
        elif prog.own_rows is None:
            acc = wire_own.to(self.acc)
        else:
            acc = k.new_zeros(_wire_shape(prog.n_own, k, prog.chunk_size), dtype=self.acc)
            acc.index_add_(0, prog.own_rows, wire_own.to(self.acc))
        for t in list(self.pending):
            self.pending.pop(t).wait()
        if prog.n_direct_send:
            acc.index_add_(0, prog.direct_send_rows, self.direct_buf.to(self.acc))
        dk, dv = from_wire(acc, None)
        return dk.to(k.dtype), dv.to(k.dtype)


def backward_overlap(prog: RankProgram, exchange, backend, dout, dlse, q, k, v, out, lse, scale,
                     kept: Optional[torch.Tensor] = None):
    """Staged backward (see docs/cp-runtime.md): the K/V come again by the forward's rounds and
    each remote stage's dK/dV go back to where they came from, in :func:`backward_order`. The
    backend's staged backward (kernels/staged.py) pays the per-layer work once: one prepare
    (pre-pass), its stage calls (dQ accumulated by the backend), one finish. The stage calls
    follow ``prog.backward_calls``: ``"stage"``, one per stage, each stage's returns leaving
    while later stages compute; ``"one"``, one call over every stage once every round arrived;
    ``"one+local"``, the remote stages' call first, its returns issued, then the own stage while
    they travel (:func:`_backward_merged`). ``kept``: the forward's key buffer
    (``forward_overlap(..., keep_kv=True)``): no K/V traffic and no gathers, only the gradient
    returns."""
    prepare, stage, finish = staged_functions(backend)
    keys = (_Keys.of(prog, kept) if kept is not None
            else _Keys(prog, k, _Rounds(prog, exchange, k, v, backend), backend))
    returns = _Returns(prog, exchange, k, backend)
    state = call_attention(prepare, q, out, dout, lse, dlse)

    def run(s):
        ks, vs = _stage_kv(prog, keys, s, k, v)
        return call_attention(stage, state, q, ks, vs, prog.cols(s, q.shape[0]), False, scale)

    def own_stage() -> Optional[torch.Tensor]:
        return pack_wire_rows(*run(0), None, prog.chunk_size, backend) if prog.stage_chunks[0] else None

    if prog.merged is None:
        own_wire = own_stage()
        for t in prog.backward_order:
            r = prog.rounds[t]
            keys.arrive(t)
            if r.stage_size:
                returns.stage_grads(r, *run(t + 1))
            returns.send(r)
    else:
        own_wire = _backward_merged(prog, keys, returns, stage, state, q, scale)
        if prog.backward_calls == "one+local":
            own_wire = own_stage()
    dk, dv = returns.own_grads(own_wire, backend)
    return call_attention(finish, state), dk, dv


def _backward_merged(prog, keys: _Keys, returns: _Returns, stage, state, q, scale):
    """The merged stages of ``prog.merged`` in one call once every round arrived: their K/V
    are the whole key buffer, their dK/dV split back into rows per round (views of one wire
    buffer) and returned in the merged send order (:func:`~.program.merged_send_order`).
    Returns the own stage's dK/dV wire rows where the call covered the own stage (``"one"``),
    else None."""
    m = prog.merged
    for t in prog.backward_order:
        keys.arrive(t)
    grads = own_wire = None
    if prog.n_keys:
        ks, vs = keys.all()
        dk, dv = call_attention(stage, state, q, ks, vs, prog.merged_cols(q.shape[0]), False, scale)
        grads = pack_wire_rows(dk, dv, None, prog.chunk_size, returns.backend)
        if m.own is not None:
            own_wire = grads[m.own[0]:m.own[1]]
    for t, start, stop in m.pieces:
        r = prog.rounds[t]
        if stop > start:
            returns.stage_wire(r, grads[start:stop])
        returns.send(r)
    return own_wire


def forward_allgather(prog: RankProgram, exchange, backend, q, k, v, scale):
    """Baseline forward: all-gather the wire rows, one attention call over the needed keys."""
    keys = _gathered_keys(prog, exchange, backend, k, v)
    if keys is None:
        return _finish_forward([], [], q, v)
    o, l = call_attention(backend.forward, q, keys[0], keys[1], prog.cols(0, q.shape[0]), False, scale)
    return o.to(q.dtype), l


def _gather(prog, exchange, k, v, backend=None):
    wire = pack_wire_rows(k, v, None, prog.chunk_size, backend)
    out = k.new_empty(_wire_shape(prog.n_own * exchange.world, k, prog.chunk_size))
    exchange.all_gather(out, wire)
    return out


def _gathered_keys(prog, exchange, backend, k, v, gathered=None) -> Optional[torch.Tensor]:
    """The all-gather baseline's key buffer: the needed chunks of the gathered wire rows."""
    gathered = _gather(prog, exchange, k, v, backend) if gathered is None else gathered
    if prog.key_rows is None:
        return None
    keys = _key_buffer(k, prog.n_keys, prog.chunk_size)
    gather_stage_keys(gathered, prog.key_rows, keys, 0, backend)
    return keys


def backward_allgather(prog: RankProgram, exchange, backend, dout, dlse, q, k, v, out, lse, scale):
    """Baseline backward: all-gather again, one backward call, reduce-scatter dK/dV."""
    gathered = _gather(prog, exchange, k, v, backend)
    keys = _gathered_keys(prog, exchange, backend, k, v, gathered)
    full = torch.zeros_like(gathered)
    dq = None
    if keys is not None:
        dq, dk, dv = call_attention(backend.backward, dout, dlse, q, keys[0], keys[1], out, lse,
                                    prog.cols(0, q.shape[0]), False, scale)
        full.index_copy_(0, prog.key_rows, to_wire(dk, dv, prog.chunk_size))
    mine = k.new_empty(_wire_shape(prog.n_own, k, prog.chunk_size))
    exchange.reduce_scatter(mine, full)
    dk, dv = from_wire(mine, None)
    return (torch.zeros_like(q) if dq is None else dq), dk, dv


# -- one-process emulation -----------------------------------------------------------------------------


class _Done:
    def wait(self):
        return None


class EmulatedExchange:
    """Communication replaced by device copies in one process (the one-GPU benchmark, launch
    counting): every receive buffer is filled from ``wire`` (the whole sequence's wire rows,
    ``[num_chunks, 2, B, chunk, Hk, D]``, chunk ids as rows), gradient returns too (their values
    are then K/V, not gradients: only the data movement is emulated). The copies are not counted
    by a :class:`~flashmask3.distributed.launches.LaunchCounter`; ``copy=False`` skips them."""

    #: The all-gather copies wire rows in pieces of at most this many bytes: torch's
    #: ``index_select`` of a few huge rows (dual_chunk's 8K-token chunks at cp 8: 16 rows of 32 MB)
    #: takes a slow path at about a third of the bandwidth, an artefact of the emulation.
    PIECE_BYTES = 1 << 20

    def __init__(self, wire: torch.Tensor, world: int, rank: int = 0, plan=None, copy: bool = True):
        self.wire, self.world, self.rank, self.copy = wire, world, rank, copy
        self._rank_major = None
        numel = wire[0].numel() if wire.shape[0] else 0
        pieces = max(1, numel * wire.element_size() // self.PIECE_BYTES)
        self._pieces = pieces if numel % pieces == 0 else 1
        if plan is not None:
            ids = torch.as_tensor([c for r in range(world) for c in plan.chunks(r)], dtype=torch.int64)
            n = self._pieces
            self._rank_major = (ids[:, None] * n + torch.arange(n)).flatten().to(wire.device)

    def start(self, rnd: RoundProgram, reverse: bool, send, recv):
        ids = rnd.send_chunk_ids if reverse else rnd.recv_chunk_ids
        if self.copy and recv is not None and recv.shape[0]:
            with not_counted():
                torch.index_select(self.wire, 0, ids, out=recv)
        return _Done()

    def all_gather(self, out, inp):
        if self.copy:
            with not_counted():
                n = self._pieces
                torch.index_select(self.wire.view(self.wire.shape[0] * n, -1), 0, self._rank_major,
                                   out=out.view(out.shape[0] * n, -1))

    def reduce_scatter(self, out, inp):
        if self.copy:
            with not_counted():
                n = out.shape[0]
                out.copy_(inp[self.rank * n:(self.rank + 1) * n])
