"""The context-parallel runtime's own device work, read off the real runtime.

:func:`record_layer` runs one rank's layer (forward + backward) through
``flashmask3.distributed.run_layer`` on the ``meta`` device: the real program of the real plan,
the real schedule, no data and no GPU. A recording backend stands in for the attention kernels
and the runtime's small kernels (the one-launch merge, key gather and gradient sum, as a CUDA
run takes them), and a ``TorchDispatchMode`` records every aten operator that launches a
kernel, with the bytes it moves. The result is the op sequence of that rank's layer, in issue
order, each op with its kind and bytes: what :func:`ops_seconds` turns into GPU time
(bytes at the measured bandwidth of the op's rate class plus a launch floor), so the model's
runtime term follows every change to the runtime without a second implementation of it here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .params import RUNTIME_BW_FIELDS

#: Kinds of :class:`Op`: a backend attention function (its GPU time is the attention cost
#: model's), one of the runtime's small kernels (merge, key gather, gradient sum), an aten
#: operator of the runtime, a copy of the emulated exchange (what NCCL does in a real run).
KINDS = ("attention", "kernel", "torch", "emulated")

#: Operators that only allocate or change metadata (no kernel): flashmask3.distributed.launches.
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "set_", "resize_", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
         "is_nonzero", "_to_copy_meta"}
#: Operators that write their output without reading a source of its size.
_WRITE_ONLY = {"fill_", "zero_", "zeros", "zeros_like", "new_zeros", "full", "full_like", "ones_like",
               "new_full", "new_ones"}


#: An attention op's stage when it is the merged backward call (:attr:`Op.stage`).
MERGED = "merged"


@dataclass(frozen=True)
class Op:
    """One device operation of a rank's layer: ``kind`` (:data:`KINDS`), ``name``, the bytes it
    reads and writes, and for attention calls which stage (:data:`MERGED`: the merged backward
    call) and function (``forward``, ``backward_prepare``, ``backward_stage``, ``backward_finish``,
    ``backward``)."""

    kind: str
    name: str
    nbytes: int = 0
    stage: object = None
    pass_: str = ""
    rate: str = "copy"


#: Rate classes of the non-attention ops: the kernels that implement them reach different
#: bandwidths, so the model gives each class its own (fitted on profiles, validate.py):
#: ``copy``  contiguous copies and gathers (torch's vectorized gather, clone, the runtime's Triton
#:           merge / key-gather / pack / gradient-sum kernels);
#: ``small_index``  torch's ``index_select`` of at most :data:`SMALL_INDEX_ROWS` rows;
#: ``scatter``  indexed writes and strided copies (``index_copy_``, ``index_add_``, ``stack``);
#: ``fill``  write-only ops (zeros, fills).
#: (The cluster's bandwidth field of each: params.RUNTIME_BW_FIELDS, which defines them.)
RATE_CLASSES = tuple(RUNTIME_BW_FIELDS)

#: torch's CUDA ``index_select`` copies with ``indexSelectSmallIndex`` when it selects at most this
#: many rows (``aten/src/ATen/native/cuda/Indexing.cu``, ``index_select_out_cuda_impl``), else with
#: the vectorized gather: with the CP runtime's rows (0.5-4 MB of wire per chunk) about a quarter of
#: the gather's bandwidth.
SMALL_INDEX_ROWS = 16

_SCATTER = {"index_copy_", "index_copy", "index_add_", "index_add", "stack"}


def rate_class(name: str, index_rows: int = 0) -> str:
    """The :data:`RATE_CLASSES` entry of an aten operator (``index_rows``: the rows an
    ``index_select`` picks)."""
    if name == "index_select" and index_rows <= SMALL_INDEX_ROWS:
        return "small_index"
    if name in _SCATTER:
        return "scatter"
    return "fill" if name in _WRITE_ONLY else "copy"


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _moved_bytes(name: str, args, out) -> int:
    """Bytes an aten operator reads and writes: its output written (and read once for a copy
    of the same size), in-place index adds read their source and the touched rows twice."""
    if name in ("index_add_", "index_add"):
        return 3 * _nbytes(args[3])
    if name in ("index_copy_", "index_copy"):
        return 2 * _nbytes(args[3])
    outs = out if isinstance(out, (tuple, list)) else (out,)
    written = sum(_nbytes(o) for o in outs)
    return written if name in _WRITE_ONLY else 2 * written


def _fast_alloc(name: str, args, kwargs) -> "torch.Tensor | None":
    """The output of an allocation op (``empty_like`` giving a contiguous tensor, ``new_empty``
    on its tensor's device, unpinned as torch passes them) made by the C++ factory: the meta
    device's ``empty_like`` runs torch's Python reference, ~15x slower (63 vs 4 us a call), and
    a recorded layer allocates dozens of outputs. None for any other op or argument, which then
    runs as called."""
    if kwargs.get("pin_memory"):
        return None
    kw = set(kwargs) - {"pin_memory"}
    if name == "empty_like" and len(args) == 1 and kw <= {"dtype", "memory_format"}:
        x, fmt = args[0], kwargs.get("memory_format", torch.preserve_format)
        if fmt is torch.contiguous_format or (fmt is torch.preserve_format and x.is_contiguous()):
            return torch.empty(x.shape, dtype=kwargs.get("dtype") or x.dtype, device=x.device)
        return None
    if name == "new_empty" and len(args) == 2 and kw <= {"dtype"}:
        return torch.empty(args[1], dtype=kwargs.get("dtype") or args[0].dtype, device=args[0].device)
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.pass_ = "fwd"
        self._pause = 0
        self._kind = "torch"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = _fast_alloc(name, args, kwargs or {})
        if out is None:
            out = func(*args, **(kwargs or {}))
        if not self._pause and not func.is_view and name not in _FREE:
            rows = args[2].numel() if name == "index_select" else 0
            self.ops.append(Op(self._kind, name, _moved_bytes(name, args, out), pass_=self.pass_,
                               rate=rate_class(name, rows)))
        return out

    @contextlib.contextmanager
    def paused(self):
        self._pause += 1
        try:
            yield
        finally:
            self._pause -= 1

    @contextlib.contextmanager
    def kind(self, kind: str):
        saved, self._kind = self._kind, kind
        try:
            yield
        finally:
            self._kind = saved


class _Backend:
    """Attention functions and small kernels of a CUDA backend, as meta tensors of the right
    shapes, each recorded as one :class:`Op`."""

    def __init__(self, rec: _Recorder, prog):
        self.rec, self.prog = rec, prog

    def _stage(self, cols) -> object:
        prog = self.prog
        for s, c in enumerate(prog.stage_cols):
            if c is cols:
                return s
        if prog.merged is not None and prog.merged.cols is cols:
            return MERGED
        return None

    def _attention(self, name, cols=None):
        self.rec.ops.append(Op("attention", name, stage=self._stage(cols) if cols is not None else None,
                               pass_=self.rec.pass_))

    def forward(self, q, k, v, cols, causal, scale):
        self._attention("forward", cols)
        with self.rec.paused():
            b, s, h, _ = q.shape
            return q.new_empty(b, s, h, v.shape[-1]), q.new_empty(b, h, s, dtype=torch.float32)

    def backward_prepare(self, q, out, dout, lse, dlse):
        self._attention("backward_prepare")
        return q

    def backward_stage(self, state, q, k, v, cols, causal, scale):
        self._attention("backward_stage", cols)
        with self.rec.paused():
            return torch.empty_like(k), torch.empty_like(v)

    def backward_finish(self, state):
        self._attention("backward_finish")
        with self.rec.paused():
            return torch.empty_like(state)

    def backward(self, dout, dlse, q, k, v, out, lse, cols, causal, scale):
        self._attention("backward", cols)
        with self.rec.paused():
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def merge_usable(self, q):
        return True

    def merge_stages(self, outs, lses, dtype):
        moved = sum(_nbytes(o) + _nbytes(l) for o, l in zip(outs, lses)) + _nbytes(outs[0]) + _nbytes(lses[0])
        self.rec.ops.append(Op("kernel", "merge", moved, pass_=self.rec.pass_))
        with self.rec.paused():
            return torch.empty_like(outs[0], dtype=dtype), torch.empty_like(lses[0])

    def wire_usable(self, t):
        return True

    def gather_keys(self, src, rows, dst, pos):
        row = _nbytes(src[0]) if src.shape[0] else 0
        self.rec.ops.append(Op("kernel", "gather_keys", 2 * rows.numel() * row, pass_=self.rec.pass_))

    def pack_wire(self, k, v, rows, out):
        self.rec.ops.append(Op("kernel", "pack_wire", 2 * _nbytes(out), pass_=self.rec.pass_))

    def returns_usable(self, k):
        return True

    def sum_wire_rows(self, own, own_index, returned, returned_index, n_out, chunk, k):
        out = k.new_empty(n_out, 2, k.shape[0], chunk, k.shape[2], k.shape[3])
        moved = _nbytes(own) + _nbytes(returned) + _nbytes(out)
        self.rec.ops.append(Op("kernel", "sum_wire_rows", moved, pass_=self.rec.pass_))
        return out

    def add_returns(self, own, own_index, returned, returned_index, n_own, chunk, k):
        written = 2 * k.shape[0] * n_own * chunk * k.shape[2] * k.shape[3] * k.element_size()  # dK and dV
        moved = _nbytes(own) + _nbytes(returned) + written
        self.rec.ops.append(Op("kernel", "add_returns", moved, pass_=self.rec.pass_))
        with self.rec.paused():
            b, _, h, d = k.shape
            dk = k.new_empty(b, n_own * chunk, h, d)
            return dk, torch.empty_like(dk)


def _exchange(rec: _Recorder, wire, p, rank, copies: bool = True):
    from flashmask3.distributed import EmulatedExchange

    class Exchange(EmulatedExchange):
        """The emulated exchange, its copies recorded as ``emulated`` ops. A real exchange
        (``comm.DistExchange``) sends views of what the runtime packed: the runtime's own device
        work is the same under both."""

        def start(self, *a):
            with rec.kind("emulated"):
                return super().start(*a)

        def all_gather(self, *a):
            with rec.kind("emulated"):
                return super().all_gather(*a)

        def reduce_scatter(self, *a):
            with rec.kind("emulated"):
                return super().reduce_scatter(*a)

    return Exchange(wire, p.cp_size, rank, plan=p, copy=copies)


def record_layer(p, rank: int, comm: str, backward_calls: str, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, keep_kv: bool = True, hide: tuple = (),
                 emulated: bool = True) -> list[Op]:
    """The device ops of rank ``rank``'s layer (forward then backward, issue order) under plan
    ``p`` (a :class:`flashmask3.distributed.CPPlan`), ``comm`` and ``backward_calls``, B=1;
    ``hide``: backend functions the runtime does without (an A/B layout of cp_single_gpu.py);
    ``emulated=False``: the emulated exchange moves nothing (no ``emulated`` ops; the runtime's
    own ops are the same: what :func:`rank_device_work` keeps, a third faster)."""
    from flashmask3.distributed import prepare_rank, run_layer
    from flashmask3.distributed.runtime import _wire_shape

    meta = torch.device("meta")
    prog = prepare_rank(p, rank, meta, comm, backward_calls)
    n, s = p.local_seqlen, p.seqlen
    rec = _Recorder()
    backend = _Backend(rec, prog)
    if hide:
        from benchmarks.cp_single_gpu import Without

        backend = Without(backend, hide)
    q = torch.empty(1, n, heads, head_dim, dtype=dtype, device=meta, requires_grad=True)
    k, v = (torch.empty(1, n, kv_heads, head_dim, dtype=dtype, device=meta, requires_grad=True)
            for _ in range(2))
    wire = torch.empty(_wire_shape(s // p.chunk_size, k, p.chunk_size), dtype=dtype, device=meta)  # to_wire's
    ex = _exchange(rec, wire, p, rank, emulated)
    with rec:
        out, _ = run_layer(q, k, v, prog, ex, head_dim ** -0.5, backend=backend, keep_kv=keep_kv)
        rec.pass_ = "bwd"
        with rec.paused():
            do = torch.empty_like(out)
        out.backward(do)
    return rec.ops


def op_seconds(op: Op, bandwidths: dict, launch_floor: float) -> float:
    """GPU seconds of one non-attention op: its bytes at the bandwidth of its rate class
    (``bandwidths``: :data:`RATE_CLASSES` -> bytes/s) plus ``launch_floor``."""
    return op.nbytes / bandwidths[op.rate] + launch_floor


def rate_seconds(by_rate: dict, launches: int, bandwidths: dict, launch_floor: float) -> float:
    """GPU seconds of ops already summed per rate class (:func:`bytes_by_rate`) and counted:
    each class's bytes at its bandwidth plus ``launch_floor`` a launch."""
    return sum(n / bandwidths[c] for c, n in by_rate.items()) + launches * launch_floor


def ops_seconds(ops: list[Op], bandwidths: dict, launch_floor: float,
                kinds=("kernel", "torch", "emulated")) -> float:
    """GPU seconds of the ops of ``kinds`` (:func:`op_seconds` each)."""
    return sum(op_seconds(o, bandwidths, launch_floor) for o in ops if o.kind in kinds)


def bytes_by_rate(ops) -> dict:
    """Bytes the ops (any iterable of :class:`Op`) move per :data:`RATE_CLASSES` entry."""
    out = dict.fromkeys(RATE_CLASSES, 0)
    for o in ops:
        out[o.rate] += o.nbytes
    return out


#: Bump when :func:`rank_device_work`'s cached content changes meaning.
DEVICE_CACHE_VERSION = 4  # 4: one pack per pass, the exchange sends views (session 33)


def _runtime_code_digest() -> str:
    """Digest of the runtime's source, so cached op bytes never outlive a runtime change."""
    import hashlib
    import os

    import flashmask3.distributed as d

    h = hashlib.sha256()
    base = os.path.dirname(d.__file__)
    for name in ("program.py", "runtime.py", "attention.py", "comm.py"):
        with open(os.path.join(base, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def rank_device_work(doc_lens, cp: int, balance: str, nodes: int, comm: str, backward_calls: str,
                     heads: int, kv_heads: int, head_dim: int, cache: bool = True) -> list[tuple]:
    """Per rank of the plan of a causal document mask of ``doc_lens``: ``(forward bytes by rate
    class, forward launches, backward bytes by rate class, backward launches)`` of the runtime's
    own device work (its torch ops and small kernels, the packing of outgoing rows included; not
    the attention calls, not the emulated exchange's copies, which a real run leaves to
    NCCL), recorded by :func:`record_layer` (:func:`bytes_by_rate`). Cached on disk next to the
    plan views, keyed on the inputs and the runtime's and exchange's source."""
    import hashlib

    from .layout import _key, cached_pickle, document_plan

    key = hashlib.sha256(repr((DEVICE_CACHE_VERSION, _key(doc_lens, True, int(sum(doc_lens)), cp, balance, nodes),
                               comm, backward_calls, heads, kv_heads, head_dim,
                               _runtime_code_digest())).encode()).hexdigest()[:24]

    def build() -> list:
        p = document_plan(doc_lens, cp, balance, nodes)[0]
        out = []
        for r in range(cp):
            ops = [o for o in record_layer(p, r, comm, backward_calls, heads, kv_heads, head_dim, emulated=False)
                   if o.kind in ("kernel", "torch")]
            f = [o for o in ops if o.pass_ == "fwd"]
            b = [o for o in ops if o.pass_ == "bwd"]
            out.append((bytes_by_rate(f), len(f), bytes_by_rate(b), len(b)))
        return out

    return cached_pickle("ops-" + key + ".pkl", build, cache)


__all__ = ["KINDS", "MERGED", "Op", "RATE_CLASSES", "SMALL_INDEX_ROWS", "rate_class", "record_layer",
           "op_seconds", "ops_seconds", "rate_seconds", "bytes_by_rate", "rank_device_work"]
