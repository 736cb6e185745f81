"""The portable tl kernels and the mask/tile helpers, called through the Triton backend contract.

Without a GPU these run under ``TRITON_INTERPRET=1`` (tests/conftest.py) on small shapes in
fp32/fp16; tests marked ``gpu`` run bf16/fp16 at realistic sizes on a CUDA device. Every
numerical check compares with the float64 dense reference on fresh random inputs.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import flashmask3.masks as M  # noqa: E402
from flashmask3.kernels import dispatch, tiles  # noqa: E402
from flashmask3.kernels import tl_kernels as TL  # noqa: E402
from flashmask3.kernels import triton_backend as T  # noqa: E402
from tests.helpers import LAYOUTS, gpu_masks, named_masks, random_columns  # noqa: E402
from tests.reference import reference_attention, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------------
# The @jit twin of the tile rule and the live ranges
# ---------------------------------------------------------------------------------------------


@triton.jit
def _classify_all_kernel(sum_ptr, out_ptr, Sq, Sk, NQB, NKB, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, NI: tl.constexpr,
                         NKB_P2: tl.constexpr):
    """Class of every tile of one (batch*mask head, query block) through the kernels' twin."""
    m = tl.program_id(0)
    bh = tl.program_id(1)
    n = tl.arange(0, NKB_P2)
    valid = n < NKB
    cls = tiles._tile_class(sum_ptr + bh * NKB * 8, m, n, Sq, Sk, valid, BLOCK_M, BLOCK_N, CAUSAL, NI)
    tl.store(out_ptr + (bh * NQB + m) * NKB + n, cls, mask=valid)


def _twin_classes(cols, causal, sq, sk, bm, bn):
    """[B, Hm, NQB, NKB] classes from the Triton summary kernel + the @jit rule."""
    b, hm = (1, 1) if cols is None else cols.shape[:2]
    nqb, nkb = triton.cdiv(sq, bm), triton.cdiv(sk, bn)
    c = 0 if cols is None else cols.shape[-1]
    summary = (torch.zeros(1, nkb, 8, dtype=torch.int32, device=DEVICE) if cols is None
               else tiles.block_summaries(cols.contiguous(), causal, sq, bn))
    out = torch.empty(b * hm, nqb, nkb, dtype=torch.int32, device=DEVICE)
    _classify_all_kernel[(nqb, b * hm)](summary, out, sq, sk, nqb, nkb, BLOCK_M=bm, BLOCK_N=bn,
                                        CAUSAL=causal, NI=tiles._num_intervals(causal, c),
                                        NKB_P2=triton.next_power_of_2(nkb))
    return out.view(b, hm, nqb, nkb)


@pytest.mark.parametrize("causal,c", LAYOUTS + [(True, 0), (False, 0)])
@pytest.mark.parametrize("sq,sk,bm,bn", [(100, 100, 16, 32), (64, 130, 32, 16), (130, 17, 32, 64)])
def test_classification_twin_matches_classify_tiles(causal, c, sq, sk, bm, bn):
    cols = None if c == 0 else random_columns(2, 3, sq, sk, causal, c, seed=sq + sk + c).to(DEVICE)
    got = _twin_classes(cols, causal, sq, sk, bm, bn).cpu()
    want = M.classify_tiles(None if cols is None else cols.cpu(), causal, sq, sk, bm, bn)
    assert torch.equal(got, want.to(torch.int32).expand_as(got))


@pytest.mark.parametrize("name", ["causal_document", "global_sliding_window", "sliding_window_two_sided",
                                  "shared_question", "prefix_document"])
def test_classification_twin_on_named_masks(name):
    mask = named_masks(100, batch_size=2)[name]
    got = _twin_classes(mask.startend_row_indices.to(DEVICE), mask.causal, 100, 100, 16, 16).cpu()
    want = M.classify_tiles(mask.startend_row_indices, mask.causal, 100, 100, 16, 16)
    assert torch.equal(got, want.to(torch.int32))


def _covered(ranges, n):
    """Boolean [.., n] of the blocks inside [lo0, hi0) or [lo1, hi1)."""
    idx = torch.arange(n)
    r = ranges.long().unsqueeze(-1)
    return ((idx >= r[..., 0, :]) & (idx < r[..., 1, :])) | ((idx >= r[..., 2, :]) & (idx < r[..., 3, :]))


@pytest.mark.parametrize("causal,c", LAYOUTS)
@pytest.mark.parametrize("by_key", [False, True])
def test_live_ranges_cover_every_live_tile(causal, c, by_key):
    sq, sk, bm, bn = 130, 100, 16, 16
    cols = random_columns(2, 2, sq, sk, causal, c, seed=7 + c).to(DEVICE)
    summary = tiles.block_summaries(cols, causal, sq, bn)
    ranges = tiles.live_ranges(summary, causal, tiles._num_intervals(causal, c), sq, sk, bm, bn, by_key).cpu()
    cls = M.classify_tiles(cols.cpu(), causal, sq, sk, bm, bn).flatten(0, 1)  # [bh, nq, nk]
    if by_key:
        cls = cls.transpose(1, 2)
    live = cls != M.SKIP
    cov = _covered(ranges, cls.shape[-1])
    assert not (live & ~cov).any(), "a live tile lies outside the ranges"
    # The first range is one exact run of live tiles starting at the first live tile.
    first = torch.where(live.any(-1), live.int().argmax(-1), 0)
    has = live.any(-1)
    assert torch.equal(ranges[..., 0][has], first[has].int())
    idx = torch.arange(cls.shape[-1])
    in_first = (idx >= ranges[..., 0:1].long()) & (idx < ranges[..., 1:2].long())
    assert not (in_first & ~live).any()
    _check_unmasked_runs(ranges, cls, sk, bn, by_key)


def _check_unmasked_runs(ranges, cls, sk, bn, by_key):
    """Words 4..7: inside each live range, [flo, fhi) is its first maximal run of UNMASKED tiles
    whose key block ends inside Sk (empty, at hi, when there is none)."""
    full = cls == M.UNMASKED
    clipped = (torch.arange(cls.shape[-2 if by_key else -1]) + 1) * bn > sk
    full &= ~clipped[:, None] if by_key else ~clipped[None, :]
    found = 0
    for bh in range(ranges.shape[0]):
        for fixed in range(ranges.shape[1]):
            for r in (0, 1):
                lo, hi = ranges[bh, fixed, 2 * r:2 * r + 2].tolist()
                flo, fhi = ranges[bh, fixed, 4 + 2 * r:6 + 2 * r].tolist()
                f = full[bh, fixed].tolist()
                want_lo = next((i for i in range(lo, hi) if f[i]), hi)
                want_hi = next((i for i in range(want_lo, hi) if not f[i]), hi)
                assert (flo, fhi) == (want_lo, want_hi), (bh, fixed, r, lo, hi, flo, fhi)
                found += fhi - flo
    assert found > 0 or not full.any(), "no UNMASKED run found although UNMASKED tiles exist"


# ---------------------------------------------------------------------------------------------
# Forward and backward against the float64 dense reference
# ---------------------------------------------------------------------------------------------


def _qkv(b, sq, sk, hq, hk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(DEVICE, dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk))]


def _check(q, k, v, cols, causal, scale=None, with_dlse=True, tol=None):
    """Run T.forward/T.backward and compare out, lse, dq, dk, dv with the float64 reference."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tol = TOL[q.dtype] if tol is None else tol
    out, lse = T.forward(q, k, v, cols, causal, scale)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, cols, causal, scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(ref_lse).cpu())
    assert not torch.isnan(out).any()
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse).masked_fill(torch.isinf(lse), 0.0) if with_dlse else None
    dq, dk, dv = T.backward(dout, dlse, q, k, v, out, lse, cols, causal, scale)
    loss = (ref_out * dout.double()).sum()
    if with_dlse:
        loss = loss + (ref_lse.masked_fill(torch.isinf(ref_lse), 0) * dlse.double()).sum()
    rq, rk, rv = torch.autograd.grad(loss, (q64, k64, v64))
    errs = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse), "dq": rel_err(dq, rq),
            "dk": rel_err(dk, rk), "dv": rel_err(dv, rv)}
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert g.dtype == q.dtype and not torch.isnan(g).any(), name
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"
    return errs


@pytest.mark.parametrize("causal,c,hm_kind", [(cz, c, hm) for cz, c in LAYOUTS + [(True, 0), (False, 0)]
                                               for hm in (("one", "kv", "q") if c else ("one",))])
def test_forward_backward_random_columns(causal, c, hm_kind):
    """GQA (Hq=4, Hk=2), Sq != Sk, lengths that are not block multiples, every Hm choice (no
    mask: only one)."""
    b, sq, sk, hq, hk, d = 2, 100, 70, 4, 2, 32
    hm = {"one": 1, "kv": hk, "q": hq}[hm_kind]
    cols = None if c == 0 else random_columns(b, hm, sq, sk, causal, c, seed=31 * c + hm).to(DEVICE)
    q, k, v = _qkv(b, sq, sk, hq, hk, d, torch.float32, seed=c + 10 * hm)
    _check(q, k, v, cols, causal)


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-loop"])
@pytest.mark.parametrize("causal,c", LAYOUTS + [(True, 0), (False, 0)])
@pytest.mark.parametrize("sq,sk", [(100, 70), (70, 100), (96, 96)])
def test_unmasked_run_loops(monkeypatch, split, causal, c, sq, sk):
    """Every kernel with and without its mask-free loop over runs of UNMASKED tiles
    (SPLIT_UNMASKED_LOOP), on random columns and document masks, GQA, ragged lengths."""
    for kind in TL.SPLIT_UNMASKED_LOOP:
        monkeypatch.setitem(TL.SPLIT_UNMASKED_LOOP, kind, split)
    b, hq, hk, d = 2, 4, 2, 32
    masks = [None] if c == 0 else [random_columns(b, hk, sq, sk, causal, c, seed=sq + c)]
    docs = (M.causal_document_mask if causal else M.document_mask)([64, 32])
    if sq == sk and docs.startend_row_indices.shape[-1] == c:  # long UNMASKED runs
        masks.append(docs.startend_row_indices.expand(b, 1, sk, c).contiguous())
        for kind in ("fwd", "dkdv"):
            choice = dispatch.choose(torch.device(DEVICE), torch.float32, d, causal, c)
            cfg = (choice.forward if kind == "fwd" else choice.backward[0]).tile
            plan = tiles.make_plan(masks[-1].to(DEVICE), causal, sq, sk, cfg.block_m, cfg.block_n,
                               dispatch.PLAN_BY_KEY[kind], DEVICE)
            assert (plan.ranges[..., 5] - plan.ranges[..., 4]).sum() > 0, "no UNMASKED run"
    for i, cols in enumerate(masks):
        q, k, v = _qkv(b, sq, sk, hq, hk, d, torch.float32, seed=sq + 3 * c + i)
        _check(q, k, v, None if cols is None else cols.to(DEVICE), causal)


@pytest.mark.parametrize("name", ["causal_document", "global_sliding_window", "shared_question",
                                  "prefix_lm", "random_eviction"])
def test_named_masks_fp16(name):
    mask = named_masks(64, batch_size=1)[name]
    q, k, v = _qkv(1, 64, 64, 2, 1, 64, torch.float16, seed=len(name))
    _check(q, k, v, mask.startend_row_indices.to(DEVICE), mask.causal)


@pytest.mark.parametrize("sq,sk", [(17, 64), (64, 17)])
def test_short_and_unequal_lengths_without_dlse(sq, sk):
    cols = random_columns(1, 1, sq, sk, True, 1, seed=sq).to(DEVICE)
    q, k, v = _qkv(1, sq, sk, 2, 2, 16, torch.float32, seed=sk)
    _check(q, k, v, cols, True, scale=0.2, with_dlse=False)


@pytest.mark.parametrize("a_smem", [("fwd",), ("fwd", "dkdv", "dq"), ()])
def test_tma_descriptor_path(monkeypatch, a_smem):
    """The tensor-descriptor (TMA) loads give the same results (interpreter emulates them), with
    the wgmma A operands in shared memory or registers; B=2 makes loads cross the batch
    boundary, which the masks must neutralise."""
    monkeypatch.setattr(TL, "use_tma", lambda x: True)
    for kind in TL.A_OPERAND_IN_SMEM:
        monkeypatch.setitem(TL.A_OPERAND_IN_SMEM, kind, kind in a_smem)
    monkeypatch.setattr(TL, "A_OPERAND_IN_SMEM_BY_DIM", {})
    mask = M.causal_document_mask([30, 41, 29], batch_size=2)
    q, k, v = _qkv(2, 100, 100, 2, 1, 32, torch.float32, seed=3)
    _check(q, k, v, mask.startend_row_indices.to(DEVICE), True)


def test_a_operand_placement_per_head_dim():
    """Q, dO of the D=256 dQ kernel sit in shared memory (its 128x32 tile needs it), the other
    head dims keep the per-kernel default."""
    assert TL.a_smem("dq", 256) and TL.a_smem("dq", 200)
    assert not TL.a_smem("dq", 128) and not TL.a_smem("dkdv", 256) and TL.a_smem("fwd", 64)


def test_other_tile_shapes(monkeypatch):
    """Block shapes differ between passes (BLOCK_M != BLOCK_N, several per pass)."""
    monkeypatch.setitem(dispatch.TILE_OVERRIDE, "fwd", tiles.Config(16, 32, 4, 1))
    monkeypatch.setitem(dispatch.TILE_OVERRIDE, "dkdv", tiles.Config(32, 16, 4, 1))
    monkeypatch.setitem(dispatch.TILE_OVERRIDE, "dq", tiles.Config(16, 64, 4, 1))
    cols = random_columns(1, 2, 90, 90, False, 4, seed=5).to(DEVICE)
    q, k, v = _qkv(1, 90, 90, 2, 2, 16, torch.float32, seed=6)
    _check(q, k, v, cols, False)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,c", [(True, 1), (False, 4)])
def test_default_forward_tiles_of_each_head_dim(monkeypatch, d, causal, c):
    """The portable forward tile of each head dim (e.g. 128x64 at D=256), run by the
    interpreter on lengths that are not multiples of it: the tile logic at the shipped shapes."""
    monkeypatch.setitem(dispatch.TILE_OVERRIDE, "fwd",
                        dispatch.decide("any", d, "16bit", causal, c, None).forward.tile)
    cols = random_columns(1, 1, 300, 200, causal, c, seed=d + c).to(DEVICE)
    q, k, v = _qkv(1, 300, 200, 2, 1, d, torch.float32, seed=d)
    _check(q, k, v, cols, causal)


#: The table's short-row forward tiles (head dim, tile), run here by the tl kernel.
SHORT_ROW_TILES = [(row.dims[-1], row.tile) for row in dispatch.TABLE
                   if row.pass_ == "fwd" and row.span_below is not None]


@pytest.mark.parametrize("d,cfg", SHORT_ROW_TILES)
def test_short_document_forward_tiles(monkeypatch, d, cfg):
    """The table's 64x64 forward tiles for short rows, run by the interpreter on short causal
    documents whose boundaries fall inside tiles, against the float64 reference."""
    monkeypatch.setitem(dispatch.TILE_OVERRIDE, "fwd", cfg)
    cols = M.causal_document_mask([37, 70, 21, 90, 82]).startend_row_indices.to(DEVICE)
    q, k, v = _qkv(1, 300, 300, 2, 1, d, torch.float32, seed=d + cfg.num_stages)
    _check(q, k, v, cols, True)


@pytest.mark.parametrize("bwd", ["split", "fused"])
def test_fully_masked_everything(monkeypatch, bwd):
    """Every row masked: zeros, -inf LSE, zero gradients, no NaN."""
    monkeypatch.setenv("FLASHMASK3_KERNELS", "split" if bwd == "split" else "default")
    cols = torch.zeros(1, 1, 40, 1, dtype=torch.int32, device=DEVICE)  # LTS=0: all masked
    q, k, v = _qkv(1, 40, 40, 2, 1, 16, torch.float32, seed=8)
    out, lse = T.forward(q, k, v, cols, True, 0.25)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    dq, dk, dv = T.backward(torch.randn_like(out), None, q, k, v, out, lse, cols, True, 0.25)
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


# ---------------------------------------------------------------------------------------------
# GPU: bf16/fp16 at realistic sizes (skipped without CUDA)
# ---------------------------------------------------------------------------------------------


#: (dtype, head dim, mask): every mask at bf16/D=128; the other dims and fp16 on a subset
#: (each (D, layout, dtype) is a separate compile of three kernels).
GPU_CASES = ([(torch.bfloat16, 128, n) for n in gpu_masks(256)]
             + [(torch.bfloat16, 64, n) for n in ("causal_document", "global_sliding_window", "full")]
             + [(torch.bfloat16, 256, n) for n in ("causal_document", "document", "causal")]
             + [(torch.float16, 128, "causal_document"), (torch.float16, 128, "sliding_window"),
                (torch.float16, 64, "document")])


#: Cases run a second time with the fused (atomic dQ, TMA reduce-add) backward.
GPU_FUSED_CASES = ([(torch.bfloat16, 128, n) for n in gpu_masks(256)]
                   + [(torch.bfloat16, 64, "causal_document"), (torch.bfloat16, 256, "document"),
                      (torch.float16, 128, "sliding_window"), (torch.float16, 64, "document")])
#: Cases run a third time with every kernel's UNMASKED-run loop split flipped from its default
#: (SPLIT_UNMASKED_LOOP, tl kernels), so both loop structures are checked on the GPU.
GPU_FLIPPED_CASES = ([(torch.bfloat16, 128, n) for n in gpu_masks(256)]
                     + [(torch.bfloat16, 64, "document"), (torch.bfloat16, 256, "causal_document")])
GPU_ALL = ([c + ("split",) for c in GPU_CASES] + [c + ("fused",) for c in GPU_FUSED_CASES]
           + [c + ("flipped",) for c in GPU_FLIPPED_CASES])


def _gpu_backward_mode(monkeypatch, mode):
    """"split"/"fused": that backward; "flipped": split backward with every kernel's
    SPLIT_UNMASKED_LOOP entry inverted."""
    if mode == "flipped":
        for kind, split in list(TL.SPLIT_UNMASKED_LOOP.items()):
            monkeypatch.setitem(TL.SPLIT_UNMASKED_LOOP, kind, not split)
        mode = "split"
    monkeypatch.setenv("FLASHMASK3_KERNELS", "split" if mode == "split" else "default")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,name,bwd", GPU_ALL,
                         ids=[f"{str(t).split('.')[-1]}-{d}-{n}-{m}" for t, d, n, m in GPU_ALL])
def test_gpu_against_float64_reference(monkeypatch, dtype, d, name, bwd):
    """S=1500 (not a block multiple), GQA 4:2 -> float64 dense reference on the GPU."""
    _gpu_backward_mode(monkeypatch, bwd)
    s = 1500
    mask, causal = gpu_masks(s)[name]
    cols = None if mask is None else mask.startend_row_indices.cuda()
    causal = mask.causal if mask is not None else causal
    q, k, v = _qkv(2 if cols is None else 1, s, s, 4, 2, d, dtype, seed=d)
    _check(q, k, v, cols, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d,bwd", [(128, "default"), (128, "split"), (64, "default")],
                         ids=["d128-default", "d128-split", "d64-default"])
@pytest.mark.parametrize("causal,c", LAYOUTS + [(True, 0), (False, 0)])
@pytest.mark.parametrize("sq,sk", [(700, 1100), (1100, 700)])
def test_gpu_random_columns(monkeypatch, d, bwd, causal, c, sq, sk):
    """bf16 at the head dims where the Gluon kernels run by default (the fused backward on
    Hopper at D=64 and D=128; split's Gluon dK/dV at D=128): random columns on every layout,
    GQA 4:2, Sq != Sk, ragged lengths, Hm = Hq or 1, with dlse."""
    monkeypatch.setenv("FLASHMASK3_KERNELS", bwd)
    b, hq, hk = 2, 4, 2
    hm = hq if sq > sk else 1
    cols = None if c == 0 else random_columns(b, hm, sq, sk, causal, c, seed=sq + c).to(DEVICE)
    q, k, v = _qkv(b, sq, sk, hq, hk, d, torch.bfloat16, seed=sk + c)
    _check(q, k, v, cols, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,c,sq,sk", [(torch.float16, True, 1, 700, 1100),
                                                 (torch.bfloat16, False, 2, 1100, 700)],
                         ids=["fp16-causal-C1-700x1100", "bf16-C2-1100x700"])
def test_gpu_d256_random_columns(monkeypatch, dtype, causal, c, sq, sk):
    """D=256 through the default backward (split, with the Gluon dK/dV whose two warpgroups
    split the head dim on Hopper): random columns, Sq != Sk, ragged lengths, GQA 4:2, fp16
    and bf16, Hm = 1 or Hq, with dlse."""
    monkeypatch.delenv("FLASHMASK3_KERNELS", raising=False)
    b, hq, hk = 2, 4, 2
    hm = hq if sq > sk else 1
    cols = random_columns(b, hm, sq, sk, causal, c, seed=sq + c + 256).to(DEVICE)
    q, k, v = _qkv(b, sq, sk, hq, hk, 256, dtype, seed=sk + c + 256)
    _check(q, k, v, cols, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("bwd", ["split", "fused", "flipped"])
@pytest.mark.parametrize("name,s", [("causal_document", 32768), ("global_sliding_window", 32768),
                                    ("causal", 16384)])
def test_gpu_long_sequences_against_sdpa(monkeypatch, name, s, bwd):
    """32K bf16 against fp32 SDPA (memory-efficient backend) with the dense boolean mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _gpu_backward_mode(monkeypatch, bwd)

    mask, causal = gpu_masks(s)[name]
    cols = None if mask is None else mask.startend_row_indices.cuda()
    causal = mask.causal if mask is not None else causal
    q, k, v = _qkv(1, s, s, 2, 2, 128, torch.bfloat16, seed=1)
    scale = 1 / math.sqrt(128)
    out, lse = T.forward(q, k, v, cols, causal, scale)
    dout = torch.randn_like(out)
    dq, dk, dv = T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)
    allowed = M.to_dense(cols, causal, s, s).cuda()
    live = allowed.any(-1).view(1, 1, s, 1)
    qf, kf, vf = (x.float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale)
    ref = torch.where(live, ref, 0.0)
    ref.backward(dout.float().transpose(1, 2))
    assert rel_err(out.transpose(1, 2), ref) < 2e-2
    for g, rg in ((dq, qf.grad), (dk, kf.grad), (dv, vf.grad)):
        assert not torch.isnan(g).any()
        assert rel_err(g.transpose(1, 2), rg) < 3e-2


@pytest.mark.gpu
def test_gpu_deterministic_mode_is_bitwise_reproducible(monkeypatch):
    """With torch's deterministic mode on, the default (fused) backward becomes the split
    (atomic-free) one: two runs give bitwise equal gradients. The fused backward agrees with
    them to rounding."""
    monkeypatch.delenv("FLASHMASK3_KERNELS", raising=False)
    mask, _ = gpu_masks(4096)["causal_document"]
    cols = mask.startend_row_indices.cuda()
    q, k, v = _qkv(1, 4096, 4096, 8, 2, 128, torch.bfloat16, seed=2)
    out, lse = T.forward(q, k, v, cols, True, 0.125)
    dout = torch.randn_like(out)
    fused = T.backward(dout, None, q, k, v, out, lse, cols, True, 0.125)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = T.backward(dout, None, q, k, v, out, lse, cols, True, 0.125)
        second = T.backward(dout, None, q, k, v, out, lse, cols, True, 0.125)
    finally:
        torch.use_deterministic_algorithms(prev)
    for a, b, f in zip(first, second, fused):
        assert torch.equal(a, b)
        assert rel_err(f, a) < 1e-2


@pytest.mark.parametrize("d,dlse", [(64, False), (128, True)])
def test_backward_prepass_zeroes_the_fused_dq_accumulator(d, dlse):
    """``backward_prepass`` with the fused backward's dQᵀ accumulator: delta and lse2 bit for
    bit those of the pre-pass without it (and equal to torch's formula), the accumulator's first
    Sq columns zeroed over random garbage (Sq not a multiple of the block), the padding
    untouched (never read)."""
    b, sq, hq = 2, 70, 3
    g = torch.Generator(device=DEVICE).manual_seed(d)
    out, dout = (torch.randn(b, sq, hq, d, device=DEVICE, generator=g) for _ in range(2))
    lse = torch.randn(b, hq, sq, device=DEVICE, generator=g)
    lse[0, 1, 5] = float("-inf")
    dl = torch.randn(b, hq, sq, device=DEVICE, generator=g) if dlse else None
    dq_t = TL.dq_accumulator(b, sq, hq, d, DEVICE)
    assert dq_t.shape == (b, hq, d, 72)
    dq_t.copy_(torch.randn(dq_t.shape, device=DEVICE, generator=g))
    pad = dq_t[..., sq:].clone()
    delta, lse2 = TL.backward_prepass(out, dout, lse, dl, dq_t)
    delta0, lse20 = TL.backward_prepass(out, dout, lse, dl)
    assert torch.equal(delta, delta0) and torch.equal(lse2, lse20)
    assert torch.count_nonzero(dq_t[..., :sq]) == 0 and torch.equal(dq_t[..., sq:], pad)
    ref = (out.double() * dout.double()).sum(-1).permute(0, 2, 1)
    if dlse:
        ref = ref - dl.double()
    assert rel_err(delta, ref) < 1e-5
    assert lse2[0, 1, 5] == float("inf")
    with pytest.raises(ValueError, match="dq_t"):
        TL.backward_prepass(out, dout, lse, dl, dq_t[..., :sq])


@pytest.mark.parametrize("d", [64, 256])
def test_scale_dq_reads_any_strides(d):
    """``scale_dq`` (the fused backward's last step) on the Gluon kernel's transposed
    accumulator view ([B, Hq, D, Sq_pad] seen as [B, Sq, Hq, D]) and on a contiguous one, Sq not
    a multiple of its query block: torch.mul's values (fp32 multiply, then one rounding; the
    interpreter's bf16 rounding may differ by one unit in the last place), contiguous output."""
    b, sq, hq = 2, 70, 3
    pad = (sq + 3) // 4 * 4
    g = torch.Generator(device=DEVICE).manual_seed(d)
    t = torch.randn(b, hq, d, pad, device=DEVICE, generator=g)
    for acc in (t[..., :sq].permute(0, 3, 1, 2), torch.randn(b, sq, hq, d, device=DEVICE,
                                                             generator=g)):
        for dtype, ulp in ((torch.float16, 0.0), (torch.float32, 0.0), (torch.bfloat16, 2 ** -7)):
            got = TL.scale_dq(acc, 0.3, dtype)
            ref = torch.empty(acc.shape, dtype=dtype, device=DEVICE)
            torch.mul(acc, 0.3, out=ref)
            assert got.is_contiguous() and got.dtype == dtype and got.shape == (b, sq, hq, d)
            err = ((got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-6)).max()
            assert err <= ulp, err
