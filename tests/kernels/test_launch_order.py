"""Longest-first program order (``tiles.block_order``, ``FLASHMASK3_LAUNCH_ORDER``).

CPU (Triton interpreter): the plans' order tables are a permutation of the blocks per mask
batch-head, in descending live work with ties in grid order; outputs and gradients of the
forward and backward match the float64 dense reference in the new order on uneven document
masks, GQA, batch > 1 with per-batch masks, per-head masks and a fully masked row; and the
``grid`` knob gives the same results bit for bit (only the order programs run in changes).
GPU (``gpu`` marker): the same equality through the Hopper kernels the dispatch picks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import flashmask3.masks as M  # noqa: E402
from flashmask3.kernels import tiles  # noqa: E402
from flashmask3.kernels import triton_backend as T  # noqa: E402
from tests.helpers import random_columns  # noqa: E402
from tests.reference import reference_attention, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_plans():
    tiles.clear_plan_cache()
    yield
    tiles.clear_plan_cache()


def _set_order(monkeypatch, order: str) -> None:
    """Plans built from now on launch in ``order`` (what FLASHMASK3_LAUNCH_ORDER sets at
    import)."""
    monkeypatch.setattr(tiles, "LAUNCH_ORDER", order)
    tiles.clear_plan_cache()


def _work(row) -> int:
    """A block's live work from its range-table row, written out (the rule of block_order)."""
    lo0, hi0, lo1, hi1, flo0, fhi0, flo1, fhi1 = (int(x) for x in row)
    visited = max(hi0 - lo0, 0) + max(hi1 - lo1, 0)
    full = (max(min(fhi0, hi0) - max(flo0, lo0), 0) + max(min(fhi1, hi1) - max(flo1, lo1), 0))
    return tiles.FULL_TILE_WEIGHT * full + tiles.PARTIAL_TILE_WEIGHT * (visited - full)


def _uneven_columns(heads: int = 2):
    """[2, heads, 128, 1] uneven causal document masks, different per batch row and per head
    (heads 2 or 4)."""
    docs = [[5, 70, 13, 40], [100, 3, 25], [21, 21, 86], [64, 2, 60, 2]]
    c = [M.causal_document_mask(d, device=DEVICE).startend_row_indices for d in docs]
    rows = [[c[0], c[2], c[3], c[1]][:heads], [c[1], c[0], c[2], c[3]][:heads]]
    return torch.cat([torch.cat(r, 1) for r in rows], 0).contiguous()


@pytest.mark.parametrize("by_key", [False, True])
@pytest.mark.parametrize("kind", ["documents", "random_non_causal"])
def test_order_is_a_descending_permutation_per_mask_head(monkeypatch, by_key, kind):
    _set_order(monkeypatch, "longest")
    if kind == "documents":
        cols, causal, s = _uneven_columns(), True, 128
    else:
        cols, causal, s = random_columns(2, 3, 128, 128, False, 4, seed=5).to(DEVICE), False, 128
    plan = tiles.make_plan(cols, causal, s, s, 32, 16, by_key, DEVICE)
    n_blocks = plan.ranges.shape[1]
    assert plan.ordered and plan.order.dtype == torch.int32
    assert plan.order.shape == (cols.shape[0] * cols.shape[1], n_blocks)
    ranges = plan.ranges.cpu()
    for mbh, row in enumerate(plan.order.cpu().tolist()):
        assert sorted(row) == list(range(n_blocks)), f"row {mbh} is not a permutation"
        work = [_work(ranges[mbh, blk]) for blk in row]
        assert work == sorted(work, reverse=True), f"row {mbh} is not longest-first"
        for a, b, wa, wb in zip(row, row[1:], work, work[1:]):
            assert wa > wb or a < b, f"row {mbh}: a tie out of grid order"
    if kind == "documents":  # (random columns: every tile PARTIAL, all blocks tie)
        assert len({tuple(r) for r in plan.order.tolist()}) > 1, "masks differ, orders too"
        assert plan.order[:, 0].tolist() != [0] * plan.order.shape[0], "grid order kept"


def test_grid_knob_and_plan_fields(monkeypatch):
    """``grid``: no order table, the 2-D grid; the default ``longest``: a 1-D grid, also
    without a mask (the causal diagonal's order needs no table). Bad values are refused."""
    monkeypatch.delenv("FLASHMASK3_LAUNCH_ORDER", raising=False)
    assert tiles._launch_order_from_env() == "longest"
    monkeypatch.setenv("FLASHMASK3_LAUNCH_ORDER", "grid")
    assert tiles._launch_order_from_env() == "grid"
    monkeypatch.setenv("FLASHMASK3_LAUNCH_ORDER", "shortest")
    with pytest.raises(ValueError, match="FLASHMASK3_LAUNCH_ORDER"):
        tiles._launch_order_from_env()
    monkeypatch.delenv("FLASHMASK3_LAUNCH_ORDER")
    cols = _uneven_columns()
    _set_order(monkeypatch, "grid")
    plan = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, DEVICE)
    assert plan.order is None and tiles.launch_grid(plan, 8, 4) == (8, 4)
    _set_order(monkeypatch, "longest")
    plan = tiles.cached_plan(cols, True, 128, 128, 32, 16, False, DEVICE)
    assert plan.ordered and tiles.launch_grid(plan, 8, 4) == (32,)
    assert tiles.make_plan(None, True, 128, 128, 32, 16, False, DEVICE).ordered


def _run(q, k, v, cols, causal):
    """(out, lse, dq, dk, dv) through the backend contract, with fresh dO and dLSE."""
    scale = q.shape[-1] ** -0.5
    out, lse = T.forward(q, k, v, cols, causal, scale)
    g = torch.Generator().manual_seed(99)
    dout = torch.randn(out.shape, generator=g).to(device=q.device, dtype=q.dtype)
    dlse = torch.randn(lse.shape, generator=g).to(q.device).masked_fill(torch.isinf(lse), 0.0)
    dq, dk, dv = T.backward(dout, dlse, q, k, v, out, lse, cols, causal, scale)
    return out, lse, dq, dk, dv, dout, dlse


def _reference_errors(q, k, v, cols, causal, got) -> dict:
    out, lse, dq, dk, dv, dout, dlse = got
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, cols, causal)
    loss = ((ref_out * dout.double()).sum()
            + (ref_lse.masked_fill(torch.isinf(ref_lse), 0) * dlse.double()).sum())
    rq, rk, rv = torch.autograd.grad(loss, (q64, k64, v64))
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "fully masked rows disagree"
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    return {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse), "dq": rel_err(dq, rq),
            "dk": rel_err(dk, rk), "dv": rel_err(dv, rv)}


def _case(name):
    """(b, s, hq, hk, d, cols, causal) of one CPU case; fresh random columns per case."""
    if name == "uneven_documents_gqa_per_batch_and_head":  # a KV group's heads: 2 masks
        return 2, 128, 4, 2, 16, _uneven_columns(4), True
    if name == "documents_bidirectional_one_head":
        cols = M.document_mask([[9, 60, 40, 19], [90, 38]], batch_size=2,
                               device=DEVICE).startend_row_indices
        return 2, 128, 2, 1, 16, cols, False
    if name == "random_non_causal_per_head":
        return 1, 96, 3, 3, 16, random_columns(1, 3, 96, 96, False, 4, seed=17).to(DEVICE), False
    if name == "fully_masked_row":
        cols = M.causal_document_mask([40, 88], device=DEVICE).startend_row_indices.clone()
        cols[..., :1, 0] = 0  # key 0 hidden from every row: row 0 sees nothing
        return 1, 128, 2, 2, 16, cols.contiguous(), True
    if name == "causal_no_mask":
        return 2, 80, 2, 1, 16, None, True
    raise KeyError(name)


CASES = ["uneven_documents_gqa_per_batch_and_head", "documents_bidirectional_one_head",
         "random_non_causal_per_head", "fully_masked_row", "causal_no_mask"]


@pytest.mark.parametrize("name", CASES)
def test_longest_first_matches_reference_and_grid_order(monkeypatch, name):
    b, s, hq, hk, d, cols, causal = _case(name)
    g = torch.Generator().manual_seed(100 + CASES.index(name))
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(DEVICE) for h in (hq, hk, hk))
    _set_order(monkeypatch, "longest")
    got = _run(q, k, v, cols, causal)
    errs = _reference_errors(q, k, v, cols, causal, got)
    bad = {n: e for n, e in errs.items() if not e <= 2e-4}
    assert not bad, f"relative errors above 2e-4: {bad}"
    if name == "fully_masked_row":
        assert torch.equal(got[0][0, 0], torch.zeros_like(got[0][0, 0]))
        assert bool(torch.isneginf(got[1][0, :, 0]).all())
    _set_order(monkeypatch, "grid")
    want = _run(q, k, v, cols, causal)
    for label, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(x, y), f"{label} differs between longest-first and grid order"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernels", ["default", "split"])
def test_gpu_longest_first_equals_grid_order(monkeypatch, d, kernels):
    """The Hopper kernels (Gluon forward, Gluon dK/dV or fused backward) on an uneven
    document mask with GQA: the forward and the split backward bit for bit, the fused
    backward's dQ (atomics: its rounding order varies) to 1e-2."""
    monkeypatch.setenv("FLASHMASK3_KERNELS", kernels)
    lens = [[1000, 37, 3000, 59, 1000], [4000, 1096]]
    cols = M.causal_document_mask(lens, batch_size=2, device="cuda").startend_row_indices
    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(2, 5096, h, d, generator=g).to("cuda", torch.bfloat16)
               for h in (8, 2, 2))
    _set_order(monkeypatch, "longest")
    got = _run(q, k, v, cols, True)
    _set_order(monkeypatch, "grid")
    want = _run(q, k, v, cols, True)
    for label, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if label == "dq" and kernels == "default":
            assert rel_err(x, y) < 1e-2, label
        else:
            assert torch.equal(x, y), f"{label} differs between longest-first and grid order"
