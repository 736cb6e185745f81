"""The float64 dense reference attention: the one ground truth every path is tested against.

Dense O(S²) on purpose and in float64: it shares no code with the kernels except the
documented mask semantics (via :func:`flashmask3.masks.to_dense`, itself tested against a
literal reading of the column-mask table in docs/masks.md, tested in tests/masks).
"""

from __future__ import annotations

import math

import torch

from flashmask3.masks import to_dense


def reference_attention(q, k, v, startend_row_indices=None, causal=False, softmax_scale=None):
    """Masked attention in float64. Returns ``(out [B,Sq,Hq,D], lse [B,Hq,Sq])``, differentiable.

    Fully masked rows give out = 0 and lse = -inf, matching the library's contract.
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    k64 = k64.repeat_interleave(hq // hk, dim=2)
    v64 = v64.repeat_interleave(hq // hk, dim=2)
    allowed = to_dense(startend_row_indices, causal, sq, sk).to(q.device)  # [B|1, Hm, Sq, Sk]
    allowed = allowed.repeat_interleave(hq // allowed.shape[1], dim=1)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    p = torch.where(allowed, p, torch.zeros_like(p))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v64)
    return out, lse


def rel_err(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖ in float64, ignoring -inf entries that match exactly."""
    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    both_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    x = torch.where(both_inf, 0.0, x)
    ref = torch.where(both_inf, 0.0, ref)
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)
