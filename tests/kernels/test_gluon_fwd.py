"""The Gluon forward kernel (flashmask3/kernels/gluon_fwd.py).

CPU: the kernel compiles offline for sm_90 (Triton's bundled ptxas/cuobjdump, no GPU) into a
cubin with wgmma (HGMMA), a wait that leaves the PV matmul in flight under the softmax
(``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and no spill inside a tile loop at 128x128 w8 on the
layouts below; the env dispatch FLASHMASK3_TRITON_FWD accepts tl/gluon (falling back to tl
where Gluon cannot run) and rejects anything else. GPU (``gpu`` marker): through the public
function with FLASHMASK3_TRITON_FWD=gluon, O and LSE match the float64 dense reference on
several masks (a fully masked row: O = 0, LSE = -inf, no NaN), and the backward runs on them.
"""

from __future__ import annotations

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


def test_config_checks():
    F.check_config(128, 128, 128, 8, 3)
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


def test_dispatch_env(monkeypatch):
    """Default and =tl: tl; =gluon: tl wherever Gluon cannot run (CPU tensors here); anything
    else: a ValueError naming the variable."""
    q = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    cfg = T.CANDIDATES[("fwd", 128)][0]
    monkeypatch.delenv("FLASHMASK3_TRITON_FWD", raising=False)
    assert T._fwd_impl(q, cfg) == "tl"
    for value in ("tl", "gluon", " gluon "):
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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "document",
                                  "sliding_window", "global_sliding_window", "empty_rows"])
def test_gpu_public_forward_matches_reference(name, monkeypatch):
    import flashmask3

    _require_hopper_gluon()
    monkeypatch.setenv("FLASHMASK3_TRITON_FWD", "gluon")
    s, d = 1000, 128  # not a multiple of the blocks
    mask, causal = _gpu_masks(s)[name]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, s, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, s, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cfg = T._config("fwd", d, causal is True, 0, q.dtype)
    assert T._fwd_impl(q, cfg) == "gluon"
    if isinstance(mask, torch.Tensor):
        cols, mask_arg, kw = mask.cuda(), mask.cuda(), dict(causal=causal)
    elif mask is None:
        cols, mask_arg, kw = None, None, dict(causal=causal)
    else:
        mask = mask.to("cuda")
        cols, causal, mask_arg, kw = mask.startend_row_indices, mask.causal, mask, {}
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
