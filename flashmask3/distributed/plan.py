"""Context-parallel planning: who owns which tokens, what each rank computes and fetches.

A :class:`CPPlan` is computed from the *global* mask, identically and deterministically on
every rank (integer work counts, stable sorts, no randomness), so that no communication is
needed to agree on it. It answers everything the communication layer needs before any data
moves (DESIGN.md §3):

* ownership: the sequence is cut into chunks of ``chunk_size`` tokens and every rank owns the
  same number of chunks (``contiguous``, ``dual_chunk`` or work-balanced ``sparse``);
* work: per chunk, the number of live (not SKIP) tiles of its query rows, summed over batch and
  mask heads, from the mask layer's tile classification;
* liveness: which KV chunks are live for which query chunks, hence ``needed_chunks(rank)``;
* routing: the point-to-point rounds that bring each rank its needed chunks (flat, or
  hierarchical over ``nodes`` nodes: inter-node chunks once per node, then fanned out);
* rank-local masks (:mod:`flashmask3.distributed.local_mask`) over the rank's rows and its key
  axis in arrival order.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ..masks import SKIP, FlashMask, classify_tiles, unmasked_pairs, validate_startend_row_indices
from .local_mask import rank_local_columns

BALANCES = ("contiguous", "dual_chunk", "sparse")
WORK_MODELS = ("tiles", "pairs")

#: Tile edge of the work model (the kernels' query/key block size on Hopper).
DEFAULT_TILE = 128

#: Largest tile grid (over batch and mask heads) the work model will classify.
_MAX_TILES = 1 << 28

#: Chunks per rank tried (largest first) when ``balance="sparse"`` picks its own chunk size.
_SPARSE_CHUNKS_PER_RANK = (16, 12, 8, 6, 4, 3, 2, 1)


@dataclass(frozen=True)
class Transfer:
    """``src`` sends its copies of KV ``chunks`` (sorted chunk ids) to ``dst``."""

    src: int
    dst: int
    chunks: tuple[int, ...]


@dataclass(frozen=True)
class Round:
    """One batch of point-to-point transfers, the same on every rank's copy of the plan.

    ``relay``: the round forwards chunks received in the previous round, so a rank may only
    start it after that round has arrived.
    """

    transfers: tuple[Transfer, ...]
    relay: bool = False

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def recvs(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank]


# -- argument handling ------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _mask_args(startend_row_indices, causal, seqlen):
    """Normalise the mask argument to ``(cpu int32 tensor | None, causal, seqlen)``."""
    if isinstance(startend_row_indices, FlashMask):
        mask = startend_row_indices
        if causal is not None and bool(causal) != mask.causal:
            raise ValueError(f"causal={causal} conflicts with the FlashMask (causal={mask.causal})")
        if mask.seqlen_q != mask.seqlen_k:
            raise ValueError("context parallelism needs a self-attention mask (seqlen_q == seqlen_k)")
        startend_row_indices, causal = mask.startend_row_indices, mask.causal
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
    validate_startend_row_indices(startend_row_indices, causal=causal,
                                  batch_size=startend_row_indices.shape[0], seqlen_q=s, seqlen_k=s)
    # Kept on its device: tile classification and local masks run there (GPU when training).
    return startend_row_indices.detach().contiguous(), causal, s


def _default_chunk_size(seqlen: int, cp_size: int, balance: str, tile: int) -> int:
    """Chunk size when the caller gives none: P chunks, 2P chunks, or many for ``sparse``."""
    if balance == "contiguous":
        return seqlen // cp_size if seqlen % cp_size == 0 else 0
    if balance == "dual_chunk":
        return seqlen // (2 * cp_size) if seqlen % (2 * cp_size) == 0 else 0
    fits = [k for k in _SPARSE_CHUNKS_PER_RANK if seqlen % (k * cp_size) == 0]
    aligned = [k for k in fits if (seqlen // (k * cp_size)) % tile == 0]
    if aligned:
        return seqlen // (aligned[0] * cp_size)
    roomy = [k for k in fits if seqlen // (k * cp_size) >= 8]
    k = (roomy or fits or [0])[0]
    return seqlen // (k * cp_size) if k else 0


def _check_chunking(seqlen: int, cp_size: int, balance: str, chunk_size: int) -> int:
    """Validate that ``chunk_size`` splits the sequence evenly over the ranks; return #chunks."""
    if chunk_size <= 0 or seqlen % chunk_size != 0:
        raise ValueError(f"chunk_size={chunk_size} must divide the sequence length {seqlen} "
                         f"(cannot split {seqlen} tokens evenly over cp_size={cp_size} ranks)")
    n = seqlen // chunk_size
    per = 2 * cp_size if balance == "dual_chunk" else cp_size
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
    (live for some batch row or head). Uses the mask layer's tile rule; a SKIP tile is fully
    masked, so a key chunk that is not live for a query chunk can be dropped exactly.
    """
    block = math.gcd(chunk_size, tile)
    n, per = seqlen // chunk_size, chunk_size // block
    heads = 1 if startend_row_indices is None else startend_row_indices.shape[0] * startend_row_indices.shape[1]
    if heads * (seqlen // block) ** 2 > _MAX_TILES:
        raise ValueError(f"chunk_size={chunk_size} needs {seqlen // block}^2 work tiles per head for "
                         f"seqlen={seqlen}; use a chunk_size that is a multiple of {tile}")
    cls = classify_tiles(startend_row_indices, causal, seqlen, seqlen, block, block)
    alive = (cls != SKIP).flatten(0, 1)  # [B*Hm, nq, nk]
    work = alive.sum(dim=(0, 2), dtype=torch.int64).view(n, per).sum(1)
    live = alive.any(0).view(n, per, n, per).any(3).any(1)
    return work.cpu().numpy(), live.cpu().numpy()


def chunk_pairs(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int,
                chunk_size: int, group: int = 16) -> np.ndarray:
    """Exact unmasked (query, key) pairs of each query chunk, summed over batch and mask heads.

    Each chunk's rows get their own local mask (all keys) and the mask layer counts its pairs;
    ``group`` chunks are counted per call (stacked on the batch dimension).
    """
    n = seqlen // chunk_size
    device = startend_row_indices.device if startend_row_indices is not None else torch.device("cpu")
    keys = torch.arange(seqlen, device=device)
    out = []
    for start in range(0, n, group):
        ids = range(start, min(n, start + group))
        cols = torch.cat([rank_local_columns(startend_row_indices, causal,
                                             torch.arange(c * chunk_size, (c + 1) * chunk_size), keys)
                          for c in ids])
        per_head = unmasked_pairs(cols, False, chunk_size, per_head=True)  # [len(ids) * B, Hm]
        out.append(per_head.view(len(ids), -1).sum(1))
    return torch.cat(out).cpu().numpy()


# -- ownership strategies -------------------------------------------------------------------------


def _contiguous(n: int, cp_size: int) -> np.ndarray:
    return np.repeat(np.arange(cp_size), n // cp_size)


def _dual_chunk(n: int, cp_size: int) -> np.ndarray:
    """2P equal segments; rank r owns segments r and 2P-1-r (the standard causal baseline)."""
    seg = np.repeat(np.arange(2 * cp_size), n // (2 * cp_size))
    return np.minimum(seg, 2 * cp_size - 1 - seg)


def _lpt(work: np.ndarray, cp_size: int) -> np.ndarray:
    """Longest-processing-time greedy: heaviest chunk to the lightest rank that has room."""
    per_rank = len(work) // cp_size
    owner = np.empty(len(work), dtype=np.int64)
    count = [0] * cp_size
    heap = [(0, r) for r in range(cp_size)]
    for c in np.argsort(-work, kind="stable"):
        load, r = heapq.heappop(heap)
        owner[c] = r
        count[r] += 1
        if count[r] < per_rank:
            heapq.heappush(heap, (load + int(work[c]), r))
    return owner


def _improve(work: np.ndarray, owner: np.ndarray, cp_size: int, max_swaps: int) -> np.ndarray:
    """Pairwise exchanges between the heaviest rank and the others until none lowers its load.

    Each step takes the swap (a chunk of the heaviest rank for a lighter chunk of another rank)
    that minimises the larger of the two new loads, if that is below the heaviest load.
    """
    members = np.stack([np.flatnonzero(owner == r) for r in range(cp_size)])  # [P, k]
    for _ in range(max_swaps):
        w = work[members]  # [P, k]
        loads = w.sum(1)
        h = int(np.argmax(loads))
        d = w[h][None, :, None] - w[:, None, :]  # load moved from h to o by swapping a <-> b
        gap = (loads[h] - loads)[:, None, None]
        ok = (d > 0) & (d < gap)
        ok[h] = False
        if not ok.any():
            break
        new_max = np.maximum(loads[h] - d, loads[:, None, None] + d)
        o, a, b = np.unravel_index(np.argmin(np.where(ok, new_max, np.iinfo(np.int64).max)),
                                   ok.shape)
        members[h, a], members[o, b] = members[o, b], members[h, a]
    out = np.empty_like(owner)
    for r in range(cp_size):
        out[members[r]] = r
    return out


def _local_lpt(work: np.ndarray, live: np.ndarray, cp_size: int) -> np.ndarray:
    """LPT with locality: the heaviest chunk goes, among the ranks with room that stay within
    the mean load, to the one that already needs most of the chunk's live KV chunks (ties: the
    lightest); when no rank stays within the mean, to the lightest rank with room (plain LPT).

    Chunks of one document then gather on few ranks, so fewer KV chunks must travel.
    """
    n = len(work)
    per_rank = n // cp_size
    owner = np.empty(n, dtype=np.int64)
    load = np.zeros(cp_size, dtype=np.int64)
    count = np.zeros(cp_size, dtype=np.int64)
    need = np.zeros((cp_size, n), dtype=bool)
    total = int(work.sum())
    for c in np.argsort(-work, kind="stable"):
        room = count < per_rank
        fits = room & ((load + work[c]) * cp_size <= total)
        if fits.any():
            affinity = np.where(fits, need[:, live[c]].sum(1), -1)
            best = np.flatnonzero(affinity == affinity.max())
        else:
            best = np.flatnonzero(room)
        r = int(best[np.argmin(load[best])])
        owner[c] = r
        load[r] += work[c]
        count[r] += 1
        need[r] |= live[c]
    return owner


def _fetches(owner: np.ndarray, live: np.ndarray, cp_size: int) -> int:
    """KV chunks that must travel: per rank, live chunks it does not own."""
    total = 0
    for r in range(cp_size):
        own = owner == r
        total += int((live[own].any(0) & ~own).sum())
    return total


def _max_load(work: np.ndarray, owner: np.ndarray, cp_size: int) -> int:
    return int(np.bincount(owner, weights=work, minlength=cp_size).max())


def _sparse(work: np.ndarray, live: np.ndarray, cp_size: int, locality: bool) -> np.ndarray:
    """LPT + pairwise improvement (DESIGN.md §3). With ``locality``, the locality-aware greedy
    is tried too and kept when it balances as well (max load within 0.5%) and moves fewer
    KV chunks."""
    swaps = 4 * len(work) + 100
    owner = _improve(work, _lpt(work, cp_size), cp_size, max_swaps=swaps)
    if not locality or cp_size == 1:
        return owner
    local = _improve(work, _local_lpt(work, live, cp_size), cp_size, max_swaps=swaps)
    balanced = _max_load(work, local, cp_size) * 200 <= _max_load(work, owner, cp_size) * 201
    if balanced and _fetches(local, live, cp_size) < _fetches(owner, live, cp_size):
        return local
    return owner


# -- routing ----------------------------------------------------------------------------------------


def _flat_rounds(owned: list[np.ndarray], need: np.ndarray, n_rounds: int) -> list[Round]:
    """Direct transfers grouped by ring distance d (rank r sends to r+d), ``n_rounds`` groups.

    Grouping by distance gives every rank the same sequence of rounds, each round holding at
    most one message per (src, dst) pair, so batches match on both ends.
    """
    p = len(owned)
    dists = [d for d in range(1, p)]
    groups = [g.tolist() for g in np.array_split(np.array(dists, dtype=np.int64), n_rounds) if len(g)]
    rounds = []
    for group in groups:
        transfers = []
        for src in range(p):
            for d in group:
                dst = (src + d) % p
                chunks = tuple(int(c) for c in owned[src] if need[dst, c])
                if chunks:
                    transfers.append(Transfer(src, dst, chunks))
        rounds.append(Round(tuple(sorted(transfers, key=lambda t: (t.src, t.dst)))))
    return rounds


def _hierarchical_rounds(owned: list[np.ndarray], need: np.ndarray, nodes: int) -> list[Round]:
    """Two rounds: (0) intra-node direct + one inter-node copy per node to the owner's
    same-slot peer; (1, relay) that peer fans the chunk out to the ranks of its node."""
    p = len(owned)
    g = p // nodes
    first: dict[tuple[int, int], list[int]] = {}
    second: dict[tuple[int, int], list[int]] = {}
    for src in range(p):
        node, slot = divmod(src, g)
        for c in owned[src]:
            c = int(c)
            for dst in range(node * g, (node + 1) * g):
                if dst != src and need[dst, c]:
                    first.setdefault((src, dst), []).append(c)
            for other in range(nodes):
                if other == node:
                    continue
                ranks = [r for r in range(other * g, (other + 1) * g) if need[r, c]]
                if not ranks:
                    continue
                relay = other * g + slot
                first.setdefault((src, relay), []).append(c)
                for dst in ranks:
                    if dst != relay:
                        second.setdefault((relay, dst), []).append(c)

    def as_round(d, relay):
        return Round(tuple(Transfer(s, t, tuple(sorted(c))) for (s, t), c in sorted(d.items())), relay)

    return [as_round(first, False), as_round(second, True)]


# -- the plan ---------------------------------------------------------------------------------------


class CPPlan:
    """Everything about one context-parallel layout of one global mask (see module doc).

    Built by :func:`plan`; immutable; identical on every rank. Rank numbers are ranks of the
    CP process group (``0 .. cp_size-1``).
    """

    def __init__(self, startend_row_indices, causal, seqlen, cp_size, balance, chunk_size, nodes,
                 tile, comm_rounds, work_model="tiles", locality=True):
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
        if balance == "contiguous":
            owner = _contiguous(n, cp_size)
        elif balance == "dual_chunk":
            owner = _dual_chunk(n, cp_size)
        else:
            owner = _sparse(self.chunk_work, self.chunk_live, cp_size, locality)
        self.owner: np.ndarray = owner.astype(np.int64)
        self._owned = [np.flatnonzero(self.owner == r) for r in range(cp_size)]
        # need[r, c]: KV chunk c is live for some query row of rank r.
        self.need: np.ndarray = np.stack([self.chunk_live[o].any(0) for o in self._owned])
        if nodes > 1:
            self.rounds: list[Round] = _hierarchical_rounds(self._owned, self.need, nodes)
        else:
            self.rounds = _flat_rounds(self._owned, self.need, comm_rounds)
        self._local_masks: dict[tuple[int, str], FlashMask] = {}

    # -- ownership ---------------------------------------------------------------------------
    def _check_rank(self, rank) -> int:
        rank = _check_int("rank", rank, 0)
        if rank >= self.cp_size:
            raise ValueError(f"rank must be < cp_size={self.cp_size}, got {rank}")
        return rank

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Chunk ids owned by ``rank``, ascending."""
        return tuple(int(c) for c in self._owned[self._check_rank(rank)])

    def _token_index(self, chunks: Sequence[int]) -> torch.Tensor:
        if not len(chunks):
            return torch.zeros(0, dtype=torch.int64)
        base = torch.as_tensor(list(chunks), dtype=torch.int64).view(-1, 1) * self.chunk_size
        return (base + torch.arange(self.chunk_size)).flatten()

    def rows(self, rank: int) -> torch.Tensor:
        """Global token indices owned by ``rank`` (sorted, int64): its query rows, and the
        global position ids of its shard."""
        return self._token_index(self.chunks(rank))

    @property
    def local_seqlen(self) -> int:
        """Tokens per rank (the same on every rank)."""
        return self.seqlen // self.cp_size

    # -- work --------------------------------------------------------------------------------
    def work(self, rank: int) -> int:
        """Work of ``rank``'s query rows (summed over batch and mask heads): live tiles, or
        unmasked pairs with ``work="pairs"``."""
        return int(self.chunk_work[self._owned[self._check_rank(rank)]].sum())

    @property
    def works(self) -> list[int]:
        return [self.work(r) for r in range(self.cp_size)]

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank work (1.0 = perfect; 1.0 when there is no work)."""
        w = np.array(self.works, dtype=np.float64)
        return float(w.max() / w.mean()) if w.sum() > 0 else 1.0

    # -- keys and communication ------------------------------------------------------------
    def stages(self, rank: int) -> list[tuple[int, ...]]:
        """Needed KV chunks of ``rank`` grouped by arrival: [own chunks, round 0, round 1, ...],
        ascending inside each stage (so a document's chunks stay contiguous within a stage and
        the kernels' live key-block ranges stay tight).

        Chunks that a rank only relays (needed by another rank of its node) are not listed.
        """
        rank = self._check_rank(rank)
        out = [tuple(int(c) for c in self._owned[rank] if self.need[rank, c])]
        for rnd in self.rounds:
            got = sorted(c for t in rnd.recvs(rank) for c in t.chunks if self.need[rank, c])
            out.append(tuple(got))
        return out

    def needed_chunks(self, rank: int, order: str = "arrival") -> tuple[int, ...]:
        """KV chunks live for ``rank``'s rows: in arrival order (the local key axis of the
        overlapped path) or ``order="sorted"`` (global order: one call over all keys)."""
        chunks = tuple(c for stage in self.stages(rank) for c in stage)
        if order == "sorted":
            return tuple(sorted(chunks))
        if order != "arrival":
            raise ValueError(f"order must be 'arrival' or 'sorted', got {order!r}")
        return chunks

    def key_index(self, rank: int, order: str = "arrival") -> torch.Tensor:
        """Global key positions of ``rank``'s local key axis."""
        return self._token_index(self.needed_chunks(rank, order))

    def local_mask(self, rank: int, order: str = "arrival") -> FlashMask:
        """The rank-local mask: rows = ``rows(rank)``, keys = ``key_index(rank, order)``,
        non-causal.

        Every global bound v becomes ``#{i in rows : i < v}`` and the causal diagonal is folded
        into an upper interval, so the local problem equals the global one restricted to the
        rank's rows and needed keys (DESIGN.md §3). The key axis is the K/V arrival order by
        default; ``order="sorted"`` keeps global order, best when all keys are present at once
        (all-gather) since every document's keys are then contiguous.
        """
        rank = self._check_rank(rank)
        key = (rank, order)
        if key not in self._local_masks:
            cols = rank_local_columns(self.startend_row_indices, self.causal, self.rows(rank),
                                      self.key_index(rank, order))
            self._local_masks[key] = FlashMask(cols, False, self.local_seqlen)
        return self._local_masks[key]

    # -- accounting --------------------------------------------------------------------------
    def kv_tokens_moved(self, comm: str = "overlap") -> int:
        """K/V tokens received over all ranks in one forward pass (x2 with backward's refetch,
        x3 with the gradient return): ``allgather`` gives every rank every other rank's shard."""
        if comm == "allgather":
            return self.cp_size * (self.seqlen - self.local_seqlen)
        if comm != "overlap":
            raise ValueError(f"comm must be 'allgather' or 'overlap', got {comm!r}")
        return sum(len(t.chunks) for rnd in self.rounds for t in rnd.transfers) * self.chunk_size

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
        return sum(len(t.chunks) for rnd in self.rounds for t in rnd.transfers
                   if t.src // g != t.dst // g)

    # -- sharding ------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s rows of a token-dimension tensor (inputs, labels, global position ids)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = dim % x.dim() if x.dim() else 0
        if x.dim() == 0 or x.shape[dim] != self.seqlen:
            raise ValueError(f"x must have {self.seqlen} tokens along dim={dim}, got shape {tuple(x.shape)}")
        return x.index_select(dim, self.rows(rank).to(x.device))

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
            out.index_copy_(dim, self.rows(r).to(x.device), x)
        return out

    @property
    def fingerprint(self) -> int:
        """A 63-bit digest of everything ranks must agree on (layout, ownership, routing), to
        detect ranks that planned from different masks before their traffic mismatches."""
        import hashlib

        h = hashlib.sha256(repr((self.seqlen, self.cp_size, self.chunk_size, self.nodes, self.causal,
                                 [(t.src, t.dst, t.chunks) for r in self.rounds for t in r.transfers]
                                 )).encode())
        h.update(self.owner.tobytes())
        h.update(np.packbits(self.need).tobytes())
        return int.from_bytes(h.digest()[:8], "little") >> 1

    def __repr__(self) -> str:
        return (f"CPPlan(seqlen={self.seqlen}, cp_size={self.cp_size}, balance={self.balance!r}, "
                f"chunk_size={self.chunk_size}, nodes={self.nodes}, imbalance={self.imbalance:.3f})")


def plan(startend_row_indices: Union[torch.Tensor, FlashMask, None], causal: Optional[bool] = None,
         cp_size: int = 1, *, balance: str = "sparse", chunk_size: Optional[int] = None,
         nodes: int = 1, seqlen: Optional[int] = None, tile_size: int = DEFAULT_TILE,
         comm_rounds: Optional[int] = None, work: str = "tiles", locality: bool = True) -> CPPlan:
    """Plan context parallelism over ``cp_size`` ranks for one global mask.

    Args:
        startend_row_indices: the global ``[B, Hm, S, C]`` mask, a FlashMask, or ``None``
            (full / plain causal; then ``seqlen`` is required).
        causal: the mask's causal flag (taken from a FlashMask when omitted).
        cp_size: number of ranks.
        balance: ``"contiguous"``, ``"dual_chunk"`` or ``"sparse"`` (work-balanced).
        chunk_size: tokens per chunk; must divide the sequence into a multiple of ``cp_size``
            chunks (``2 * cp_size`` for dual_chunk). Default: S/P, S/2P, or ~16 chunks per rank
            for sparse.
        nodes: number of nodes; > 1 selects hierarchical routing (must divide ``cp_size``).
        tile_size: tile edge of the work model.
        work: ``"tiles"`` (live tiles: what the kernels pay for) or ``"pairs"`` (exact unmasked
            pairs, DESIGN.md's alternative).
        locality: ``sparse`` only: also try a locality-aware greedy and keep it when it is as
            balanced and moves fewer KV chunks (``False``: plain LPT + improvement).
        comm_rounds: number of point-to-point rounds of the flat routing (default
            ``min(cp_size - 1, 3)``); more rounds overlap finer but launch more kernels.
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
    if chunk_size is None:
        chunk_size = _default_chunk_size(s, cp_size, balance, tile)
        if chunk_size == 0:
            raise ValueError(f"cannot split a sequence of {s} tokens evenly over cp_size={cp_size} "
                             f"ranks with balance={balance!r}; pad the sequence or pass chunk_size")
    chunk_size = _check_int("chunk_size", chunk_size)
    _check_chunking(s, cp_size, balance, chunk_size)
    if comm_rounds is None:
        comm_rounds = max(1, min(cp_size - 1, 3))
    comm_rounds = min(_check_int("comm_rounds", comm_rounds), max(cp_size - 1, 1))
    if not isinstance(locality, bool):
        raise TypeError(f"locality must be a bool, got {type(locality).__name__}")
    return CPPlan(cols, causal, s, cp_size, balance, chunk_size, nodes, tile, comm_rounds, work,
                  locality)
