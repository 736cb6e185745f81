"""Does planning the next batch in a background thread slow the training step's host path?

The training loader (``flashmask3/train/loader.py``) packs, masks and plans the next batch in a
Python thread while the current step runs. Planning is Python and numpy (tens of ms at cp 128,
128K tokens); the step's eager CP layers are host-bound at high cp (docs/cp-runtime.md), and
both threads need the GIL. This times one rank's step of ``--layers`` eager layers (forward +
backward each, the real runtime, exchange emulated as in ``cp_single_gpu.py``) with no other
thread, with a thread that plans one new batch per step (a loader one batch ahead), and with a
thread that has the loader's worker process plan it (``planner="process"``), the modes
alternating within each repetition on the same inputs.

    python benchmarks/cp_planner_contention.py --cp 128 --layers 8 --out DIR
    python benchmarks/cp_planner_contention.py --device cpu --tokens 4096 --cp 8 --heads 2 \\
        --kv-heads 1 --head-dim 16 --dtype float32 --layers 2 --reps 2   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import flashmask3.masks as M  # noqa: E402
from benchmarks.corpus import document_spreads  # noqa: E402
from benchmarks.cp_single_gpu import DTYPES, Timer  # noqa: E402
from benchmarks.environment import run_environment  # noqa: E402
from flashmask3.distributed import EmulatedExchange, plan, prepare_rank, run_layer  # noqa: E402
from flashmask3.distributed.runtime import to_wire  # noqa: E402
from flashmask3.train.loader import ProcessPlanner  # noqa: E402


class Planner:
    """A thread that plans one batch each time :meth:`kick` is called (the loader preparing the
    next batch while a step runs), itself or (``process``: the training loader's
    :class:`~flashmask3.train.loader.ProcessPlanner`) in a worker process while it waits;
    :attr:`seconds` holds each plan's wall time."""

    def __init__(self, masks, cp: int, nodes: int, process=None):
        self.masks, self.cp, self.nodes, self.process = masks, cp, nodes, process
        self.go, self.done, self.stop = threading.Event(), threading.Event(), False
        self.seconds: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        i = 0
        while True:
            self.go.wait()
            self.go.clear()
            if self.stop:
                return
            t0 = time.perf_counter()
            m = self.masks[i % len(self.masks)]
            (self.process.plan if self.process else plan)(m.startend_row_indices, m.causal, self.cp,
                                                          balance="sparse", nodes=self.nodes)
            self.seconds.append(time.perf_counter() - t0)
            i += 1
            self.done.set()

    def kick(self):
        self.done.clear()
        self.go.set()

    def close(self):
        self.stop = True
        self.go.set()
        self.thread.join(timeout=10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    masks = [M.causal_document_mask(document_spreads(args.tokens, seed=s)["corpus"]) for s in range(3)]
    p = plan(masks[0], None, args.cp, balance="sparse", nodes=args.nodes)
    rank = max(range(p.cp_size), key=lambda r: (p.works[r], r))
    prog = prepare_rank(p, rank, device, "overlap")
    g = torch.Generator(device=device).manual_seed(0)
    fq, fdo = (torch.randn(1, args.tokens, args.heads, args.head_dim, generator=g, device=device, dtype=dtype)
               for _ in range(2))
    fk, fv = (torch.randn(1, args.tokens, args.kv_heads, args.head_dim, generator=g, device=device, dtype=dtype)
              for _ in range(2))
    ex = EmulatedExchange(to_wire(fk, fv, p.chunk_size), p.cp_size, rank, plan=p)
    q, k, v = (p.shard(t, rank).detach().requires_grad_() for t in (fq, fk, fv))
    do = p.shard(fdo, rank)
    scale = args.head_dim ** -0.5

    def step():
        for _ in range(args.layers):
            out, _ = run_layer(q, k, v, prog, ex, scale)
            out.backward(do)
        q.grad = k.grad = v.grad = None

    timer = Timer(device)
    for _ in range(2):
        step()
    alone = []
    for i in range(3):  # a plan with no step running (the main thread)
        t0 = time.perf_counter()
        plan(masks[i], None, args.cp, balance="sparse", nodes=args.nodes)
        alone.append(time.perf_counter() - t0)
    process = ProcessPlanner()
    planners = {"planning thread": Planner(masks, args.cp, args.nodes),
                "planning process": Planner(masks, args.cp, args.nodes, process)}
    for pl in planners.values():  # (the worker's start and imports, before any timing)
        pl.kick()
        pl.done.wait()
        pl.seconds.clear()
    rows = {"alone": [], **{m: [] for m in planners}}
    try:
        for _ in range(args.reps):  # the modes alternate within each repetition
            rows["alone"].append(timer(step))
            for m, pl in planners.items():
                pl.kick()  # the loader starts on the next batch as the step starts
                rows[m].append(timer(step))
                pl.done.wait()  # (a plan longer than the step: the step waits for the batch)
    finally:
        for pl in planners.values():
            pl.close()
        process.close()
    res = {"args": vars(args), "env": run_environment(device), "rank": rank,
           "plan_alone_seconds": alone,
           "plan_during_step_seconds": {m: pl.seconds for m, pl in planners.items()},
           "modes": {m: {"step_seconds": statistics.median(t for t, _ in r),
                         "host_seconds": statistics.median(h for _, h in r),
                         "samples": r} for m, r in rows.items()}}
    a = res["modes"]["alone"]
    print(f"cp {args.cp} rank {rank}, {args.layers} layers: step alone {a['step_seconds'] * 1e3:.2f} ms "
          f"(host {a['host_seconds'] * 1e3:.2f}); a plan alone {statistics.median(alone) * 1e3:.1f} ms")
    for m, pl in planners.items():
        b = res["modes"][m]
        print(f"  with a {m}: step {b['step_seconds'] * 1e3:.2f} ms (host {b['host_seconds'] * 1e3:.2f}): "
              f"{b['step_seconds'] / a['step_seconds']:.2f}x; a plan {statistics.median(pl.seconds) * 1e3:.1f} ms "
              "during the step (median)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cp_planner_contention.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
