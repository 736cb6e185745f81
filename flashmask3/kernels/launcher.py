"""One launch path for every Triton/Gluon kernel of the package, without ``JITFunction.run``
on the warm path.

``kernel[grid](*args, **kwargs)`` costs ~40 µs of host time a launch in Triton 3.6 (argument
binding, specialisation of every argument, a string cache key of the options, the global
check, launch metadata). :func:`launch` does the same launch with a fraction of that:

1. It computes a cheap key: the kernel, the current device, the keyword arguments
   (constexprs and launch options, as given) and, per positional argument, everything Triton
   specialises on (:func:`_arg_key`).
2. On a miss it launches through the normal path (``kernel[grid](...)``, which compiles if
   needed and returns the ``CompiledKernel``) and keeps that compiled kernel for the key.
3. On a hit it calls ``compiled.run(gx, gy, gz, stream, function, packed_metadata, None,
   None, None, *all_args)``, the call ``JITFunction.run`` ends with, on the CURRENT stream
   (CUDA-graph capture records that stream); with Triton's ``CudaLauncher`` (only on the
   versions in :data:`RAW_LAUNCH_TRITON`) it goes one step further and calls the C
   launcher inside it, with each host TMA descriptor expanded from a cache (the CUtensorMap
   of a descriptor template and base pointer is encoded once, not on every launch:
   :func:`_raw_launch_parts`) and each plain tensor passed as its data pointer (an int: the
   C launcher then skips its ``data_ptr()`` call and the driver's pointer query,
   ``cuPointerGetAttribute``; the library's tensors are CUDA device memory of one device, for
   which that query returns the same pointer).

Specialisation safety. Triton 3.6 specialises (``native_specialize_impl``) a tensor on its
dtype and on its data pointer being 16-byte aligned; an integer on its type (i32 / i64 /
u64 by range), on being 1 and on being divisible by 16 (the last two unless listed in
``do_not_specialize``); ``None`` as a constexpr; a bool / float on its type; a tensor
descriptor on its block shape, dtype and layout. :func:`_arg_key` keys on a superset of these
(the integer flags even for ``do_not_specialize`` arguments, the descriptor's base alignment
and shape/stride divisibility), so a hit never reuses a compile that Triton would not; an
argument of any other type is never cached (the normal path runs). Over-keying can only cost
an extra pass through the normal path, which returns the right compiled kernel.

The normal path runs instead whenever Triton's launch hooks are set (profilers, Proton), the
kernel has pre-run hooks, under ``TRITON_INTERPRET=1``, or with ``FLASHMASK3_FAST_LAUNCH=0``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._env import UNSET_OR_OFF, env_reader

try:
    import triton as _triton
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - triton is a dependency of the kernels
    _triton = _knobs = _driver = None
try:  # Triton's per-launch expansion of a host tensor descriptor (_raw_launch_parts)
    from triton.backends.nvidia.driver import make_tensordesc_arg as _tritons_tensordesc_arg
except ImportError:  # pragma: no cover - another Triton layout: compiled.run is called
    _tritons_tensordesc_arg = None


#: Whether Triton's ``make_tensordesc_arg`` takes a third, unused parameter (3.8 and 3.9).
_TENSORDESC_ARG3 = (_tritons_tensordesc_arg is not None
                    and _tritons_tensordesc_arg.__code__.co_argcount == 3)


def _make_tensordesc_arg(desc, meta) -> list:
    """Triton's ``make_tensordesc_arg(desc, meta)``: the CUtensorMap, shape and strides the C
    launcher gets for a host descriptor."""
    if _TENSORDESC_ARG3:
        return _tritons_tensordesc_arg(desc, meta, None)
    return _tritons_tensordesc_arg(desc, meta)

#: The Triton versions whose ``CudaLauncher`` the raw launch (:func:`_raw_launch_parts`) was
#: built for and checked on: a CPU test against Triton's own wrappers (every listed version)
#: and the GPU tests (3.6.0 on the H200 and H100; 3.7.1, 3.8.0, 3.9.0 carried to the GPU
#: machine; 3.7.0's launcher is 3.7.1's, Python and C). The C function's argument list is
#: Triton-internal: 3.6 takes the kernel arguments flat, 3.7-3.9 take the kernel metadata,
#: hooks and argument annotations and then the kernel arguments as one sequence; a class of
#: the same name on another version says nothing about it, so there every warm launch calls
#: ``compiled.run``, the call ``JITFunction.run`` ends with.
RAW_LAUNCH_TRITON = ("3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0")

#: Whether this process's Triton is one of them (decided at import).
RAW_LAUNCH_HERE = _triton is not None and _triton.__version__ in RAW_LAUNCH_TRITON

#: Compile options every compile of the package passes: FMA contraction on, the code every
#: kernel was checked with. Triton <= 3.9 has it on by default (3.9 warns at each compile that
#: the default is unset) and 3.10 turns it off: saying so keeps the kernels' code and numerics
#: the same on every version (compile_tools' offline compiles pass it too).
COMPILE_OPTIONS = {"enable_fp_fusion": True}

#: Set to 0 to launch every kernel through ``kernel[grid](...)`` (the A/B switch of the GPU test).
FAST_LAUNCH_ENV = "FLASHMASK3_FAST_LAUNCH"

#: (TRITON_INTERPRET, FLASHMASK3_FAST_LAUNCH) now: C-level reads (flashmask3/_env.py).
_read_env = env_reader("TRITON_INTERPRET", FAST_LAUNCH_ENV)

_I32 = 2 ** 31
_U64 = 2 ** 63


class _Entry:
    """A compiled kernel and how to lay out a call's arguments in its parameter order, and,
    where Triton's launcher has the known shape (:func:`_raw_launch_parts`), how to call its C
    entry point directly."""

    __slots__ = ("compiled", "kernel", "n_pos", "tail", "raw", "descs", "tensors")

    def __init__(self, compiled, kernel, args: tuple, kwargs: dict):
        self.compiled = compiled
        self.kernel = kernel  # held: the cache key uses id(kernel)
        n_pos = self.n_pos = len(args)
        # positions of the plain tensors (the same on every hit: the key holds each argument's
        # kind); the raw launch passes their data pointers (module docstring)
        self.tensors = tuple(i for i, x in enumerate(args) if type(x) is torch.Tensor)
        params = kernel.signature.parameters
        names = list(params)[n_pos:]
        # (name, default) of every parameter after the positional ones
        self.tail = [(name, params[name].default) for name in names]
        parts = _raw_launch_parts(compiled)
        self.raw, self.descs = parts if parts is not None else (None, ())


def _raw_launch_parts(compiled):
    """``(head, descs)`` for calling the C launcher of ``compiled`` past Triton's Python
    wrappers, or None where this module does not know their shape (then ``compiled.run`` is
    called). ``head`` = (C launch function, cooperative-grid flag, PDL flag, kernel metadata,
    argument annotations, signature bytes; the last two None for Triton 3.6's flat layout,
    :func:`_c_head`); ``descs`` = ((position, TMA metadata), ...) of the tensor-descriptor
    arguments, which ``CudaLauncher`` expands per launch (``make_tensordesc_arg``: a CUtensorMap
    encoded on the host, then the shape and strides) and :func:`_expand_descriptor` expands
    from a cache instead. Never used when the kernel needs scratch memory (allocated per
    launch by the wrapper) or Triton's sanitizer, nor on a Triton outside
    :data:`RAW_LAUNCH_TRITON`."""
    run = getattr(compiled, "run", None)
    if (not RAW_LAUNCH_HERE or type(run).__name__ != "CudaLauncher"
            or _tritons_tensordesc_arg is None):
        return None
    if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or getattr(run, "gsan_enabled", False)):
        return None
    fn = getattr(run, "launch", None)
    packed = hasattr(run, "arg_annotations")  # 3.7-3.9: the arguments go as one sequence
    head = (fn, run.launch_cooperative_grid, run.launch_pdl, compiled.packed_metadata,
            run.arg_annotations if packed else None, run.kernel_signature if packed else None)
    code = getattr(fn, "__code__", None)
    if code is None:  # no descriptor arguments: the C function itself
        return (head, ()) if callable(fn) else None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    inner, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    positions = _descriptor_positions(cells)
    if (fn.__name__ != "inner" or not callable(inner)
            or getattr(inner, "__code__", None) is not None or positions is None
            or not isinstance(metas, (list, tuple)) or len(metas) != len(positions)):
        return None
    return (inner,) + head[1:], tuple(zip(positions, metas))


def _descriptor_positions(cells: dict):
    """The sorted argument positions of the descriptors Triton's wrapper expands, from its
    closure (``tensordesc_indices``, a set, up to 3.7; ``relevant_paths``, {position: {}} for
    a top-level descriptor, from 3.8), or None for another shape (a descriptor in a tuple)."""
    indices = cells.get("tensordesc_indices")
    if isinstance(indices, set):
        return sorted(indices)
    paths = cells.get("relevant_paths")
    if isinstance(paths, dict) and all(type(k) is int and v == {} for k, v in paths.items()):
        return sorted(paths)
    return None


#: Arguments of the C launcher before the kernel's own in Triton 3.7-3.9 (:func:`_c_head`).
_PACKED_HEAD = 15


def _c_head(gx: int, gy: int, gz: int, stream, function, raw: tuple) -> list:
    """The C launcher's arguments before the kernel's, in the order ``CudaLauncher`` passes
    them (launch metadata, hooks and scratch buffers None: the raw path runs without hooks or
    scratch). Triton 3.6 (``raw[4]`` None): the kernel's arguments follow in the same list.
    3.7-3.9: :data:`_PACKED_HEAD` of them, then one sequence of the kernel's arguments."""
    if raw[4] is None:
        return [gx, gy, gz, stream, function, raw[1], raw[2], None, None, raw[3], None, None,
                None]
    return [gx, gy, gz, stream, function, raw[1], raw[2], raw[3], None, None, None, None, None,
            raw[4], raw[5]]


def _call_c_launcher(raw: tuple, final: list) -> None:
    """Call the C launcher ``raw[0]`` with ``final`` (:func:`_c_head`, then the kernel's
    arguments): as one flat list for Triton 3.6, the kernel's arguments as one sequence after
    :data:`_PACKED_HEAD` others for 3.7-3.9."""
    if raw[4] is None:
        raw[0](*final)
    else:
        raw[0](*final[:_PACKED_HEAD], final[_PACKED_HEAD:])


#: (id(entry), descriptor position, id(template), base pointer) -> the expanded arguments of a
#: tensor descriptor (``make_tensordesc_arg``'s list): the CUtensorMap depends only on the
#: template's dtype / shape / strides / block / layout and on the base pointer.
_TMA_ARGS: dict = {}
_MAX_TMA_ARGS = 4096


def _expand_descriptor(entry_id: int, pos: int, desc, meta) -> list:
    """``make_tensordesc_arg(desc, meta)`` from :data:`_TMA_ARGS` where ``desc`` came from
    :func:`descriptor` (its template identifies everything but the pointer)."""
    proto = getattr(desc, "_flashmask3_proto", None)
    if proto is None or meta is None:
        return _make_tensordesc_arg(desc, meta)
    key = (entry_id, pos, proto, desc.base.data_ptr())
    got = _TMA_ARGS.get(key)
    if got is None:
        if len(_TMA_ARGS) >= _MAX_TMA_ARGS:
            _TMA_ARGS.clear()
        got = _TMA_ARGS[key] = _make_tensordesc_arg(desc, meta)
    return got


_COMPILED: dict = {}


def fast_launch_enabled() -> bool:
    """Whether :func:`launch` may skip ``JITFunction.run`` (not under the interpreter, not
    with ``FLASHMASK3_FAST_LAUNCH=0``, not while Triton launch hooks are set: a hook is a
    ``HookChain`` in Triton 3.6, set when its ``calls`` list is not empty; a callable or None
    in older versions)."""
    interpret, fast = _read_env()
    if _knobs is None or interpret not in UNSET_OR_OFF or fast in ("0", b"0"):
        return False
    rt = _knobs.runtime
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    return not (getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side grid sizes (``triton.cdiv`` is a constexpr function in
    Triton 3.6: five Python calls a use)."""
    return -(-a // b)


def _arg_key(x) -> Any:
    """What Triton specialises on for one runtime argument (a superset), or raises TypeError
    for an argument type this module does not know (the caller then takes the normal path).
    Tensors, None and floats are keyed inline in :func:`launch` (the common cases)."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if x is None:
        return None
    if isinstance(x, bool):
        return ("i1",)
    if isinstance(x, int):
        rng = 0 if -_I32 <= x < _I32 else (1 if -_U64 <= x < _U64 else 2)
        return (rng, x == 1, x % 16 == 0)
    if isinstance(x, float):
        return ("fp32",)
    base = getattr(x, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(x, "block_shape"):  # a TMA descriptor
        return (type(x), base.dtype, base.data_ptr() % 16 == 0, tuple(x.block_shape),
                getattr(x, "layout", None), getattr(x, "padding", None),
                tuple(s % 16 == 0 for s in x.shape), tuple(s % 16 == 0 for s in x.strides))
    raise TypeError(type(x))


def _args_key(args: tuple) -> tuple:
    """:func:`_arg_key` of every argument, with plain tensors and small ints inline (one
    Python frame for the usual 15-25 arguments of a launch)."""
    key = []
    for x in args:
        t = type(x)
        if t is torch.Tensor:
            key.append((x.dtype, x.data_ptr() % 16 == 0))
        elif t is int and -_I32 <= x < _I32:
            key.append((0, x == 1, x % 16 == 0))
        elif t is float:
            key.append(1.5)  # the float marker (no int or tensor key equals it)
        elif x is None:
            key.append(None)
        else:
            spec = getattr(x, "_flashmask3_key", None)  # a descriptor from descriptor()
            if spec is not None:
                key.append((spec, x.base.data_ptr() % 16 == 0))
            else:
                key.append(_arg_key(x))
    return tuple(key)


def _launch_key(kernel, device, args: tuple, kwargs: dict) -> tuple:
    """The :data:`_COMPILED` key of a launch (raises TypeError for an argument this module
    does not key, or an unhashable keyword value)."""
    key = (id(kernel), device, len(args), _args_key(args), tuple(kwargs.items()))
    hash(key)
    return key


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` (same arguments, same result), through the cached
    compiled kernel when the call's key was seen before (module docstring)."""
    if not fast_launch_enabled() or kernel.pre_run_hooks:
        return kernel[grid](*args, **COMPILE_OPTIONS, **kwargs)
    device = _driver.active.get_current_device()
    try:
        key = _launch_key(kernel, device, args, kwargs)
        entry = _COMPILED.get(key)
    except TypeError:  # an unknown argument type, or an unhashable keyword value
        return kernel[grid](*args, **COMPILE_OPTIONS, **kwargs)
    if entry is None:
        compiled = kernel[grid](*args, **COMPILE_OPTIONS, **kwargs)
        if compiled is not None:
            _COMPILED[key] = _Entry(compiled, kernel, args, kwargs)
        return compiled
    full = list(args)
    if entry.tail:
        full.extend([kwargs.get(name, default) for name, default in entry.tail])
    c = entry.compiled
    stream = _driver.active.get_current_stream(device)
    gx = grid[0]
    gy = grid[1] if len(grid) > 1 else 1
    gz = grid[2] if len(grid) > 2 else 1
    raw = entry.raw
    if raw is None:
        c.run(gx, gy, gz, stream, c.function, c.packed_metadata, None, None, None, *full)
        return c
    for i in entry.tensors:  # a pointer as an int: no data_ptr() call or driver query in C
        full[i] = full[i].data_ptr()
    # the C launcher's own argument order (CudaLauncher.__call__ and its descriptor wrapper)
    final = _c_head(gx, gy, gz, stream, c.function, raw)
    prev = 0
    eid = id(entry)
    for pos, meta in entry.descs:
        final += full[prev:pos]
        final += _expand_descriptor(eid, pos, full[pos], meta)
        prev = pos + 1
    final += full[prev:]
    _call_c_launcher(raw, final)
    return c


#: A :class:`Bound` launch's per-call plain tensor argument (see :class:`Desc` for a
#: per-call TMA descriptor).
TENSOR = object()
#: Per-call descriptor expansions a :class:`Desc` slot keeps (one per base pointer seen).
_MAX_SLOT_EXPANSIONS = 64


class Desc:
    """A :class:`Bound` launch's per-call TMA descriptor argument: the call passes a tensor
    ``t`` and the kernel gets ``descriptor(cls, view(t), block_shape, layout)``. ``view``
    gives the 2-D tensor the kernel addresses (e.g. ``[B*S, H*D]`` of a contiguous
    ``[B, S, H, D]``); the bound call takes contiguous tensors of one shape (checked), so its
    descriptor depends only on the base pointer."""

    __slots__ = ("cls", "view", "block_shape", "layout")

    def __init__(self, cls, view, block_shape: list, layout=None):
        self.cls, self.view, self.block_shape, self.layout = cls, view, block_shape, layout

    def build(self, t: torch.Tensor):
        """The descriptor of ``t`` (:func:`descriptor`)."""
        return descriptor(self.cls, self.view(t), self.block_shape, self.layout)


class Bound:
    """``launch(kernel, grid, *args, **kwargs)`` with everything but the tensors fixed: a
    prepared call's launch (its shapes, dtypes, constexprs and scalars decided once), called
    with the per-call tensors in the order of the ``args`` marked :data:`TENSOR` or
    :class:`Desc`. The first call launches through :func:`launch` (which compiles); after it
    a call writes the tensors' pointers (and the cached expansion of each descriptor, per base
    pointer) into the C launcher's argument list built then and calls Triton's C launcher
    (module docstring): no key, no argument walk, no descriptor object.

    Safety: the fast path runs only where :func:`launch` would take its warm raw path (fast
    launch enabled, no pre-run hooks, the device of the first call current) and only with
    every tensor of the first call's dtype and 16-byte aligned, and each descriptor tensor
    contiguous and of the first call's shape: then Triton would pick the same compiled kernel
    (the key of the first call, :func:`_arg_key`) and build the same descriptors. Any other
    call takes :func:`launch`, unchanged."""

    __slots__ = ("kernel", "grid", "args", "kwargs", "slots", "fast")

    def __init__(self, kernel, grid: tuple, args: tuple, kwargs: dict):
        self.kernel, self.grid, self.kwargs = kernel, tuple(grid), kwargs
        self.args = tuple(args)
        self.slots = tuple(i for i, a in enumerate(self.args) if a is TENSOR or type(a) is Desc)
        # (device, entry, C argument list, per-slot parts) after a launch; False: never (_fast_parts)
        self.fast = None

    def __call__(self, *tensors):
        fast = self.fast
        if not fast or not fast_launch_enabled() or self.kernel.pre_run_hooks:
            return self._launch(tensors)
        device, entry, final, parts = fast
        if _driver.active.get_current_device() != device:
            return self._launch(tensors)
        final = final.copy()
        for (pos, dtype, shape, cache, meta, slot), t in zip(parts, tensors):
            ptr = t.data_ptr()
            if ptr & 15 or t.dtype is not dtype:
                return self._launch(tensors)
            if cache is None:
                final[pos] = ptr
                continue
            if t.shape != shape or not t.is_contiguous():
                return self._launch(tensors)
            exp = cache.get(ptr)
            if exp is None:
                if len(cache) >= _MAX_SLOT_EXPANSIONS:
                    cache.clear()
                exp = cache[ptr] = _make_tensordesc_arg(slot.build(t), meta)
            final[pos:pos + len(exp)] = exp
        final[3] = _driver.active.get_current_stream(device)
        _call_c_launcher(entry.raw, final)
        return entry.compiled

    def once(self, *tensors):
        """One launch with these tensors through :func:`launch` (a launch not called again:
        no fast-path parts are built)."""
        return launch(self.kernel, self.grid, *self._arguments(tensors), **self.kwargs)

    def _arguments(self, tensors) -> list:
        args = list(self.args)
        if len(tensors) != len(self.slots):
            raise TypeError(f"this bound launch of {getattr(self.kernel, '__name__', 'a kernel')}"
                            f" takes {len(self.slots)} tensors, got {len(tensors)}")
        for pos, t in zip(self.slots, tensors):
            slot = args[pos]
            args[pos] = t if slot is TENSOR else slot.build(t)
        return args

    def _launch(self, tensors):
        """The launch through :func:`launch`; after the first one, the fast path's parts."""
        args = self._arguments(tensors)
        compiled = launch(self.kernel, self.grid, *args, **self.kwargs)
        if self.fast is None and fast_launch_enabled() and not self.kernel.pre_run_hooks:
            self.fast = self._fast_parts(args, tensors)
        return compiled

    def _fast_parts(self, args: list, tensors: tuple):
        """``(device, entry, C argument list, slot parts)`` for the fast path, from a call
        that just launched with ``args``; False where it can never be built (no raw launcher
        in this Triton, an argument :func:`launch` does not key: not tried again, so such a
        Bound costs one :func:`launch` a call), None where this call's tensors prevent it (a
        misaligned or non-contiguous tensor: the next call tries again)."""
        device = _driver.active.get_current_device()
        try:
            entry = _COMPILED.get(_launch_key(self.kernel, device, tuple(args), self.kwargs))
        except TypeError:
            return False
        if entry is None:
            return None
        if entry.raw is None or len(args) != entry.n_pos:
            return False
        raw, c = entry.raw, entry.compiled
        full = args + [self.kwargs.get(name, default) for name, default in entry.tail]
        metas = dict(entry.descs)
        final = _c_head(self.grid[0], self.grid[1] if len(self.grid) > 1 else 1,
                        self.grid[2] if len(self.grid) > 2 else 1, None, c.function, raw)
        parts = []
        slots = dict(zip(self.slots, tensors))  # position -> the call's tensor
        for i, x in enumerate(full):
            slot = self.args[i] if i < len(self.args) else None
            if i in metas:
                if type(slot) is not Desc:
                    return False  # a fixed descriptor: not a bound launch's argument
                t = slots[i]
                if t.data_ptr() & 15 or x.base.data_ptr() & 15 or not t.is_contiguous():
                    return None
                exp = _make_tensordesc_arg(x, metas[i])
                parts.append((len(final), t.dtype, t.shape, {t.data_ptr(): exp}, metas[i],
                              slot))
                final += exp
            elif i in slots:
                if type(x) is not torch.Tensor or x.data_ptr() & 15:
                    return None
                parts.append((len(final), x.dtype, None, None, None, None))
                final.append(None)
            elif type(x) is torch.Tensor:
                return False  # a fixed tensor: not a bound launch's argument
            else:
                final.append(x)
        return device, entry, final, tuple(parts)


#: :func:`cached_bound`'s launches, by the caller's key.
_BOUND: dict = {}
_MAX_BOUND = 256


def cached_bound(key: tuple, build) -> Bound:
    """The :class:`Bound` launch kept under ``key`` (hashable: the kernel and everything that
    fixes its launch but the tensors), made from ``build()`` = ``(kernel, grid, args, kwargs)``
    on first use. For small kernels launched with the same configuration call after call (the
    backward's pre-pass and dQ scaling): the key is a few values instead of :func:`launch`'s
    walk over every argument."""
    bound = _BOUND.get(key)
    if bound is None:
        if len(_BOUND) >= _MAX_BOUND:
            _BOUND.clear()
        bound = _BOUND[key] = Bound(*build())
    return bound


#: (descriptor class, dtype, shape, strides, block shape, layout) -> a validated descriptor
#: whose base is gone (None): the template :func:`descriptor` copies (it holds no tensor).
_DESCRIPTORS: dict = {}


def descriptor(cls, tensor: torch.Tensor, block_shape: list, layout=None):
    """``cls.from_tensor(tensor, block_shape[, layout])`` (a Triton / Gluon host TMA
    descriptor), validated by Triton once per (dtype, shape, strides, block, layout) and
    copied from that template afterwards: the dataclass checks in ``__post_init__`` depend only
    on those and on the base's 16-byte alignment, which is checked here on every call."""
    # id(layout): the template holds the layout, so the id is not reused while it exists
    key = (cls, tensor.dtype, tuple(tensor.shape), tensor.stride(), tuple(block_shape),
           id(layout))
    proto = _DESCRIPTORS.get(key)
    if proto is None or tensor.data_ptr() % 16 != 0:
        d = (cls.from_tensor(tensor, block_shape) if layout is None
             else cls.from_tensor(tensor, block_shape, layout))
        proto = object.__new__(cls)
        proto.__dict__.update(d.__dict__)
        proto.base = None
        # what launch() keys this descriptor on (with its base's alignment, per call)
        spec = _arg_key(d)
        # without the base's alignment (keyed per call) and with id(layout) for the layout
        # (hashing a layout dataclass is a Python call; the template keeps the layout alive)
        spec = spec[:2] + spec[3:4] + (id(layout),) + spec[5:]
        d._flashmask3_key = proto._flashmask3_key = spec
        # the template's identity: with the base pointer, all a CUtensorMap depends on
        d._flashmask3_proto = proto._flashmask3_proto = id(proto)
        _DESCRIPTORS[key] = proto
        return d
    d = object.__new__(cls)
    d.__dict__.update(proto.__dict__)
    d.base = tensor
    return d


def clear_cache() -> None:
    """Forget every compiled kernel, bound launch and descriptor template kept here (tests)."""
    _COMPILED.clear()
    _BOUND.clear()
    _DESCRIPTORS.clear()
    _TMA_ARGS.clear()
