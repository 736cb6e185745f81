"""What the scale model reads from a context-parallel plan, through its public API only.

:class:`PlanView` holds, per rank, its stages (``plan.stages(r)``), the live full/partial tiles
of each stage (from the global mask's 128x128 tile classes, summed over the (query chunk, key
chunk) blocks of the stage), its work (``plan.works``) and the plan's rounds (``plan.rounds``:
``Transfer(src, dst, chunks)``, ``Round.relay``, ``Round.source``). Nothing about placement or
routing is re-derived here, so a change of ``plan()`` shows up in the model as it is.

Plans at long context and high cp are slow to build on the current planner; views are cached
on disk (``~/.cache/flashmask3-scale-model``) keyed by the mask, cp, balance and nodes.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .calibrate import TILE, TileCounts

CACHE_DIR = os.environ.get("FLASHMASK3_SCALE_MODEL_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "flashmask3-scale-model"))
CACHE_VERSION = 3


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


def chunk_tile_matrix(startend_row_indices, causal: bool, seqlen: int, chunk_size: int):
    """``(full, partial)`` int64 ``[n, n]``: live tiles of (query chunk, key chunk) blocks."""
    from flashmask3.masks import PARTIAL, UNMASKED, classify_tiles

    if chunk_size % TILE:
        raise ValueError(f"chunk_size={chunk_size} must be a multiple of {TILE} for the tile model")
    cls = classify_tiles(startend_row_indices, causal, seqlen, seqlen, TILE, TILE)
    n, per = seqlen // chunk_size, chunk_size // TILE

    def blocks(sel):
        import torch

        x = sel.flatten(0, 1).sum(0, dtype=torch.int64)
        return x.view(n, per, n, per).sum((1, 3)).numpy().astype(np.int64)

    full = blocks((cls == UNMASKED).to("cpu"))
    part = blocks((cls == PARTIAL).to("cpu"))
    return full, part


def view_plan(p, startend_row_indices, causal: bool, plan_seconds: float = 0.0) -> PlanView:
    """Read a :class:`~flashmask3.distributed.plan.CPPlan` into a :class:`PlanView`."""
    full, part = chunk_tile_matrix(startend_row_indices, causal, p.seqlen, p.chunk_size)
    owner = np.asarray(p.owner)
    rows = p.seqlen // p.cp_size
    stages, stage_chunks, sorted_tiles = [], [], []
    for r in range(p.cp_size):
        q = np.flatnonzero(owner == r)
        per_rank, counts, all_keys = [], [], []
        for st in p.stages(r):
            k = np.asarray(st, dtype=np.int64)
            all_keys.append(k)
            f = int(full[np.ix_(q, k)].sum()) if len(k) else 0
            pa = int(part[np.ix_(q, k)].sum()) if len(k) else 0
            per_rank.append(TileCounts(f, pa, rows, len(k) * p.chunk_size))
            counts.append(len(k))
        k = np.concatenate(all_keys) if all_keys else np.zeros(0, np.int64)
        sorted_tiles.append(TileCounts(int(full[np.ix_(q, k)].sum()), int(part[np.ix_(q, k)].sum()),
                                       rows, len(k) * p.chunk_size))
        stages.append(per_rank)
        stage_chunks.append(counts)
    rounds = [RoundView(tuple((t.src, t.dst, len(t.chunks)) for t in rnd.transfers), bool(rnd.relay),
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


def _key(doc_lens, causal, seqlen, cp, balance, nodes) -> str:
    h = hashlib.sha256(repr((CACHE_VERSION, list(doc_lens) if doc_lens is not None else None,
                             causal, seqlen, cp, balance, nodes, _plan_code_digest())).encode())
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


def document_plan_view(doc_lens: Sequence[int], cp: int, balance: str, nodes: int = 1,
                       cache: bool = True) -> PlanView:
    """Plan a causal document mask of ``doc_lens`` and view it (cached on disk)."""
    import time

    import flashmask3.masks as M
    from flashmask3.distributed import plan

    seqlen = int(sum(doc_lens))
    key = _key(doc_lens, True, seqlen, cp, balance, nodes)
    path = os.path.join(CACHE_DIR, key + ".pkl")
    if cache and os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    mask = M.causal_document_mask(list(doc_lens))
    t0 = time.perf_counter()
    p = plan(mask, None, cp, balance=balance, nodes=nodes)
    secs = time.perf_counter() - t0
    v = view_plan(p, mask.startend_row_indices, True, secs)
    if cache:
        os.makedirs(CACHE_DIR, exist_ok=True)
        tmp = path + f".{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(v, f)
        os.replace(tmp, path)
    return v


def mask_sparsity(doc_lens: Sequence[int]) -> float:
    """Sparsity of a causal document mask: 1 - unmasked pairs / S^2 (the mask layer's rule)."""
    s = float(sum(doc_lens))
    pairs = sum(n * (n + 1) / 2 for n in doc_lens)
    return 1.0 - pairs / (s * s)


__all__ = ["PlanView", "RoundView", "view_plan", "document_plan_view", "chunk_tile_matrix",
           "mask_sparsity"]
