"""The scale model's commands (``python -m benchmarks.scale_model``, ``__main__.py`` parses
the arguments): the paper experiment, the cp sweep, the validation, each from the parsed
arguments. Kept out of ``__main__`` so that a worker process can import them (``all`` runs the
validation and the sweep in a second process)."""

from __future__ import annotations

import dataclasses
import json
import os

from tqdm import tqdm

from benchmarks.scale_model import calibrate
from benchmarks.scale_model import experiment as X
from benchmarks.scale_model import validate
from benchmarks.scale_model.model import DENSE_7B, MOE_118B, Layout, ModelConfig
from benchmarks.scale_model.params import GB, Cluster, Param, Runtime

MODELS = {"moe118b": MOE_118B, "dense7b": DENSE_7B}


def _model(args, default: str = "moe118b") -> ModelConfig:
    """The model of a command: ``--model`` (default: ``default``) with any dims overridden."""
    m = MODELS[args.model or default]
    changes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "experts",
                                             "top_k", "expert_ffn") if getattr(args, k, None) is not None}
    return dataclasses.replace(m, **changes) if changes else m


def _cluster(args) -> Cluster:
    c = Cluster()
    if getattr(args, "gpu", None):
        c = c.on_gpu(args.gpu)
    if args.gpus_per_node:
        c = c.with_(gpus_per_node=args.gpus_per_node)
    if args.nvlink_gbs:
        c = c.with_(nvlink_bw=Param(args.nvlink_gbs * GB, "given on the command line"))
    if args.ib_gbs:
        c = c.with_(ib_bw=Param(args.ib_gbs * GB, "given on the command line"))
    return c


def _datasets(args, seqlen: int, sequences: int):
    lengths = None
    if args.lengths:
        with open(args.lengths) as f:
            lengths = [int(x) for x in json.load(f)]
    return X.make_datasets(seqlen, targets=args.targets, sequences=sequences, lengths=lengths)


def run_paper(args, costs, cluster, runtime, bar_total=None):
    model = _model(args)
    costs = costs.for_heads(model.heads, model.kv_heads)
    layout = Layout(cp=args.cp, pp=args.pp, dp=args.dp, ep=args.ep, micro_batches=args.micro_batches,
                    recompute=args.recompute)
    datasets = _datasets(args, args.seqlen, args.sequences)
    n_methods = len(X.METHODS) - (1 if layout.cp <= cluster.gpus_per_node else 0)
    steps = len(datasets) * args.sequences * (n_methods + (2 if layout.cp > cluster.gpus_per_node else 0))
    if args.sensitivity:
        steps += (2 * len(X.SWEPT) + 8) * args.sequences * n_methods  # x0.5/x2 each, per-tile 2, per-call 3, bytes 2, runtime 1
    if args.host_sweep:
        steps += len(datasets) * X.host_sweep_layers(layout, cluster, args.sequences)
    results = {}
    with tqdm(total=steps, desc="paper experiment", unit="layer") as bar:
        for name, ds in datasets.items():
            results[name] = X.simulate_dataset(ds["sequences"], model, layout, cluster, runtime, costs, progress=bar)
            free = X.per_call_free(ds["sequences"], model, layout, cluster, runtime, costs, progress=bar)
            if free is not None:
                results[name][X.NO_CALL] = free
            fill = X.sm_filled(ds["sequences"], model, layout, cluster, runtime, costs, progress=bar)
            if fill is not None:
                results[name][X.NO_UNDERFILL] = fill
        sens = []
        if args.sensitivity:
            mid = list(datasets)[len(datasets) // 2]
            sens = X.sensitivity(datasets[mid]["sequences"], model, layout, cluster, runtime, costs, progress=bar)
            for r in sens:
                r["dataset"] = mid
        if args.host_sweep:
            for name, ds in datasets.items():
                for r in X.host_sweep(ds["sequences"], model, layout, cluster, runtime, costs, progress=bar):
                    sens.append(dict(r, param="host_per_call", dataset=name))
    return model, layout, datasets, results, sens


def run_sweep(args, costs, cluster, runtime, position: int = 0):
    model = MODELS[args.sweep_model] if args.cmd == "all" else _model(args, args.sweep_model)
    costs = costs.for_heads(model.heads, model.kv_heads)
    mid = [args.targets[len(args.targets) // 2]]
    seqs = {}
    for s in args.seqlens:
        ds = X.make_datasets(s, targets=mid, sequences=1 if s > 131072 else args.sweep_sequences)
        seqs[s] = next(iter(ds.values()))["sequences"]
    total = sum(len(v) for v in seqs.values()) * sum(len(X.METHODS) - (1 if cp <= cluster.gpus_per_node else 0)
                                                      for cp in args.cps)
    with tqdm(total=total, desc="cp sweep", unit="layer", position=position) as bar:
        sweep = X.cp_sweep(seqs, model, args.cps, cluster, runtime, costs, progress=bar)
    return model, sweep, seqs


def _setup(args):
    """``(cluster, runtime, costs)`` of a command's arguments (and the predicted plans'
    ``--tolerance``, :data:`layout.PLAN_TOLERANCE`, in this process)."""
    from . import layout

    tol = getattr(args, "tolerance", None)
    if tol is not None and not 0 <= tol < 1:
        raise SystemExit(f"--tolerance must be in [0, 1), got {tol}")
    layout.PLAN_TOLERANCE = tol
    cluster, runtime = _cluster(args), Runtime(args.runtime, bwd_calls=args.bwd_calls, keep_kv=not args.refetch_kv)
    costs = X.default_costs(gqa=True, per_rank_factor=args.per_rank_factor)
    if args.kv_rule or args.order:
        costs = costs.mapped(lambda c: calibrate.variant(c, args.kv_rule, args.order))
    return cluster, runtime, costs


def _worker_job(args):
    """``all``'s second process: the validation, then the cp sweep, of ``args`` (plain data
    comes back). Together about as long as the paper experiment and its second layout, which
    the first process runs meanwhile."""
    import torch

    torch.set_num_threads(1)  # one core each: torch's worker threads would spin against the other process
    cluster, runtime, costs = _setup(args)
    return run_validate(args, position=1), run_sweep(args, costs, cluster, runtime, position=1)


def _start_worker(args):
    """``all``: the validation and the cp sweep started in a second process while this one
    runs the paper experiment (they share nothing but the on-disk plan cache, whose writes are
    atomic); on a one-core machine they run here, after it. Returns something with
    ``.result()``: ``((single, multi), (model, sweep, sequences))``."""
    if (os.cpu_count() or 1) < 2:
        return _Lazy(lambda: _worker_job(args))
    import concurrent.futures
    import multiprocessing

    import torch

    torch.set_num_threads(1)  # this process keeps one core, the worker the other
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    job = pool.submit(_worker_job, args)
    pool.shutdown(wait=False)
    return job


class _Lazy:
    def __init__(self, run):
        self.run = run

    def result(self):
        return self.run()


def run_validate(args, position: int = 0):
    with tqdm(total=2, desc="validation", unit="file", position=position) as bar:
        single = validate.validate_single(args.single)
        if os.path.exists(calibrate.MEASURED_FILE):
            single["measured"] = validate.validate_measured(calibrate.MEASURED_FILE)
        single["transfer"] = validate.validate_transfer()
        single["kv_expansion"] = validate.validate_kv_expansion()
        single["cp_runtime"] = validate.validate_cp_runtime()
        fitted = (single["cp_runtime"] or {}).get("bandwidths")  # checked on the H200's graph file
        # another GPU (an H100): its own fit, and the H200's fit carried over as a transfer check
        single["cp_ptrr"] = validate.validate_cp_runtime(validate.CP_PTRR, fit_cp=validate.PTRR_FIT_CP)
        if single["cp_ptrr"] and fitted:
            single["cp_ptrr"]["transfer"] = validate.validate_cp_runtime(validate.CP_PTRR, bandwidths=fitted)
        single["cp_graph"] = validate.validate_cp_graph(bandwidths=fitted)
        bar.update(1)
        multi = validate.validate_multigpu(args.multigpu)
        multi += validate.validate_training(args.multigpu, multi)
        bar.update(1)
    return single, multi


def _print_validation(single, multi):
    for kind in ("tables", "per_rank"):
        print(f"cp_single_gpu [{kind}]: {validate.summary(single[kind])}")
    print(f"per-rank calibration: k={single['k']:.3f}, per-call {single['c'] * 1e3:.2f} ms")
    for cls, d in single.get("measured", {}).items():
        for kind in [k for k in d["in_sample"] if k in d["held_out"]]:
            print(f"current kernels, measured shapes, {cls} {kind}: in-sample "
                  f"{validate.summary(d['in_sample'][kind], held_only=False)}; held out "
                  f"{validate.summary(d['held_out'][kind])}")
    for cls, checks in (single.get("transfer") or {}).get("classes", {}).items():
        for check, pts in checks.items():
            print(f"H200 fits on the H100's calls, {cls} {check}: {validate.summary(pts)}")
    for p in multi:
        print(f"  {p.name}: measured {p.measured * 1e3:.2f} ms, PREDICTED {p.predicted * 1e3:.2f} ms "
              f"({100 * p.error:+.1f}%)")
    print(f"multi-GPU file: {validate.summary(multi)}")
    for key, title in (("cp_runtime", "CP runtime on one GPU"), ("cp_ptrr", "sparse vs PTRR on one GPU")):
        rt = single.get(key) or {}
        for kind in ("kernels", "runtime", "busy", "layer", "layer_host_model"):
            if rt.get(kind):
                print(f"{title}, per rank [{kind}]: {validate.summary(rt[kind])}")
    graph = (single.get("cp_graph") or {}).get("graph")
    if graph:
        print(f"CP layer replayed from a CUDA graph, per rank: {validate.summary(graph)}")
