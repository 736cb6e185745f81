"""Attention backends for the training harness, and a timer for the attention share of a step.

``make_attention(backend, mask)`` returns the ``attention(q, k, v)`` callable the model calls in
every layer (q ``[B, S, Hq, D]``, k/v ``[B, S, Hk, D]``, output ``[B, S, Hq, D]``):

* ``flashmask3``: :func:`flashmask3.flashmask_attention` on the column mask (O(S) memory);
* ``flex``: FlexAttention with a ``mask_mod`` that reads the same column vectors (compiled on
  GPU; eager on CPU, where it materialises the scores and is only good for checking);
* ``sdpa``: ``scaled_dot_product_attention`` with the dense ``[B, 1, S, S]`` boolean mask
  (the O(S²) baseline).

With context parallelism the callable is built from a plan instead (``make_cp_attention``).
All three single-device backends compute the same function, so swapping them is a flag.
"""

from __future__ import annotations

import time
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from flashmask3.masks import FlashMask

from .model import AttentionFn


def make_attention(backend: str, mask: FlashMask, dtype: Optional[torch.dtype] = None) -> AttentionFn:
    """The attention callable of ``backend`` for one batch's mask. ``dtype``: the dtype q/k/v
    will have (the autocast dtype), for backends that prepare a mask in it (sdpa)."""
    if not isinstance(mask, FlashMask):
        raise TypeError(f"mask must be a FlashMask, got {type(mask).__name__}")
    if backend == "flashmask3":
        return _flashmask3_attention(mask)
    if backend == "flex":
        return _flex_attention(mask)
    if backend == "sdpa":
        return _sdpa_attention(mask, dtype)
    raise ValueError(f"attention backend must be one of ['flashmask3', 'flex', 'sdpa'], "
                     f"got {backend!r}")


def _flashmask3_attention(mask: FlashMask) -> AttentionFn:
    from flashmask3 import flashmask_attention

    def attention(q, k, v):
        return flashmask_attention(q, k, v, mask)
    return attention


def _additive_mask(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``0 / -inf`` float mask of a boolean one (True = attend) in ``dtype``."""
    return torch.zeros(dense.shape, dtype=dtype, device=dense.device).masked_fill_(~dense, float("-inf"))


def _sdpa_attention(mask: FlashMask, dtype: Optional[torch.dtype] = None) -> AttentionFn:
    """SDPA with the dense mask. Its float form in ``dtype`` is built here, once per batch; a
    call in another dtype builds its own. Built eagerly, not memoised on first use: the callable
    mutates nothing, so it traces under torch.compile and recomputes alike under activation
    checkpointing (a memo filled inside the compiled forward made the recomputation differ)."""
    dense = mask.to_dense()  # [B, Hm, S, S] bool, True = attend
    prepared = None if dtype is None else _additive_mask(dense, dtype)

    def attention(q, k, v):
        hq, hk = q.shape[2], k.shape[2]
        m = prepared if prepared is not None and prepared.dtype == q.dtype else _additive_mask(dense, q.dtype)
        if m.shape[1] not in (1, hq):
            m = m.repeat_interleave(hq // m.shape[1], 1)
        if hq != hk:  # repeat K/V so the fused masked kernels (not the math path) are eligible
            k, v = k.repeat_interleave(hq // hk, 2), v.repeat_interleave(hq // hk, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=m)
        return out.transpose(1, 2)
    return attention


# -- FlexAttention -------------------------------------------------------------------------------

_COMPILED_FLEX = None


def flex_available() -> bool:
    """Whether ``torch.nn.attention.flex_attention`` can be imported."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex_fn(device: torch.device, compiled: bool):
    """``flex_attention``, compiled once (the fused kernel; always on GPU), or eager."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_mask_mod(columns: tuple, causal: bool):
    """A FlexAttention ``mask_mod`` (True = attend) for the column semantics of docs/masks.md.

    ``columns``: the C column vectors, each ``[B, S]`` (one mask head) or ``[B, H, S]`` (one
    per query head), read inside the mask_mod, so refilling the same tensors with the next
    batch's mask needs no recompilation. (Plain 2-D/3-D gathers: FlexAttention's vmap-based
    block-mask builder rejects indexing a 4-D tensor with constant indices.)
    """
    c = len(columns)
    if columns[0].dim() == 3:
        col = lambda b, h, kv, i: columns[i][b, h, kv]  # noqa: E731
    else:
        col = lambda b, h, kv, i: columns[i][b, kv]  # noqa: E731

    def mask_mod(b, h, q_idx, kv_idx):
        if causal and c == 1:
            masked = q_idx >= col(b, h, kv_idx, 0)
        elif causal:
            masked = (q_idx >= col(b, h, kv_idx, 0)) & (q_idx < col(b, h, kv_idx, 1))
        elif c == 2:
            masked = (q_idx >= col(b, h, kv_idx, 0)) | (q_idx < col(b, h, kv_idx, 1))
        else:
            masked = ((q_idx >= col(b, h, kv_idx, 0)) & (q_idx < col(b, h, kv_idx, 1))) | \
                     ((q_idx >= col(b, h, kv_idx, 2)) & (q_idx < col(b, h, kv_idx, 3)))
        if causal:
            masked = masked | (kv_idx > q_idx)
        return ~masked
    return mask_mod


# One (column buffers, mask_mod) per mask shape: every batch of a run reuses them, so the
# compiled block-mask builder and flex kernel are not recompiled for each new mask.
_FLEX_MASK_MODS: dict = {}


def _cached_mask_mod(mask: FlashMask):
    t = mask.startend_row_indices
    key = (tuple(t.shape), mask.causal, str(t.device))
    per_head = t.shape[1] > 1
    if key not in _FLEX_MASK_MODS:
        shape = (t.shape[0], t.shape[1], t.shape[2]) if per_head else (t.shape[0], t.shape[2])
        bufs = tuple(torch.empty(shape, dtype=torch.int32, device=t.device)
                     for _ in range(t.shape[3]))
        _FLEX_MASK_MODS[key] = (bufs, flex_mask_mod(bufs, mask.causal))
    bufs, mask_mod = _FLEX_MASK_MODS[key]
    for i, buf in enumerate(bufs):
        buf.copy_(t[..., i] if per_head else t[:, 0, :, i])
    return mask_mod


def _flex_attention(mask: FlashMask, compiled: Optional[bool] = None) -> AttentionFn:
    """FlexAttention on ``mask``; ``compiled`` (default: on GPU) compiles the block-mask builder
    and the kernel, otherwise both run eagerly (CPU: forward only, for checks)."""
    if not flex_available():
        raise RuntimeError("the flex backend needs torch.nn.attention.flex_attention "
                           "(torch >= 2.5); pick --attention flashmask3 or sdpa")
    from torch.nn.attention.flex_attention import create_block_mask
    t = mask.startend_row_indices
    s = mask.seqlen_q
    heads = t.shape[1] if t.shape[1] > 1 else None  # per-head masks: one per query head
    compiled = t.device.type == "cuda" if compiled is None else compiled
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*_compile flag on create_block_mask.*")
        block_mask = create_block_mask(_cached_mask_mod(mask), t.shape[0], heads, s, s,
                                       device=t.device, _compile=compiled)
    fn = _flex_fn(t.device, compiled)

    def attention(q, k, v):
        with warnings.catch_warnings():
            if not compiled:  # eager flex is intended here (checks only): no nagging
                warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     block_mask=block_mask, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    return attention


# -- context parallelism ------------------------------------------------------------------------

def make_cp_attention(plan, group, comm: str, backward_calls: str = "auto", keep_kv: bool = True,
                      window_size: Optional[int] = None) -> AttentionFn:
    """Attention over a context-parallel group: local q/k/v shards in, local output out;
    ``window_size``: the plan's mask limited to a sliding window (``CPPlan.windowed``)."""
    from flashmask3.distributed import cp_flashmask_attention

    def attention(q, k, v):
        return cp_flashmask_attention(q, k, v, plan, group=group, comm=comm,
                                      backward_calls=backward_calls, keep_kv=keep_kv,
                                      window_size=window_size)
    return attention


# -- timing ------------------------------------------------------------------------------------

class AttentionTimer:
    """Accumulates the wall time spent in attention, forward and backward.

    ``wrap(fn)`` returns a callable that marks the start and end of the forward call and, through
    two identity autograd functions around it, the start and end of its backward. On CUDA the
    marks are events (no synchronisation until :meth:`collect`); on CPU ``perf_counter``.
    With activation checkpointing the recomputed forward counts too, as it costs step time.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self._spans: list = []   # (start_mark, end_mark) pairs
        self._open_bwd: list = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def wrap(self, fn: AttentionFn) -> AttentionFn:
        if not self.enabled:
            return fn

        def timed(q, k, v):
            if torch.is_grad_enabled() and q.requires_grad:
                q, k, v = _BackwardEnd.apply(self, q, k, v)
            start = self._mark()
            out = fn(q, k, v)
            self._spans.append((start, self._mark()))
            if torch.is_grad_enabled() and out.requires_grad:
                out = _BackwardStart.apply(self, out)
            return out
        return timed

    def collect(self) -> float:
        """Seconds of attention since the last collect (synchronises CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            total = sum(a.elapsed_time(b) for a, b in self._spans) / 1000.0
        else:
            total = sum(b - a for a, b in self._spans)
        self._spans, self._open_bwd = [], []
        return total


class _BackwardStart(torch.autograd.Function):
    """Identity on the attention output; its backward marks where attention backward begins."""

    @staticmethod
    def forward(ctx, timer, out):
        ctx.timer = timer
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer._open_bwd.append(ctx.timer._mark())
        return None, grad


class _BackwardEnd(torch.autograd.Function):
    """Identity on q, k, v; its backward marks where attention backward ends."""

    @staticmethod
    def forward(ctx, timer, q, k, v):
        ctx.timer = timer
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        timer = ctx.timer
        if timer._open_bwd:
            timer._spans.append((timer._open_bwd.pop(), timer._mark()))
        return None, dq, dk, dv


def attention_available(backend: str, device: torch.device, training: bool = True
                        ) -> Optional[str]:
    """None if ``backend`` runs on ``device`` (with a backward if ``training``), else why not."""
    if backend == "flex" and not flex_available():
        return "torch.nn.attention.flex_attention is not available in this torch"
    if backend == "flex" and training and device.type != "cuda":
        return "FlexAttention has no backward on CPU (it is the GPU baseline); use a GPU"
    return None
