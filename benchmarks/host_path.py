"""Host cost of one attention call, and small problems end to end (issue 25's numbers).

Two tables, one JSON (``--out``/host_path.json) and a markdown summary:

* **host**: at 32K tokens (B=1, 16 heads, D=128, causal documents) for a ``FlashMask`` and for
  the same raw column tensor: host µs per call (CPU time to enqueue while the GPU is busy,
  ``benchmarks.kernel.host_us``), the standard ``do_bench`` median (host work included), the
  GPU time (CUDA events behind a GPU sleep that hides the host's work), and the kernels each
  call launches (torch profiler), forward and forward+backward. Targets: host <= 100 µs (fwd),
  <= 250 µs (fwd+bwd).
* **floor** (``--floor``): what this host allows, host µs of the smallest pieces of a call:
  ``torch.empty_like`` of a CUDA tensor, a bare CUDA launch through torch (``x.add_(1)``),
  ``autograd.Function.apply`` of an identity (and with its backward), one launch of a
  trivial Triton kernel through the package's launcher and through ``JITFunction.run``, and
  FlexAttention's forward at the host table's size.
* **small**: fwd+bwd at 4K and 8K tokens (B=1, 16 heads, D=128; one and five causal documents):
  flashmask3 vs FlexAttention, standard do_bench (wall time incl. host) and GPU time, each
  library eager (the backward on autograd's device thread and on the calling thread), under
  ``torch.compile(mode="reduce-overhead")`` and captured by hand in a CUDA graph. Targets:
  flashmask3 std <= Flex std, and <= 1.3x flashmask3's GPU time.

    python benchmarks/host_path.py --out $OUT/host-path          # on the GPU
    python benchmarks/host_path.py --floor --out $OUT/host-path  # on the GPU: the floor only
    python benchmarks/host_path.py --dry-run                     # CPU: code path only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashmask3  # noqa: E402
import flashmask3.masks as M  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the floor's Triton rows need it
    triton = None

HOST_FWD_US, HOST_FWD_BWD_US = 100.0, 250.0  # targets
SMALL_VS_GPU = 1.3


def _docs(s: int, n: int) -> list[int]:
    """``n`` causal documents of near-equal length filling ``s`` tokens."""
    base = s // n
    return [base] * (n - 1) + [s - base * (n - 1)]


def _inputs(s: int, heads: int, d: int, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(1, s, heads, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
            for _ in range(3)]


#: Calls per backward of the "chained" rows: a model's layers share one backward, so the
#: autograd engine's cost around a backward (its hand-off to the device thread and back) is
#: paid once per step, not once per attention call as in the one-call rows.
CHAIN = 8
CHAINED = f"fwd+bwd, {CHAIN} per backward"


def _calls(q, k, v, mask, causal):
    """(fwd, fwd_bwd, chained) closures of flashmask3 calls: one forward; one forward and its
    backward; :data:`CHAIN` forwards each taking the previous output as its queries, then one
    backward of the last."""
    dout = torch.randn_like(q)

    def fwd():
        return flashmask3.flashmask_attention(q, k, v, mask, causal=causal)

    def fwd_bwd():
        fwd().backward(dout)

    def chained():
        x = q
        for _ in range(CHAIN):
            x = flashmask3.flashmask_attention(x, k, v, mask, causal=causal)
        x.backward(dout)

    return fwd, fwd_bwd, chained


def gpu_ms(fn, leaves, reps: int = 20) -> float:
    """Median GPU time (ms) of ``fn`` by CUDA events, each call behind a GPU sleep that covers
    its host work (the interleaved timer of benchmarks/kernel.py, one implementation)."""
    from benchmarks.kernel import HOST_COVER_CYCLES

    out = []
    for _ in range(reps):
        for t in leaves:
            t.grad = None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_COVER_CYCLES)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def kernels_per_call(fn) -> int:
    """CUDA kernels one call launches (torch profiler; after warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_profile_text(fn, calls: int = 20) -> str:
    """cProfile of ``calls`` calls of ``fn`` (GPU kept busy, so no call waits for it): the top
    functions by own time and by cumulative time, per call, for finding the host cost."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    buf.write(f"{calls} calls; {st.total_calls / calls:.0f} Python function calls per call\n")
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    return buf.getvalue()


#: The host table's variants: (mask, launch) -> what changes. "reused": one mask tensor for
#: every call (a model's layers: the plans come from the cache after the first call);
#: "fresh": the plan cache emptied before each call (a new mask every call: the preprocessing
#: runs); launch "triton": every kernel through JITFunction.run (FLASHMASK3_FAST_LAUNCH=0, the
#: A/B of flashmask3/kernels/launcher.py); the autograd thread (:data:`AUTOGRAD_THREADS`).
HOST_VARIANTS = (("reused", "fast", "device"), ("fresh", "fast", "device"),
                 ("reused", "triton", "device"), ("reused", "fast", "calling"))
#: The autograd engine runs a CUDA backward on its device thread ("device", torch's default)
#: or, with ``torch.autograd.set_multithreading_enabled(False)``, on the calling thread.
AUTOGRAD_THREADS = ("device", "calling")


@contextlib.contextmanager
def autograd_thread(which: str):
    """The autograd engine's backward thread for the block (:data:`AUTOGRAD_THREADS`)."""
    prev = torch._C._is_multithreading_enabled()
    torch.autograd.set_multithreading_enabled(which == "device")
    try:
        yield
    finally:
        torch.autograd.set_multithreading_enabled(prev)


def _variant(fn, mask_mode: str, launch: str, thread: str = "device"):
    """``fn`` under a host-table variant (:data:`HOST_VARIANTS`)."""
    from flashmask3.kernels import launcher, tiles

    def call():
        if mask_mode == "fresh":
            tiles.clear_plan_cache()
        with autograd_thread(thread):
            if launch == "triton":
                os.environ[launcher.FAST_LAUNCH_ENV] = "0"
                try:
                    return fn()
                finally:
                    del os.environ[launcher.FAST_LAUNCH_ENV]
            return fn()

    return call


#: Rounds of the host table: every row's host sample is taken once per round, rows in turn, so
#: the VM's drifting host speed (tens of percent over a run) hits every row alike; a row's host
#: time is the median of its rounds, its spread the 10th and 90th percentile.
HOST_ROUNDS = 9
#: Rounds of the small table: each cell's do_bench median is taken this many times, FlashMask
#: and Flex and both autograd threads in turn; a cell is the median of its rounds (one do_bench
#: at 4K, ~0.3 ms a call, moved by up to 1.8x between cells that run the same work).
SMALL_ROUNDS = 5


def round_robin_host(rows: list, sample, rounds: int = HOST_ROUNDS) -> list[list[float]]:
    """Host samples of every row, the rows taken in turn within each of ``rounds`` rounds:
    ``rows`` = ``(fn, leaves)`` pairs, ``sample(fn, leaves)`` = one host µs sample (after one
    untimed call, so a row never pays the previous row's cache clearing)."""
    samples: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for got, (fn, leaves) in zip(samples, rows):
            fn()
            got.append(sample(fn, leaves))
    return samples


def _percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def host_table(seqlen: int, heads: int, d: int, dtype, ndocs: int, out_dir=None) -> list[dict]:
    from benchmarks.kernel import host_us, standard_ms

    q, k, v = _inputs(seqlen, heads, d, "cuda", dtype)
    fm = M.causal_document_mask(_docs(seqlen, ndocs), device="cuda")
    specs = []  # (row fields, fn, leaves, whether do_bench and GPU time are measured)
    for form, mask, causal in (("FlashMask", fm, False),
                               ("raw columns", fm.startend_row_indices, True)):
        fwd0, fwd_bwd0, chained0 = _calls(q, k, v, mask, causal)
        for _ in range(3):
            fwd_bwd0()
        chained0()
        for variant in HOST_VARIANTS:
            mask_mode, launch, thread = variant
            if launch == "triton" and form != "FlashMask":
                continue
            fwd, fwd_bwd, chained = (_variant(f, *variant) for f in (fwd0, fwd_bwd0, chained0))
            full = variant == HOST_VARIANTS[0]  # do_bench / GPU time once per form
            for mode, fn, target in (("fwd", fwd, HOST_FWD_US),
                                     ("fwd+bwd", fwd_bwd, HOST_FWD_BWD_US),
                                     (CHAINED, chained, HOST_FWD_BWD_US)):
                if mode == "fwd" and thread != "device":
                    continue  # (the thread matters to the backward only)
                if mode == CHAINED and (mask_mode, launch) != ("reused", "fast"):
                    continue  # (a model's layers: one mask, the library's launcher)
                fields = dict(form=form, mask=mask_mode, launch=launch, autograd=thread, mode=mode,
                              S=seqlen, H=heads, D=d, docs=ndocs, target_us=target,
                              calls=CHAIN if mode == CHAINED else 1)
                specs.append((fields, fn, [q, k, v] if mode != "fwd" else [],
                              full and mode != CHAINED))
    torch.cuda.synchronize()
    samples = round_robin_host([(fn, leaves) for _, fn, leaves, _ in specs],
                               lambda fn, leaves: host_us(fn, leaves, samples=1))
    rows = []
    for (fields, fn, leaves, full), got in zip(specs, samples):
        got = [x / fields["calls"] for x in got]  # host µs per attention call
        host = statistics.median(got)
        rows.append(dict(fields, host_us=host, host_p10_us=_percentile(got, 0.1),
                         host_p90_us=_percentile(got, 0.9), rounds=len(got),
                         std_ms=standard_ms(fn, leaves or None) if full else None,
                         gpu_ms=gpu_ms(fn, leaves) if full else None,
                         kernels=kernels_per_call(fn) / fields["calls"],
                         met=host <= fields["target_us"]))
        print(json.dumps(rows[-1]), flush=True)
        if out_dir:
            name = (f"profile_{fields['form'].split()[0].lower()}_{fields['mask']}_{fields['launch']}_"
                    f"{fields['mode'].replace('+', '_').replace(', ', '_').replace(' ', '_')}.txt")
            with open(os.path.join(out_dir, name), "w") as f:
                f.write(host_profile_text(fn))
    return rows


if triton is not None:
    @triton.jit
    def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
        """x[:n] += 1: the trivial kernel of the host floor."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


class _Identity(torch.autograd.Function):
    """The cheapest autograd.Function: a view of its input, the gradient passed through."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def floor_rows(device: str, seqlen: int, heads: int, d: int, dtype, ndocs: int,
               measure=None, save=None) -> list[dict]:
    """Host µs of the smallest pieces of a call on this host (module docstring, "floor").
    ``measure(fn, leaves)``: the timer (``benchmarks.kernel.host_us`` on the GPU); ``save``:
    called with the rows after each one (so a timeout keeps what was measured). Flex's row
    comes last (it compiles)."""
    from flashmask3.kernels import launcher

    x = torch.randn(1, seqlen, heads, d, device=device, dtype=dtype)
    small = torch.zeros(1024, device=device)
    xg = torch.randn(64, device=device, requires_grad=True)
    g = torch.ones(64, device=device)
    pieces = [("torch.empty_like(q) (CUDA, 32K x 16 x 128 bf16)", lambda: torch.empty_like(x), None),
              ("x.add_(1) (a bare CUDA launch through torch)", lambda: small.add_(1), None),
              ("autograd.Function.apply of an identity", lambda: _Identity.apply(xg), None),
              ("... and its backward (autograd engine)",
               lambda: _Identity.apply(xg).backward(g), [xg]),
              ("... and its backward, calling-thread autograd (set_multithreading_enabled(False))",
               _variant(lambda: _Identity.apply(xg).backward(g), "reused", "fast", "calling"),
               [xg])]
    if triton is not None and (device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"):
        pieces += [("trivial Triton kernel via flashmask3 launcher",
                    lambda: launcher.launch(_add_one_kernel, (1,), small, 1024, BLOCK=1024), None),
                   ("trivial Triton kernel via JITFunction.run",
                    lambda: _add_one_kernel[(1,)](small, 1024, BLOCK=1024), None)]
    pieces.append(("flashmask_attention forward (the host table's call, for comparison)",
                   _calls(*_inputs(seqlen, heads, d, device, dtype),
                          M.causal_document_mask(_docs(seqlen, ndocs), device=device), False)[0],
                   None))
    pieces.append(("flex_attention forward (same size, block mask reused)",
                   _flex_forward(device, seqlen, heads, d, dtype, ndocs), None))
    rows = []
    for name, fn, leaves in pieces:
        if fn is None:
            continue
        for _ in range(3):
            fn()
        us = measure(fn, leaves) if measure else _cpu_us(fn)
        rows.append(dict(piece=name, host_us=us))
        print(json.dumps(rows[-1]), flush=True)
        if save:
            save(rows)
    return rows


def _flex_forward(device, seqlen, heads, d, dtype, ndocs):
    """A lazily built FlexAttention forward of the floor (None when Flex cannot run here)."""
    state = {}

    def fwd():
        if "fn" not in state:
            from benchmarks.kernel import flex_impl

            q, k, v = _inputs(seqlen, heads, d, device, dtype)
            fm = M.causal_document_mask(_docs(seqlen, ndocs), device=device)
            state["fn"] = flex_impl(fm, True, q, k, v, 1 / math.sqrt(d))[0]
        return state["fn"]()

    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return None
    if device == "cpu":  # (the dry run: Flex's block mask wants CUDA in this torch build)
        return None
    return fwd


def _cpu_us(fn, calls: int = 50) -> float:
    """µs per call by wall time (the dry run's stand-in for the GPU timer)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


#: The small table's third mode: each library's forward + backward (``autograd.grad`` inside)
#: under ``torch.compile(mode="reduce-overhead")``, inductor's CUDA graphs: one replay a call.
GRAPHS = "graphs"
#: The fourth: the same forward + backward captured by hand (:func:`flashmask3.graphs.capture`)
#: and timed as ``graph.replay()``: one CUDA graph launch a call, nothing else on the host (a
#: training step captured whole replays so; copying new inputs in is not timed).
CAPTURED = "captured"


def _graph_steps(s: int, d: int, cache: dict):
    """``(flashmask3 step, flex step)`` of length ``s`` under ``torch.compile(mode=
    "reduce-overhead")``, made once per length (masks, block masks and tensors are arguments,
    so a new mask of the length replays the same graph)."""
    if s not in cache:
        from torch.nn.attention.flex_attention import flex_attention

        def fm_step(q, k, v, mask, dout):
            out = flashmask3.flashmask_attention(q, k, v, mask)
            return torch.autograd.grad(out, (q, k, v), dout)

        def flex_step(q, k, v, block_mask, dout):
            out = flex_attention(q, k, v, block_mask=block_mask, scale=1 / math.sqrt(d))
            return torch.autograd.grad(out, (q, k, v), dout)

        cache[s] = tuple(torch.compile(fn, mode="reduce-overhead") for fn in (fm_step, flex_step))
    return cache[s]


def _graph_calls(s, d, mask, q, k, v, fleaves, cache):
    """Zero-argument calls of the two graph steps on this cell's inputs (None where building
    or warming one up failed, with the error printed)."""
    from benchmarks.kernel import flex_block_mask

    fm_step, flex_step = _graph_steps(s, d, cache)
    dout = torch.randn_like(q)
    bm = flex_block_mask(mask, True, 1, s, q.device)
    fdout = dout.transpose(1, 2).contiguous()
    calls = []
    for name, call in (("flashmask3", lambda: fm_step(q, k, v, mask, dout)),
                       ("flex", lambda: flex_step(*fleaves, bm, fdout))):
        try:
            for _ in range(3):  # inductor's warm-up, recording, a replay
                call()
            torch.cuda.synchronize()
            calls.append(call)
        except Exception as e:  # noqa: BLE001 - reported in the row, the table goes on
            print(f"graphs: {name} at S={s}: {type(e).__name__}: {e}", flush=True)
            calls.append(None)
    return calls


def _captured_calls(q, k, v, mask, d):
    """``graph.replay`` of each library's forward + backward captured by hand (on leaves no eager
    step used: :mod:`flashmask3.graphs` says why), None where the capture failed (the error
    printed)."""
    from benchmarks.kernel import flex_impl
    from flashmask3.graphs import capture

    calls = []
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fm_dout = torch.randn_like(q)
    ffwd, fleaves, _ = flex_impl(mask, True, q, k, v, 1 / math.sqrt(d))
    fdout = fm_dout.transpose(1, 2).contiguous()
    steps = (("flashmask3", lambda: torch.autograd.grad(
                  flashmask3.flashmask_attention(*leaves, mask), leaves, fm_dout)),
             ("flex", lambda: torch.autograd.grad(ffwd(), fleaves, fdout)))
    inputs = (leaves, fm_dout, ffwd, fleaves, fdout, mask)  # a graph holds no reference to what it reads
    for name, step in steps:
        try:
            graph, outputs = capture(step)
            graph.replay()
            torch.cuda.synchronize()
            calls.append(_Replay(graph, (inputs, outputs)))
        except Exception as e:  # noqa: BLE001 - reported in the row, the table goes on
            print(f"captured: {name}: {type(e).__name__}: {e}", flush=True)
            calls.append(None)
    return calls


class _Replay:
    """``graph.replay`` that keeps the captured step's inputs and outputs alive: the graph reads
    and writes their memory but does not own it (freed, it would be reused by other tensors)."""

    def __init__(self, graph, tensors):
        self.graph, self.tensors = graph, tensors

    def __call__(self):
        self.graph.replay()


def small_table(seqlens, heads: int, d: int, dtype, docs, graphs: bool = True) -> list[dict]:
    from benchmarks.kernel import flex_impl, standard_ms

    rows = []
    graph_cache: dict = {}
    modes = AUTOGRAD_THREADS + ((GRAPHS, CAPTURED) if graphs else ())
    for s in seqlens:
        for n in docs:
            q, k, v = _inputs(s, heads, d, "cuda", dtype, seed=s + n)
            mask = M.causal_document_mask(_docs(s, n), device="cuda")
            _, fm_fb, _ = _calls(q, k, v, mask, False)
            ffwd, fleaves, _ = flex_impl(mask, True, q, k, v, 1 / math.sqrt(d))
            fdout = torch.randn_like(ffwd())

            def flex_fb():
                ffwd().backward(fdout)

            for fn in (fm_fb, flex_fb):
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            fm_gpu, fx_gpu = gpu_ms(fm_fb, [q, k, v]), gpu_ms(flex_fb, fleaves)
            calls = {(who, t): (fn, leaves) for t in AUTOGRAD_THREADS
                     for who, fn, leaves in (("fm", fm_fb, [q, k, v]), ("flex", flex_fb, fleaves))}
            if graphs:
                fm_g, flex_g = _graph_calls(s, d, mask, q, k, v, fleaves, graph_cache)
                calls["fm", GRAPHS], calls["flex", GRAPHS] = (fm_g, None), (flex_g, None)
                fm_c, flex_c = _captured_calls(q, k, v, mask, d)
                calls["fm", CAPTURED], calls["flex", CAPTURED] = (fm_c, None), (flex_c, None)
            std = {key: [] for key in calls}
            for _ in range(SMALL_ROUNDS):  # both libraries and every mode in turn, as the host table
                for mode in modes:
                    with autograd_thread("device" if mode in (GRAPHS, CAPTURED) else mode):
                        for who in ("fm", "flex"):
                            fn, leaves = calls[who, mode]
                            if fn is not None:
                                std[who, mode].append(standard_ms(fn, leaves))
            for mode in modes:
                if not std["fm", mode] or not std["flex", mode]:
                    continue  # (a graph step that did not build: printed above)
                fm_std, fx_std = (statistics.median(std[who, mode]) for who in ("fm", "flex"))
                rows.append(dict(S=s, docs=n, H=heads, D=d, autograd=mode, fm_std_ms=fm_std,
                                 fm_gpu_ms=fm_gpu, flex_std_ms=fx_std, flex_gpu_ms=fx_gpu,
                                 fm_std_rounds_ms=std["fm", mode], flex_std_rounds_ms=std["flex", mode],
                                 fm_std_over_flex_std=fm_std / fx_std,
                                 fm_std_over_gpu=fm_std / fm_gpu, met_vs_flex=fm_std <= fx_std,
                                 met_vs_gpu=fm_std <= SMALL_VS_GPU * fm_gpu))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _range(xs) -> str:
    """``min-max`` of a cell's rounds (ms), ``-`` for files from before the rounds."""
    return f"{min(xs):.3f}-{max(xs):.3f}" if xs else "-"


def markdown(meta: dict, host: list[dict], small: list[dict], floor=()) -> str:
    lines = ["# Host path: host time per call and small problems", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in meta.items()]
    if floor:
        lines += ["", "Host floor (µs per call, CPU time to enqueue while the GPU is busy):", "",
                  "| piece | host µs |", "|---|---|"]
        lines += [f"| {r['piece']} | {r['host_us']:.1f} |" for r in floor]
    lines += ["", "Host µs = CPU time per call to enqueue while the GPU is busy; std = "
              "`triton.testing.do_bench` median (host work included); GPU = CUDA events behind "
              "a GPU sleep (host work hidden); kernels = CUDA kernels per call (profiler).", "",
              "mask: reused = one mask tensor every call (plans cached), fresh = plans rebuilt "
              "every call; launch: fast = flashmask3/kernels/launcher.py, triton = every "
              "kernel through JITFunction.run (FLASHMASK3_FAST_LAUNCH=0).", "",
              "autograd: the thread the engine runs the backward on, device = torch's default "
              "(its CUDA device thread), calling = `torch.autograd.set_multithreading_enabled("
              "False)`.", "",
              f"mode `{CHAINED}`: {CHAIN} forwards, each taking the previous output as its "
              "queries, and one backward of the last (a model's layers share a backward, so the "
              "engine's cost around a backward is paid once a step); host µs and kernels are per "
              f"attention call (the total over the chain / {CHAIN}).", "",
              f"host µs: the median of {HOST_ROUNDS} rounds in which every row takes one sample in "
              "turn (so the host's drift hits all rows alike); p10-p90: their spread.", "",
              "| form | mask | launch | autograd | mode | S | docs | host µs | p10-p90 | target | std ms "
              "| GPU ms | kernels |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    spread = lambda r: (f"{r['host_p10_us']:.0f}-{r['host_p90_us']:.0f}"  # noqa: E731
                        if r.get("host_p10_us") is not None else "-")
    ms = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for r in host:
        lines.append(f"| {r['form']} | {r.get('mask', 'reused')} | {r.get('launch', 'fast')} | "
                     f"{r.get('autograd', 'device')} | {r['mode']} | {r['S'] // 1024}K | {r['docs']} | "
                     f"{r['host_us']:.0f} | {spread(r)} | <= {r['target_us']:.0f} "
                     f"{'met' if r['met'] else 'MISSED'} | {ms(r['std_ms'])} | {ms(r['gpu_ms'])} | {r['kernels']:g} |")
    lines += ["", f"Small problems (fwd+bwd): each std cell is the median of {SMALL_ROUNDS} do_bench medians "
              "taken in turn with the other library and mode; fm std range: FlashMask's rounds. "
              f"autograd `{GRAPHS}`: each library's forward + backward under `torch.compile(mode="
              "\"reduce-overhead\")` (inductor's CUDA graphs; GPU columns: the eager calls'); "
              f"`{CAPTURED}`: each library's forward + backward captured by hand in one CUDA graph "
              "(`flashmask3.graphs.capture`), timed as `graph.replay()` (new inputs would be copied in "
              "first: not timed)."]
    lines += ["", "| S | docs | autograd | fm std f+b | fm GPU f+b | flex std f+b | flex GPU f+b "
              "| fm/flex (std) | fm std/GPU | fm std range |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in small:
        lines.append(f"| {r['S'] // 1024}K | {r['docs']} | {r.get('autograd', 'device')} | "
                     f"{r['fm_std_ms']:.3f} | {r['fm_gpu_ms']:.3f} | "
                     f"{r['flex_std_ms']:.3f} | {r['flex_gpu_ms']:.3f} | "
                     f"{r['fm_std_over_flex_std']:.2f} <= 1 {'met' if r['met_vs_flex'] else 'MISSED'} | "
                     f"{r['fm_std_over_gpu']:.2f} <= {SMALL_VS_GPU} "
                     f"{'met' if r['met_vs_gpu'] else 'MISSED'} | {_range(r.get('fm_std_rounds_ms'))} |")
    return "\n".join(lines) + "\n"


def dry_run() -> int:
    """The code path on the CPU (torch backend, tiny sizes): the calls, the profiler-free parts."""
    os.environ.setdefault("FLASHMASK3_BACKEND", "torch")
    q, k, v = _inputs(256, 2, 16, "cpu", torch.float32)
    fm = M.causal_document_mask(_docs(256, 5))

    def cpu_us(fn, leaves):
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)

    for mask, causal in ((fm, False), (fm.startend_row_indices, True)):
        fwd, fwd_bwd, chained = _calls(q, k, v, mask, causal)
        rows = ([(_variant(fwd_bwd, *variant), [q, k, v]) for variant in HOST_VARIANTS]
                + [(chained, [q, k, v]), (fwd, [])])
        fwd_us = statistics.median(round_robin_host(rows, cpu_us, rounds=3)[-1])
        print(f"dry run: {type(mask).__name__} fwd {fwd_us:.0f} µs (CPU, torch path)")
    print(markdown({"dry_run": True}, [dict(form="FlashMask", mode="fwd", S=256, docs=5, host_us=1.0,
                                            target_us=100, met=True, std_ms=0.0, gpu_ms=None,
                                            kernels=0, mask="fresh", launch="triton")],
                   [dict(S=4096, docs=5, fm_std_ms=1, fm_gpu_ms=1, flex_std_ms=1, flex_gpu_ms=1,
                         fm_std_over_flex_std=1, fm_std_over_gpu=1, met_vs_flex=True, met_vs_gpu=True)],
                   floor_rows("cpu", 256, 2, 16, torch.float32, 5)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/host-path")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--host-seqlen", type=int, default=32768)
    ap.add_argument("--host-docs", type=int, default=16)
    ap.add_argument("--small-seqlens", default="4096,8192")
    ap.add_argument("--small-docs", default="1,5")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--no-graphs", action="store_true",
                    help="the small table without its CUDA-graph rows (compiled and captured)")
    ap.add_argument("--skip-host", action="store_true", help="only the small-problem table")
    ap.add_argument("--floor", action="store_true", help="only the host floor (floor.json/.md)")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run()
    from benchmarks.environment import run_environment

    os.environ.setdefault("FLASHMASK3_BACKEND", "triton")
    torch._functorch.config.donated_buffer = False
    dtype, heads, d = torch.bfloat16, 16, 128
    meta = dict(run_environment(torch.device("cuda")), command=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    if args.floor:
        from benchmarks.kernel import host_us

        def save(rows):
            with open(os.path.join(args.out, "floor.json"), "w") as f:
                json.dump(dict(meta=meta, floor=rows), f, indent=1)
            with open(os.path.join(args.out, "floor.md"), "w") as f:
                f.write(markdown(meta, [], [], rows))

        floor_rows("cuda", args.host_seqlen, heads, d, dtype, args.host_docs, host_us, save)
        with open(os.path.join(args.out, "floor.md")) as f:
            print(f.read())
        return 0
    host = [] if args.skip_host else host_table(args.host_seqlen, heads, d, dtype, args.host_docs,
                                                 args.out)
    md = write(args.out, meta, host, [])  # (kept if the small table runs out of time)
    if not args.skip_small:
        small = small_table([int(x) for x in args.small_seqlens.split(",")], heads, d, dtype,
                            [int(x) for x in args.small_docs.split(",")], graphs=not args.no_graphs)
        md = write(args.out, meta, host, small)
    print(md)
    return 0


def write(out: str, meta: dict, host: list, small: list) -> str:
    """host_path.json and host_path.md under ``out``; returns the markdown."""
    with open(os.path.join(out, "host_path.json"), "w") as f:
        json.dump(dict(meta=meta, host=host, small=small), f, indent=1)
    md = markdown(meta, host, small)
    with open(os.path.join(out, "host_path.md"), "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    sys.exit(main())
