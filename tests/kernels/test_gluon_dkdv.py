"""The Gluon dK/dV kernel (flashmask3/kernels/gluon_dkdv.py).

CPU: the kernel compiles offline for sm_90 (Triton's bundled ptxas/cuobjdump, no GPU) into a
cubin that uses wgmma (HGMMA) with overlapped waits and spills at most a few loop-invariant
registers. GPU (``gpu`` marker): its dK, dV match the ``tl`` dK/dV kernel's on a few masks.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

import flashmask3.masks as M
from flashmask3.kernels import gluon_dkdv as G
from flashmask3.kernels import triton_flashmask as T

#: Spill bound of the default D=128 config: its few spills are loop-invariant scalars around
#: the per-head setup (offline report: 48-80 bytes of stack, 20-36 LDL/STL in the whole
#: kernel, none inside the tile loops); 64x64 would spill ~300 and is not a default.
MAX_LDL_STL = 64


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
    import subprocess
    import tempfile

    ck = G.compile_sm90(128, *_default_config(128), causal=True, c=1)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        sass = subprocess.run([os.path.join(G._TOOLS, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass


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


def _gpu_case(name, s):
    docs = M.random_document_lengths(s, max(64, s // 8), seed=s)
    return {
        "causal": (None, True),
        "full": (None, False),
        "causal_document": (M.causal_document_mask(docs), None),
        "document": (M.document_mask(docs), None),
        "global_sliding_window": (M.global_sliding_window_mask(s, 64, s // 16), None),
        "causal_blockwise": (M.causal_blockwise_mask([s // 4, s // 4, s // 2]), None),
    }[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "global_sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("cfg", [(32, 64, 4, 3), (32, 128, 8, 3)])
def test_gpu_matches_tl_kernel(name, cfg):
    if G.unavailable_reason():
        pytest.skip(G.unavailable_reason())
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90 (wgmma)")
    s, b, hq, hk, d = 1000, 2, 4, 2, 128
    mask, causal = _gpu_case(name, s)
    cols = None if mask is None else mask.startend_row_indices.cuda()
    causal = causal if mask is None else mask.causal
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    out, lse = T.forward(q, k, v, cols, causal, scale)
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
    if G.unavailable_reason() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Hopper and gluon")
    monkeypatch.delenv("FLASHMASK3_TRITON_DKDV", raising=False)
    q = torch.zeros(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert T._dkdv_impl(q, T.CANDIDATES[("dkdv", 128)][0]) == "gluon"
    assert T._dkdv_impl(q[..., :64].contiguous(), T.CANDIDATES[("dkdv", 64)][0]) == "tl"
    monkeypatch.setenv("FLASHMASK3_TRITON_DKDV", "tl")
    assert T._dkdv_impl(q, T.CANDIDATES[("dkdv", 128)][0]) == "tl"
