"""Staged backward: one attention backward whose keys arrive in several stages.

Context parallelism (docs/cp-runtime.md) computes one layer's backward in 3-4 stages, one per
set of key chunks, all against the same queries, output and (merged) log-sum-exp. What does not
depend on the keys is the same for every stage: the pre-pass (``delta = rowsum(dO * O) - dlse``
and the LSE in base 2), the fp32 dQ accumulator and the final dQ scaling. A backend with a
staged backward pays it once per layer through three functions:

- ``backward_prepare(q, out, dout, lse, dlse) -> state``: the per-layer work;
- ``backward_stage(state, q, k, v, mask, causal, softmax_scale) -> (dk, dv)``: one stage's
  dK/dV; its dQ is added into ``state``;
- ``backward_finish(state) -> dq``: the summed dQ in q's dtype.

Calling them over stages whose keys partition a key set gives the gradients of one
``backward`` over that key set (up to the summation order of dQ).

This module has the part every backend shares: :func:`add_dq` (how stage dQs are summed) and
:class:`WholeCallStages`, the staged functions built on a backend's plain ``backward`` (each
stage is one whole backward call; the dQs are summed in fp32 / float64), used by the torch path
and by the runtime for any backend without staged functions of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype stage dQs are summed in: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def add_dq(total: Optional[torch.Tensor], dq: torch.Tensor) -> torch.Tensor:
    """``total + dq``, summed in :func:`sum_dtype`. The first stage's dQ is kept as it is (no
    copy: a one-stage backward returns it unchanged); from the second on the sum is fp32
    (``total`` is then owned by the caller and updated in place)."""
    if total is None:
        return dq
    acc = sum_dtype(dq.dtype)
    if total.dtype != acc:
        total = total.to(acc)
    return total.add_(dq)


def check_stage_scale(state, softmax_scale: float) -> None:
    """Every stage of one staged backward must use the same ``softmax_scale``."""
    if state.scale is None:
        state.scale = float(softmax_scale)
    elif float(softmax_scale) != state.scale:
        raise ValueError(f"softmax_scale: every stage of a staged backward must use the same "
                         f"scale, got {softmax_scale} after {state.scale}")


@dataclass
class WholeCallState:
    """A staged backward made of whole ``backward`` calls (see :class:`WholeCallStages`)."""

    q: torch.Tensor
    out: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    dlse: Optional[torch.Tensor]
    dq: Optional[torch.Tensor] = None
    scale: Optional[float] = None


class WholeCallStages:
    """The three staged-backward functions on top of a plain ``backward(dout, dlse, q, k, v,
    out, lse, mask, causal, softmax_scale) -> (dq, dk, dv)``: every stage is one backward call
    (its per-call work is repeated), the stages' dQs are summed by :func:`add_dq`."""

    def __init__(self, backward: Callable):
        self.backward = backward

    def backward_prepare(self, q, out, dout, lse, dlse) -> WholeCallState:
        return WholeCallState(q, out, dout, lse, dlse)

    def backward_stage(self, state: WholeCallState, q, k, v, mask, causal, softmax_scale):
        check_stage_scale(state, softmax_scale)
        if k.shape[1] == 0:  # a stage without keys adds nothing
            return torch.zeros_like(k), torch.zeros_like(v)
        dq, dk, dv = self.backward(state.dout, state.dlse, q, k, v, state.out, state.lse, mask,
                                   causal, softmax_scale)
        state.dq = add_dq(state.dq, dq)
        return dk, dv

    def backward_finish(self, state: WholeCallState) -> torch.Tensor:
        if state.dq is None:  # no stage had keys
            return torch.zeros_like(state.q)
        return state.dq.to(state.q.dtype)


def staged_functions(backend):
    """``(prepare, stage, finish)`` of ``backend``: its own staged backward where it has one,
    else :class:`WholeCallStages` around its ``backward``."""
    if all(hasattr(backend, f"backward_{n}") for n in ("prepare", "stage", "finish")):
        return backend.backward_prepare, backend.backward_stage, backend.backward_finish
    whole = WholeCallStages(backend.backward)
    return whole.backward_prepare, whole.backward_stage, whole.backward_finish
