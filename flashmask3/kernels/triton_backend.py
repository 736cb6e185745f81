"""The Triton backend of :func:`flashmask3.flashmask_attention`: what runs a call.

Backend contract (docs/ARCHITECTURE.md): :func:`forward` and :func:`backward` (and the
optional staged backward, ``merge_stages`` / ``merge_usable``, ``gather_keys`` and ``pack_wire``
/ ``wire_usable`` and ``add_returns`` / ``sum_wire_rows`` / ``returns_usable``, which context
parallelism uses). Layout is
q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hk, D]`` (GQA without repeating K/V), mask
``startend_row_indices`` int32 ``[B, Hm, Sk, C]`` or ``None``, LSE fp32 ``[B, Hq, Sq]``.

Each call asks :func:`flashmask3.kernels.dispatch.choose` which kernel and tile run each pass,
builds the mask's plan for that tile (:func:`flashmask3.kernels.tiles.make_plan`) and launches
the kernel: :mod:`.tl_kernels` (portable), :mod:`.gluon_fwd` or :mod:`.gluon_bwd` (Hopper).
The module imports without a GPU; under ``TRITON_INTERPRET=1`` it runs on CPU tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .._env import env_reader
from . import dispatch, staged, tl_kernels
from .dispatch import PLAN_BY_KEY, Launch, backward_mode, use_backward  # noqa: F401
from .gluon_bwd import (FUSED_VARIANT, GluonDkdv, dq_accumulator_view, launch_dkdv_gluon,
                        new_dq_accumulator)
from .gluon_fwd import GluonForward, launch_fwd_gluon
from .launcher import cdiv
from .gather import gather_keys  # noqa: F401  (the context-parallel stages' keys from wire rows)
from .gather import pack_wire  # noqa: F401  (K/V or dK/dV from the key layout into wire rows)
from .gather import usable as wire_usable  # noqa: F401
from .merge import merge_stages  # noqa: F401  (the context-parallel forward's merge)
from .merge import usable as merge_usable  # noqa: F401
from .returns import add_returns, sum_wire_rows  # noqa: F401  (the context-parallel backward's gradient returns)
from .returns import usable as returns_usable  # noqa: F401
from .tiles import Config, Plan, cached_plan, make_plan  # noqa: F401

HEAD_DIMS = (16, 32, 64, 128, 256)


def unsupported_reason(q: torch.Tensor) -> Optional[str]:
    """Why these inputs cannot run on the Triton kernels (None when they can); api.py falls
    back to the torch path on ``auto``."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} (the Triton kernels take float16, bfloat16 and float32)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (the Triton kernels take 16, 32, 64, 128 or 256)"
    if not q.is_cuda and not tl_kernels.interpreting():
        return f"tensors on {q.device} (CUDA, or TRITON_INTERPRET=1 for CPU tensors)"
    return None


def _check_head_dim(d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"the Triton FlashMask kernel supports head dims 16..256 powers of two, got {d}")


def _plan(mask, causal, sq, sk, launch: Launch, device) -> Plan:
    t = launch.tile
    return cached_plan(mask, causal, sq, sk, t.block_m, t.block_n, PLAN_BY_KEY[launch.pass_],
                       device)


def _tile_args(t: Config) -> tuple:
    return (t.block_m, t.block_n, t.num_warps, t.num_stages)


def run_forward(launch: Launch, q, k, v, mask, causal, softmax_scale, plan: Plan):
    """(out, lse) of the forward ``launch`` (a :class:`~.dispatch.Launch` of pass "fwd")."""
    if launch.kernel == "tl":
        return tl_kernels.launch_fwd(q, k, v, causal, softmax_scale, launch.tile, plan)
    return launch_fwd_gluon(q, k, v, mask, causal, softmax_scale, plan, *_tile_args(launch.tile),
                            warp_spec=True, pingpong=launch.kernel == "gluon_ws_pingpong")


def run_dkdv(launch: Launch, q, k, v, dout, lse2, delta, causal, softmax_scale, plan: Plan,
             dq_t: Optional[torch.Tensor] = None, kv_split: int = 1):
    """(dk, dv, dq_acc) of a dK/dV or fused ``launch``; dq_acc (unscaled fp32 dQ) only when
    fused without ``dq_t``, else None. ``dq_t``: the fused kernel's zeroed dQᵀ accumulator
    (``tl_kernels.dq_accumulator`` zeroed by the pre-pass), which the caller then views
    (``dq_accumulator_view``); without it the kernel's launcher allocates one. ``kv_split``:
    programs per KV head's group of query heads (:func:`kv_split_of`)."""
    args = (q, k, v, dout, lse2, delta, causal, softmax_scale)
    if launch.kernel == "tl":
        return tl_kernels.launch_dkdv(*args, launch.tile, plan, kv_split) + (None,)
    out = launch_dkdv_gluon(*args, plan, *_tile_args(launch.tile), **_dkdv_variant(launch),
                            dq_t=dq_t, kv_split=kv_split)
    return out if len(out) == 3 else out + (None,)


def _dkdv_variant(launch: Launch) -> dict:
    """The Gluon dK/dV kernel's variant flags (:func:`~.gluon_bwd.launch_dkdv_gluon`) of a
    ``gluon_fused`` or ``gluon_ws_dkdv*`` launch."""
    if launch.kernel == "gluon_fused":
        return FUSED_VARIANT
    return dict(warp_spec=True, stats_smem=launch.kernel == "gluon_ws_dkdv_stats")


def gluon_dkdv(launch: Launch, q, k, plan: Plan, causal: bool, softmax_scale: float,
               kv_split: int = 1) -> GluonDkdv:
    """The prepared Gluon dK/dV launch (:class:`~.gluon_bwd.GluonDkdv`) of a Gluon ``launch``
    for these shapes and this plan's mask layout."""
    return GluonDkdv(q, k, plan, causal, softmax_scale, *_tile_args(launch.tile),
                     **_dkdv_variant(launch), kv_split=kv_split)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> Optional[int]:
    """Streaming multiprocessors of a CUDA ``device`` (None elsewhere: the interpreter)."""
    if device.type != "cuda":
        return None
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def splits_kv_groups(launch: Launch, b: int, hq: int, hk: int, sk: int, device) -> bool:
    """Whether a GQA backward splits each KV head's group over programs: its dK/dV launch runs
    one program per query head instead of per KV head. The dK/dV kernels run one program per
    (key block, KV head), each looping over its group's query heads: a call over few key blocks
    (a context-parallel stage, a short
    sequence) has fewer programs than SMs, and each does ``Hq/Hk`` heads of work, so most of the
    GPU idles (measured: 1024 keys, 32/4 heads, 4.2 ms where 16/16 heads take 0.62 ms;
    docs/scale-model.md). Split, the same work runs as ``Hq/Hk`` times more programs of one
    head each (the kernels' KV_SPLIT), whose fp32 partial dK/dV one more launch sums (bytes of
    order Sk x Hq x D). The rule: :func:`dispatch.kv_expansion` (grouped grids of at most 4
    waves with a ragged or idle last wave; measured in benchmarks/results/gqa_expand_ab.json)."""
    if hk >= hq:
        return False
    sms = sm_count(device)
    if sms is None:
        return False
    return dispatch.kv_expansion(b * hk * cdiv(sk, launch.tile.block_n), hq // hk, sms)


def kv_split_of(launch: Launch, b: int, hq: int, hk: int, sk: int, device) -> int:
    """Programs per KV head's group in this call's dK/dV launch: the group size where
    :func:`splits_kv_groups` says so, else 1 (grouped)."""
    return hq // hk if splits_kv_groups(launch, b, hq, hk, sk, device) else 1


class PreparedCall:
    """The decisions of one call signature, made once: the dispatch's forward and backward
    launches for these shapes, dtype, mask layout and row span (``api.py`` keeps one per
    signature, docs/host-path.md). :meth:`forward` / :meth:`backward` do only the per-call
    work: the plans (cached per mask tensor), the outputs and the launches. The backward
    runs the launches chosen when the call was prepared (with the environment of then), with
    each GQA group split over programs where :func:`splits_kv_groups` said so for these
    shapes (:attr:`kv_split`)."""

    __slots__ = ("causal", "scale", "fwd_launch", "bwd_launches", "kv_split", "_runs")

    def __init__(self, q, k, startend_row_indices: Optional[torch.Tensor], causal: bool,
                 softmax_scale: float, row_span: Optional[float] = None):
        d = q.shape[-1]
        _check_head_dim(d)
        c = 0 if startend_row_indices is None else startend_row_indices.shape[-1]
        self.causal, self.scale = causal, softmax_scale
        self.fwd_launch = dispatch.choose(q.device, q.dtype, d, causal, c, row_span).forward
        self.bwd_launches = dispatch.choose(q.device, q.dtype, d, causal, c).backward
        b, _, hq, _ = q.shape
        _, sk, hk, _ = k.shape
        self.kv_split = kv_split_of(self.bwd_launches[0], b, hq, hk, sk, q.device)
        #: (pass, the plan's mask layout) -> the pass's prepared Gluon launch
        #: (:class:`~.gluon_fwd.GluonForward` / :class:`~.gluon_bwd.GluonDkdv`)
        self._runs = {}

    def _gluon_run(self, pass_: str, q, k, plan):
        """The prepared Gluon launch of ``pass_`` ("fwd" or "dkdv") for this plan's mask
        layout (``c``, ``ni``, ``hm``, ``mask_b_stride``: the kernel's scalars from the
        plan; the signature fixes everything else), made on its first use."""
        key = (pass_, plan.c, plan.ni, plan.hm, plan.mask_b_stride)
        run = self._runs.get(key)
        if run is None:
            if pass_ == "fwd":
                launch = self.fwd_launch
                run = GluonForward(q, k, plan, self.causal, self.scale, *_tile_args(launch.tile),
                                   pingpong=launch.kernel == "gluon_ws_pingpong")
            else:
                run = gluon_dkdv(self.bwd_launches[0], q, k, plan, self.causal, self.scale,
                                 kv_split=self.kv_split)
            self._runs[key] = run
        return run

    def forward(self, q, k, v, startend_row_indices):
        """``(out, lse)`` of these inputs (the signature's shapes)."""
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, sq, hq, _ = q.shape
        sk = k.shape[1]
        if sq == 0 or sk == 0:
            return torch.zeros_like(q), torch.full((b, hq, sq), float("-inf"), device=q.device)
        launch = self.fwd_launch
        plan = _plan(startend_row_indices, self.causal, sq, sk, launch, q.device)
        if launch.kernel == "tl":
            return run_forward(launch, q, k, v, startend_row_indices, self.causal, self.scale,
                               plan)
        return self._gluon_run("fwd", q, k, plan)(q, k, v, plan)

    def backward(self, dout, dlse, q, k, v, out, lse, startend_row_indices):
        """``(dq, dk, dv)``; ``dlse`` (or None) is folded into delta."""
        q, k, v, out = q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous()
        dout = dout.contiguous()
        b, sq, hq, d = q.shape
        sk = k.shape[1]
        if sq == 0 or sk == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if dout.dtype != q.dtype:
            dout = dout.to(q.dtype)
        causal, scale = self.causal, self.scale
        launches = self.bwd_launches
        first = launches[0]
        # the fused kernel's dQ accumulator is zeroed by the pre-pass (no memset launch)
        dq_t = (tl_kernels.dq_accumulator(b, sq, hq, d, q.device)
                if first.kernel == "gluon_fused" else None)
        delta, lse2 = tl_kernels.backward_prepass(out, dout, lse, dlse, dq_t)
        plan = _plan(startend_row_indices, causal, sq, sk, first, q.device)
        if first.kernel == "tl":
            dk, dv, _ = run_dkdv(first, q, k, v, dout, lse2, delta, causal, scale, plan,
                                 kv_split=self.kv_split)
        else:
            dk, dv = self._gluon_run("dkdv", q, k, plan)(q, k, v, dout, lse2, delta, plan, dq_t)
        if dq_t is not None:
            return tl_kernels.scale_dq(dq_accumulator_view(dq_t, sq), scale, q.dtype), dk, dv
        dq_launch = launches[1]
        plan = _plan(startend_row_indices, causal, sq, sk, dq_launch, q.device)
        dq = tl_kernels.launch_dq(q, k, v, dout, lse2, delta, causal, scale, dq_launch.tile,
                                  plan)
        return dq, dk, dv

    def backward_stage(self, state, q, k, v, startend_row_indices):
        """One stage of a staged backward (:func:`backward_stage`: q, k, v contiguous, the
        stage's scale checked): ``(dk, dv)``, its dQ added into ``state``."""
        b, sq, hq, d = q.shape
        sk = k.shape[1]
        if sq == 0 or sk == 0:
            return torch.zeros_like(k), torch.zeros_like(v)
        causal, scale = self.causal, self.scale
        first = self.bwd_launches[0]
        plan = _plan(startend_row_indices, causal, sq, sk, first, q.device)
        args = (q, k, v, state.dout, state.lse2, state.delta, causal, scale)
        if first.kernel == "gluon_fused":
            if state.dq_t is None:
                state.dq_t = new_dq_accumulator(b, sq, hq, d, q.device)
            return self._gluon_run("dkdv", q, k, plan)(*args[:6], plan, state.dq_t)
        if first.kernel == "tl":
            dk, dv, _ = run_dkdv(first, *args, plan, kv_split=self.kv_split)
        else:
            dk, dv = self._gluon_run("dkdv", q, k, plan)(*args[:6], plan)
        dq_launch = self.bwd_launches[1]
        plan = _plan(startend_row_indices, causal, sq, sk, dq_launch, q.device)
        dq = tl_kernels.launch_dq(*args, dq_launch.tile, plan)
        state.dq_split = staged.add_dq(state.dq_split, dq)
        return dk, dv


#: signature (:func:`_signature`) -> :class:`PreparedCall`: the backend functions below decide
#: once per signature, as ``api.py`` does for public calls (the context-parallel runtime calls
#: them directly, 6-10 times a layer with the same few shapes).
_PREPARED_CALLS: dict = {}
#: More signatures than this (varying sequence lengths): start over.
_MAX_PREPARED_CALLS = 1024
#: The environment the dispatch reads (its kernel mode), for the signature: C-level reads.
_dispatch_env = env_reader(dispatch.ENV_VAR)
_deterministic = torch.are_deterministic_algorithms_enabled


def _signature(q, k, cols, causal, softmax_scale, row_span) -> Optional[tuple]:
    """Everything a :class:`PreparedCall` decides from (shapes, dtype, device, the mask's
    columns, causal, scale, row span, the dispatch's mode and the deterministic flag), or
    None when the call must not be cached (a tile override is set)."""
    if dispatch.TILE_OVERRIDE:
        return None
    c = None if cols is None else cols.shape[-1]
    return (q.shape, k.shape, q.dtype, q.device, c, causal, softmax_scale, row_span,
            tuple(_dispatch_env()), _deterministic())


def prepare(q, k, startend_row_indices: Optional[torch.Tensor], causal: bool,
            softmax_scale: float, row_span: Optional[float] = None) -> PreparedCall:
    """The :class:`PreparedCall` of a signature, made on its first call and kept."""
    key = _signature(q, k, startend_row_indices, causal, softmax_scale, row_span)
    call = None if key is None else _PREPARED_CALLS.get(key)
    if call is None:
        call = PreparedCall(q, k, startend_row_indices, causal, softmax_scale, row_span)
        if key is not None:
            if len(_PREPARED_CALLS) >= _MAX_PREPARED_CALLS:
                _PREPARED_CALLS.clear()
            _PREPARED_CALLS[key] = call
    return call


def clear_prepared() -> None:
    """Forget every prepared signature (tests that mock the hardware or the dispatch)."""
    _PREPARED_CALLS.clear()


def forward(q, k, v, startend_row_indices: Optional[torch.Tensor], causal: bool,
            softmax_scale: float, row_span: Optional[float] = None):
    """Backend contract: masked attention forward, returns ``(out, lse)``. ``row_span``: the
    mask's mean row span where known (as ``api.kernel_row_span`` gives it: rounded down to its
    half octave), a key of the dispatch table."""
    return prepare(q, k, startend_row_indices, causal, softmax_scale, row_span).forward(
        q, k, v, startend_row_indices)


def backward(dout, dlse, q, k, v, out, lse, startend_row_indices: Optional[torch.Tensor],
             causal: bool, softmax_scale: float):
    """Backend contract: gradients ``(dq, dk, dv)``; ``dlse`` (or None) is folded into delta.
    The fused backward (the table's default on Hopper at D=64/128) adds dQ with atomics, so
    its rounding order varies run to run; the split one is bitwise reproducible."""
    return prepare(q, k, startend_row_indices, causal, softmax_scale).backward(
        dout, dlse, q, k, v, out, lse, startend_row_indices)


def preprocess(mask: Optional[torch.Tensor], causal: bool, seqlen_q: int, seqlen_k: int,
               head_dim: int, dtype: torch.dtype, backward: bool = True,
               row_span: Optional[float] = None) -> list[Plan]:
    """All plans one forward (+ backward) call builds: what the benchmark times as 'mask prep'
    (``row_span``: the mask's mean row span, as the forward gets it)."""
    c = 0 if mask is None else mask.shape[-1]
    device = mask.device if mask is not None else torch.device("cpu")
    choice = dispatch.choose(device, dtype, head_dim, causal, c, row_span)
    launches = (choice.forward,) + (dispatch.choose(device, dtype, head_dim, causal, c).backward
                                    if backward else ())
    return [make_plan(mask, causal, seqlen_q, seqlen_k, x.tile.block_m, x.tile.block_n,
                      PLAN_BY_KEY[x.pass_], device) for x in launches]


# -- staged backward (context parallelism: docs/cp-runtime.md, kernels/staged.py) ------------------


def _contig(*xs):
    return [x.contiguous() for x in xs]


@dataclass
class StagedBackward:
    """What every stage of one layer's backward shares: ``dout`` in q's dtype, the pre-pass
    results (``delta``, ``lse2``), the fused kernel's fp32 dQᵀ accumulator (zeroed by the
    pre-pass where the dispatch runs the fused backward, else made zeroed by the first fused
    stage) and the split stages' summed dQ."""

    q: torch.Tensor
    dout: torch.Tensor
    delta: Optional[torch.Tensor]
    lse2: Optional[torch.Tensor]
    dq_t: Optional[torch.Tensor] = None  # fused stages: unscaled dQᵀ [B, Hq, D, Sq_pad] fp32
    dq_split: Optional[torch.Tensor] = None  # split stages: sum of their (scaled) dQ
    scale: Optional[float] = None


def backward_prepare(q, out, dout, lse, dlse) -> StagedBackward:
    """Staged backward, once per layer: the pre-pass over all local query rows (``delta``
    with ``dlse`` folded in, ``lse2``), shared by every :func:`backward_stage` call. Where the
    dispatch runs the fused backward for q (the same for every stage: its row depends on the
    device, dtype and head dim only), the pre-pass also zeroes the stages' dQ accumulator, as
    the whole backward does (one launch less than a memset of its own)."""
    out, dout = _contig(out, dout.to(q.dtype))
    b, sq, hq, d = q.shape
    _check_head_dim(d)
    if sq == 0:
        return StagedBackward(q, dout, None, None)
    dq_t = tl_kernels.dq_accumulator(b, sq, hq, d, q.device) if backward_mode(q) == "fused" else None
    delta, lse2 = tl_kernels.backward_prepass(out, dout, lse, dlse, dq_t)
    return StagedBackward(q, dout, delta, lse2, dq_t=dq_t)


def backward_stage(state: StagedBackward, q, k, v, startend_row_indices: Optional[torch.Tensor],
                   causal: bool, softmax_scale: float):
    """Staged backward, once per stage: ``(dk, dv)`` of this stage's keys. Its dQ goes into
    ``state``: the fused kernel reduce-adds into the layer's one accumulator (no pre-pass, no
    memset, no scaling here); the split one's dQ kernel output is added to the stages' sum."""
    q, k, v = _contig(q, k, v)
    call = prepare(q, k, startend_row_indices, causal, softmax_scale)
    staged.check_stage_scale(state, softmax_scale)
    return call.backward_stage(state, q, k, v, startend_row_indices)


def backward_finish(state: StagedBackward) -> torch.Tensor:
    """Staged backward, once per layer: dQ in q's dtype (one scaling pass of the fused
    accumulator, or the split stages' sum converted)."""
    dq = None
    if state.dq_t is not None:
        dq = tl_kernels.scale_dq(dq_accumulator_view(state.dq_t, state.q.shape[1]), state.scale,
                                 state.q.dtype)
    if state.dq_split is not None:
        dq = state.dq_split if dq is None else staged.add_dq(dq, state.dq_split)
    if dq is None:  # no stage had keys
        return torch.zeros_like(state.q)
    return dq.to(state.q.dtype)
