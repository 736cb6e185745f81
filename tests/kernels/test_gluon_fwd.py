"""The Gluon forward kernel (flashmask3/kernels/gluon_fwd.py).

CPU: the kernel compiles offline for sm_90 (Triton's bundled ptxas/cuobjdump, no GPU) into a
cubin with wgmma (HGMMA), a wait that leaves the PV matmul in flight under the softmax
(``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and no spill inside a tile loop at 128x128 w8 on the
layouts below; the env dispatch FLASHMASK3_TRITON_FWD accepts tl/gluon (falling back to tl
where Gluon cannot run) and rejects anything else. GPU (``gpu`` marker): through the public
function with FLASHMASK3_TRITON_FWD=gluon, O and LSE match the float64 dense reference on
several masks (a fully masked row: O = 0, LSE = -inf, no NaN), and the backward runs on them.
The warp-specialised kernel (``_fwd_ws_kernel``, FLASHMASK3_TRITON_FWD=gluon_ws / gluon_wsp):
offline, its tile loops hold no spill at its D=128 and D=64 tiles on every layout and it
compiles at D=256; on the GPU the same reference checks at D=64, 128 and 256, with and without
ping-pong.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from flashmask3.kernels import gluon_fwd as F
from flashmask3.kernels import triton_flashmask as T
from tests.kernels.test_gluon_dkdv import _offline_skip_reason
from tests.reference import reference_attention, rel_err

_SKIP = _offline_skip_reason()


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
@pytest.mark.parametrize("causal, c", [(True, 0), (True, 1), (False, 4)])
def test_compiles_for_sm90_with_overlapped_wgmma(causal, c):
    """128x128 w8 s3 (the tl D=128 forward default tile): HGMMA, the overlapped wait, TMA
    loads, and no spill inside the tile loops."""
    r = F.compile_report(128, 128, 128, 8, 3, causal=causal, c=c)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["tma_load"] > 0, r
    assert r["overlap"], r
    assert r["ldl_stl_in_tile_loops"] == 0, r
    assert r["shared"] <= F.SMEM_LIMIT + 1024, r


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
def test_other_shape_compiles():
    """128x64 w8 (no spill at all on the offline report)."""
    r = F.compile_report(128, 128, 64, 8, 3, causal=False, c=2)
    assert "error" not in r, r.get("error")
    assert r["overlap"] and r["ldl_stl"] == 0, r


#: (causal, C) layouts of the offline WS checks.
_WS_LAYOUTS = [(True, 0), (True, 1), (True, 2), (False, 0), (False, 2), (False, 4)]


def _ws_spill_free_cases():
    """(d, causal, C): every layout at D=128 (the library default on all of them since
    COLS_SMEM) and at D=64 (its 128x128 s3 tile)."""
    return [(d, cz, c) for d in (128, 64) for cz, c in _WS_LAYOUTS]


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
@pytest.mark.parametrize("d, causal, c", _ws_spill_free_cases())
def test_ws_kernel_compiles_without_spills_in_tile_loops(d, causal, c):
    """The WS forward at its library tile (T.GLUON_TILE) and ping-pong choice: HGMMA, the
    overlapped S wait, the producer's TMA loads, register reallocation (24 for the producer,
    240 for the consumers) and no spill inside a tile loop."""
    cfg = T.GLUON_TILE[("fwd", d)]
    r = F.compile_report(d, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                         causal=causal, c=c, warp_spec=True,
                         pingpong=T.GLUON_FWD_PINGPONG[d])
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["tma_load"] > 0 and r["overlap"], r
    assert 24 in r["setmaxnreg"] and F.ws_consumer_regs() in r["setmaxnreg"], r
    assert r["ldl_stl_in_tile_loops"] == 0, r


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
@pytest.mark.parametrize("causal, c", [(True, 0), (True, 1), (False, 2)])
def test_ws_kernel_compiles_at_d256(causal, c):
    """The D=256 tile (128x64 s2, 192 KB of shared memory plus the column ring): compiles, no
    spill in the tile loops (the masked loops spilled 3 values each before COLS_SMEM)."""
    cfg = T.GLUON_TILE[("fwd", 256)]
    r = F.compile_report(256, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                         causal=causal, c=c, warp_spec=True,
                         pingpong=T.GLUON_FWD_PINGPONG[256])
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["shared"] <= F.SMEM_LIMIT + 1024, r
    assert r["ldl_stl_in_tile_loops"] == 0, r


@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
def test_ws_persistent_kernel_claims_its_blocks():
    """The PERSISTENT WS forward compiles at the D=128 library tile: its producer claims blocks
    from the global counter (the first claim and the one per block: two atomic sites), the
    one-block kernel has none, and the mask-free causal layout keeps its tile loops spill-free
    with the claim loop around them."""
    cfg = T.GLUON_TILE[("fwd", 128)]
    shape = (128, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    per = F.compile_report(*shape, causal=True, c=0, warp_spec=True, persistent=True)
    one = F.compile_report(*shape, causal=True, c=0, warp_spec=True)
    assert "error" not in per, per.get("error")
    assert per["atomics"] == 2 and one["atomics"] == 0, (per, one)
    assert per["ldl_stl_in_tile_loops"] == 0, per


def test_default_forward_kernel_per_layout(monkeypatch):
    """Without the env variable, the WS forward is chosen exactly at GLUON_FWD_DIMS, on every
    mask layout (where the Gluon kernel can run; forced here, the check told the mask's C
    for the column ring's shared memory), with that head dim's ping-pong choice, and tl
    elsewhere; the env variable forces WS at another head dim too."""
    monkeypatch.delenv("FLASHMASK3_TRITON_FWD", raising=False)
    checked = []

    def fake_runs(q, module, cfg, **variant):
        checked.append(variant.get("col_words"))
        return True

    monkeypatch.setattr(T, "_gluon_runs", fake_runs)
    monkeypatch.setattr(T, "_interpreting", lambda: False)  # (the CPU tests set TRITON_INTERPRET)
    for d in (64, 128, 256):
        q = torch.zeros(1, 8, 1, d, dtype=torch.bfloat16)
        cfg = T.GLUON_TILE[("fwd", d)]
        for causal, c in _WS_LAYOUTS:
            want = "tl"
            if d in T.GLUON_FWD_DIMS:
                want = "gluon_wsp" if T.GLUON_FWD_PINGPONG[d] else "gluon_ws"
            checked.clear()
            assert T._fwd_impl(q, cfg, c) == want, (d, causal, c)
            assert checked == ([c] if want != "tl" else []), (d, c, checked)
            tile = T._config("fwd", d, causal, c, q.dtype, like=q)
            expect = cfg if want != "tl" else T.CANDIDATES[("fwd", d)][0]
            assert tile == expect, (d, causal, c, tile)
    q = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("FLASHMASK3_TRITON_FWD", "gluon_ws")
    assert T._fwd_impl(q, T.GLUON_TILE[("fwd", 64)], 1) == "gluon_ws"


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
    r = F.compile_report(d, 64, 64, 4, 2, causal=causal, c=c, warp_spec=True)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["tma_load"] > 0 and r["overlap"], r
    assert r["setmaxnreg"] == [24, 232] and r["regs"] <= 128, r
    assert r["ldl_stl_in_tile_loops"] == 0, r
    assert 2 * (r["shared"] + F.RESERVED_SHARED_PER_PROGRAM) <= F.SM_SHARED, r
    assert r["shared"] <= F.shared_bytes(d, 64, 64, 2, c) + F.WS_SHARED_SLACK, r
    assert F.ws_programs_per_sm(d, 64, 64, 4, 2, c) == 2
    assert F.ws_programs_per_sm(d, 128, 128, 8, 2, c) == 1


def test_ab_config_labels_round_trip():
    """benchmarks/gluon_fwd_ab.py's config labels: WS / ping-pong / global-column / persistent
    suffixes parse to the launcher's flags and print back the same; a label without stages is
    refused."""
    from benchmarks import gluon_fwd_ab as AB

    cases = {"128x128w8s3": (128, 128, 8, 3, False, False, 0, True),
             "128x64w8s4ws": (128, 64, 8, 4, True, False, 0, True),
             "128x128w8s2wsp": (128, 128, 8, 2, True, True, 0, True),
             "128x128w8s2wsg": (128, 128, 8, 2, True, False, 0, False),
             "128x128w8s2ws+P": (128, 128, 8, 2, True, False, -1, True),
             "128x64w8s2wspg+P3": (128, 64, 8, 2, True, True, 3, False),
             "64x64w4s2ws": (64, 64, 4, 2, True, False, 0, True)}
    for label, cfg in cases.items():
        assert AB._parse(label) == cfg
        assert AB._label(cfg) == label
    assert AB._label((128, 64, 8, 3)) == "128x64w8s3"
    with pytest.raises(ValueError, match="BMxBNwWsS"):
        AB._parse("128x64w8")
    assert AB._parse_tl("64x64w4s3") == T.Config(64, 64, 4, 3)


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
    F.check_config(128, 64, 64, 4, 2, warp_spec=True, persistent=True)
    with pytest.raises(ValueError, match="warp_spec"):
        F.check_config(128, 32, 64, 2, 4, warp_spec=True)  # whole warpgroups of 64 rows
    with pytest.raises(ValueError, match="two consumer warpgroups"):
        F.check_config(128, 64, 64, 4, 2, warp_spec=True, pingpong=True)
    with pytest.raises(ValueError, match="pingpong"):
        F.check_config(128, 128, 64, 8, 4, pingpong=True)


def test_short_rows_hint_picks_the_measured_tile(monkeypatch):
    """A mean row span below SHORT_ROWS_FWD's threshold picks its forward tile: at D=128 the
    one-warpgroup WS tile where the WS forward runs it (here, on a CPU tensor, where it is
    made to), at D=64 the tl 64x64 tile; at or above the threshold, without a span, at D=256,
    with FLASHMASK3_TRITON_FWD set, for the backward kernels or where the WS forward cannot
    run, the usual tile."""
    monkeypatch.delenv("FLASHMASK3_TRITON_FWD", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(T, "_TUNED", {})
    bf16 = torch.bfloat16
    q128 = torch.zeros(1, 8, 1, 128, dtype=bf16)
    q64 = torch.zeros(1, 8, 1, 64, dtype=bf16)
    q256 = torch.zeros(1, 8, 1, 256, dtype=bf16)
    default128 = T._config("fwd", 128, True, 1, bf16, like=q128)
    assert T._config("fwd", 128, True, 1, bf16, like=q128, row_span=900.0) == default128
    def runs_if_accepted(q, module, cfg, **variant):  # as on an H200: the config checks only
        try:
            importlib.import_module(f"flashmask3.kernels.{module}").check_config(
                q.shape[-1], cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, **variant)
        except ValueError:
            return False
        return True

    monkeypatch.setattr(T, "_gluon_runs", runs_if_accepted)
    assert T._config("fwd", 128, True, 1, bf16, like=q128) == T.GLUON_TILE[("fwd", 128)]
    threshold, tile = T.SHORT_ROWS_FWD[128]
    assert tile == T.Config(64, 64, 4, 2) and T._fwd_impl(q128, tile, 1) == "gluon_ws"
    assert T._config("fwd", 128, True, 1, bf16, like=q128, row_span=900.0) == tile
    assert T._config("fwd", 128, False, 2, bf16, like=q128, row_span=threshold - 1) == tile
    assert T._config("fwd", 128, True, 1, bf16, like=q128,
                     row_span=threshold) == T.GLUON_TILE[("fwd", 128)]
    assert T._config("dkdv", 128, True, 1, bf16, like=q128, row_span=900.0) == T.GLUON_TILE[
        ("dkdv", 128)]
    assert T._config("fwd", 64, True, 1, bf16, like=q64, row_span=900.0) == T.Config(64, 64, 4, 3)
    assert T._config("fwd", 256, True, 1, bf16, like=q256, row_span=900.0) == T.GLUON_TILE[
        ("fwd", 256)]
    monkeypatch.setenv("FLASHMASK3_TRITON_FWD", "gluon_ws")
    assert T._config("fwd", 128, True, 1, bf16, like=q128,
                     row_span=900.0) == T.GLUON_TILE[("fwd", 128)]


def test_dispatch_env(monkeypatch):
    """Default and =tl: tl; =gluon: tl wherever Gluon cannot run (CPU tensors here); anything
    else: a ValueError naming the variable."""
    q = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    cfg = T.CANDIDATES[("fwd", 128)][0]
    monkeypatch.delenv("FLASHMASK3_TRITON_FWD", raising=False)
    assert T._fwd_impl(q, cfg) == "tl"
    for value in ("tl", "gluon", " gluon ", "gluon_ws", "gluon_wsp"):
        monkeypatch.setenv("FLASHMASK3_TRITON_FWD", value)
        assert T._fwd_impl(q, cfg) == "tl"
    for bad in ("triton", "GLUON", "1"):
        monkeypatch.setenv("FLASHMASK3_TRITON_FWD", bad)
        with pytest.raises(ValueError, match="FLASHMASK3_TRITON_FWD"):
            T._fwd_impl(q, cfg)


# ---------------------------------------------------------------------------------------------
# GPU: through the public function against the float64 reference
# ---------------------------------------------------------------------------------------------


def _require_hopper_gluon():
    if F.unavailable_reason():
        pytest.skip(F.unavailable_reason())
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90 (wgmma)")


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
@pytest.mark.parametrize("name", _GPU_MASK_NAMES)
def test_gpu_public_forward_matches_reference(name, monkeypatch):
    _check_public_forward(name, "gluon", 128, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["gluon_ws", "gluon_wsp"])
@pytest.mark.parametrize("d", [128, 64, 256])
@pytest.mark.parametrize("name", _GPU_MASK_NAMES)
def test_gpu_ws_forward_matches_reference(name, d, impl, monkeypatch):
    _check_public_forward(name, impl, d, monkeypatch)


def _check_public_forward(name, impl, d, monkeypatch):
    """O and LSE of the public function with FLASHMASK3_TRITON_FWD=``impl`` against the
    float64 reference (S=1000, GQA 4:2), the fully masked rows, finite gradients."""
    import flashmask3

    _require_hopper_gluon()
    monkeypatch.setenv("FLASHMASK3_TRITON_FWD", impl)
    s = 1000  # not a multiple of the blocks
    mask, causal = _gpu_masks(s)[name]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, s, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, s, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cfg = T._config("fwd", d, causal is True, 0, q.dtype, like=q)
    assert T._fwd_impl(q, cfg) == impl
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
@pytest.mark.parametrize("programs", [3, None])
@pytest.mark.parametrize("d, causal, c", [(128, True, 0), (128, True, 1), (128, False, 2),
                                          (256, True, 1), (64, False, 4)])
def test_gpu_persistent_ws_forward_equals_one_block_kernel(d, causal, c, programs):
    """The PERSISTENT WS forward (3 programs: every program takes many blocks, the ring
    counter and Q's barrier running on across them; None: one per SM) gives O and LSE
    bitwise equal to the one-block WS kernel (same tiles, same order of the key blocks), on
    random column masks whose rows may be fully masked (Sq != Sk, GQA)."""
    from tests.helpers import random_columns

    _require_hopper_gluon()
    cfg = T.GLUON_TILE[("fwd", d)]
    pp = T.GLUON_FWD_PINGPONG[d]
    b, sq, sk, hq, hk = 2, 700, 1100, 4, 2
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    cols = None if c == 0 else random_columns(b, hq, sq, sk, causal, c, seed=5).cuda()
    plan = T.make_plan(cols, causal, sq, sk, cfg.block_m, cfg.block_n, False, q.device)
    args = (q, k, v, cols, causal, 1 / math.sqrt(d), plan, cfg.block_m, cfg.block_n,
            cfg.num_warps, cfg.num_stages)
    one = F.launch_fwd_gluon(*args, warp_spec=True, pingpong=pp)
    per = F.launch_fwd_gluon(*args, warp_spec=True, pingpong=pp, persistent=True,
                             programs=programs)
    torch.cuda.synchronize()
    assert torch.equal(one[0], per[0]) and torch.equal(one[1], per[1])
    ref_out, ref_lse = reference_attention(q, k, v, cols, causal, 1 / math.sqrt(d))
    assert rel_err(per[0], ref_out) < 2e-2
    assert torch.equal(torch.isinf(per[1]), torch.isinf(ref_lse))


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal, c", [(128, True, 0), (128, True, 1), (128, False, 2),
                                          (128, False, 4), (64, True, 1)])
def test_gpu_one_consumer_ws_forward_matches_reference(d, causal, c):
    """The one-warpgroup WS forward (64x64 w4 s2, two programs per SM), one-block and
    persistent (3 programs), on random column masks whose rows may be fully masked (Sq != Sk,
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
        plan = T.make_plan(cols, causal, sq, sk, 64, 64, False, q.device)
        args = (q, k, v, cols, causal, 1 / math.sqrt(d), plan, 64, 64, 4, 2)
        one = F.launch_fwd_gluon(*args, warp_spec=True)
        per = F.launch_fwd_gluon(*args, warp_spec=True, persistent=True, programs=3)
        tl_out, tl_lse = T._launch_fwd_tl(q, k, v, cols, causal, 1 / math.sqrt(d),
                                          T.Config(64, 64, 4, 2), plan)
        torch.cuda.synchronize()
        assert torch.equal(one[0], per[0]) and torch.equal(one[1], per[1])
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
    mean row span is known) runs the SHORT_ROWS_FWD tile through the public function, and O,
    LSE and the gradients match the float64 reference."""
    import flashmask3
    import flashmask3.masks as M

    _require_hopper_gluon()
    s, hq, hk = 1500, 4, 2
    lens = M.random_document_lengths(s, 90, seed=4)
    mask = M.causal_document_mask(lens, batch_size=2, device="cuda")
    from flashmask3.api import kernel_row_span

    assert kernel_row_span(mask) < T.SHORT_ROWS_FWD[d][0]
    g = torch.Generator(device="cuda").manual_seed(21)
    q = torch.randn(2, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    assert T._config("fwd", d, True, 1, q.dtype, like=q,
                     row_span=kernel_row_span(mask)) == T.SHORT_ROWS_FWD[d][1]
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
