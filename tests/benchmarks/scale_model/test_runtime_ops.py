"""The CP runtime's op sequence read off the real runtime on the meta device
(benchmarks/scale_model/runtime_ops.py): its attention calls are the runtime's, its key gathers
move exactly the held stages' rows, and the emulated exchange's copies are told apart."""

from __future__ import annotations

import pytest
import torch

import flashmask3.masks as M
from benchmarks.corpus import document_spreads
from benchmarks.scale_model.runtime_ops import RATE_CLASSES, bytes_by_rate, ops_seconds, rate_class, record_layer
from flashmask3.distributed import EmulatedExchange, LaunchCounter, plan, prepare_rank, run_layer
from flashmask3.distributed.runtime import to_wire


def _plan(cp, nodes=1):
    lens = document_spreads(4096, seed=0)["corpus"]
    return plan(M.causal_document_mask(lens), None, cp, balance="sparse", nodes=nodes)


def _attention_calls_on_cpu(p, rank, comm, calls):
    """Attention calls of the same rank's layer run for real (CPU, torch backend)."""
    prog = prepare_rank(p, rank, "cpu", comm, calls)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, p.local_seqlen, 2, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, p.local_seqlen, 1, 8, generator=g, requires_grad=True) for _ in range(2))
    wire = to_wire(torch.randn(1, p.seqlen, 1, 8), torch.randn(1, p.seqlen, 1, 8), p.chunk_size)
    with LaunchCounter() as c:
        out, _ = run_layer(q, k, v, prog, EmulatedExchange(wire, p.cp_size, rank, plan=p), 0.3)
        out.backward(torch.ones_like(out))
    return c.attention_calls


@pytest.mark.parametrize("nodes,comm,calls", [(1, "overlap", "stage"), (1, "overlap", "one"),
                                              (2, "overlap", "one+local"), (1, "allgather", "stage")])
def test_recorded_layer_matches_the_runtime(nodes, comm, calls):
    p = _plan(8, nodes)
    for rank in (0, 5):
        ops = record_layer(p, rank, comm, calls, heads=4, kv_heads=2, head_dim=16)
        attn = [o for o in ops if o.kind == "attention"]
        assert len(attn) == _attention_calls_on_cpu(p, rank, comm, calls)
        assert {o.pass_ for o in ops} == {"fwd", "bwd"}
        assert all(o.nbytes > 0 for o in ops if o.kind != "attention")
        prog = prepare_rank(p, rank, "meta", comm, calls)
        real = prepare_rank(p, rank, "cpu", comm, calls)  # the meta program's columns are shapes only
        assert [None if c is None else c.shape for c in prog.stage_cols] == \
            [None if c is None else c.shape for c in real.stage_cols]
        if real.merged is not None:
            assert getattr(prog.merged.cols, "shape", None) == getattr(real.merged.cols, "shape", None)
        row = 2 * p.chunk_size * 2 * 16 * 2  # a wire row: K and V, chunk keys, 2 heads, D=16, bf16
        gathered = sum(o.nbytes for o in ops if o.name == "gather_keys")
        passes = 1 if comm == "overlap" else 2  # the overlapped backward keeps the forward's keys
        assert gathered == passes * 2 * prog.n_keys * row  # read + write
        assert any(o.kind == "emulated" for o in ops)
        quiet = record_layer(p, rank, comm, calls, heads=4, kv_heads=2, head_dim=16, emulated=False)
        assert quiet == [o for o in ops if o.kind != "emulated"]  # the runtime's own ops are the same
        if comm == "overlap":
            assert any(o.name == "merge" for o in ops) == (sum(bool(s) for s in prog.stage_chunks) > 1)
            assert any(o.name == "add_returns" for o in ops)
            stages = [o.stage for o in attn if o.name in ("forward", "backward_stage")]
            assert ("merged" in stages) == (calls != "stage")


def test_ops_seconds_counts_bytes_by_rate_class_and_launches():
    ops = record_layer(_plan(8), 3, "overlap", "stage", heads=4, kv_heads=2, head_dim=16)
    small = [o for o in ops if o.kind != "attention"]
    one = dict.fromkeys(RATE_CLASSES, 1e12)
    assert ops_seconds(ops, one, 0.0) == pytest.approx(sum(o.nbytes for o in small) / 1e12)
    assert ops_seconds(ops, dict.fromkeys(RATE_CLASSES, float("inf")), 1e-6) == pytest.approx(len(small) * 1e-6)
    by_rate = bytes_by_rate(small)
    assert sum(by_rate.values()) == sum(o.nbytes for o in small)
    for c in RATE_CLASSES:  # each class at its own bandwidth
        slow = {**one, c: 0.5e12}
        assert ops_seconds(ops, slow, 0.0) == pytest.approx((sum(by_rate.values()) + by_rate[c]) / 1e12)


def test_rate_classes_follow_the_kernels_torch_runs():
    """``index_select`` of at most 16 rows is torch's small-index kernel, more rows its gather;
    indexed writes and stack are scatters, zeros and fills write only, everything else copies."""
    assert rate_class("index_select", 16) == "small_index" and rate_class("index_select", 17) == "copy"
    assert {rate_class(n) for n in ("index_copy_", "index_add_", "stack")} == {"scatter"}
    assert {rate_class(n) for n in ("zeros", "fill_", "zeros_like")} == {"fill"}
    assert {rate_class(n) for n in ("clone", "copy_", "cat", "_to_copy")} == {"copy"}


def test_recorded_index_selects_carry_their_row_count_class():
    """The recorder classes each index_select by the rows it picks: the emulated exchange's
    rounds of a few chunks are small-index copies, the all-gather's many pieces are not."""
    over = record_layer(_plan(8), 3, "overlap", "stage", heads=4, kv_heads=2, head_dim=16)
    gather = record_layer(_plan(8), 3, "allgather", "stage", heads=4, kv_heads=2, head_dim=16)
    sel = [o for o in over + gather if o.name == "index_select"]
    assert {o.rate for o in sel} <= {"small_index", "copy"}
    assert any(o.rate == "small_index" for o in over if o.kind == "emulated")
    assert all(o.rate == "copy" for o in gather if o.kind == "emulated" and o.name == "index_select")


def test_rank_device_work_is_the_recorded_runtime_ops_and_cached(tmp_path, monkeypatch):
    """Per rank and pass, the bytes and launches of the runtime's torch ops and small kernels
    (not the attention calls, not the emulated copies); the second call reads the disk cache."""
    from benchmarks.scale_model import layout, runtime_ops

    monkeypatch.setattr(layout, "CACHE_DIR", str(tmp_path))
    lens = document_spreads(4096, seed=0)["corpus"]
    work = runtime_ops.rank_device_work(lens, 8, "sparse", 1, "overlap", "stage", 4, 2, 16)
    assert len(work) == 8
    ops = record_layer(_plan(8), 3, "overlap", "stage", heads=4, kv_heads=2, head_dim=16)
    own = [o for o in ops if o.kind in ("kernel", "torch")]
    fwd = [o for o in own if o.pass_ == "fwd"]
    bwd = [o for o in own if o.pass_ == "bwd"]
    assert work[3] == (bytes_by_rate(fwd), len(fwd), bytes_by_rate(bwd), len(bwd))

    def fail(*a, **k):
        raise AssertionError("recorded again instead of read from the cache")

    monkeypatch.setattr(runtime_ops, "record_layer", fail)
    assert runtime_ops.rank_device_work(lens, 8, "sparse", 1, "overlap", "stage", 4, 2, 16) == work


def test_layer_time_adds_the_runtime_device_work():
    """simulate_layer with the recorded device work: each rank's time grows by exactly its
    forward + backward device seconds (GPU-bound), and the timeline's own fp32-pass stand-ins
    for merges and accumulation are dropped."""
    from benchmarks.scale_model.calibrate import load_cost
    from benchmarks.scale_model.layout import document_plan_view
    from benchmarks.scale_model.params import Cluster, Runtime
    from benchmarks.scale_model.timeline import AttnShape, simulate_layer

    lens = document_spreads(4096, seed=0)["corpus"]
    view = document_plan_view(lens, 8, "sparse")
    cost, shape, rt = load_cost("flashmask3", True), AttnShape(4, 2, 16), Runtime("lean")
    cluster = Cluster().with_(host_op=Cluster().host_op.scaled(0.0))
    zero = simulate_layer(view, cost, cluster, shape, "overlap", rt, device=[(0.0, 0.0)] * 8)
    some = simulate_layer(view, cost, cluster, shape, "overlap", rt, device=[(1e-3, 2e-3)] * 8)
    terms = simulate_layer(view, cost, cluster, shape, "overlap", rt)
    for r in range(8):
        assert some.rank_time(r) == pytest.approx(zero.rank_time(r) + 3e-3)
    for p in ("fwd", "bwd"):  # the stand-ins add compute to the stage tasks
        assert sum(x.compute for x in getattr(terms, p).ranks) > sum(x.compute for x in getattr(zero, p).ranks)


def test_an_ab_layout_is_recorded_with_its_hidden_functions():
    """A hierarchical rank that relays: with the backend's returns kernels its gradient sums are
    one ``sum_wire_rows`` launch each and its own sum one ``add_returns``; recorded as the A/B
    layout ``sparse+overlap hier torch returns`` (those functions hidden) they are the torch
    path's fp32 ``index_add_`` ops instead, as cp_single_gpu.py runs that layout."""
    from benchmarks.cp_single_gpu import RETURNS_KERNEL, hidden_functions

    assert hidden_functions("sparse+overlap hier torch returns") == RETURNS_KERNEL
    assert hidden_functions("sparse+overlap hier") == ()
    p = _plan(8, nodes=2)
    rank = next(r for r in range(8) if any(
        x.sum_index is not None and x.stage_size and any(prepare_rank(p, r, "meta").rounds[c].n_send
                                                         for c in x.children)
        for x in prepare_rank(p, r, "meta").rounds))
    kernel = record_layer(p, rank, "overlap", "stage", heads=4, kv_heads=2, head_dim=16)
    torch_ops = record_layer(p, rank, "overlap", "stage", heads=4, kv_heads=2, head_dim=16,
                             hide=hidden_functions("sparse+overlap hier torch returns"))
    names = lambda ops: {o.name for o in ops if o.kind != "emulated"}  # noqa: E731
    assert {"sum_wire_rows", "add_returns"} <= names(kernel) and "index_add_" not in names(kernel)
    assert not {"sum_wire_rows", "add_returns"} & names(torch_ops) and "index_add_" in names(torch_ops)


def test_fast_allocations_match_the_real_ops(monkeypatch):
    """The recorder's shortcut for ``empty_like`` / ``new_empty`` gives the shape, strides,
    dtype and device the real op gives, in the form torch dispatches them (``pin_memory=False``
    included), and leaves every other form to the real op; a recorded layer takes it."""
    import torch

    from benchmarks.scale_model.runtime_ops import _fast_alloc

    x = torch.empty(2, 3, 4, dtype=torch.bfloat16, device="meta")
    t = x.transpose(0, 2)  # dense, not contiguous: preserve_format keeps its strides
    cases = [("empty_like", (x,), {"pin_memory": False}), ("empty_like", (x,), {"dtype": torch.float32}),
             ("empty_like", (t,), {"memory_format": torch.contiguous_format, "pin_memory": False}),
             ("new_empty", (x, [5, 6]), {"pin_memory": False}), ("new_empty", (t, [7]), {"dtype": torch.int32})]
    for name, args, kwargs in cases:
        got = _fast_alloc(name, args, kwargs)
        want = getattr(torch.ops.aten, name).default(*args, **kwargs)
        assert (got.shape, got.stride(), got.dtype, got.device) == \
            (want.shape, want.stride(), want.dtype, want.device), (name, kwargs)
    assert _fast_alloc("empty_like", (t,), {}) is None  # preserve_format of a strided tensor
    assert _fast_alloc("new_empty", (x, [2]), {"pin_memory": True}) is None
    assert _fast_alloc("new_empty", (x, [2]), {"device": "meta", "pin_memory": False}) is None
    assert _fast_alloc("clone", (x,), {}) is None
    from benchmarks.scale_model import runtime_ops as R

    taken = []
    monkeypatch.setattr(R, "_fast_alloc", lambda *a: taken.append(_fast_alloc(*a)) or taken[-1])
    R.record_layer(_plan(8), 3, "overlap", "stage", heads=4, kv_heads=2, head_dim=16)
    assert sum(o is not None for o in taken) >= 10  # the layer's allocations take the shortcut
