"""Host work of one attention call, measured on a CPU machine (no GPU): what the Python side
of the CUDA path does per call, so that its reductions are measurable before a GPU run.

Two parts, each timed over many calls and profiled (cProfile: Python function calls per call):

* **backend**: ``triton_backend.forward`` / ``backward`` as on an H200 (bf16, D=128, a
  ``[B, 1, S, 1]`` causal mask), on fake CUDA tensors (``FakeTensorMode``: no memory, no
  device) with the device queries answering "Hopper" and every Triton launch replaced by a
  recorder: the dispatch, the plans, the allocations, the descriptors, the argument lists,
  and the package's launcher (:mod:`flashmask3.kernels.launcher`: its warm path up to the
  compiled kernel's ``run``). Three forms: one mask reused (as a model's layers call it),
  a fresh mask every call (plans rebuilt), and every launch through ``JITFunction.run`` (the
  launcher off: Triton's ``run`` itself is mocked, so its ~40 µs a launch is not in these
  numbers; the C launch is timed only on the GPU, benchmarks/host_path.py).
* **api**: ``flashmask_attention`` forward (and fwd+bwd) on CPU tensors with the backend's
  kernels replaced by a stub that returns ready outputs: the argument checks, the backend
  choice, the custom op and autograd around it.

    python benchmarks/host_profile.py [--calls 200] [--out FILE.json] [--run after]

``--out`` keeps one file of named runs (``--run``, e.g. ``before`` and ``after`` a change):
the run is stored under its key and the file's other runs stay
(``benchmarks/results/host_profile_cpu.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time
import warnings
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # (before the kernels are defined: the JIT launcher)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Props:
    multi_processor_count = 132
    major, minor = 9, 0
    name = "fake H200"


def _slice_by_narrow(orig):
    """Tensor.__getitem__ for fake CUDA tensors in a CPU-only torch: basic slices as narrow
    (indexing with slices creates a device tensor there, which such a build cannot)."""
    def getitem(self, idx):
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(self, FakeTensor):
            return orig(self, idx)
        idx = idx if isinstance(idx, tuple) else (idx,)
        out, dim = self, 0
        for i in idx:
            if i is Ellipsis:
                dim = out.dim() - (len(idx) - 1 - idx.index(Ellipsis)) + 0
                dim = out.dim() - len(idx[idx.index(Ellipsis) + 1:])
                continue
            if not isinstance(i, slice) or i.step not in (None, 1):
                return orig(self, idx)
            n = out.shape[dim]
            start, stop, _ = i.indices(n)
            out = out.narrow(dim, start, max(0, stop - start))
            dim += 1
        return out

    return getitem


class _FakeCompiled:
    """What ``JITFunction.run`` returns on a GPU (a ``CompiledKernel``), for the fake Hopper:
    its ``run`` (the launcher's warm path, :mod:`flashmask3.kernels.launcher`) records too."""

    function = packed_metadata = None

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, exit_, *args):
        self.launches.append(self.name)


class _FakeDriver:
    """``triton.runtime.driver.driver`` on a machine without one: device 0, stream 0."""

    class active:  # noqa: N801 (the attribute name Triton uses)
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device=None: 0)


@contextlib.contextmanager
def fake_hopper(launches: list, fast_launch: bool = True):
    """Fake CUDA tensors on a Hopper that never runs: launches are appended to ``launches``.
    ``JITFunction.run`` (Triton's launch path, mocked: it is not measured) returns a fake
    compiled kernel, so the package's launcher takes its warm path from the second call on
    (``fast_launch=False``: every launch through ``JITFunction.run``, as before the launcher)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.runtime.jit import JITFunction

    from flashmask3.kernels import dispatch, launcher, tiles, tl_kernels

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(self.fn.__name__)
        return _FakeCompiled(self.fn.__name__, launches)

    hopper = lambda index: (9, 0)  # noqa: E731
    from flashmask3 import api

    dispatch.decide.cache_clear()
    launcher.clear_cache()
    tiles.clear_plan_cache()
    getattr(api, "clear_prepared", lambda: None)()  # (absent before the prepared calls)
    env = {launcher.FAST_LAUNCH_ENV: "1" if fast_launch else "0"}
    with mock.patch.object(JITFunction, "run", record), \
            mock.patch.object(launcher, "_driver", _FakeDriver), \
            mock.patch.dict(os.environ, env), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False), \
            mock.patch.object(dispatch, "_capability", hopper), \
            mock.patch.object(tl_kernels, "_capability", hopper), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: _Props()), \
            mock.patch.object(torch.Tensor, "__getitem__", _slice_by_narrow(torch.Tensor.__getitem__)), \
            warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        yield
    dispatch.decide.cache_clear()
    launcher.clear_cache()
    tiles.clear_plan_cache()
    getattr(api, "clear_prepared", lambda: None)()  # (absent before the prepared calls)


def _per_call(fn, calls: int, launches: list | None = None) -> dict:
    """Per call: µs (median of 5 batches; on fake tensors it includes FakeTensor's own
    dispatch, so compare the counts), Python function calls (cProfile) in flashmask3's files,
    in Triton's and in all, torch ops dispatched (on fake tensors: FakeTensorMode dispatches)
    and Triton launches."""
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    if launches is not None:
        launches.clear()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    ours = sum(v[1] for k, v in stats.items() if f"{os.sep}flashmask3{os.sep}" in k[0])
    trit = sum(v[1] for k, v in stats.items() if f"{os.sep}triton{os.sep}" in k[0])
    wrap = sum(v[1] for k, v in stats.items()  # torch's Python wrapper of autograd.Function
               if k[0].endswith((f"autograd{os.sep}function.py", f"_functorch{os.sep}utils.py")))
    ops = sum(v[1] for k, v in stats.items() if k[2] == "__torch_dispatch__"
              and "fake_tensor" in k[0])
    per_fn = sorted(((v[1] / calls, f"{k[0].split(os.sep)[-1]}:{k[2]}") for k, v in
                     stats.items() if f"{os.sep}flashmask3{os.sep}" in k[0]), reverse=True)
    top = sorted(((v[3] / calls * 1e6, f"{k[0].split(os.sep)[-1]}:{k[2]}") for k, v in
                  stats.items() if f"{os.sep}flashmask3{os.sep}" in k[0]), reverse=True)[:10]
    out = dict(us=sorted(times)[2], calls_flashmask3=ours / calls, calls_triton=trit / calls,
               calls_autograd_function=wrap / calls,
               calls_all=sum(v[1] for v in stats.values()) / calls, torch_ops=ops / calls,
               top_cumulative_us=[(name, round(us, 1)) for us, name in top],
               flashmask3_calls_by_function=[(name, n) for n, name in per_fn])
    if launches is not None:
        out["launches"] = launches[:len(launches) // calls]
    return out


def backend_profile(calls: int, seqlen: int = 32768, heads: int = 16, d: int = 128,
                    fast_launch: bool = True, fresh_mask: bool = False) -> dict:
    """The backend per call on the fake Hopper. ``fresh_mask``: a new mask tensor every call
    (the plan cache misses: the preprocessing launches run), else one mask reused (a model's
    layers: after the first call the plans come from the cache)."""
    from flashmask3.kernels import triton_backend as T

    launches: list = []
    res = {}
    with fake_hopper(launches, fast_launch):
        q = torch.empty(1, seqlen, heads, d, dtype=torch.bfloat16, device="cuda")
        k, v = torch.empty_like(q), torch.empty_like(q)
        cols = torch.empty(1, 1, seqlen, 1, dtype=torch.int32, device="cuda")
        mask = (lambda: torch.empty_like(cols)) if fresh_mask else (lambda: cols)
        scale = d ** -0.5
        for span in (None, 1024.0):  # default tile, short-rows tile
            label = "default tile" if span is None else "short-rows tile"
            out, lse = T.forward(q, k, v, cols, True, scale, row_span=span)
            res[f"backend fwd ({label})"] = _per_call(
                lambda: T.forward(q, k, v, mask(), True, scale, row_span=span), calls, launches)
        res["backend bwd"] = _per_call(
            lambda: T.backward(out, None, q, k, v, out, lse, mask(), True, scale), calls,
            launches)

        def fwd_bwd():  # one call's forward and backward see one mask tensor
            m = mask()
            o, l_ = T.forward(q, k, v, m, True, scale)
            T.backward(o, None, q, k, v, o, l_, m, True, scale)

        res["backend fwd+bwd (default tile)"] = _per_call(fwd_bwd, calls, launches)
    return res


def public_profile(calls: int, seqlen: int = 32768, heads: int = 16, d: int = 128) -> dict:
    """``flashmask_attention`` itself (the public call: checks or the prepared signature,
    autograd's apply, the backend, the launcher) on the fake Hopper, as a model's layer calls
    it: one ``FlashMask`` (and one raw column tensor) reused. The eager route is forced
    (``api._traced`` answers False: fake tensors would take the custom op). A CPU-only torch
    cannot build an autograd graph on fake CUDA tensors, so the backward is measured as the
    body autograd's engine runs (``_EagerAttention.backward`` on the context the forward
    saved), the engine itself (C++) not included."""
    import flashmask3
    from flashmask3 import api
    from flashmask3.masks import FlashMask

    launches: list = []
    res = {}
    key = getattr(api, "_call_key", None)  # (None: a tree before the prepared calls)
    with fake_hopper(launches), mock.patch.object(api, "_traced", lambda q: False), \
            mock.patch.object(api, "_call_key", _plain_tensor_key(key), create=True), \
            mock.patch.object(api._EagerAttention, "forward", _saving_forward(api)), \
            mock.patch.object(api, "_needs_autograd", lambda q, k, v: True, create=True):
        q, k, v = (torch.empty(1, seqlen, heads, d, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        cols = torch.empty(1, 1, seqlen, 1, dtype=torch.int32, device="cuda")
        fm = FlashMask(cols, True, seqlen, None, _validated=True)  # (no value read)
        dout = torch.empty(1, seqlen, heads, d, dtype=torch.bfloat16, device="cuda")
        for form, m in (("FlashMask", fm), ("raw columns", cols)):
            def fwd():
                return flashmask3.flashmask_attention(q, k, v, m, causal=True)

            def fwd_bwd():
                fwd()
                api._EagerAttention.backward(_LAST_CTX[0], dout, None)

            res[f"public fwd, {form}"] = _per_call(fwd, calls, launches)
            res[f"public fwd+bwd, {form}"] = _per_call(fwd_bwd, calls, launches)
    return res


#: The context of the last forward (:func:`_saving_forward`).
_LAST_CTX: list = [None]


def _saving_forward(api):
    """``_EagerAttention.forward`` that also keeps its context (the backward is run on it)."""
    real = api._EagerAttention.forward

    class _Ctx:
        """A stand-in autograd context (no graph on fake CUDA tensors in a CPU-only torch)."""

        def save_for_backward(self, *ts):
            self.saved_tensors = ts

        def set_materialize_grads(self, value):
            pass

    def forward(ctx, *args):
        ctx = _Ctx()  # (the real one cannot hold fake CUDA tensors for a backward here)
        _LAST_CTX[0] = ctx
        return real(ctx, *args)

    return staticmethod(forward)


def _plain_tensor_key(call_key):
    """``api._call_key`` that takes fake tensors for plain ones (FakeTensor is a subclass, and
    FakeTensorMode is a dispatch mode: the real key refuses both, as it should)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def key(q, k, v, mask, causal, softmax_scale):
        if call_key is None:
            return None
        with mock.patch("flashmask3.api.Tensor", FakeTensor), \
                mock.patch("flashmask3.api._dispatch_stack_len", lambda: 0):
            return call_key(q, k, v, mask, causal, softmax_scale)

    return key


def api_profile(calls: int) -> dict:
    """flashmask_attention around a stub backend (CPU tensors): the public layer's own work."""
    import flashmask3
    import flashmask3.masks as M
    from flashmask3.kernels import torch_path

    s, h, d = 256, 2, 16
    q, k, v = (torch.randn(1, s, h, d, requires_grad=True) for _ in range(3))
    out0, lse0 = torch.randn(1, s, h, d), torch.randn(1, h, s)
    grads = tuple(torch.randn(1, s, h, d) for _ in range(3))
    mask = M.causal_document_mask([128, 128])
    dout = torch.randn(1, s, h, d)
    res = {}
    with mock.patch.object(torch_path, "forward", lambda *a, **kw: (out0, lse0)), \
            mock.patch.object(torch_path, "backward", lambda *a, **kw: grads), \
            mock.patch.dict(os.environ, {"FLASHMASK3_BACKEND": "torch"}):
        for form, m, causal in (("FlashMask", mask, False),
                                ("raw columns (CPU: values read)", mask.startend_row_indices, True)):
            res[f"api fwd, {form}"] = _per_call(
                lambda: flashmask3.flashmask_attention(q, k, v, m, causal=causal), calls)
            res[f"api fwd+bwd, {form}"] = _per_call(
                lambda: flashmask3.flashmask_attention(q, k, v, m, causal=causal).backward(dout),
                calls)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run", default="after",
                    help="the key this run is stored under in --out (other keys are kept)")
    ap.add_argument("--top", action="store_true", help="print the top cumulative functions")
    ap.add_argument("--only-public", action="store_true", help="only the public-call part")
    args = ap.parse_args(argv)
    import triton

    import datetime
    import platform
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               machine=f"{platform.node()} {platform.processor() or platform.machine()} "
                       f"({os.cpu_count()} CPUs, no GPU: fake Hopper tensors)",
               python=platform.python_version(), commit=commit.strip(),
               command=" ".join(["python"] + sys.argv),
               torch=torch.__version__, triton=triton.__version__,
               **({} if args.only_public else dict(
                   backend=backend_profile(args.calls),
               backend_fresh_mask=backend_profile(args.calls, fresh_mask=True),
               backend_jit_run=backend_profile(args.calls, fast_launch=False, fresh_mask=True),
                   api=api_profile(args.calls))),
               public=public_profile(args.calls))
    for part in ("public", "backend", "backend_fresh_mask", "backend_jit_run", "api"):
        if part not in res:
            continue
        print(f"-- {part}")
        for name, r in res[part].items():
            print(f"{name:44s} {r['us']:7.1f} µs  Python calls: flashmask3 "
                  f"{r['calls_flashmask3']:4.0f}, triton {r['calls_triton']:4.0f}, autograd.Function "
                  f"{r['calls_autograd_function']:3.0f}, all "
                  f"{r['calls_all']:5.0f}; torch ops {r['torch_ops']:3.0f}"
                  + (f"; launches {len(r['launches'])}: {','.join(r['launches'])}"
                     if "launches" in r else ""))
            if args.top:
                for fn, us in r["top_cumulative_us"]:
                    print(f"      {us:7.1f} µs  {fn}")
                print("      calls: " + ", ".join(f"{fn} {n:g}" for fn, n in
                                                 r["flashmask3_calls_by_function"]))
    if args.out:
        write_run(args.out, args.run, res)
    return 0


def write_run(path: str, run: str, res: dict) -> None:
    """Store ``res`` as run ``run`` of the JSON file ``path`` (``{run: result, ...}``), keeping
    the file's other runs, so that before/after profiles of a change live in one file."""
    runs = {}
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)
    runs[run] = res
    with open(path, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
