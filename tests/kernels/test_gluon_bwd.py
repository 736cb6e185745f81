"""The Gluon backward kernels (flashmask3/kernels/gluon_bwd.py): dK/dV and the fused backward.

CPU: the kernel compiles offline for sm_90 (Triton's bundled ptxas/cuobjdump, no GPU) into a
cubin that uses wgmma (HGMMA) with overlapped waits and spills at most a few loop-invariant
registers; so does its FUSE_DQ variant (TMA reduce-add of dQ, no element atomics); the launcher
compiles exactly the offline-checked kernels. The WARP_SPEC variant (a 1-warp TMA producer
partition) compiles with the same wgmmas, its compute partition's tile loops hold no TMA load and
no spill, and WARP_SPEC=False still compiles to the SASS recorded before WARP_SPEC existed. GPU
(``gpu`` marker): its dK, dV match the ``tl`` dK/dV kernel's on a few masks (the WARP_SPEC ones
bit for bit); the fused Gluon backward's dQ, dK, dV match the split backward's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import shutil

import pytest
import torch
import triton

from flashmask3.kernels import compile_tools as CT
from flashmask3.kernels import dispatch, tiles
from flashmask3.kernels import gluon_bwd as G
from flashmask3.kernels import tl_kernels as TL
from flashmask3.kernels import triton_backend as T
from flashmask3.kernels.compile_tools import cuobjdump
from tests.helpers import gpu_masks
from tests.reference import rel_err

#: Spill bound of the default D=128 config: its few spills are loop-invariant scalars around
#: the per-head setup (offline report: 48-80 bytes of stack, 20-36 LDL/STL in the whole
#: kernel, none inside the tile loops); 64x64 would spill ~300 and is not a default.
MAX_LDL_STL = 64

#: FUSE_DQ at 32x64 w4 s3 (offline report, D=128 bf16): 62-115 LDL/STL in the kernel; inside
#: the tile loops 2 (causal C=0/1), 22 (non-causal C=2), 18 (C=4), mostly LDL reloads of loop
#: invariants. 16x64 w4 s3: none inside the loops.
MAX_FUSED_LDL_STL = 140
MAX_FUSED_LOOP_LDL_STL = {(True, 1): 4, (False, 2): 32, (True, 0): 4, (False, 4): 28}


#: WARP_SPEC at 32x64 w4 (s3 and s2, D=128 bf16, offline report): the compute partition runs
#: at setmaxnreg 232 (maxnreg 128 x 8 warps, the producer warpgroup down to 24) and touches 230
#: registers; 0-50 LDL/STL in the whole kernel (per-head setup, as in the non-WS kernel's
#: 3-36), none inside a tile loop. Per tile the compute partition has 2 BAR.SYNC over its own
#: 128 threads (before the ready wait and before the empty arrive; the non-WS kernel: 4 CTA
#: barriers, 2 UTMALDG and an expect-arrive per tile), 1 mbarrier wait and 1 arrive.
MAX_WS_LDL_STL = 64
WS_COMPUTE_REGS = 232
MAX_WS_BAR_SYNC_PER_TILE = 2

#: sha256 of the ``cuobjdump -sass`` listing of the kernel as it was before WARP_SPEC existed
#: (commit 6ff8a4b, triton 3.6.0's ptxas): (block_m, block_n, warps, stages, causal, C, fused).
PRE_WS_SASS_SHA256 = {
    (32, 64, 4, 3, True, 1, False):
        "a9482f57764ff66fa880b75610de7d4f1708eb71fcdcdbe82d5d49bf64ffa4ad",
    (32, 64, 4, 3, False, 2, False):
        "59bd84933e5f9478621edca309023ebefdace0024f6fbefdd09d675007ad9c8f",
    (32, 64, 4, 3, True, 0, False):
        "0b47816fa766296003bdccbe2f1b08c523b51b3cca3ef59be1b20c152ea69b17",
    (32, 64, 4, 3, False, 4, False):
        "6216e52a8da191882aecd33f1e3195399a3bbe3c4cee73c1aec133de36ea3820",
    (32, 128, 8, 3, True, 1, False):
        "6af5f7107e3c04f0c68b7e04b9419e766fb70c4b90ab37765fc97ebd1ace75af",
    (32, 64, 4, 3, True, 1, True):
        "457767fcd92041e84705067678d2c3cac6978203746513afc3e34f2171f2a148",
}


#: The table's Hopper D=256 dK/dV tile (the head-dim split).
D256_DKDV_TILE = dispatch.decide("sm90", 256, "16bit", True, 1, None, "split").backward[0].tile


def _default_config(d: int) -> tuple:
    """The library's default dK/dV (block_m, block_n, num_warps, num_stages) at head dim d."""
    c = dispatch.decide("any", d, "16bit", True, 1, None).backward[0].tile
    return (c.block_m, c.block_n, c.num_warps, c.num_stages)


def _offline_skip_reason():
    """Why the Gluon kernels' offline sm_90 checks cannot run here (None when they can). They
    belong to the Triton versions the dispatch runs Gluon on: Gluon's API changes between
    releases (3.9 spills in the backward's tile loops), and on any other version every launch is tl
    (.ci/compile_sm90.py still reports whether Gluon compiles there)."""
    if not dispatch.GLUON_CHECKED_HERE:
        return (f"the Gluon kernels are checked on Triton {', '.join(dispatch.GLUON_CHECKED_TRITON)} only "
                f"(this is {triton.__version__}: the dispatch runs the tl kernels)")
    reason = G.unavailable_reason()
    if reason:
        return f"the offline sm_90 compile needs {reason}"
    for tool in ("ptxas", "cuobjdump"):
        if not os.path.exists(os.path.join(CT._TOOLS, tool)) and shutil.which(tool) is None:
            return f"the offline sm_90 compile needs Triton's bundled {tool}"
    return None


#: int32 column values the one-compare test below draws from besides random in-range rows:
#: the bounds, just past them, and int32's extremes (out-of-range values act as clamped).
EDGE_VALUES = (0, 1, -1, -(2 ** 31), 2 ** 31 - 1)


@pytest.mark.parametrize("sq, sk", [(37, 37), (29, 53), (53, 29)])
def test_causal_c1_one_compare_mask_is_the_column_mask(sq, sk):
    """The backward tiles' one-compare mask of causal C=1 masks from Triton 3.9 on
    (``gluon_common._causal_c1_masked``: each column leaves one unmasked row interval [lo, hi)):
    masked where ``uint32(row - lo) >= uint32(max(hi - lo, 0))``, lo = col - (Sk - Sq), hi = the
    column's start clamped to [0, Sq]. Derived here in 64-bit integers wrapped to 32 bits, as
    the kernel computes it, and compared with ``masks.to_dense`` on every row in [0, Sq) for
    random columns and int32's extremes. (Gluon does not run on a CPU: the GPU tests run the
    kernel itself on causal C=1 masks.)"""
    from flashmask3.masks import to_dense

    g = torch.Generator().manual_seed(sq * 1000 + sk)
    random_rows = torch.randint(-2, sq + 3, (sk, 1), generator=g)
    edges = torch.tensor(EDGE_VALUES + (sq, sq + 1))[torch.randint(0, 7, (sk, 1), generator=g)]
    cols = torch.where(torch.rand(sk, 1, generator=g) < 0.3, edges, random_rows).to(torch.int32)
    allowed = to_dense(cols.view(1, 1, sk, 1), True, sq, sk)[0, 0]
    rows = torch.arange(sq, dtype=torch.int64)[:, None]
    lo = torch.arange(sk, dtype=torch.int64)[None, :] - (sk - sq)
    hi = cols[:, 0].to(torch.int64).clamp(0, sq)[None, :]
    n = _int32(hi - lo).clamp(min=0)  # int32 arithmetic, as in the kernel
    masked = _int32(rows - lo) % 2 ** 32 >= n  # the unsigned compare
    assert torch.equal(~masked, allowed)


def _int32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (int64) wrapped to int32's range, as 32-bit integer arithmetic leaves it."""
    return (x + 2 ** 31) % 2 ** 32 - 2 ** 31


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2), (True, 0), (False, 4)])
def test_compiles_for_sm90_with_overlapped_wgmma(causal, c):
    cfg = _default_config(128)
    r = CT.bwd_report(128, *cfg, causal=causal, c=c)
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
    ck = CT.compile_bwd(128, *_default_config(128), causal=True, c=1)
    sass = cuobjdump(ck.asm["cubin"])[1]
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2), (True, 0), (False, 4)])
def test_fused_dq_compiles_for_sm90(causal, c):
    """FUSE_DQ (32x64 w4 s3, D=128): the dQ^T wgmmas (more HGMMA than the split kernel), one TMA
    reduce-add (UTMAREDG) per tile loop, no element atomics, bounded spills in the tile loops."""
    split = CT.bwd_report(128, 32, 64, 4, 3, causal=causal, c=c)
    r = CT.bwd_report(128, 32, 64, 4, 3, causal=causal, c=c, fuse_dq=True)
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
    r = CT.bwd_report(128, 16, 64, 4, 3, causal=causal, c=c, fuse_dq=True)
    assert "error" not in r, r.get("error")
    assert r["tma_reduce"] > 0 and r["ldl_stl_in_tile_loops"] == 0, r


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
def test_launcher_compiles_the_offline_checked_kernels(monkeypatch):
    """``launch_dkdv_gluon``'s real arguments (split: dq_desc=None, a constexpr; fused: the
    strided dQ^T descriptor, Sq=777 padded to 780; warp_spec: WARP_SPEC and maxnreg; the
    DS_SHARED fused kernel's [D, 32] reduce descriptor, at D=128 and D=64) bound by
    Triton's JIT under a stand-in sm_90 driver (compile only, nothing launched) give the same
    SASS as :func:`compile_sm90`."""
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

    ds_opts = dict(fuse_dq=True, warp_spec=True, stats_smem=True, ds_shared=True)
    # the references, compiled before the patch: their cache keys differ from the launcher's
    # (the SASS does not), and a compile from source under the patch would see the stand-in
    # kernel object (which Triton 3.7+ refuses as a source: its JIT looks up the source line
    # through the kernel object's `fn` chain)
    variants = ((False, False), (True, False), (False, True))
    refs = {v: CT.compile_bwd(128, 32, 64, 4, 3, True, 1, "bf16", fuse_dq=v[0], warp_spec=v[1])
            for v in variants}
    ds_ref = CT.compile_bwd(128, 64, 128, 8, 2, True, 1, "bf16", **ds_opts)
    ds64_ref = CT.compile_bwd(64, 64, 64, 4, 2, True, 1, "bf16", **ds_opts)
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
        plan = tiles.Plan(cols, stats, stats.clone(), 1, 1, 1, 1)
        for fuse, ws in variants:
            out = G.launch_dkdv_gluon(q, k, k, q, lse2, lse2, True, 0.1, plan, 32, 64, 4, 3,
                                      fuse_dq=fuse, warp_spec=ws)
            assert len(out) == (3 if fuse else 2)
            if fuse:
                assert out[2].shape == (b, sq, hq, d) and out[2].dtype == torch.float32
                assert out[2].stride()[1] == 1  # the [B, Hq, D, Sq_pad] dQ^T buffer
            assert sass(compiled["kernel"].asm["cubin"]) == sass(refs[fuse, ws].asm["cubin"]), (fuse, ws)
        # DS_SHARED (64x128 w8, WS + STATS_SMEM): the [D, 32] dQ^T reduce descriptor
        stats = torch.zeros(b, -(-sk // 128), 8, dtype=torch.int32)
        plan = tiles.Plan(cols, stats, stats.clone(), 1, 1, 1, 1)
        out = G.launch_dkdv_gluon(q, k, k, q, lse2, lse2, True, 0.1, plan, 64, 128, 8, 2,
                                  **ds_opts)
        assert len(out) == 3 and out[2].shape == (b, sq, hq, d)
        assert sass(compiled["kernel"].asm["cubin"]) == sass(ds_ref.asm["cubin"])
        # DS_SHARED at D=64 (64x64 w4): the [64, 32] reduce descriptor
        q64, k64 = q[..., :64].contiguous(), k[..., :64].contiguous()
        stats = torch.zeros(b, nkb, 8, dtype=torch.int32)  # 64-key blocks again
        plan = tiles.Plan(cols, stats, stats.clone(), 1, 1, 1, 1)
        out = G.launch_dkdv_gluon(q64, k64, k64, q64, lse2, lse2, True, 0.1, plan, 64, 64, 4, 2,
                                  **ds_opts)
        assert len(out) == 3 and out[2].shape == (b, sq, hq, 64)
        assert sass(compiled["kernel"].asm["cubin"]) == sass(ds64_ref.asm["cubin"])
    finally:
        driver._active = saved
        kern.device_caches.clear()


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.skipif(__import__("triton").__version__ != "3.6.0",
                    reason="needs triton 3.6.0 (the recorded SASS hashes are its ptxas output)")
@pytest.mark.parametrize("key", list(PRE_WS_SASS_SHA256))
def test_warp_spec_off_compiles_to_the_pre_warp_spec_sass(key):
    """WARP_SPEC=False (the default, the GPU-verified kernel) is byte-identical in SASS to the
    kernel before the WARP_SPEC code was added."""
    bm, bn, w, st, causal, c, fused = key
    ck = CT.compile_bwd(128, bm, bn, w, st, causal=causal, c=c, fuse_dq=fused)
    sass = cuobjdump(ck.asm["cubin"])[1]
    assert hashlib.sha256(sass.encode()).hexdigest() == PRE_WS_SASS_SHA256[key]


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2), (True, 0), (False, 4)])
def test_warp_spec_compiles_for_sm90(causal, c):
    """WARP_SPEC at the default 32x64 w4 s3: the non-WS kernel's wgmmas (same HGMMA count), the
    compute partition at setmaxnreg 232 (producer 24), no spill and no TMA load inside the tile
    loops, which synchronise through one mbarrier wait and one arrive per tile."""
    cfg = (32, 64, 4, 3)
    plain = CT.bwd_report(128, *cfg, causal=causal, c=c)
    r = CT.bwd_report(128, *cfg, causal=causal, c=c, warp_spec=True)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] == plain["hgmma"] > 0, (r, plain)
    assert r["tile_loops"] == plain["tile_loops"], (r, plain)
    assert r["setmaxnreg"] == [G.PRODUCER_REGS, WS_COMPUTE_REGS], r
    assert WS_COMPUTE_REGS == G.ws_compute_regs(4) and r["maxnreg"] == G.ws_maxnreg(4) == 128
    assert r["regs_touched"] <= WS_COMPUTE_REGS, r
    assert r["ldl_stl"] <= MAX_WS_LDL_STL and r["ldl_stl_in_tile_loops"] == 0, r
    assert r["tma_load_per_tile"] == 0 and plain["tma_load_per_tile"] > 0, (r, plain)
    assert r["mbar_wait_per_tile"] == 1 and r["mbar_arrive_per_tile"] == 1, r
    assert r["bar_sync_per_tile"] <= MAX_WS_BAR_SYNC_PER_TILE < plain["bar_sync_per_tile"], \
        (r, plain)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in cuobjdump(
        CT.compile_bwd(128, *cfg, causal=causal, c=c, warp_spec=True).asm["cubin"])[1]


def _loops(sass: str) -> list:
    """Instruction texts of every backward-branch range of a SASS listing before its last EXIT
    (loops, including the producer's, which holds no HGMMA)."""
    ins = CT._sass_instructions(sass)
    last_exit = max(a for a, t in ins if re.search(r"\bEXIT\b", t))
    out = []
    for addr, txt in ins:
        br = re.search(r"\bBRA\s+(0x[0-9a-f]+)", txt)
        if br and int(br.group(1), 16) < addr < last_exit:
            out.append([t for a, t in ins if int(br.group(1), 16) <= a <= addr])
    return out


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
def test_warp_spec_producer_loads_and_consumer_waits():
    """The SASS has a producer loop (no HGMMA) that waits on an empty barrier, arms the ready
    barrier and issues UTMALDG, and tile loops that wait (SYNCS.PHASECHK) and arrive with no
    UTMALDG; the producer warpgroup gives registers back (USETMAXREG.DEALLOC 24)."""
    sass = cuobjdump(CT.compile_bwd(128, 32, 64, 4, 3, causal=True, c=1,
                                    warp_spec=True).asm["cubin"])[1]
    loops = _loops(sass)
    producer = [lp for lp in loops if not any("HGMMA" in t for t in lp)
                and any("UTMALDG" in t for t in lp)]
    consumer = [lp for lp in loops if any("HGMMA" in t for t in lp)]
    assert producer and consumer
    for lp in producer:
        assert any("SYNCS.PHASECHK" in t for t in lp) and any("SYNCS.ARRIVE" in t for t in lp)
    for lp in consumer:
        assert not any("UTMALDG" in t for t in lp)
        assert any("SYNCS.PHASECHK" in t for t in lp) and any("SYNCS.ARRIVE" in t for t in lp)
    assert re.search(r"USETMAXREG\.DEALLOC\S*\s+0x18\b", sass)
    assert re.search(r"USETMAXREG\.TRY_ALLOC\S*\s+UP\d, 0xe8\b", sass)  # 232


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("cfg, compute_regs", [((32, 64, 4, 2), 232), ((64, 128, 8, 2), 240)])
def test_warp_spec_other_shapes_compile(cfg, compute_regs):
    """WARP_SPEC at 2 stages and at 8 warps (maxnreg 168 x 12 warps: 240 for the compute
    warps) compiles with the non-WS kernel's wgmmas. 64x128 spills in its tile loops (~250,
    the non-WS kernel ~215 at 255 registers): measured, not bounded here."""
    plain = CT.bwd_report(128, *cfg, causal=True, c=1)
    r = CT.bwd_report(128, *cfg, causal=True, c=1, warp_spec=True)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] == plain["hgmma"] > 0, (r, plain)
    assert r["setmaxnreg"] == [G.PRODUCER_REGS, compute_regs] and r["regs_touched"] <= compute_regs
    assert compute_regs == G.ws_compute_regs(cfg[2])
    assert r["tma_load_per_tile"] == 0 and r["mbar_wait_per_tile"] == 1, r
    if cfg[0] == 32:
        assert r["ldl_stl_in_tile_loops"] == 0, r


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 0), (True, 0), (False, 2), (True, 2),
                                       (False, 4)])
def test_stats_smem_64x128_has_no_spills_in_tile_loops(causal, c):
    """WARP_SPEC + STATS_SMEM (lse2/delta staged in shared memory by the producer, column
    intervals reloaded per masked non-causal tile, mask applied before exp2): the 64-query x
    128-key tile at 8 warps (240 registers) keeps every mask layout's tile loops free of
    LDL/STL (the WS kernel without it: up to ~360), with the WS kernel's wgmmas."""
    ws = CT.bwd_report(128, 64, 128, 8, 2, causal=causal, c=c, warp_spec=True)
    r = CT.bwd_report(128, 64, 128, 8, 2, causal=causal, c=c, warp_spec=True,
                         stats_smem=True)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] == ws["hgmma"] > 0, (r, ws)
    assert r["setmaxnreg"] == [G.PRODUCER_REGS, 240] and r["regs_touched"] <= 240, r
    assert r["tile_loops"] > 0 and r["ldl_stl_in_tile_loops"] == 0, r
    assert r["tma_load_per_tile"] == 0 and r["mbar_wait_per_tile"] == 1, r


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2)])
def test_fused_dq_with_warp_spec_compiles(causal, c):
    """FUSE_DQ with WARP_SPEC (32x64 w4 s3): the fused kernel's wgmmas and one TMA reduce-add
    per tile loop, no TMA load and (measured) no spill inside the tile loops (the non-WS fused
    kernel has 2-22 there)."""
    fused = CT.bwd_report(128, 32, 64, 4, 3, causal=causal, c=c, fuse_dq=True)
    r = CT.bwd_report(128, 32, 64, 4, 3, causal=causal, c=c, fuse_dq=True, warp_spec=True)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] == fused["hgmma"] and r["tma_reduce"] == r["tile_loops"] > 0, (r, fused)
    assert r["atomics"] == 0 and r["tma_load_per_tile"] == 0, r
    assert r["ldl_stl_in_tile_loops"] == 0, r


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 0), (True, 0), (False, 2), (True, 2),
                                       (False, 4)])
def test_fused_ds_shared_64x128_has_no_spills_in_tile_loops(causal, c):
    """FUSE_DQ + WARP_SPEC + STATS_SMEM + DS_SHARED at 64x128 w8 s2 (Pᵀ, dSᵀ in shared memory,
    dQ once per tile): per tile the five wgmmas (Sᵀ, dPᵀ: 8 k-steps; dV, dK: 4; dQᵀ: 8 over
    all 128 keys) and two TMA reduce-adds ([D, 32] each), no TMA load, one ready wait, and no
    LDL/STL inside the tile loops in any mask layout, at the 240 registers of the WS
    kernel."""
    r = CT.bwd_report(128, 64, 128, 8, 2, causal=causal, c=c, fuse_dq=True, warp_spec=True,
                         stats_smem=True, ds_shared=True)
    assert "error" not in r, r.get("error")
    assert r["tile_loops"] > 0 and r["hgmma"] == 32 * r["tile_loops"], r
    assert r["tma_reduce"] == 2 * r["tile_loops"] and r["atomics"] == 0, r
    assert r["setmaxnreg"] == [G.PRODUCER_REGS, 240] and r["regs_touched"] <= 240, r
    assert r["ldl_stl_in_tile_loops"] == 0, r
    assert r["tma_load_per_tile"] == 0 and r["mbar_wait_per_tile"] == 1, r
    assert r["shared"] <= 232448, r  # sm_90: 227 KB per block


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
def test_fused_64_query_tile_reduces_every_column():
    """A 64-query fused dQᵀ tile is 256 bytes wide in fp32, a 128-byte-swizzled TMA box at most
    128: the kernel issues two [D, 32] reduces per tile (one [D, 64] reduce lowered to a single
    message, i.e. half the tile). Also s3 of DS_SHARED fits in shared memory without spills."""
    r = CT.bwd_report(128, 64, 128, 8, 2, causal=True, c=1, fuse_dq=True, warp_spec=True,
                         stats_smem=True)
    assert "error" not in r, r.get("error")
    assert r["tma_reduce"] == 2 * r["tile_loops"] > 0, r
    r = CT.bwd_report(128, 64, 128, 8, 3, causal=True, c=1, fuse_dq=True, warp_spec=True,
                         stats_smem=True, ds_shared=True)
    assert "error" not in r, r.get("error")
    assert r["ldl_stl_in_tile_loops"] == 0 and r["shared"] <= 232448, r


#: Shared memory of one program when two share an sm_90 SM (228 KB each SM, 1 KB reserved per
#: program): what keeps the D=64 DS_SHARED kernel at the split kernel's residency.
TWO_PER_SM_SHARED = 233472 // 2 - 1024


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("st, causal, c", [(2, True, 1), (2, False, 0), (2, True, 0),
                                           (2, False, 2), (2, True, 2), (2, False, 4),
                                           (3, True, 1), (3, False, 4)])
def test_fused_ds_shared_d64_has_no_spills_in_tile_loops(st, causal, c):
    """DS_SHARED at D=64 (64x64 w4, one compute warpgroup): per tile the five wgmmas (Sᵀ, dPᵀ,
    dV, dK, dQᵀ: 4 k-steps each; dQᵀ = Kᵀ dSᵀ with M = D = 64 over the warpgroup's own 64
    keys) and two [64, 32] TMA reduce-adds, no TMA load, one ready wait, no LDL/STL inside the tile
    loops (offline: none in the whole kernel) at the 232 registers of the 4-warp WS kernel,
    and shared memory for two programs per SM at s2 and s3."""
    r = CT.bwd_report(64, 64, 64, 4, st, causal=causal, c=c, fuse_dq=True, warp_spec=True,
                         stats_smem=True, ds_shared=True)
    assert "error" not in r, r.get("error")
    assert r["tile_loops"] > 0 and r["hgmma"] == 20 * r["tile_loops"], r
    assert r["tma_reduce"] == 2 * r["tile_loops"] and r["atomics"] == 0, r
    assert r["setmaxnreg"] == [G.PRODUCER_REGS, 232] and r["regs_touched"] <= 232, r
    assert r["maxnreg"] == G.ws_maxnreg(4) == 128, r
    assert r["ldl_stl_in_tile_loops"] == 0, r
    assert r["tma_load_per_tile"] == 0 and r["mbar_wait_per_tile"] == 1, r
    assert r["shared"] <= TWO_PER_SM_SHARED, r


def test_ws_register_budget():
    """maxnreg keeps the non-WS kernel's residency (2 programs per SM at 4 warps, 1 at 8) and
    the compute partition gets what the producer warpgroup gives back."""
    assert G.ws_maxnreg(4) == 128 and G.ws_compute_regs(4) == 232
    assert G.ws_maxnreg(8) == 168 and G.ws_compute_regs(8) == 240
    for w in (4, 8):
        resident = 2 if w == 4 else 1
        assert resident * G.ws_maxnreg(w) * (w + 4) * 32 <= G.SM_REGISTERS


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
    G.check_config(128, 64, 128, 8, 2, True, True, True, ds_shared=True)
    for bad in [dict(fuse_dq=False, warp_spec=True, stats_smem=True),
                dict(fuse_dq=True, warp_spec=True, stats_smem=False),
                dict(fuse_dq=True, warp_spec=False, stats_smem=False)]:
        with pytest.raises(ValueError):  # DS_SHARED: the 64x128 w8 fused WS + STATS_SMEM kernel
            G.check_config(128, 64, 128, 8, 2, ds_shared=True, **bad)
    with pytest.raises(ValueError):
        G.check_config(128, 32, 128, 8, 3, True, True, True, ds_shared=True)
    with pytest.raises(ValueError):  # 256 fp32 accumulator registers for dK, dV alone
        G.check_config(256, 64, 128, 8, 2, True, True, True, ds_shared=True)
    with pytest.raises(ValueError):
        G.check_config(128, 64, 64, 4, 2, warp_spec=False, stats_smem=True)
    with pytest.raises(ValueError, match="D=128 64x128 w8 s1-s3"):  # s4: over 227 KB
        G.check_config(128, 64, 128, 8, 4, True, True, True, ds_shared=True)
    assert G.dq_reduce_block(32, 128) == [128, 32] and G.dq_reduce_block(16, 64) == [64, 16]
    assert G.dq_reduce_block(64, 128) == [128, 32]  # two TMA reduces per 64-query tile


def test_config_checks_of_the_d256_head_dim_split():
    """64 keys at 8 warps: two warpgroups split the head dim, at D=256 only, split backward
    only (the fused dQᵀ tail assumes warps along the keys)."""
    assert G.d_warps(256, 64, 8) == 2 and G.d_warps(256, 128, 8) == 1
    assert G.d_warps(128, 64, 8) == 1 and G.d_warps(256, 64, 4) == 1
    G.check_config(256, 64, 64, 8, 2, warp_spec=True, stats_smem=True)
    G.check_config(256, 32, 64, 8, 3, warp_spec=True, stats_smem=True)
    with pytest.raises(ValueError, match="8 \\* num_warps at D=256"):
        G.check_config(128, 64, 64, 8, 2)  # D=128 keeps warps along the keys
    with pytest.raises(ValueError, match="split-backward shape"):
        G.check_config(256, 64, 64, 8, 2, fuse_dq=True)
    with pytest.raises(ValueError, match="whole warpgroups"):
        G.check_config(256, 32, 32, 2, 2)  # wgmma needs 4-warp warpgroups
    assert D256_DKDV_TILE == tiles.Config(64, 64, 8, 2)
    G.check_config(256, *dataclasses.astuple(D256_DKDV_TILE), warp_spec=True,
                   stats_smem=True)


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 2), (True, 0), (False, 4)])
def test_d256_head_dim_split_has_no_spills_in_tile_loops(causal, c):
    """The D=256 default (64x64 w8 s2, WARP_SPEC + STATS_SMEM): wgmma throughout, no local
    memory traffic in any tile loop, under the shared-memory limit."""
    r = CT.bwd_report(256, 64, 64, 8, 2, causal=causal, c=c, warp_spec=True, stats_smem=True)
    assert r.get("error") is None, r.get("error")
    assert r["hgmma"] > 0 and r["ldl_stl_in_tile_loops"] == 0, r
    assert r["tile_loops"] >= (1 if c == 0 else 3), r
    assert r["shared"] <= 227 * 1024


def test_ds_shared_config_check_at_d64():
    """DS_SHARED at D=64 is the one-warpgroup tile 64x64 w4 (s1-s3), with FUSE_DQ + WARP_SPEC
    + STATS_SMEM; 64x128 w8 at D=64 is refused (two warpgroups would each get M = 32 of dQᵀ's
    64 rows, below wgmma's 64), and so is the D=64 tile at D=128, s4, or without a flag."""
    ds = dict(fuse_dq=True, warp_spec=True, stats_smem=True, ds_shared=True)
    for st in (1, 2, 3):
        G.check_config(64, 64, 64, 4, st, **ds)
    assert G.DS_SHARED_TILES[64] == (64, 64, 4, 3)
    with pytest.raises(ValueError, match="d=64 < 16 \\* num_warps"):
        G.check_config(64, 64, 128, 8, 2, **ds)
    for args in [(64, 64, 64, 4, 4), (64, 32, 64, 4, 2), (64, 128, 64, 4, 2),
                 (128, 64, 64, 4, 2), (256, 64, 64, 4, 2)]:
        with pytest.raises(ValueError, match="ds_shared .* D=64 64x64 w4 s1-s3"):
            G.check_config(*args, **ds)
    for off, flags in [("fuse_dq", dict(fuse_dq=False)), ("stats_smem", dict(stats_smem=False)),
                       ("warp_spec", dict(warp_spec=False, stats_smem=False))]:
        with pytest.raises(ValueError, match=f"{off}=False"):
            G.check_config(64, 64, 64, 4, 2, **dict(ds, **flags))
    G.check_config(64, 64, 64, 4, 2, fuse_dq=True, warp_spec=True, stats_smem=True)  # not DS


# ---------------------------------------------------------------------------------------------
# GPU: against the tl kernel
# ---------------------------------------------------------------------------------------------


def _require_hopper_gluon():
    """Skip unless gluon imports and the GPU is sm_90 (the kernel's wgmma)."""
    if G.unavailable_reason():
        pytest.skip(G.unavailable_reason())
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (sm_90: the Gluon kernels use wgmma)")


def _gpu_inputs(name, s, d, seed, b=2, hq=4, hk=2):
    """bf16 q, k, v, dO (default B=2, GQA 4:2), the mask columns on the GPU, causal, the scale,
    and the forward's O and LSE for mask ``name`` at length ``s``."""
    mask, causal = gpu_masks(s)[name]
    cols = None if mask is None else mask.startend_row_indices.cuda()
    causal = causal if mask is None else mask.causal
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    out, lse = T.forward(q, k, v, cols, causal, scale)
    return q, k, v, dout, cols, causal, scale, out, lse


def _tl_dkdv_reference(name, s, d, seed):
    """The GPU inputs of mask ``name`` (see :func:`_gpu_inputs`), delta and lse2, and the tl
    dK/dV kernel's (dK, dV) at its default tile: what the Gluon variants are checked against."""
    inputs = _gpu_inputs(name, s, d, seed=seed)
    q, k, v, dout, cols, causal, scale, out, lse = inputs
    delta, lse2 = TL.backward_prepass(out, dout, lse, None)
    c = 0 if cols is None else cols.shape[-1]
    tcfg = dispatch.decide("any", d, "16bit", causal, c, None).backward[0].tile
    tplan = tiles.make_plan(cols, causal, s, s, tcfg.block_m, tcfg.block_n, True, q.device)
    ref = TL.launch_dkdv(q, k, v, dout, lse2, delta, causal, scale, tcfg, tplan)[:2]
    return inputs, delta, lse2, ref


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("cfg", [(32, 64, 4, 3), (32, 128, 8, 3)])
def test_gpu_matches_tl_kernel(name, cfg):
    _require_hopper_gluon()
    s, d = 1000, 128
    (q, k, v, dout, cols, causal, scale, out, lse), delta, lse2, ref = \
        _tl_dkdv_reference(name, s, d, seed=3)
    bm, bn, w, st = cfg
    plan = tiles.make_plan(cols, causal, s, s, bm, bn, True, q.device)
    got = G.launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, bm, bn, w, st)
    for a, r in zip(got, ref):
        assert torch.isfinite(a).all()
        rel = rel_err(a, r)
        assert rel < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("d,cfg", [(128, (32, 64, 4, 3)), (128, (32, 64, 4, 2)),
                                   (128, (64, 128, 8, 2)), (64, (64, 64, 4, 2))])
def test_gpu_warp_spec_is_bitwise_equal_to_tl(name, d, cfg):
    """The WARP_SPEC kernel (1-warp TMA producer) computes the non-WS kernel's wgmmas in the
    same order: dK, dV bit for bit equal to the tl kernel's and to the non-WS Gluon kernel's
    (D=64 at its default tile, which the dispatcher picks)."""
    _require_hopper_gluon()
    _check_bitwise_variant(name, d, cfg, seed=11, twin={}, variant=dict(warp_spec=True))


def _check_bitwise_variant(name, d, cfg, seed, twin, variant):
    """dK, dV of the Gluon kernel launched with ``variant`` options equal, bit for bit, those of
    its ``twin`` options and the tl kernel's (S=1000: a clipped last tile)."""
    s = 1000
    (q, k, v, dout, cols, causal, scale, out, lse), delta, lse2, ref = \
        _tl_dkdv_reference(name, s, d, seed=seed)
    bm, bn, w, st = cfg
    plan = tiles.make_plan(cols, causal, s, s, bm, bn, True, q.device)
    args = (q, k, v, dout, lse2, delta, causal, scale, plan, bm, bn, w, st)
    other = G.launch_dkdv_gluon(*args, **twin)
    got = G.launch_dkdv_gluon(*args, **variant)
    for a, r, p in zip(got, ref, other):
        assert torch.equal(a, p)
        assert torch.equal(a, r)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("cfg", [(64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3)])
def test_gpu_stats_smem_is_bitwise_equal_to_tl(name, cfg):
    """WARP_SPEC + STATS_SMEM (lse2/delta staged in shared memory by the producer): the same
    wgmmas on the same values, dK, dV bit for bit equal to the tl kernel's and to the plain
    WARP_SPEC kernel's (D=128)."""
    _require_hopper_gluon()
    _check_bitwise_variant(name, 128, cfg, seed=13, twin=dict(warp_spec=True),
                           variant=dict(warp_spec=True, stats_smem=True))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "document", "causal_document",
                                  "global_sliding_window"])
def test_gpu_d256_head_dim_split_matches_tl(name):
    """D=256 (64 keys, 8 warps: the two warpgroups split the head dim): the default variant
    (WARP_SPEC + STATS_SMEM) within 2e-2 of the tl kernel at its default tile and bit for bit
    equal to the plain Gluon kernel (same wgmmas in the same order). S=1000: a clipped last
    tile; GQA 4:2."""
    _require_hopper_gluon()
    s, d = 1000, 256
    (q, k, v, dout, cols, causal, scale, out, lse), delta, lse2, ref = \
        _tl_dkdv_reference(name, s, d, seed=17)
    bm, bn, w, st = dataclasses.astuple(D256_DKDV_TILE)
    plan = tiles.make_plan(cols, causal, s, s, bm, bn, True, q.device)
    args = (q, k, v, dout, lse2, delta, causal, scale, plan, bm, bn, w, st)
    got = G.launch_dkdv_gluon(*args, warp_spec=True, stats_smem=True)
    plain = G.launch_dkdv_gluon(*args)
    for a, r, p in zip(got, ref, plain):
        assert torch.isfinite(a).all()
        assert rel_err(a, r) < 2e-2, rel_err(a, r)
        assert torch.equal(a, p)


#: The D=64 DS_SHARED configs (64x64 w4, one compute warpgroup; offline-checked, s2 and s3).
DS_SHARED_D64_CONFIGS = [(64, 64, 4, 2, True, True, True), (64, 64, 4, 3, True, True, True)]

#: (head dim, fused config) of :func:`test_gpu_fused_backward_matches_split`, and their ids:
#: the A/B script's labels (the D=64 DS_SHARED ones prefixed ``ds_shared_``:
#: ``gpu_kernel.sh fused64d`` selects them with "ds_shared and d64").
FUSED_CASES = ([(128, cfg) for cfg in [(32, 64, 4, 3), (16, 64, 4, 3), (32, 64, 4, 3, True),
                                       (64, 128, 8, 2, True, True, True),
                                       (64, 128, 8, 3, True, True, True)]]
               + [(64, cfg) for cfg in DS_SHARED_D64_CONFIGS])

def _label(cfg) -> str:
    """``BMxBNwWsS`` plus ``ws`` (WARP_SPEC), ``m`` (STATS_SMEM), ``ds`` (DS_SHARED)."""
    bm, bn, w, st = cfg[:4]
    flags = "".join(f for f, on in zip(("ws", "m", "ds"), cfg[4:]) if on)
    return f"{bm}x{bn}w{w}s{st}{flags}"


FUSED_CASE_IDS = [("ds_shared_" if d == 64 else "") + f"d{d}-{_label(cfg)}"
                  for d, cfg in FUSED_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("d,cfg", FUSED_CASES, ids=FUSED_CASE_IDS)
def test_gpu_fused_backward_matches_split(name, d, cfg):
    """The fused Gluon backward (FUSE_DQ kernel; a fifth config element True: with WARP_SPEC,
    sixth: STATS_SMEM, seventh: DS_SHARED) against the library's split backward at the same
    head dim (GQA 4:2, S=1000: a length that is not a block multiple): dQ, dK, dV within 2e-2
    relative. At D=64 the DS_SHARED 64x64 w4 tile (offline-checked) against the split
    backward's Gluon WS 64x64 w4 s2 dK/dV + tl dQ."""
    _require_hopper_gluon()
    s = 1000
    q, k, v, dout, cols, causal, scale, out, lse = _gpu_inputs(name, s, d, seed=5)
    with dispatch.use_backward("split"):
        ref = T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)
    delta, lse2 = TL.backward_prepass(out, dout, lse, None)
    plan = tiles.make_plan(cols, causal, s, s, cfg[0], cfg[1], True, q.device)
    got = G.fused_backward_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, cfg)
    for a, r in zip(got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype
        assert torch.isfinite(a).all()
        rel = rel_err(a, r)
        assert rel < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("d,st", [(128, 2), (128, 3), (64, 2), (64, 3)],
                         ids=["d128-s2", "d128-s3", "d64-s2", "d64-s3"])
def test_gpu_fused_ds_shared_dkdv_bitwise_equal_to_tl_and_split(name, d, st, monkeypatch):
    """DS_SHARED (at its head dim's DS_SHARED_TILES tile; D=64: offline-checked) reads Pᵀ and
    dSᵀ from shared memory for dV and dK (the split kernels: from registers): the same bf16
    values in the same k-steps, so dK, dV bit for bit equal to the tl kernel's and to the split
    backward's; dQ (TMA reduce-adds: run-to-run rounding) within 2e-2 of the split backward's.
    The split backward runs grouped here: this small GQA call would otherwise split each group
    over programs (``triton_backend.splits_kv_groups``), whose fp32 partials are summed in
    another order (other bits; checked against the reference in
    test_gpu_kv_split_matches_the_reference_and_the_grouped_launch and gqa_expand_ab.py)."""
    _require_hopper_gluon()
    monkeypatch.setattr(T, "sm_count", lambda device: None)  # no SM count: never expanded
    s = 1000
    (q, k, v, dout, cols, causal, scale, out, lse), delta, lse2, ref = \
        _tl_dkdv_reference(name, s, d, seed=17)
    bm, bn, w, _ = G.DS_SHARED_TILES[d]
    plan = tiles.make_plan(cols, causal, s, s, bm, bn, True, q.device)
    dq, dk, dv = G.fused_backward_gluon(q, k, v, dout, lse2, delta, causal, scale, plan,
                                        (bm, bn, w, st, True, True, True))
    assert torch.equal(dk, ref[0]) and torch.equal(dv, ref[1])
    with dispatch.use_backward("split"):
        dq_ref, dk_split, dv_split = T.backward(dout, None, q, k, v, out, lse, cols, causal,
                                                scale)[:3]
    assert torch.equal(dk, dk_split) and torch.equal(dv, dv_split)
    rel = rel_err(dq, dq_ref)
    assert torch.isfinite(dq).all() and rel < 2e-2, rel


def _gqa_case(name, s, d, hq, hk, seed):
    """bf16 inputs of mask ``name`` with ``hq``/``hk`` heads (B=1), the forward, delta, lse2
    and the float64 reference's (dq, dk, dv)."""
    from tests.reference import reference_attention

    q, k, v, dout, cols, causal, scale, out, lse = _gpu_inputs(name, s, d, seed, 1, hq, hk)
    delta, lse2 = TL.backward_prepass(out, dout, lse, None)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference_attention(*x64, cols, causal, scale)
    ref = torch.autograd.grad(ref_out, x64, dout.double())
    return (q, k, v, dout, cols, causal, scale), delta, lse2, ref


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal_document", "document", "full"])
@pytest.mark.parametrize("kernel", ["gluon_fused", "gluon_ws_dkdv_stats"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hk", [(8, 1), (8, 2)])
def test_gpu_kv_split_matches_the_reference_and_the_grouped_launch(name, kernel, d, hq, hk):
    """A GQA group split over KV_SPLIT programs (every divisor of the group) in the Gluon
    dK/dV kernels the table launches (fused DS_SHARED and WS dK/dV; D=64: the WS dK/dV kernel
    without staged statistics): dK, dV (and the fused dQ) against the float64 reference, and
    dK, dV within bf16 rounding of the grouped launch's (fp32 partials, one rounding)."""
    _require_hopper_gluon()
    s = 1000
    (q, k, v, dout, cols, causal, scale), delta, lse2, ref = _gqa_case(name, s, d, hq, hk, 29)
    if kernel == "gluon_fused":
        bm, bn, w, st = G.DS_SHARED_TILES[d]
        variant = dict(G.FUSED_VARIANT)
        st = 2
    else:
        bm, bn, w, st = (64, 128, 8, 2) if d == 128 else (64, 64, 4, 2)
        variant = dict(warp_spec=True, stats_smem=d == 128)
    plan = tiles.make_plan(cols, causal, s, s, bm, bn, True, q.device)
    grouped = None
    for split in [e for e in range(1, hq // hk + 1) if (hq // hk) % e == 0]:
        got = G.launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, bm, bn, w, st,
                                  kv_split=split, **variant)
        assert got[0].shape == k.shape and got[0].dtype == k.dtype
        errs = [rel_err(got[0], ref[1]), rel_err(got[1], ref[2])]
        if kernel == "gluon_fused":
            errs.append(rel_err(got[2] * scale, ref[0]))
        assert all(torch.isfinite(x).all() for x in got)
        assert max(errs) < 2e-2, (split, errs)
        if grouped is None:
            grouped = got
        else:
            drift = max(rel_err(got[0], grouped[0]), rel_err(got[1], grouped[1]))
            assert drift < 5e-3, (split, drift)
    with pytest.raises(ValueError, match="kv_split"):
        G.launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, bm, bn, w, st,
                            kv_split=3, **variant)


@pytest.mark.gpu
def test_gpu_sum_kv_split_equals_torch_sum():
    """The partials' sum on the GPU: torch's fp32 sum over each head's parts, rounded once to
    bf16 (multiples of 1/8: exact sums, so round-to-nearest gives torch's bits)."""
    k = torch.empty(2, 333, 3, 128, device="cuda", dtype=torch.bfloat16)
    part = TL.kv_split_partials(k, 8)
    part.copy_(torch.randint(-512, 512, part.shape, device="cuda") / 8)
    dk, dv = TL.sum_kv_split(part, k)
    ref = part.view(2, 2, 333, 3, 8, 128).sum(4).to(torch.bfloat16)
    assert torch.equal(dk, ref[0]) and torch.equal(dv, ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_scale_dq_equals_torch_mul(d):
    """The dQ scaling kernel gives torch.mul's bits (fp32 multiply, one rounding to bf16) on
    the Gluon kernel's transposed accumulator view and on a contiguous one."""
    b, sq, hq = 2, 1001, 3
    pad = (sq + 3) // 4 * 4
    g = torch.Generator(device="cuda").manual_seed(d)
    t = torch.randn(b, hq, d, pad, device="cuda", generator=g)
    for acc in (t[..., :sq].permute(0, 3, 1, 2), torch.randn(b, sq, hq, d, device="cuda",
                                                             generator=g)):
        for dtype in (torch.bfloat16, torch.float16):
            ref = torch.empty(acc.shape, dtype=dtype, device="cuda")
            torch.mul(acc, 0.0883883, out=ref)
            assert torch.equal(TL.scale_dq(acc, 0.0883883, dtype), ref)


@pytest.mark.skipif(_offline_skip_reason() is not None, reason=str(_offline_skip_reason()))
def test_offline_compile_survives_a_leaked_interpreter_patch(monkeypatch, tmp_path):
    """triton 3.6's interpreter leaves triton.language patched after a device function is
    called from Python; the offline compile must undo that (an empty cache, so the kernel is
    really compiled) instead of failing with "block_argument has no attribute dtype"."""
    from triton.runtime import interpreter

    R = CT

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    interpreter._patch_lang(TL._fwd_kernel.fn)  # what such a call leaves behind
    try:
        ck = CT.compile_bwd(128, 32, 64, 4, 3, causal=False, c=4)
    finally:
        R.restore_triton_language()
    assert "HGMMA" in cuobjdump(ck.asm["cubin"])[1]
