"""Static mask tensors: column tensors the library builds once and never writes (the
context-parallel runtime's per-stage columns). The Triton backend keeps a static mask's plans
on the tensor itself and reuses them while a CUDA graph is captured (``tiles.cached_plan``);
any other mask is re-planned inside a capture, since a replay may see new columns copied into
it. This module has no Triton dependency: the runtime marks its columns on every backend."""

from __future__ import annotations

import torch

#: The attribute that marks a static mask (and, once planned, holds its plans).
STATIC_PLANS = "_flashmask3_plans"


def mark_static(mask: torch.Tensor) -> torch.Tensor:
    """Mark ``mask`` static (a tensor nothing writes after this call) and return it."""
    setattr(mask, STATIC_PLANS, None)
    return mask


def is_static(mask: torch.Tensor) -> bool:
    """Whether ``mask`` was marked by :func:`mark_static`."""
    return hasattr(mask, STATIC_PLANS)


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream while ``t`` (a CUDA tensor)
    is used: a tensor made then holds values only after a replay, and a mask read then may get
    new values copied in before a replay, so neither may be cached."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
