"""The warp-specialised Gluon forward kernel (flashmask3/kernels/gluon_fwd.py).

CPU: the kernel compiles offline for sm_90 (Triton's bundled ptxas/cuobjdump, no GPU) into a
cubin with wgmma (HGMMA), a wait that leaves the PV matmul in flight under the softmax
(``WARPGROUP.DEPBAR.LE gsb0, 0x1``), the producer's TMA loads, register reallocation and no
spill inside a tile loop at its tiles on every layout. GPU (``gpu`` marker): O and LSE match
the float64 dense reference at D=64, 128 and 256, with and without ping-pong, through the public
function (a fully masked row: O = 0, LSE = -inf, no NaN), and the backward runs on them.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashmask3.kernels import gluon_fwd as F
from flashmask3.kernels import compile_tools as CT
from flashmask3.kernels import dispatch, gluon_bwd, tiles
from flashmask3.kernels import tl_kernels as TL
from tests.kernels.test_gluon_bwd import _offline_skip_reason
from tests.reference import reference_attention, rel_err

_SKIP = _offline_skip_reason()

#: The WS forward's tile and ping-pong choice per head dim: the table's at D=128 and D=256; at
#: D=64 (where the table keeps tl) the tile it was measured at.
WS_TILES = {128: (tiles.Config(128, 128, 8, 2), False), 64: (tiles.Config(128, 128, 8, 3), True),
            256: (tiles.Config(128, 64, 8, 2), True)}


#: LDL per tile loop the WS forward may keep: none up to Triton 3.8; from 3.9 on (CUDA 13's
#: ptxas) one per masked tile loop of some layouts (the lane part of the key-column offsets,
#: stored once before the loops and reloaded per tile; D=128 non-causal C=4: 8 of its 12 loops).
#: Measured on an H200: the forward 0.4-1.3% slower under 3.9.0 than under 3.6.0
#: (benchmarks/results/newer_triton_3.9.0.md). A store in a loop, or a second reload, fails.
RELOADS_PER_TILE_LOOP = 1 if gluon_bwd._triton_at_least(3, 9) else 0


def _assert_tile_loops_keep_registers(r: dict):
    """No spill in the tile loops of a compile report (``compile_tools.sass_report``) beyond
    :data:`RELOADS_PER_TILE_LOOP`."""
    assert r["stl_in_tile_loops"] == 0, r
    assert r["max_ldl_stl_per_tile_loop"] <= RELOADS_PER_TILE_LOOP, r


#: (causal, C) layouts of the offline WS checks.
_WS_LAYOUTS = [(True, 0), (True, 1), (True, 2), (False, 0), (False, 2), (False, 4)]


def _ws_spill_free_cases():
    """(d, causal, C): every layout at D=128 (the library default on all of them since
    COLS_SMEM) and at D=64 (its 128x128 s3 tile)."""
    return [(d, cz, c) for d in (128, 64) for cz, c in _WS_LAYOUTS]


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
@pytest.mark.parametrize("d, causal, c", _ws_spill_free_cases())
def test_ws_kernel_compiles_without_spills_in_tile_loops(d, causal, c):
    """The WS forward at its library tile (WS_TILES) and ping-pong choice: HGMMA, the
    overlapped S wait, the producer's TMA loads, register reallocation (24 for the producer,
    240 for the consumers) and no spill inside a tile loop."""
    cfg, pingpong = WS_TILES[d]
    r = CT.fwd_report(d, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                      causal=causal, c=c, warp_spec=True, pingpong=pingpong)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["tma_load"] > 0 and r["overlap"], r
    assert 24 in r["setmaxnreg"] and F.ws_consumer_regs() in r["setmaxnreg"], r
    _assert_tile_loops_keep_registers(r)


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
@pytest.mark.parametrize("causal, c", [(True, 0), (True, 1), (False, 2)])
def test_ws_kernel_compiles_at_d256(causal, c):
    """The D=256 tile (128x64 s2, 192 KB of shared memory plus the column ring): compiles, no
    spill in the tile loops (the masked loops spilled 3 values each before COLS_SMEM)."""
    cfg, pingpong = WS_TILES[256]
    r = CT.fwd_report(256, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                      causal=causal, c=c, warp_spec=True, pingpong=pingpong)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["shared"] <= F.SMEM_LIMIT + 1024, r
    _assert_tile_loops_keep_registers(r)


def test_ws_register_split():
    """Two consumer warpgroups: maxnreg 168 over 12 warp slots, one program per SM; one: 128
    over 8 warp slots, two programs per SM; the producer's warpgroup gives back all but 24."""
    assert F.ws_maxnreg() == F.ws_maxnreg(8) == 168 and F.ws_consumer_regs() == 240
    assert 4 * (2 * F.ws_consumer_regs() + F.WS_PRODUCER_REGS) <= 12 * F.ws_maxnreg()
    assert F.ws_maxnreg(4) == 128 and F.ws_consumer_regs(4) == 232
    assert 2 * 32 * 4 * (F.ws_consumer_regs(4) + F.WS_PRODUCER_REGS) <= 65536


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
@pytest.mark.parametrize("d, causal, c", [(128, True, 1), (128, True, 0), (128, False, 2),
                                          (64, True, 1)])
def test_one_consumer_ws_kernel_fits_two_programs_per_sm(d, causal, c):
    """The one-warpgroup WS forward (64 query rows, 4 consumer warps) at 64x64 s2: HGMMA with
    the overlapped S wait, the producer's TMA loads, 24 / 232 registers, no spill in a tile
    loop, and shared memory and registers for two programs per SM."""
    r = CT.fwd_report(d, 64, 64, 4, 2, causal=causal, c=c, warp_spec=True)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["tma_load"] > 0 and r["overlap"], r
    assert r["setmaxnreg"] == [24, 232] and r["regs"] <= 128, r
    _assert_tile_loops_keep_registers(r)
    assert 2 * (r["shared"] + F.RESERVED_SHARED_PER_PROGRAM) <= F.SM_SHARED, r
    assert r["shared"] <= F.shared_bytes(d, 64, 64, 2, c) + F.WS_SHARED_SLACK, r
    assert F.ws_programs_per_sm(d, 64, 64, 4, 2, c) == 2
    assert F.ws_programs_per_sm(d, 128, 128, 8, 2, c) == 1


def test_config_checks():
    F.check_config(128, 128, 128, 8, 3)
    # the WS tile 128x128 s3 at D=128 fits (224 KB) until the column ring of a C=4 mask is added
    F.check_config(128, 128, 128, 8, 3, warp_spec=True)
    with pytest.raises(ValueError, match="shared memory"):
        F.check_config(128, 128, 128, 8, 3, warp_spec=True, col_words=4)
    F.check_config(128, 64, 128, 4, 2)
    F.check_config(64, 128, 64, 8, 3)
    with pytest.raises(ValueError):
        F.check_config(128, 128, 128, 4, 3)  # block_m must be 16 * num_warps
    with pytest.raises(ValueError):
        F.check_config(128, 128, 128, 8, 1)  # the ring needs two slots
    with pytest.raises(ValueError):
        F.check_config(128, 128, 128, 8, 4)  # 288 KB of shared memory
    with pytest.raises(ValueError):
        F.check_config(96, 128, 128, 8, 2)
    F.check_config(128, 128, 64, 8, 4, warp_spec=True, pingpong=True)
    F.check_config(128, 64, 64, 4, 2, warp_spec=True)  # one consumer warpgroup
    with pytest.raises(ValueError, match="warp_spec"):
        F.check_config(128, 32, 64, 2, 4, warp_spec=True)  # whole warpgroups of 64 rows
    with pytest.raises(ValueError, match="two consumer warpgroups"):
        F.check_config(128, 64, 64, 4, 2, warp_spec=True, pingpong=True)
    with pytest.raises(ValueError, match="pingpong"):
        F.check_config(128, 128, 64, 8, 4, pingpong=True)


# ---------------------------------------------------------------------------------------------
# GPU: through the public function against the float64 reference
# ---------------------------------------------------------------------------------------------


def _require_hopper_gluon():
    if F.unavailable_reason():
        pytest.skip(F.unavailable_reason())
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (sm_90: the Gluon kernels use wgmma)")


def _gpu_masks(s):
    """name -> (FlashMask or None, causal): a few of tests/helpers' GPU masks and one whose
    rows [0, s/4) see no key (non-causal C=2 columns [LTS = s/2, UTE = s/4])."""
    from tests.helpers import gpu_masks

    masks = {k: v for k, v in gpu_masks(s).items()
             if k in ("causal", "full", "causal_document", "document", "sliding_window",
                      "global_sliding_window")}
    cols = torch.empty((1, 1, s, 2), dtype=torch.int32)
    cols[..., 0] = s // 2
    cols[..., 1] = s // 4
    masks["empty_rows"] = (cols, False)
    return masks


_GPU_MASK_NAMES = ["causal", "full", "causal_document", "document", "sliding_window",
                   "global_sliding_window", "empty_rows"]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["gluon_ws", "gluon_wsp"])
@pytest.mark.parametrize("d", [128, 64, 256])
@pytest.mark.parametrize("name", _GPU_MASK_NAMES)
def test_gpu_ws_forward_matches_reference(name, d, impl, monkeypatch):
    _check_public_forward(name, impl, d, monkeypatch)


def _force_forward(monkeypatch, kernel: str, tile):
    """Make the dispatch choose ``kernel`` at ``tile`` for the forward (the backward as chosen)."""
    choose = dispatch.choose

    def forced(*args, **kwargs):
        choice = choose(*args, **kwargs)
        return dispatch.Choice(dispatch.Launch("fwd", kernel, tile, "test"), choice.backward)

    monkeypatch.setattr(dispatch, "choose", forced)


def _check_public_forward(name, impl, d, monkeypatch):
    """O and LSE of the public function with the forward forced to the WS kernel (``impl``
    gluon_ws: without, gluon_wsp: with ping-pong) at its :data:`WS_TILES` tile against the
    float64 reference (S=1000, GQA 4:2), the fully masked rows, finite gradients."""
    import flashmask3

    _require_hopper_gluon()
    _force_forward(monkeypatch, "gluon_ws_pingpong" if impl == "gluon_wsp" else "gluon_ws",
                   WS_TILES[d][0])
    s = 1000  # not a multiple of the blocks
    mask, causal = _gpu_masks(s)[name]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, s, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, s, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if isinstance(mask, torch.Tensor):  # (the masks are built for one sequence: batch 2 here)
        cols = mask.expand(2, -1, -1, -1).contiguous().cuda()
        mask_arg, kw = cols, dict(causal=causal)
    elif mask is None:
        cols, mask_arg, kw = None, None, dict(causal=causal)
    else:
        cols = mask.startend_row_indices.expand(2, -1, -1, -1).contiguous().cuda()
        causal, mask_arg, kw = mask.causal, cols, dict(causal=mask.causal)
    out, lse = flashmask3.flashmask_attention(q, k, v, mask_arg, return_softmax_lse=True, **kw)
    ref_out, ref_lse = reference_attention(q, k, v, cols, causal, 1 / math.sqrt(d))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    empty = torch.isinf(ref_lse)
    if name == "empty_rows":
        assert empty.any()
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all()
    assert rel_err(out, ref_out) < 2e-2
    assert rel_err(lse, ref_lse) < 1e-3
    grads = torch.autograd.grad((out.float() * torch.randn_like(out, dtype=torch.float32)).sum(),
                                (q, k, v))
    for gr in grads:
        assert torch.isfinite(gr).all()


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal, c", [(128, True, 0), (128, True, 1), (128, False, 2),
                                          (128, False, 4), (64, True, 1)])
def test_gpu_one_consumer_ws_forward_matches_reference(d, causal, c):
    """The one-warpgroup WS forward (64x64 w4 s2, two programs per SM) on random column masks whose rows may be fully masked (Sq != Sk,
    GQA, fp16 and bf16): O and LSE against the float64 reference, zeros on the empty rows, and
    O bitwise equal to the tl forward at the same tile (the same key blocks in the same order,
    the same k-steps)."""
    from tests.helpers import random_columns

    _require_hopper_gluon()
    b, sq, sk, hq, hk = 2, 700, 1100, 4, 2
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator(device="cuda").manual_seed(17)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
                for _ in range(2))
        cols = None if c == 0 else random_columns(b, hq, sq, sk, causal, c, seed=9).cuda()
        plan = tiles.make_plan(cols, causal, sq, sk, 64, 64, False, q.device)
        args = (q, k, v, cols, causal, 1 / math.sqrt(d), plan, 64, 64, 4, 2)
        one = F.launch_fwd_gluon(*args, warp_spec=True)
        tl_out, tl_lse = TL.launch_fwd(q, k, v, causal, 1 / math.sqrt(d),
                                       tiles.Config(64, 64, 4, 2), plan)
        torch.cuda.synchronize()
        ref_out, ref_lse = reference_attention(q, k, v, cols, causal, 1 / math.sqrt(d))
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(one[1]), empty)
        assert (one[0].permute(0, 2, 1, 3)[empty] == 0).all()
        assert rel_err(one[0], ref_out) < 2e-2 and rel_err(one[1], ref_lse) < 1e-3
        assert torch.equal(one[0], tl_out), (one[0].float() - tl_out.float()).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_short_documents_take_the_short_rows_tile(d):
    """A causal document mask of short documents (a FlashMask from the constructor, so its
    mean row span is known) runs the table's short-rows tile through the public function, and O,
    LSE and the gradients match the float64 reference."""
    import flashmask3
    import flashmask3.masks as M

    _require_hopper_gluon()
    s, hq, hk = 1500, 4, 2
    lens = M.random_document_lengths(s, 90, seed=4)
    mask = M.causal_document_mask(lens, batch_size=2, device="cuda")
    from flashmask3.api import kernel_row_span

    threshold, tile = next((r.span_below, r.tile) for r in dispatch.TABLE if r.pass_ == "fwd"
                           and r.span_below is not None and d in r.dims)
    assert kernel_row_span(mask) < threshold
    g = torch.Generator(device="cuda").manual_seed(21)
    q = torch.randn(2, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    assert dispatch.choose(q.device, q.dtype, d, True, 1,
                           kernel_row_span(mask)).forward.tile == tile
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = flashmask3.flashmask_attention(q, k, v, mask, return_softmax_lse=True)
    cols = mask.startend_row_indices
    ref_out, ref_lse = reference_attention(q, k, v, cols, True, 1 / math.sqrt(d))
    assert rel_err(out, ref_out) < 2e-2 and rel_err(lse, ref_lse) < 1e-3
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.to(ref_out.dtype))
    for gr, rg in zip(grads, ref_grads):
        assert rel_err(gr, rg) < 3e-2
