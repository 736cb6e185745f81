"""The public attention function, its argument checks and its ``torch.library`` registration.

``flashmask_attention`` follows the established FlashMask interface so users can switch:
q/k/v are ``[B, S, H, D]`` and the mask is the column-wise ``startend_row_indices`` tensor (or a
:class:`~flashmask3.masks.FlashMask`). The computation is a ``torch.library`` custom op with
fake (meta) implementations and an autograd formula, so it traces under ``torch.compile``
without graph breaks.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Union

import torch
from torch import Tensor

from ._env import env_reader
from .kernels import ENV_VAR as ENV_BACKEND
from .kernels import choose_backend, get_backend
from .kernels import loaded as _loaded_backends
from .kernels.dispatch import ENV_VAR as ENV_KERNELS
from .kernels.dispatch import TILE_OVERRIDE
from .masks.mask import FlashMask, row_span_of_bucket, row_span_of_columns, validate_startend_row_indices

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# -- the custom ops -------------------------------------------------------------------------


@torch.library.custom_op("flashmask3::attention_forward", mutates_args=())
def _attention_forward(
    q: Tensor, k: Tensor, v: Tensor, startend_row_indices: Optional[Tensor], causal: bool,
    softmax_scale: float, backend: str,
) -> tuple[Tensor, Tensor]:
    # the tile hint of a FlashMask's columns is an attribute of that tensor, not an argument:
    # a 0-d CPU tensor input fails inductor's CUDA graphs, a float would be specialised on
    return _attention_forward_impl(q, k, v, startend_row_indices, causal, softmax_scale, backend,
                                   row_span_of_columns(startend_row_indices))


def _attention_forward_impl(q, k, v, startend_row_indices, causal, softmax_scale, backend,
                            row_span: Optional[float]):
    """The backend's forward (the body of both the custom op and the eager Function)."""
    out, lse = get_backend(backend).forward(q, k, v, startend_row_indices, causal, softmax_scale,
                                            row_span=row_span)
    # the public contract is an fp32 LSE (a backend may return float64 for float64 inputs)
    return out.contiguous(), lse.to(torch.float32).contiguous()


@_attention_forward.register_fake
def _attention_forward_fake(q, k, v, startend_row_indices, causal, softmax_scale, backend):
    b, sq, hq, _ = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1])
    lse = q.new_empty(b, hq, sq, dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashmask3::attention_backward", mutates_args=())
def _attention_backward(
    dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    startend_row_indices: Optional[Tensor], causal: bool, softmax_scale: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = get_backend(backend).backward(
        dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale
    )
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_backward.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, startend_row_indices, causal,
                             softmax_scale, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, startend_row_indices, causal, softmax_scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, startend_row_indices)
    ctx.causal, ctx.softmax_scale, ctx.backend = causal, softmax_scale, backend


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, startend_row_indices = ctx.saved_tensors
    dq, dk, dv = _attention_backward(
        dout.contiguous(), dlse, q, k, v, out, lse, startend_row_indices, ctx.causal,
        ctx.softmax_scale, ctx.backend,
    )
    return dq, dk, dv, None, None, None, None


_attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _BackendCall:
    """A backend's forward and backward for one call signature, for backends without a
    ``prepare`` of their own (the torch path): the decisions are the arguments."""

    __slots__ = ("mod", "causal", "scale", "span")

    def __init__(self, mod, causal: bool, softmax_scale: float, row_span: Optional[float]):
        self.mod, self.causal, self.scale, self.span = mod, causal, softmax_scale, row_span

    def forward(self, q, k, v, cols):
        return self.mod.forward(q, k, v, cols, self.causal, self.scale, row_span=self.span)

    def backward(self, dout, dlse, q, k, v, out, lse, cols):
        return self.mod.backward(dout, dlse, q, k, v, out, lse, cols, self.causal, self.scale)


def _prepare_backend(backend: str, q, k, cols, causal: bool, softmax_scale: float,
                     row_span: Optional[float]):
    """The backend's prepared call for this signature (its ``prepare`` if it has one)."""
    mod = get_backend(backend)
    prepare = getattr(mod, "prepare", None)
    if prepare is None:
        return _BackendCall(mod, causal, softmax_scale, row_span)
    return prepare(q, k, cols, causal, softmax_scale, row_span)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the custom op, for eager calls on plain tensors: one
    ``autograd.Function`` frame instead of the custom op's dispatcher round trip. Traced calls
    (torch.compile, export, fake or dispatch modes, functorch transforms, tensor subclasses)
    take the custom op. ``call`` is the signature's prepared backend call
    (:func:`_prepare_backend`). Gradients are not materialised: an unused LSE (or output) gets
    None, not a zero tensor (no memset launch; the backends take ``dlse=None``)."""

    @staticmethod
    def forward(ctx, q, k, v, cols, call):
        out, lse = call.forward(q, k, v, cols)
        # the public contract: out contiguous, an fp32 LSE (float64 inputs give float64)
        out, lse = out.contiguous(), lse.to(torch.float32).contiguous()
        ctx.save_for_backward(q, k, v, out, lse, cols)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cols = ctx.saved_tensors
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.call.backward(dout.contiguous(), dlse, q, k, v, out, lse, cols)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), None, None


#: ``_EagerAttention.apply`` without ``Function.apply``'s Python wrapper (default-argument
#: binding, unused here, and functorch's dead-wrapper unwrapping, done by :func:`_run_eager`
#: with the same C function: 5-12 Python calls): the C entry point it ends with. Used only
#: with no functorch transform active (those calls take the custom op, :func:`_traced`).
_apply_eager = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerAttention)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


_grad_enabled = torch.is_grad_enabled


def _needs_autograd(q, k, v) -> bool:
    """Whether the call builds an autograd node: grad mode on and an input requiring grad."""
    return _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _run_eager(q, k, v, cols, call):
    """``_EagerAttention.apply(q, k, v, cols, call)`` as ``Function.apply`` runs it outside
    functorch transforms (dead functorch wrappers unwrapped), without its Python frames; with
    no gradient to compute (grad mode off, or no input requiring one) the backend's forward
    alone (no autograd node: what ``Function.apply`` would give, without its cost)."""
    q, k, v = _unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v)
    if cols is not None:
        cols = _unwrap_if_dead(cols)
    if not _needs_autograd(q, k, v):
        out, lse = call.forward(q, k, v, cols)
        return out.contiguous(), lse.to(torch.float32).contiguous()
    return _apply_eager(q, k, v, cols, call)


_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_deterministic = torch.are_deterministic_algorithms_enabled


def _traced(q: Tensor) -> bool:
    """Whether this call must go through the custom op: under torch.compile / export, inside a
    dispatch mode (FakeTensorMode, functionalization, ...), under a functorch transform
    (vmap, grad, ...), or on a tensor subclass."""
    return (torch.compiler.is_compiling() or type(q) is not Tensor
            or _dispatch_stack_len() > 0 or _functorch_active())


# -- argument checks ------------------------------------------------------------------------


def check_qkv(q, k, v) -> None:
    """Raise ``TypeError``/``ValueError`` unless q, k, v are valid ``[B, S, H, D]`` attention inputs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, sq, hq, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, seqlen_k, kv_heads], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"k batch size {k.shape[0]} does not match q batch size {b}")
    if k.shape[3] != d:
        raise ValueError(f"k head_dim {k.shape[3]} does not match q head_dim {d}")
    if v.shape[3] != d:
        raise ValueError(f"v head_dim {v.shape[3]} must equal the q/k head_dim {d}")
    hk = k.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the {hq} query heads must be a multiple of the {hk} key/value heads (GQA/MQA)")
    if sq == 0 or k.shape[1] == 0 or d == 0:
        raise ValueError(f"empty inputs are not supported: q {tuple(q.shape)}, k {tuple(k.shape)}")


def kernel_row_span(mask: FlashMask) -> Optional[float]:
    """The row span the kernels get for ``mask`` (as a number, for benchmarks and tests): the
    lower edge of its half-octave bucket (:attr:`FlashMask.row_span_bucket`), or None without
    one: the forward's tile hint."""
    bucket = mask.row_span_bucket
    return None if bucket is None else row_span_of_bucket(bucket)


#: Set to 1 to have :func:`flashmask_attention` read the values of column tensors on a GPU too
#: (min/max: one device sync per call): a debugging switch, read on every eager call.
CHECK_VALUES_ENV = "FLASHMASK3_CHECK_MASK_VALUES"


def reads_column_values(columns: Tensor) -> bool:
    """Whether the call reads the column values: on CPU tensors (free), or everywhere with
    ``FLASHMASK3_CHECK_MASK_VALUES=1``; never while tracing. Unchecked out-of-range values act
    as if clamped to ``[0, Sq]`` (the kernels only compare them with row indices)."""
    if torch.compiler.is_compiling():
        return False
    return columns.device.type == "cpu" or os.environ.get(CHECK_VALUES_ENV, "0") == "1"


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale applied to QKᵀ: ``1 / sqrt(head_dim)`` when None, else the given positive,
    finite number (TypeError / ValueError otherwise, naming the argument)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a positive number, got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def _window_columns(window_size, causal: bool, batch: int, sq: int, sk: int, device) -> Tensor:
    """Columns of a sliding-window mask aligned on the bottom-right diagonal (Sq != Sk ok).

    Query ``i`` sees keys ``[i + off - left, i + off + right]`` with ``off = Sk - Sq``; ``-1``
    means unlimited on that side; with ``causal`` the right side is the diagonal.
    """
    if isinstance(window_size, int) and not isinstance(window_size, bool):
        left, right = window_size, window_size
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) for w in window_size
    ):
        left, right = window_size
    else:
        raise TypeError(f"window_size must be an int or a (left, right) pair of ints, got {window_size!r}")
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0 (or -1 for unlimited), got {window_size!r}")
    off = sk - sq
    j = torch.arange(sk, device=device, dtype=torch.int64)
    lts = torch.full_like(j, sq) if left == -1 else (j - off + left + 1).clamp(0, sq)
    if causal:
        cols = lts.view(sk, 1)
    else:
        ute = torch.zeros_like(j) if right == -1 else (j - off - right).clamp(0, sq)
        cols = torch.stack([lts, ute], -1)
    return cols.to(torch.int32).view(1, 1, sk, -1).expand(batch, 1, sk, cols.shape[-1]).contiguous()


# -- the public function --------------------------------------------------------------------


def flashmask_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    startend_row_indices: Union[Tensor, FlashMask, None] = None,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size=None,
    return_softmax_lse: bool = False,
):
    """Scaled dot-product attention under a column-wise sparse (FlashMask) mask.

    Args:
        q: ``[B, Sq, Hq, D]``; k, v: ``[B, Sk, Hk, D]`` with ``Hq % Hk == 0`` (GQA/MQA).
        startend_row_indices: int32 ``[B, Hm, Sk, C]`` column mask (docs/masks.md), a
            :class:`~flashmask3.masks.FlashMask` (which brings its own ``causal`` and, from the
            constructors, its mean row span: the Triton forward's tile hint), or ``None``
            for full attention (plain bottom-right causal with ``causal=True``).
        causal: whether the causal diagonal applies (selects the meaning of the C columns).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        window_size: sliding window ``w`` or ``(left, right)`` (``-1`` = unlimited), used
            instead of ``startend_row_indices`` (giving both is an error).
        return_softmax_lse: also return the log-sum-exp ``[B, Hq, Sq]`` (float32, natural log,
            ``-inf`` on fully masked rows). It is differentiable too.

    Returns:
        ``out [B, Sq, Hq, D]`` (the dtype of q), or ``(out, lse)``. Fully masked rows give zeros
        and zero gradients.

    The backend is ``FLASHMASK3_BACKEND`` (``auto``: Triton on CUDA, else the torch path); the
    Triton kernels of each call come from one table (docs/kernels.md). Reproducibility: on
    Hopper at D=64 and D=128 (fp16/bf16) the default Triton backward is the fused kernel, whose
    dQ is summed with atomics, so it is **not** bitwise reproducible run to run; every other
    case, ``FLASHMASK3_KERNELS=split`` and ``torch.use_deterministic_algorithms(True)`` run the
    split backward, which is. The torch path is deterministic.
    """
    if window_size is None and not torch.compiler.is_compiling():
        key = _call_key(q, k, v, startend_row_indices, causal, softmax_scale)
        prepared = None if key is None else _PREPARED.get(key)
        if prepared is not None:
            out, lse = prepared.run(q, k, v, startend_row_indices)
            return (out, lse) if return_softmax_lse else out
    else:
        key = None
    return _checked_call(q, k, v, startend_row_indices, causal, softmax_scale, window_size,
                         return_softmax_lse, key)


# -- prepared calls: the decisions of a call signature, made once ---------------------------


#: The environment variables a call's checks and decisions read (the backend, the kernels'
#: mode, the column-value switch, the interpreter): part of every signature.
_ENV_NAMES = (ENV_BACKEND, ENV_KERNELS, CHECK_VALUES_ENV, "TRITON_INTERPRET")
#: The values of :data:`_ENV_NAMES` now (an iterator; C-level reads, flashmask3/_env.py).
_env_state = env_reader(*_ENV_NAMES)

#: signature (:func:`_call_key`) -> :class:`_Prepared`, filled by calls that passed every check.
_PREPARED: dict = {}
#: More signatures than this (a shape per call, e.g. varying sequence lengths): start over.
_MAX_PREPARED = 1024


def _call_key(q, k, v, mask, causal, softmax_scale) -> Optional[tuple]:
    """The signature of an eager call: everything :func:`_checked_call`'s checks and
    decisions read (types, shapes, strides, dtypes, devices, the mask's form and layout, a
    ``FlashMask``'s ``causal``/``seqlen_q``/row-span bucket, ``causal``, ``softmax_scale``
    with their types, so that ``1`` and ``True`` differ, the environment, the deterministic
    flag), or None when the call must take the full path (not plain tensors, a
    dispatch mode or functorch transform active, a tile override, an unhashable argument)."""
    if (type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor
            or _dispatch_stack_len() or _functorch_active() or TILE_OVERRIDE):
        return None
    tm = type(mask)
    if mask is None:
        mk = None
    elif tm is Tensor:
        mk = (mask.shape, mask.stride(), mask.dtype, mask.device)
    elif tm is FlashMask:
        cols = mask.startend_row_indices
        if type(cols) is not Tensor:
            return None
        mk = (mask.causal, mask.seqlen_q, mask.row_span_bucket, cols.shape, cols.stride(),
              cols.dtype, cols.device)
    else:
        return None
    key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
           v.shape, v.stride(), v.dtype, v.device, tm, mk, type(causal), causal,
           type(softmax_scale), softmax_scale, tuple(_env_state()), _deterministic())
    try:
        hash(key)
    except TypeError:  # e.g. softmax_scale a list: the full path raises the TypeError
        return None
    return key


class _Prepared:
    """What a call signature runs after its checks: the prepared backend call, and whether
    the columns' values are read on every call (CPU raw columns, or the debug switch)."""

    __slots__ = ("call", "flashmask", "value_check")

    def __init__(self, call, flashmask: bool, value_check: Optional[dict]):
        self.call, self.flashmask, self.value_check = call, flashmask, value_check

    def run(self, q, k, v, mask):
        """(out, lse) of a call of this signature."""
        cols = mask.startend_row_indices if self.flashmask else mask
        if cols is not None:
            if self.value_check is not None:
                validate_startend_row_indices(cols, **self.value_check)
            cols = cols.contiguous()
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        return _run_eager(q, k, v, cols, self.call)


def clear_prepared() -> None:
    """Forget every prepared call signature, here and in the backends that keep their own
    (tests that mock the hardware or the dispatch)."""
    _PREPARED.clear()
    for mod in _loaded_backends():
        getattr(mod, "clear_prepared", lambda: None)()


def _checked_call(q, k, v, startend_row_indices, causal, softmax_scale, window_size,
                  return_softmax_lse, key):
    """The full path of :func:`flashmask_attention`: every check, the decisions, the call;
    when ``key`` is given (an eager signature), the decisions are kept under it."""
    check_qkv(q, k, v)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_values = True
    traced = _traced(q)
    row_span = None  # (eager calls only: under tracing, reading it would guard on its value)
    is_flashmask = isinstance(startend_row_indices, FlashMask)
    if is_flashmask:
        mask = startend_row_indices
        if causal and not mask.causal:
            raise ValueError("causal=True conflicts with the given FlashMask, which has causal=False")
        if mask.seqlen_q != sq:
            raise ValueError(f"the FlashMask was built for seqlen_q={mask.seqlen_q}, but q has {sq} rows "
                             f"(q is [batch, seqlen, heads, head_dim]; got shape {tuple(q.shape)})")
        causal, startend_row_indices = mask.causal, mask.startend_row_indices
        check_values = False  # validated when the mask was built
        if not traced:
            row_span = kernel_row_span(mask)
    if window_size is not None:
        if startend_row_indices is not None:
            raise ValueError("pass either window_size or startend_row_indices, not both")
        startend_row_indices = _window_columns(window_size, causal, b, sq, sk, q.device)
        check_values = False
    value_check = None  # the validation a prepared call repeats: only the values' part
    if startend_row_indices is not None:
        checks = dict(causal=causal, batch_size=b, seqlen_q=sq, seqlen_k=sk, num_heads=hq,
                      device=q.device,
                      check_values=check_values and reads_column_values(startend_row_indices))
        validate_startend_row_indices(startend_row_indices, **checks)
        if checks["check_values"]:
            value_check = checks
        startend_row_indices = startend_row_indices.contiguous()
    softmax_scale = resolve_softmax_scale(softmax_scale, d)
    backend = choose_backend(q)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if traced:
        out, lse = _attention_forward(q, k, v, startend_row_indices, causal, softmax_scale,
                                      backend)
    else:
        call = _prepare_backend(backend, q, k, startend_row_indices, causal, softmax_scale,
                                row_span)
        out, lse = _run_eager(q, k, v, startend_row_indices, call)
        if key is not None:
            _remember(key, call, is_flashmask, value_check)
    return (out, lse) if return_softmax_lse else out


def _remember(key, call, is_flashmask: bool, value_check: Optional[dict]) -> None:
    if len(_PREPARED) >= _MAX_PREPARED:
        _PREPARED.clear()
    _PREPARED[key] = _Prepared(call, is_flashmask, value_check)
