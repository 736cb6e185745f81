"""Scale model CLI: predictions of context-parallel training at 8-128 GPUs (issue 23).

    python -m benchmarks.scale_model all                 # everything -> benchmarks/results/scale_model.*
    python -m benchmarks.scale_model paper --cp 32 --pp 2 --ib-gbs 25     # another layout / cluster
    python -m benchmarks.scale_model sweep --model dense7b --seqlens 131072 --cps 8 16 32
    python -m benchmarks.scale_model validate --multigpu other_run.json  # errors on a result file
    python -m benchmarks.scale_model calibrate           # refit the cached calibration (slow)
    python -m benchmarks.scale_model underfill           # the SM underfill by call kind + the levers
    python -m benchmarks.scale_model paper --kv-rule waves --order longest --bwd-calls one   # a variant

Every number it writes about a cluster is a PREDICTION. Plans are cached on disk
(~/.cache/flashmask3-scale-model), so reruns on the same datasets take seconds; the first run
at 512K tokens plans for a few minutes on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tqdm import tqdm  # noqa: E402

from benchmarks.scale_model import calibrate  # noqa: E402
from benchmarks.scale_model import experiment as X  # noqa: E402
from benchmarks.scale_model import report, validate  # noqa: E402
from benchmarks.scale_model.model import DENSE_7B, MOE_118B, Layout, ModelConfig  # noqa: E402
from benchmarks.scale_model.params import GB, Cluster, Param, Runtime  # noqa: E402

MODELS = {"moe118b": MOE_118B, "dense7b": DENSE_7B}


def _model(args, default: str = "moe118b") -> ModelConfig:
    """The model of a command: ``--model`` (default: ``default``) with any dims overridden."""
    m = MODELS[args.model or default]
    changes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "experts",
                                             "top_k", "expert_ffn") if getattr(args, k, None) is not None}
    return dataclasses.replace(m, **changes) if changes else m


def _cluster(args) -> Cluster:
    c = Cluster()
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


def run_sweep(args, costs, cluster, runtime):
    model = MODELS[args.sweep_model] if args.cmd == "all" else _model(args, args.sweep_model)
    mid = [args.targets[len(args.targets) // 2]]
    seqs = {}
    for s in args.seqlens:
        ds = X.make_datasets(s, targets=mid, sequences=1 if s > 131072 else args.sweep_sequences)
        seqs[s] = next(iter(ds.values()))["sequences"]
    total = sum(len(v) for v in seqs.values()) * sum(len(X.METHODS) - (1 if cp <= cluster.gpus_per_node else 0)
                                                      for cp in args.cps)
    with tqdm(total=total, desc="cp sweep", unit="layer") as bar:
        sweep = X.cp_sweep(seqs, model, args.cps, cluster, runtime, costs, progress=bar)
    return model, sweep, seqs


def run_validate(args):
    with tqdm(total=2, desc="validation", unit="file") as bar:
        single = validate.validate_single(args.single)
        if os.path.exists(calibrate.MEASURED_FILE):
            single["measured"] = validate.validate_measured(calibrate.MEASURED_FILE)
        single["kv_expansion"] = validate.validate_kv_expansion()
        single["cp_runtime"] = validate.validate_cp_runtime()
        single["cp_graph"] = validate.validate_cp_graph(
            bandwidths=(single["cp_runtime"] or {}).get("bandwidths"))
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
    for p in multi:
        print(f"  {p.name}: measured {p.measured * 1e3:.2f} ms, PREDICTED {p.predicted * 1e3:.2f} ms "
              f"({100 * p.error:+.1f}%)")
    print(f"multi-GPU file: {validate.summary(multi)}")
    rt = single.get("cp_runtime") or {}
    for kind in ("kernels", "runtime", "busy", "layer", "layer_host_model"):
        if rt.get(kind):
            print(f"CP runtime on one GPU, per rank [{kind}]: {validate.summary(rt[kind])}")
    graph = (single.get("cp_graph") or {}).get("graph")
    if graph:
        print(f"CP layer replayed from a CUDA graph, per rank: {validate.summary(graph)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["all", "paper", "sweep", "validate", "calibrate", "underfill"], nargs="?",
                    default="paper")
    g = ap.add_argument_group("model")
    g.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="paper: default moe118b; sweep: default --sweep-model")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "experts", "top-k", "expert-ffn"):
        g.add_argument(f"--{name}", type=int, default=None, help="override the model's value")
    g = ap.add_argument_group("layout (paper experiment)")
    g.add_argument("--cp", type=int, default=X.PAPER_LAYOUT.cp)
    g.add_argument("--pp", type=int, default=X.PAPER_LAYOUT.pp)
    g.add_argument("--dp", type=int, default=X.PAPER_LAYOUT.dp)
    g.add_argument("--ep", type=int, default=X.PAPER_LAYOUT.ep)
    g.add_argument("--micro-batches", type=int, default=X.PAPER_LAYOUT.micro_batches)
    g.add_argument("--recompute", action="store_true")
    g.add_argument("--seqlen", type=int, default=131072)
    g = ap.add_argument_group("cluster and runtime")
    g.add_argument("--gpus-per-node", type=int, default=None)
    g.add_argument("--nvlink-gbs", type=float, default=None, help="NVLink GB/s per direction per GPU (peak)")
    g.add_argument("--ib-gbs", type=float, default=None, help="InfiniBand GB/s per GPU (peak)")
    g.add_argument("--runtime", choices=["lean", "current"], default="lean")
    g.add_argument("--per-rank-factor", type=float, default=1.0,
                   help="scale the current kernels' per-tile cost (1 = tables; see docs/scale-model.md)")
    g = ap.add_argument_group("kernel and runtime variants (PREDICTIONS with the same calibration)")
    g.add_argument("--kv-rule", default=None,
                   choices=sorted(calibrate.KV_RULES) + list(calibrate.KV_CHOSEN),
                   help="GQA K/V expansion rule of the backward (default: the library's, dispatch.kv_expansion)")
    g.add_argument("--order", choices=["launch", "longest"], default=None,
                   help="program launch order of both kernels (longest: by descending live tiles)")
    g.add_argument("--bwd-calls", choices=["stage", "one", "local+one", "auto"], default="auto",
                   help="the overlapped backward: one call per stage, one per layer, own keys + one, "
                   "or the runtime's default rule per plan (auto)")
    g.add_argument("--refetch-kv", action="store_true",
                   help="the overlapped backward fetches the K/V again (the runtime's keep_kv=False; "
                   "default: it reuses the forward's)")
    g = ap.add_argument_group("datasets")
    g.add_argument("--targets", type=float, nargs="+", default=[0.70, 0.78, 0.86], help="mean sparsities")
    g.add_argument("--sequences", type=int, default=4, help="packed sequences per dataset")
    g.add_argument("--lengths", default=None, help="json list of document lengths (default: this machine's corpus)")
    g.add_argument("--no-sensitivity", dest="sensitivity", action="store_false")
    g.add_argument("--no-host-sweep", dest="host_sweep", action="store_false",
                   help="skip the gains vs the host time per attention call (measured, issue-25 targets, zero)")
    g.add_argument("--alt-cp", type=int, default=64, help="'all': also the paper experiment at this cp "
                   "(pp = 128 / cp / alt-dp); 0 = skip")
    g.add_argument("--alt-dp", type=int, default=1)
    g = ap.add_argument_group("sweep")
    g.add_argument("--sweep-model", choices=sorted(MODELS), default="dense7b")
    g.add_argument("--cps", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    g.add_argument("--seqlens", type=int, nargs="+", default=[131072, 524288])
    g.add_argument("--sweep-sequences", type=int, default=2)
    g = ap.add_argument_group("validation")
    g.add_argument("--multigpu", default=validate.MULTI, help="a result file in cp_multigpu.json's format")
    g.add_argument("--single", default=validate.SINGLE)
    ap.add_argument("--out", default=calibrate.RESULTS)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    if args.cmd == "calibrate":
        with tqdm(total=2 * len(calibrate.FITS), desc="calibration fits") as bar:
            calibrate.build_calibration(progress=bar)
        print(f"wrote {calibrate.CALIBRATION_FILE}")
        return 0
    if args.cmd == "validate":
        _print_validation(*run_validate(args))
        return 0
    if args.cmd == "underfill":
        from benchmarks.scale_model import underfill

        with tqdm(desc="underfill", unit="step") as bar:
            underfill.run(args.out, sequences=args.sequences, progress=bar)
        print(f"wrote {os.path.join(args.out, 'scale_model_underfill.md')}/.json, {underfill.CANDIDATES} "
              f"({time.perf_counter() - t0:.1f} s)")
        return 0

    cluster, runtime = _cluster(args), Runtime(args.runtime, bwd_calls=args.bwd_calls, keep_kv=not args.refetch_kv)
    costs = X.default_costs(gqa=True, per_rank_factor=args.per_rank_factor)
    if args.kv_rule or args.order:
        costs = dataclasses.replace(costs, flashmask3=calibrate.variant(costs.flashmask3, args.kv_rule, args.order))
    out = {"label": "PREDICTIONS of the scale model (benchmarks/scale_model), not measurements",
           "command": "python -m benchmarks.scale_model " + " ".join(sys.argv[1:] if argv is None else argv),
           "calibration": {"flashmask3": costs.flashmask3.source, "flex": costs.flex.source},
           "cluster": {k: dataclasses.asdict(v) for k, v in cluster.params().items()}}
    md = ["# Scale model of context-parallel training — PREDICTIONS", "",
          "Every throughput below is a **prediction** of the event-timeline model "
          "(`python -m benchmarks.scale_model`, docs/scale-model.md), not a measurement; the "
          "validation section compares predictions with the only measurements there are.", "",
          f"Command: `{out['command']}`", "",
          f"Attention calibration used for the predictions: {costs.flashmask3.source}"
          + ("" if costs.flashmask3.source.startswith("measured") else
             " -- benchmarks/gpu/scale-model.sh has not run yet, so the current kernels' per-rank cost is "
             "the full-sequence tables' (see Validation for what that costs on the old kernel)") + ".", "",
          "## Parameters", ""]
    md += report.params_table(cluster, costs, runtime) + [""]
    if args.cmd == "all":
        single, multi = run_validate(args)
        _print_validation(single, multi)
        md += report.validation_section(single, multi, os.path.relpath(args.multigpu, os.getcwd()))
        out["validation"] = {"single": {k: [dataclasses.asdict(p) for p in single[k]] for k in ("tables", "per_rank")},
                             "k": single["k"], "c": single["c"],
                             "measured_shapes": {cls: {chk: {kind: validate.summary(pts, held_only=False)
                                                             for kind, pts in d[chk].items()}
                                                       for chk in ("in_sample", "held_out")}
                                                 for cls, d in single.get("measured", {}).items()},
                             "multigpu": [dataclasses.asdict(p) for p in multi]}
    if args.cmd in ("all", "paper"):
        model, layout, datasets, results, sens = run_paper(args, costs, cluster, runtime)
        model_p = model
        md += report.paper_section(model, layout, datasets, results, sens, cluster) + [""]
        out["paper"] = {"model": dataclasses.asdict(model), "layout": dataclasses.asdict(layout),
                        "datasets": datasets, "sensitivity": sens,
                        "results": {d: {m: X._summ(e) for m, e in r.items()} for d, r in results.items()},
                        "gains": {d: X.gains(r) for d, r in results.items()},
                        "attribution": {d: X.attribution(model, layout, r) for d, r in results.items()}}
        for d, r in results.items():
            print(f"{d}: PREDICTED gains " + ", ".join(f"{m} {100 * g:+.1f}%" for m, g in X.gains(r).items()))
        if args.cmd == "all" and args.alt_cp:
            alt = argparse.Namespace(**{**vars(args), "cp": args.alt_cp, "pp": 128 // args.alt_cp // args.alt_dp,
                                        "dp": args.alt_dp, "micro_batches": max(1, args.micro_batches * args.dp // args.alt_dp),
                                        "sensitivity": False, "host_sweep": False})
            _, alayout, adatasets, aresults, _ = run_paper(alt, costs, cluster, runtime)
            md += ["### The same at another plausible layout", ""]
            md += report.paper_section(model, alayout, adatasets, aresults, [], cluster)[4:] + [""]
            out["paper_alt"] = {"layout": dataclasses.asdict(alayout),
                                "gains": {d: X.gains(r) for d, r in aresults.items()},
                                "results": {d: {m: X._summ(e) for m, e in r.items()} for d, r in aresults.items()}}
    if args.cmd in ("all", "sweep"):
        model, sweep, seqs = run_sweep(args, costs, cluster, runtime)
        md += report.sweep_section(model, sweep, cluster)
        out["sweep"] = {"model": dataclasses.asdict(model), "results": sweep,
                        "sequences": {str(k): v for k, v in seqs.items()}}
        os.makedirs(args.out, exist_ok=True)
        X.plot_sweep(sweep, os.path.join(args.out, "scale_model.png"))
    if args.cmd == "all":
        at = md.index("## Parameters")
        md[at:at] = report.discussion(model_p, layout, results, alayout if args.alt_cp else None,
                                      aresults if args.alt_cp else {}, sweep, sens, cost=costs.flashmask3)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "scale_model" if args.cmd == "all" else f"scale_model_{args.cmd}")
    X.write_json(out, base + ".json")
    with open(base + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {base}.md/.json ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
