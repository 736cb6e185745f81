"""Event timeline of one context-parallel attention layer on every rank.

A discrete-event simulation: per rank a compute stream running the attention stages in order,
per GPU four link ports (NVLink out/in, InfiniBand NIC out/in), messages between them, and the
overlap rules of the runtime (docs/cp-runtime.md):

``comm="overlap"``, forward
    stage 0 (the rank's own needed chunks) starts at once; every direct round is posted at the
    start of the layer; stage ``s+1`` waits until all of the rank's receives of round ``s``
    have arrived; a relay round is posted by a rank when its receives of the relay's source
    round have arrived. A message flows once both ends have posted its round.
``comm="overlap"``, backward
    K/V fetched again by the same rounds, stage by stage; after the stage that consumed round
    ``j`` (stage ``j+1``) the rank posts round ``j``'s gradient return (the gradients of the
    chunks it received in ``j`` go back to their senders; it posts receives for the chunks it
    sent in ``j``); a round that relays have forwarded from (the cross-node round) is returned
    only after the relay's own gradient receives of the relay round arrived (relays sum, then
    forward). The rank is done when its stages are done and every gradient it waits for arrived.
    Merged backward calls (``bwd_calls``): ``"one"`` one call once every round arrived, every
    return after it; ``"one+local"`` the remote stages' call first, every return posted after
    it, then the own stage (after the relay rounds' gradients arrived: the runtime's relay sums
    wait on the compute stream).
``comm="allgather"``
    forward: all-gather of K/V (exposed), then one call over the needed keys; backward:
    all-gather (exposed), one backward call, reduce-scatter of dK/dV (exposed).

Links: a message occupies its sender's out-port and its receiver's in-port (NVLink inside a
node, the GPU's NIC across nodes) for ``overhead + bytes / (bandwidth x efficiency)`` each, in
the order messages reach the port (FIFO per port, ports served independently), and arrives a
per-message latency after both ports have served it; contention = queueing on a port. While
a rank has a message in flight, its compute runs at ``1 - comm_sm_share`` speed (NCCL kernels
hold SMs). Ring collectives: ``(P-1)`` steps of latency plus the larger of the NVLink term
(every rank receives ``(P-1)`` shards) and the InfiniBand term (every node ingests the
``P-G`` other nodes' shards through its ``G`` NICs).

The layer starts on every rank at time 0 (the previous layer's collectives -- expert
all-to-all, all-gather, or the K/V exchange itself -- synchronise the ranks), so a layer's time
is its slowest rank's finish.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from flashmask3.distributed.program import BACKWARD_CALL_MODES, BACKWARD_CALLS, resolve_backward_calls

from .calibrate import AttentionCost, ProgramWork, TileCounts
from .layout import PlanView
from .params import Cluster
from .runtime_ops import MERGED

COMMS = ("allgather", "overlap")


@dataclass(frozen=True)
class AttnShape:
    """Per-rank attention dims: query/KV heads, head dim, bytes per element."""

    heads: int
    kv_heads: int
    head_dim: int = 128
    elem_bytes: int = 2

    def kv_bytes(self, tokens: int) -> int:
        """K and V of ``tokens`` tokens (also dK and dV, returned in the same dtype)."""
        return 2 * tokens * self.kv_heads * self.head_dim * self.elem_bytes


@dataclass
class RankTimes:
    end: float = 0.0          # when the rank finished this pass
    compute: float = 0.0      # compute time at full speed (attention kernels + merges)
    exposed_comm: float = 0.0  # time its compute stream was idle waiting for data
    host_floor: float = 0.0


@dataclass
class PassResult:
    ranks: list[RankTimes]
    messages: int = 0
    bytes: int = 0
    cross_node_bytes: int = 0

    @property
    def time(self) -> float:
        return max(r.end for r in self.ranks)

    @property
    def slowest(self) -> int:
        return max(range(len(self.ranks)), key=lambda i: self.ranks[i].end)


class Links:
    """Per-GPU ports with FIFO queues; node of rank r = r // gpus_per_node."""

    def __init__(self, cluster: Cluster, gpus_per_node: Optional[int] = None):
        self.cluster = cluster
        self.g = gpus_per_node or cluster.gpus_per_node
        self.free: dict[tuple, float] = {}

    def same_node(self, a: int, b: int) -> bool:
        return a // self.g == b // self.g

    def transfer(self, t: float, src: int, dst: int, nbytes: int) -> float:
        """Issue a message at ``t``; return its arrival time."""
        same = self.same_node(src, dst)
        fab = "nvl" if same else "ib"
        occ = self.cluster.msg_overhead.value + nbytes / self.cluster.p2p_bw(same)
        ends = []
        for port in ((fab, "out", src), (fab, "in", dst)):
            start = max(t, self.free.get(port, 0.0))
            self.free[port] = start + occ
            ends.append(start + occ)
        return max(ends) + self.cluster.latency(same)


def ring_collective_time(cluster: Cluster, p: int, nbytes_per_rank: int,
                         gpus_per_node: Optional[int] = None) -> float:
    """All-gather or reduce-scatter of ``nbytes_per_rank`` per rank over ``p`` ranks (ring)."""
    if p <= 1:
        return 0.0
    g = min(p, gpus_per_node or cluster.gpus_per_node)
    nodes = math.ceil(p / g)
    intra = (p - 1) * nbytes_per_rank / cluster.p2p_bw(True)
    cross = (p - g) * nbytes_per_rank / (g * cluster.p2p_bw(False)) if nodes > 1 else 0.0
    return (p - 1) * cluster.latency(nodes == 1) + max(intra, cross)


# -- the discrete-event engine ----------------------------------------------------------------------


class _Engine:
    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


@dataclass
class _Task:
    work: float                    # seconds at full speed
    deps: tuple = ()               # keys that must be signalled on this rank first
    done_key: Optional[tuple] = None


@dataclass
class _Rank:
    tasks: list
    idx: int = 0
    running: bool = False
    remaining: float = 0.0
    last: float = 0.0
    version: int = 0
    active: int = 0               # messages in flight touching this rank
    signals: set = field(default_factory=set)
    waiting: list = field(default_factory=list)   # (keys, callback) posts waiting on signals
    idle_wait: float = 0.0
    ready_since: float = 0.0
    end: float = 0.0


class _PassSim:
    """One pass (forward or backward) of the overlapped exchange on all ranks."""

    def __init__(self, view: PlanView, cluster: Cluster, shape: AttnShape, links: Links,
                 tasks: list[list[_Task]], grads: bool):
        self.v, self.c, self.shape, self.links = view, cluster, shape, links
        self.e = _Engine()
        self.share = cluster.comm_sm_share.value
        self.ranks = [_Rank(t) for t in tasks]
        self.grads = grads
        self.posted: dict[tuple, set] = {}
        self.pending: dict[tuple, int] = {}   # (rank, kind, round) -> receives not arrived yet
        self.messages = self.bytes = self.xbytes = 0
        self.by_rank: dict[tuple, list] = {}
        for j, rnd in enumerate(view.rounds):
            for (src, dst, n) in rnd.transfers:
                self.by_rank.setdefault(("kv", j, src), []).append((src, dst, n))
                self.by_rank.setdefault(("kv", j, dst), []).append((src, dst, n))
                if grads:
                    self.by_rank.setdefault(("grad", j, dst), []).append((dst, src, n))
                    self.by_rank.setdefault(("grad", j, src), []).append((dst, src, n))
        for r in range(view.cp_size):
            for j in range(len(view.rounds)):
                for kind in ("kv", "grad") if grads else ("kv",):
                    self.pending[(r, kind, j)] = sum(
                        1 for (s, d, _) in self.by_rank.get((kind, j, r), []) if d == r)

    # -- compute stream ------------------------------------------------------------------------
    def _rate(self, r: _Rank) -> float:
        return 1.0 - self.share if r.active > 0 else 1.0

    def _try_start(self, i: int) -> None:
        r = self.ranks[i]
        if r.running or r.idx >= len(r.tasks):
            return
        task = r.tasks[r.idx]
        if not all(k in r.signals for k in task.deps):
            return
        r.idle_wait += self.e.now - r.ready_since
        r.running, r.remaining, r.last = True, task.work, self.e.now
        self._schedule_end(i)

    def _schedule_end(self, i: int) -> None:
        r = self.ranks[i]
        r.version += 1
        self.e.at(self.e.now + r.remaining / self._rate(r), self._task_end, i, r.version)

    def _task_end(self, i: int, version: int) -> None:
        r = self.ranks[i]
        if version != r.version or not r.running:
            return
        task = r.tasks[r.idx]
        r.running, r.idx = False, r.idx + 1
        r.ready_since = r.end = self.e.now
        if task.done_key is not None:
            self.signal(i, task.done_key)
        self._try_start(i)

    def _set_active(self, i: int, delta: int) -> None:
        r = self.ranks[i]
        before = self._rate(r)
        if r.running:
            r.remaining -= (self.e.now - r.last) * before
            r.last = self.e.now
        r.active += delta
        if r.running and self._rate(r) != before:
            self._schedule_end(i)

    # -- signals and posts ---------------------------------------------------------------------
    def signal(self, i: int, key: tuple) -> None:
        r = self.ranks[i]
        if key in r.signals:
            return
        r.signals.add(key)
        still = []
        for keys, fn in r.waiting:
            if all(k in r.signals for k in keys):
                fn()
            else:
                still.append((keys, fn))
        r.waiting = still
        self._try_start(i)

    def when(self, i: int, keys: tuple, fn: Callable) -> None:
        r = self.ranks[i]
        if all(k in r.signals for k in keys):
            fn()
        else:
            r.waiting.append((keys, fn))

    def post(self, i: int, kind: str, j: int) -> None:
        key = (kind, j)
        seen = self.posted.setdefault(key, set())
        if i in seen:
            return
        seen.add(i)
        for (src, dst, n) in self.by_rank.get((kind, j, i), []):
            other = dst if src == i else src
            if other in seen:
                self._inject(src, dst, n, kind, j)
        if self.pending[(i, kind, j)] == 0:
            self.signal(i, ("recv", kind, j))

    def _inject(self, src: int, dst: int, n: int, kind: str, j: int) -> None:
        nbytes = self.shape.kv_bytes(n * self.v.chunk_size)
        arrive = self.links.transfer(self.e.now, src, dst, nbytes)
        self.messages += 1
        self.bytes += nbytes
        if not self.links.same_node(src, dst):
            self.xbytes += nbytes
        self._set_active(src, +1)
        self._set_active(dst, +1)
        self.e.at(arrive, self._arrive, src, dst, kind, j)

    def _arrive(self, src: int, dst: int, kind: str, j: int) -> None:
        self._set_active(src, -1)
        self._set_active(dst, -1)
        self.ranks[src].end = max(self.ranks[src].end, self.e.now)
        self.ranks[dst].end = max(self.ranks[dst].end, self.e.now)
        self.pending[(dst, kind, j)] -= 1
        if self.pending[(dst, kind, j)] == 0:
            self.signal(dst, ("recv", kind, j))

    def run(self) -> list[RankTimes]:
        self.e.run()
        out = []
        for r in self.ranks:
            if r.idx < len(r.tasks):
                raise RuntimeError("the timeline deadlocked: a stage never got its data")
            work = sum(t.work for t in r.tasks)
            out.append(RankTimes(end=r.end, compute=work, exposed_comm=max(0.0, r.end - work)))
        return out


# -- building one layer's passes -----------------------------------------------------------------


def _merge_seconds(cluster: Cluster, shape: AttnShape, rows: int) -> float:
    """LSE merge of one stage's partial output into the running one (fp32, ~6 passes)."""
    return 6 * 4 * rows * shape.heads * shape.head_dim / cluster.hbm_bw.value


def _grad_accum_seconds(cluster: Cluster, shape: AttnShape, rows: int, keys: int) -> float:
    """dQ accumulate (fp32) and the stage's dK/dV into per-chunk fp32 buffers (~3 passes)."""
    return 3 * 4 * (rows * shape.heads * shape.head_dim + 2 * keys * shape.kv_heads * shape.head_dim) \
        / cluster.hbm_bw.value


def _backward_call_seconds(cost: AttentionCost, cluster: Cluster, shape: AttnShape, tiles: TileCounts,
                           gpu_scale: float, first: bool, device_terms: bool = True) -> float:
    """One overlapped ``backward_stage`` call over ``tiles`` and (``device_terms``) its dK/dV
    accumulation; the ``first`` call of the layer also pays ``backward_prepare``'s
    per-query-block pre-pass."""
    work = cost.backward_stage(tiles, shape.heads, shape.kv_heads) * gpu_scale
    if device_terms:
        work += _grad_accum_seconds(cluster, shape, tiles.q_rows, tiles.keys)
    if first:
        work += cost.backward_query_blocks(tiles, shape.heads) * gpu_scale
    return work


def _stage_tasks(view: PlanView, r: int, cost: AttentionCost, cluster: Cluster, shape: AttnShape,
                 gpu_scale: float, backward: bool, device_terms: bool = True) -> list[_Task]:
    tasks = []
    have = False
    for s, tiles in enumerate(view.stages[r]):
        deps = () if s == 0 else (("recv", "kv", s - 1),)
        work = 0.0
        if tiles.live:
            if backward:
                work = _backward_call_seconds(cost, cluster, shape, tiles, gpu_scale, not have, device_terms)
            else:
                work = cost.forward(tiles, shape.heads, shape.kv_heads) * gpu_scale
                if have and device_terms:
                    work += _merge_seconds(cluster, shape, tiles.q_rows)
            have = True
        tasks.append(_Task(work, deps, ("stage", s)))
    return tasks


#: How the overlapped backward calls the kernel (``Runtime.bwd_calls``): the runtime's
#: ``backward_calls`` values, ``"auto"`` resolved per plan by the runtime's own rule.
BWD_CALLS = BACKWARD_CALL_MODES


def resolve_bwd_calls(view: PlanView, bwd_calls: str) -> str:
    """``bwd_calls`` checked, ``"auto"`` resolved for ``view``: the runtime's own function
    (flashmask3.distributed.program.resolve_backward_calls: one implementation for both)."""
    return resolve_backward_calls(bwd_calls, view, name="bwd_calls")


def backward_calls_of(stages: list, bwd_calls: str) -> list[tuple[object, list]]:
    """The overlapped backward's attention calls of one rank in call order, ``(label, stages)``:
    the stages' tiles each call covers, labelled with the stage's index for a call on one stage
    and ``runtime_ops.MERGED`` (the recorded op's stage) for a call over several (``bwd_calls`` resolved: not ``"auto"``). The one
    place the modes' calls are spelled out for the host count, the underfill and validation."""
    if bwd_calls == "stage":
        return [(i, [t]) for i, t in enumerate(stages)]
    if bwd_calls == "one":
        return [(MERGED, list(stages))]
    if bwd_calls == "one+local":
        return [(MERGED, list(stages[1:])), (0, [stages[0]])]
    raise ValueError(f"bwd_calls must be one of {BACKWARD_CALLS}, got {bwd_calls!r}")


def merge_calls(tiles: list[TileCounts]) -> Optional[TileCounts]:
    """One call over the keys of several calls of the same query rows (disjoint key sets): the
    tiles add, the backward's key-block programs follow one another in the calls' order, the
    forward's query-block programs add up. None when no call has live tiles."""
    live = [t for t in tiles if t.live]
    if not live:
        return None
    works = [t.work for t in live]
    work = None
    if all(w is not None for w in works):
        work = ProgramWork(sum(w.fwd_full for w in works), sum(w.fwd_partial for w in works),
                           np.concatenate([w.bwd_full for w in works]),
                           np.concatenate([w.bwd_partial for w in works]))
    return TileCounts(sum(t.full for t in live), sum(t.partial for t in live), live[0].q_rows,
                      sum(t.keys for t in live), live[0].batch, work=work)


def _one_call_tasks(view: PlanView, r: int, cost: AttentionCost, cluster: Cluster,
                    shape: AttnShape, gpu_scale: float, device_terms: bool = True) -> list[_Task]:
    """``"one"``: the backward as one call over the rank's needed keys once every K/V round
    arrived; the later stages' done signals (which post the dK/dV returns) follow it."""
    stages = view.stages[r]
    n = len(stages)
    call = merge_calls(stages)
    work = 0.0
    if call is not None and call.live:
        work = _backward_call_seconds(cost, cluster, shape, call, gpu_scale, True, device_terms)
    tasks = [_Task(work, tuple(("recv", "kv", j) for j in range(n - 1)), ("stage", 0))]
    return tasks + [_Task(0.0, (), ("stage", s)) for s in range(1, n)]


def _remote_first_tasks(view: PlanView, r: int, cost: AttentionCost, cluster: Cluster, shape: AttnShape,
                        gpu_scale: float, device_terms: bool = True) -> list[_Task]:
    """``"one+local"``: one call over the remote stages once every K/V round arrived (its
    done signals post every round's dK/dV return), then the own stage's call. The runtime issues
    the returns that sum relays' returns last and their sums wait on the compute stream, so
    the own call waits until the relay rounds' gradients reached this rank."""
    stages = view.stages[r]
    n = len(stages)
    rest = merge_calls(stages[1:])
    work, have = 0.0, False
    if rest is not None and rest.live:
        work = _backward_call_seconds(cost, cluster, shape, rest, gpu_scale, True, device_terms)
        have = True
    tasks = [_Task(work, tuple(("recv", "kv", j) for j in range(n - 1)), ("stage", 1))]
    tasks += [_Task(0.0, (), ("stage", s)) for s in range(2, n)]
    own = 0.0
    if stages[0].live:
        own = _backward_call_seconds(cost, cluster, shape, stages[0], gpu_scale, not have, device_terms)
    relays = tuple(("recv", "grad", j) for j, rnd in enumerate(view.rounds) if rnd.relay)
    tasks.append(_Task(own, relays, ("stage", 0)))
    return tasks


def simulate_overlap(view: PlanView, cost: AttentionCost, cluster: Cluster, shape: AttnShape,
                     backward: bool, bwd_calls: str = "stage", keep_kv: bool = False,
                     device_terms: bool = True) -> PassResult:
    """One overlapped pass on every rank (see the module docstring for the rules;
    ``bwd_calls``: :data:`BWD_CALLS`; ``keep_kv``: the backward's K/V are the forward's, already
    there: no K/V rounds, every stage ready at once; ``device_terms``: the runtime's merges and
    gradient accumulation as a few fp32 passes each, for callers without the recorded runtime
    ops of :func:`simulate_layer`'s ``device``)."""
    gpu_scale = cluster.gpu_scale.value
    bwd_calls = resolve_bwd_calls(view, bwd_calls)
    if backward and bwd_calls != "stage":
        merged = _remote_first_tasks if bwd_calls == "one+local" else _one_call_tasks
        tasks = [merged(view, r, cost, cluster, shape, gpu_scale, device_terms) for r in range(view.cp_size)]
    else:
        tasks = [_stage_tasks(view, r, cost, cluster, shape, gpu_scale, backward, device_terms)
                 for r in range(view.cp_size)]
    sim = _PassSim(view, cluster, shape, Links(cluster), tasks, grads=backward)
    rounds = view.rounds
    relays_of = {j: [i for i, rnd in enumerate(rounds) if rnd.relay and rnd.source == j]
                 for j in range(len(rounds))}
    for r in range(view.cp_size):
        for j, rnd in enumerate(rounds):
            if backward and keep_kv:
                sim.signal(r, ("recv", "kv", j))
            elif not rnd.relay:
                sim.post(r, "kv", j)
            else:
                sim.when(r, (("recv", "kv", rnd.source),), lambda r=r, j=j: sim.post(r, "kv", j))
            if backward:
                keys = (("stage", j + 1),) + tuple(("recv", "grad", i) for i in relays_of[j])
                sim.when(r, keys, lambda r=r, j=j: sim.post(r, "grad", j))
        sim._try_start(r)
    ranks = sim.run()
    return PassResult(ranks, sim.messages, sim.bytes, sim.xbytes)


def simulate_allgather(view: PlanView, cost: AttentionCost, cluster: Cluster, shape: AttnShape,
                       backward: bool, device_terms: bool = True) -> PassResult:
    """All-gather (exposed), one call, and in the backward a reduce-scatter (exposed)."""
    p = view.cp_size
    shard = shape.kv_bytes(view.local_seqlen)
    ag = ring_collective_time(cluster, p, shard)
    gpu_scale = cluster.gpu_scale.value
    ranks = []
    for r in range(p):
        tiles = view.sorted_tiles[r]
        if backward:
            work = cost.backward(tiles, shape.heads, shape.kv_heads) * gpu_scale if tiles.live else 0.0
            if device_terms:  # dK/dV into gathered slots
                work += 2 * shape.kv_bytes(tiles.keys) / cluster.hbm_bw.value
            comm = 2 * ag
        else:
            work = cost.forward(tiles, shape.heads, shape.kv_heads) * gpu_scale if tiles.live else 0.0
            comm = ag
        ranks.append(RankTimes(end=comm + work, compute=work, exposed_comm=comm))
    g = min(p, cluster.gpus_per_node)
    total = p * (p - 1) * shard * (2 if backward else 1)
    cross = p * (p - g) * shard * (2 if backward else 1)
    return PassResult(ranks, p * (p - 1), total, cross)


def simulate_pass(view: PlanView, cost: AttentionCost, cluster: Cluster, shape: AttnShape,
                  comm: str, backward: bool, bwd_calls: str = "stage", keep_kv: bool = False,
                  device_terms: bool = True) -> PassResult:
    if comm == "overlap":
        return simulate_overlap(view, cost, cluster, shape, backward, bwd_calls, keep_kv, device_terms)
    if comm == "allgather":
        return simulate_allgather(view, cost, cluster, shape, backward, device_terms)
    raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")


@dataclass
class LayerResult:
    """Attention of one layer (forward, backward, and a recomputed forward if on)."""

    fwd: PassResult
    bwd: PassResult
    host: list[float]          # host time per rank (fwd+bwd), the floor of its GPU time
    recompute: bool = False
    #: per rank, the runtime's own device work of the forward and of the backward (seconds;
    #: the recorded ops of scale_model/runtime_ops.py), on the attention's stream after its pass
    device: Optional[list[tuple[float, float]]] = None

    def rank_time(self, r: int) -> float:
        f, b = self.device[r] if self.device is not None else (0.0, 0.0)
        gpu = (self.fwd.ranks[r].end + f) * (2 if self.recompute else 1) + self.bwd.ranks[r].end + b
        return max(gpu, self.host[r] * (1.5 if self.recompute else 1.0))

    @property
    def time(self) -> float:
        return max(self.rank_time(r) for r in range(len(self.host)))

    @property
    def slowest(self) -> int:
        return max(range(len(self.host)), key=self.rank_time)


def _messages_per_rank(view: PlanView) -> list[int]:
    """Messages each rank sends or receives in one pass of the rounds (cached on the view)."""
    cached = getattr(view, "_msgs_per_rank", None)
    if cached is None:
        cached = [0] * view.cp_size
        for rnd in view.rounds:
            for (s, d, _) in rnd.transfers:
                cached[s] += 1
                cached[d] += 1
        view._msgs_per_rank = cached
    return cached


def host_seconds(view: PlanView, r: int, comm: str, cluster: Cluster, runtime) -> float:
    """Host time of rank ``r``'s attention forward+backward (ops x time per op)."""
    if comm == "allgather":
        return 2 * 12 * cluster.host_op.value  # a few ops per pass: gather, call, scatter
    stages = sum(1 for t in view.stages[r] if t.live)
    msgs = _messages_per_rank(view)[r]
    chunks = sum(view.stage_chunks[r][1:])
    mode = resolve_bwd_calls(view, getattr(runtime, "bwd_calls", "stage"))
    bwd = sum(any(t.live for t in ts) for _, ts in backward_calls_of(view.stages[r], mode))
    # forward + backward_stage calls, backward_prepare/finish once
    calls = stages + bwd + 2
    ops = runtime.host_ops(2 * len(view.stages[r]), msgs, chunks, calls)
    return ops * cluster.host_op.value


def simulate_layer(view: PlanView, cost: AttentionCost, cluster: Cluster, shape: AttnShape,
                   comm: str, runtime, recompute: bool = False,
                   device: Optional[list[tuple[float, float]]] = None) -> LayerResult:
    """One layer's attention on every rank. ``device``: per rank, the runtime's own device work
    of each pass (seconds, from the recorded runtime ops); without it the passes count the
    runtime's merges and gradient accumulation as a few fp32 passes (the runtimes before the
    recording, whose ops are not known)."""
    terms = device is None
    fwd = simulate_pass(view, cost, cluster, shape, comm, backward=False, device_terms=terms)
    bwd = simulate_pass(view, cost, cluster, shape, comm, backward=True,
                        bwd_calls=getattr(runtime, "bwd_calls", "stage"),
                        keep_kv=getattr(runtime, "keep_kv", False), device_terms=terms)
    host = [host_seconds(view, r, comm, cluster, runtime) for r in range(view.cp_size)]
    return LayerResult(fwd, bwd, host, recompute, device)


__all__ = ["BWD_CALLS", "resolve_bwd_calls", "backward_calls_of", "merge_calls", "AttnShape", "Links",
           "PassResult", "LayerResult", "RankTimes", "ring_collective_time",
           "simulate_layer", "simulate_pass", "simulate_overlap", "simulate_allgather"]
