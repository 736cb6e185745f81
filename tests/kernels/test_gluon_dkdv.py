"""The Gluon dK/dV kernel (flashmask3/kernels/gluon_dkdv.py).

CPU: the kernel compiles offline for sm_90 (Triton's bundled ptxas/cuobjdump, no GPU) into a
cubin that uses wgmma (HGMMA) with overlapped waits and spills at most a few loop-invariant
registers; so does its FUSE_DQ variant (TMA reduce-add of dQ, no element atomics); the launcher
compiles exactly the offline-checked kernels. GPU (``gpu`` marker): its dK, dV match the ``tl``
dK/dV kernel's on a few masks; the fused Gluon backward's dQ, dK, dV match the split backward's.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from flashmask3.kernels import gluon_dkdv as G
from flashmask3.kernels import triton_flashmask as T
from flashmask3.kernels.triton_report import cuobjdump
from tests.helpers import gpu_masks

#: Spill bound of the default D=128 config: its few spills are loop-invariant scalars around
#: the per-head setup (offline report: 48-80 bytes of stack, 20-36 LDL/STL in the whole
#: kernel, none inside the tile loops); 64x64 would spill ~300 and is not a default.
MAX_LDL_STL = 64

#: FUSE_DQ at 32x64 w4 s3 (offline report, D=128 bf16): 62-115 LDL/STL in the kernel; inside
#: the tile loops 2 (causal C=0/1), 22 (non-causal C=2), 18 (C=4), mostly LDL reloads of loop
#: invariants. 16x64 w4 s3: none inside the loops.
MAX_FUSED_LDL_STL = 140
MAX_FUSED_LOOP_LDL_STL = {(True, 1): 4, (False, 2): 32, (True, 0): 4, (False, 4): 28}


def _default_config(d: int) -> tuple:
    """The library's default dK/dV (block_m, block_n, num_warps, num_stages) at head dim d."""
    c = T.CANDIDATES[("dkdv", d)][0]
    return (c.block_m, c.block_n, c.num_warps, c.num_stages)


def _offline_skip_reason():
    reason = G.unavailable_reason()
    if reason:
        return reason
    for tool in ("ptxas", "cuobjdump"):
        if not os.path.exists(os.path.join(G._TOOLS, tool)) and shutil.which(tool) is None:
            return f"Triton's bundled {tool} is not available"
    return None


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2), (True, 0), (False, 4)])
def test_compiles_for_sm90_with_overlapped_wgmma(causal, c):
    cfg = _default_config(128)
    r = G.compile_report(128, *cfg, causal=causal, c=c)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0, r
    assert r["ldl_stl"] <= MAX_LDL_STL, r
    assert r["tma_load"] > 0, r
    # async schedule: some waits leave one wgmma group in flight
    assert r["wgmma_wait"] > 0, r


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
def test_wait_leaves_a_group_in_flight():
    """The SASS waits ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (the point of the kernel): S^T's wait
    leaves dP^T running, dP^T's wait leaves dV running."""
    ck = G.compile_sm90(128, *_default_config(128), causal=True, c=1)
    sass = cuobjdump(ck.asm["cubin"])[1]
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2), (True, 0), (False, 4)])
def test_fused_dq_compiles_for_sm90(causal, c):
    """FUSE_DQ (32x64 w4 s3, D=128): the dQ^T wgmmas (more HGMMA than the split kernel), one TMA
    reduce-add (UTMAREDG) per tile loop, no element atomics, bounded spills in the tile loops."""
    split = G.compile_report(128, 32, 64, 4, 3, causal=causal, c=c)
    r = G.compile_report(128, 32, 64, 4, 3, causal=causal, c=c, fuse_dq=True)
    assert "error" not in r, r.get("error")
    assert split["tma_reduce"] == 0 and split["ldl_stl_in_tile_loops"] == 0, split
    assert r["hgmma"] > split["hgmma"], (r, split)
    assert r["tma_reduce"] == r["tile_loops"] > 0, r
    assert r["atomics"] == 0, r
    assert r["ldl_stl"] <= MAX_FUSED_LDL_STL, r
    assert r["ldl_stl_in_tile_loops"] <= MAX_FUSED_LOOP_LDL_STL[(causal, c)], r


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2)])
def test_fused_dq_16x64_does_not_spill_in_tile_loops(causal, c):
    r = G.compile_report(128, 16, 64, 4, 3, causal=causal, c=c, fuse_dq=True)
    assert "error" not in r, r.get("error")
    assert r["tma_reduce"] > 0 and r["ldl_stl_in_tile_loops"] == 0, r


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
def test_launcher_compiles_the_offline_checked_kernels(monkeypatch):
    """``launch_dkdv_gluon``'s real arguments (split: dq_desc=None, a constexpr; fused: the
    strided dQ^T descriptor, Sq=777 padded to 780) bound by Triton's JIT under a stand-in sm_90
    driver (compile only, nothing launched) give the same SASS as :func:`compile_sm90`."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    kern = G._dkdv_gluon_kernel
    compiled = {}

    class _WarmupOnly:  # kernel[grid](...) compiles without launching; the rest as kernel
        def __getattr__(self, name):
            return getattr(kern, name)

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                compiled["kernel"] = kern.run(*args, grid=grid, warmup=True, **kwargs)
            return run

    def sass(cubin):
        return cuobjdump(cubin)[1]

    saved = driver._active
    kern.device_caches.clear()
    driver.set_active(_Sm90())
    monkeypatch.setattr(G, "_dkdv_gluon_kernel", _WarmupOnly())
    try:
        b, sq, sk, hq, hk, d = 2, 777, 1000, 4, 2, 128
        nkb = -(-sk // 64)
        q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, dtype=torch.bfloat16)
        lse2 = torch.zeros(b, hq, sq)
        cols = torch.full((b, 1, sk, 1), sq, dtype=torch.int32)
        stats = torch.zeros(b, nkb, 8, dtype=torch.int32)
        plan = T.Plan(cols, stats, stats.clone(), 1, 1, 1, 1)
        for fuse in (False, True):
            out = G.launch_dkdv_gluon(q, k, k, q, lse2, lse2, True, 0.1, plan, 32, 64, 4, 3,
                                      fuse_dq=fuse)
            assert len(out) == (3 if fuse else 2)
            if fuse:
                assert out[2].shape == (b, sq, hq, d) and out[2].dtype == torch.float32
                assert out[2].stride()[1] == 1  # the [B, Hq, D, Sq_pad] dQ^T buffer
            ref = G.compile_sm90(128, 32, 64, 4, 3, True, 1, "bf16", fuse_dq=fuse)
            assert sass(compiled["kernel"].asm["cubin"]) == sass(ref.asm["cubin"]), fuse
    finally:
        driver._active = saved
        kern.device_caches.clear()


def test_config_checks():
    with pytest.raises(ValueError):
        G.check_config(128, 32, 128, 4, 2)  # block_n must be 16 * num_warps
    with pytest.raises(ValueError):
        G.check_config(96, 32, 64, 4, 2)
    with pytest.raises(ValueError):
        G.check_config(128, 32, 64, 4, 0)
    G.check_config(128, 32, 64, 4, 3)
    G.check_config(128, 32, 64, 4, 1)
    G.check_config(*((128,) + _default_config(128)))  # the D=128 default runs on Gluon
    G.check_config(128, 32, 128, 8, 3, fuse_dq=True)
    with pytest.raises(ValueError):
        G.check_config(64, 32, 128, 8, 3, fuse_dq=True)  # dQ^T: d rows, 16 per warp


def test_dispatch_uses_tl_off_hopper(monkeypatch):
    """CPU tensors (and the interpreter) take the tl kernel; a bad override is a clear error."""
    q = torch.zeros(1, 8, 1, 128)
    cfg = T.CANDIDATES[("dkdv", 128)][0]
    monkeypatch.delenv("FLASHMASK3_TRITON_DKDV", raising=False)
    assert T._dkdv_impl(q, cfg) == "tl"
    monkeypatch.setenv("FLASHMASK3_TRITON_DKDV", "gluon")
    assert T._dkdv_impl(q, cfg) == "tl"  # no GPU: gluon cannot run, falls back
    monkeypatch.setenv("FLASHMASK3_TRITON_DKDV", "cutlass")
    with pytest.raises(ValueError, match="FLASHMASK3_TRITON_DKDV"):
        T._dkdv_impl(q, cfg)


# ---------------------------------------------------------------------------------------------
# GPU: against the tl kernel
# ---------------------------------------------------------------------------------------------


def _require_hopper_gluon():
    """Skip unless gluon imports and the GPU is sm_90 (the kernel's wgmma)."""
    if G.unavailable_reason():
        pytest.skip(G.unavailable_reason())
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90 (wgmma)")


def _gpu_inputs(name, s, d, seed):
    """bf16 q, k, v, dO (B=2, GQA 4:2), the mask columns on the GPU, causal, the scale, and
    the forward's O and LSE for mask ``name`` at length ``s``."""
    mask, causal = gpu_masks(s)[name]
    cols = None if mask is None else mask.startend_row_indices.cuda()
    causal = causal if mask is None else mask.causal
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, s, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, s, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    out, lse = T.forward(q, k, v, cols, causal, scale)
    return q, k, v, dout, cols, causal, scale, out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("cfg", [(32, 64, 4, 3), (32, 128, 8, 3)])
def test_gpu_matches_tl_kernel(name, cfg):
    _require_hopper_gluon()
    s, d = 1000, 128
    q, k, v, dout, cols, causal, scale, out, lse = _gpu_inputs(name, s, d, seed=3)
    delta, lse2 = T._bwd_pre(out, dout, lse, None)
    c = 0 if cols is None else cols.shape[-1]
    tcfg = T._config("dkdv", d, causal, c, q.dtype)
    tplan = T.make_plan(cols, causal, s, s, tcfg.block_m, tcfg.block_n, True, q.device)
    ref = T._launch_dkdv_tl(q, k, v, dout, lse2, delta, causal, scale, tcfg, tplan)[:2]
    bm, bn, w, st = cfg
    plan = T.make_plan(cols, causal, s, s, bm, bn, True, q.device)
    got = G.launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, bm, bn, w, st)
    for a, r in zip(got, ref):
        assert torch.isfinite(a).all()
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 2e-2, rel


@pytest.mark.gpu
def test_gpu_dispatch_picks_gluon_at_d128_on_hopper(monkeypatch):
    _require_hopper_gluon()
    monkeypatch.delenv("FLASHMASK3_TRITON_DKDV", raising=False)
    q = torch.zeros(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert T._dkdv_impl(q, T.CANDIDATES[("dkdv", 128)][0]) == "gluon"
    assert T._dkdv_impl(q[..., :64].contiguous(), T.CANDIDATES[("dkdv", 64)][0]) == "tl"
    assert T._dkdv_impl(q.float(), T.CANDIDATES[("dkdv", 128)][0]) == "tl"  # fp32: tl (tf32)
    monkeypatch.setenv("FLASHMASK3_TRITON_DKDV", "tl")
    assert T._dkdv_impl(q, T.CANDIDATES[("dkdv", 128)][0]) == "tl"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("cfg", [(32, 64, 4, 3), (16, 64, 4, 3)])
def test_gpu_fused_backward_matches_split(name, cfg):
    """The fused Gluon backward (FUSE_DQ kernel) against the library's split backward (GQA 4:2,
    a length that is not a block multiple)."""
    _require_hopper_gluon()
    s, d = 1000, 128
    q, k, v, dout, cols, causal, scale, out, lse = _gpu_inputs(name, s, d, seed=5)
    with T.use_backward("split"):
        ref = T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)
    delta, lse2 = T._bwd_pre(out, dout, lse, None)
    plan = T.make_plan(cols, causal, s, s, cfg[0], cfg[1], True, q.device)
    got = G.fused_backward_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, cfg)
    for a, r in zip(got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype
        assert torch.isfinite(a).all()
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 2e-2, rel
