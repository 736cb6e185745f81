"""A rank's device program: what one rank of a context-parallel plan needs on its device.

:func:`prepare_rank` turns a :class:`~flashmask3.distributed.plan.CPPlan` into a
:class:`RankProgram` for one rank on one device, once per plan (cached on the plan object):
every index tensor, the local mask columns of each stage, the message layout of every round
(:class:`RoundProgram`), the key buffer's rows, the merged backward call's layout
(:class:`MergedBackward`) and the gradient returns' indexes. Everything here runs once per plan,
on the host, with host-to-device copies from pinned memory; nothing here runs per layer. The
per-layer schedule that executes a program is :mod:`flashmask3.distributed.runtime`
(docs/cp-runtime.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..kernels.static_masks import keeps_nothing, mark_static
from .plan import to_device_pinned

#: How :func:`~.runtime.backward_overlap` calls the staged backward: one call per stage as its K/V
#: arrives (``"stage"``); one call over the own and every remote stage once every round arrived
#: (``"one"``: the dK/dV returns go out after it); one call over every remote stage first, then
#: the own stage while their dK/dV returns travel (``"one+local"``). ``"auto"`` picks one per
#: plan (:func:`auto_backward_calls`). (The own stage first, then one call over the remote ones,
#: ``"local+one"``, never beat ``"one+local"``: removed in session 39, benchmarks/NOTES.md.)
BACKWARD_CALLS = ("stage", "one", "one+local")
#: ``backward_calls`` values the API takes: :data:`BACKWARD_CALLS` and ``"auto"`` (the plan's rule).
BACKWARD_CALL_MODES = BACKWARD_CALLS + ("auto",)

#: ``"auto"`` calls the remote keys first (``"one+local"``) on flat plans of at most this many
#: ranks and one call per stage beyond (see :func:`auto_backward_calls`).
AUTO_FLAT_MAX_CP = 16


def auto_backward_calls(plan) -> str:
    """The backward calls ``"auto"`` picks for ``plan`` (a :class:`~.plan.CPPlan` or anything
    with its ``nodes`` and ``cp_size``, e.g. the scale model's plan view); the same on every
    rank, so every rank issues its gradient returns in the same order.

    ``"one"`` for hierarchical plans (``nodes > 1``); ``"one+local"`` for flat plans of at most
    :data:`AUTO_FLAT_MAX_CP` ranks (the remote keys' dK/dV travel while the own keys compute);
    ``"stage"`` for larger flat plans, whose many cross-node returns take longer than the own
    keys' call hides: leaving stage by stage spreads them over the whole backward. The scale
    model's numbers behind the rule are in docs/cp-runtime.md ("Backward calls")."""
    if plan.nodes > 1:
        return "one"
    return "one+local" if plan.cp_size <= AUTO_FLAT_MAX_CP else "stage"


def resolve_backward_calls(backward_calls: str, plan, name: str = "backward_calls") -> str:
    """``backward_calls`` checked (ValueError naming it as ``name``: the caller's argument)
    with ``"auto"`` resolved for ``plan``."""
    if backward_calls == "auto":
        return auto_backward_calls(plan)
    if backward_calls not in BACKWARD_CALLS:
        raise ValueError(f"{name} must be one of {BACKWARD_CALL_MODES}, got {backward_calls!r}")
    return backward_calls


def round_source(rounds, t: int) -> Optional[int]:
    """The round whose chunks relay round ``t`` forwards (``None`` for a direct round).

    Plans that predate ``Round.source`` relay from the previous round."""
    r = rounds[t]
    return getattr(r, "source", t - 1 if r.relay else None)


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a round: rows ``[start, stop)`` of a wire buffer."""

    peer: int
    start: int
    stop: int
    chunks: tuple[int, ...]


@dataclass
class RoundProgram:
    """One round as seen by one rank.

    ``sends``/``recvs``: its messages (rows of the payload / of the receive buffer).
    ``send_rows``: rows the payload is gathered from (own wire rows for a direct round, rows
    of the source round's receive buffer for a relay round). ``stage_rows``: receive rows this
    rank attends to, in stage order. ``grad_rows``: for the fast gradient path, the stage
    position of every receive row. ``children``: relay rounds forwarding this round's chunks.
    """

    index: int
    relay: bool
    source: Optional[int]
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    send_rows: Optional[torch.Tensor]
    stage_rows: Optional[torch.Tensor]
    stage_size: int
    grad_rows: Optional[torch.Tensor]
    children: tuple[int, ...]
    send_chunk_ids: torch.Tensor
    recv_chunk_ids: torch.Tensor
    direct_offset: int = 0  # rows before this round's in the direct gradient-return buffer
    recv_offset: int = 0  # rows before this round's in the pass's one receive buffer
    #: a direct round's outgoing rows (every message, in message order) as ``(packed, start,
    #: stop)``: a slice of the own wire rows (``packed`` False: the rows are one run of own
    #: chunks) or of the pass's packed payload (``RankProgram.pack_rows``); None: nothing sent
    send_slice: Optional[tuple[bool, int, int]] = None
    #: a relay round's rows in its source round's buffer of returned gradients (the source's
    #: children, in ``children`` order, back to back)
    child_offset: int = 0
    #: where the gradient return is summed (not :attr:`fast_grad`): ``(stage index, children
    #: index)``, which stage rows and which rows of the children's returned gradients add into
    #: each receive row, as kernels/returns.py's indexes (``None`` for an absent source)
    sum_index: Optional[tuple] = None
    #: what an exchange derives from the round once and keeps (e.g. comm.DistExchange's
    #: per-peer row counts)
    exchange_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_send(self) -> int:
        return self.sends[-1].stop if self.sends else 0

    @property
    def n_recv(self) -> int:
        return self.recvs[-1].stop if self.recvs else 0

    @property
    def fast_grad(self) -> bool:
        """Gradients go back straight from the stage's dK/dV: every received chunk is attended
        to and none is relayed on."""
        return not self.children and self.stage_size == self.n_recv


@dataclass
class MergedBackward:
    """One backward call over several stages (``"one"``: every stage, ``"one+local"``: the
    remote ones), precomputed once per plan. Its keys are the pass's whole
    key buffer (which holds exactly the merged stages, ``RankProgram.key_first`` on).

    ``cols``: their mask columns (the arrival-order local mask from the first merged stage's
    keys on, since a stage's columns are per key and its rows are the rank's queries); ``own``:
    the own stage's rows in the call's dK/dV (``None``: not merged or empty); ``pieces``:
    ``(round, start, stop)`` of every round in the order its return is issued
    (:func:`merged_send_order`): its stage's dK/dV rows in the call's output (empty for a round
    without a stage)."""

    first_stage: int
    cols: Optional[torch.Tensor]
    own: Optional[tuple[int, int]]
    pieces: tuple[tuple[int, int, int], ...]


@dataclass
class RankProgram:
    """Everything one rank needs on its device to run one layer (see the module doc)."""

    rank: int
    device: torch.device
    comm: str
    chunk_size: int
    n_own: int
    own_chunks: tuple[int, ...]
    stage_chunks: list[tuple[int, ...]]
    stage_cols: list[Optional[torch.Tensor]]
    own_rows: Optional[torch.Tensor]  # None: the own stage is every own chunk, in order
    rounds: list[RoundProgram]
    backward_order: list[int]
    direct_send_rows: Optional[torch.Tensor]  # own rows of every direct round's messages, in round order
    n_direct_send: int
    #: the stages held in the pass's key buffer: ``key_first`` on (0: the own stage too, for
    #: ``"one"`` and allgather; 1: the remote ones), their chunks' rows in the pass's K/V store
    #: (the own wire rows first when ``key_first`` is 0, then every round's receive rows; for
    #: allgather the gathered wire rows) in stage order, and each held stage's first chunk
    key_first: int = 1
    key_rows: Optional[torch.Tensor] = None
    key_starts: tuple[int, ...] = (0,)
    #: each held stage's slice of ``key_rows`` (views made once, not per layer)
    stage_key_rows: tuple = ()
    #: own chunks packed for the direct rounds whose rows are not one run of own chunks, each
    #: round's rows back to back (:attr:`RoundProgram.send_slice`)
    pack_rows: Optional[torch.Tensor] = None
    #: some direct round sends a slice of the own wire rows (else only the packed rows are built)
    sends_own_rows: bool = False
    backward_calls: str = "stage"  # BACKWARD_CALLS, resolved ("auto" never)
    merged: Optional[MergedBackward] = None  # backward_calls other than "stage"
    n_recv: int = 0  # rows of one pass's receive buffer (every round's, in round order)
    #: (own stage rows, direct returns) -> own chunk, as kernels/returns.py's indexes (overlap)
    returns_index: Optional[tuple] = None
    _host: list = field(default_factory=list, repr=False)  # pinned sources of in-flight copies
    _batched_cols: dict = field(default_factory=dict, repr=False)

    @property
    def n_keys(self) -> int:
        """Chunks in the pass's key buffer."""
        return self.key_starts[-1]

    def key_slice(self, stage: int) -> tuple[int, int]:
        """Chunks ``[start, stop)`` of held stage ``stage`` in the key buffer."""
        i = stage - self.key_first
        return self.key_starts[i], self.key_starts[i + 1]

    def cols(self, stage: int, batch: int) -> Optional[torch.Tensor]:
        """Stage ``stage``'s local mask columns for a batch of ``batch`` rows."""
        return self._batched(stage, self.stage_cols[stage], batch)

    def merged_cols(self, batch: int) -> Optional[torch.Tensor]:
        """The merged backward call's mask columns for a batch of ``batch`` rows."""
        return self._batched("merged", self.merged.cols, batch)

    def _batched(self, key, cols: Optional[torch.Tensor], batch: int) -> Optional[torch.Tensor]:
        if cols is None or cols.shape[0] == batch:
            return cols
        key = (key, batch)
        got = self._batched_cols.get(key)
        if got is None:  # first layer of a new batch size only
            got = cols.expand(batch, -1, -1, -1).contiguous()
            if keeps_nothing(got):
                return got  # made in a CUDA graph capture (only replays fill it) or a graph tree's warm-up
            self._batched_cols[key] = mark_static(got)
        return got


# -- building a program -----------------------------------------------------------------------------


def _index(values, device, keep) -> torch.Tensor:
    return to_device_pinned(torch.as_tensor(np.asarray(values, dtype=np.int64)), device, keep)


def _messages(transfers, peer_of) -> tuple[Message, ...]:
    out, row = [], 0
    for tr in transfers:
        out.append(Message(peer_of(tr), row, row + len(tr.chunks), tr.chunks))  # a tuple of ints (Round)
        row += len(tr.chunks)
    return tuple(out)


def _rows_of(messages) -> dict[int, int]:
    """Chunk id -> its first row in a buffer laid out by ``messages``."""
    rows: dict[int, int] = {}
    for m in messages:
        for i, c in enumerate(m.chunks):
            rows.setdefault(c, m.start + i)
    return rows


def backward_order(rounds) -> list[int]:
    """The order in which the backward computes the remote stages.

    A round that feeds relays comes with its family: the relays first (their gradients must
    come back before the source's can be returned), then the source; families first (their
    return path is the longest: it crosses nodes), then the other direct rounds ascending.
    For a flat plan this is arrival order."""
    children = {t: [u for u in range(len(rounds)) if round_source(rounds, u) == t] for t in range(len(rounds))}

    def family(t):
        out = []
        for c in sorted(children[t], reverse=True):
            out += family(c)
        return out + [t]

    direct = [t for t in range(len(rounds)) if round_source(rounds, t) is None]
    order = []
    for t in direct:
        if children[t]:
            order += family(t)
    return order + [t for t in direct if not children[t]]


def merged_send_order(rounds, order: list[int]) -> list[int]:
    """The order a merged backward call's gradient returns are issued in: ``order`` (the
    backward order) with every round that sums relays' returns (``children``) moved behind the
    others. Summing waits for the children's returns on the compute stream, so a return issued
    after it would wait too; the rounds with children keep their relative order, in which every
    child comes before its source. A property of the plan's rounds, the same on every rank."""
    return [t for t in order if not rounds[t].children] + [t for t in order if rounds[t].children]


def _send_slice(send_rows: list[int], pack: list[int]) -> tuple[bool, int, int]:
    """A direct round's :attr:`RoundProgram.send_slice`: its own rows ``send_rows`` (message
    order) as a slice of the own wire rows where they are one run, else appended to ``pack`` as
    one slice of the packed payload. Either way an exchange sends a view: a collective needs the
    round's rows in one buffer, and packing them here copies each row once per pass."""
    a, n = send_rows[0], len(send_rows)
    if send_rows == list(range(a, a + n)):
        return (False, a, a + n)
    pack += send_rows
    return (True, len(pack) - n, len(pack))


def _build_rounds(plan, rank, device, keep, own_pos, pack: list[int],
                  host_sends: dict[int, list[int]]) -> list[RoundProgram]:
    """Every round of ``plan`` as ``rank`` sees it; the own rows that direct rounds must pack
    are appended to ``pack`` (:func:`_send_slice`), each round's ``send_rows`` as a host list
    put in ``host_sends`` (the indexes built from them are computed on the host)."""
    rounds = plan.rounds
    stages = plan.stages(rank)
    out: list[RoundProgram] = []
    recv_rows: list[dict[int, int]] = []
    stage_lists: list[list[int]] = []  # each round's stage rows, on the host
    direct_offset = recv_offset = 0
    for t, rnd in enumerate(rounds):
        src = round_source(rounds, t)
        sends = _messages(rnd.sends(rank), lambda tr: tr.dst)
        recvs = _messages(rnd.recvs(rank), lambda tr: tr.src)
        rows = _rows_of(recvs)
        recv_rows.append(rows)
        base = own_pos if src is None else recv_rows[src]
        send_rows = host_sends[t] = [base[c] for m in sends for c in m.chunks]
        stage = stages[t + 1]
        stage_rows = [rows[c] for c in stage]
        stage_lists.append(stage_rows)
        n_recv = recvs[-1].stop if recvs else 0
        grad_rows = None
        identity = stage_rows == list(range(n_recv))
        if len(stage) == n_recv and n_recv and not identity:
            pos = {r: i for i, r in enumerate(stage_rows)}
            grad_rows = _index([pos[r] for r in range(n_recv)], device, keep)
        out.append(RoundProgram(
            index=t, relay=src is not None, source=src, sends=sends, recvs=recvs,
            send_rows=_index(send_rows, device, keep) if send_rows else None,
            stage_rows=_index(stage_rows, device, keep) if stage_rows else None,
            stage_size=len(stage), grad_rows=grad_rows, children=(),
            send_chunk_ids=_index([c for m in sends for c in m.chunks], device, keep),
            recv_chunk_ids=_index([c for m in recvs for c in m.chunks], device, keep),
            direct_offset=direct_offset, recv_offset=recv_offset,
            send_slice=_send_slice(send_rows, pack) if src is None and send_rows else None))
        recv_offset += n_recv
        if src is None:
            direct_offset += len(send_rows)
    for r in out:
        r.children = tuple(u.index for u in out if u.source == r.index)
        offset = 0
        for c in r.children:
            out[c].child_offset = offset
            offset += out[c].n_send
        if not r.fast_grad and r.n_recv:
            sent_back = [row for c in r.children for row in host_sends[c]]
            r.sum_index = (_returns_index_on(device, keep, stage_lists[r.index], r.n_recv) if r.stage_size else None,
                           _returns_index_on(device, keep, sent_back, r.n_recv) if sent_back else None)
    return out


def _static_columns(cols: torch.Tensor, device, keep) -> torch.Tensor:
    """A contiguous copy of ``cols`` on ``device``, marked static (the program never writes
    its columns: their plans are kept with them and reused inside a CUDA graph capture)."""
    return mark_static(to_device_pinned(cols.clone(memory_format=torch.contiguous_format), device, keep))


def _stage_columns(cols: torch.Tensor, stage_chunks, chunk_size, device, keep):
    """Each stage's slice of the local key axis, contiguous, on ``device``."""
    out, start = [], 0
    for chunks in stage_chunks:
        stop = start + len(chunks) * chunk_size
        out.append(_static_columns(cols[:, :, start:stop], device, keep) if chunks else None)
        start = stop
    return out


def _normal_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def prepare_rank(plan, rank: int, device, comm: str = "overlap", backward_calls: str = "auto") -> RankProgram:
    """The :class:`RankProgram` of ``rank`` on ``device`` for ``comm`` ("overlap" or
    "allgather") and ``backward_calls`` (:data:`BACKWARD_CALLS` or ``"auto"``; the overlapped
    backward only), built once and cached on ``plan``.

    Host-to-device copies come from pinned memory without blocking, so a data-loader thread can
    prepare the next batch's programs while the current one trains."""
    from .attention import COMMS

    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    calls = resolve_backward_calls(backward_calls, plan)
    device = _normal_device(device)
    cache = plan.__dict__.setdefault("_rank_programs", {})
    key = (int(rank), str(device), comm, calls)
    if key not in cache:
        cache[key] = _build_program(plan, int(rank), device, comm, calls)
    return cache[key]


def _key_rows(stages, rounds, own_pos, first: int) -> tuple[list[int], tuple[int, ...]]:
    """The key buffer of a pass that holds stages ``first`` on: their chunks' rows in the K/V
    store (the own wire rows first when ``first`` is 0, then every round's receive rows, in
    round order) in stage order, and each held stage's first chunk (``RankProgram.key_rows`` /
    ``key_starts``)."""
    lead = len(own_pos) if first == 0 else 0
    rows: list[int] = []
    starts = [0]
    for s in range(first, len(stages)):
        if s == 0:
            rows += [own_pos[c] for c in stages[0]]
        else:
            r = rounds[s - 1]  # stage s is round s - 1's
            recv_row = _rows_of(r.recvs)
            rows += [lead + r.recv_offset + recv_row[c] for c in stages[s]]
        starts.append(len(rows))
    return rows, tuple(starts)


def _key_index(rows: list[int], starts: tuple[int, ...], device, keep) -> dict:
    """``key_rows`` on the device, ``key_starts`` and each held stage's slice of the rows (empty
    stages: ``None``), as :class:`RankProgram` fields."""
    index = _index(rows, device, keep) if rows else None
    per_stage = tuple(index[a:b] if b > a else None for a, b in zip(starts, starts[1:]))
    return dict(key_rows=index, key_starts=starts, stage_key_rows=per_stage)


def _merged_backward(calls, stages, rounds, order, key_starts, cols, cs, device, keep) -> MergedBackward:
    """The :class:`MergedBackward` of ``calls`` (not "stage") over the held stages
    (``key_starts``, :func:`_key_rows`); ``cols``: the arrival-order local mask columns."""
    first = 0 if calls == "one" else 1
    own = (0, len(stages[0])) if first == 0 and stages[0] else None
    start = {r.index: key_starts[r.index + 1 - first] for r in rounds}  # stage r + 1's chunks
    pieces = tuple((t, start[t], start[t] + rounds[t].stage_size) for t in merged_send_order(rounds, order))
    key_start = sum(len(x) for x in stages[:first]) * cs
    merged_cols = None
    if key_starts[-1]:
        merged_cols = _static_columns(cols[:, :, key_start:], device, keep)
        if merged_cols.shape[2] != key_starts[-1] * cs:
            raise ValueError(f"the local mask has {cols.shape[2]} keys but the stages hold "
                             f"{key_start + key_starts[-1] * cs}")
    return MergedBackward(first, merged_cols, own, pieces)


def _local_columns(plan, rank: int, order: str, device) -> torch.Tensor:
    """The rank's local mask columns (``plan.local_mask``); for a program on the ``meta``
    device their shape only: such a program (shape tracing, the scale model's recording of the
    runtime) reads no values, and at 512K tokens building the columns is about half of
    building a program."""
    if device.type == "meta":
        return torch.empty(plan.local_columns_shape(rank, order), dtype=torch.int32, device=device)
    return plan.local_mask(rank, order).startend_row_indices


def _build_program(plan, rank, device, comm, calls="stage") -> RankProgram:
    keep: list = []
    own = plan.chunks(rank)
    own_pos = {c: i for i, c in enumerate(own)}
    cs = plan.chunk_size
    stages = [tuple(s) for s in plan.stages(rank)]
    own_stage = stages[0]
    own_rows = None if list(own_stage) == list(own) else _index([own_pos[c] for c in own_stage], device, keep)
    common = dict(rank=rank, device=device, comm=comm, chunk_size=cs, n_own=len(own), own_chunks=own,
                  backward_calls=calls)
    if comm == "allgather":
        needed = sorted(c for s in stages for c in s)
        row_of = {}
        for r in range(plan.cp_size):
            for i, c in enumerate(plan.chunks(r)):
                row_of[c] = r * len(own) + i
        cols = _local_columns(plan, rank, "sorted", device)
        return RankProgram(**common, stage_chunks=[tuple(needed)],
                           stage_cols=_stage_columns(cols, [needed], cs, device, keep),
                           own_rows=None, rounds=[], backward_order=[], direct_send_rows=None,
                           n_direct_send=0, key_first=0,
                           **_key_index([row_of[c] for c in needed], (0, len(needed)), device, keep),
                           _host=keep)
    pack: list[int] = []
    host_sends: dict[int, list[int]] = {}
    rounds = _build_rounds(plan, rank, device, keep, own_pos, pack, host_sends)
    direct = [r for r in rounds if r.source is None and r.send_rows is not None]
    direct_host = [row for r in direct for row in host_sends[r.index]]
    direct_rows = _index(direct_host, device, keep) if direct else None
    cols = _local_columns(plan, rank, "arrival", device)
    order = backward_order(plan.rounds)
    first = 0 if calls == "one" else 1
    key_rows, key_starts = _key_rows(stages, rounds, own_pos, first)
    merged = None
    if calls != "stage":
        merged = _merged_backward(calls, stages, rounds, order, key_starts, cols, cs, device, keep)
    return RankProgram(**common, stage_chunks=stages,
                       stage_cols=_stage_columns(cols, stages, cs, device, keep), own_rows=own_rows,
                       rounds=rounds, backward_order=order,
                       direct_send_rows=direct_rows, n_direct_send=sum(r.n_send for r in direct),
                       key_first=first, **_key_index(key_rows, key_starts, device, keep),
                       pack_rows=_index(pack, device, keep) if pack else None,
                       sends_own_rows=any(r.send_slice and not r.send_slice[0] for r in rounds),
                       merged=merged, n_recv=sum(r.n_recv for r in rounds),
                       returns_index=_own_returns_index([own_pos[c] for c in own_stage], direct_host,
                                                        len(own), device, keep),
                       _host=keep)


def returns_index(targets, n_own: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, rows)`` of a source whose row ``j`` adds into own chunk ``targets[j]``: the
    rows adding into chunk ``c`` are ``rows[starts[c]:starts[c + 1]]``, in increasing order.

    Computed on the host (numpy) when a program is built: int32 tensors on ``targets``' device
    for a tensor (read to the host: build time only, never per layer), on the CPU for a
    sequence of ints or an array."""
    device = torch.device("cpu")
    if isinstance(targets, torch.Tensor):
        device = targets.device
        targets = targets.detach().cpu().numpy()
    t = np.asarray(targets, dtype=np.int64).reshape(-1)
    if t.size and (t.min() < 0 or t.max() >= n_own):
        raise ValueError(f"targets must lie in [0, {n_own}), got values from {t.min()} to {t.max()}")
    rows = np.argsort(t, kind="stable")
    starts = np.zeros(n_own + 1, dtype=np.int64)
    np.cumsum(np.bincount(t, minlength=n_own), out=starts[1:])
    return (torch.from_numpy(starts.astype(np.int32)).to(device),
            torch.from_numpy(rows.astype(np.int32)).to(device))


def _returns_index_on(device, keep, targets, n_own: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`returns_index` of host ``targets``, moved to ``device`` (from pinned memory)."""
    return tuple(to_device_pinned(x, device, keep) for x in returns_index(targets, n_own))


def _own_returns_index(own_rows: list[int], direct_rows: list[int], n_own: int, device, keep) -> Optional[tuple]:
    """Which own chunk each own-stage row and each directly returned row adds into, as the
    indexes of kernels/returns.py (host lists in, built once per program)."""
    if n_own == 0:
        return None
    return (_returns_index_on(device, keep, own_rows, n_own) if own_rows else None,
            _returns_index_on(device, keep, direct_rows, n_own) if direct_rows else None)
