"""Communication for context parallelism: process-group handling and the chunk exchange.

Everything goes through ``torch.distributed`` (NCCL on GPUs, gloo on CPU):

* the baseline uses the single-tensor all-gather / reduce-scatter collectives;
* the mask-aware path runs the plan's rounds (:class:`flashmask3.distributed.plan.Round`) as
  batched point-to-point operations (``batch_isend_irecv``). They are asynchronous: NCCL runs
  them on its own internal stream while the caller computes on the current stream, and
  ``Work.wait()`` only makes the current stream wait for the transfer (no host sync).

Every rank issues the batches of one exchange in the same order (rounds ascending for K/V,
descending for gradients), each batch holding at most one message per (src, dst) pair, so the
two ends of every message always match.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .plan import Round

_READY_GROUPS: set[str] = set()

# Newer torch renames the single-tensor collectives; use whichever this version has.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: Tag offset of the gradient (reverse) rounds; forward rounds use their index as tag.
GRAD_TAG = 1 << 10


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


def ensure_ready(pg: dist.ProcessGroup, device: torch.device) -> None:
    """Run one collective on ``pg`` before its first point-to-point batch.

    NCCL requires every rank of the group to take part in the first collective call of a
    communicator; a batch of P2P ops may involve only some ranks, so we open with a tiny
    all-reduce (once per group).
    """
    name = dist.get_backend(pg) + ":" + str(pg.group_name if hasattr(pg, "group_name") else id(pg))
    if name in _READY_GROUPS:
        return
    dist.all_reduce(torch.zeros(1, device=device), group=pg)
    _READY_GROUPS.add(name)


class Inflight:
    """Handles of one issued batch: its works, receive buffers and (kept alive) payloads."""

    def __init__(self, works, recvs, payloads):
        self.works = works
        self.recvs: list[tuple[tuple[int, ...], torch.Tensor]] = recvs
        self.payloads = payloads

    def wait(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        for w in self.works:
            w.wait()
        self.payloads = None
        return self.recvs


def issue(pg: dist.ProcessGroup, sends: list[tuple[int, torch.Tensor]],
          recvs: list[tuple[int, tuple[int, ...], torch.Tensor]], tag: int) -> Inflight:
    """Start one batch: ``sends`` = [(group peer, payload)], ``recvs`` = [(peer, chunks, buffer)]."""
    ops = [dist.P2POp(dist.isend, payload, group=pg, group_peer=peer, tag=tag)
           for peer, payload in sends]
    ops += [dist.P2POp(dist.irecv, buf, group=pg, group_peer=peer, tag=tag)
            for peer, _, buf in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    return Inflight(works, [(chunks, buf) for _, chunks, buf in recvs], [p for _, p in sends])


class ChunkExchange:
    """Runs a plan's rounds for one rank: K/V chunks forward, gradient partials in reverse.

    ``store`` maps chunk id -> tensor ``[2, B, chunk, Hk, D]`` (K and V stacked). Forward
    rounds put received chunks into it; :meth:`start_reverse` sends back the accumulated
    gradient of every received chunk to the rank it came from and adds what arrives into
    ``grads``.
    """

    def __init__(self, pg, rank: int, rounds: list[Round], store: dict[int, torch.Tensor],
                 make_buffer: Callable[..., torch.Tensor]):
        self.pg, self.rank, self.rounds = pg, rank, rounds
        self.store = store
        self.make_buffer = make_buffer
        self._inflight: dict[int, Inflight] = {}
        self._next = 0  # next forward round to issue
        self._reverse: dict[int, Inflight] = {}

    # -- forward: K/V chunks ------------------------------------------------------------------
    def _issue_forward(self, t: int) -> None:
        rnd = self.rounds[t]
        sends = [(tr.dst, torch.stack([self.store[c] for c in tr.chunks])) for tr in rnd.sends(self.rank)]
        recvs = [(tr.src, tr.chunks, self.make_buffer(len(tr.chunks))) for tr in rnd.recvs(self.rank)]
        self._inflight[t] = issue(self.pg, sends, recvs, tag=t)

    def issue_ready(self) -> None:
        """Issue, in order, every forward round whose payload is already available: leading
        direct rounds at once; a relay round only after the previous round arrived."""
        while self._next < len(self.rounds):
            t = self._next
            if self.rounds[t].relay and (t - 1) in self._inflight:
                break
            self._issue_forward(t)
            self._next += 1

    def wait_forward(self, t: int) -> list[int]:
        """Wait for round ``t``; store its chunks; issue rounds that became ready. Returns the
        received chunk ids."""
        if t not in self._inflight:
            raise RuntimeError(f"round {t} was never issued")
        got = []
        for chunks, buf in self._inflight.pop(t).wait():
            for c, x in zip(chunks, buf.unbind(0)):
                self.store[c] = x
                got.append(c)
        self.issue_ready()
        return got

    # -- reverse: gradient partials -----------------------------------------------------------
    def start_reverse(self, t: int, grads: dict[int, torch.Tensor], dtype: torch.dtype) -> None:
        """Send the gradients of the chunks received in round ``t`` back to their senders and
        post receives for the partial gradients of the chunks this rank sent in round ``t``."""
        rnd = self.rounds[t]
        sends = []
        for tr in rnd.recvs(self.rank):
            payload = torch.stack([self._grad(grads, c) for c in tr.chunks]).to(dtype)
            sends.append((tr.src, payload))
        recvs = [(tr.dst, tr.chunks, self.make_buffer(len(tr.chunks), dtype))
                 for tr in rnd.sends(self.rank)]
        self._reverse[t] = issue(self.pg, sends, recvs, tag=GRAD_TAG + t)

    def _grad(self, grads, c):
        if c not in grads:
            grads[c] = torch.zeros_like(self.store[c], dtype=torch.float32)
        return grads[c]

    def wait_reverse(self, t: int, grads: dict[int, torch.Tensor]) -> None:
        """Wait for reverse round ``t`` and add the received partial gradients into ``grads``."""
        for chunks, buf in self._reverse.pop(t).wait():
            for c, x in zip(chunks, buf.unbind(0)):
                self._grad(grads, c).add_(x)

    @property
    def has_relay(self) -> bool:
        return any(r.relay for r in self.rounds)


def all_gather_kv(pg, kv_local: torch.Tensor, world: int) -> torch.Tensor:
    """``[2, B, S_local, Hk, D]`` on every rank -> ``[P, 2, B, S_local, Hk, D]`` (rank order)."""
    shape = tuple(kv_local.shape)
    out = kv_local.new_empty((world * shape[0],) + shape[1:])
    _ALL_GATHER(out, kv_local.contiguous(), group=pg)
    return out.view((world,) + shape)


def reduce_scatter_kv(pg, grads: torch.Tensor) -> torch.Tensor:
    """``[P, 2, B, S_local, Hk, D]`` partial gradients on every rank -> this rank's sum."""
    shape = tuple(grads.shape)
    out = grads.new_empty(shape[1:])
    _REDUCE_SCATTER(out, grads.contiguous().view((shape[0] * shape[1],) + shape[2:]), group=pg)
    return out

