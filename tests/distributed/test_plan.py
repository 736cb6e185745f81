"""Planning (no process group needed): ownership, work balance, rank-local masks, routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashmask3.masks as M
from flashmask3.distributed import plan
from tests.helpers import LAYOUTS, named_masks, random_columns

MASKS = named_masks(96, batch_size=2, num_heads=2)


@pytest.mark.parametrize("cp,nodes", [(4, 1), (4, 2), (3, 1)])
def test_local_masks_every_mask_and_balance(cp, nodes):
    for name in sorted(MASKS):
        for balance in ("contiguous", "dual_chunk", "sparse"):
            _check_local_masks(MASKS[name], balance, cp, nodes)


def _check_local_masks(mask, balance, cp, nodes):
    """Dense local mask == dense global mask on (rows, needed keys); dropped keys are dead."""
    p = plan(mask, None, cp, balance=balance, chunk_size=4, nodes=nodes)
    dense = mask.to_dense()
    seen = torch.zeros(96, dtype=torch.long)
    for r in range(cp):
        rows = p.rows(r)
        seen[rows] += 1
        for order in ("arrival", "sorted"):
            keys = p.key_index(r, order)
            local = p.local_mask(r, order)
            assert local.causal is False
            want = dense[:, :, rows][:, :, :, keys]
            assert torch.equal(local.to_dense().expand_as(want), want)
            dropped = torch.ones(96, dtype=torch.bool)
            dropped[keys] = False
            assert not dense[:, :, rows][:, :, :, dropped].any()
        arrival = p.needed_chunks(r)
        assert len(set(arrival)) == len(arrival) and sorted(arrival) == list(p.needed_chunks(r, "sorted"))
        own = set(p.chunks(r))
        first = p.stages(r)[0]
        assert set(first) <= own and set(arrival[len(first):]).isdisjoint(own)  # own chunks first
    assert torch.equal(seen, torch.ones(96, dtype=torch.long))  # a partition of the tokens


def test_ownership_layouts_and_determinism():
    mask = M.causal_document_mask(M.random_document_lengths(4096, 300, seed=1))
    p = plan(mask, None, 4, balance="dual_chunk")
    assert p.chunk_size == 512
    assert [p.chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    c = plan(mask, None, 4, balance="contiguous")
    assert torch.equal(c.rows(1), torch.arange(1024, 2048))
    a = plan(mask, None, 4, balance="sparse", chunk_size=64)
    b = plan(mask.startend_row_indices.clone(), True, 4, balance="sparse", chunk_size=64)
    assert np.array_equal(a.owner, b.owner) and a.rounds == b.rounds
    assert a.fingerprint == b.fingerprint != plan(mask, None, 4, balance="dual_chunk", chunk_size=64).fingerprint
    assert all(len(a.chunks(r)) == 16 for r in range(4))


def test_sparse_balances_document_masks():
    docs = M.random_document_lengths(32768, 2048, seed=3)
    mask = M.causal_document_mask(docs)
    for cp in (8, 16):
        dual = plan(mask, None, cp, balance="dual_chunk")
        sparse = plan(mask, None, cp, balance="sparse")
        assert sparse.imbalance <= 1.05, (cp, sparse.imbalance)
        assert sparse.imbalance <= dual.imbalance
        assert sum(sparse.works) == sum(dual.works) == int(sparse.chunk_work.sum())


def test_pairs_work_model_counts_every_unmasked_pair():
    for name in ("causal_document", "qk_sparse", "global_sliding_window", "prefix_document"):
        mask = MASKS[name]
        p = plan(mask, None, 4, balance="sparse", chunk_size=8, work="pairs")
        assert sum(p.works) == mask.unmasked_pairs()
    docs = M.random_document_lengths(16384, 1024, seed=4)
    p = plan(M.causal_document_mask(docs), None, 8, balance="sparse", work="pairs")
    assert p.imbalance <= 1.05
    with pytest.raises(ValueError, match="work"):
        plan(MASKS["causal"], None, 4, work="flops")


def test_routing_delivers_each_needed_chunk_once_and_never_more_than_allgather():
    mask = M.causal_document_mask(M.random_document_lengths(4096, 200, seed=2))
    for nodes in (1, 2, 4):
        p = plan(mask, None, 8, balance="sparse", chunk_size=64, nodes=nodes)
        for rnd in p.rounds:
            pairs = [(t.src, t.dst) for t in rnd.transfers]
            assert len(pairs) == len(set(pairs))  # one message per pair and round
        for r in range(8):
            got = [c for rnd in p.rounds for t in rnd.recvs(r) for c in t.chunks]
            remote = {c for c in np.flatnonzero(p.need[r]) if p.owner[c] != r}
            assert remote <= set(got)
            assert len(got) == len(set(got))
        assert p.kv_tokens_moved("overlap") < p.kv_tokens_moved("allgather")
    flat = plan(mask, None, 8, balance="sparse", chunk_size=64)
    hier = plan(mask, None, 8, balance="sparse", chunk_size=64, nodes=2)
    assert hier.cross_node_transfers() < flat.cross_node_transfers(gpus_per_node=4)
    full = plan(M.full_mask(256), None, 4, balance="sparse")
    assert full.kv_tokens_moved("overlap") == full.kv_tokens_moved("allgather")


@pytest.mark.parametrize("causal,c", LAYOUTS)
def test_overlap_moves_fewer_bytes_iff_a_remote_chunk_is_dead(causal, c):
    """Flat routing moves exactly the live remote chunks: fewer than all-gather when some
    rank can skip some other rank's chunk, the same otherwise (random masks of every layout)."""
    for seed in range(6):
        cols = random_columns(1, 2, 64, 64, causal, c, seed=seed)
        for balance in ("contiguous", "dual_chunk", "sparse"):
            p = plan(cols, causal, 4, balance=balance, chunk_size=8)
            remote = p.owner[None, :] != np.arange(4)[:, None]
            dead = bool((remote & ~p.need).any())
            moved, gathered = p.kv_tokens_moved("overlap"), p.kv_tokens_moved("allgather")
            assert moved < gathered if dead else moved == gathered
            assert moved == int((remote & p.need).sum()) * p.chunk_size


def test_shard_unshard_roundtrip_keeps_global_positions():
    p = plan(MASKS["causal_document"], None, 4, balance="sparse", chunk_size=8)
    x = torch.randn(2, 96, 3)
    pos = torch.arange(96).view(1, 96).expand(2, 96)
    shards = [p.shard(x, r) for r in range(4)]
    assert torch.equal(p.unshard(shards), x)
    assert torch.equal(p.shard(pos, 2)[0], p.rows(2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(cp_size=5), "cannot split"),
    (dict(cp_size=4, chunk_size=7), "chunk_size"),
    (dict(cp_size=4, chunk_size=32, balance="dual_chunk"), "dual_chunk"),
    (dict(cp_size=4, balance="ring"), "balance"),
    (dict(cp_size=4, nodes=3), "nodes"),
    (dict(cp_size=0), "cp_size"),
])
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(MASKS["causal"], None, **kwargs)


def test_tiny_chunks_on_long_sequences_are_refused():
    with pytest.raises(ValueError, match="use chunk_size >= 16"):
        plan(None, True, 2, seqlen=1 << 17, chunk_size=2)


def test_mask_argument_errors():
    with pytest.raises(ValueError, match="seqlen"):
        plan(None, True, 2)
    with pytest.raises(ValueError, match="causal"):
        plan(MASKS["causal"], False, 2)
    with pytest.raises(TypeError, match="startend_row_indices"):
        plan([1, 2], True, 2)
    p = plan(None, True, 2, seqlen=64, balance="contiguous")
    assert p.local_mask(1).startend_row_indices.shape == (1, 1, 64, 2)
    with pytest.raises(ValueError, match="rank"):
        p.rows(2)
