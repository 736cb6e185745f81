"""Blockwise pure-PyTorch FlashMask attention: forward and backward on any device.

The fallback for machines without a Hopper GPU and the reference the Triton kernels are
tested against. It walks (query block, key block) tiles like the kernels do and uses the same
tile classification (:func:`flashmask3.masks.blocks.classify_tiles`): SKIP tiles are never
touched, PARTIAL tiles are masked element-wise, UNMASKED tiles do no mask work. Memory stays
O(S · block) beyond the inputs and outputs: no ``[Sq, Sk]`` tensor is ever built.

Tiles are shared by all batch rows and heads of one call, so a tile is skipped only when it is
SKIP for every (batch, mask head) and computed without a mask only when UNMASKED for all of
them. Accumulation is float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..masks.blocks import PARTIAL, SKIP, UNMASKED, classify_tiles
from ..masks.mask import element_mask

#: Tile sizes of the torch path: large tiles amortise Python overhead per tile.
BLOCK_M = 128
BLOCK_N = 128


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_view(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, S, Hq, D]`` -> ``[B, Hk, G, S, D]`` (query heads grouped by their KV head)."""
    b, s, h, d = x.shape
    return x.view(b, s, num_kv_heads, h // num_kv_heads, d).permute(0, 2, 3, 1, 4)


def _kv_view(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, Hk, D]`` -> ``[B, Hk, 1, S, D]`` (broadcast over the query-head group)."""
    return x.permute(0, 2, 1, 3).unsqueeze(2)


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hk, G, S, D]`` -> ``[B, S, Hk*G, D]``."""
    b, hk, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


class _TilePlan:
    """Tile classes of one call plus the element mask of a tile, in grouped-head layout."""

    def __init__(self, startend, causal, sq, sk, hq, hk, device):
        self.startend, self.causal, self.sq, self.sk = startend, causal, sq, sk
        self.hq, self.hk = hq, hk
        cls = classify_tiles(startend, causal, sq, sk, BLOCK_M, BLOCK_N)
        flat = cls.flatten(0, 1)
        self.any_live = (flat != SKIP).any(0).tolist()
        self.all_unmasked = (flat == UNMASKED).all(0).tolist()
        self.device = device

    def tile_kind(self, qi: int, ki: int) -> int:
        if not self.any_live[qi][ki]:
            return SKIP
        return UNMASKED if self.all_unmasked[qi][ki] else PARTIAL

    def allowed(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Boolean allowed mask broadcastable to ``[B, Hk, G, rows, cols]``."""
        rows = torch.arange(r0, r1, device=self.device)
        cols = torch.arange(c0, c1, device=self.device)
        if self.startend is None:
            m = element_mask(torch.full((1, 1, c1 - c0, 1), self.sq, device=self.device),
                             True, rows, cols, self.sq, self.sk)
        else:
            m = element_mask(self.startend[:, :, c0:c1], self.causal, rows, cols, self.sq, self.sk)
        b, hm = m.shape[:2]
        if hm == 1:
            return m.view(b, 1, 1, r1 - r0, c1 - c0)
        if hm == self.hk:
            return m.view(b, hm, 1, r1 - r0, c1 - c0)
        # Any other divisor of Hq: repeat to query heads, then group by KV head.
        m = m.repeat_interleave(self.hq // hm, dim=1)
        return m.view(b, self.hk, self.hq // self.hk, r1 - r0, c1 - c0)


def _tiles(n: int, block: int):
    for idx, start in enumerate(range(0, n, block)):
        yield idx, start, min(start + block, n)


def forward(q, k, v, startend_row_indices: Optional[torch.Tensor], causal: bool,
            softmax_scale: float, row_span: Optional[float] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention forward. Returns ``out [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]`` (fp32).
    ``row_span`` (the mask's mean row span, a tile hint for the Triton backend) is unused."""
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    acc = _acc_dtype(q.dtype)
    plan = _TilePlan(startend_row_indices, causal, sq, sk, hq, hk, q.device)
    qg, kg, vg = _group_view(q, hk), _kv_view(k), _kv_view(v)
    g = hq // hk
    out = torch.empty(b, hk, g, sq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hk, g, sq, dtype=acc, device=q.device)
    for qi, r0, r1 in _tiles(sq, BLOCK_M):
        q_blk = qg[:, :, :, r0:r1].to(acc)
        m_i = torch.full((b, hk, g, r1 - r0), -math.inf, dtype=acc, device=q.device)
        l_i = torch.zeros_like(m_i)
        o_i = torch.zeros(b, hk, g, r1 - r0, dv, dtype=acc, device=q.device)
        for ki, c0, c1 in _tiles(sk, BLOCK_N):
            kind = plan.tile_kind(qi, ki)
            if kind == SKIP:
                continue
            s = torch.matmul(q_blk, kg[:, :, :, c0:c1].to(acc).transpose(-1, -2)) * softmax_scale
            if kind == PARTIAL:
                s = s.masked_fill(~plan.allowed(r0, r1, c0, c1), -math.inf)
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(-1)
            o_i = o_i * alpha.unsqueeze(-1) + torch.matmul(p, vg[:, :, :, c0:c1].to(acc))
            m_i = m_new
        empty = l_i == 0
        out[:, :, :, r0:r1] = (o_i / torch.where(empty, 1.0, l_i).unsqueeze(-1)).to(q.dtype)
        lse[:, :, :, r0:r1] = torch.where(empty, -math.inf, m_i + torch.log(l_i))
    return _ungroup(out), lse.reshape(b, hq, sq).to(torch.float32)


def backward(dout, dlse, q, k, v, out, lse, startend_row_indices: Optional[torch.Tensor],
             causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the forward with respect to q, k, v (``dlse`` may be ``None``)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    acc = _acc_dtype(q.dtype)
    plan = _TilePlan(startend_row_indices, causal, sq, sk, hq, hk, q.device)
    qg, kg, vg = _group_view(q, hk), _kv_view(k), _kv_view(v)
    dog = _group_view(dout, hk).to(acc)
    delta = (dog * _group_view(out, hk).to(acc)).sum(-1)  # [B, Hk, G, Sq]
    if dlse is not None:
        delta = delta - dlse.to(acc).view(b, hk, g, sq)
    lse_g = lse.to(acc).view(b, hk, g, sq)
    # Fully masked rows: lse = -inf; use +inf so that every p = exp(s - lse) is exactly 0.
    lse_g = torch.where(torch.isinf(lse_g), math.inf, lse_g)
    dq = torch.zeros(b, hk, g, sq, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, hk, sk, d, dtype=acc, device=q.device)
    dv = torch.zeros(b, hk, sk, v.shape[3], dtype=acc, device=q.device)
    for ki, c0, c1 in _tiles(sk, BLOCK_N):
        k_blk = kg[:, :, :, c0:c1].to(acc)
        v_blk = vg[:, :, :, c0:c1].to(acc)
        for qi, r0, r1 in _tiles(sq, BLOCK_M):
            kind = plan.tile_kind(qi, ki)
            if kind == SKIP:
                continue
            q_blk = qg[:, :, :, r0:r1].to(acc)
            s = torch.matmul(q_blk, k_blk.transpose(-1, -2)) * softmax_scale
            p = torch.exp(s - lse_g[:, :, :, r0:r1].unsqueeze(-1))
            if kind == PARTIAL:
                p = p.masked_fill(~plan.allowed(r0, r1, c0, c1), 0.0)
            do_blk = dog[:, :, :, r0:r1]
            dv[:, :, c0:c1] += torch.matmul(p.transpose(-1, -2), do_blk).sum(2)
            dp = torch.matmul(do_blk, v_blk.transpose(-1, -2))
            ds = p * (dp - delta[:, :, :, r0:r1].unsqueeze(-1)) * softmax_scale
            dq[:, :, :, r0:r1] += torch.matmul(ds, k_blk)
            dk[:, :, c0:c1] += torch.matmul(ds.transpose(-1, -2), q_blk).sum(2)
    return (
        _ungroup(dq).to(q.dtype),
        dk.permute(0, 2, 1, 3).to(k.dtype),
        dv.permute(0, 2, 1, 3).to(v.dtype),
    )
