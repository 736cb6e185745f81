"""Planning (no process group needed): ownership, work balance, rank-local masks, routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashmask3.masks as M
from benchmarks.corpus import document_spreads
from flashmask3.distributed import plan
from flashmask3.distributed.plan import Round, Transfer, chunk_liveness
from flashmask3.masks import SKIP, classify_tiles
from flashmask3.masks.mask import to_dense
from tests.helpers import LAYOUTS, named_masks, random_columns
from flashmask3.distributed import BALANCES

MASKS = named_masks(96, batch_size=2, num_heads=2)


@pytest.mark.parametrize("cp,nodes", [(4, 1), (4, 2), (3, 1)])
def test_local_masks_every_mask_and_balance(cp, nodes):
    for name in sorted(MASKS):
        for balance in BALANCES:
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
            assert p.local_columns_shape(r, order) == tuple(local.startend_row_indices.shape)
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


@pytest.mark.parametrize("seed", range(6))
def test_count_below_equals_the_binary_search(seed):
    """Every path of the count equals the binary search for every bound (inside, before,
    after and at the edges of held rows, out of range, any shape): the table filled chunk by
    chunk (a plan's rank rows), the table counted row by row (other rows), and rows far past
    the bounds' count, which keep the binary search."""
    from flashmask3.distributed.local_mask import count_below

    g = torch.Generator().manual_seed(seed)
    cs = int(2 ** torch.randint(0, 6, (1,), generator=g))
    n = int(torch.randint(1, 40, (1,), generator=g))
    held = torch.randperm(n, generator=g)[:int(torch.randint(1, n + 1, (1,), generator=g))].sort().values
    rows = (held[:, None] * cs + torch.arange(cs)).flatten()
    bounds = torch.randint(-3, n * cs + 4, (2, 3, 50, 2), generator=g)
    bounds[0, 0, :4, 0] = torch.tensor([0, n * cs, rows[0], rows[-1] + 1])
    odd = rows[rows % cs != 0] if cs > 1 else rows[1:]  # not whole chunks: the table counted row by row
    far = rows + (1 << 20)  # past the bounds: the binary search
    for r, b in ((rows, bounds), (odd, bounds), (far, bounds + (1 << 20)), (far, bounds)):
        if r.numel():
            want = torch.searchsorted(r, b.contiguous())
            got = count_below(r, b, cs)
            assert got.dtype == torch.int64 and torch.equal(got, want)
            assert torch.equal(count_below(r, b.to(torch.int32), cs), want)
            assert torch.equal(count_below(r, b[..., 1], cs), want[..., 1])  # a strided view


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


def test_ptrr_deals_sorted_chunks_in_snake_order_as_torch_does():
    """balance="ptrr" is PyTorch's processing-time round-robin: the same groups as torch's own
    ``_PTRRLoadBalancer.ptrr_scheduling`` on the plan's chunk works (ties kept in order)."""
    docs = M.random_document_lengths(32768, 1500, seed=5)
    mask = M.causal_document_mask(docs)
    for cp in (4, 8, 16):
        p = plan(mask, None, cp, balance="ptrr")
        assert p.chunk_size == 128 and all(len(p.chunks(r)) == 256 // cp for r in range(cp))
        order = np.argsort(-p.chunk_work, kind="stable")  # heaviest first
        first, second = order[:cp], order[cp:2 * cp]
        assert list(p.owner[first]) == list(range(cp))  # the first pass deals 0..P-1
        assert list(p.owner[second]) == list(range(cp - 1, -1, -1))  # the next P-1..0
        assert p.imbalance <= plan(mask, None, cp, balance="dual_chunk").imbalance
        try:
            from torch.distributed.tensor.experimental._context_parallel._load_balancer import \
                _PTRRLoadBalancer
        except ImportError:  # a torch without it: the snake checks above stand
            continue
        groups = _PTRRLoadBalancer.ptrr_scheduling(torch.as_tensor(p.chunk_work), cp)
        for r in range(cp):
            assert p.chunks(r) == tuple(groups[r].tolist())


def test_ptrr_scatters_documents_so_ranks_need_nearly_all_keys():
    """Why torch pairs PTRR with all-gather: each rank holds pieces of most documents."""
    docs = M.random_document_lengths(65536, 4096, seed=6)
    mask = M.causal_document_mask(docs)
    ptrr, sparse = (plan(mask, None, 16, balance=b) for b in ("ptrr", "sparse"))
    assert ptrr.imbalance < 1.02
    assert ptrr.max_remote_kv_tokens > 2 * sparse.max_remote_kv_tokens
    odd = plan(M.causal_document_mask([1000, 1000]), None, 2, balance="ptrr")
    assert odd.chunk_size == 125 and odd.num_chunks == 16  # no 128-token split: largest below


def test_sparse_tolerance_bounds_the_heaviest_rank():
    """``tolerance`` is where the swaps stop: the heaviest rank within that fraction of the mean
    (reachable on these masks), tighter never worse; bad values are refused."""
    docs = M.random_document_lengths(65536, 3000, seed=7)
    mask = M.causal_document_mask(docs)
    for cp in (8, 32):
        got = {tol: plan(mask, None, cp, balance="sparse", tolerance=tol) for tol in (0.08, 0.01, 0.0)}
        for tol, p in got.items():
            assert p.tolerance == tol
            assert tol == 0.0 or p.imbalance <= 1 + tol  # (0: until no swap helps, ~1.002 here)
        assert got[0.0].imbalance <= got[0.01].imbalance <= got[0.08].imbalance
    assert plan(mask, None, 8).tolerance == 0.04
    for bad in (-0.1, 1.0, "0.01", True):
        with pytest.raises(ValueError, match="tolerance"):
            plan(mask, None, 8, tolerance=bad)


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
        for balance in BALANCES:
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


# -- session 17: summaries, placement, routing --------------------------------------------------


def _dense_tile_summary(cols, causal, s, chunk, tile=128):
    """The dense reference of the per-chunk summaries: classify every tile, then reduce."""
    block = int(np.gcd(chunk, tile))
    n, per = s // chunk, chunk // block
    alive = (classify_tiles(cols, causal, s, s, block, block) != SKIP).flatten(0, 1)
    work = alive.sum(dim=(0, 2), dtype=torch.int64).view(n, per).sum(1)
    live = alive.any(0).view(n, per, n, per).any(3).any(1)
    return work.numpy(), live.numpy()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 10_000), heads=st.integers(1, 3),
       chunk=st.sampled_from([4, 8, 16, 32]), tile=st.sampled_from([8, 16, 128]))
def test_summaries_equal_the_tile_rule_and_never_drop_a_live_key(layout, seed, heads, chunk, tile):
    """Per-chunk work and liveness from block summaries == the dense tile classification; and
    a key chunk reported not live is fully masked (dense reference) for that query chunk."""
    causal, c = layout
    s = 64
    cols = random_columns(2, heads, s, s, causal, c, seed=seed)
    work, live = chunk_liveness(cols, causal, s, chunk, tile)
    want_work, want_live = _dense_tile_summary(cols, causal, s, chunk, tile)
    assert np.array_equal(work, want_work) and np.array_equal(live, want_live)
    n = s // chunk
    dense = to_dense(cols, causal, s, s).any(0).any(0).view(n, chunk, n, chunk).any(3).any(1).numpy()
    assert not (dense & ~live).any()  # conservative: every truly live pair is reported live


@pytest.mark.parametrize("max_layers", [0, 2, 8])
def test_live_grid_range_layers_and_difference_array_fill_the_same_cells(monkeypatch, max_layers):
    """The chunk grid from merged key-chunk ranges, range by range or by the difference
    array's cumulative sum (``max_layers=0``), equals a dense fill of the raw ranges."""
    from flashmask3.distributed import summaries

    monkeypatch.setattr(summaries, "_MAX_GRID_LAYERS", max_layers)
    rng = np.random.default_rng(17)
    for _ in range(60):
        n = int(rng.integers(1, 90))
        m = int(rng.integers(0, 4 * n + 1))
        q0 = rng.integers(0, n, m)
        q1 = np.minimum(n, q0 + rng.integers(1, n + 1, m))
        kc = rng.integers(0, n, m)
        want = np.zeros((n, n), dtype=bool)
        for a, b, k in zip(q0, q1, kc):
            want[a:b, k] = True
        assert np.array_equal(summaries._live_grid(q0, q1, kc, n), want)


def _brute_force_swap(ps, h, lo, hi, span, node, intra, cross, tile_ps, bucket, cap):
    """The placement's exchange rule, scored on every (slot of h, chunk) pair: eligible iff
    it lowers the pair's maximum and the remote K/V bound stays within ``cap``; least compute
    key, then least link time of the new K/V, then lowest (slot, chunk)."""
    big = np.iinfo(np.int64).max
    slots = ps.members[h]
    cols = np.flatnonzero(ps.loads[ps.owner] < ps.loads[h])
    if not len(cols):
        return None
    o = ps.owner[cols]
    d = ps.work[slots][:, None] - ps.work[cols][None, :]
    ok = (d > 0) & (d < (ps.loads[h] - ps.loads[o])[None, :])
    pre = ps.prefix
    gain_o = (span[slots][:, None] - (pre[:, hi[slots]] - pre[:, lo[slots]]).T)[:, o]
    gain_h = (span[cols] - (pre[h, hi[cols]] - pre[h, lo[cols]]))[None, :]
    bound = np.maximum(ps.remote[h] + gain_h, ps.remote[o][None, :] + gain_o) + 1
    compute = tile_ps * np.maximum(ps.loads[h] - d, ps.loads[o][None, :] + d) // bucket
    pick = np.where(ok & (bound <= cap), compute, big)
    if pick.min() == big:
        return None
    link = np.where(node[o] != node[h], cross, intra)[None, :]
    best = int(np.argmin(np.where(pick == pick.min(), link * (gain_h + gain_o), big)))
    slot, j = divmod(best, len(cols))
    return slot, int(cols[j])


@pytest.mark.parametrize("seed", range(6))
def test_swap_search_picks_the_brute_force_exchange(seed):
    """The search's shortcuts (column filter, X < L_h, penalty, tie threshold) choose exactly
    the exchange a full scoring of every pair chooses, for tight and loose caps, fine and
    coarse compute buckets (many ties), along a run of exchanges."""
    from flashmask3.distributed import placement as PL

    rng = np.random.default_rng(seed)
    cp = int(rng.choice([4, 8, 16]))
    s = 128 * cp * int(rng.choice([4, 8]))
    mask = M.causal_document_mask(M.random_document_lengths(s, int(rng.integers(32, s // 4)), seed=seed))
    p = plan(mask, None, cp, balance="contiguous", chunk_size=128)
    work, live = p.chunk_work, p.chunk_live
    lo, hi = PL.live_hull(live)
    span = hi - lo
    ps = PL._State(work.astype(np.int64), live, PL.folded_owner(lo, cp), cp)
    node = np.arange(cp) // 2
    intra, cross = 3, 29
    wk = ps.work.astype(np.int32)
    checked = 0
    for _ in range(40):
        h = int(np.argmax(ps.loads))
        cols = np.flatnonzero((ps.work < ps.work[ps.members[h]].max()) & (ps.loads[ps.owner] < ps.loads[h]))
        chosen = None
        for tile_ps, bucket in [(1, 1), (7, 50), (3, int(ps.loads.mean()) // 4 + 1)]:
            for cap in sorted({0, int(ps.remote.max()), int(ps.remote.max()) + 3, len(work)}):
                want = _brute_force_swap(ps, h, lo, hi, span, node, intra, cross, tile_ps, bucket, cap)
                got = (PL._best_capped_swap(ps, h, cols, wk, lo, hi, span, node, intra, cross,
                                            tile_ps, bucket, cap) if len(cols) else None)
                assert got == want, (tile_ps, bucket, cap)
                checked += want is not None
                if cap == len(work) and bucket == 1:
                    chosen = want
        if chosen is None:
            break
        ps.swap(h, *chosen)
    assert checked > 0


def test_rank_needs_are_exact_or_conservative_on_random_masks():
    """A key chunk left out of needed_chunks(rank) is fully masked for the rank's rows."""
    for causal, c in LAYOUTS:
        for seed in range(4):
            cols = random_columns(1, 2, 128, 128, causal, c, seed=seed)
            dense = to_dense(cols, causal, 128, 128).any(0).any(0)
            for balance in BALANCES:
                p = plan(cols, causal, 4, balance=balance, chunk_size=8)
                for r in range(4):
                    dropped = torch.ones(128, dtype=torch.bool)
                    dropped[p.key_index(r)] = False
                    assert not dense[p.rows(r)][:, dropped].any()


def _remote_tokens(p):
    return [p.remote_chunks(r) * p.chunk_size for r in range(p.cp_size)]


@pytest.mark.parametrize("cp", [4, 8, 16])
def test_sparse_keeps_tokens_equal_balances_work_and_moves_no_more_than_dual_chunk(cp):
    """On the benchmark's document spreads (small scale): equal chunk counts, imbalance <= 1.05,
    largest remote K/V <= 1.1x dual_chunk's and never below the lower bound."""
    for spread, lens in document_spreads(16384, seed=1).items():
        mask = M.causal_document_mask(lens)
        sparse = plan(mask, None, cp, balance="sparse")
        dual = plan(mask, None, cp, balance="dual_chunk")
        assert {len(sparse.chunks(r)) for r in range(cp)} == {sparse.num_chunks // cp}
        assert sparse.imbalance <= 1.05, (spread, cp, sparse.imbalance)
        assert sparse.max_remote_kv_tokens <= 1.1 * dual.max_remote_kv_tokens, (spread, cp)
        assert sparse.max_remote_kv_tokens == max(_remote_tokens(sparse))
        assert sparse.max_remote_kv_tokens >= max(0, max(lens) - 16384 // cp - sparse.chunk_size)


def test_sparse_keeps_a_long_document_near_the_lower_bound():
    """One document of 3/4 of the sequence: the tail owner needs it all, but no rank needs
    much more than (length - tokens per rank)."""
    s, cp = 32768, 8
    mask = M.causal_document_mask([s * 3 // 4, s // 8, s // 8])
    p = plan(mask, None, cp)
    bound = s * 3 // 4 - s // cp
    assert p.imbalance <= 1.05
    assert bound <= p.max_remote_kv_tokens <= 1.25 * bound


@pytest.mark.parametrize("cp,nodes", [(8, 2), (8, 4), (12, 3), (16, 2)])
def test_hierarchical_rounds_intra_cross_relay_and_each_chunk_arrives_once(cp, nodes):
    mask = M.causal_document_mask(M.random_document_lengths(cp * 512, 300, seed=cp + nodes))
    p = plan(mask, None, cp, chunk_size=64, nodes=nodes)
    g = cp // nodes
    kinds = []
    for i, rnd in enumerate(p.rounds):
        pairs = [(t.src, t.dst) for t in rnd.transfers]
        assert len(pairs) == len(set(pairs)) and pairs == sorted(pairs)
        assert all(list(t.chunks) == sorted(t.chunks) and t.chunks for t in rnd.transfers)
        crossing = {t.src // g != t.dst // g for t in rnd.transfers}
        if rnd.relay:
            kind = "relay"
            src = p.rounds[rnd.source]
            assert rnd.source < i and not src.relay and crossing == {False}
            for t in rnd.transfers:  # a relay forwards only chunks it received in its source round
                got = {c for r in src.recvs(t.src) for c in r.chunks}
                assert set(t.chunks) <= got and not set(t.chunks) & set(p.chunks(t.src))
        elif crossing == {True}:
            kind = "cross"
            assert all(t.src % g == t.dst % g for t in rnd.transfers)  # the same-slot peer
            assert all(p.owner[c] == t.src for t in rnd.transfers for c in t.chunks)
            per_node = [(c, t.dst // g) for t in rnd.transfers for c in t.chunks]
            assert len(per_node) == len(set(per_node))  # one copy per (chunk, node)
        else:
            kind = "intra"
            assert crossing == {False}
            assert all(p.owner[c] == t.src for t in rnd.transfers for c in t.chunks)
        kinds.append(kind)
    assert kinds == [k for k in ("intra", "cross", "relay") if k in kinds]  # in this order
    for r in range(cp):
        got = [c for rnd in p.rounds for t in rnd.recvs(r) for c in t.chunks]
        assert len(got) == len(set(got))  # nothing arrives twice
        remote = {int(c) for c in np.flatnonzero(p.need[r]) if p.owner[c] != r}
        assert remote <= set(got)
        assert [c for st_ in p.stages(r)[1:] for c in st_] == [c for rnd in p.rounds for c in
                                                               sorted(c for t in rnd.recvs(r) for c in t.chunks
                                                                      if p.need[r, c])]
        assert len(p.stages(r)) == 1 + len(p.rounds)


def test_flat_rounds_are_direct_and_deliver_each_needed_chunk_exactly_once():
    mask = M.causal_document_mask(M.random_document_lengths(8192, 400, seed=7))
    p = plan(mask, None, 8, chunk_size=128)
    assert all(not rnd.relay and rnd.source is None for rnd in p.rounds)
    for r in range(8):
        got = sorted(c for rnd in p.rounds for t in rnd.recvs(r) for c in t.chunks)
        assert got == sorted(int(c) for c in np.flatnonzero(p.need[r]) if p.owner[c] != r)
        for rnd in p.rounds:
            assert all(p.owner[c] == r for t in rnd.sends(r) for c in t.chunks)


def test_round_source_must_match_relay():
    with pytest.raises(ValueError, match="source"):
        Round((Transfer(0, 1, (2,)),), relay=True)
    with pytest.raises(ValueError, match="source"):
        Round((), relay=False, source=0)


def test_round_lists_each_ranks_messages_in_peer_order_and_refuses_a_repeated_pair():
    r = Round((Transfer(2, 0, (5,)), Transfer(0, 3, (1,)), Transfer(0, 1, (2,)), Transfer(1, 0, (4,))))
    assert [t.dst for t in r.sends(0)] == [1, 3]
    assert [t.src for t in r.recvs(0)] == [1, 2]
    with pytest.raises(ValueError, match=r"\(0, 1\) appears twice"):
        Round((Transfer(0, 1, (2,)), Transfer(0, 1, (3,))))


def test_round_keeps_every_transfer_of_its_triples_and_builds_them_per_rank():
    """A Round holds (src, dst, chunk) arrays and builds Transfers on demand: every view of it
    (all transfers, each rank's sends and receives, its stages, the plan's K/V accounting)
    must equal what the transfers themselves say, for flat and hierarchical plans."""
    lens = document_spreads(16384, seed=5)["mixed"]
    for nodes in (1, 2):
        p = plan(M.causal_document_mask(lens), None, 8, nodes=nodes, chunk_size=256)
        g = p.cp_size // p.nodes
        for rnd in p.rounds:
            ts = rnd.transfers
            assert [(t.src, t.dst) for t in ts] == sorted({(t.src, t.dst) for t in ts})
            assert all(list(t.chunks) == sorted(t.chunks) and t.chunks for t in ts)
            assert rnd.num_chunks_sent == sum(len(t.chunks) for t in ts)
            assert list(zip(*(a.tolist() for a in rnd.transfer_sizes()))) == [(t.src, t.dst, len(t.chunks)) for t in ts]
            assert rnd.cross_node_chunks(g) == sum(len(t.chunks) for t in ts if t.src // g != t.dst // g)
            for r in range(p.cp_size):
                assert rnd.sends(r) == [t for t in ts if t.src == r]
                assert rnd.recvs(r) == sorted((t for t in ts if t.dst == r), key=lambda t: t.src)
                assert sorted(rnd.received_chunks(r).tolist()) == sorted(c for t in ts if t.dst == r for c in t.chunks)
        for r in range(p.cp_size):  # the stages: own needed chunks, then each round's needed arrivals
            need = p.need[r]
            want = [tuple(c for c in p.chunks(r) if need[c])]
            want += [tuple(sorted(c for t in rnd.recvs(r) for c in t.chunks if need[c])) for rnd in p.rounds]
            assert p.stages(r) == want
        moved = sum(len(t.chunks) for rnd in p.rounds for t in rnd.transfers)
        assert p.kv_tokens_moved() == moved * p.chunk_size


def test_round_is_immutable_pickles_and_refuses_an_empty_transfer():
    import pickle

    r = Round((Transfer(1, 0, (4, 6)), Transfer(0, 2, (3,))), relay=True, source=0)
    with pytest.raises(AttributeError, match="immutable"):
        r.relay = False
    back = pickle.loads(pickle.dumps(r))
    assert back == r and hash(back) == hash(r) and back.source == 0 and back.relay
    assert back.transfers == (Transfer(0, 2, (3,)), Transfer(1, 0, (4, 6)))
    assert r != Round((Transfer(1, 0, (4, 6)), Transfer(0, 2, (3,))), relay=True, source=1)
    with pytest.raises(ValueError, match="carries no chunk"):
        Round((Transfer(0, 1, ()),))


def test_plans_are_deterministic_and_queries_are_cached():
    lens = document_spreads(16384, seed=2)["corpus"]
    a = plan(M.causal_document_mask(lens), None, 8, nodes=2)
    b = plan(M.causal_document_mask(lens).startend_row_indices.clone(), True, 8, nodes=2)
    assert np.array_equal(a.owner, b.owner) and a.rounds == b.rounds and a.fingerprint == b.fingerprint
    assert a.fingerprint != plan(M.causal_document_mask(lens), None, 8).fingerprint  # flat routing differs
    assert a.key_index(3) is a.key_index(3) and a.rows(2) is a.rows(2)
    assert a.stages(1) == a.stages(1) and a.needed_chunks(1) is a.needed_chunks(1)
    assert a.rounds[0].sends(0) == [t for t in a.rounds[0].transfers if t.src == 0]


@pytest.mark.parametrize("s, cp, balance, expect", [
    (1001, 8, "sparse", "multiple of 8 .*pad the sequence to 1024"),
    (1000, 8, "dual_chunk", "multiple of 16 .*pad the sequence to 2048"),
    (4102, 4, "contiguous", "multiple of 4 .*pad the sequence to 4608"),
])
def test_lengths_that_cannot_be_split_say_which_lengths_work(s, cp, balance, expect):
    with pytest.raises(ValueError, match=expect):
        plan(None, True, cp, seqlen=s, balance=balance)


def test_lengths_that_are_not_a_multiple_of_128_cp_still_plan():
    p = plan(M.causal_document_mask(M.random_document_lengths(8 * 200, 150, seed=3)), None, 8)
    assert p.chunk_size * p.num_chunks == 1600 and p.num_chunks % 8 == 0 and p.imbalance <= 1.1


def test_planning_a_million_tokens_with_per_head_masks_works():
    """Smoke (not a speed assertion): 1M tokens, cp 128, two mask heads with different docs."""
    s = 1 << 20
    heads = [document_spreads(s, seed=h)["mixed"] for h in range(2)]
    cols = torch.cat([M.causal_document_mask(d).startend_row_indices for d in heads], dim=1)
    p = plan(cols, True, 128)
    assert p.chunk_size == 512 and p.imbalance <= 1.05
    assert sum(p.works) == int(p.chunk_work.sum()) > 0


@pytest.mark.gpu
def test_shard_and_unshard_of_cuda_tensors_do_not_synchronise():
    """A plan's rows go to a GPU once, from pinned memory without blocking: sharding a batch's
    CUDA tensors (the transformers integration's ``model_inputs``) never waits for the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    p = plan(M.causal_document_mask([100, 156]), None, 2)
    x = torch.arange(256, device="cuda").view(1, -1)
    p.shard(x, 0)  # the first use per device copies the rows (still without a sync)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        shards = [p.shard(x, r) for r in range(2)]
        back = p.unshard(shards)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert torch.equal(back, x)
    assert torch.equal(shards[1].cpu(), p.rows(1).view(1, -1))


def test_op_token_names_its_plan_in_this_process_only():
    """``CPPlan.op_token`` (how the traced CP layer's custom op finds its plan): it names this
    plan; a pickled copy (a planning process's result) gets its own; a freed plan's name is a
    clear error, not another plan."""
    import gc
    import pickle

    from flashmask3.distributed.plan import plan_of_token

    p = plan(M.causal_document_mask([40, 24]), None, 2)
    assert p.op_token.device.type == "cpu" and p.op_token.dim() == 0
    assert plan_of_token(p.op_token) is p
    copy = pickle.loads(pickle.dumps(p))
    assert int(copy.op_token) != int(p.op_token) and plan_of_token(copy.op_token) is copy
    assert copy.fingerprint == p.fingerprint
    name = int(p.op_token)
    del p
    gc.collect()
    with pytest.raises(RuntimeError, match="keep the plan alive"):
        plan_of_token(torch.tensor(name))


@pytest.mark.parametrize("balance", ["sparse", "dual_chunk"])
def test_with_mask_keeps_the_placement_and_routes_the_new_mask(balance):
    """``CPPlan.with_mask`` / ``windowed``: the same owner (so the same shards), the new mask's
    needed chunks (a subset when the new mask only removes pairs), fewer or equal transfers, and
    one windowed plan per window; mismatched masks are errors."""
    seqlen, cp = 1024, 4
    full = M.causal_document_mask([300, 212, 500, 12])
    p = plan(full, None, cp, balance=balance)
    w = p.windowed(40)
    assert w is p.windowed(40) and w is not p.windowed(41)
    assert np.array_equal(w.owner, p.owner) and w.chunk_size == p.chunk_size
    x = torch.arange(seqlen).view(1, seqlen)
    for r in range(cp):
        assert torch.equal(w.shard(x, r), p.shard(x, r))
    assert (w.need <= p.need).all() and w.need.sum() < p.need.sum()
    # the same liveness as the windowed mask's own tile grid
    windowed = M.with_window(full, 40)
    want = chunk_liveness(windowed.startend_row_indices, True, seqlen, p.chunk_size, p.tile)[1]
    assert np.array_equal(w.chunk_live, want)
    moved = lambda q: sum(len(t.chunks) for rnd in q.rounds for t in rnd.transfers)  # noqa: E731
    assert moved(w) <= moved(p)
    assert p.with_mask(full).fingerprint == p.fingerprint
    with pytest.raises(ValueError, match="tokens"):
        p.with_mask(M.causal_mask(512))
    with pytest.raises(ValueError, match="causal plan"):
        plan(M.document_mask([512, 512]), None, cp).windowed(8)
    with pytest.raises(ValueError, match="window_size"):
        p.windowed(-1)


def test_padded_seqlen_is_the_shortest_length_a_plan_splits():
    from flashmask3.distributed import padded_seqlen

    assert padded_seqlen(1001, 8) == 1008 and padded_seqlen(1024, 8) == 1024
    assert padded_seqlen(1001, 8, balance="dual_chunk") == 1008
    assert padded_seqlen(1001, 8, multiple=128) == 1024
    for s, cp, balance in ((1001, 8, "sparse"), (777, 6, "dual_chunk"), (130, 4, "contiguous")):
        length = padded_seqlen(s, cp, balance=balance)
        assert length >= s and plan(M.pad_to(M.causal_document_mask([s]), length), None, cp, balance=balance)
    with pytest.raises(ValueError, match="balance"):
        padded_seqlen(100, 2, balance="ring")
