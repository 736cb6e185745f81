"""One layer of context-parallel attention, every rank's real staged path, on ONE GPU.

For each cp size and layout, every (sampled) rank runs forward + backward of one attention layer
through the runtime that ``cp_flashmask_attention`` uses -- its ``prepare_rank`` program, its
local mask, its stages in arrival order, its gradient returns -- with communication replaced
by device copies in one process (``EmulatedExchange``). Per rank: the layer's time (CUDA
events around the whole step, so a host-bound step shows as host time), the host's time to
issue it, and its kernel launches outside the attention calls (``LaunchCounter``, copies not
counted). The slowest rank sets the step time of a real run.

Layouts: ``dual_chunk+allgather`` (the baseline), ``sparse+allgather``, ``sparse+overlap``
flat and hierarchical (``nodes = cp / 8``, 8 GPUs a node), ``sparse+overlap bwd per stage``
(the flat layout with one whole backend backward per stage instead of the staged backward: the
A/B of kernels/staged.py) and ``sparse+overlap torch returns`` (the returned gradients summed by
torch ops instead of kernels/returns.py: its A/B). Causal document masks from the real corpus lengths of
benchmarks/corpus.py. ``--backward-calls stage one one+local`` measures every overlap layout
once per mode (entries ``"<layout> bwd=<mode>"``; ``auto``, the default, keeps the layout's
name): the A/B of the overlapped backward's calls (docs/cp-runtime.md "Backward calls").

    python benchmarks/cp_single_gpu.py                      # H200: 128K, cp 8 32 128, bf16
    python benchmarks/cp_single_gpu.py --device cpu --tokens 4096 --cp 4 8 --heads 2 \\
        --kv-heads 1 --head-dim 16 --dtype float32 --iters 1 --warmup 0   # CPU dry run
    python benchmarks/cp_single_gpu.py --cp 16 32 --configs sparse+overlap "sparse+overlap hier" \
        --backward-calls stage one one+local --check          # A/B of the backward's calls

Ranks: all at cp <= ``--all-ranks-up-to`` (8), else the ``--heaviest`` (8) heaviest by
attention work plus ``--random`` (8) others drawn with ``--seed``, and the rank needing the
most K/V. Writes ``cp_runtime.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import flashmask3.masks as M  # noqa: E402
from benchmarks.corpus import document_spreads  # noqa: E402
from benchmarks.environment import run_environment  # noqa: E402
from flashmask3.distributed import (BACKWARD_CALL_MODES, EmulatedExchange, LaunchCounter,  # noqa: E402
                                    plan, prepare_rank, run_layer)
from flashmask3.distributed.placement import DEFAULT_TOLERANCE  # noqa: E402
from flashmask3.distributed.runtime import to_wire  # noqa: E402
from flashmask3.graphs import capture  # noqa: E402
from flashmask3.kernels import choose_backend, get_backend  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: name -> (balance, comm, hierarchical)
CONFIGS = {
    "dual_chunk+allgather": ("dual_chunk", "allgather", False),
    "sparse+allgather": ("sparse", "allgather", False),
    "sparse+overlap": ("sparse", "overlap", False),
    "sparse+overlap hier": ("sparse", "overlap", True),
    "sparse+overlap bwd per stage": ("sparse", "overlap", False),
    "sparse+overlap torch returns": ("sparse", "overlap", False),
    "sparse+overlap hier torch returns": ("sparse", "overlap", True),
    # PyTorch's document-aware placement in our runtime (session 37: the scale model predicts it
    # ahead of sparse at cp 16, behind at cp 32-128)
    "ptrr+allgather": ("ptrr", "allgather", False),
    "ptrr+overlap hier": ("ptrr", "overlap", True),
}
#: Layouts whose backward calls the backend's whole ``backward`` once per stage (the runtime
#: before the staged backward: pre-pass, dQ memset and scaling repeated per stage), for A/B.
WHOLE_BACKWARD = {"sparse+overlap bwd per stage"}
#: Layouts whose returned gradients (and a relay's sums, hierarchical) are summed by the
#: runtime's torch ops instead of the backend's one-launch kernels (kernels/returns.py), for A/B.
TORCH_RETURNS = {"sparse+overlap torch returns", "sparse+overlap hier torch returns"}
GPUS_PER_NODE = 8


#: The backend functions each A/B layout hides (the runtime then does without them).
STAGED_BACKWARD = ("backward_prepare", "backward_stage", "backward_finish")
RETURNS_KERNEL = ("add_returns", "sum_wire_rows", "returns_usable")
GATHER_KERNEL = ("gather_keys", "pack_wire", "wire_usable")


def hidden_functions(name: str) -> tuple:
    """The backend functions layout ``name`` runs without (its A/B arm), or ()."""
    return STAGED_BACKWARD if name in WHOLE_BACKWARD else RETURNS_KERNEL if name in TORCH_RETURNS else ()


class Without:
    """``backend`` with the optional functions ``names`` hidden, everything else as it is: the
    runtime falls back to what it does without them (``STAGED_BACKWARD``: one whole backward
    per stage, kernels/staged.py's WholeCallStages; ``RETURNS_KERNEL``: the returned gradients
    summed by torch ops; ``GATHER_KERNEL``: the moves between wire rows and the key layout by torch ops). One optional function per A/B, the rest of the backend unchanged."""

    def __init__(self, backend, names):
        self._backend, self._hidden = backend, frozenset(names)

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._backend, name)


def sample_ranks(p, args) -> list[int]:
    """Every rank at small cp; else the heaviest by work, some random ones and the one needing
    the most K/V (the two candidates for the slowest rank)."""
    if p.cp_size <= args.all_ranks_up_to:
        return list(range(p.cp_size))
    works = p.works
    heavy = sorted(range(p.cp_size), key=lambda r: (-works[r], r))[:args.heaviest]
    most_kv = max(range(p.cp_size), key=lambda r: (len(p.needed_chunks(r)), -r))
    rest = [r for r in range(p.cp_size) if r not in heavy and r != most_kv]
    picked = random.Random(args.seed).sample(rest, min(args.random, len(rest)))
    return sorted(set(heavy) | {most_kv} | set(picked))


class Timer:
    """Layer time (CUDA events on a GPU, wall clock on the CPU) and host issue time of a step."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, step) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step()
            host = time.perf_counter() - t0
            stop.record()
            torch.cuda.synchronize()
            return start.elapsed_time(stop) * 1e-3, host
        t0 = time.perf_counter()
        step()
        host = time.perf_counter() - t0
        return host, host


#: flashmask3's own kernels (Triton / Gluon functions are named ``_<what>_kernel``); every other
#: kernel of a layer is a torch op of the runtime (copies, casts, index_add, ...).
OWN_KERNEL = re.compile(r"^_\w+_kernel$")


def kernel_breakdown(step, timer) -> dict:
    """Where one layer's GPU time goes: one ``step`` under torch.profiler (CUDA activity), its
    kernels in launch order. ``layer_ms``: the step's CUDA-event time (as :class:`Timer`, the
    profiler's own host cost included); ``busy_ms``: the union of its kernels' intervals;
    ``idle_ms``: the span from the first kernel's start to the last one's end minus the busy
    time (the GPU waiting for the host inside the layer; the wait before the first kernel is
    ``layer_ms`` minus the span); ``own``: flashmask3's kernels (:data:`OWN_KERNEL`: the
    attention calls, their pre-pass, merges, sums and plans) in launch order as ``[name, ms]``;
    ``torch_ms``: the other kernels' total, ``torch_top``: the largest of them by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer, host = timer(step)
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda x: x[0])
    busy, reach = 0.0, None
    for start, end, _ in kernels:  # union of the intervals
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    own = [[name, (end - start) * 1e-3] for start, end, name in kernels if OWN_KERNEL.match(name)]
    torch_by = {}
    for start, end, name in kernels:
        if not OWN_KERNEL.match(name):
            torch_by[name] = torch_by.get(name, 0.0) + (end - start) * 1e-3
    top = sorted(torch_by.items(), key=lambda kv: -kv[1])[:8]
    return {"layer_ms": layer * 1e3, "host_ms": host * 1e3, "kernels": len(kernels),
            "busy_ms": busy * 1e-3, "span_ms": span * 1e-3, "idle_ms": (span - busy) * 1e-3,
            "own": own, "own_ms": sum(ms for _, ms in own),
            "torch_ms": sum(torch_by.values()), "torch_top": [[n[:120], ms] for n, ms in top]}


def reference(mask, full_q, full_k, full_v, full_do):
    """Single-device output and dQ of the whole sequence (the emulation's forward and dQ are
    exact, its returned dK/dV are not: see EmulatedExchange)."""
    from flashmask3 import flashmask_attention

    q = full_q.detach().requires_grad_()
    out = flashmask_attention(q, full_k, full_v, mask.to(full_q.device))
    out.backward(full_do)
    return out.detach(), q.grad


def graph_layer(step, eager_step, timer, iters: int) -> dict:
    """The layer ``step`` (returns the output and the gradients of q, k, v, whose leaves are new
    to autograd: ``flashmask3.graphs.capture``) captured once in a CUDA graph and replayed: the
    median layer and host seconds of one replay (the host issues one graph launch, so the layer
    runs at the GPU's pace), and the largest deviation of the replayed output and dQ from
    ``eager_step`` (the same layer on leaves of their own, sharing the inputs' memory; the fused
    dQ's fp32 atomics are not bitwise reproducible)."""
    graph, captured = capture(step)
    graph.replay()
    eager = eager_step()
    err = [(a.float() - b.float()).abs().max().item() for a, b in zip(captured[:2], eager[:2])]
    times = [timer(graph.replay) for _ in range(iters)]
    del graph, captured
    return {"graph_seconds": statistics.median(t for t, _ in times),
            "graph_host_seconds": statistics.median(h for _, h in times),
            "graph_err_out": err[0], "graph_err_dq": err[1]}


def measure_rank(p, rank, comm, full_wire, full_q, full_k, full_v, full_do, args, timer, ref=None,
                 backend=None, backward_calls="auto", breakdown: bool = False, graph: bool = False) -> dict:
    """Median layer and host seconds of ``rank``'s forward+backward, its launch count, (with
    ``ref``) its largest deviation from the single-device output and dQ, (``breakdown``, on
    a GPU) one more step's kernels (:func:`kernel_breakdown`) and (``graph``, on a GPU) the
    same layer replayed from a CUDA graph (:func:`graph_layer`)."""
    device = full_k.device
    prog = prepare_rank(p, rank, device, comm, backward_calls)
    q, k, v = (p.shard(t, rank).detach().requires_grad_() for t in (full_q, full_k, full_v))
    do = p.shard(full_do, rank)
    ex = EmulatedExchange(full_wire, p.cp_size, rank, plan=p)
    scale = args.head_dim ** -0.5

    def step():
        out, _ = run_layer(q, k, v, prog, ex, scale, backend=backend)
        out.backward(do)
        q.grad = k.grad = v.grad = None

    errors = {}
    if ref is not None:
        out, _ = run_layer(q, k, v, prog, ex, scale, backend=backend)
        out.backward(do)
        errors = {"max_err_out": (out.float() - p.shard(ref[0], rank).float()).abs().max().item(),
                  "max_err_dq": (q.grad.float() - p.shard(ref[1], rank).float()).abs().max().item()}
        q.grad = k.grad = v.grad = None
    for _ in range(args.warmup):
        step()
    with LaunchCounter() as counter:
        step()
    times = [timer(step) for _ in range(args.iters)]
    if breakdown and device.type == "cuda":
        errors["breakdown"] = kernel_breakdown(step, timer)
    if graph and device.type == "cuda":
        gq, gk, gv = (t.detach().requires_grad_() for t in (q, k, v))  # leaves new to autograd
        errors.update(graph_layer(lambda: _grads_step(gq, gk, gv, prog, ex, scale, do, backend),
                                  lambda: _grads_step(q, k, v, prog, ex, scale, do, backend), timer, args.iters))
    return {**errors, "rank": rank, "seconds": statistics.median(t for t, _ in times),
            "host_seconds": statistics.median(h for _, h in times),
            "iterations": [[t, h] for t, h in times], "launches": counter.launches,
            "backend_aten_launches": counter.attention_launches,
            "attention_calls": counter.attention_calls, "syncs": counter.syncs,
            "stages": sum(1 for s in prog.stage_chunks if s), "own_stage": bool(prog.stage_chunks[0]),
            "backward_calls": prog.backward_calls, "work": p.work(rank),
            "keys": len(p.needed_chunks(rank)) * p.chunk_size}


def _grads_step(q, k, v, prog, ex, scale, do, backend):
    """One layer's output and the gradients of q, k, v (``autograd.grad``: no ``.grad``
    accumulation, so a captured step writes into its own buffers)."""
    out, _ = run_layer(q, k, v, prog, ex, scale, backend=backend)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def measure_config(mask, cp, name, args, device, dtype, deadline, backward_calls="auto") -> dict:
    balance, comm, hier = CONFIGS[name]
    nodes = max(1, cp // GPUS_PER_NODE) if hier else 1
    t0 = time.perf_counter()
    p = plan(mask, None, cp, balance=balance, nodes=nodes, tolerance=args.tolerance)
    plan_s = time.perf_counter() - t0
    g = torch.Generator(device=device).manual_seed(args.seed)
    full_q, full_do = (torch.randn(1, args.tokens, args.heads, args.head_dim, generator=g, device=device,
                                   dtype=dtype) for _ in range(2))
    full_k, full_v = (torch.randn(1, args.tokens, args.kv_heads, args.head_dim, generator=g, device=device,
                                  dtype=dtype) for _ in range(2))
    full_wire = to_wire(full_k, full_v, p.chunk_size)
    hidden = hidden_functions(name)
    backend = Without(get_backend(choose_backend(full_q)), hidden) if hidden else None
    timer = Timer(device)
    ref = reference(mask, full_q, full_k, full_v, full_do) if args.check else None
    ranks, wanted = [], sample_ranks(p, args)
    for r in wanted:
        if time.monotonic() > deadline:
            break
        ranks.append(measure_rank(p, r, comm, full_wire, full_q, full_k, full_v, full_do, args, timer, ref,
                                  backend, backward_calls, args.breakdown, args.graph))
    entry = {"config": config_key(name, backward_calls), "layout": name, "balance": balance, "comm": comm,
             "backward_calls": backward_calls, "nodes": nodes, "chunk_size": p.chunk_size,
             "imbalance": p.imbalance, "plan_seconds": plan_s, "ranks": ranks,
             "ranks_wanted": len(wanted), "sampled": len(wanted) < cp}
    if ranks:
        slow = max(ranks, key=lambda x: x["seconds"])
        entry.update(slowest_rank=slow["rank"], slowest_seconds=slow["seconds"],
                     median_seconds=statistics.median(x["seconds"] for x in ranks),
                     host_seconds_max=max(x["host_seconds"] for x in ranks),
                     launches_max=max(x["launches"] for x in ranks),
                     syncs_max=max(x["syncs"] for x in ranks))
        if all("graph_seconds" in x for x in ranks):
            slow_g = max(ranks, key=lambda x: x["graph_seconds"])
            entry.update(graph_slowest_rank=slow_g["rank"], graph_slowest_seconds=slow_g["graph_seconds"],
                         graph_median_seconds=statistics.median(x["graph_seconds"] for x in ranks),
                         graph_host_seconds_max=max(x["graph_host_seconds"] for x in ranks),
                         graph_err_max=max(max(x["graph_err_out"], x["graph_err_dq"]) for x in ranks))
        if ref is not None:
            entry["max_err_out"] = max(x["max_err_out"] for x in ranks)
            entry["max_err_dq"] = max(x["max_err_dq"] for x in ranks)
    return entry


def config_key(name: str, backward_calls: str) -> str:
    """The result entry of layout ``name`` with ``backward_calls`` (the layout's name for auto)."""
    return name if backward_calls == "auto" else f"{name} bwd={backward_calls}"


def config_runs(name: str, modes) -> list[str]:
    """The ``backward_calls`` a layout is measured with: every mode for the staged overlap
    layouts, the default for the others (allgather ignores it; the whole-backward A/B is per
    stage by construction)."""
    if CONFIGS[name][1] != "overlap" or name in WHOLE_BACKWARD | TORCH_RETURNS:
        return ["auto"]
    return list(modes)


def markdown(res: dict) -> str:
    a, env = res["args"], res["env"]
    lines = [f"# One CP layer (fwd+bwd) per rank through the staged runtime, {a['tokens']} tokens, one device",
             "", f"{env.get('gpu', env['device'])}, torch {env['torch']}, triton {env['triton']}, "
             f"{env['date']}; {a['dtype']}, B=1, Hq={a['heads']}, Hk={a['kv_heads']}, D={a['head_dim']}; "
             f"causal document mask ({a['spread']} lengths). Communication emulated by device copies. "
             f"Median of {a['iters']} after {a['warmup']} warm-up. `{env['command']}`", "",
             "Layer ms: CUDA events around one rank's whole forward+backward (a host-bound step "
             "shows its host time). Launches: kernel-launching ops outside attention, copies "
             "not counted.", "",
             "| cp | layout | nodes | imbalance | ranks timed | slowest rank ms | median rank ms "
             "| host ms (max) | launches (max) | plan s | max err out / dQ |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cp, configs in res["cp"].items():
        for e in configs.values():
            if not e["ranks"]:
                lines.append(f"| {cp} | {e['config']} | {e['nodes']} | {e['imbalance']:.3f} | 0 | - | - | - | - "
                             f"| {e['plan_seconds']:.2f} | - |")
                continue
            timed = f"{len(e['ranks'])}/{cp}" + (" (sampled)" if e["sampled"] else "")
            lines.append(f"| {cp} | {e['config']} | {e['nodes']} | {e['imbalance']:.3f} | {timed} "
                         f"| {e['slowest_seconds'] * 1e3:.2f} | {e['median_seconds'] * 1e3:.2f} "
                         f"| {e['host_seconds_max'] * 1e3:.2f} | {e['launches_max']} | {e['plan_seconds']:.2f} "
                         f"| {_errors(e)} |")
    lines += ["", "Sampled rows: all ranks at cp <= "
              f"{a['all_ranks_up_to']}, else the {a['heaviest']} heaviest by work, {a['random']} random "
              "others and the rank needing the most K/V; the slowest of those is reported."]
    lines += graph_markdown(res)
    lines += breakdown_markdown(res)
    return "\n".join(lines) + "\n"


def graph_markdown(res: dict) -> list[str]:
    """The ``--graph`` table (none without it): per layout, eager vs CUDA-graph replay of the
    timed ranks' layers."""
    rows = [(cp, e) for cp, configs in res["cp"].items() for e in configs.values()
            if e["ranks"] and "graph_slowest_seconds" in e]
    if not rows:
        return []
    lines = ["", "The same layers captured in one CUDA graph per rank (`--graph`: forward + the q/k/v "
             "gradients, replayed; the host issues one graph launch): ", "",
             "| cp | layout | eager slowest ms | graph slowest ms | eager / graph (slowest) "
             "| eager median ms | graph median ms | host ms (max): eager / graph | replay vs eager max err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for cp, e in rows:
        lines.append(f"| {cp} | {e['config']} | {e['slowest_seconds'] * 1e3:.2f} "
                     f"| {e['graph_slowest_seconds'] * 1e3:.2f} "
                     f"| {e['slowest_seconds'] / e['graph_slowest_seconds']:.2f}x "
                     f"| {e['median_seconds'] * 1e3:.2f} | {e['graph_median_seconds'] * 1e3:.2f} "
                     f"| {e['host_seconds_max'] * 1e3:.2f} / {e['graph_host_seconds_max'] * 1e3:.3f} "
                     f"| {e['graph_err_max']:.1e} |")
    return lines


def breakdown_markdown(res: dict) -> list[str]:
    """The ``--breakdown`` table (none without it): per layout, the slowest timed rank's
    profiled step split into flashmask3's kernels, the runtime's torch ops (with the
    emulation's copies), the GPU idle inside the layer and the time before its first kernel."""
    rows = [(cp, e, max(e["ranks"], key=lambda x: x["seconds"]))
            for cp, configs in res["cp"].items() for e in configs.values()
            if e["ranks"] and all("breakdown" in r for r in e["ranks"])]
    if not rows:
        return []
    lines = ["", "Where the slowest rank's GPU time goes (`--breakdown`: one more step under "
             "torch.profiler, so its layer time includes the profiler's host cost):", "",
             "| cp | layout | rank | layer ms (profiled) | flashmask3 kernels ms | torch ops ms "
             "| idle inside ms | before first kernel ms | largest torch op |",
             "|---|---|---|---|---|---|---|---|---|"]
    for cp, e, r in rows:
        b = r["breakdown"]
        top = b["torch_top"][0] if b["torch_top"] else ["-", 0.0]
        lines.append(f"| {cp} | {e['config']} | {r['rank']} | {b['layer_ms']:.2f} | {b['own_ms']:.2f} "
                     f"| {b['torch_ms']:.2f} | {b['idle_ms']:.2f} | {b['layer_ms'] - b['span_ms']:.2f} "
                     f"| {top[0][:60]} ({top[1]:.2f}) |")
    return lines


def _errors(e) -> str:
    return f"{e['max_err_out']:.1e} / {e['max_err_dq']:.1e}" if "max_err_out" in e else "-"


def write(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, "cp_runtime")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(res))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help="sparse placement tolerance (plan(tolerance=); recorded: the scale model "
                         "rebuilds these plans with it)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--spread", default="corpus", help="a document spread of benchmarks/corpus.py, or 'causal'")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--backward-calls", nargs="+", default=["auto"], choices=list(BACKWARD_CALL_MODES),
                    help="the overlap layouts' backward calls, one run of each layout per value "
                         "(auto: the plan's rule)")
    ap.add_argument("--all-ranks-up-to", type=int, default=8)
    ap.add_argument("--heaviest", type=int, default=8)
    ap.add_argument("--random", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--time-budget", type=float, default=float("inf"),
                    help="seconds, shared equally by the cp sizes; ranks not started within a cp "
                         "size's share are skipped (and reported as such)")
    ap.add_argument("--check", action="store_true",
                    help="also compare every timed rank's output and dQ with the single-device layer")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile one more step of every timed rank: its kernels in order, "
                         "the GPU's busy and idle time (the key 'breakdown' of each rank)")
    ap.add_argument("--graph", action="store_true",
                    help="also capture every timed rank's layer (forward + the q/k/v gradients) in a "
                         "CUDA graph and time its replay (GPU only: the keys 'graph_*' of each rank)")
    ap.add_argument("--autograd-thread", choices=("device", "calling"), default="device",
                    help="where the autograd engine runs the backward: torch's default device thread, or "
                         "the calling thread (torch.autograd.set_multithreading_enabled(False))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=RESULTS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with torch.autograd.set_multithreading_enabled(args.autograd_thread == "device"):
        return _run(args)


def _run(args) -> int:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    end = time.monotonic() + args.time_budget
    if args.spread == "causal":
        mask = M.causal_mask(args.tokens)
    else:
        spreads = document_spreads(args.tokens, seed=args.seed)
        if args.spread not in spreads:
            raise SystemExit(f"unknown spread {args.spread!r}; choose from {sorted(spreads)} or 'causal'")
        mask = M.causal_document_mask(spreads[args.spread])
    res = {"args": vars(args), "env": run_environment(device), "cp": {},
           # the document lengths (the corpus spread depends on the machine's files): what
           # the scale model rebuilds each rank's plan from (benchmarks/scale_model/validate.py)
           "lengths": None if args.spread == "causal" else spreads[args.spread]}
    for i, cp in enumerate(args.cp):
        # each cp size gets an equal share of what is left, so a slow one cannot starve the rest
        deadline = time.monotonic() + (end - time.monotonic()) / (len(args.cp) - i)
        res["cp"][str(cp)] = {}
        for name in args.configs:
            if CONFIGS[name][2] and cp // GPUS_PER_NODE < 2:
                continue  # one node: hierarchical is the flat plan
            for calls in config_runs(name, args.backward_calls):
                e = measure_config(mask, cp, name, args, device, dtype, deadline, calls)
                res["cp"][str(cp)][e["config"]] = e
                report(cp, e)
                write(res, args.out)  # after every layout: a time limit still leaves the finished ones
    print(f"wrote {os.path.join(args.out, 'cp_runtime')}.md/.json")
    return 0


def report(cp: int, e: dict) -> None:
    """One line per measured layout."""
    name = e["config"]
    if not e["ranks"]:
        print(f"cp={cp:4d} {name:22s} skipped: time budget spent", flush=True)
        return
    print(f"cp={cp:4d} {name:22s} slowest {e['slowest_seconds'] * 1e3:8.2f} ms (rank "
          f"{e['slowest_rank']}), host max {e['host_seconds_max'] * 1e3:6.2f} ms, launches max "
          f"{e['launches_max']}, {len(e['ranks'])}/{cp} ranks"
          + (f", max err out {e['max_err_out']:.2e} dq {e['max_err_dq']:.2e}" if "max_err_out" in e else ""),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
