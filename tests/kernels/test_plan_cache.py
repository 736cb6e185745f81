"""Plan reuse across calls with the same mask tensor (``tiles.cached_plan``): keyed on the
tensor's identity (weakly) and its ``_version``, never used under CUDA-graph capture."""

import gc
import weakref
from unittest import mock

import pytest
import torch

import flashmask3
import flashmask3.masks as M
from flashmask3.kernels import tiles, triton_available
from tests.kernels.attention_checks import make_qkv
from tests.reference import reference_attention, rel_err

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton installed")


def _columns(lens, device="cpu"):
    return M.causal_document_mask(lens, device=device).startend_row_indices.clone()


def _same_plan(a, b):
    return torch.equal(a.summary, b.summary) and torch.equal(a.ranges, b.ranges)


@pytest.fixture(autouse=True)
def _empty_cache():
    tiles.clear_plan_cache()
    yield
    tiles.clear_plan_cache()


@needs_triton
def test_cached_plan_equals_make_plan_and_is_reused():
    cols = _columns([40, 24, 64])
    want = tiles.make_plan(cols, True, 128, 128, 32, 16, False, cols.device)
    with mock.patch.object(tiles, "block_summaries", wraps=tiles.block_summaries) as summ, \
            mock.patch.object(tiles, "live_ranges", wraps=tiles.live_ranges) as rng:
        first = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
        again = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
        # another tile with the same block_n (the backward's, by key): summaries shared
        by_key = tiles.cached_plan(cols, True, 128, 128, 64, 16, True, cols.device)
    assert _same_plan(first, want) and first.mask is cols
    assert again.summary is first.summary and again.ranges is first.ranges
    assert by_key.summary is first.summary
    assert _same_plan(by_key, tiles.make_plan(cols, True, 128, 128, 64, 16, True, cols.device))
    assert summ.call_count == 1 and rng.call_count == 2


@needs_triton
def test_in_place_edit_of_the_columns_gives_a_new_plan_and_the_right_answer():
    """Writes through torch (copy_, indexing) bump the tensor's version: the next call plans
    the new values; the attention output follows the new mask (Triton backend, interpreter)."""
    s, h, d = 128, 2, 16
    q, k, v = (t.detach() for t in make_qkv(1, s, s, h, h, d, torch.float32))
    cols = _columns([64, 64])
    old = tiles.cached_plan(cols, True, s, s, 32, 16, False, cols.device)
    new_cols = _columns([16, 80, 32])
    cols.copy_(new_cols)
    new = tiles.cached_plan(cols, True, s, s, 32, 16, False, cols.device)
    assert not _same_plan(old, new)
    assert _same_plan(new, tiles.make_plan(new_cols, True, s, s, 32, 16, False, cols.device))
    with mock.patch.dict("os.environ", {"FLASHMASK3_BACKEND": "triton"}):
        flashmask3.flashmask_attention(q, k, v, cols, causal=True)  # warm the cache
        cols[0, 0, :40, 0] = torch.randint(40, s, (40,), dtype=torch.int32)
        got = flashmask3.flashmask_attention(q, k, v, cols, causal=True)
    want = reference_attention(q, k, v, cols, True)[0]
    assert rel_err(got, want) < 1e-4


@needs_triton
def test_a_new_tensor_is_never_taken_for_a_freed_one():
    """The entry goes when its mask is freed (the cache holds no reference to it); an entry
    found under a tensor's id but made for another object is not used."""
    cols = _columns([32, 96])
    tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
    ref = weakref.ref(cols)
    key = id(cols)
    del cols
    gc.collect()
    assert ref() is None and key not in tiles._PLAN_CACHE
    a, b = _columns([32, 96]), _columns([100, 28])
    tiles.cached_plan(a, True, 128, 128, 32, 16, False, a.device)
    tiles._PLAN_CACHE[id(b)] = tiles._PLAN_CACHE[id(a)]  # as if b reused a's address/id
    got = tiles.cached_plan(b, True, 128, 128, 32, 16, False, b.device)
    assert _same_plan(got, tiles.make_plan(b, True, 128, 128, 32, 16, False, b.device))
    assert not _same_plan(got, tiles.make_plan(a, True, 128, 128, 32, 16, False, a.device))


@needs_triton
def test_no_cache_while_a_cuda_graph_is_captured():
    cols = _columns([64, 64])
    with mock.patch.object(tiles, "_capturing", lambda mask: True), \
            mock.patch.object(tiles, "block_summaries", wraps=tiles.block_summaries) as summ:
        for _ in range(3):
            tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
    assert summ.call_count == 3 and not tiles._PLAN_CACHE


@needs_triton
def test_static_masks_keep_their_plans_and_reuse_them_under_capture():
    """A static mask (the CP runtime's columns) keeps its plans on the tensor, out of the shared
    cache (clear_plan_cache leaves them); while a graph is captured they are reused, and a plan
    first needed there is built in the graph and kept nowhere; an in-place write drops them."""
    from flashmask3.kernels.static_masks import is_static, mark_static

    cols = mark_static(_columns([40, 24, 64]))
    assert is_static(cols) and not is_static(_columns([40, 24, 64]))
    first = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
    assert not tiles._PLAN_CACHE
    assert _same_plan(first, tiles.make_plan(cols, True, 128, 128, 32, 16, False, cols.device))
    tiles.clear_plan_cache()
    with mock.patch.object(tiles, "_capturing", lambda mask: True), \
            mock.patch.object(tiles, "block_summaries", wraps=tiles.block_summaries) as summ:
        again = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
        assert again.summary is first.summary and summ.call_count == 0
        other = tiles.cached_plan(cols, True, 128, 128, 64, 16, True, cols.device)  # not planned yet
        assert summ.call_count == 1
        assert other.summary is not first.summary
        tiles.cached_plan(cols, True, 128, 128, 64, 16, True, cols.device)
        assert summ.call_count == 2  # (kept nowhere)
    assert not tiles._PLAN_CACHE
    cols.copy_(_columns([16, 80, 32]))
    with mock.patch.object(tiles, "_capturing", lambda mask: True), \
            mock.patch.object(tiles, "block_summaries", wraps=tiles.block_summaries) as summ:
        tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
        assert summ.call_count == 1  # written since: planned in the graph
    new = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
    assert _same_plan(new, tiles.make_plan(_columns([16, 80, 32]), True, 128, 128, 32, 16, False,
                                           cols.device))
    assert not _same_plan(new, first)


# -- GPU (benchmarks/gpu/host-path.sh) --------------------------------------------------------


@pytest.mark.gpu
def test_gpu_in_place_edit_and_fresh_masks_follow_the_values():
    """On the H200: a reused CUDA column tensor written in place between calls, and a fresh
    tensor every call, both give the reference answer (the cache never serves stale plans)."""
    s, h, d = 2048, 4, 128
    q, k, v = (t.detach() for t in make_qkv(1, s, s, h, h, d, torch.bfloat16, device="cuda"))
    cols = _columns([1024, 1024], "cuda")
    flashmask3.flashmask_attention(q, k, v, cols, causal=True)
    for lens in ([512, 1536], [256] * 8, [2000, 48]):
        cols.copy_(_columns(lens, "cuda"))
        got = flashmask3.flashmask_attention(q, k, v, cols, causal=True)
        fresh = flashmask3.flashmask_attention(q, k, v, _columns(lens, "cuda"), causal=True)
        want = reference_attention(q, k, v, cols, True)[0]
        assert rel_err(got, want) < 2e-2, lens
        torch.testing.assert_close(got, fresh, rtol=0, atol=0)


@needs_triton
def test_graph_tree_warm_up_reads_cached_plans_and_keeps_no_new_one():
    """While inductor's CUDA graph trees warm a graph up (``warming_up``), a cached plan is
    read, and a plan first needed then is built but not kept (it would sit in the trees' pool)."""
    cols = _columns([40, 24, 64])
    first = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
    with mock.patch.object(tiles, "_warming_up", lambda mask: True), \
            mock.patch.object(tiles, "block_summaries", wraps=tiles.block_summaries) as summ:
        again = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, cols.device)
        assert again.summary is first.summary and summ.call_count == 0
        for _ in range(2):
            tiles.cached_plan(cols, True, 128, 128, 64, 16, True, cols.device)
        fresh = _columns([64, 64])
        for _ in range(2):
            got = tiles.cached_plan(fresh, True, 128, 128, 32, 16, False, fresh.device)
        assert summ.call_count == 4
    assert _same_plan(got, tiles.make_plan(fresh, True, 128, 128, 32, 16, False, fresh.device))
    assert all(len(e.plans) == (1 if e.ref() is cols else 0) for e in tiles._PLAN_CACHE.values())


def test_graph_tree_warm_up_is_read_from_torch_and_an_unknown_layout_keeps_nothing(monkeypatch):
    """``static_masks._graph_trees_warming_up`` reads inductor's tree manager of the device: its
    warm-up state; no tree module imported, or none used on the thread: no warm-up; a layout it
    cannot read counts as a warm-up. And on this torch, with the real module and no tree run, it
    reads no warm-up (a changed private layout fails here, not silently)."""
    import sys
    from types import SimpleNamespace

    import torch._inductor.cudagraph_trees  # noqa: F401  (the real module, imported)

    from flashmask3.kernels.static_masks import _graph_trees_warming_up

    assert _graph_trees_warming_up(0) is False
    name = "torch._inductor.cudagraph_trees"

    def trees(state):
        managers = {0: SimpleNamespace(tree_manager=None if state is None else SimpleNamespace(in_warmup=state))}
        return SimpleNamespace(local=object(), get_obj=lambda local, attr: managers)

    monkeypatch.setattr(torch._C, "_is_key_in_tls", lambda key: True)
    for state, want in ((True, True), (False, False), (None, False)):
        monkeypatch.setitem(sys.modules, name, trees(state))
        assert _graph_trees_warming_up(0) is want, state
    monkeypatch.setitem(sys.modules, name, SimpleNamespace())  # another layout
    assert _graph_trees_warming_up(0) is True
    monkeypatch.setattr(torch._C, "_is_key_in_tls", lambda key: False)
    assert _graph_trees_warming_up(0) is False
    monkeypatch.delitem(sys.modules, name)
    assert _graph_trees_warming_up(0) is False
