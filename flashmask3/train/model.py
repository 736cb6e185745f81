"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) with an optional top-k MoE FFN.

The attention kernel is not part of the model: every forward receives a
:class:`StepContext` whose ``attention(q, k, v)`` callable (q ``[B, S, Hq, D]``, k/v
``[B, S, Hk, D]``) closes over the batch's mask, or over a context-parallel plan. That keeps
the model identical for every backend (flashmask3, flex, sdpa) and for every CP setting.

Everything outside attention is token-local, so under context parallelism each rank runs the
model on its own token shard: RoPE uses the global position ids of its tokens, and the MoE
load-balancing loss is written as a sum over tokens with globally reduced expert counts, so the
per-rank losses add up to exactly the single-rank loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _identity_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class StepContext:
    """What one forward needs besides the tokens.

    ``attention``: the attention callable for this batch (``window_attention``: the one of the
    sliding-window layers). ``all_reduce``: sums a tensor over the
    context-parallel group (identity without CP). ``num_tokens``: tokens in the *global* batch
    (all ranks), the denominator of token-mean quantities.
    """

    attention: AttentionFn
    num_tokens: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=_identity_reduce)
    #: the sliding-window layers' attention (the batch's mask limited to the window), if any
    window_attention: Optional[AttentionFn] = None


# -- rotary embeddings -------------------------------------------------------------------------

def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[B, S, 1, head_dim/2]`` (fp32) for integer positions ``[B, S]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) of ``x [B, S, H, D]`` by the position angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


# -- blocks ------------------------------------------------------------------------------------

class Attention(nn.Module):
    """GQA self-attention; the kernel comes from the step context."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, windowed: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.windowed = windowed  # a sliding-window layer: ctx.window_attention
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin, ctx: StepContext):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attention = ctx.window_attention if self.windowed else ctx.attention
        if attention is None:
            raise ValueError("a sliding-window layer needs StepContext.window_attention")
        out = attention(q, k, v)
        return self.wo(out.reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a Switch-style load-balancing loss.

    Returns ``(out, aux)``. ``aux`` is this rank's share of ``E · Σ_e f_e · P_e`` where the
    dispatch fractions ``f_e`` are counted over the whole CP group (``ctx.all_reduce``) and
    ``P_e = Σ_tokens p_e / ctx.num_tokens``; the shares of all ranks sum to the global value.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x, ctx: StepContext):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), dim=-1)
        gate, expert = probs.topk(self.top_k, dim=-1)
        gate = (gate / gate.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            tok, slot = torch.nonzero(expert == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = x[tok]
            y = (F.silu(h @ self.w1[e]) * (h @ self.w3[e])) @ self.w2[e]
            out.index_add_(0, tok, (y * gate[tok, slot, None]).to(out.dtype))
        counts = torch.bincount(expert.flatten(), minlength=self.n_experts).to(probs.dtype)
        frac = ctx.all_reduce(counts.detach()) / (ctx.num_tokens * self.top_k)
        aux = self.n_experts * (frac * probs.sum(0)).sum() / ctx.num_tokens
        return out.view(shape), aux


class Block(nn.Module):
    def __init__(self, cfg, windowed: bool = False):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attn = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, windowed)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        if cfg.moe_experts:
            self.ffn = MoE(cfg.dim, cfg.moe_ffn_dim or cfg.resolved_ffn_dim(), cfg.moe_experts,
                           cfg.moe_top_k)
        else:
            self.ffn = SwiGLU(cfg.dim, cfg.resolved_ffn_dim())

    def forward(self, x, cos, sin, ctx: StepContext):
        x = x + self.attn(self.attn_norm(x), cos, sin, ctx)
        h = self.ffn_norm(x)
        if isinstance(self.ffn, MoE):
            y, aux = self.ffn(h, ctx)
        else:
            y, aux = self.ffn(h), x.new_zeros((), dtype=torch.float32)
        return x + y, aux


class Transformer(nn.Module):
    """Byte-level decoder. ``forward(tokens, position_ids, ctx) -> (logits, moe_aux)``."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, w) for w in cfg.windowed_layers())
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.activation_checkpointing = cfg.activation_checkpointing
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; residual output projections scaled by 1/sqrt(2·layers)."""
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)  # RMSNorm gains
            elif name.endswith(("wo.weight", "w2.weight")) or name.endswith(".w2"):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=0.02)

    def compile_blocks(self) -> None:
        """``torch.compile`` each block's ``forward`` (the repeated region: the blocks share one
        compiled graph). The module's ``__call__`` and its hooks (FSDP2's gather and free) stay
        eager around it; dense blocks compile with ``fullgraph=True``, so a graph break is an
        error rather than a silent slowdown."""
        for block in self.layers:
            block.forward = torch.compile(block.forward, fullgraph=not self.cfg.moe_experts)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, ctx: StepContext):
        x = self.embed(tokens)
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # no RNG state to stash and replay: the blocks draw no random numbers (no
                # dropout), and a CUDA-graph capture may not read the RNG state (--cuda-graph)
                x, a = checkpoint(layer, x, cos, sin, ctx, use_reentrant=False, preserve_rng_state=False)
            else:
                x, a = layer(x, cos, sin, ctx)
            aux = aux + a
        return self.head(self.norm(x)), aux


def loss_terms(model: Transformer, tokens, labels, position_ids, ctx: StepContext,
               num_label_tokens: int, moe_aux_coef: float = 0.0):
    """This rank's share of the loss: ``(total, ce)`` with ``ce = Σ_local CE / num_label_tokens``.

    ``num_label_tokens`` (an int, or a scalar tensor on the device) counts the targets of the
    *global* batch, so summing the shares of all ranks gives the mean cross-entropy of the whole
    batch, as on a single rank.
    """
    logits, aux = model(tokens, position_ids, ctx)
    if isinstance(num_label_tokens, torch.Tensor):  # a device count: no host synchronisation
        denominator = num_label_tokens.clamp(min=1)
    else:
        denominator = max(1, num_label_tokens)
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                         reduction="sum") / denominator
    return ce + moe_aux_coef * aux, ce


# -- accounting --------------------------------------------------------------------------------

def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_counts(cfg) -> dict[str, int]:
    """``{"total", "active"}`` parameters of the model ``cfg`` describes, counted from the
    config (no model built). ``active``: what one token uses, i.e. the total minus the experts
    it is not routed to (embeddings, norms and the router counted in both), the convention of
    "14B active of 118B" MoE figures."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    norms = 2 * d
    if cfg.moe_experts:
        expert = 3 * d * (cfg.moe_ffn_dim or cfg.resolved_ffn_dim())
        ffn, idle = d * cfg.moe_experts + cfg.moe_experts * expert, \
            (cfg.moe_experts - cfg.moe_top_k) * expert
    else:
        ffn, idle = 3 * d * cfg.resolved_ffn_dim(), 0
    total = cfg.n_layers * (attn + norms + ffn) + 2 * cfg.vocab_size * d + d
    return {"total": total, "active": total - cfg.n_layers * idle}


def active_matmul_params(cfg) -> int:
    """Parameters one token multiplies through (MoE: router + top_k experts), LM head included."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    if cfg.moe_experts:
        hidden = cfg.moe_ffn_dim or cfg.resolved_ffn_dim()
        ffn = d * cfg.moe_experts + cfg.moe_top_k * 3 * d * hidden
    else:
        ffn = 3 * d * cfg.resolved_ffn_dim()
    return cfg.n_layers * (attn + ffn) + d * cfg.vocab_size


def model_flops_per_step(cfg, num_tokens: int, attention_flops_per_layer: float,
                         window_flops_per_layer: Optional[float] = None) -> float:
    """Forward+backward model FLOPs: 6·N_active·tokens + attention (all layers).

    ``attention_flops_per_layer`` is one full layer's forward+backward attention count, from
    :func:`flashmask3.masks.attention_flops` (``mode="fwd_bwd"``), the one FLOP convention;
    ``window_flops_per_layer`` a sliding-window layer's (``cfg.windowed_layers()``).

    Activation recomputation is not counted (model FLOPs, not hardware FLOPs).
    """
    windowed = sum(cfg.windowed_layers())
    if windowed and window_flops_per_layer is None:
        raise ValueError("the config has sliding-window layers: pass window_flops_per_layer")
    return 6.0 * active_matmul_params(cfg) * num_tokens + \
        attention_flops_per_layer * (cfg.n_layers - windowed) + (window_flops_per_layer or 0.0) * windowed
