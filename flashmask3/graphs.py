"""CUDA-graph capture of a step that calls flashmask3 (one attention call, or a context-parallel
layer through the runtime): torch's recipe with the one detail that matters for autograd.

The step is warmed up on a side stream and captured on that same stream. Warming up compiles
the kernels, builds the plans and the rank programs and runs the first-call collectives, none
of which may happen inside a capture; using one stream for both matters because torch (2.11)
remembers the stream on which each leaf's gradient-accumulation node was made, and a node made
on the default stream by an earlier eager step breaks the capture
(``cudaErrorStreamCaptureImplicit``). So pass leaves that no eager step used before (e.g.
``t.detach().requires_grad_()``). docs/cp-runtime.md ("CUDA graphs") and docs/host-path.md.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def capture(step: Callable[..., Any], *args, warmup: int = 2, stream: Optional[torch.cuda.Stream] = None,
            capture_error_mode: str = "global"):
    """``(graph, outputs)``: ``step(*args)`` run ``warmup`` times eagerly on a side stream, then
    captured once on it. ``outputs`` are the captured call's results: every ``graph.replay()``
    rewrites them from whatever was copied into the captured inputs (``args`` and any tensor the
    step reads). The graph does not own that memory: keep the inputs and ``outputs`` alive while
    you replay it (a freed input's memory goes to other tensors, and a replay would read them).

    ``stream``: the side stream (default a new one); pass the same one to capture the same
    leaves again (autograd keeps the stream each leaf's gradient node was made on).
    ``capture_error_mode``: torch's (``"thread_local"`` lets other threads, e.g. a data loader
    copying the next batch, use CUDA during the capture)."""
    if not torch.cuda.is_available():
        raise RuntimeError("capture needs CUDA (CUDA graphs)")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be a positive int (the capture needs a warmed-up step), got {warmup!r}")
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode=capture_error_mode):
        outputs = step(*args)
    return graph, outputs


__all__ = ["capture"]
