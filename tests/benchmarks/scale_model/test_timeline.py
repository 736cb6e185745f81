"""The timeline's rules on tiny cases whose answer can be worked out by hand."""

import math

import pytest

from benchmarks.scale_model.calibrate import TileCounts
from benchmarks.scale_model.layout import PlanView, RoundView
from benchmarks.scale_model.params import Cluster, Param, Runtime
from benchmarks.scale_model.timeline import (AttnShape, Links, ring_collective_time, simulate_layer,
                                             simulate_pass)

MS = 1e-3
SHAPE = AttnShape(heads=1, kv_heads=1, head_dim=64, elem_bytes=2)
CHUNK = 1024
CHUNK_BYTES = SHAPE.kv_bytes(CHUNK)  # 262144


class TileCost:
    """Forward: 1 ms per full tile; backward: 2 ms per full tile; no per-call cost."""

    def forward(self, tiles, heads, kv_heads=None):
        return tiles.full * MS

    def backward(self, tiles, heads, kv_heads=None):
        return 2 * tiles.full * MS

    def backward_stage(self, tiles, heads, kv_heads=None):
        return self.backward(tiles, heads)

    def backward_query_blocks(self, tiles, heads):
        return 0.0


def cluster(**kw) -> Cluster:
    """A chunk takes 1 ms on any link; no latency, overhead or SM share; merges free."""
    base = dict(nvlink_bw=Param(CHUNK_BYTES / MS, "test"), ib_bw=Param(CHUNK_BYTES / MS, "test"),
                link_efficiency=Param(1.0, "test"), nvlink_latency=Param(0.0, "test"),
                ib_latency=Param(0.0, "test"), msg_overhead=Param(0.0, "test"),
                comm_sm_share=Param(0.0, "test"), hbm_bw=Param(1e30, "test"), gpus_per_node=2)
    base.update(kw)
    return Cluster().with_(**base)


def tiles(n: int, keys: int = CHUNK) -> TileCounts:
    return TileCounts(n, 0, CHUNK, keys)


def view(stages, rounds, nodes=1) -> PlanView:
    p = len(stages)
    chunks = [[1 if t.live else 0 for t in st] for st in stages]
    works = [sum(t.live for t in st) for st in stages]
    sorted_tiles = [TileCounts(sum(t.full for t in st), 0, CHUNK, CHUNK * p) for st in stages]
    return PlanView(p, nodes, CHUNK * p, CHUNK, "test", 1.0, works, stages, chunks, sorted_tiles,
                    rounds, 0.0)


def test_a_stage_waits_for_its_round():
    # rank 0: own stage 1 ms, then a chunk from rank 1 that needs 3 chunk-times on the link.
    v = view([[tiles(1), tiles(2)], [tiles(1), tiles(0)]],
             [RoundView(((1, 0, 3),), False, None)])
    r = simulate_pass(v, TileCost(), cluster(), SHAPE, "overlap", backward=False)
    assert r.ranks[0].end == pytest.approx(3 * MS + 2 * MS)  # waits until 3 ms, then 2 ms
    assert r.ranks[0].exposed_comm == pytest.approx(2 * MS)
    assert r.ranks[1].end == pytest.approx(3 * MS)  # its send completes at 3 ms
    assert r.slowest == 0


def test_compute_hides_a_short_transfer():
    v = view([[tiles(5), tiles(1)], [tiles(1), tiles(0)]], [RoundView(((1, 0, 1),), False, None)])
    r = simulate_pass(v, TileCost(), cluster(), SHAPE, "overlap", backward=False)
    assert r.ranks[0].end == pytest.approx(6 * MS) and r.ranks[0].exposed_comm == pytest.approx(0)


def test_allgather_is_exposed():
    v = view([[tiles(2)], [tiles(1)]], [])
    c = cluster()
    ag = ring_collective_time(c, 2, SHAPE.kv_bytes(CHUNK))
    assert ag == pytest.approx(1 * MS)  # one shard over one link
    f = simulate_pass(v, TileCost(), c, SHAPE, "allgather", backward=False)
    b = simulate_pass(v, TileCost(), c, SHAPE, "allgather", backward=True)
    assert f.ranks[0].end == pytest.approx(ag + 2 * MS)
    # backward: all-gather + kernels + reduce-scatter (+ the dK/dV copy into the gathered slots)
    copy = 2 * SHAPE.kv_bytes(v.sorted_tiles[0].keys) / c.hbm_bw.value
    assert b.ranks[0].end == pytest.approx(2 * ag + 4 * MS + copy)


def test_allgather_across_nodes_uses_every_nic():
    c = cluster(gpus_per_node=2, ib_bw=Param(CHUNK_BYTES / MS / 10, "slow IB"))
    # 4 ranks, 2 nodes: each node ingests 2 shards through 2 NICs at 0.1 shard/ms -> 10 ms
    assert ring_collective_time(c, 4, CHUNK_BYTES) == pytest.approx(10 * MS)


def test_relay_waits_for_its_source_round():
    # 4 ranks, 2 nodes of 2: rank 0 -> rank 2 across nodes (round 0), rank 2 relays to rank 3
    # (round 1, source 0). Rank 3's remote stage cannot start before 2 ms (1 + 1 link times).
    c = cluster(ib_bw=Param(CHUNK_BYTES / (2 * MS), "IB: 2 ms a chunk"))
    rounds = [RoundView(((0, 2, 1),), False, None), RoundView(((2, 3, 1),), True, 0)]
    stages = [[tiles(1), tiles(0), tiles(0)], [tiles(1), tiles(0), tiles(0)],
              [tiles(1), tiles(1), tiles(0)], [tiles(1), tiles(0), tiles(1)]]
    r = simulate_pass(view(stages, rounds, nodes=2), TileCost(), c, SHAPE, "overlap", backward=False)
    assert r.ranks[2].end == pytest.approx(2 * MS + 1 * MS)   # IB 2 ms, then 1 ms of compute
    assert r.ranks[3].end == pytest.approx(2 * MS + 1 * MS + 1 * MS)  # + NVLink relay 1 ms
    assert r.cross_node_bytes == CHUNK_BYTES


def test_backward_gradient_return_after_the_relays_and_the_stage():
    # Same routing, backward: rank 3 returns its gradient to rank 2 after its stage 2; rank 2
    # sums and returns to rank 0 over IB only after that arrives.
    c = cluster(ib_bw=Param(CHUNK_BYTES / (2 * MS), "IB: 2 ms a chunk"))
    rounds = [RoundView(((0, 2, 1),), False, None), RoundView(((2, 3, 1),), True, 0)]
    stages = [[tiles(1), tiles(0), tiles(0)], [tiles(1), tiles(0), tiles(0)],
              [tiles(1), tiles(1), tiles(0)], [tiles(1), tiles(0), tiles(1)]]
    r = simulate_pass(view(stages, rounds, nodes=2), TileCost(), c, SHAPE, "overlap", backward=True)
    # K/V: rank 2 has it at 2 ms, rank 3 at 3 ms; rank 3 computes 3..5 (2 ms a tile), returns 5..6;
    # rank 2 returns to rank 0 over IB 6..8 (its own stage ended at 2 + 2 = 4 ms).
    assert r.ranks[3].end == pytest.approx(6 * MS)
    assert r.ranks[0].end == pytest.approx(8 * MS)
    assert r.ranks[2].end == pytest.approx(8 * MS)


def test_link_contention_on_the_receivers_port():
    c = cluster(gpus_per_node=4)
    one_port = Links(c)
    assert one_port.transfer(0.0, 1, 0, CHUNK_BYTES) == pytest.approx(1 * MS)
    assert one_port.transfer(0.0, 2, 0, CHUNK_BYTES) == pytest.approx(2 * MS)  # queued behind it
    two_ports = Links(c)
    assert two_ports.transfer(0.0, 1, 0, CHUNK_BYTES) == pytest.approx(1 * MS)
    assert two_ports.transfer(0.0, 2, 3, CHUNK_BYTES) == pytest.approx(1 * MS)  # other ports


def test_round_with_two_senders_to_one_rank_waits_for_both():
    v = view([[tiles(0), tiles(1)], [tiles(1), tiles(0)], [tiles(1), tiles(0)]],
             [RoundView(((1, 0, 1), (2, 0, 1)), False, None)])
    r = simulate_pass(v, TileCost(), cluster(gpus_per_node=4), SHAPE, "overlap", backward=False)
    assert r.ranks[0].end == pytest.approx(2 * MS + 1 * MS)


def test_sm_share_slows_overlapped_compute():
    # 2 ms of compute on rank 1 while its 1 ms send is in flight at half speed: 0.5 ms of work done
    # in the first ms, the remaining 1.5 ms after -> 2.5 ms.
    v = view([[tiles(0), tiles(1)], [tiles(2), tiles(0)]], [RoundView(((1, 0, 1),), False, None)])
    r = simulate_pass(v, TileCost(), cluster(comm_sm_share=Param(0.5, "test")), SHAPE, "overlap", False)
    assert r.ranks[1].end == pytest.approx(2.5 * MS)


def test_step_is_the_slowest_rank_and_host_floor():
    v = view([[tiles(1)], [tiles(3)]], [])
    lr = simulate_layer(v, TileCost(), cluster(), SHAPE, "overlap", Runtime("lean"))
    assert lr.slowest == 1
    assert lr.time == pytest.approx(lr.rank_time(1)) and lr.time == pytest.approx(3 * MS + 6 * MS)
    slow_host = cluster(host_op=Param(1.0, "1 s per op"))
    lr = simulate_layer(v, TileCost(), slow_host, SHAPE, "overlap", Runtime("lean"))
    assert lr.time == pytest.approx(max(lr.host))  # host-bound: the host sets the pace


def test_bad_comm_is_a_clear_error():
    v = view([[tiles(1)]], [])
    with pytest.raises(ValueError, match="comm"):
        simulate_pass(v, TileCost(), cluster(), SHAPE, "ring", False)


def test_empty_layout_sanity():
    assert ring_collective_time(cluster(), 1, 123) == 0.0
    assert math.isfinite(ring_collective_time(cluster(), 128, CHUNK_BYTES))


# -- the staged overlap backward's per-query-block term (session 19) -----------------------------

def _qblock_cost(a_qblock: float):
    """A real "greedy" cost: 1 ms per program-tile-free call, a_qblock per query block and head."""
    from benchmarks.scale_model.calibrate import AttentionCost, PassCost

    p = PassCost(0.0, 0.0, 1 * MS, 0.0, 0, a_qblock=a_qblock, schedule="greedy")
    return AttentionCost(p, p, "test", 64, False)


def _three_stage_view(first_empty: bool):
    """Rank 0 with three stages (the first without keys if ``first_empty``), rank 1 sends."""
    s0 = TileCounts(0, 0, CHUNK, 0) if first_empty else tiles(1)
    return view([[s0, tiles(1), tiles(1)], [tiles(1), tiles(0), tiles(0)]],
                [RoundView(((1, 0, 1),), False, None), RoundView(((1, 0, 1),), False, None)])


@pytest.mark.parametrize("first_empty", [False, True])
def test_query_block_term_is_charged_once_per_rank_per_layer_in_the_staged_backward(first_empty):
    """backward_prepare / backward_finish run once per layer: the per-query-block term adds
    a_qblock x (all the rank's query blocks) x heads once, not once per stage call, and also
    when the rank's stage 0 has no keys (it lands on the first live stage)."""
    v = _three_stage_view(first_empty)
    a_q = 1e-6
    with_q = simulate_pass(v, _qblock_cost(a_q), cluster(), SHAPE, "overlap", backward=True)
    without = simulate_pass(v, _qblock_cost(0.0), cluster(), SHAPE, "overlap", backward=True)
    q_blocks = CHUNK // 128
    live_stages = 2 if first_empty else 3
    assert without.ranks[0].compute == pytest.approx(live_stages * MS)  # one call cost per live stage
    assert with_q.ranks[0].compute - without.ranks[0].compute == pytest.approx(a_q * q_blocks * SHAPE.heads)
    # the all-gather backward is one call: it pays the term once too
    ag = simulate_pass(v, _qblock_cost(a_q), cluster(), SHAPE, "allgather", backward=True)
    ag0 = simulate_pass(v, _qblock_cost(0.0), cluster(), SHAPE, "allgather", backward=True)
    assert ag.ranks[0].compute - ag0.ranks[0].compute == pytest.approx(a_q * q_blocks * SHAPE.heads)


def test_forward_merges_only_after_the_first_live_stage():
    """A rank whose stage 0 has no keys: its first live stage starts the output, so two live
    stages cost one LSE merge, not two."""
    from benchmarks.scale_model.timeline import _merge_seconds

    c = cluster(hbm_bw=Param(1e9, "slow HBM: merges cost"))
    empty = simulate_pass(_three_stage_view(True), _qblock_cost(0.0), c, SHAPE, "overlap", backward=False)
    assert empty.ranks[0].compute == pytest.approx(2 * MS + _merge_seconds(c, SHAPE, CHUNK))
    full = simulate_pass(_three_stage_view(False), _qblock_cost(0.0), c, SHAPE, "overlap", backward=False)
    assert full.ranks[0].compute == pytest.approx(3 * MS + 2 * _merge_seconds(c, SHAPE, CHUNK))


def test_every_stage_call_covers_all_the_ranks_query_rows():
    """The once-per-layer query-block term is charged on the rank's first live stage with that
    stage's query rows: every stage call of a real plan runs over all the rank's rows (the keys
    change per stage, the rows do not), so that charge covers the whole local query axis."""
    import flashmask3.masks as M
    from benchmarks.scale_model.layout import view_plan
    from flashmask3.distributed import plan

    lens = [700, 1300, 300, 1796, 4096, 2000, 6192]
    mask = M.causal_document_mask(lens)
    p = plan(mask, None, 4, balance="sparse", nodes=2)
    v = view_plan(p, mask.startend_row_indices, True)
    for r in range(4):
        live = [t for t in v.stages[r] if t.live]
        assert live, f"rank {r} has no live stage"
        for t in v.stages[r]:
            assert t.q_rows == p.local_seqlen == len(p.rows(r))
            if t.work is not None:
                assert len(t.work.fwd_full) == p.local_seqlen // 128  # one forward program per query block
        assert v.stages[r][0].live > 0  # causal documents: a rank's own chunks are always needed


# -- the backward's calls (Runtime.bwd_calls) ----------------------------------------------------


def _relay_case():
    c = cluster(ib_bw=Param(CHUNK_BYTES / (2 * MS), "IB: 2 ms a chunk"))
    rounds = [RoundView(((0, 2, 1),), False, None), RoundView(((2, 3, 1),), True, 0)]
    stages = [[tiles(1), tiles(0), tiles(0)], [tiles(1), tiles(0), tiles(0)],
              [tiles(1), tiles(1), tiles(0)], [tiles(1), tiles(0), tiles(1)]]
    return view(stages, rounds, nodes=2), c


def test_one_backward_call_waits_for_every_round_and_returns_after_it():
    """The routing of the gradient-return test, the backward as one call per rank: rank 3 has its
    K/V at 3 ms, computes both tiles 3..7, returns 7..8; rank 2 (its call 2..6) forwards to rank 0
    over IB after that, 8..10."""
    v, c = _relay_case()
    r = simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=True, bwd_calls="one")
    assert r.ranks[3].end == pytest.approx(8 * MS)
    assert r.ranks[0].end == pytest.approx(10 * MS) and r.ranks[2].end == pytest.approx(10 * MS)
    assert r.ranks[3].compute == pytest.approx(4 * MS)
    f = simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=False, bwd_calls="one")
    assert f.time == simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=False).time  # forward as is
    with pytest.raises(ValueError, match="bwd_calls"):
        simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=True, bwd_calls="two")


def test_merged_calls_add_tiles_and_chain_the_key_blocks():
    import numpy as np

    from benchmarks.scale_model.calibrate import ProgramWork
    from benchmarks.scale_model.timeline import host_seconds, merge_calls

    a = TileCounts(2, 1, 256, 128, work=ProgramWork(np.array([1, 1]), np.array([1, 0]), np.array([4]), np.array([1])))
    b = TileCounts(3, 0, 256, 256, work=ProgramWork(np.array([1, 2]), np.array([0, 0]), np.array([2, 2]),
                                                    np.array([0, 0])))
    m = merge_calls([a, TileCounts(0, 0, 256, 128), b])
    assert (m.full, m.partial, m.q_rows, m.keys) == (5, 1, 256, 384)
    assert list(m.work.fwd_full) == [2, 3] and list(m.work.bwd_full) == [4, 2, 2]
    assert merge_calls([TileCounts(0, 0, 256, 128)]) is None
    v, c = _relay_case()
    c = cluster(host_op=Param(1.0, "1 s per op"))
    ops = {k: host_seconds(v, 3, "overlap", c, Runtime("lean", bwd_calls=k))
           for k in ("stage", "one", "one+local")}
    # 2 live stages: 2 forward calls + 2, 1 or 2 backward calls + prepare/finish, 2 ops per call
    assert ops == {"stage": 64 + 2 * 6, "one": 64 + 2 * 5, "one+local": 64 + 2 * 6}
    with pytest.raises(ValueError, match="bwd_calls"):
        host_seconds(v, 3, "overlap", c, Runtime("lean", bwd_calls="local+one"))  # (removed in session 39)


def test_kept_kv_backward_sends_only_gradients():
    """``keep_kv``: the relay case's backward as one call starts at once (its K/V are the
    forward's), rank 3 computes 0..4 and returns 4..5, and no K/V message is counted; refetching
    (the default of simulate_pass) still waits for the K/V rounds."""
    v, c = _relay_case()
    kept = simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=True, bwd_calls="one", keep_kv=True)
    again = simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=True, bwd_calls="one")
    assert kept.ranks[3].end == pytest.approx(5 * MS) and again.ranks[3].end == pytest.approx(8 * MS)
    assert kept.messages == again.messages - 2  # the two K/V rounds' messages are gone
    assert kept.time < again.time


def test_remote_keys_first_returns_travel_during_the_own_call():
    """``"one+local"`` on the relay case: rank 3's remote call (its K/V at 3 ms) runs 3..5, its
    return reaches relay rank 2 at 6 while rank 3's own call runs 5..7; rank 2's remote call
    runs 2..4, but its own call waits for that return (the runtime sums relays' returns on the
    compute stream) and runs 6..8 while the summed return crosses IB, 6..8: the layer ends at 8
    instead of "one"'s 10. With the K/V kept every call starts at once: rank 0 has its gradient
    at 5 ms ("one": 7)."""
    v, c = _relay_case()
    r = simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=True, bwd_calls="one+local")
    assert r.ranks[3].end == pytest.approx(7 * MS) and r.ranks[3].compute == pytest.approx(4 * MS)
    assert r.ranks[2].end == pytest.approx(8 * MS) and r.ranks[0].end == pytest.approx(8 * MS)
    assert r.ranks[2].exposed_comm == pytest.approx(4 * MS)  # waits: K/V 0..2, the return 4..6
    kept = simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=True, bwd_calls="one+local", keep_kv=True)
    one = simulate_pass(v, TileCost(), c, SHAPE, "overlap", backward=True, bwd_calls="one", keep_kv=True)
    assert kept.ranks[0].end == pytest.approx(5 * MS) and one.ranks[0].end == pytest.approx(7 * MS)
    assert kept.ranks[3].end == pytest.approx(4 * MS)
