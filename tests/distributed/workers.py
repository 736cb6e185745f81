"""Functions run on every rank by tests/distributed (must be importable by spawned children)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashmask3 import flashmask_attention
from flashmask3.distributed import BACKWARD_CALL_MODES, cp_flashmask_attention, plan
from tests.helpers import named_masks

B, HQ, HK, D = 2, 4, 2, 16


def _inputs(seqlen, seed, dtype=torch.float32):
    """Fresh random q, k, v, dout: identical on every rank (same seed)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seqlen, HQ, D, generator=g, dtype=dtype)
    k = torch.randn(B, seqlen, HK, D, generator=g, dtype=dtype)
    v = torch.randn(B, seqlen, HK, D, generator=g, dtype=dtype)
    do = torch.randn(B, seqlen, HQ, D, generator=g, dtype=dtype)
    return q, k, v, do


def _reference(q, k, v, do, mask):
    """Single-process flashmask_attention on the full sequence: out, lse, dq, dk, dv."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flashmask_attention(q, k, v, mask, return_softmax_lse=True)
    out.backward(do)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _run_cp(q, k, v, do, p, rank, comm, group=None, with_lse=False, node_layout=None):
    """CP attention of ``rank``'s shards and its gradients. ``node_layout`` defaults to GPUs per
    node = cp_size // nodes over the group's global ranks (every rank "on" its plan node)."""
    ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
    if node_layout is None:
        node_layout = p.cp_size // p.nodes
    res = cp_flashmask_attention(ql, kl, vl, p, group=group, comm=comm, return_softmax_lse=with_lse,
                                 node_layout=node_layout)
    out = res[0] if with_lse else res
    out.backward(p.shard(do, rank))
    return out.detach(), ql.grad, kl.grad, vl.grad, (res[1].detach() if with_lse else None)


def _close(name, got, want, tag):
    if not torch.allclose(got, want, rtol=2e-4, atol=2e-5):
        err = (got - want).abs().max().item()
        raise AssertionError(f"{tag}: {name} differs from single-process attention (max abs err {err:.3g})")


def check_configs(rank, world, seqlen, mask_names, balances, comms, nodes_list, chunk_sizes, seed):
    """Compare CP attention (outputs, dq, dk, dv) with single-process attention for every
    combination; raise AssertionError naming the first failing configuration."""
    masks = named_masks(seqlen, batch_size=B, num_heads=HK)
    count = 0
    for i, name in enumerate(mask_names):
        mask = masks[name]
        q, k, v, do = _inputs(seqlen, seed + i)
        ref = _reference(q, k, v, do, mask)
        for balance in balances:
            for nodes in nodes_list:
                for chunk in chunk_sizes:
                    p = plan(mask, None, world, balance=balance, chunk_size=chunk, nodes=nodes)
                    for comm in comms:
                        tag = f"rank {rank} mask={name} balance={balance} comm={comm} nodes={nodes} chunk={chunk}"
                        out, dq, dk, dv, _ = _run_cp(q, k, v, do, p, rank, comm)
                        for label, got, want in (("out", out, ref[0]), ("dq", dq, ref[2]),
                                                 ("dk", dk, ref[3]), ("dv", dv, ref[4])):
                            _close(label, got, p.shard(want, rank), tag)
                        count += 1
    assert count > 0


def check_mesh_and_lse(rank, world, seqlen, seed):
    """A DeviceMesh (and a (mesh, dim) pair) as the group; the returned LSE and its gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    mask = named_masks(seqlen, batch_size=B, num_heads=HK)["causal_document"]
    q, k, v, do = _inputs(seqlen, seed)
    g = torch.Generator().manual_seed(seed + 1)
    dlse = torch.randn(B, HQ, seqlen, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_r, lse_r = flashmask_attention(qr, kr, vr, mask, return_softmax_lse=True)
    ((out_r * do).sum() + (torch.where(torch.isinf(lse_r), 0, lse_r) * dlse).sum()).backward()
    for group in (mesh, (mesh, "cp")):
        for comm in ("overlap", "allgather"):
            p = plan(mask, None, world, balance="sparse")
            ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
            out, lse = cp_flashmask_attention(ql, kl, vl, p, group=group, comm=comm,
                                              return_softmax_lse=True)
            dl = p.shard(dlse, rank, dim=2)
            ((out * p.shard(do, rank)).sum() + (torch.where(torch.isinf(lse), 0, lse) * dl).sum()).backward()
            tag = f"rank {rank} mesh group={type(group).__name__} comm={comm}"
            _close("out", out.detach(), p.shard(out_r.detach(), rank), tag)
            _close("lse", lse.detach(), p.shard(lse_r.detach(), rank, dim=2), tag)
            for label, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                                     ("dv", vl.grad, vr.grad)):
                _close(label, got, p.shard(want, rank), tag)


def fail_on_rank_one(rank, world):
    """Rank 1 raises while the others wait in a collective: the error must surface, no hang."""
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))


def mismatched_plans(rank, world, seqlen):
    """Ranks that planned from different masks get a ValueError with check_plan, not a hang;
    identical plans pass the check."""
    masks = named_masks(seqlen)
    q, k, v, _ = _inputs(seqlen, 0)
    same = plan(masks["causal_document"], None, world)
    _run_cp(q, k, v, torch.ones_like(q), same, rank, "overlap")  # warm: no check
    out = cp_flashmask_attention(same.shard(q, rank), same.shard(k, rank), same.shard(v, rank), same,
                                 check_plan=True)
    assert out.shape[1] == seqlen // world
    mine = plan(masks["causal_document" if rank == 0 else "sliding_window"], None, world)
    try:
        cp_flashmask_attention(mine.shard(q, rank), mine.shard(k, rank), mine.shard(v, rank), mine,
                               check_plan=True)
    except ValueError as e:
        assert "different CP plans" in str(e)
    else:
        raise AssertionError("expected ValueError for plans that differ across ranks")


def wrong_group_size(rank, world, seqlen):
    """A plan for a different cp_size is a ValueError on every rank (before any traffic)."""
    mask = named_masks(seqlen)["causal"]
    p = plan(mask, None, world * 2, balance="contiguous")
    x = torch.randn(1, seqlen // (world * 2), 2, 8)
    try:
        cp_flashmask_attention(x, x, x, p)
    except ValueError as e:
        assert "cp_size" in str(e)
    else:
        raise AssertionError("expected ValueError for a plan of the wrong cp_size")


def stuck_rank(rank, world):
    """Rank 1 never joins the collective: the run must end with an error, not hang."""
    if rank == 1:
        import time

        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def check_submesh(rank, world, seqlen, seed):
    """CP over the 'cp' dimension of a 2-D (dp, cp) DeviceMesh: group ranks differ from global
    ranks, so point-to-point peers must be addressed within the group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    cp_group = mesh.get_group("cp")
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    dp_rank = mesh.get_local_rank("dp")
    masks = named_masks(seqlen, batch_size=B, num_heads=HK)
    name = ["causal_document", "sliding_window"][dp_rank]  # each replica its own mask
    q, k, v, do = _inputs(seqlen, seed + dp_rank)
    ref = _reference(q, k, v, do, masks[name])
    for group in ((mesh, "cp"), mesh["cp"], cp_group):
        for comm in ("overlap", "allgather"):
            for nodes in (1, 2):
                p = plan(masks[name], None, cp_size, balance="sparse", nodes=nodes)
                out, dq, dk, dv, _ = _run_cp(q, k, v, do, p, cp_rank, comm, group=group)
                tag = f"rank {rank} (dp {dp_rank}, cp {cp_rank}) group={type(group).__name__} {comm} nodes={nodes}"
                for label, got, want in (("out", out, ref[0]), ("dq", dq, ref[2]), ("dk", dk, ref[3]),
                                         ("dv", dv, ref[4])):
                    _close(label, got, p.shard(want, cp_rank), tag)


def cp4_suite(rank, world, seqlen, masks, balances, comms, nodes_list, chunk_sizes, seed):
    """Everything that needs 4 ranks, in one process group."""
    check_configs(rank, world, seqlen, masks, balances, comms, nodes_list, chunk_sizes, seed)
    check_submesh(rank, world, seqlen, seed)


def abort_in_teardown(rank, world):
    """Pass, then die in C++-like fashion while the group is being destroyed (rank 1 only)."""
    import os

    import torch.distributed as dist

    if rank == 1:
        dist.destroy_process_group = lambda *a, **k: os.abort()


def abort_before_barrier(rank, world):
    """Die without a Python error before the final barrier (rank 1 only), once rank 0 waits in
    it, so rank 0 records a Python "connection closed" echo."""
    import os
    import time

    if rank == 1:
        time.sleep(1.0)
        os.abort()


def abort_on_first_attempt(rank, world, marker):
    """Rank 1 dies from a signal the first time it runs (``marker`` does not exist yet)."""
    import os

    import time

    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(1.0)  # rank 0 is in the final barrier: it records an echo error
        os.abort()


# -- the runtime: hierarchical round structure, fully masked ranks, float64, node layout --------


def split_hierarchical(p):
    """Give a hierarchical plan the round structure [intra direct, cross direct, relay] of
    docs/context-parallel.md if its planner still mixes intra- and cross-node transfers in one
    direct round (an older plan.py); plans that already separate them (or have only one kind,
    as a narrow window's plan may) are returned as they are."""
    from flashmask3.distributed import Round

    if p.nodes == 1:
        return p
    g = p.cp_size // p.nodes
    direct = [r for r in p.rounds if not r.relay]
    if len(direct) != 1:
        return p
    intra = tuple(t for t in direct[0].transfers if t.src // g == t.dst // g)
    cross = tuple(t for t in direct[0].transfers if t.src // g != t.dst // g)
    if not intra or not cross:
        return p
    relays = [r for r in p.rounds if r.relay]
    p.rounds = [Round(intra, False), Round(cross, False)] + [Round(r.transfers, True, 1) for r in relays]
    return p


def _half_masked(seqlen):
    """A non-causal mask whose rows past the middle see no key: ranks holding only those rows
    are fully masked (zeros out, zero gradients), the others attend over everything."""
    from flashmask3.masks import FlashMask

    cols = torch.zeros(1, 1, seqlen, 2, dtype=torch.int32)
    cols[..., 0] = seqlen // 2
    return FlashMask(cols, False, seqlen)


def _check_against(ref, p, rank, got, tag, rtol=2e-4, atol=2e-5):
    for label, g, want in zip(("out", "dq", "dk", "dv"), got, (ref[0], ref[2], ref[3], ref[4])):
        w = p.shard(want, rank)
        if not torch.allclose(g, w.to(g.dtype), rtol=rtol, atol=atol):
            raise AssertionError(f"{tag}: {label} differs from the float64 reference "
                                 f"(max abs err {(g - w).abs().max().item():.3g})")


def runtime_suite(rank, world, seqlen, node_counts, seed):
    """The reworked runtime on ``world`` gloo ranks against the float64 dense reference:
    hierarchical plans in the [intra, cross, relay] structure for every node count in
    ``node_counts`` and flat plans, every balance, GQA with per-head masks (Hm = Hk = 2 < Hq),
    a mask with fully masked ranks, float64 inputs; then the node-layout check."""
    from tests.reference import reference_attention

    masks = named_masks(seqlen, batch_size=B, num_heads=HK)
    cases = {"causal_document": masks["causal_document"], "random_eviction": masks["random_eviction"],
             "half_masked": _half_masked(seqlen)}
    for i, (name, mask) in enumerate(cases.items()):
        for dtype in (torch.float32, torch.float64):
            q, k, v, do = _inputs(seqlen, seed + i, dtype)
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            out_r, lse_r = reference_attention(qr, kr, vr, mask.startend_row_indices, mask.causal)
            out_r.backward(do.to(torch.float64))
            ref = (out_r.detach(), lse_r, qr.grad, kr.grad, vr.grad)
            # float64 stays float64 end to end (the torch backend's LSE included)
            tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else {}
            for balance in ("contiguous", "dual_chunk", "sparse"):
                for nodes in (1, *node_counts):
                    p = split_hierarchical(plan(mask, None, world, balance=balance, nodes=nodes))
                    for comm in ("overlap", "allgather"):
                        got = _run_cp(q, k, v, do, p, rank, comm)[:4]
                        tag = f"rank {rank} {name} {dtype} {balance} nodes={nodes} {comm}"
                        _check_against(ref, p, rank, got, tag, **tol)
    check_node_layout_errors(rank, world, seqlen)


def check_node_layout_errors(rank, world, seqlen):
    """A hierarchical plan on a group that is not node-major raises ValueError on every rank,
    never a hang: an interleaved layout, no layout at all, and ranks that disagree."""
    import os

    mask = named_masks(seqlen)["causal_document"]
    p = plan(mask, None, world, balance="sparse", nodes=2)
    x = torch.randn(1, seqlen // world, 2, 8)
    interleaved = [r % 2 for r in range(world)]
    disagree = list(range(world)) if rank == 0 else [r // (world // 2) for r in range(world)]
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    for layout, words in ((interleaved, "node-major"), (None, "LOCAL_WORLD_SIZE"), (disagree, "node")):
        try:
            cp_flashmask_attention(x, x, x, p, node_layout=layout)
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: node_layout={layout} should be refused")
    os.environ["LOCAL_WORLD_SIZE"] = str(world // 2)  # torchrun's variable: node-major, accepted
    out = cp_flashmask_attention(x, x, x, p)
    assert out.shape == x.shape


# -- the backward's calls (backward_calls) ----------------------------------------------------------


def _run_calls(q, k, v, do, p, rank, backward_calls, keep_kv=True):
    """``_run_cp`` (overlap) with ``backward_calls`` and ``keep_kv``: out, dq, dk, dv of
    ``rank``'s shards."""
    ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
    out = cp_flashmask_attention(ql, kl, vl, p, comm="overlap", node_layout=p.cp_size // p.nodes,
                                 backward_calls=backward_calls, keep_kv=keep_kv)
    out.backward(p.shard(do, rank))
    return out.detach(), ql.grad, kl.grad, vl.grad


def backward_calls_suite(rank, world, seqlen, node_counts, seed):
    """Every ``backward_calls`` on ``world`` gloo ranks, float64 end to end: document masks
    (causal and not), GQA (Hq = 4, Hk = 2), flat plans and hierarchical ones for every node count
    in ``node_counts``: out/dq/dk/dv match the float64 dense reference, and every merged mode
    matches "stage" to rounding; then a bad value is a ValueError on every rank."""
    from tests.reference import reference_attention

    masks = named_masks(seqlen, batch_size=B, num_heads=HK)
    for i, name in enumerate(("causal_document", "document")):
        mask = masks[name]
        q, k, v, do = _inputs(seqlen, seed + i, torch.float64)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out_r, lse_r = reference_attention(qr, kr, vr, mask.startend_row_indices, mask.causal)
        out_r.backward(do)
        ref = (out_r.detach(), lse_r, qr.grad, kr.grad, vr.grad)
        for balance in ("dual_chunk", "sparse"):
            for nodes in (1, *node_counts):
                p = plan(mask, None, world, balance=balance, nodes=nodes)
                p = split_hierarchical(p) if world > nodes else p  # one rank a node: as planned
                got = {c: _run_calls(q, k, v, do, p, rank, c) for c in BACKWARD_CALL_MODES}
                got |= {f"{c}, refetched": _run_calls(q, k, v, do, p, rank, c, keep_kv=False)
                        for c in ("stage", "one", "one+local")}
                for calls, res in got.items():
                    tag = f"rank {rank} {name} {balance} nodes={nodes} backward_calls={calls}"
                    _check_against(ref, p, rank, res, tag, rtol=1e-10, atol=1e-10)
                    for label, a, b in zip(("out", "dq", "dk", "dv"), res, got["stage"]):
                        err = (a - b).abs().max().item()
                        assert err <= 1e-11, f"{tag}: {label} differs from 'stage' by {err:.3g}"
    check_bad_backward_calls(rank, world, seqlen)


def check_bad_backward_calls(rank, world, seqlen):
    """A bad ``backward_calls`` is a ValueError naming the argument on every rank, before any
    traffic (the group is usable afterwards)."""
    p = plan(named_masks(seqlen)["causal_document"], None, world)
    x = torch.randn(1, seqlen // world, 2, 8)
    for bad in ("two", "", None):
        try:
            cp_flashmask_attention(x, x, x, p, backward_calls=bad)
        except ValueError as e:
            assert "backward_calls" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: backward_calls={bad!r} should be refused")
    try:
        cp_flashmask_attention(x, x, x, p, keep_kv="yes")
    except TypeError as e:
        assert "keep_kv" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: keep_kv='yes' should be refused")
    dist.barrier()
    out = cp_flashmask_attention(x, x, x, p, backward_calls="one")
    assert out.shape == x.shape


def compiled_model_suite(rank, world, seqlen, seed):
    """``torch.compile`` of a module calling ``cp_flashmask_attention``, with and without
    ``fullgraph=True``, gives the eager loss and gradients in one graph without a break, and a
    batch with a new plan reuses it (the CP layer is one custom op with outputs of static shape;
    the plan travels as a tensor token: docs/cp-runtime.md)."""
    import torch._dynamo.utils as dynamo_utils

    from flashmask3 import masks as M

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, D)

        def forward(self, q, k, v, p):
            out = cp_flashmask_attention(self.proj(q), k, v, p)
            return (out * out).sum()

    for fullgraph in (True, False):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        torch.manual_seed(seed)
        layer = Layer()
        compiled = torch.compile(layer, fullgraph=fullgraph)
        graphs = []
        for i, docs in enumerate(([seqlen // 4, seqlen - seqlen // 4],
                                  [seqlen // 3, seqlen // 3, seqlen - 2 * (seqlen // 3)])):
            p = plan(M.causal_document_mask(docs), None, world, balance="sparse")
            q, k, v, _ = _inputs(seqlen, seed + i)
            ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
            want = layer(ql, kl, vl, p)
            want_grads = torch.autograd.grad(want, (ql, kl, vl))
            got = compiled(ql, kl, vl, p)
            got_grads = torch.autograd.grad(got, (ql, kl, vl))
            tag = f"rank {rank} fullgraph={fullgraph} batch {i}"
            _close("loss", got.detach(), want.detach(), tag)
            for name, a, b in zip("qkv", got_grads, want_grads):
                _close(f"d{name}", a, b, tag)
            graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
        breaks = dict(dynamo_utils.counters["graph_break"])
        assert graphs == [1, 1] and not breaks, f"rank {rank} fullgraph={fullgraph}: graphs {graphs}, breaks {breaks}"


class _CountedRounds:
    """Counts ``DistExchange.start`` calls (one per round and direction) while active."""

    def __enter__(self):
        from flashmask3.distributed import comm

        self.count, self._orig = 0, comm.DistExchange.start

        def start(exchange, *args, **kwargs):
            self.count += 1
            return self._orig(exchange, *args, **kwargs)

        comm.DistExchange.start = start
        return self

    def __exit__(self, *exc):
        from flashmask3.distributed import comm

        comm.DistExchange.start = self._orig


def compiled_options_suite(rank, world, seqlen, seed):
    """The traced layer (``torch.compile(fullgraph=True)``, inductor) against eager for every
    comm and keep_kv, with the LSE used, on a flat and a 2-node plan: equal loss and gradients,
    the same exchange rounds (a kept K/V buffer travels from the compiled forward to its
    backward: no refetch), no recompile for new plans; the backward finds a plan the caller
    dropped after the forward; a node_layout that cannot be traced is a TypeError."""
    import gc

    import torch._dynamo.utils as dynamo_utils

    from flashmask3 import masks as M

    def loss_of(q, k, v, p, comm, keep, layout):
        out, lse = cp_flashmask_attention(q * 1.5, k, v, p, comm=comm, keep_kv=keep, return_softmax_lse=True,
                                          node_layout=layout)
        return (out * out).sum() + 0.1 * lse.sum()

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64  # one graph per (nodes, comm, keep_kv): 12 here
    compiled = torch.compile(loss_of, fullgraph=True)
    docs_list = ([seqlen // 4, seqlen - seqlen // 4], [seqlen // 3, seqlen // 3, seqlen - 2 * (seqlen // 3)])
    for nodes, layout in ((1, None), (2, 1), (2, list(range(world)))):
        for comm in ("overlap", "allgather"):
            for keep in (True, False):
                graphs = []
                for i, docs in enumerate(docs_list):
                    p = plan(M.causal_document_mask(docs), None, world, balance="sparse", nodes=nodes)
                    q, k, v, _ = _inputs(seqlen, seed + i)
                    ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
                    tag = f"rank {rank} nodes {nodes} {comm} keep_kv={keep} batch {i}"
                    with _CountedRounds() as eager_rounds:
                        want = loss_of(ql, kl, vl, p, comm, keep, layout)
                        want_grads = torch.autograd.grad(want, (ql, kl, vl))
                    with _CountedRounds() as traced_rounds:
                        got = compiled(ql, kl, vl, p, comm, keep, layout)
                        del p
                        gc.collect()  # the backward still finds the plan (its token holds it)
                        got_grads = torch.autograd.grad(got, (ql, kl, vl))
                    _close("loss", got.detach(), want.detach(), tag)
                    for name, a, b in zip("qkv", got_grads, want_grads):
                        _close(f"d{name}", a, b, tag)
                    assert traced_rounds.count == eager_rounds.count, (
                        f"{tag}: {traced_rounds.count} exchange rounds traced, {eager_rounds.count} eager")
                    graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
                assert graphs[0] == graphs[1], f"{tag}: a new plan recompiled ({graphs})"
    gc.collect()  # the kept K/V die with their graphs: nothing stays registered
    from flashmask3.distributed import handles

    kept = sum(isinstance(obj, torch.Tensor) for obj in handles._OBJECTS.values())  # (the rest are plans)
    assert not kept, f"rank {rank}: {kept} kept buffers leaked"
    p = plan(M.causal_document_mask(docs_list[0]), None, world, nodes=2)
    ql, kl, vl = (p.shard(t, rank) for t in _inputs(seqlen, seed)[:3])
    try:
        compiled(ql, kl, vl, p, "overlap", True, lambda g: g)
    except Exception as exc:  # dynamo wraps errors raised while tracing
        assert "node_layout" in str(exc) and "TypeError" in repr(exc) + str(type(exc)) + str(exc.__cause__), exc
    else:
        raise AssertionError("a callable node_layout under torch.compile was accepted")


def windowed_suite(rank, world, seqlen, seed):
    """``window_size=`` on a causal plan equals single-process attention on the windowed mask
    (``masks.with_window``): outputs and gradients, for document and plain causal plans, both
    comms, a flat and a 2-node plan, eager and traced (``fullgraph=True``, where the op derives the
    windowed plan at run time); bad windows are clear errors."""
    import pytest

    from flashmask3 import masks as M

    docs = M.causal_document_mask([seqlen // 4, seqlen // 2, seqlen - seqlen // 4 - seqlen // 2], batch_size=B)
    cases = [(docs, 0), (docs, 5), (docs, seqlen // 3), (None, 7)]
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64

    def attend(ql, kl, vl, p, comm, window):
        return cp_flashmask_attention(ql, kl, vl, p, comm=comm, window_size=window, node_layout=world // p.nodes)

    traced = torch.compile(attend, fullgraph=True, backend="aot_eager")
    for i, (mask, window) in enumerate(cases):
        full = M.causal_mask(seqlen, batch_size=B) if mask is None else mask
        q, k, v, do = _inputs(seqlen, seed + i)
        want = _reference(q, k, v, do, M.with_window(full, window))
        for nodes in (1, 2):
            p = plan(mask, True, world, seqlen=seqlen, nodes=nodes)
            for comm, fn in (("overlap", attend), ("allgather", attend), ("overlap", traced)):
                tag = f"rank {rank} case {i} window {window} nodes {nodes} {comm} {'traced' if fn is traced else 'eager'}"
                ql, kl, vl = (p.shard(t, rank).requires_grad_() for t in (q, k, v))
                out = fn(ql, kl, vl, p, comm, window)
                out.backward(p.shard(do, rank))
                for name, got, ref in zip(("out", "dq", "dk", "dv"), (out.detach(), ql.grad, kl.grad, vl.grad),
                                          (want[0], want[2], want[3], want[4])):
                    _close(name, got, p.shard(ref, rank), tag)
    p = plan(M.document_mask([seqlen // 2, seqlen // 2]), None, world)
    ql = p.shard(_inputs(seqlen, seed)[0], rank)
    with pytest.raises(ValueError, match="causal plan"):
        cp_flashmask_attention(ql, ql[:, :, :HK], ql[:, :, :HK], p, window_size=4)
    with pytest.raises(ValueError, match="window_size must be >= 0"):
        cp_flashmask_attention(ql, ql[:, :, :HK], ql[:, :, :HK], p, window_size=-1)
    with pytest.raises(TypeError, match="window_size"):
        cp_flashmask_attention(ql, ql[:, :, :HK], ql[:, :, :HK], p, window_size=True)
