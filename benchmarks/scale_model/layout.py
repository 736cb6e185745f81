"""What the scale model reads from a context-parallel plan, through its public API only.

:class:`PlanView` holds, per rank, its stages (``plan.stages(r)``), the live full/partial tiles
of each stage (from the global mask's 128x128 tile classes, summed over the (query chunk, key
chunk) blocks of the stage) and of each kernel program of the stage's call (per query block
forward, per key block backward: the greedy schedule of ``calibrate``), its work (``plan.works``) and the plan's rounds (``plan.rounds``:
``Transfer(src, dst, chunks)``, ``Round.relay``, ``Round.source``). Nothing about placement or
routing is re-derived here, so a change of ``plan()`` shows up in the model as it is.

Plans at long context and high cp are slow to build on the current planner; views are cached
on disk (``~/.cache/flashmask3-scale-model``) keyed by the mask, cp, balance and nodes.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .calibrate import BWD_TILE, FWD_TILE, TILE, ProgramWork, TileCounts

CACHE_DIR = os.environ.get("FLASHMASK3_SCALE_MODEL_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "flashmask3-scale-model"))
CACHE_VERSION = 4  # 4: per-program tiles (session 19)


@dataclass(frozen=True)
class RoundView:
    """One routing round: ``transfers`` = ((src, dst, n_chunks), ...); ``source`` for relays."""

    transfers: tuple[tuple[int, int, int], ...]
    relay: bool
    source: Optional[int]


@dataclass
class PlanView:
    cp_size: int
    nodes: int
    seqlen: int
    chunk_size: int
    balance: str
    imbalance: float
    works: list[int]
    stages: list[list[TileCounts]]          # [rank][stage] (q_rows = tokens per rank)
    stage_chunks: list[list[int]]           # [rank][stage] number of chunks in the stage
    sorted_tiles: list[TileCounts]          # [rank] all needed keys in one call (allgather)
    rounds: list[RoundView]
    plan_seconds: float

    @property
    def local_seqlen(self) -> int:
        return self.seqlen // self.cp_size


def _tile_maps(startend_row_indices, causal: bool, seqlen: int, tile: tuple[int, int]) -> tuple:
    """``(full, partial)`` maps ``[query blocks, key blocks]`` of the mask's ``tile``-sized tiles
    (bool, or int32 counts summed over batch and mask heads): the mask layer's tile rule. The
    last few masks' maps are kept in memory: the cp sweep views one mask at five cp sizes and
    four balances, whose chunks differ but whose tiles do not (the cold sweep classified the
    same 512K masks ~12 times each, ~10 s)."""
    from flashmask3.masks import PARTIAL, UNMASKED, classify_tiles

    cols = startend_row_indices
    digest = None if cols is None else hashlib.blake2b(cols.to("cpu").contiguous().numpy().tobytes(),
                                                       digest_size=16).digest()
    key = (digest, None if cols is None else tuple(cols.shape), causal, seqlen, tuple(tile))
    got = _TILE_MAPS.get(key)
    if got is None:
        classes = classify_tiles(cols, causal, seqlen, seqlen, *tile).to("cpu").flatten(0, 1).numpy()
        got = []
        for c in (UNMASKED, PARTIAL):
            x = classes == c
            got.append(x.sum(0, dtype=np.int32) if x.shape[0] > 1 else x[0])
        got = _TILE_MAPS[key] = tuple(got)
        while len(_TILE_MAPS) > _TILE_MAPS_KEPT:
            _TILE_MAPS.popitem(last=False)
    else:
        _TILE_MAPS.move_to_end(key)
    return got


_TILE_MAPS: "OrderedDict[tuple, tuple]" = OrderedDict()
_TILE_MAPS_KEPT = 6  # two tile shapes of the sweep's three masks per sequence length (~0.3 GB at 512K)


def _class_counts(maps: tuple, per: int, n: int, over_rows: bool):
    """(full, partial) int32 counts of :func:`_tile_maps`' ``[rows, cols]`` maps, summed over
    groups of ``per`` blocks along the rows (``over_rows``: ``[n, cols]``) or the columns
    (``[rows, n]``), ``n`` chunks. In numpy, int32 sums and no sum at all for one block a chunk:
    the cold sweep spent ~10 s here converting 16M-tile maps to int64, and ~5 s more while the
    row sums were stored transposed."""
    out = []
    for x in maps:
        if over_rows:  # sum query blocks per query chunk: [n, per, cols] -> [n, cols]
            x = x.reshape(n, per, -1).sum(1, dtype=np.int32) if per > 1 else x
        else:  # sum key blocks per key chunk: [rows, n, per] -> [rows, n]
            x = x.reshape(-1, n, per).sum(2, dtype=np.int32) if per > 1 else x
        out.append(np.ascontiguousarray(x, dtype=np.int32))
    return out


def program_chunk_matrices(startend_row_indices, causal: bool, seqlen: int, chunk_size: int) -> dict:
    """Per-program live tiles against every chunk, the mask layer's tile rule at the kernels'
    tiles (:data:`~.calibrate.FWD_TILE`, :data:`~.calibrate.BWD_TILE`) on the global mask:
    ``fwd_full`` / ``fwd_partial`` ``[query blocks, chunks]`` (a forward program's tiles against
    each key chunk), ``bwd_full`` / ``bwd_partial`` ``[chunks, key blocks]`` (each backward
    program's tiles against a query chunk: a rank's query chunks are rows to add)."""
    if chunk_size % TILE:
        raise ValueError(f"chunk_size={chunk_size} must be a multiple of {TILE} for the tile model")
    n = seqlen // chunk_size
    fq, fk = FWD_TILE
    bq, bk = BWD_TILE
    ff, fp = _class_counts(_tile_maps(startend_row_indices, causal, seqlen, FWD_TILE), chunk_size // fk, n,
                           over_rows=False)
    bf, bp = _class_counts(_tile_maps(startend_row_indices, causal, seqlen, BWD_TILE), chunk_size // bq, n,
                           over_rows=True)
    return {"fwd_full": ff, "fwd_partial": fp, "bwd_full": bf, "bwd_partial": bp,
            "per_q": chunk_size // fq, "per_k": chunk_size // bk}


def chunk_tile_matrix(startend_row_indices, causal: bool, seqlen: int, chunk_size: int):
    """``(full, partial)`` int64 ``[n, n]``: live 128x128 tiles of (query chunk, key chunk) blocks."""
    m = program_chunk_matrices(startend_row_indices, causal, seqlen, chunk_size)
    return _chunk_totals(m, seqlen // chunk_size)


def _chunk_totals(m: dict, n: int):
    per = m["per_q"]
    return tuple(m[k].reshape(n, per, n).sum(1) for k in ("fwd_full", "fwd_partial"))


def _blocks(chunks: np.ndarray, per: int) -> np.ndarray:
    """The block indices of ``chunks`` in order (``per`` blocks a chunk)."""
    return (np.asarray(chunks, dtype=np.int64)[:, None] * per + np.arange(per)).ravel()


def rank_call_work(m: dict, q_chunks: np.ndarray):
    """``work(k_chunks)``: the :class:`ProgramWork` of one call of a rank whose query chunks
    are ``q_chunks`` (local row order) against ``k_chunks`` (local key order). The rank's rows
    of the forward maps and its backward sums over its query chunks (every key block's tiles
    against them) are taken once for all of its calls."""
    q_chunks = np.asarray(q_chunks, dtype=np.int64)
    qb = _blocks(q_chunks, m["per_q"])
    fwd = [m[f"fwd_{c}"][qb] for c in ("full", "partial")]  # [the rank's query blocks, chunks]
    bwd = [m[f"bwd_{c}"][q_chunks].sum(0, dtype=np.int32) for c in ("full", "partial")]  # [key blocks]

    def work(k_chunks: np.ndarray) -> ProgramWork:
        k_chunks = np.asarray(k_chunks, dtype=np.int64)
        kb = _blocks(k_chunks, m["per_k"])
        return ProgramWork(*(f[:, k_chunks].sum(1).astype(np.int32) for f in fwd), *(b[kb] for b in bwd))

    return work


def view_plan(p, startend_row_indices, causal: bool, plan_seconds: float = 0.0) -> PlanView:
    """Read a :class:`~flashmask3.distributed.plan.CPPlan` into a :class:`PlanView`: per rank
    and stage the live tiles, and the tiles of every kernel program (:func:`rank_call_work`)."""
    m = program_chunk_matrices(startend_row_indices, causal, p.seqlen, p.chunk_size)
    owner = np.asarray(p.owner)
    rows = p.seqlen // p.cp_size

    def tiles(work_of, k: np.ndarray) -> TileCounts:
        work = work_of(k) if len(k) else None
        full, partial = work.totals() if work is not None else (0, 0)
        return TileCounts(full, partial, rows, len(k) * p.chunk_size, work=work)

    stages, stage_chunks, sorted_tiles = [], [], []
    for r in range(p.cp_size):
        work_of = rank_call_work(m, np.flatnonzero(owner == r))
        keys = [np.asarray(st, dtype=np.int64) for st in p.stages(r)]
        stages.append([tiles(work_of, k) for k in keys])
        stage_chunks.append([len(k) for k in keys])
        sorted_tiles.append(tiles(work_of, np.sort(np.concatenate(keys)) if keys else np.zeros(0, np.int64)))
    rounds = [RoundView(tuple(zip(*(a.tolist() for a in rnd.transfer_sizes()))), bool(rnd.relay),
                        _source(p.rounds, i)) for i, rnd in enumerate(p.rounds)]
    return PlanView(p.cp_size, p.nodes, p.seqlen, p.chunk_size, p.balance, float(p.imbalance),
                    [int(w) for w in p.works], stages, stage_chunks, sorted_tiles, rounds, plan_seconds)


def _source(rounds, i: int) -> Optional[int]:
    """A relay round's source round: ``Round.source`` where the plan has it, else the previous
    round (the rule of the planner on main, whose relay forwards what arrived just before)."""
    rnd = rounds[i]
    if not rnd.relay:
        return None
    src = getattr(rnd, "source", None)
    return i - 1 if src is None else int(src)


def _key(doc_lens, causal, seqlen, cp, balance, nodes, tolerance=None) -> str:
    h = hashlib.sha256(repr((CACHE_VERSION, list(doc_lens) if doc_lens is not None else None,
                             causal, seqlen, cp, balance, nodes, plan_tolerance(tolerance),
                             _plan_code_digest())).encode())
    return h.hexdigest()[:24]


_DIGEST: Optional[str] = None


def _plan_code_digest() -> str:
    """Digest of the planner's source, so a cached view never outlives a placement change."""
    global _DIGEST
    if _DIGEST is None:
        import flashmask3.distributed as d

        h = hashlib.sha256()
        base = os.path.dirname(d.__file__)
        for name in sorted(os.listdir(base)):
            if name.endswith(".py") and name in ("plan.py", "placement.py", "summaries.py", "local_mask.py"):
                with open(os.path.join(base, name), "rb") as f:
                    h.update(f.read())
        _DIGEST = h.hexdigest()[:16]
    return _DIGEST


_PLANS: "OrderedDict[tuple, tuple]" = OrderedDict()
_PLANS_KEPT = 1  # a layer's view and its recorded runtime ops plan the same mask back to back


#: The ``sparse`` placement tolerance of a measurement file that records none: every file
#: measured before session 37 was planned with 0.04 (the library's default then and now).
LEGACY_TOLERANCE = 0.04

#: The ``plan(tolerance=...)`` of the predictions' plans (None: the library default); the CLI's
#: ``--tolerance`` sets it.
PLAN_TOLERANCE: Optional[float] = None


def plan_tolerance(tolerance: Optional[float] = None) -> float:
    """The ``plan(tolerance=...)`` a plan of this module is built with: ``tolerance``, else
    :data:`PLAN_TOLERANCE`, else the library default."""
    from flashmask3.distributed.placement import DEFAULT_TOLERANCE

    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE if PLAN_TOLERANCE is None else PLAN_TOLERANCE
    return float(tolerance)


def file_tolerance(args: Optional[dict]) -> float:
    """The ``plan(tolerance=...)`` a measurement file's plans were built with (its ``args``)."""
    return float((args or {}).get("tolerance", LEGACY_TOLERANCE))


def document_plan(doc_lens: Sequence[int], cp: int, balance: str, nodes: int = 1,
                  tolerance: Optional[float] = None):
    """``(plan, planning seconds)`` of a causal document mask of ``doc_lens``; the last
    :data:`_PLANS_KEPT` are kept in memory, so that the plan view and the runtime-op recording of
    one layer (runtime_ops.rank_device_work) plan it once. ``tolerance``: ``plan()``'s (None:
    the library default; a measured file's plans are rebuilt with :func:`file_tolerance`)."""
    import time

    import flashmask3.masks as M
    from flashmask3.distributed import plan

    tol = plan_tolerance(tolerance)
    key = (tuple(int(n) for n in doc_lens), int(cp), balance, int(nodes), tol)
    got = _PLANS.get(key)
    if got is None:
        mask = M.causal_document_mask(list(doc_lens))
        t0 = time.perf_counter()
        got = _PLANS[key] = (plan(mask, None, cp, balance=balance, nodes=nodes, tolerance=tol),
                             time.perf_counter() - t0)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return got


def document_plan_view(doc_lens: Sequence[int], cp: int, balance: str, nodes: int = 1,
                       cache: bool = True, tolerance: Optional[float] = None) -> PlanView:
    """Plan a causal document mask of ``doc_lens`` and view it (cached on disk)."""

    def build() -> PlanView:
        p, seconds = document_plan(doc_lens, cp, balance, nodes, tolerance)
        return view_plan(p, p.startend_row_indices, True, seconds)

    key = _key(doc_lens, True, int(sum(doc_lens)), cp, balance, nodes, tolerance)
    return cached_pickle(key + ".pkl", build, cache)


def cached_pickle(name: str, build, cache: bool = True):
    """``build()``, kept as ``name`` in :data:`CACHE_DIR` (written atomically) and read back
    from there by later calls; ``cache=False`` builds and keeps nothing."""
    path = os.path.join(CACHE_DIR, name)
    if cache and os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    value = build()
    if cache:
        os.makedirs(CACHE_DIR, exist_ok=True)
        tmp = path + f".{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(value, f)
        os.replace(tmp, path)
    return value


def mask_sparsity(doc_lens: Sequence[int]) -> float:
    """Sparsity of a causal document mask: 1 - unmasked pairs / S^2 (the mask layer's rule)."""
    s = float(sum(doc_lens))
    pairs = sum(n * (n + 1) / 2 for n in doc_lens)
    return 1.0 - pairs / (s * s)


__all__ = ["PlanView", "RoundView", "view_plan", "document_plan_view", "file_tolerance", "plan_tolerance",
           "LEGACY_TOLERANCE",
           "chunk_tile_matrix", "program_chunk_matrices", "rank_call_work", "mask_sparsity"]
