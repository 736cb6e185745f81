"""Shared correctness checks of one attention backend against the float64 dense reference."""

from __future__ import annotations

import math

import torch

import flashmask3
from tests.reference import reference_attention, rel_err

#: ‖err‖/‖ref‖ bounds per input dtype (METHOD.md: fp32 far under 1e-3, bf16 up to 1e-2).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_qkv(batch, sq, sk, hq, hk, d, dtype, device="cpu", seed=0):
    """Fresh random q, k, v (never zeros) that require grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(batch, sk, hk, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch, sk, hk, d, generator=g).to(device=device, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def check_attention(q, k, v, mask=None, *, causal=False, softmax_scale=None, check_grad=True,
                    tol=None, **kwargs):
    """Run flashmask_attention forward (+ backward through out and lse) and compare with the
    float64 reference. Returns the dict of relative errors for reporting."""
    tol = TOLERANCE[q.dtype] if tol is None else tol
    out, lse = flashmask3.flashmask_attention(q, k, v, mask, causal=causal, softmax_scale=softmax_scale,
                                              return_softmax_lse=True, **kwargs)
    if isinstance(mask, flashmask3.FlashMask):
        cols, ref_causal = mask.startend_row_indices, mask.causal
    else:
        cols, ref_causal = mask, causal
    ref_out, ref_lse = reference_attention(q, k, v, cols, ref_causal, softmax_scale)
    assert out.shape == q.shape[:3] + (v.shape[-1],) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "fully masked rows disagree"
    errs = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse)}
    if check_grad:
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse).masked_fill(torch.isinf(lse), 0.0)
        grads = torch.autograd.grad((out * dout).sum() + (lse.masked_fill(torch.isinf(lse), 0) * dlse).sum(),
                                    (q, k, v))
        ref_lse_f = ref_lse.masked_fill(torch.isinf(ref_lse), 0)
        ref_grads = torch.autograd.grad((ref_out * dout.double()).sum() + (ref_lse_f * dlse.double()).sum(),
                                        (q, k, v))
        for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert g.shape == rg.shape and g.dtype == q.dtype
            assert not torch.isnan(g).any(), name
            errs[name] = rel_err(g, rg)
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"
    return errs
