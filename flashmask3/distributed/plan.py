"""Context-parallel planning: who owns which tokens, what each rank computes and fetches.

A :class:`CPPlan` is computed from the *global* mask, identically and deterministically on
every rank (integer work counts, stable sorts, lowest-index tie breaks, no randomness), so that
no communication is needed to agree on it. It answers everything the communication layer needs
before any data moves (docs/context-parallel.md):

* ownership: the sequence is cut into chunks of ``chunk_size`` tokens and every rank owns the
  same number of chunks (``contiguous``, ``dual_chunk``, or the communication-aware ``sparse``
  of :mod:`flashmask3.distributed.placement`);
* work and liveness, from per-chunk summaries (:mod:`flashmask3.distributed.summaries`): per
  chunk the live (not SKIP) tiles of its query rows, summed over batch and mask heads, and the
  key chunks with a live tile, hence ``needed_chunks(rank)``;
* routing: the point-to-point rounds that bring each rank its needed chunks (flat by ring
  distance, or hierarchical over ``nodes`` nodes: intra-node direct, one cross-node copy per
  node to the same-slot peer, then an intra-node relay);
* rank-local masks (:mod:`flashmask3.distributed.local_mask`) over the rank's rows and its key
  axis in arrival order.

Planning costs O(B * Hm * S / tile) for the summaries, O(n^2) for the chunk liveness grid
(``n`` chunks), the placement's swaps (see its module) and O(P * n) for the routing (numpy
arrays, no per-transfer objects); every per-rank query is built on first use and cached.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ..masks import FlashMask, causal_mask, validate_startend_row_indices, with_window
from .handles import name_object, named_object
from .local_mask import local_columns_shape, rank_local_columns
from .placement import DEFAULT_TOLERANCE, PlacementCost, sparse_placement
from .summaries import chunk_pair_counts, chunk_summaries


def plan_of_token(token: torch.Tensor) -> "CPPlan":
    """The plan named by ``token`` (:attr:`CPPlan.op_token`; read on the host, no device sync)."""
    got = named_object(token)
    if not isinstance(got, CPPlan):
        raise RuntimeError("the CPPlan of this context-parallel call no longer exists (freed before "
                           "its backward?): keep the plan alive until the backward has run")
    return got


def to_device_pinned(x: torch.Tensor, device: torch.device, keep: list) -> torch.Tensor:
    """``x`` on ``device``: from pinned host memory without blocking when it goes to a GPU (the
    pinned source appended to ``keep``, to outlive the copy); as it is when already there."""
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        pinned = x.pin_memory()
        keep.append(pinned)
        return pinned.to(device, non_blocking=True)
    return x.to(device)


BALANCES = ("contiguous", "dual_chunk", "ptrr", "sparse")
WORK_MODELS = ("tiles", "pairs")

#: Tile edge of the work model (the kernels' query/key block size on Hopper).
DEFAULT_TILE = 128

#: Chunks per rank tried (largest first) when ``balance="sparse"`` picks its own chunk size.
_SPARSE_CHUNKS_PER_RANK = (16, 12, 8, 6, 4, 3, 2, 1)


@dataclass(frozen=True)
class Transfer:
    """``src`` sends its copies of KV ``chunks`` (sorted chunk ids) to ``dst``."""

    src: int
    dst: int
    chunks: tuple[int, ...]


class Round:
    """One batch of point-to-point transfers, the same on every rank's copy of the plan.

    ``relay=False``: a direct round; every sender sends chunks it owns, so all direct rounds
    may be issued at once at the start of a layer. ``relay=True``: the senders forward chunks
    they received in round ``source`` (an earlier round index), so a rank may issue it only
    after round ``source`` has arrived.

    Kept as arrays of (src, dst, chunk) triples, one per chunk sent, ordered by (src, dst):
    a flat plan over P ranks exchanges between nearly every pair (16K transfers at cp 128), and
    a training rank reads only its own messages, so :class:`Transfer` objects are built on
    demand (:meth:`sends` / :meth:`recvs` per rank, cached; :attr:`transfers` all of them).
    Thousands of objects per plan made Python's full garbage collections (~0.2 s each on a
    slow host) come every few plans (benchmarks/NOTES.md, session 47). Immutable; equal when
    the transfers, ``relay`` and ``source`` are.
    """

    __slots__ = ("_relay", "_source", "_src", "_dst", "_chunk", "_dst_order", "_cache")

    def __init__(self, transfers: Sequence[Transfer] = (), relay: bool = False,
                 source: Optional[int] = None):
        transfers = tuple(transfers)
        pairs = set()
        for t in transfers:
            if (t.src, t.dst) in pairs:
                raise ValueError(f"a round holds at most one transfer per (src, dst) pair; ({t.src}, {t.dst}) "
                                 "appears twice")
            if not t.chunks:
                raise ValueError(f"transfer ({t.src}, {t.dst}) carries no chunk")
            pairs.add((t.src, t.dst))
        counts = [len(t.chunks) for t in transfers]
        src = np.repeat(np.array([t.src for t in transfers], dtype=np.int64), counts)
        dst = np.repeat(np.array([t.dst for t in transfers], dtype=np.int64), counts)
        chunk = np.array([c for t in transfers for c in t.chunks], dtype=np.int64)
        order = np.lexsort((dst, src))  # stable: each transfer's chunks keep their order
        self._set(src[order], dst[order], chunk[order], relay, source)

    @classmethod
    def _of_triples(cls, src: np.ndarray, dst: np.ndarray, chunk: np.ndarray, relay: bool = False,
                    source: Optional[int] = None) -> "Round":
        """A round of (src, dst, chunk) triples already ordered by (src, dst, chunk) (the
        planner's; no per-transfer objects)."""
        rnd = cls.__new__(cls)
        rnd._set(src, dst, chunk, relay, source)
        return rnd

    def _set(self, src, dst, chunk, relay, source) -> None:
        if bool(relay) != (source is not None):
            raise ValueError("a relay round needs its source round index, a direct round none "
                             f"(relay={relay}, source={source})")
        object.__setattr__(self, "_relay", bool(relay))
        object.__setattr__(self, "_source", None if source is None else int(source))
        for name, a in (("_src", src), ("_dst", dst), ("_chunk", chunk)):
            a = np.ascontiguousarray(a, dtype=np.int64)
            a.flags.writeable = False
            object.__setattr__(self, name, a)
        object.__setattr__(self, "_dst_order", None)
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, name, value):
        raise AttributeError(f"Round is immutable (cannot set {name!r})")

    def triples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The round's (src, dst, chunk) arrays (read-only), one entry per chunk sent, ordered by
        (src, dst): what equality, hashing, pickling and the plan's fingerprint compare."""
        return self._src, self._dst, self._chunk

    def __getstate__(self):
        return (*self.triples(), self._relay, self._source)

    def __setstate__(self, state):
        self._set(*state)

    @property
    def relay(self) -> bool:
        return self._relay

    @property
    def source(self) -> Optional[int]:
        return self._source

    @property
    def num_chunks_sent(self) -> int:
        """Chunk copies this round moves (summed over its transfers)."""
        return len(self._chunk)

    def cross_node_chunks(self, gpus_per_node: int) -> int:
        """Chunk copies of this round whose sender and receiver sit on different nodes."""
        return int(np.count_nonzero(self._src // gpus_per_node != self._dst // gpus_per_node))

    def transfer_sizes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, chunks)`` arrays, one entry per transfer ordered by (src, dst): who sends
        how many chunks to whom, without building :class:`Transfer` objects."""
        if not len(self._src):
            return self._src, self._dst, self._src
        starts = _transfer_starts(self._src, self._dst)
        return self._src[starts], self._dst[starts], np.diff(np.r_[starts, len(self._src)])

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer, ordered by (src, dst) (built on first use)."""
        got = self._cache.get("all")
        if got is None:
            got = self._cache["all"] = _transfers_of(self._src, self._dst, self._chunk)
        return got

    def sends(self, rank: int) -> list[Transfer]:
        """Transfers ``rank`` sends in this round, in increasing destination rank."""
        key = ("send", int(rank))
        got = self._cache.get(key)
        if got is None:
            lo, hi = np.searchsorted(self._src, [rank, rank + 1])
            got = self._cache[key] = _transfers_of(self._src[lo:hi], self._dst[lo:hi], self._chunk[lo:hi])
        return list(got)

    def _by_dst(self) -> tuple[np.ndarray, np.ndarray]:
        """(triple indices ordered by (dst, src), each transfer's chunks in order; their dst)."""
        if self._dst_order is None:
            order = np.lexsort((self._src, self._dst))
            object.__setattr__(self, "_dst_order", (order, self._dst[order]))
        return self._dst_order

    def recvs(self, rank: int) -> list[Transfer]:
        """Transfers ``rank`` receives in this round, in increasing source rank."""
        key = ("recv", int(rank))
        got = self._cache.get(key)
        if got is None:
            idx = self._received(rank)
            got = self._cache[key] = _transfers_of(self._src[idx], self._dst[idx], self._chunk[idx])
        return list(got)

    def _received(self, rank: int) -> np.ndarray:
        """Indices of the triples ``rank`` receives, ordered by source."""
        order, dst = self._by_dst()
        lo, hi = np.searchsorted(dst, [rank, rank + 1])
        return order[lo:hi]

    def received_chunks(self, rank: int) -> np.ndarray:
        """Chunk ids ``rank`` receives in this round (by source, then ascending)."""
        return self._chunk[self._received(rank)]

    def __eq__(self, other) -> bool:
        if not isinstance(other, Round):
            return NotImplemented
        return (self._relay == other._relay and self._source == other._source
                and all(np.array_equal(a, b) for a, b in zip(self.triples(), other.triples())))

    def __hash__(self) -> int:
        return hash((self._relay, self._source, *(a.tobytes() for a in self.triples())))

    def __repr__(self) -> str:
        n = len(_transfer_starts(self._src, self._dst)) if len(self._src) else 0
        return (f"Round({n} transfers, {len(self._chunk)} chunks, relay={self._relay}, "
                f"source={self._source})")


def _transfer_starts(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """First triple of each (src, dst) run."""
    cut = np.flatnonzero((src[1:] != src[:-1]) | (dst[1:] != dst[:-1])) + 1
    return np.r_[0, cut]


def _transfers_of(src: np.ndarray, dst: np.ndarray, chunk: np.ndarray) -> tuple[Transfer, ...]:
    """:class:`Transfer` objects of (src, dst, chunk) triples grouped by (src, dst) runs."""
    if not len(src):
        return ()
    starts = _transfer_starts(src, dst)
    bounds = np.r_[starts, len(src)].tolist()
    chunks = chunk.tolist()
    return tuple(Transfer(s, d, tuple(chunks[i:j])) for s, d, i, j in
                 zip(src[starts].tolist(), dst[starts].tolist(), bounds[:-1], bounds[1:]))


# -- argument handling ------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _mask_args(startend_row_indices, causal, seqlen):
    """Normalise the mask argument to ``(int32 tensor | None, causal, seqlen)``."""
    validated = False
    if isinstance(startend_row_indices, FlashMask):
        mask = startend_row_indices
        if causal is not None and bool(causal) != mask.causal:
            raise ValueError(f"causal={causal} conflicts with the FlashMask (causal={mask.causal})")
        if mask.seqlen_q != mask.seqlen_k:
            raise ValueError("context parallelism needs a self-attention mask (seqlen_q == seqlen_k)")
        startend_row_indices, causal = mask.startend_row_indices, mask.causal
        validated = True
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if startend_row_indices is None:
        if seqlen is None:
            raise ValueError("seqlen is required when startend_row_indices is None")
        return None, causal, _check_int("seqlen", seqlen)
    if not isinstance(startend_row_indices, torch.Tensor):
        raise TypeError("startend_row_indices must be a torch.Tensor, a FlashMask or None, got "
                        f"{type(startend_row_indices).__name__}")
    s = startend_row_indices.shape[2] if startend_row_indices.dim() == 4 else -1
    if seqlen is not None and seqlen != s:
        raise ValueError(f"seqlen={seqlen} does not match the mask's {s} columns")
    if not validated:  # a FlashMask was validated when it was built
        validate_startend_row_indices(startend_row_indices, causal=causal,
                                      batch_size=startend_row_indices.shape[0], seqlen_q=s, seqlen_k=s)
    # Kept on its device: tile classification and local masks run there (GPU when training).
    return startend_row_indices.detach().contiguous(), causal, s


def _default_chunk_size(seqlen: int, cp_size: int, balance: str, tile: int) -> int:
    """Chunk size when the caller gives none: P chunks, 2P chunks, or many for ``sparse``
    (0 when the length cannot be split evenly)."""
    if balance == "contiguous":
        return seqlen // cp_size if seqlen % cp_size == 0 else 0
    if balance == "dual_chunk":
        return seqlen // (2 * cp_size) if seqlen % (2 * cp_size) == 0 else 0
    if balance == "ptrr":  # one tile a chunk (torch's blocks); else the largest chunks that split
        if seqlen % (tile * cp_size) == 0:
            return tile
        return next((c for c in range(tile - 1, 0, -1) if seqlen % (c * cp_size) == 0), 0)
    fits = [k for k in _SPARSE_CHUNKS_PER_RANK if seqlen % (k * cp_size) == 0]
    aligned = [k for k in fits if (seqlen // (k * cp_size)) % tile == 0]
    if aligned:
        return seqlen // (aligned[0] * cp_size)
    roomy = [k for k in fits if seqlen // (k * cp_size) >= 8]
    k = (roomy or fits or [0])[0]
    return seqlen // (k * cp_size) if k else 0


def _chunks_multiple(cp_size: int, balance: str) -> int:
    """The number of chunks must be a multiple of this: ``2 * cp_size`` for dual_chunk (each rank
    owns a head and a tail chunk), else ``cp_size``."""
    return 2 * cp_size if balance == "dual_chunk" else cp_size


def _lengths_that_work(seqlen: int, cp_size: int, balance: str, tile: int) -> str:
    """The sentence that says which sequence lengths a plan can split evenly."""
    step = _chunks_multiple(cp_size, balance)
    best = step * tile
    up = padded_seqlen(seqlen, cp_size, balance=balance, multiple=best)
    return (f"with balance={balance!r} the length must be a multiple of {step} "
            f"({'2 * ' if balance == 'dual_chunk' else ''}cp_size), best a multiple of {best} so that chunks "
            f"align with the {tile}-token tiles: pad the sequence to {up} tokens (masked padding "
            f"documents) or pass a chunk_size that divides it into a multiple of {step} chunks")


def padded_seqlen(seqlen: int, cp_size: int, *, balance: str = "sparse", multiple: int = 1) -> int:
    """The shortest length >= ``seqlen`` that :func:`plan` splits evenly over ``cp_size`` ranks
    with ``balance`` and its default chunks, and a multiple of ``multiple`` (``cp_size * 128``
    or ``2 * cp_size * 128`` aligns the chunks with the kernels' tiles; the default pads least).
    Pad the mask with :func:`flashmask3.masks.pad_to` and the inputs to it (the transformers
    integration's ``model_inputs`` pads them to its plan's length)."""
    seqlen, cp_size, multiple = (_check_int(n, v) for n, v in
                                 (("seqlen", seqlen), ("cp_size", cp_size), ("multiple", multiple)))
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    step = math.lcm(_chunks_multiple(cp_size, balance), multiple)
    return -(-seqlen // step) * step


def _check_chunking(seqlen: int, cp_size: int, balance: str, chunk_size: int) -> int:
    """Validate that ``chunk_size`` splits the sequence evenly over the ranks; return #chunks."""
    per = _chunks_multiple(cp_size, balance)
    if seqlen % chunk_size != 0:
        raise ValueError(f"chunk_size={chunk_size} must divide the sequence length {seqlen} into a "
                         f"multiple of {per} chunks ({balance} over cp_size={cp_size} ranks)")
    n = seqlen // chunk_size
    if n % per != 0:
        raise ValueError(f"chunk_size={chunk_size} gives {n} chunks, which {balance} cannot share "
                         f"evenly over cp_size={cp_size} ranks (need a multiple of {per})")
    return n


# -- work model and liveness --------------------------------------------------------------------


def chunk_liveness(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int,
                   chunk_size: int, tile: int = DEFAULT_TILE) -> tuple[np.ndarray, np.ndarray]:
    """Per query chunk its work (live tiles) and the live (query chunk, key chunk) pairs.

    Tiles are ``gcd(chunk_size, tile)`` square so that every tile lies in one chunk. Returns
    ``work`` int64 ``[n]`` (summed over batch and mask heads) and ``live`` bool ``[n, n]``
    (live for some batch row or head), from per-block summaries with the mask layer's tile rule
    (:mod:`flashmask3.distributed.summaries`): a key chunk that is not live for a query chunk
    is fully masked there and can be dropped exactly.
    """
    return chunk_summaries(startend_row_indices, causal, seqlen, chunk_size, tile)


def chunk_pairs(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int,
                chunk_size: int) -> np.ndarray:
    """Exact unmasked (query, key) pairs of each query chunk, summed over batch and mask heads."""
    return chunk_pair_counts(startend_row_indices, causal, seqlen, chunk_size)


# -- ownership strategies -------------------------------------------------------------------------


def _contiguous(n: int, cp_size: int) -> np.ndarray:
    return np.repeat(np.arange(cp_size), n // cp_size)


def _dual_chunk(n: int, cp_size: int) -> np.ndarray:
    """2P equal segments; rank r owns segments r and 2P-1-r (the standard causal baseline)."""
    seg = np.repeat(np.arange(2 * cp_size), n // (2 * cp_size))
    return np.minimum(seg, 2 * cp_size - 1 - seg)


def _ptrr(chunk_work: np.ndarray, cp_size: int) -> np.ndarray:
    """PyTorch's processing-time round-robin (``_PTRRLoadBalancer``): chunks sorted by work,
    heaviest first (ties in sequence order), dealt to the ranks in snake order (0..P-1, then
    P-1..0, ...). Equal chunk counts and near-equal work, but every rank holds pieces of every
    document, so each needs almost all K/V (the all-gather torch pairs it with)."""
    n = len(chunk_work)
    order = np.argsort(-np.asarray(chunk_work, dtype=np.int64), kind="stable")
    pos = np.arange(n) % cp_size
    turn = (np.arange(n) // cp_size) % 2 == 1
    owner = np.empty(n, dtype=np.int64)
    owner[order] = np.where(turn, cp_size - 1 - pos, pos)
    return owner


# -- routing ----------------------------------------------------------------------------------------


def _ordered_triples(src: np.ndarray, dst: np.ndarray, chunk: np.ndarray) -> tuple[np.ndarray, ...]:
    """(src, dst, chunk) triples ordered by (src, dst, chunk): one transfer per (src, dst),
    chunks ascending (a :class:`Round`'s layout)."""
    order = np.lexsort((chunk, dst, src))
    return src[order], dst[order], chunk[order]


def _remote_needs(owner: np.ndarray, need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rank, chunk) pairs of needed chunks the rank does not own."""
    remote = need & (owner[None, :] != np.arange(need.shape[0])[:, None])
    return np.nonzero(remote)


def _flat_rounds(owner: np.ndarray, need: np.ndarray, n_rounds: int) -> list[Round]:
    """Direct transfers grouped by ring distance d (rank r sends to r+d), ``n_rounds`` groups.

    Grouping by distance gives every rank the same sequence of rounds, each round holding at
    most one message per (src, dst) pair, so batches match on both ends.
    """
    p = need.shape[0]
    groups = [g for g in np.array_split(np.arange(1, p, dtype=np.int64), n_rounds) if len(g)]
    which = np.zeros(p, dtype=np.int64)
    for i, g in enumerate(groups):
        which[g] = i
    dst, chunk = _remote_needs(owner, need)
    src = owner[chunk]
    rnd = which[(dst - src) % p]
    return [Round._of_triples(*_ordered_triples(src[rnd == i], dst[rnd == i], chunk[rnd == i]))
            for i in range(len(groups))]


def _hierarchical_rounds(owner: np.ndarray, need: np.ndarray, nodes: int) -> list[Round]:
    """Three rounds: intra-node direct; cross-node direct, one copy per (chunk, node) to the
    owner's same-slot peer there; intra-node relay from that peer (source: the cross round).

    The first remote stage thus waits only for intra-node traffic. Empty rounds are dropped
    (the relay's ``source`` follows).
    """
    p, n = need.shape
    g = p // nodes
    dst, chunk = _remote_needs(owner, need)
    src = owner[chunk]
    same = dst // g == src // g
    intra = _ordered_triples(src[same], dst[same], chunk[same])
    # cross-node: (chunk, other node) pairs with some rank of that node needing the chunk
    far_dst, far_chunk = dst[~same], chunk[~same]
    far_src = owner[far_chunk]
    peer = (far_dst // g) * g + far_src % g
    key = np.unique(far_chunk * p + peer)
    x_chunk, x_peer = key // p, key % p
    cross = _ordered_triples(owner[x_chunk], x_peer, x_chunk)
    fan = far_dst != peer
    relay = _ordered_triples(peer[fan], far_dst[fan], far_chunk[fan])
    rounds: list[Round] = []
    if len(intra[0]):
        rounds.append(Round._of_triples(*intra))
    if len(cross[0]):
        rounds.append(Round._of_triples(*cross))
        if len(relay[0]):
            rounds.append(Round._of_triples(*relay, relay=True, source=len(rounds) - 1))
    return rounds


# -- the plan ---------------------------------------------------------------------------------------


class CPPlan:
    """Everything about one context-parallel layout of one global mask (see module doc).

    Built by :func:`plan`; immutable; identical on every rank. Rank numbers are ranks of the
    CP process group (``0 .. cp_size-1``). Per-rank answers are computed once at construction
    (ownership, needs, stages) or on first use and cached (index tensors, local masks).
    """

    def __init__(self, startend_row_indices, causal, seqlen, cp_size, balance, chunk_size, nodes,
                 tile, comm_rounds, work_model="tiles", cost: Optional[PlacementCost] = None,
                 owner: Optional[np.ndarray] = None, tolerance: float = DEFAULT_TOLERANCE):
        self.startend_row_indices: Optional[torch.Tensor] = startend_row_indices
        self.causal: bool = causal
        self.seqlen: int = seqlen
        self.cp_size: int = cp_size
        self.balance: str = balance
        self.chunk_size: int = chunk_size
        self.nodes: int = nodes
        self.tile: int = tile
        self.num_chunks: int = seqlen // chunk_size
        self.work_model: str = work_model
        self.chunk_work, self.chunk_live = chunk_liveness(startend_row_indices, causal, seqlen,
                                                          chunk_size, tile)
        if work_model == "pairs":
            self.chunk_work = chunk_pairs(startend_row_indices, causal, seqlen, chunk_size)
        n = self.num_chunks
        self.comm_rounds: int = comm_rounds
        self.cost: Optional[PlacementCost] = cost
        self.tolerance: float = tolerance
        if owner is None:  # else another plan's placement (with_mask)
            if balance == "contiguous":
                owner = _contiguous(n, cp_size)
            elif balance == "dual_chunk":
                owner = _dual_chunk(n, cp_size)
            elif balance == "ptrr":
                owner = _ptrr(self.chunk_work, cp_size)
            else:
                block = int(np.gcd(chunk_size, tile))
                scale = 1.0 / DEFAULT_TILE ** 2 if work_model == "pairs" else (block / DEFAULT_TILE) ** 2
                owner = sparse_placement(self.chunk_work, self.chunk_live, cp_size, chunk_tokens=chunk_size,
                                         tile_scale=scale, nodes=nodes, cost=cost or PlacementCost(),
                                         tolerance=tolerance)
        self.owner: np.ndarray = np.ascontiguousarray(owner, dtype=np.int64)
        self._owned = [np.flatnonzero(self.owner == r) for r in range(cp_size)]
        members = np.stack(self._owned)  # [P, k]
        # need[r, c]: KV chunk c is live for some query row of rank r.
        self.need: np.ndarray = self.chunk_live[members].any(1)
        if nodes > 1:
            self.rounds: list[Round] = _hierarchical_rounds(self.owner, self.need, nodes)
        else:
            self.rounds = _flat_rounds(self.owner, self.need, comm_rounds)
        self._works = np.bincount(self.owner, weights=self.chunk_work, minlength=cp_size).astype(np.int64)
        self._chunks = [tuple(o.tolist()) for o in self._owned]
        self._stages: dict[int, list[tuple[int, ...]]] = {}  # per rank, on first use
        self._needed: dict[tuple[int, str], tuple[int, ...]] = {}
        self._index_cache: dict = {}
        self._local_masks: dict[tuple[int, str], FlashMask] = {}
        # names the plan to the traced layer's custom op (flashmask3::cp_attention_forward): a
        # tensor, so every batch's new plan reuses the compiled graph (handles.py)
        self.op_token: torch.Tensor = name_object(self)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("op_token", None)  # a per-process name (handles.py): the copy gets its own
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.op_token = name_object(self)

    def with_mask(self, startend_row_indices: Union[torch.Tensor, FlashMask, None],
                  causal: Optional[bool] = None) -> "CPPlan":
        """A plan for another mask over the same sequence with this plan's placement: the same
        owner of every chunk (so the same shards: ``shard``/``unshard`` agree), and the other
        mask's liveness, needed chunks, rounds and local masks. For models whose layers mask
        differently (sliding-window and full layers): plan the placement once, on the mask that
        matters most, then derive a plan per other mask. Its work balance is this placement's,
        not one optimised for the new mask."""
        if causal is None and not isinstance(startend_row_indices, FlashMask):
            raise TypeError("causal is required unless startend_row_indices is a FlashMask")
        cols, causal, s = _mask_args(startend_row_indices, causal, self.seqlen if startend_row_indices is None else None)
        if s != self.seqlen:
            raise ValueError(f"the mask has {s} tokens, the plan {self.seqlen}")
        return CPPlan(cols, causal, s, self.cp_size, self.balance, self.chunk_size, self.nodes, self.tile,
                      self.comm_rounds, self.work_model, self.cost, owner=self.owner,
                      tolerance=self.tolerance)

    def windowed(self, window: int) -> "CPPlan":
        """The plan of this plan's mask limited to a causal sliding window (query ``i`` keeps
        the keys ``[i - window, i]`` it was allowed; :func:`flashmask3.masks.with_window`), with
        this placement (:meth:`with_mask`); built once per window and kept."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window_size must be an int >= 0, got {window!r}")
        if not self.causal:
            raise ValueError("a sliding window needs a causal plan (window_size limits the keys "
                             "before each query)")
        cache = self.__dict__.setdefault("_windowed", {})
        if window not in cache:
            cols = self.startend_row_indices
            full = (causal_mask(self.seqlen) if cols is None  # a plan of plain causal attention
                    else FlashMask(cols, True, self.seqlen, _validated=True))  # checked when planned
            cache[window] = self.with_mask(with_window(full, window))
        return cache[window]

    def _rank_stages(self, rank: int) -> list[tuple[int, ...]]:
        """:meth:`stages` of a checked rank, built on first use (a training rank asks for its
        own only)."""
        got = self._stages.get(rank)
        if got is None:
            need = self.need[rank]
            own = self._owned[rank]
            got = [tuple(own[need[own]].tolist())]
            for rnd in self.rounds:
                c = rnd.received_chunks(rank)
                got.append(tuple(np.sort(c[need[c]]).tolist()))
            self._stages[rank] = got
        return got

    # -- ownership ---------------------------------------------------------------------------
    def _check_rank(self, rank) -> int:
        rank = _check_int("rank", rank, 0)
        if rank >= self.cp_size:
            raise ValueError(f"rank must be < cp_size={self.cp_size}, got {rank}")
        return rank

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Chunk ids owned by ``rank``, ascending."""
        return self._chunks[self._check_rank(rank)]

    def _token_index(self, chunks: Sequence[int]) -> torch.Tensor:
        key = tuple(chunks)
        hit = self._index_cache.get(key)
        if hit is None:
            if not len(key):
                hit = torch.zeros(0, dtype=torch.int64)
            else:
                base = torch.as_tensor(key, dtype=torch.int64).view(-1, 1) * self.chunk_size
                hit = (base + torch.arange(self.chunk_size)).flatten()
            self._index_cache[key] = hit
        return hit

    def rows(self, rank: int) -> torch.Tensor:
        """Global token indices owned by ``rank`` (sorted, int64): its query rows, and the
        global position ids of its shard. Cached: do not modify in place."""
        return self._token_index(self.chunks(rank))

    @property
    def local_seqlen(self) -> int:
        """Tokens per rank (the same on every rank)."""
        return self.seqlen // self.cp_size

    # -- work --------------------------------------------------------------------------------
    def work(self, rank: int) -> int:
        """Work of ``rank``'s query rows (summed over batch and mask heads): live tiles, or
        unmasked pairs with ``work="pairs"``."""
        return int(self._works[self._check_rank(rank)])

    @property
    def works(self) -> list[int]:
        return self._works.tolist()

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank work (1.0 = perfect; 1.0 when there is no work)."""
        w = self._works.astype(np.float64)
        return float(w.max() / w.mean()) if w.sum() > 0 else 1.0

    # -- keys and communication ------------------------------------------------------------
    def stages(self, rank: int) -> list[tuple[int, ...]]:
        """Needed KV chunks of ``rank`` grouped by arrival: [own chunks, round 0, round 1, ...]
        (one entry per round, possibly empty), ascending inside each stage (so a document's
        chunks stay contiguous within a stage and the kernels' live key-block ranges stay tight).

        Chunks that a rank only relays (needed by another rank of its node) are not listed.
        """
        return list(self._rank_stages(self._check_rank(rank)))

    def needed_chunks(self, rank: int, order: str = "arrival") -> tuple[int, ...]:
        """KV chunks live for ``rank``'s rows: in arrival order (the local key axis of the
        overlapped path) or ``order="sorted"`` (global order: one call over all keys)."""
        rank = self._check_rank(rank)
        if order not in ("arrival", "sorted"):
            raise ValueError(f"order must be 'arrival' or 'sorted', got {order!r}")
        if (rank, order) not in self._needed:
            arrival = tuple(c for stage in self._rank_stages(rank) for c in stage)
            self._needed[(rank, "arrival")] = arrival
            self._needed[(rank, "sorted")] = tuple(sorted(arrival))
        return self._needed[(rank, order)]

    def key_index(self, rank: int, order: str = "arrival") -> torch.Tensor:
        """Global key positions of ``rank``'s local key axis (cached: do not modify in place)."""
        return self._token_index(self.needed_chunks(rank, order))

    def remote_chunks(self, rank: int) -> int:
        """Needed KV chunks of ``rank`` that it does not own (what it must receive)."""
        rank = self._check_rank(rank)
        return int((self.need[rank] & (self.owner != rank)).sum())

    @property
    def max_remote_kv_tokens(self) -> int:
        """The largest per-rank remote K/V in tokens (needed chunks not owned x chunk size)."""
        remote = (self.need & (self.owner[None, :] != np.arange(self.cp_size)[:, None])).sum(1)
        return int(remote.max()) * self.chunk_size

    def local_mask(self, rank: int, order: str = "arrival") -> FlashMask:
        """The rank-local mask: rows = ``rows(rank)``, keys = ``key_index(rank, order)``,
        non-causal.

        Every global bound v becomes ``#{i in rows : i < v}`` and the causal diagonal is folded
        into an upper interval, so the local problem equals the global one restricted to the
        rank's rows and needed keys (docs/context-parallel.md, "Rank-local masks"). The key
        axis is the K/V arrival order by default; ``order="sorted"`` keeps global order, best
        when all keys are present at once (all-gather) since every document's keys are then
        contiguous.
        """
        rank = self._check_rank(rank)
        key = (rank, order)
        if key not in self._local_masks:
            cols = rank_local_columns(self.startend_row_indices, self.causal, self.rows(rank),
                                      self.key_index(rank, order), self.chunk_size)
            self._local_masks[key] = FlashMask(cols, False, self.local_seqlen)
        return self._local_masks[key]

    def local_columns_shape(self, rank: int, order: str = "arrival") -> tuple:
        """The shape of :meth:`local_mask`'s columns, without building them."""
        n_keys = len(self.needed_chunks(rank, order)) * self.chunk_size
        return local_columns_shape(self.startend_row_indices, self.causal, n_keys)

    # -- accounting --------------------------------------------------------------------------
    def kv_tokens_moved(self, comm: str = "overlap") -> int:
        """K/V tokens received over all ranks in one forward pass (x2 with backward's refetch,
        x3 with the gradient return): ``allgather`` gives every rank every other rank's shard."""
        if comm == "allgather":
            return self.cp_size * (self.seqlen - self.local_seqlen)
        if comm != "overlap":
            raise ValueError(f"comm must be 'allgather' or 'overlap', got {comm!r}")
        return sum(rnd.num_chunks_sent for rnd in self.rounds) * self.chunk_size

    def cross_node_transfers(self, comm: str = "overlap", gpus_per_node: Optional[int] = None) -> int:
        """Chunk transfers that cross a node boundary in one forward pass.

        ``gpus_per_node`` defaults to the plan's own ``cp_size // nodes``; a flat plan can be
        measured against any node size. ``allgather`` sends every chunk to every rank of every
        other node.
        """
        g = self.cp_size // self.nodes if gpus_per_node is None else _check_int("gpus_per_node", gpus_per_node)
        if self.cp_size % g:
            raise ValueError(f"gpus_per_node={g} must divide cp_size={self.cp_size}")
        if comm == "allgather":
            return self.num_chunks * (self.cp_size - g)
        if comm != "overlap":
            raise ValueError(f"comm must be 'allgather' or 'overlap', got {comm!r}")
        return sum(rnd.cross_node_chunks(g) for rnd in self.rounds)

    # -- sharding ------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s rows of a token-dimension tensor (inputs, labels, global position ids)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = dim % x.dim() if x.dim() else 0
        if x.dim() == 0 or x.shape[dim] != self.seqlen:
            raise ValueError(f"x must have {self.seqlen} tokens along dim={dim}, got shape {tuple(x.shape)}")
        return x.index_select(dim, self._rows_on(rank, x.device))

    def _rows_on(self, rank: int, device: torch.device) -> torch.Tensor:
        """:meth:`rows` on ``device``, cached per device: a GPU gets them once per plan, from
        pinned memory without blocking (a copy from pageable memory would wait for the GPU on
        every shard of every batch)."""
        cache = self.__dict__.setdefault("_device_rows", {})
        key = (int(rank), str(device))
        got = cache.get(key)
        if got is None:
            keep: list = []  # the pinned source lives with its copy
            got = cache[key] = (to_device_pinned(self.rows(rank), device, keep), keep)
        return got[0]

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: the full tensor from every rank's shard (rank order)."""
        if not isinstance(shards, (list, tuple)) or len(shards) != self.cp_size:
            raise ValueError(f"shards must be a list of cp_size={self.cp_size} tensors")
        first = shards[0]
        dim = dim % first.dim()
        shape = list(first.shape)
        shape[dim] = self.seqlen
        out = first.new_empty(shape)
        for r, x in enumerate(shards):
            if x.shape[dim] != self.local_seqlen:
                raise ValueError(f"shard {r} has {x.shape[dim]} tokens along dim={dim}, "
                                 f"expected {self.local_seqlen}")
            out.index_copy_(dim, self._rows_on(r, x.device), x)
        return out

    @property
    def fingerprint(self) -> int:
        """A 63-bit digest of everything ranks must agree on (layout, ownership, routing), to
        detect ranks that planned from different masks before their traffic mismatches."""
        if getattr(self, "_fingerprint", None) is None:
            h = hashlib.sha256(repr((self.seqlen, self.cp_size, self.chunk_size, self.nodes, self.causal,
                                     [(r.relay, r.source, r.num_chunks_sent) for r in self.rounds])).encode())
            for r in self.rounds:  # the routing, without building its Transfer objects
                for a in r.triples():
                    h.update(a.tobytes())
            h.update(self.owner.tobytes())
            h.update(np.packbits(self.need).tobytes())
            self._fingerprint = int.from_bytes(h.digest()[:8], "little") >> 1
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"CPPlan(seqlen={self.seqlen}, cp_size={self.cp_size}, balance={self.balance!r}, "
                f"chunk_size={self.chunk_size}, nodes={self.nodes}, imbalance={self.imbalance:.3f})")


def plan(startend_row_indices: Union[torch.Tensor, FlashMask, None], causal: Optional[bool] = None,
         cp_size: int = 1, *, balance: str = "sparse", chunk_size: Optional[int] = None,
         nodes: int = 1, seqlen: Optional[int] = None, tile_size: int = DEFAULT_TILE,
         comm_rounds: Optional[int] = None, work: str = "tiles",
         cost: Optional[PlacementCost] = None, tolerance: float = DEFAULT_TOLERANCE) -> CPPlan:
    """Plan context parallelism over ``cp_size`` ranks for one global mask.

    Args:
        startend_row_indices: the global ``[B, Hm, S, C]`` mask, a FlashMask, or ``None``
            (full / plain causal; then ``seqlen`` is required).
        causal: the mask's causal flag (taken from a FlashMask when omitted).
        cp_size: number of ranks.
        balance: ``"contiguous"``, ``"dual_chunk"``, ``"ptrr"`` (PyTorch's processing-time
            round-robin of tile-sized chunks: balanced work, but every rank needs nearly all K/V)
            or ``"sparse"`` (equal tokens, balanced work and small per-rank remote K/V:
            :mod:`flashmask3.distributed.placement`).
        chunk_size: tokens per chunk; must divide the sequence into a multiple of ``cp_size``
            chunks (``2 * cp_size`` for dual_chunk). Default: S/P, S/2P, or up to 16 chunks per
            rank for sparse (128-token aligned when the length allows), one tile for ptrr. A length that cannot be
            split evenly is refused with the lengths that work.
        nodes: number of nodes; > 1 selects hierarchical routing (must divide ``cp_size``;
            group rank r is assumed to live on node ``r // (cp_size // nodes)``).
        tile_size: tile edge of the work model.
        work: ``"tiles"`` (live tiles: what the kernels pay for) or ``"pairs"`` (exact unmasked
            pairs).
        comm_rounds: number of point-to-point rounds of the flat routing (default
            ``min(cp_size - 1, 3)``); more rounds overlap finer but launch more kernels.
        cost: the time model ``sparse`` places by (:class:`PlacementCost`; default: H200-class
            compute, NVLink inside nodes of 8 GPUs, InfiniBand across).
        tolerance: ``sparse`` stops rebalancing once the heaviest rank's work is within this
            fraction of the mean (default 0.04). 0.01 balances tighter for a little more K/V
            (``benchmarks/results/balance.md``); the scale model predicts it faster with >= 4K
            tokens a rank and slower with 1-2K (docs/context-parallel.md, "Placement").
    """
    if causal is None and not isinstance(startend_row_indices, FlashMask):
        raise TypeError("causal is required unless startend_row_indices is a FlashMask")
    cols, causal, s = _mask_args(startend_row_indices, causal, seqlen)
    cp_size = _check_int("cp_size", cp_size)
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    nodes = _check_int("nodes", nodes)
    if cp_size % nodes:
        raise ValueError(f"nodes={nodes} must divide cp_size={cp_size}")
    tile = _check_int("tile_size", tile_size)
    if work not in WORK_MODELS:
        raise ValueError(f"work must be one of {WORK_MODELS}, got {work!r}")
    if cost is not None and not isinstance(cost, PlacementCost):
        raise TypeError(f"cost must be a PlacementCost, got {type(cost).__name__}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    if chunk_size is None:
        chunk_size = _default_chunk_size(s, cp_size, balance, tile)
        if chunk_size == 0:
            raise ValueError(f"cannot split a sequence of {s} tokens evenly over cp_size={cp_size} "
                             f"ranks: {_lengths_that_work(s, cp_size, balance, tile)}")
    chunk_size = _check_int("chunk_size", chunk_size)
    _check_chunking(s, cp_size, balance, chunk_size)
    if comm_rounds is None:
        comm_rounds = max(1, min(cp_size - 1, 3))
    comm_rounds = min(_check_int("comm_rounds", comm_rounds), max(cp_size - 1, 1))
    return CPPlan(cols, causal, s, cp_size, balance, chunk_size, nodes, tile, comm_rounds, work, cost,
                  tolerance=float(tolerance))
