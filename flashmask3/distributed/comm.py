"""Communication for context parallelism: process-group handling and the chunk exchange.

Everything goes through ``torch.distributed`` (NCCL on GPUs, gloo on CPU):

* the baseline uses the single-tensor all-gather / reduce-scatter collectives;
* the mask-aware path runs each of the plan's rounds as one ``all_to_all_single`` with
  per-peer row counts (:class:`DistExchange`; NCCL runs it as grouped point-to-point sends and
  receives). They are asynchronous: NCCL runs them on its own internal stream while the caller
  computes on the current stream, and ``Work.wait()`` only makes the current stream wait for
  the transfer (no host sync);
* the node-layout check of hierarchical plans (:func:`check_node_layout`).

Every rank issues the rounds of a layer in the same order (the runtime's schedule depends on
the round list only, docs/cp-runtime.md), each round holding at most one message per
(src, dst) pair, so every rank's k-th exchange call is the same round and no two ranks wait on
each other's later rounds.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist


_READY_GROUPS: set[str] = set()

# Newer torch renames the single-tensor collectives; use whichever this version has.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group) -> dist.ProcessGroup:
    """The process group for ``group``: ``None`` (world), a ProcessGroup, a 1-D DeviceMesh,
    or a ``(DeviceMesh, dim)`` pair naming the context-parallel dimension."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: a {group.ndim}-D DeviceMesh is ambiguous; pass mesh['cp'] "
                             "or (mesh, 'cp')")
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    raise TypeError("group must be None, a ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, dim), "
                    f"got {type(group).__name__}")


def group_of_name(name: str) -> dist.ProcessGroup:
    """The process group whose ``group_name`` is ``name`` (how the context-parallel custom op
    receives its group: ops take strings, not ProcessGroup objects)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def ensure_ready(pg: dist.ProcessGroup, device: torch.device) -> None:
    """Run one small all-reduce on ``pg`` before its first exchange (once per group): it
    creates the group's communicator on every rank at a point where all of them are known to
    take part, before the layer's asynchronous rounds."""
    name = _group_key(pg)
    if name in _READY_GROUPS:
        return
    dist.all_reduce(torch.zeros(1, device=device), group=pg)
    _READY_GROUPS.add(name)


def message_splits(rnd, reverse: bool, world: int) -> tuple[list[int], list[int]]:
    """``(rows to each peer, rows from each peer)`` of round ``rnd`` in direction ``reverse``
    for a group of ``world`` ranks (``all_to_all_single``'s split sizes; computed once per round
    and direction, kept on the round)."""
    key = ("splits", reverse, world)
    cache = rnd.exchange_cache
    got = cache.get(key)
    if got is None:
        out_msgs, in_msgs = (rnd.recvs, rnd.sends) if reverse else (rnd.sends, rnd.recvs)
        got = cache[key] = (_rows_per_peer(out_msgs, world), _rows_per_peer(in_msgs, world))
    return got


def _rows_per_peer(msgs, world: int) -> list[int]:
    rows = [0] * world
    last = -1
    for m in msgs:
        if m.peer <= last:
            raise ValueError(f"a round's messages must be in increasing peer order, one per peer; got peer "
                             f"{m.peer} after {last}")
        rows[m.peer] = m.stop - m.start
        last = m.peer
    return rows


def outgoing_rows(send: Optional[torch.Tensor], out_msgs) -> Optional[torch.Tensor]:
    """The rows of ``out_msgs`` (one buffer laid out by them, message order) as one contiguous
    tensor, a view of ``send``; None: nothing to send."""
    if send is None or not out_msgs:
        return None
    return send[:out_msgs[-1].stop]


class _Batch:
    """The works of one issued batch, and the payload they read (kept alive until waited)."""

    def __init__(self, works, payload):
        self.works, self.payload = works, payload

    def wait(self) -> None:
        """Make the current stream wait for the batch (NCCL: no host sync; gloo: blocks)."""
        for w in self.works:
            w.wait()
        self.payload = None


class DistExchange:
    """The runtime's exchange over a torch.distributed group (see
    :mod:`flashmask3.distributed.runtime`): one ``all_to_all_single`` per round and direction.

    A forward round sends each message's wire rows to ``m.peer`` (``send``: one buffer of which
    each message is ``send[m.start:m.stop]``; a direct round's is a view,
    :attr:`~.program.RoundProgram.send_slice`) and receives straight into ``recv`` (each
    message its rows ``recv[m.start:m.stop]``); the reverse round swaps the roles of the two
    message lists.

    Why a collective and not one ``P2POp`` per message: issuing a message of a
    ``batch_isend_irecv`` costs 46-69 µs of host time on the H200 machine
    (benchmarks/results/cp_exchange_host.md), and a rank of a flat cp-128 plan has ~250
    messages a pass, milliseconds a layer. One
    ``all_to_all_single`` with per-peer row counts is one call whatever the count (NCCL runs it
    as the same grouped sends and receives, in C++). Every rank takes part in every round, with
    zero rows for peers it does not talk to; the runtime issues the rounds in the same order on
    every rank (docs/cp-runtime.md), which a collective needs. Messages are in peer order (a
    :class:`~.plan.Round` keeps them so), so the outgoing rows are one buffer (the program packs
    each direct round's rows back to back, once per pass) and the incoming ones land in ``recv``
    as they are."""

    def __init__(self, pg: dist.ProcessGroup):
        self.pg = pg
        self.world = dist.get_world_size(pg)

    def start(self, rnd, reverse: bool, send, recv) -> _Batch:
        out_msgs, in_msgs = (rnd.recvs, rnd.sends) if reverse else (rnd.sends, rnd.recvs)
        out_rows, in_rows = message_splits(rnd, reverse, self.world)
        payload = outgoing_rows(send, out_msgs)
        if recv is None:  # nothing arrives: any empty tensor of the payload's kind
            if payload is None:
                raise ValueError("DistExchange.start needs a receive buffer or a payload (every rank "
                                 "takes part in every round)")
            recv = payload[:0]
        if payload is None:
            payload = recv[:0]
        work = dist.all_to_all_single(recv[:in_msgs[-1].stop] if in_msgs else recv[:0], payload,
                                      output_split_sizes=in_rows, input_split_sizes=out_rows,
                                      group=self.pg, async_op=True)
        return _Batch([work], payload)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        _ALL_GATHER(out, inp, group=self.pg)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        _REDUCE_SCATTER(out, inp, group=self.pg)


# -- node layout ---------------------------------------------------------------------------------

_LAYOUT_OK: set = set()


def node_ids(global_ranks, node_layout) -> list:
    """Node of every global rank: ``node_layout`` is GPUs per node (node = rank // it), a
    sequence (node of global rank i = node_layout[i]) or a callable; ``None`` reads torchrun's
    ``LOCAL_WORLD_SIZE``."""
    if node_layout is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if not env:
            raise ValueError("a plan with nodes > 1 needs the node layout to check that the CP group "
                             "is node-major: run under torchrun (LOCAL_WORLD_SIZE) or pass "
                             "node_layout=<GPUs per node> or a node id per global rank")
        node_layout = int(env)
    if isinstance(node_layout, bool):
        raise TypeError("node_layout must be an int, a sequence or a callable, got bool")
    if isinstance(node_layout, int):
        if node_layout < 1:
            raise ValueError(f"node_layout (GPUs per node) must be >= 1, got {node_layout}")
        return [g // node_layout for g in global_ranks]
    if callable(node_layout):
        return [node_layout(g) for g in global_ranks]
    try:
        return [node_layout[g] for g in global_ranks]
    except (IndexError, KeyError, TypeError) as e:
        raise ValueError(f"node_layout must give a node for every global rank {list(global_ranks)}: {e}") from None


def node_layout_error(ids, nodes: int) -> Optional[str]:
    """Why group ranks on nodes ``ids`` (group rank order) are not node-major for ``nodes``
    nodes (group rank r on node r // (P / nodes)), or ``None`` when they are."""
    per = len(ids) // nodes
    blocks = [ids[i * per:(i + 1) * per] for i in range(nodes)]
    if all(len(set(b)) == 1 for b in blocks) and len({b[0] for b in blocks}) == nodes:
        return None
    return (f"the plan routes over nodes={nodes} assuming group rank r sits on node r // {per}, "
            f"but the group's ranks sit on nodes {list(ids)}; build the CP group node-major "
            f"(consecutive group ranks on one node) or plan with nodes=1")


def check_node_layout(pg: dist.ProcessGroup, nodes: int, node_layout, device) -> None:
    """Raise ValueError on every rank unless the group is node-major for ``nodes`` nodes.

    Checked once per (group, nodes, layout): the verdicts are combined by one all-reduce so that
    a rank with a different view of the layout cannot leave the others waiting."""
    if nodes == 1:
        return
    key = (_group_key(pg), nodes, repr(node_layout), os.environ.get("LOCAL_WORLD_SIZE"))
    if key in _LAYOUT_OK:
        return
    try:
        err = node_layout_error(node_ids(dist.get_process_group_ranks(pg), node_layout), nodes)
    except (ValueError, TypeError) as e:
        err = str(e)
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    if err is not None:
        raise ValueError(err)
    if int(flag.item()):
        raise ValueError("another rank of the CP group found the group not node-major for the plan's "
                         f"nodes={nodes} (see its error)")
    _LAYOUT_OK.add(key)


def _group_key(pg) -> str:
    return dist.get_backend(pg) + ":" + str(pg.group_name if hasattr(pg, "group_name") else id(pg))
