"""The launch path past ``JITFunction.run`` (flashmask3/kernels/launcher.py).

CPU tests drive :func:`launcher.launch` with a stand-in kernel (the interface it uses: a
signature, pre-run hooks, ``kernel[grid](...)`` returning a compiled kernel with ``run``);
the gpu-marked tests compare the fast path with Triton's own on the real kernels of the
H200 (run by benchmarks/gpu/host-path.sh).
"""

import inspect
import os
from unittest import mock

import pytest
import torch

from flashmask3.kernels import launcher


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, calls):
        self.calls = calls

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, exit_, *args):
        self.calls.append(("fast", (gx, gy, gz), stream, args, (metadata, enter, exit_)))


class _Kernel:
    """A stand-in JITFunction: ``kernel[grid](*args, **kw)`` is the normal path."""

    def __init__(self):
        def body(x_ptr, n, scale, y_ptr=None, BLOCK: int = 16, FLAG: bool = False):
            pass

        self.signature = inspect.signature(body)
        self.pre_run_hooks = []
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("slow", grid, args, kwargs))
            return self.compiled_kernel()
        return run

    def compiled_kernel(self):
        """What the normal path returns: a new compiled kernel recording into ``calls``."""
        return _Compiled(self.calls)


class _Driver:
    class active:  # noqa: N801
        get_current_device = staticmethod(lambda: 0)
        stream = 77
        get_current_stream = staticmethod(lambda device: _Driver.active.stream)


@pytest.fixture
def fast(monkeypatch):
    launcher.clear_cache()
    monkeypatch.setattr(launcher, "_driver", _Driver)
    monkeypatch.setattr(launcher, "fast_launch_enabled", lambda: True)
    yield
    launcher.clear_cache()


def test_second_launch_skips_the_normal_path_with_all_arguments_in_order(fast):
    k = _Kernel()
    x = torch.randn(64)
    n = 1000 + int(torch.randint(0, 7, ()).item()) * 16
    launcher.launch(k, (3, 2), x, n, 0.5, BLOCK=32, num_warps=4)
    _Driver.active.stream = 91
    launcher.launch(k, (3, 2), x, n, 0.5, BLOCK=32, num_warps=4)
    assert [c[0] for c in k.calls] == ["slow", "fast"]
    kind, grid, stream, args, hooks = k.calls[1]
    # every parameter in signature order, defaults filled, launch options dropped
    assert grid == (3, 2, 1) and stream == 91 and hooks == (None, None, None)
    assert args[0] is x and args[1:] == (n, 0.5, None, 32, False)


@pytest.mark.parametrize("change", [
    "int_is_one", "int_div16", "int64", "misaligned", "dtype", "none_to_tensor", "constexpr",
    "option"])
def test_anything_triton_specialises_on_takes_the_normal_path_again(fast, change):
    """A change of any property Triton specialises on misses the cache (and compiles or finds
    the right kernel through ``kernel[grid]``)."""
    k = _Kernel()
    base = torch.randn(80)
    x, n, y, kw = base[:64], 1001, None, dict(BLOCK=32, num_warps=4)
    launcher.launch(k, (1,), x, n, 0.5, y, **kw)
    if change == "int_is_one":
        n = 1
    elif change == "int_div16":
        n = 1008
    elif change == "int64":
        n = 2 ** 40 + 1
    elif change == "misaligned":
        x = base[1:65]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        x = x.double()
    elif change == "none_to_tensor":
        y = torch.randn(4)
    elif change == "constexpr":
        kw["BLOCK"] = 64
    elif change == "option":
        kw["num_warps"] = 8
    launcher.launch(k, (1,), x, n, 0.5, y, **kw)
    assert [c[0] for c in k.calls] == ["slow", "slow"]
    launcher.launch(k, (1,), x, n, 0.5, y, **kw)  # and that key is cached in turn
    assert k.calls[-1][0] == "fast"


def test_hooks_interpreter_and_switch_keep_the_normal_path(monkeypatch):
    """Triton launch hooks (profilers), pre-run hooks, TRITON_INTERPRET and
    FLASHMASK3_FAST_LAUNCH=0 all launch through ``kernel[grid]`` every time."""
    launcher.clear_cache()
    monkeypatch.setattr(launcher, "_driver", _Driver)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(launcher.FAST_LAUNCH_ENV, raising=False)
    assert launcher.fast_launch_enabled()
    hook = launcher._knobs.runtime.launch_enter_hook
    hook.add(print)
    try:
        assert not launcher.fast_launch_enabled()
    finally:
        hook.remove(print)
    monkeypatch.setenv(launcher.FAST_LAUNCH_ENV, "0")
    assert not launcher.fast_launch_enabled()
    monkeypatch.delenv(launcher.FAST_LAUNCH_ENV)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launcher.fast_launch_enabled()
    monkeypatch.delenv("TRITON_INTERPRET")
    k = _Kernel()
    k.pre_run_hooks.append(lambda *a, **kw: None)
    x = torch.randn(16)
    for _ in range(2):
        launcher.launch(k, (1,), x, 5, 1.0)
    assert [c[0] for c in k.calls] == ["slow", "slow"]
    launcher.clear_cache()


def test_unknown_argument_types_are_never_cached(fast):
    k = _Kernel()
    for _ in range(2):
        launcher.launch(k, (1,), torch.randn(4), [1, 2], 1.0)
    assert [c[0] for c in k.calls] == ["slow", "slow"]


def test_descriptor_templates_copy_triton_descriptors_with_the_new_base():
    """descriptor() equals Triton's own from_tensor field by field, for a new tensor of the
    same shape, and holds no tensor in its template."""
    td = pytest.importorskip("triton.tools.tensor_descriptor")
    launcher.clear_cache()
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    first = launcher.descriptor(td.TensorDescriptor, a, [16, 32])
    second = launcher.descriptor(td.TensorDescriptor, b, [16, 32])
    want = td.TensorDescriptor.from_tensor(b, [16, 32])
    assert second.base is b and first.base is a
    for f in ("shape", "strides", "block_shape", "padding"):
        assert list(getattr(second, f)) == list(getattr(want, f)), f
    assert all(p.base is None for p in launcher._DESCRIPTORS.values())
    # the first (Triton-built) and later (copied) descriptors key one compiled kernel
    assert launcher._args_key((first,)) == launcher._args_key((second,))
    assert launcher._args_key((second,)) != launcher._args_key(
        (launcher.descriptor(td.TensorDescriptor, b, [32, 32]),))
    launcher.clear_cache()


def _triton_binder():
    """Triton 3.6's own argument binder for a small kernel (offline, sm_90 target): what
    ``JITFunction.run`` computes on every launch (bound arguments, specialisation)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    def body(x_ptr, desc, n, m, scale, y_ptr, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
        pass

    jf = JITFunction(body, do_not_specialize=["m"])
    backend = make_backend(GPUTarget("cuda", 90, 32))
    return jf, create_function_from_signature(jf.signature, jf.params, backend), triton


def test_keys_separate_whatever_triton_specialises_on_and_arguments_bind_as_triton_binds():
    """Against Triton's binder, over a grid of argument variants: equal launcher keys imply an
    equal Triton specialisation (so a cached compiled kernel is always the one Triton would
    pick), and the warm path's argument list is Triton's bound argument list."""
    td = pytest.importorskip("triton.tools.tensor_descriptor")
    jf, binder, _ = _triton_binder()
    base = torch.randn(200, 32)
    flat = base.view(-1)  # offsets of 1 and 2 elements: 4 and 8 bytes past 16-byte alignment
    tensors = [base[:64], flat[1:2049].view(64, 32), flat[2:2050].view(64, 32),
               flat[4:2052].view(64, 32), base[:64].double(), base[:64].half()]
    descs = [td.TensorDescriptor.from_tensor(base[:64], [16, 32]),
             td.TensorDescriptor.from_tensor(base[:64], [32, 32]),
             td.TensorDescriptor.from_tensor(base[16:80].half(), [16, 32])]
    ints = [1, 2, 16, 17, 32, 2 ** 31 + 16, -5]
    seen = {}
    for xi, x in enumerate(tensors):
        for d in descs:
            for n in ints:
                for m in (1, 16, 7, 2 ** 33):
                    for y in (None, tensors[0], tensors[1]):
                        for block in (16, 32):
                            args = (x, d, n, m, 0.5, y)
                            kw = dict(BLOCK=block, num_warps=4)
                            bound, spec, _ = binder(*args, **kw)
                            key = (launcher._args_key(args), tuple(kw.items()))
                            spec = tuple(spec)
                            assert seen.setdefault(key, spec) == spec, (args, kw)
                            entry = launcher._Entry(None, jf, args, kw)
                            full = list(args) + [kw.get(nm, df) for nm, df in entry.tail]
                            assert len(full) == len(bound)
                            assert all(a is b for a, b in zip(full, bound.values()))
    assert len(seen) > 100


#: The raw C launch is built for the ``CudaLauncher`` of launcher.RAW_LAUNCH_TRITON's versions;
#: these tests run that launcher's own wrappers, so they belong to those versions.
needs_raw_launch = pytest.mark.skipif(
    not launcher.RAW_LAUNCH_HERE,
    reason=f"the raw C launch is built for Triton {', '.join(launcher.RAW_LAUNCH_TRITON)}'s CudaLauncher; "
           "on this Triton every warm launch calls compiled.run")


class CudaLauncher:
    """A launcher with the class name and attributes :func:`launcher._raw_launch_parts` looks
    for, around a C-like function (a callable without ``__code__``: no descriptor wrapper)."""

    launch_cooperative_grid, launch_pdl = False, False
    global_scratch_size = profile_scratch_size = 0

    def __init__(self, calls):
        self.calls = calls
        self.launch = type("CLaunch", (), {"__call__": lambda _, *a: calls.append(("raw", a))})()

    __call__ = _Compiled.run  # Triton's own wrapper: records a "fast" call


class _RawKernel(_Kernel):
    """A stand-in kernel whose compiled kernel has the :class:`CudaLauncher` above."""

    def __init__(self):
        super().__init__()
        self.compiled = _Compiled(self.calls)
        self.compiled.run = CudaLauncher(self.calls)

    def compiled_kernel(self):
        return self.compiled


@pytest.mark.parametrize("checked", [True, False])
def test_raw_launch_only_on_the_triton_versions_it_was_checked_on(fast, monkeypatch, checked):
    """The C launcher's argument list is Triton-internal (3.7-3.9 pass metadata, hooks and
    annotations to it and the kernel arguments as one tuple, where 3.6 passes them flat), so a
    launcher of the known class name on any other version is called through ``compiled.run``,
    with the arguments ``JITFunction.run`` passes; on a checked version the C function itself."""
    monkeypatch.setattr(launcher, "RAW_LAUNCH_HERE", checked)
    k = _RawKernel()
    x = torch.randn(64)
    n = 1000 + int(torch.randint(0, 7, ()).item()) * 16
    for _ in range(2):
        launcher.launch(k, (3, 2), x, n, 0.5, BLOCK=32, num_warps=4)
    assert k.calls[0][0] == "slow" and len(k.calls) == 2
    assert (launcher._raw_launch_parts(k.compiled) is not None) == checked
    if checked:  # Triton 3.6's flat layout: grid, stream, function, flags, 6 slots, then the arguments
        kind, args = k.calls[1]
        assert kind == "raw" and args[:3] == (3, 2, 1) and args[13:] == (x.data_ptr(), n, 0.5, None, 32, False)
    else:
        kind, grid, stream, args, hooks = k.calls[1]
        assert kind == "fast" and grid == (3, 2, 1) and hooks == (None, None, None)
        assert args[0] is x and args[1:] == (n, 0.5, None, 32, False)


# -- GPU: the fast path against Triton's (gpu-marked: benchmarks/gpu/host-path.sh) ----------


def _fake_cuda_launcher(monkeypatch, recorded, fills):
    """The installed Triton's real ``CudaLauncher`` (its ``__call__`` and descriptor wrapper)
    around a recording stand-in for the compiled C function, with the CUtensorMap encoder
    mocked (no GPU): what Triton's own path passes the C launcher, to compare the raw path
    with."""
    import triton
    from triton.backends.nvidia import driver as nv

    class CLaunch:  # the compiled C function: a callable without __code__
        def __call__(self, *a):
            recorded.append(a)

    def fill(ptr, swizzle, elem_size, dtype, block, shape, strides, pad):
        fills.append(ptr)
        return ("CUtensorMap", ptr, swizzle, elem_size, dtype, tuple(block), tuple(shape),
                tuple(strides), pad)

    class Utils:  # the encoder's name up to 3.6 / from 3.7
        fill_tma_descriptor = fill_tma_descriptor_tiled = staticmethod(fill)

    class Driver:
        utils = Utils()

    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    sig = {0: "tensordesc<bf16[64, 128]>", 1: "*fp32", 2: "i32", 3: "tensordesc<bf16[32, 128]>",
           4: "fp32", 5: "constexpr"}  # (BLOCK: every parameter has an entry)
    metas = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 128], fp4_padded=False),
             dict(swizzle=2, elem_size=2, elem_type=10, block_size=[32, 128], fp4_padded=False)]
    run = object.__new__(nv.CudaLauncher)
    run.launch = nv.wrap_handle_tensordesc(CLaunch(), sig, metas)
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, True
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    if _PACKED:  # what 3.7-3.9's __init__ builds from the signature (passed through as is)
        run.arg_annotations, run.kernel_signature = ("annotations",), b"sig"
        run.gsan_enabled = False

    class Compiled:
        function, packed_metadata = 1234, (4, 1, 0)

    compiled = Compiled()
    compiled.run = run

    class Kernel(_Kernel):
        def __init__(self):
            super().__init__()

            def body(a_desc, x_ptr, n, b_desc, scale, BLOCK: int = 16):
                pass

            self.signature = inspect.signature(body)

        def __getitem__(self, grid):
            def slow(*args, **kwargs):
                self.calls.append(("slow", grid, args, kwargs))
                return compiled
            return slow

    return Kernel(), compiled


def _packed_layout() -> bool:
    """Whether this Triton's ``CudaLauncher`` passes the kernel's arguments to the C launcher
    as one sequence after launcher._PACKED_HEAD others (3.7-3.9), not flat after 13 (3.6)."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:
        return False
    return "arg_annotations" in CudaLauncher.__init__.__code__.co_names


_PACKED = _packed_layout()


def _flat(call: tuple) -> tuple:
    """A recorded C-launcher call as one flat tuple, each tensor as its data pointer."""
    if _PACKED:
        assert len(call) == launcher._PACKED_HEAD + 1, call
        call = tuple(call[:-1]) + tuple(call[-1])
    return tuple(t.data_ptr() if type(t) is torch.Tensor else t for t in call)


@needs_raw_launch
def test_raw_launch_passes_the_c_launcher_what_tritons_wrappers_pass(fast, monkeypatch):
    """The hit path calls Triton's C launcher directly with the descriptors expanded from
    a cache: the same arguments as ``CudaLauncher.__call__`` + its descriptor wrapper pass,
    one CUtensorMap encoding per (template, pointer), a new one for a new pointer."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    recorded, fills = [], []
    kernel, compiled = _fake_cuda_launcher(monkeypatch, recorded, fills)
    a, b = torch.randn(256, 128).bfloat16(), torch.randn(96, 128).bfloat16()
    x = torch.randn(64)

    def args(a, b):
        return (launcher.descriptor(TensorDescriptor, a, [64, 128]), x, 7,
                launcher.descriptor(TensorDescriptor, b, [32, 128]), 0.25)

    def tritons_own(a, b):  # what JITFunction.run ends with on a warm kernel, with each
        c = compiled      # plain tensor as the pointer the C launcher's getPointer reads
        c.run(5, 3, 1, 77, c.function, c.packed_metadata, None, None, None, *args(a, b), 16)
        return _flat(recorded.pop())

    launcher.launch(kernel, (5, 3), *args(a, b), BLOCK=16)  # fills the cache (normal path)
    assert [c[0] for c in kernel.calls] == ["slow"] and not recorded
    expected = tritons_own(a, b)
    fills.clear()
    _Driver.active.stream = 77
    x_at = (launcher._PACKED_HEAD if _PACKED else 13) + 5  # after a's map, shape, strides
    for _ in range(2):
        launcher.launch(kernel, (5, 3), *args(a, b), BLOCK=16)
        raw = recorded.pop()
        got = _flat(raw)
        assert got == expected and got[x_at] == x.data_ptr()
        kernel_args = raw[-1] if _PACKED else raw[13:]
        assert type(kernel_args[5]) is int  # x passed as its pointer, not the tensor
    assert [c[0] for c in kernel.calls] == ["slow"]  # both were raw launches
    assert len(fills) == 2  # one encoding per descriptor, reused by the second launch
    a2 = torch.randn(256, 128).bfloat16()  # a new pointer: a new encoding, as Triton does it
    launcher.launch(kernel, (5, 3), *args(a2, b), BLOCK=16)
    got = _flat(recorded.pop())
    assert got == tritons_own(a2, b) and got != expected and len(fills) == 3 + 2


def _bound_case(monkeypatch):
    """A :class:`launcher.Bound` launch of the raw-path kernel above (two descriptor slots, a
    tensor slot) and what ``launch`` passes the C launcher for the same tensors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    recorded, fills = [], []
    kernel, compiled = _fake_cuda_launcher(monkeypatch, recorded, fills)
    ident = lambda t: t  # noqa: E731
    bound = launcher.Bound(kernel, (5, 3), (launcher.Desc(TensorDescriptor, ident, [64, 128]),
                                            launcher.TENSOR, 7,
                                            launcher.Desc(TensorDescriptor, ident, [32, 128]),
                                            0.25), dict(BLOCK=16))

    def via_launch(a, x, b):
        launcher.launch(kernel, (5, 3), launcher.descriptor(TensorDescriptor, a, [64, 128]), x,
                        7, launcher.descriptor(TensorDescriptor, b, [32, 128]), 0.25, BLOCK=16)
        return recorded.pop()

    return bound, kernel, recorded, fills, via_launch


@needs_raw_launch
def test_bound_launch_passes_the_c_launcher_what_launch_passes(fast, monkeypatch):
    """After its first (normal-path) launch, a Bound launch calls the C launcher with the same
    arguments as ``launch``'s raw path for the same tensors (itself checked against Triton's
    wrappers above), for new tensors too, on the current stream; a descriptor's encoding is
    reused per base pointer."""
    bound, kernel, recorded, fills, via_launch = _bound_case(monkeypatch)
    a, b = torch.randn(256, 128).bfloat16(), torch.randn(96, 128).bfloat16()
    x = torch.randn(64)
    bound(a, x, b)  # the normal path (compiles on a GPU); builds the fast path's parts
    assert [c[0] for c in kernel.calls] == ["slow"] and not recorded
    assert bound.fast
    _Driver.active.stream = 77
    want = via_launch(a, x, b)
    for stream in (77, 78):
        _Driver.active.stream = stream
        bound(a, x, b)
        got = recorded.pop()
        assert got[3] == stream and got[:3] + got[4:] == want[:3] + want[4:]
    _Driver.active.stream = 77
    a2, x2 = torch.randn(256, 128).bfloat16(), torch.randn(64)
    n_fills = len(fills)
    bound(a2, x2, b)
    assert recorded.pop() == via_launch(a2, x2, b)
    assert [c[0] for c in kernel.calls] == ["slow"]  # every later launch was raw
    bound(a2, x2, b)
    assert recorded.pop() == via_launch(a2, x2, b)
    assert len(fills) == n_fills + 1 + 1  # a2 encoded once by the Bound, once by launch()


@needs_raw_launch
@pytest.mark.parametrize("change", ["misaligned", "dtype", "shape", "strided", "device",
                                    "hook", "off"])
def test_bound_launch_takes_the_normal_path_whenever_the_first_calls_kernel_may_not_fit(
        fast, monkeypatch, change):
    """A call the fast path's compiled kernel or cached descriptors may not fit (a misaligned
    or other-dtype tensor, a descriptor tensor of another shape or not contiguous, another
    current device, a pre-run hook, fast launch off) goes through ``launch`` (its own key,
    Triton's path where that key is new), never the Bound's C argument list."""
    bound, kernel, recorded, fills, via_launch = _bound_case(monkeypatch)
    a, b = torch.randn(256, 128).bfloat16(), torch.randn(96, 128).bfloat16()
    x = torch.randn(65)
    bound(a, x[:64], b)
    assert bound.fast
    args = (a, x[:64], b)
    if change == "misaligned":
        args = (a, x[1:], b)
    elif change == "dtype":
        args = (a, x[:64].double(), b)
    elif change == "shape":
        args = (torch.randn(128, 128).bfloat16(), x[:64], b)
    elif change == "strided":
        args = (torch.randn(512, 128).bfloat16()[::2], x[:64], b)
    elif change == "device":
        monkeypatch.setattr(_Driver.active, "get_current_device", staticmethod(lambda: 1))
    elif change == "hook":
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    else:
        monkeypatch.setattr(launcher, "fast_launch_enabled", lambda: False)
    through_launch = []
    real_launch = launcher.launch
    monkeypatch.setattr(launcher, "launch",
                        lambda *a, **k: through_launch.append(a) or real_launch(*a, **k))
    bound(*args)
    assert len(through_launch) == 1
    passed = through_launch[0][2:]
    assert passed[1] is args[1] and passed[0].base is args[0] and passed[3].base is b
    monkeypatch.undo()  # the same call as the first again: the fast path
    monkeypatch.setattr(launcher, "_driver", _Driver)
    monkeypatch.setattr(launcher, "fast_launch_enabled", lambda: True)
    kernel.pre_run_hooks.clear()
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("not the fast path"))
    recorded.clear()
    bound(a, x[:64], b)
    assert len(recorded) == 1


@needs_raw_launch
def test_bound_launch_without_a_raw_launcher_stops_trying_a_misaligned_first_call_retries(
        fast, monkeypatch):
    """Where the fast path can never be built (this Triton has no raw C launcher) a Bound goes
    through ``launch`` once a call, without re-keying the call to try again; where only the
    first call's tensors prevented it (misaligned), a later aligned call builds it."""
    kernel = _Kernel()  # its compiled kernel has no raw launcher (compiled.run is used)
    bound = launcher.Bound(kernel, (4,), (launcher.TENSOR, 8, 0.5), dict(BLOCK=16))
    x = torch.randn(64)
    keys = []
    real_key = launcher._launch_key
    with pytest.MonkeyPatch.context() as m:
        m.setattr(launcher, "_launch_key", lambda *a: keys.append(a) or real_key(*a))
        bound(x)
        assert bound.fast is False
        n = len(keys)
        bound(x)
        bound(x)
        assert len(keys) == n + 2  # one key a call: launch()'s own
    assert [c[0] for c in kernel.calls] == ["slow", "fast", "fast"]
    retry, *_ = _bound_case(monkeypatch)  # a raw C launcher this time
    a, b, y = torch.randn(256, 128).bfloat16(), torch.randn(96, 128).bfloat16(), torch.randn(65)
    retry(a, y[1:], b)  # misaligned: not built, tried again next call
    assert retry.fast is None
    retry(a, y[:64], b)
    assert retry.fast


def test_bound_launch_checks_its_tensor_count(fast, monkeypatch):
    bound, *_ = _bound_case(monkeypatch)
    with pytest.raises(TypeError, match="takes 3 tensors, got 2"):
        bound(torch.randn(256, 128).bfloat16(), torch.randn(64))


def test_cached_bound_builds_each_configuration_once_and_clears_with_the_cache():
    """``cached_bound``: one Bound per key, built on first use; ``clear_cache`` drops them."""
    launcher.clear_cache()
    built = []

    def build(tag):
        built.append(tag)
        return (_bound_kernel_stub, (4, 1), (launcher.TENSOR, 7), {"BLOCK": 16})

    a = launcher.cached_bound(("k", 1), lambda: build("a"))
    assert launcher.cached_bound(("k", 1), lambda: build("again")) is a and built == ["a"]
    b = launcher.cached_bound(("k", 2), lambda: build("b"))
    assert b is not a and built == ["a", "b"] and isinstance(b, launcher.Bound)
    assert a.slots == (0,) and a.grid == (4, 1) and a.kwargs == {"BLOCK": 16}
    launcher.clear_cache()
    assert launcher.cached_bound(("k", 1), lambda: build("c")) is not a and built[-1] == "c"
    launcher.clear_cache()


class _bound_kernel_stub:  # (a Bound is built without launching; its kernel is not called here)
    pre_run_hooks = ()


def _case(seqlen=2048, heads=4, d=128, seed=0):
    from tests.kernels.attention_checks import make_qkv
    import flashmask3.masks as M

    q, k, v = (t.detach().requires_grad_() for t in
               make_qkv(1, seqlen, seqlen, heads, heads, d, torch.bfloat16, device="cuda",
                        seed=seed))
    mask = M.causal_document_mask([512, 1024, 512], device="cuda")
    return q, k, v, mask, torch.randn_like(q)


def _run(q, k, v, mask, dout):
    import flashmask3

    out = flashmask3.flashmask_attention(q, k, v, mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, dq, dk, dv


@pytest.mark.gpu
@pytest.mark.parametrize("raw", [True, False])
def test_gpu_fast_launch_equals_the_triton_launch_path(monkeypatch, raw):
    """Forward bitwise, dK/dV bitwise, dQ within fp32-atomics tolerance (the fused backward
    adds dQ in a varying order) between FLASHMASK3_FAST_LAUNCH=0 and the warm fast path: the
    raw C launch (a checked Triton) and ``compiled.run`` (any other version's warm path)."""
    from tests.reference import rel_err

    if raw and not launcher.RAW_LAUNCH_HERE:
        pytest.skip(f"the raw C launch is built for Triton {launcher.RAW_LAUNCH_TRITON}")
    import flashmask3

    monkeypatch.setattr(launcher, "RAW_LAUNCH_HERE", raw)
    case = _case()
    monkeypatch.setenv(launcher.FAST_LAUNCH_ENV, "0")
    slow = _run(*case)
    monkeypatch.setenv(launcher.FAST_LAUNCH_ENV, "1")
    launcher.clear_cache()
    flashmask3.api.clear_prepared()  # no bound launch built before (with the other path)
    _run(*case)  # fills the cache
    n = len(launcher._COMPILED)
    fast = _run(*case)
    assert len(launcher._COMPILED) == n > 0  # warm: nothing new was compiled or keyed
    # raw: the warm launches of the descriptor kernels went straight to Triton's C launcher
    assert any(e.raw is not None and e.descs for e in launcher._COMPILED.values()) == raw
    assert raw or all(e.raw is None for e in launcher._COMPILED.values())
    torch.testing.assert_close(fast[0], slow[0], rtol=0, atol=0)
    torch.testing.assert_close(fast[2], slow[2], rtol=0, atol=0)
    torch.testing.assert_close(fast[3], slow[3], rtol=0, atol=0)
    assert rel_err(fast[1], slow[1]) < 4e-3  # at most one bf16 rounding flip per element


@pytest.mark.gpu
def test_gpu_bound_launches_with_new_tensors_equal_the_triton_launch_path(monkeypatch):
    """The prepared Gluon forward and dK/dV launches (``launcher.Bound``) on their fast path,
    with new tensors (new pointers: new descriptor expansions) every call, give Triton's own
    path's forward and dK/dV bit for bit."""
    from flashmask3 import api
    from flashmask3.kernels import triton_backend as tb

    if not launcher.RAW_LAUNCH_HERE:  # (a Bound's fast path is the raw launch's)
        pytest.skip(f"the raw C launch is built for Triton {launcher.RAW_LAUNCH_TRITON}")
    cases = [_case(seed=10 + i) for i in range(3)]
    monkeypatch.setenv(launcher.FAST_LAUNCH_ENV, "0")
    slow = [_run(*c) for c in cases]
    monkeypatch.setenv(launcher.FAST_LAUNCH_ENV, "1")
    launcher.clear_cache()  # (only this signature's small bound launches from here on)
    _run(*_case(seed=20))  # the first fast-enabled call of the signature builds the fast path
    calls = list(tb._PREPARED_CALLS.values()) + [p.call for p in api._PREPARED.values()]
    bounds = [r.bound for c in calls if isinstance(c, tb.PreparedCall) for r in c._runs.values()]
    assert bounds and all(b.fast for b in bounds)
    small = list(launcher._BOUND.values())  # the pre-pass and dQ scaling (launcher.cached_bound)
    assert len(small) >= 2 and all(b.fast for b in small)
    from tests.reference import rel_err

    for c, want in zip(cases, slow):
        got = _run(*c)
        for i in (0, 2, 3):
            torch.testing.assert_close(got[i], want[i], rtol=0, atol=0)
        assert rel_err(got[1], want[1]) < 4e-3  # dQ: fp32 atomics add in a varying order


@pytest.mark.gpu
def test_gpu_fast_launch_uses_the_current_stream():
    """Warm launches from a side stream run on that stream: with the default stream held busy
    by a GPU sleep, the side stream's result is complete when the side stream is (had the
    fast path launched on the default stream, the copy would read an unfinished output)."""
    import flashmask3

    q, k, v, mask, dout = _case(seed=3)
    want = _run(q, k, v, mask, dout)[0]
    flashmask3.flashmask_attention(q, k, v, mask)
    torch.cuda.synchronize()
    assert os.environ.get(launcher.FAST_LAUNCH_ENV, "1") != "0" and launcher._COMPILED
    side = torch.cuda.Stream()
    torch.cuda._sleep(2_000_000_000)  # the default stream: busy for about a second
    with torch.cuda.stream(side):
        got = flashmask3.flashmask_attention(q, k, v, mask).detach().cpu()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want.detach().cpu(), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_launch_under_a_profiler_hook_takes_the_normal_path():
    """With a Triton launch hook set, launches go through JITFunction.run (the hook sees them)."""
    seen = []
    hook = launcher._knobs.runtime.launch_enter_hook
    hook.add(lambda metadata: seen.append(metadata))
    try:
        with mock.patch.object(launcher, "_COMPILED", {}):
            _run(*_case(seed=4))
    finally:
        hook.calls.pop()
    assert len(seen) >= 3
