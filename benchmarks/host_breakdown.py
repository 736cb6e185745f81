"""Where the host time of one attention call goes, piece by piece (issue 25), on the GPU.

Every row is host µs per call (``benchmarks.kernel.host_us``: CPU time to enqueue while the GPU
is kept busy). Pieces: the autograd engine's floor (an identity Function, its backward with the
engine's device thread and without it, ``torch.autograd.grad``), our forward and fwd+bwd through
the public call and with layers peeled off (no key lookup, no autograd Function, the backend
call, each kernel launch replayed alone through the launcher and through Triton's compiled
``run``), and the torch allocations a call makes. A cProfile of the forward and of the
backward's body is written next to the JSON.

    python benchmarks/host_breakdown.py --out $OUT/host-breakdown     # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashmask3  # noqa: E402
import flashmask3.masks as M  # noqa: E402
from flashmask3 import api  # noqa: E402
from flashmask3.kernels import launcher  # noqa: E402
from benchmarks.host_path import _Identity, autograd_thread, host_profile_text  # noqa: E402


def _captured_launches(fn):
    """(kernel name, replay via launcher.launch, replay via compiled.run) of every launch of
    one call of ``fn`` (the launcher's hit path)."""
    seen = []
    orig = launcher.launch

    def spy(kernel, grid, *args, **kwargs):
        seen.append((kernel, grid, args, kwargs))
        return orig(kernel, grid, *args, **kwargs)

    mods = [m for m in list(sys.modules.values())
            if m is not None and getattr(m, "__name__", "").startswith("flashmask3.kernels")
            and getattr(m, "launch", None) is orig]
    for m in mods:
        m.launch = spy
    try:
        fn()
    finally:
        for m in mods:
            m.launch = orig
    out = []
    for kernel, grid, args, kwargs in seen:
        entry = None
        for e in launcher._COMPILED.values():
            if e.kernel is kernel:
                entry = e
        name = getattr(kernel, "__name__", str(kernel))
        via_launcher = (lambda k=kernel, g=grid, a=args, kw=kwargs: orig(k, g, *a, **kw))
        via_run = None
        if entry is not None:
            full = list(args) + [kwargs.get(n, d) for n, d in entry.tail]
            c = entry.compiled
            gx = grid[0]
            gy = grid[1] if len(grid) > 1 else 1
            gz = grid[2] if len(grid) > 2 else 1

            def via_run(c=c, full=full, gx=gx, gy=gy, gz=gz):
                s = torch.cuda.current_stream().cuda_stream
                c.run(gx, gy, gz, s, c.function, c.packed_metadata, None, None, None, *full)
        out.append((name, via_launcher, via_run))
    return out


def _timed_runs(work, reps: int, into: list) -> None:
    """Run ``work`` ``reps`` times, appending each run's µs to ``into``."""
    clock = time.perf_counter
    for _ in range(reps):
        t0 = clock()
        work()
        into.append((clock() - t0) * 1e6)


class _Repeat(torch.autograd.Function):
    """An identity whose backward first runs ``work`` ``reps`` times, timing each run from the
    inside (``_Repeat.times``, µs): the same piece of host work on whichever thread the engine
    runs the backward on."""

    times: list = []

    @staticmethod
    def forward(ctx, x, work, reps):
        ctx.work, ctx.reps = work, reps
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _timed_runs(ctx.work, ctx.reps, _Repeat.times)
        return g, None, None


def thread_rows(pieces, xg, gg, reps: int = 10) -> list[dict]:
    """Median µs of each ``(name, work)`` piece run inside a backward, on the engine's device
    thread and on the calling thread (``set_multithreading_enabled(False)``), and outside any
    backward: where the device thread's extra cost of a fwd+bwd goes."""
    rows = []
    for name, work in pieces:
        row = dict(piece=name)
        for where in ("device", "calling", "outside"):
            _Repeat.times = []
            for _ in range(12):
                if where == "outside":
                    _timed_runs(work, reps, _Repeat.times)
                else:
                    with autograd_thread(where):
                        _Repeat.apply(xg, work, reps).backward(gg)
                torch.cuda.synchronize()  # never a full launch queue
            row[where] = statistics.median(_Repeat.times[reps * 2:])  # first two rounds: warm-up
        rows.append(row)
        print(f"{row['device']:9.1f} {row['calling']:9.1f} {row['outside']:9.1f}  {name} "
              "(device thread / calling thread / outside a backward, us)", flush=True)
    return rows


def _spin(us: float) -> None:
    """Keep the CPU busy for ``us`` microseconds (no sleep)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def handoff_rows(xg, gg, host_us, lengths=(0, 25, 50, 100, 200, 400)) -> list[dict]:
    """Host µs of an identity's ``apply(x).backward()`` whose backward spins for ``us`` µs
    (:class:`_Repeat` with one :func:`_spin`), minus the spin, with the engine's device thread
    and on the calling thread, for backwards of ``lengths`` µs: the engine's cost around one
    backward, by the backward's length."""
    rows = []
    for us in lengths:
        row = dict(backward_us=us)
        for where in ("device", "calling"):
            with autograd_thread(where):
                t = host_us(lambda: _Repeat.apply(xg, lambda: _spin(us), 1).backward(gg), [xg], samples=7)
            row[where] = t - us
        rows.append(row)
        print(f"{row['device']:9.1f} {row['calling']:9.1f}  engine cost around a {us} us backward "
              "(device thread / calling thread, us)", flush=True)
    return rows


def _unbound_call(self, *tensors):
    """A :class:`launcher.Bound` launch as before session 27: through ``launcher.launch``."""
    return self._launch(tensors)


def bound_ab_rows(fns: dict, host_us, reps: int = 15) -> list[dict]:
    """Host µs of each ``name -> (fn, leaves)`` with the prepared launches' fast path
    (``launcher.Bound``, current) and without it (every Bound launch through
    ``launcher.launch``: its key, descriptors rebuilt), the two alternating within every
    repetition (order flipped each time), medians of ``reps`` (this VM's host speed drifts)."""
    bound_call = launcher.Bound.__call__
    rows = []
    for name, (fn, leaves) in fns.items():
        times = {"bound": [], "launch": []}
        for rep in range(reps):
            for arm in (("bound", "launch") if rep % 2 == 0 else ("launch", "bound")):
                launcher.Bound.__call__ = bound_call if arm == "bound" else _unbound_call
                try:
                    fn()
                    times[arm].append(host_us(fn, leaves, samples=1))
                finally:
                    launcher.Bound.__call__ = bound_call
        row = dict(piece=name, bound_us=statistics.median(times["bound"]),
                   launch_us=statistics.median(times["launch"]), reps=reps)
        rows.append(row)
        print(f"{row['bound_us']:9.1f} {row['launch_us']:9.1f}  {name} (bound, launch)",
              flush=True)
    return rows


def main(argv=None) -> int:
    from benchmarks.kernel import host_us

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/host-breakdown")
    ap.add_argument("--seqlen", type=int, default=32768)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("FLASHMASK3_BACKEND", "triton")
    dev, dt, s, h, d = "cuda", torch.bfloat16, args.seqlen, 16, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=dt, generator=g).requires_grad_()
               for _ in range(3))
    docs = [s // 16] * 16
    fm = M.causal_document_mask(docs, device=dev)
    dout = torch.randn(1, s, h, d, device=dev, dtype=dt, generator=g)
    xg = torch.randn(64, device=dev, requires_grad=True)
    gg = torch.ones(64, device=dev)
    rows = []

    def add(name, fn, leaves=None):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        us = host_us(fn, leaves, samples=7)
        rows.append(dict(piece=name, host_us=us))
        print(f"{us:9.1f}  {name}", flush=True)

    def fwd():
        return flashmask3.flashmask_attention(q, k, v, fm)

    def fwd_bwd():
        fwd().backward(dout)

    def fwd_grad():
        torch.autograd.grad(fwd(), (q, k, v), dout)

    def fwd_bwd_1t():
        with autograd_thread("calling"):
            fwd().backward(dout)

    def fwd_grad_1t():
        with autograd_thread("calling"):
            torch.autograd.grad(fwd(), (q, k, v), dout)

    # the engine's floor
    add("identity apply", lambda: _Identity.apply(xg))
    add("identity apply + .backward (engine device thread)", lambda: _Identity.apply(xg).backward(gg), [xg])
    add("identity apply + autograd.grad", lambda: torch.autograd.grad(_Identity.apply(xg), xg, gg))
    with autograd_thread("calling"):
        add("identity apply + .backward, single-thread autograd", lambda: _Identity.apply(xg).backward(gg), [xg])
        add("identity apply + autograd.grad, single-thread autograd",
            lambda: torch.autograd.grad(_Identity.apply(xg), xg, gg))
    add("torch.empty_like(q)", lambda: torch.empty_like(q))
    add("torch.empty lse [1,16,S] fp32", lambda: torch.empty((1, h, s), dtype=torch.float32, device=dev))
    small = torch.zeros(1024, device=dev)
    add("x.add_(1)", lambda: small.add_(1))

    # ours, whole
    fwd_bwd()
    add("fwd (public, FlashMask reused)", fwd)
    add("fwd+bwd .backward (grads accumulate)", fwd_bwd, [q, k, v])
    add("fwd+bwd autograd.grad", fwd_grad)
    add("fwd+bwd .backward, single-thread autograd", fwd_bwd_1t, [q, k, v])
    add("fwd+bwd autograd.grad, single-thread autograd", fwd_grad_1t)

    # ours, peeled
    key = api._call_key(q, k, v, fm, False, None)
    prepared = api._PREPARED[key]
    cols = fm.startend_row_indices.contiguous()
    call = prepared.call
    add("api._call_key", lambda: api._call_key(q, k, v, fm, False, None))
    add("prepared.run (no key)", lambda: prepared.run(q, k, v, fm))
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def forward_body():
        return call.forward(qd, kd, vd, cols)

    add("call.forward (no autograd Function)", forward_body)
    out, lse = forward_body()

    def backward_body():
        call.backward(dout, None, qd, kd, vd, out, lse, cols)

    add("call.backward (the backward body, no engine)", backward_body)
    bwd_launches = _captured_launches(backward_body)
    for name, via_l, via_r in _captured_launches(forward_body) + bwd_launches:
        add(f"launch {name} via launcher.launch", via_l)
        if via_r is not None:
            add(f"launch {name} via compiled.run", via_r)

    # the prepared Gluon launches (launcher.Bound) against launcher.launch, round robin
    ab = bound_ab_rows({"fwd (public)": (fwd, None), "fwd+bwd .backward": (fwd_bwd, [q, k, v]),
                        "call.forward": (forward_body, None),
                        "call.backward": (backward_body, None)}, host_us)

    # the same host work inside a backward on either thread (the device thread's extra cost)
    pieces = [("call.backward (the backward body)", backward_body),
              ("call.forward", forward_body),
              ("torch.empty_like(q)", lambda: torch.empty_like(q)),
              ("x.add_(1)", lambda: small.add_(1)),
              ("torch.cuda.current_stream()", torch.cuda.current_stream),
              ("python loop of 1000 adds", lambda: sum(range(1000)))]
    pieces += [(f"launch {name} via launcher.launch", via_l) for name, via_l, _ in bwd_launches]
    thread = thread_rows(pieces, xg, gg)
    # once per backward, as a real backward runs it (caches cold on the engine thread's core)
    for r in thread_rows(pieces[:2], xg, gg, reps=1):
        r["piece"] += ", once per backward"
        thread.append(r)
    handoff = handoff_rows(xg, gg, host_us)

    # per call in a model: 8 calls chained (each call's output is the next one's query), one
    # backward: the engine's hand-offs are paid once per backward, not once per call
    def chain_fwd_bwd(n=8):
        x = q
        for _ in range(n):
            x = flashmask3.flashmask_attention(x, k, v, fm)
        x.backward(dout)

    for where in ("device", "calling"):
        with autograd_thread(where):
            add(f"fwd+bwd per call of 8 chained calls, one .backward ({where} thread), total / 8",
                chain_fwd_bwd, [q, k, v])
            rows[-1]["host_us"] /= 8
            print(f"   (per call: {rows[-1]['host_us']:.1f})", flush=True)

    with open(os.path.join(args.out, "profile_forward.txt"), "w") as f:
        f.write(host_profile_text(fwd))
    with open(os.path.join(args.out, "profile_backward_body.txt"), "w") as f:
        f.write(host_profile_text(backward_body))
    with open(os.path.join(args.out, "profile_fwd_bwd.txt"), "w") as f:
        f.write(host_profile_text(fwd_grad))
    from benchmarks.environment import run_environment
    meta = dict(run_environment(torch.device(dev)), command=" ".join(sys.argv))
    with open(os.path.join(args.out, "host_breakdown.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, threads=thread, handoff=handoff, bound_ab=ab), f,
                  indent=1)
    with open(os.path.join(args.out, "host_breakdown.md"), "w") as f:
        f.write(markdown(meta, rows, thread, handoff, ab))
    return 0


def markdown(meta: dict, rows: list[dict], thread: list[dict] = (), handoff: list[dict] = (),
             bound_ab: list[dict] = ()) -> str:
    lines = ["# Host time of one attention call, piece by piece", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in meta.items()]
    lines += ["", "Host µs per call = CPU time to enqueue while the GPU is kept busy "
              "(`benchmarks.kernel.host_us`, median of 7 samples). 32K tokens, 16 heads, D=128, "
              "bf16, 16 causal documents, one FlashMask reused. 'single-thread autograd' = "
              "`torch.autograd.set_multithreading_enabled(False)`: the backward runs on the "
              "calling thread instead of the engine's CUDA device thread.", "",
              "| piece | host µs |", "|---|---|"]
    lines += [f"| {r['piece']} | {r['host_us']:.1f} |" for r in rows]
    if thread:
        lines += ["", "The same host work timed from inside a backward (`_Repeat`: median µs of one "
                  "run of the piece) on the engine's device thread, on the calling thread, and "
                  "outside any backward:", "",
                  "| piece | device thread µs | calling thread µs | outside µs |", "|---|---|---|---|"]
        lines += [f"| {r['piece']} | {r['device']:.1f} | {r['calling']:.1f} | {r['outside']:.1f} |"
                  for r in thread]
    if handoff:
        lines += ["", "The engine's cost around one backward (`_Busy`: an identity whose backward spins "
                  "for the given time; host µs of apply + `.backward()` minus the spin):", "",
                  "| backward length µs | device thread µs | calling thread µs |", "|---|---|---|"]
        lines += [f"| {r['backward_us']} | {r['device']:.1f} | {r['calling']:.1f} |" for r in handoff]
    if bound_ab:
        lines += ["", "The prepared Gluon forward and dK/dV launches (`launcher.Bound`: the C "
                  "launcher's argument list built once, descriptors cached per pointer) against "
                  "the same launches through `launcher.launch` (key, descriptors rebuilt every "
                  "call), alternating within each repetition (medians of host µs):", "",
                  "| call | bound µs | launch µs | saved µs |", "|---|---|---|---|"]
        lines += [f"| {r['piece']} | {r['bound_us']:.1f} | {r['launch_us']:.1f} | "
                  f"{r['launch_us'] - r['bound_us']:.1f} |" for r in bound_ab]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
