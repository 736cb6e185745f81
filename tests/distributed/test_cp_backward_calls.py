"""The overlapped backward's calls (``backward_calls``): one staged-backward call per stage, one
per layer, or the own stage and one more; the ``"auto"`` rule shared with the scale model.

Gloo ranks check every mode against the float64 dense reference and against ``"stage"`` (cp 2
and 4, flat and hierarchical, GQA, document masks) and the ValueError on every rank; the rest
runs in this process with the emulated exchange (communication replaced by copies).
"""

from __future__ import annotations

import pytest
import torch

import flashmask3.masks as M
from benchmarks.corpus import document_spreads
from flashmask3.distributed import (BACKWARD_CALL_MODES, BACKWARD_CALLS, EmulatedExchange, LaunchCounter,
                                    auto_backward_calls, plan, prepare_rank, run_layer)
from flashmask3.distributed.runtime import to_wire
from tests.distributed.harness import run_distributed
from tests.distributed.test_cp_runtime import _Recording, _RecordingBackend, _full_rank
from tests.distributed.workers import backward_calls_suite, split_hierarchical
from tests.reference import reference_attention

MERGED = ("one", "one+local")


@pytest.mark.parametrize("world,seqlen,nodes", [(2, 64, [2]), (4, 128, [2])])
def test_backward_calls_on_gloo(world, seqlen, nodes):
    run_distributed(backward_calls_suite, world, seqlen, nodes, 21)


def _plan(tokens, cp, nodes):
    lens = document_spreads(tokens)["corpus"]
    mask = M.causal_document_mask(lens)
    return mask, split_hierarchical(plan(mask, None, cp, balance="sparse", nodes=nodes))


def _global_inputs(p, hq=4, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, p.seqlen, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, p.seqlen, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, p.seqlen, hk, d, generator=g, dtype=torch.float64)
    do = torch.randn(1, p.seqlen, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _layer(p, rank, calls, q, k, v, do, exchange=None):
    """One emulated layer of ``rank`` (the exchange serves the true global K/V, so out and dQ
    are exact; the returned dK/dV are emulated copies): out, dq, dk, dv and the launch counter."""
    ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
    ex = exchange or EmulatedExchange(to_wire(k, v, p.chunk_size), p.cp_size, rank, plan=p)
    prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
    with LaunchCounter() as c:
        out, _ = run_layer(ql, kl, vl, prog, ex, 0.3)
        out.backward(p.shard(do, rank))
    return (out.detach(), ql.grad, kl.grad, vl.grad), c


@pytest.mark.parametrize("cp,nodes", [(2, 1), (4, 1), (4, 2), (8, 2)])
def test_emulated_gradients_match_reference_and_stage(cp, nodes):
    """Every rank, every mode: out and dQ equal the float64 dense reference (GQA, causal document
    mask); dK/dV (own stage plus the emulated returns) equal the "stage" mode's."""
    mask, p = _plan(256 * cp, cp, nodes)
    q, k, v, do = _global_inputs(p)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_r, _ = reference_attention(qr, kr, vr, mask.startend_row_indices, mask.causal, 0.3)
    out_r.backward(do)
    for rank in range(cp):
        stage, _ = _layer(p, rank, "stage", q, k, v, do)
        for calls in MERGED:
            got, _ = _layer(p, rank, calls, q, k, v, do)
            tag = f"cp={cp} nodes={nodes} rank={rank} {calls}"
            assert (got[0] - p.shard(out_r.detach(), rank)).abs().max() < 1e-10, tag
            assert (got[1] - p.shard(qr.grad, rank)).abs().max() < 1e-10, tag
            for a, b in zip(got, stage):
                assert (a - b).abs().max() < 1e-11, tag


@pytest.mark.parametrize("cp,nodes", [(8, 1), (16, 2), (32, 4)])
def test_fewer_kernel_calls_with_one(cp, nodes):
    """The heaviest rank's layer: "one" makes one backward stage call (plus prepare and finish)
    where "stage" makes one per stage, "one+local" two; the runtime's own launches
    do not grow."""
    _, p = _plan(max(4096, 128 * cp), cp, nodes)
    rank = _full_rank(p)
    q, k, v, do = _global_inputs(p, hq=2, hk=1)
    counts = {c: _layer(p, rank, c, q, k, v, do)[1] for c in BACKWARD_CALLS}
    stages = sum(1 for s in p.stages(rank) if s)
    assert stages >= 3
    calls = {c: n.attention_calls for c, n in counts.items()}
    assert calls == {"stage": stages + stages + 2, "one": stages + 1 + 2, "one+local": stages + 2 + 2}
    for c in MERGED:
        assert counts[c].launches <= counts["stage"].launches, (c, counts[c].by_op, counts["stage"].by_op)
        assert counts[c].syncs == 0


def test_merged_program_layout():
    """The merged call's columns are the arrival-order local mask from its first stage on (the
    stages' columns concatenated along the key axis); its pieces follow the backward order and
    cover each round's stage once; ``prepare_rank`` caches one program per resolved mode."""
    _, p = _plan(4096, 8, 2)
    rank = _full_rank(p)
    stage = prepare_rank(p, rank, "cpu", backward_calls="stage")
    assert stage.merged is None and stage.backward_calls == "stage"
    for calls, first in (("one", 0), ("one+local", 1)):
        prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
        m = prog.merged
        assert m.first_stage == first and prog.backward_calls == calls
        want = torch.cat([c for c in stage.stage_cols[first:] if c is not None], dim=2)
        assert torch.equal(m.cols, want)
        assert prog.key_first == first and prog.n_keys * p.chunk_size == want.shape[2]
        assert prog.key_rows.numel() == prog.n_keys
        sent = [t for t, _, _ in m.pieces]  # the backward order, rounds summing relays' returns last
        assert sorted(sent) == sorted(prog.backward_order)
        summing = [t for t in prog.backward_order if prog.rounds[t].children]
        assert summing and sent[-len(summing):] == summing
        assert sent[:-len(summing)] == [t for t in prog.backward_order if t not in summing]
        sizes = {t: z - a for t, a, z in m.pieces}
        assert sizes == {r.index: r.stage_size for r in prog.rounds}
        assert (m.own is not None) == (first == 0)
    auto = prepare_rank(p, rank, "cpu")
    assert auto is prepare_rank(p, rank, "cpu", backward_calls=auto_backward_calls(p))


def test_merged_schedules():
    """ "one": every round is waited for before the one backward call and every return leaves
    after it; "one+local": every
    return is issued between the remote stages' call and the own stage's. With the forward's
    K/V kept (``keep_kv``) the backward starts no K/V round and waits for none."""
    _, p = _plan(4096, 8, 2)
    rank = _full_rank(p)
    for calls in MERGED:
        _kept_backward_has_no_kv_traffic(p, rank, calls)
        log: list = []
        q, k, v, do = _global_inputs(p, hq=2, hk=1)
        ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
        ex = _Recording(to_wire(k, v, p.chunk_size), p.cp_size, rank, plan=p, log=log)
        prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
        out, _ = run_layer(ql, kl, vl, prog, ex, 0.3, backend=_RecordingBackend(log), keep_kv=False)
        split = len(log)
        out.backward(p.shard(do, rank))
        bwd = log[split:]
        n = len(p.rounds)
        attn = [i for i, e in enumerate(bwd) if e == ("attn", "bwd")]
        waits = [i for i, e in enumerate(bwd) if e[0] == "wait" and not e[2]]
        returns = [i for i, e in enumerate(bwd) if e[0] == "start" and e[2]]
        assert len(attn) == (1 if calls == "one" else 2), (calls, bwd)
        assert len(waits) == n and len(returns) == n
        if calls == "one+local":
            assert max(waits) < attn[0] < min(returns) and max(returns) < attn[1], (calls, bwd)
        else:
            assert max(waits) < attn[-1] < min(returns), (calls, bwd)


def _kept_backward_has_no_kv_traffic(p, rank, calls):
    log: list = []
    q, k, v, do = _global_inputs(p, hq=2, hk=1)
    ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
    ex = _Recording(to_wire(k, v, p.chunk_size), p.cp_size, rank, plan=p, log=log)
    prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
    out, _ = run_layer(ql, kl, vl, prog, ex, 0.3, backend=_RecordingBackend(log))
    split = len(log)
    out.backward(p.shard(do, rank))
    bwd = log[split:]
    assert not [e for e in bwd if e[0] in ("start", "wait") and not e[2]], (calls, bwd)
    assert len([e for e in bwd if e[0] == "start" and e[2]]) == len(p.rounds), (calls, bwd)
    assert len([e for e in bwd if e == ("attn", "bwd")]) == (1 if calls == "one" else 2), (calls, bwd)


@pytest.mark.parametrize("cp,nodes", [(4, 1), (8, 2)])
def test_kept_kv_gradients_equal_refetched(cp, nodes):
    """``keep_kv`` (default) and refetching give the same out/dq/dk/dv on every rank, in every
    backward mode, and out/dq equal the float64 reference."""
    mask, p = _plan(256 * cp, cp, nodes)
    q, k, v, do = _global_inputs(p)
    qr = q.clone().requires_grad_()
    out_r, _ = reference_attention(qr, k, v, mask.startend_row_indices, mask.causal, 0.3)
    out_r.backward(do)
    for rank in range(cp):
        for calls in BACKWARD_CALLS:
            res = {}
            for keep in (True, False):
                ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
                ex = EmulatedExchange(to_wire(k, v, p.chunk_size), p.cp_size, rank, plan=p)
                prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
                out, _ = run_layer(ql, kl, vl, prog, ex, 0.3, keep_kv=keep)
                out.backward(p.shard(do, rank))
                res[keep] = (out.detach(), ql.grad, kl.grad, vl.grad)
            tag = f"cp={cp} nodes={nodes} rank={rank} {calls}"
            assert (res[True][0] - p.shard(out_r.detach(), rank)).abs().max() < 1e-10, tag
            assert (res[True][1] - p.shard(qr.grad, rank)).abs().max() < 1e-10, tag
            for a, b in zip(res[True], res[False]):
                assert (a - b).abs().max() < 1e-11, tag


def test_auto_rule_and_bad_values():
    """``"auto"``: "one" for hierarchical plans, "one+local" for flat plans of <= 16 ranks, "stage"
    beyond;
    the scale model resolves "auto" with the same function; bad values are ValueErrors."""
    from benchmarks.scale_model.params import Runtime
    from benchmarks.scale_model.timeline import BWD_CALLS, resolve_bwd_calls
    from flashmask3.train.config import BACKWARD_CALLS_CHOICES

    class View:
        def __init__(self, cp_size, nodes):
            self.cp_size, self.nodes = cp_size, nodes

    rule = {(cp, n): auto_backward_calls(View(cp, n)) for cp, n in ((2, 1), (8, 1), (16, 1), (64, 1),
                                                                    (16, 2), (64, 8))}
    assert rule == {(2, 1): "one+local", (8, 1): "one+local", (16, 1): "one+local", (64, 1): "stage",
                    (16, 2): "one", (64, 8): "one"}
    assert Runtime().bwd_calls == "auto"
    for key, want in rule.items():
        assert resolve_bwd_calls(View(*key), "auto") == want
    assert set(BWD_CALLS) == set(BACKWARD_CALL_MODES) == set(BACKWARD_CALLS_CHOICES)
    _, p = _plan(1024, 4, 1)
    for bad in ("two", "ONE", None):
        with pytest.raises(ValueError, match="backward_calls"):
            prepare_rank(p, 0, "cpu", backward_calls=bad)
    with pytest.raises(ValueError, match="bwd_calls"):
        resolve_bwd_calls(View(8, 1), "two")
