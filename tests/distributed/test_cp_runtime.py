"""The per-layer CP runtime: its device program, launch budget, schedule and checks.

One gloo launch per group size covers correctness (hierarchical 2x2, 2x3 and 3x2 in the
[intra, cross, relay] round structure, flat, every balance, fully masked ranks, GQA with
per-head masks, float64) and the node-layout errors; the rest runs in this process with the
emulated exchange (communication replaced by copies).
"""

from __future__ import annotations

import math

import pytest
import torch

import flashmask3.masks as M
from benchmarks.corpus import document_spreads
from benchmarks.cp_single_gpu import GATHER_KERNEL, RETURNS_KERNEL, STAGED_BACKWARD, Without
from flashmask3.distributed import BACKWARD_CALLS, EmulatedExchange, LaunchCounter, plan, prepare_rank, run_layer
from flashmask3.distributed.comm import node_ids, node_layout_error
from flashmask3.distributed.launches import not_counted
from flashmask3.distributed.runtime import merge_stages, to_wire
from flashmask3.kernels import get_backend
from tests.distributed.harness import run_distributed
from tests.distributed.workers import runtime_suite, split_hierarchical

LAUNCH_BUDGET = 64


def test_runtime_on_gloo_2x2_2x3_3x2_and_node_layout():
    run_distributed(runtime_suite, 4, 128, [2], 11)
    run_distributed(runtime_suite, 6, 192, [2, 3], 12)


def _corpus_plan(tokens, cp, nodes, balance="sparse"):
    mask = M.causal_document_mask(document_spreads(tokens)["corpus"])
    return split_hierarchical(plan(mask, None, cp, balance=balance, nodes=nodes))


def _heaviest_rank(p):
    return max(range(p.cp_size), key=lambda r: (len(p.needed_chunks(r)), r))


def _layer_inputs(p, rank, hq=2, hk=1, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = p.local_seqlen
    q = torch.randn(1, n, hq, d, generator=g, requires_grad=True)
    k = torch.randn(1, n, hk, d, generator=g, requires_grad=True)
    v = torch.randn(1, n, hk, d, generator=g, requires_grad=True)
    full_k = torch.randn(1, p.seqlen, hk, d, generator=g)
    full_v = torch.randn(1, p.seqlen, hk, d, generator=g)
    return q, k, v, EmulatedExchange(to_wire(full_k, full_v, p.chunk_size), p.cp_size, rank, plan=p)


def test_prepare_rank_is_cached_and_matches_the_plan():
    from flashmask3.kernels.static_masks import is_static

    p = _corpus_plan(2048, 4, 2)
    prog = prepare_rank(p, 1, "cpu")
    # the program's columns are its own copies, static (their plans reused under graph capture)
    local = p.local_mask(1, "arrival").startend_row_indices
    assert all(is_static(c) and c.data_ptr() != local.data_ptr() for c in prog.stage_cols if c is not None)
    assert is_static(prog.cols(0, 3)) and not is_static(local)
    # a batch size first seen inside a CUDA graph capture is expanded there and kept nowhere
    from unittest import mock

    with mock.patch.object(torch.Tensor, "is_cuda", property(lambda self: True)), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        first = prog.cols(0, 5)
    assert first is not prog.cols(0, 5) and prog.cols(0, 5) is prog.cols(0, 5)
    assert prepare_rank(p, 1, torch.device("cpu")) is prog
    assert prepare_rank(p, 1, "cpu", "allgather") is not prog
    assert prepare_rank(p, 2, "cpu") is not prog
    stages = p.stages(1)
    assert prog.stage_chunks == [tuple(s) for s in stages]
    for s, cols in enumerate(prog.stage_cols):
        assert (cols is None) == (not stages[s])
        if cols is not None:
            assert cols.shape[2] == len(stages[s]) * p.chunk_size and cols.is_contiguous()
    for r in prog.rounds:  # each stage is gathered from the rows its round receives
        if r.stage_rows is not None:
            got = [c for m in r.recvs for c in m.chunks]
            assert [got[i] for i in r.stage_rows.tolist()] == list(stages[r.index + 1])
    with pytest.raises(ValueError, match="comm"):
        prepare_rank(p, 1, "cpu", "ring")


@pytest.mark.parametrize("nodes", [1, 2])
def test_key_buffer_rows_and_send_views(nodes):
    """The key buffer holds the stages from ``key_first`` on, in stage order, gathered from the
    right rows of the pass's K/V store (own wire rows first where it holds the own stage); every
    direct round's outgoing rows are its messages' chunks in message order, one slice of the own
    wire rows or of the packed payload, which holds each packed round's rows once."""
    p = _corpus_plan(4096, 8, nodes)
    kinds = set()
    for rank in range(p.cp_size):
        for calls in BACKWARD_CALLS:
            prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
            assert prog.key_first == (0 if calls == "one" else 1)
            store = list(prog.own_chunks) if prog.key_first == 0 else []
            for r in prog.rounds:
                store += [c for m in r.recvs for c in m.chunks]
            held = [list(s) for s in prog.stage_chunks[prog.key_first:]]
            rows = [] if prog.key_rows is None else prog.key_rows.tolist()
            assert [store[i] for i in rows] == [c for s in held for c in s]
            assert list(prog.key_starts) == [sum(len(s) for s in held[:i]) for i in range(len(held) + 1)]
            own = list(prog.own_chunks)
            pack = [] if prog.pack_rows is None else [own[i] for i in prog.pack_rows.tolist()]
            slices = []
            for r in prog.rounds:
                if r.source is not None or not r.n_send:
                    assert r.send_slice is None
                    continue
                is_packed, a, b = r.send_slice
                assert (pack if is_packed else own)[a:b] == [c for m in r.sends for c in m.chunks]
                kinds.add(is_packed)
                if is_packed:
                    slices.append((a, b))
            assert sum(b - a for a, b in slices) == len(pack)  # every packed row serves one round
            assert prog.sends_own_rows == any(r.send_slice and not r.send_slice[0] for r in prog.rounds)
    assert True in kinds, kinds  # the corpus plans pack some rounds


@pytest.mark.parametrize("cp", [8, 32, 128])
def test_launch_budget_per_layer(cp):
    """Forward + backward of the heaviest rank with communication emulated: at most 64 kernel
    launches outside the attention calls, no host sync, for flat and hierarchical routing."""
    for nodes, comm in ((1, "overlap"), (max(2, cp // 8), "overlap"), (1, "allgather")):
        p = _corpus_plan(max(4096, 128 * cp), cp, nodes)
        rank = _heaviest_rank(p)
        prog = prepare_rank(p, rank, "cpu", comm)
        q, k, v, ex = _layer_inputs(p, rank)
        do = torch.randn_like(q)
        with LaunchCounter() as c:
            out, _ = run_layer(q, k, v, prog, ex, 0.35)
            out.backward(do)
        stages = sum(1 for s in prog.stage_chunks if s)
        tag = f"cp={cp} nodes={nodes} {comm} {prog.backward_calls}: {c.launches} launches {dict(c.by_op)}"
        assert c.launches <= LAUNCH_BUDGET, tag
        assert c.syncs == 0, tag
        # overlap: a forward call per stage, backward calls by backward_calls (tests/distributed/
        # test_cp_backward_calls.py), one backward prepare and finish
        two = stages and (bool(prog.stage_chunks[0]) + (stages > bool(prog.stage_chunks[0])))
        bwd = {"stage": stages, "one": 1, "one+local": two}
        want = 2 * stages if comm == "allgather" else stages + bwd[prog.backward_calls] + 2
        assert c.attention_calls == want, tag
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


class _Recording(EmulatedExchange):
    """The emulated exchange, logging when each round starts and is waited for."""

    def __init__(self, *a, log, **kw):
        super().__init__(*a, **kw)
        self.log = log

    def start(self, rnd, reverse, send, recv):
        super().start(rnd, reverse, send, recv)
        self.log.append(("start", rnd.index, reverse))
        log = self.log

        class Handle:
            def wait(self):
                log.append(("wait", rnd.index, reverse))
        return Handle()


class _RecordingBackend:
    def __init__(self, log):
        self.log, self.b = log, get_backend("torch")

    def forward(self, *a):
        self.log.append(("attn", "fwd"))
        return self.b.forward(*a)

    def backward(self, *a):
        self.log.append(("attn", "bwd"))
        return self.b.backward(*a)


def _schedule(p, rank, backward_calls="stage"):
    log: list = []
    q, k, v, ex = _layer_inputs(p, rank)
    ex = _Recording(ex.wire, p.cp_size, rank, plan=p, log=log)
    prog = prepare_rank(p, rank, "cpu", backward_calls=backward_calls)
    out, _ = run_layer(q, k, v, prog, ex, 0.35, backend=_RecordingBackend(log), keep_kv=False)
    split = len(log)
    out.backward(torch.randn_like(out))
    return log[:split], log[split:]


def _attn_after(log, event):
    """Index of the first attention call after ``event``."""
    i = log.index(event)
    return next(j for j in range(i, len(log)) if log[j][0] == "attn")


def _full_rank(p):
    """A rank with every stage non-empty (the strongest schedule check)."""
    full = [r for r in range(p.cp_size) if all(p.stages(r))]
    assert full, "test plan has no rank with every stage non-empty"
    return full[0]


def test_flat_backward_returns_each_stage_while_later_stages_compute():
    p = _corpus_plan(4096, 8, 1)
    rank = _full_rank(p)
    _, bwd = _schedule(p, rank)
    n = len(p.rounds)
    attn = [i for i, e in enumerate(bwd) if e[0] == "attn"]
    assert len(attn) == n + 1
    for t in range(n - 1):  # round t's gradients leave before stage t+2 computes
        assert bwd.index(("start", t, True)) < attn[t + 2]


def test_hierarchical_schedule_overlaps_both_ways():
    p = _corpus_plan(4096, 8, 2)
    relay = [t for t, r in enumerate(p.rounds) if r.relay]
    cross = [t for t, r in enumerate(p.rounds) if not r.relay and
             any(tr.src // 4 != tr.dst // 4 for tr in r.transfers)]
    intra = [t for t, r in enumerate(p.rounds) if not r.relay and t not in cross]
    assert len(relay) == len(cross) == len(intra) == 1
    (i0,), (c0,), (r0,) = intra, cross, relay
    rank = _full_rank(p)
    fwd, bwd = _schedule(p, rank)
    # forward: the first remote stage computes before the cross-node round is waited for
    assert _attn_after(fwd, ("wait", i0, False)) < fwd.index(("wait", c0, False))
    assert fwd.index(("wait", c0, False)) < fwd.index(("start", r0, False))  # relay after its source
    # backward: the relay's returns are summed before the cross-node return leaves, and that
    # return is under way while the intra-node stage still computes
    assert bwd.index(("wait", r0, True)) < bwd.index(("start", c0, True))
    last_attn = max(i for i, e in enumerate(bwd) if e[0] == "attn")
    assert bwd.index(("start", c0, True)) < last_attn
    assert bwd.index(("start", c0, True)) < _attn_after(bwd, ("wait", i0, False))


def test_merge_stages_keeps_float64():
    """Partial attentions over disjoint key sets (float64, with fully masked rows in some parts
    and in all) merge to the whole attention at float64 accuracy."""
    g = torch.Generator().manual_seed(3)
    b, s, h, d, n = 2, 24, 3, 8, 40
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    allowed = torch.rand(b, h, s, n, generator=g) < 0.5
    allowed[:, :, :3] = False  # rows masked everywhere
    allowed[:, :, 3:6, :20] = False  # rows masked in the first part only
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).masked_fill(~allowed, -math.inf)

    def attend(cols):
        sc = scores[..., cols]
        lse = torch.logsumexp(sc, -1)
        p = torch.exp(sc - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1))
        return torch.einsum("bhqk,bkhd->bqhd", p, v[:, cols]), lse

    want_out, want_lse = attend(slice(0, n))
    parts = [attend(slice(a, z)) for a, z in ((0, 20), (20, 33), (33, n))]
    out, lse = merge_stages([o for o, _ in parts], [l for _, l in parts], torch.float64)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert (out - want_out).abs().max() < 1e-13
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max() < 1e-13
    assert out[:, :3].abs().max() == 0


def test_node_layout_rules():
    assert node_layout_error([0, 0, 1, 1], 2) is None
    assert node_layout_error([5, 5, 2, 2, 7, 7], 3) is None
    assert "node-major" in node_layout_error([0, 1, 0, 1], 2)
    assert "node-major" in node_layout_error([0, 0, 0, 0], 2)  # one node, plan says two
    assert node_ids([4, 5, 6, 7], 2) == [2, 2, 3, 3]
    assert node_ids([0, 1], [3, 9]) == [3, 9]
    assert node_ids([0, 1], lambda g: -g) == [0, -1]
    with pytest.raises(ValueError, match="every global rank"):
        node_ids([0, 5], [0, 1])
    with pytest.raises(TypeError):
        node_ids([0, 1], True)


def _record_triton_launches(monkeypatch) -> list:
    """Every Triton launch of the kernel modules, by kernel name (the real launch still runs):
    the modules' ``launch`` calls and the prepared launches (``launcher.Bound``), whose first
    call goes through ``launcher.launch`` itself, not a module's name for it."""
    from flashmask3.kernels import gluon_bwd, gluon_fwd, launcher, returns, tiles, tl_kernels

    names: list = []

    def name_of(kernel) -> str:
        return kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)

    for mod in (tl_kernels, tiles, gluon_bwd, gluon_fwd, returns):
        if not hasattr(mod, "launch"):
            continue
        real = mod.launch

        def launch(kernel, grid, *args, _real=real, **kwargs):
            names.append(name_of(kernel))
            with not_counted():  # the interpreter's own tensor copies are not launches
                return _real(kernel, grid, *args, **kwargs)

        monkeypatch.setattr(mod, "launch", launch)
    for method in ("__call__", "once"):
        real = getattr(launcher.Bound, method)

        def bound(self, *tensors, _real=real):
            names.append(name_of(self.kernel))
            with not_counted():
                return _real(self, *tensors)

        monkeypatch.setattr(launcher.Bound, method, bound)
    return names


def _backward_launches(p, rank, backend, triton_names, backward_calls="stage"):
    """All launches of the second layer's backward (plans cached by the first): the runtime's
    aten ops, the backend's aten ops and its Triton kernels; and its dQ, dK, dV."""
    prog = prepare_rank(p, rank, "cpu", backward_calls=backward_calls)
    q, k, v, ex = _layer_inputs(p, rank, d=16, seed=5)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        out, _ = run_layer(q, k, v, prog, ex, 0.25, backend=backend)
        triton_names.clear()
        with LaunchCounter() as c:
            out.backward(do)
    return {"runtime": c.launches, "backend_aten": c.attention_launches,
            "triton": list(triton_names), "total": c.launches + c.attention_launches + len(triton_names),
            "grads": (q.grad, k.grad, v.grad)}


def test_staged_backward_launches_per_layer(monkeypatch):
    """The Triton backend (split backward: the interpreter's dispatch) in the runtime, one rank
    of a cp-4 corpus plan: the staged backward runs the delta pre-pass once per layer instead of
    once per stage, and gives the same gradients as a whole backward per stage. (The fused
    backward also drops a dQ memset and a scaling pass per extra stage: tests/kernels/
    test_staged.py counts those.)"""
    T = pytest.importorskip("flashmask3.kernels.triton_backend")
    if T.unsupported_reason(torch.empty(1, 1, 1, 16)) is not None:
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    names = _record_triton_launches(monkeypatch)
    p = _corpus_plan(1024, 4, 1)
    rank = _full_rank(p)
    stages = sum(1 for s in prepare_rank(p, rank, "cpu").stage_chunks if s)
    before = _backward_launches(p, rank, Without(T, STAGED_BACKWARD), names)
    after = _backward_launches(p, rank, T, names)
    print(f"backward launches per layer, {stages} stages: per-stage backward {before['total']} "
          f"({before['runtime']} runtime + {before['backend_aten']} backend aten + "
          f"{len(before['triton'])} Triton), staged {after['total']} ({after['runtime']} + "
          f"{after['backend_aten']} + {len(after['triton'])})")
    assert before["triton"].count("_bwd_pre_kernel") == stages
    assert after["triton"].count("_bwd_pre_kernel") == 1
    assert after["total"] == before["total"] - (stages - 1)
    for g_after, g_before in zip(after["grads"], before["grads"]):
        assert (g_after - g_before).abs().max() <= 1e-5 * g_before.abs().max()


@pytest.mark.parametrize("nodes,calls", [(1, "stage"), (1, "one"), (2, "stage"), (2, "one")])
def test_one_launch_gradient_returns_equal_the_torch_sum(nodes, calls):
    """The overlapped backward with the returned gradients summed by kernels/returns.py (the
    Triton backend, interpreter) gives the dK/dV of the torch ops' sum, for the first three
    sending ranks of a cp-8 corpus plan, flat and hierarchical (relays), stage-by-stage and merged backward calls
    (the own stage's rows in arrival order), and the same dQ and output."""
    T = pytest.importorskip("flashmask3.kernels.triton_backend")
    if T.unsupported_reason(torch.empty(1, 1, 1, 16)) is not None:
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    p = _corpus_plan(1024, 8, nodes)
    checked = 0
    for rank in range(p.cp_size):
        prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
        if not prog.n_direct_send:
            continue
        grads = []
        for backend in (T, Without(T, RETURNS_KERNEL)):
            q, k, v, ex = _layer_inputs(p, rank, hq=2, hk=1, d=16, seed=rank)
            out, _ = run_layer(q, k, v, prog, ex, 0.25, backend=backend)
            out.backward(torch.ones_like(out))
            grads.append((out.detach(), q.grad, k.grad, v.grad))
        for fused, ref in zip(*grads):
            assert (fused - ref).abs().max() <= 1e-5 * max(ref.abs().max(), 1.0)
        checked += 1
        if checked == 3:  # (the interpreter is slow: three sending ranks a case)
            break
    assert checked >= 2


class _SentReturns(EmulatedExchange):
    """The emulated exchange, keeping a copy of every gradient return a rank sends."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.sent: dict[int, torch.Tensor] = {}

    def start(self, rnd, reverse, send, recv):
        if reverse and send is not None:
            self.sent[rnd.index] = send.detach().clone()
        return super().start(rnd, reverse, send, recv)


class _Sent(EmulatedExchange):
    """The emulated exchange, keeping every forward direct round's outgoing rows as given."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.sent: dict[int, torch.Tensor] = {}

    def start(self, rnd, reverse, send, recv):
        if not reverse and not rnd.relay:
            self.sent[rnd.index] = send
        return super().start(rnd, reverse, send, recv)


@pytest.mark.parametrize("nodes", [1, 2])
def test_direct_rounds_send_views_of_their_chunks_kv(nodes):
    """What an exchange gets to send for a direct round is a view (no copy of its own: one
    pack per pass built every packed row) holding the rank's K/V of the round's chunks, in
    message order; a round without outgoing rows gets None."""
    p = _corpus_plan(4096, 8, nodes)
    for rank in range(p.cp_size):
        prog = prepare_rank(p, rank, "cpu")
        q, k, v, ex = _layer_inputs(p, rank, seed=rank)
        ex = _Sent(ex.wire, p.cp_size, rank, plan=p)
        run_layer(q, k, v, prog, ex, 0.35)
        own = to_wire(k.detach(), v.detach(), p.chunk_size)
        pos = {c: i for i, c in enumerate(prog.own_chunks)}
        for r in prog.rounds:
            if r.relay:
                continue
            send = ex.sent[r.index]
            if not r.n_send:
                assert send is None
                continue
            assert send._base is not None and send.shape[0] == r.n_send
            want = own[[pos[c] for m in r.sends for c in m.chunks]]
            assert torch.equal(send, want), (rank, r.index)


@pytest.mark.parametrize("calls", ["stage", "one"])
def test_relay_returns_summed_by_one_launch_equal_the_torch_sum(calls):
    """On a hierarchical plan, what a relaying rank sends back for a round (its stage's dK/dV
    plus what its node's ranks returned for the chunks it relayed) summed by
    ``sum_wire_rows`` (kernels/returns.py, the Triton backend under the interpreter) equals
    the torch ops' fp32 sum, for every round it returns, and so do its own gradients."""
    T = pytest.importorskip("flashmask3.kernels.triton_backend")
    if T.unsupported_reason(torch.empty(1, 1, 1, 16)) is not None:
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    p = _corpus_plan(2048, 8, 2)
    checked = 0
    for rank in range(p.cp_size):
        prog = prepare_rank(p, rank, "cpu", backward_calls=calls)
        summed = [r.index for r in prog.rounds if r.sum_index is not None and r.stage_size
                  and any(prog.rounds[c].n_send for c in r.children)]
        if not summed:  # (a rank whose return sums its stage and its node's returns)
            continue
        runs = []
        for backend in (T, Without(T, RETURNS_KERNEL)):
            q, k, v, ex = _layer_inputs(p, rank, hq=2, hk=1, d=16, seed=rank)
            ex = _SentReturns(ex.wire, p.cp_size, rank, plan=p)
            out, _ = run_layer(q, k, v, prog, ex, 0.25, backend=backend)
            out.backward(torch.ones_like(out))
            runs.append((ex.sent, (q.grad, k.grad, v.grad)))
        (fused, fused_grads), (ref, ref_grads) = runs
        assert set(fused) == set(ref) and set(summed) <= set(ref)
        for t in ref:
            assert fused[t].dtype == ref[t].dtype
            assert (fused[t] - ref[t]).abs().max() <= 1e-5 * max(ref[t].abs().max(), 1.0), t
        for a, b in zip(fused_grads, ref_grads):
            assert (a - b).abs().max() <= 1e-5 * max(b.abs().max(), 1.0)
        checked += 1
        if checked == 2:  # (the interpreter is slow)
            break
    assert checked == 2


@pytest.mark.parametrize("nodes,comm,calls,keep", [(1, "overlap", "stage", True), (1, "overlap", "one", False),
                                                   (2, "overlap", "stage", False),
                                                   (2, "overlap", "one+local", True),
                                                   (2, "overlap", "one", True), (1, "allgather", "stage", True)])
def test_gather_kernel_in_the_runtime_equals_the_torch_gather(nodes, comm, calls, keep):
    """The stages' keys gathered by kernels/gather.py (the Triton backend, interpreter) give
    bitwise the same output and gradients as the torch gather, overlapped (each backward_calls
    mode, the K/V kept or fetched again) and all-gathered, for a rank of a cp-8 corpus plan
    with every stage non-empty."""
    T = pytest.importorskip("flashmask3.kernels.triton_backend")
    if T.unsupported_reason(torch.empty(1, 1, 1, 16)) is not None:
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    p = _corpus_plan(1024, 8, nodes)
    rank = _full_rank(p)
    prog = prepare_rank(p, rank, "cpu", comm, backward_calls=calls)
    grads = []
    for backend in (T, Without(T, GATHER_KERNEL)):
        q, k, v, ex = _layer_inputs(p, rank, hq=2, hk=1, d=16, seed=rank)
        out, _ = run_layer(q, k, v, prog, ex, 0.25, backend=backend, keep_kv=keep)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for fused, ref in zip(*grads):
        assert torch.equal(fused, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("nodes,comm,calls", [(1, "overlap", "stage"), (1, "overlap", "one"),
                                              (2, "overlap", "stage"), (2, "overlap", "one+local"),
                                              (1, "allgather", "auto")])
def test_gpu_cp_layer_cuda_graph_replays_with_new_inputs(nodes, comm, calls):
    """One rank's layer (forward + the q/k/v gradients through the staged runtime, the exchange
    emulated by device copies) captured once in a CUDA graph and replayed with new q/k/v/dout
    and new remote K/V gives the eager layer's result on those inputs, and its output is the
    single-device attention's rows of that rank."""
    import flashmask3
    from flashmask3.graphs import capture
    from tests.reference import rel_err

    tokens, hq, hk, d = 16384, 4, 2, 128
    mask = M.causal_document_mask(document_spreads(tokens)["corpus"])
    p = split_hierarchical(plan(mask, None, 8, balance="sparse", nodes=nodes))
    rank = _full_rank(p)
    prog = prepare_rank(p, rank, "cuda", comm, backward_calls=calls)

    def full_inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(1, tokens, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
                for h in (hq, hk, hk, hq)]

    fq, fk, fv, fdo = full_inputs(1)
    q, k, v = (p.shard(t, rank).clone().requires_grad_() for t in (fq, fk, fv))
    do = p.shard(fdo, rank).clone()
    ex = EmulatedExchange(to_wire(fk, fv, p.chunk_size), p.cp_size, rank, plan=p)
    eq, ek, ev = (t.detach().requires_grad_() for t in (q, k, v))  # the eager layer's own leaves

    def step(q, k, v):
        out, _ = run_layer(q, k, v, prog, ex, d ** -0.5)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    graph, captured = capture(step, q, k, v)
    for seed in (2, 3):
        fq, fk, fv, fdo = full_inputs(seed)
        with torch.no_grad():
            for dst, src in ((q, fq), (k, fk), (v, fv), (do, fdo)):
                dst.copy_(p.shard(src, rank))
            to_wire(fk, fv, p.chunk_size, out=ex.wire)
        graph.replay()
        eager = step(eq, ek, ev)
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):  # (the fused dQ's fp32 atomics: not bitwise)
            assert rel_err(got, want) < 1e-2
        ref = flashmask3.flashmask_attention(fq, fk, fv, mask.to("cuda"))
        assert rel_err(captured[0], p.shard(ref, rank)) < 2e-2


@pytest.mark.gpu
def test_gpu_cp_layer_under_make_graphed_callables():
    """``torch.cuda.make_graphed_callables`` around a function calling the runtime (forward and
    backward captured as two graphs): calls with new q/k/v/dout and new remote K/V give the eager
    layer's output and gradients."""
    from tests.reference import rel_err

    tokens, hq, hk, d = 16384, 4, 2, 128
    p = plan(M.causal_document_mask(document_spreads(tokens)["corpus"]), None, 8, balance="sparse")
    rank = _full_rank(p)
    prog = prepare_rank(p, rank, "cuda", "overlap")

    def full_inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(1, tokens, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
                for h in (hq, hk, hk, hq)]

    fq, fk, fv, _ = full_inputs(1)
    ex = EmulatedExchange(to_wire(fk, fv, p.chunk_size), p.cp_size, rank, plan=p)

    def layer(q, k, v):
        return run_layer(q, k, v, prog, ex, d ** -0.5)[0]

    graphed = torch.cuda.make_graphed_callables(
        layer, tuple(p.shard(t, rank).clone().requires_grad_() for t in (fq, fk, fv)))
    for seed in (2, 3):
        fq, fk, fv, fdo = full_inputs(seed)
        with torch.no_grad():
            to_wire(fk, fv, p.chunk_size, out=ex.wire)
        do = p.shard(fdo, rank)
        runs = []
        for fn in (graphed, layer):
            q, k, v = (p.shard(t, rank).clone().requires_grad_() for t in (fq, fk, fv))
            out = fn(q, k, v)
            out.backward(do)
            runs.append((out.detach(), q.grad, k.grad, v.grad))
        torch.cuda.synchronize()
        for got, want in zip(*runs):
            assert rel_err(got, want) < 1e-2
