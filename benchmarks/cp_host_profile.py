"""Where the host time of one context-parallel layer goes, on a GPU: one rank's forward +
backward through the staged runtime (``run_layer``, communication emulated by device copies
as in ``cp_single_gpu.py``), timed per piece.

Per (cp, layout): the round-robin host times (below) and, for the ``--variants``, one profiled
layer each: the launches outside and inside attention (``LaunchCounter``), torch.profiler's
CPU self time per aten op (the torch side) against the layer's wall time (the rest: Python,
Triton launches, autograd), cProfile's top functions of the package (cumulative, with its
own overhead: compare shares, not times). The host times are ``round_robin``: every
variant's layer in turn within each of ``--reps`` repetitions (medians and 90th
percentiles), so the VM's drifting host speed hits all variants alike (independent medians of
a few samples per variant gave contradictory orderings on this VM).

    python benchmarks/cp_host_profile.py --cp 16 64 [--variants current no-bound] [--out DIR]

Variants, in the same run on the same inputs: ``current``; ``no-memo`` (a fresh PreparedCall
per attention call, as before session 24); ``no-merge-kernel`` (the forward's stage partials
merged by torch ops instead of the one-launch Triton merge); ``before`` (both, i.e. the host
path of session 23); ``no-bound`` (the prepared Gluon forward and dK/dV launches, ``launcher.Bound``, through
``launcher.launch`` with their descriptors rebuilt on every call, as before session 27);
``no-cached-bound`` (the small kernels bound once per configuration by ``launcher.cached_bound``
-- the backward's pre-pass and dQ scaling since session 37, the runtime's merge, key gather,
wire pack and gradient sum since session 39 -- launched through ``launcher.launch`` on every
call, as before: the same arguments, plus the cost of building them as a bound launch's
template, a few µs a launch against this variant).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashmask3.masks as M  # noqa: E402
from benchmarks.corpus import document_spreads  # noqa: E402
from flashmask3.distributed import EmulatedExchange, LaunchCounter, plan, prepare_rank, run_layer  # noqa: E402
from flashmask3.distributed.runtime import to_wire  # noqa: E402
from flashmask3.kernels import gather, launcher, merge, returns, tl_kernels, triton_backend as tb  # noqa: E402

SLEEP = 200_000_000  # cycles of torch.cuda._sleep: ~100 ms, longer than any host loop here


VARIANTS = ("current", "no-memo", "no-merge-kernel", "before", "no-bound", "no-cached-bound")
#: the modules whose small launches go through ``launcher.cached_bound``
CACHED_BOUND_USERS = (tl_kernels, gather, merge, returns)


_bound_call = launcher.Bound.__call__


def _unbound_call(self, *tensors):
    """A :class:`launcher.Bound` launch as before session 27: through ``launcher.launch``."""
    return self._launch(tensors)


def _relaunched(key, build):
    """:func:`launcher.cached_bound` as before it: a launch through ``launcher.launch`` on every
    call (``Bound.once``, which builds no fast path)."""
    return launcher.Bound(*build()).once


@contextlib.contextmanager
def variant(name: str):
    """The Triton backend with this session's host-path changes taken out (see the module doc)."""
    saved = {"prepare": tb.prepare, "merge_stages": tb.merge_stages}
    if name in ("no-memo", "before"):
        tb.prepare = lambda q, k, cols, causal, scale, row_span=None: tb.PreparedCall(
            q, k, cols, causal, scale, row_span)
    if name in ("no-merge-kernel", "before"):
        del tb.merge_stages
    if name == "no-bound":  # every Bound launch through launcher.launch (its key, descriptors)
        launcher.Bound.__call__ = _unbound_call
    if name == "no-cached-bound":
        for m in CACHED_BOUND_USERS:
            m.cached_bound = _relaunched
    try:
        yield
    finally:
        for key, val in saved.items():
            setattr(tb, key, val)
        launcher.Bound.__call__ = _bound_call
        for m in CACHED_BOUND_USERS:
            m.cached_bound = launcher.cached_bound


def profile_rank(p, rank, layout_calls, tensors, scale):
    full_q, full_k, full_v, full_do, full_wire = tensors
    dev = full_q.device
    prog = prepare_rank(p, rank, dev, "overlap", layout_calls)
    q, k, v = (p.shard(t, rank).detach().requires_grad_() for t in (full_q, full_k, full_v))
    do = p.shard(full_do, rank)
    ex = EmulatedExchange(full_wire, p.cp_size, rank, plan=p)
    state = {}

    def fwd():
        state["out"], _ = run_layer(q, k, v, prog, ex, scale)

    def bwd():
        state["out"].backward(do)

    def layer():
        fwd()
        bwd()
        q.grad = k.grad = v.grad = None

    for _ in range(3):
        layer()
    with LaunchCounter() as counter:
        layer()
    res = {"rank": rank, "backward_calls": prog.backward_calls,
           "stages": sum(1 for s in prog.stage_chunks if s), "launches": counter.launches,
           "attention_launches": counter.attention_launches,
           "attention_calls": counter.attention_calls}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.cuda._sleep(SLEEP)
        t0 = time.perf_counter()
        layer()
        wall = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    ops = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
           if e.key.startswith("aten::") or e.key.startswith("cuda")]
    ops.sort(key=lambda x: -x[2])
    res["profiled_wall_ms"] = wall
    res["aten_self_cpu_ms"] = sum(x[2] for x in ops if x[0].startswith("aten::"))
    res["top_ops"] = [(n, c, round(ms, 3)) for n, c, ms in ops[:25]]
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    pr.enable()
    layer()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr).stats
    rows = sorted(((v[3] * 1e3, v[2] * 1e3, v[1], f"{k[0].split(os.sep)[-1]}:{k[2]}")
                   for k, v in st.items() if f"{os.sep}flashmask3{os.sep}" in k[0]), reverse=True)
    res["cprofile_total_ms"] = sum(v[2] for v in st.values()) * 1e3
    res["cprofile_top"] = [(n, c, round(cum, 3), round(tot, 3)) for cum, tot, c, n in rows[:30]]
    return res


def round_robin_host_ms(p, rank, tensors, scale, variants, reps):
    """Host ms (median, 90th percentile) of the layer, its forward and its backward per
    variant, the variants measured in turn within every repetition, so drift of this VM's host
    speed hits them alike. Host ms = CPU time to enqueue while the GPU sleeps."""
    full_q, full_k, full_v, full_do, full_wire = tensors
    dev = full_q.device
    runs = {}
    for name in variants:
        prog = prepare_rank(p, rank, dev, "overlap", "auto")
        q, k, v = (p.shard(t, rank).detach().requires_grad_() for t in (full_q, full_k, full_v))
        runs[name] = (prog, q, k, v, p.shard(full_do, rank),
                      EmulatedExchange(full_wire, p.cp_size, rank, plan=p))
    times = {name: {"layer": [], "fwd": [], "bwd": []} for name in variants}
    for rep in range(reps + 2):
        # rotated each repetition: each variant follows each other equally often
        for name in variants[rep % len(variants):] + variants[:rep % len(variants)]:
            prog, q, k, v, do, ex = runs[name]
            with variant(name):
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP)
                t0 = time.perf_counter()
                out, _ = run_layer(q, k, v, prog, ex, scale)
                t1 = time.perf_counter()
                out.backward(do)
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                q.grad = k.grad = v.grad = None
            if rep >= 2:  # two warm-up rounds
                times[name]["fwd"].append((t1 - t0) * 1e3)
                times[name]["bwd"].append((t2 - t1) * 1e3)
                times[name]["layer"].append((t2 - t0) * 1e3)
    return {name: {part: round(statistics.median(ts), 3) for part, ts in parts.items()}
            | {f"{part}_p90": round(_p90(ts), 3) for part, ts in parts.items()}
            for name, parts in times.items()}


def _p90(xs) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=["current"])
    ap.add_argument("--reps", type=int, default=25, help="round-robin repetitions per variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    mask = M.causal_document_mask(document_spreads(args.tokens, seed=0)["corpus"])
    g = torch.Generator(device=dev).manual_seed(0)
    full_q, full_do = (torch.randn(1, args.tokens, 16, 128, generator=g, device=dev,
                                   dtype=torch.bfloat16) for _ in range(2))
    full_k, full_v = (torch.randn(1, args.tokens, 8, 128, generator=g, device=dev,
                                  dtype=torch.bfloat16) for _ in range(2))
    import triton

    out = {"env": {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "command": " ".join(sys.argv)}, "runs": [], "round_robin": []}
    for cp in args.cp:
        for hier in (False, True):
            nodes = max(1, cp // 8) if hier else 1
            if hier and nodes == 1:
                continue
            p = plan(mask, None, cp, balance="sparse", nodes=nodes)
            wire = to_wire(full_k, full_v, p.chunk_size)
            rank = max(range(cp), key=lambda r: p.work(r))
            tensors = (full_q, full_k, full_v, full_do, wire)
            rr = round_robin_host_ms(p, rank, tensors, 128 ** -0.5, args.variants, args.reps)
            out["round_robin"].append({"cp": cp, "nodes": nodes, "rank": rank, "reps": args.reps,
                                       "host_ms": rr})
            print(json.dumps(out["round_robin"][-1]))
            for name in args.variants:
                with variant(name):
                    r = profile_rank(p, rank, "auto", (full_q, full_k, full_v, full_do, wire),
                                     128 ** -0.5)
                r.update(cp=cp, nodes=nodes, variant=name)
                out["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("top_ops", "cprofile_top")}))
                for row in r["top_ops"][:15]:
                    print("   op", row)
                for row in r["cprofile_top"][:22]:
                    print("   py", row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cp_host_profile.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
