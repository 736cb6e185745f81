"""Static mask tensors: column tensors the library builds once and never writes (the
context-parallel runtime's per-stage columns). The Triton backend keeps a static mask's plans
on the tensor itself and reuses them while a CUDA graph is captured (``tiles.cached_plan``);
any other mask is re-planned inside a capture, since a replay may see new columns copied into
it. This module has no Triton dependency: the runtime marks its columns on every backend."""

from __future__ import annotations

import sys

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


def warming_up(t: torch.Tensor) -> bool:
    """Whether inductor's CUDA graph trees (``torch.compile(mode="reduce-overhead")``) are
    warming a graph up on this thread while ``t`` (a CUDA tensor) is used: the warm-up's
    allocations go to the trees' private pool, which must hold only the graphs' outputs when the
    next graph is recorded (a tensor kept from then fails the recording). For the paths that
    would store a new tensor (cache misses): it costs a microsecond or two."""
    return t.is_cuda and _graph_trees_warming_up(t.device.index)


def keeps_nothing(t: torch.Tensor) -> bool:
    """Whether nothing made now may be kept for later calls: :func:`capturing` or
    :func:`warming_up`."""
    return capturing(t) or warming_up(t)


def _graph_trees_warming_up(device_index) -> bool:
    """Whether inductor's CUDA graph trees run a warm-up on this thread and device. It reads
    torch's private module state (``torch._inductor.cudagraph_trees``, not imported here: if
    nothing imported it, no tree runs); a layout this code does not know counts as a warm-up,
    since keeping nothing is always correct (it only costs re-planning)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return False  # (no tree was used on this thread)
        container = trees.get_obj(trees.local, "tree_manager_containers").get(device_index)
        manager = None if container is None else container.tree_manager
        return manager is not None and bool(manager.in_warmup)
    except Exception:  # noqa: BLE001 - another torch's private layout
        return True
