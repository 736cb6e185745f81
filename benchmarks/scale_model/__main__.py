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
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tqdm import tqdm  # noqa: E402

from flashmask3.distributed.placement import DEFAULT_TOLERANCE  # noqa: E402
from flashmask3.distributed.program import BACKWARD_CALL_MODES  # noqa: E402

from benchmarks.scale_model import calibrate  # noqa: E402
from benchmarks.scale_model import experiment as X  # noqa: E402
from benchmarks.scale_model import report, validate  # noqa: E402
from benchmarks.scale_model.layout import LEGACY_TOLERANCE  # noqa: E402
from benchmarks.scale_model.params import RUNTIME_FITS  # noqa: E402
from benchmarks.scale_model.commands import (MODELS, _print_validation, _setup, _start_worker,  # noqa: E402
                                             run_paper, run_sweep, run_validate)


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
    g.add_argument("--gpu", choices=sorted(RUNTIME_FITS), default=None,
                   help="the GPU whose fitted runtime-op bandwidths the CP runtime's own device work "
                        "runs at (default H100, the paper's cluster; params.RUNTIME_FITS)")
    g.add_argument("--gpus-per-node", type=int, default=None)
    g.add_argument("--nvlink-gbs", type=float, default=None, help="NVLink GB/s per direction per GPU (peak)")
    g.add_argument("--ib-gbs", type=float, default=None, help="InfiniBand GB/s per GPU (peak)")
    g.add_argument("--runtime", choices=["lean", "current"], default="lean")
    g.add_argument("--tolerance", type=float, default=None,
                   help="plan(tolerance=) of the predicted sparse plans (default: the library's)")
    g.add_argument("--per-rank-factor", type=float, default=1.0,
                   help="scale the current kernels' per-tile cost (1 = tables; see docs/scale-model.md)")
    g = ap.add_argument_group("kernel and runtime variants (PREDICTIONS with the same calibration)")
    g.add_argument("--kv-rule", default=None,
                   choices=sorted(calibrate.KV_RULES) + list(calibrate.KV_CHOSEN),
                   help="GQA K/V expansion rule of the backward (default: the library's, dispatch.kv_expansion)")
    g.add_argument("--order", choices=["launch", "longest"], default=None,
                   help="program launch order of both kernels (longest: by descending live tiles)")
    g.add_argument("--bwd-calls", choices=list(BACKWARD_CALL_MODES), default="auto",
                   help="the overlapped backward: one call per stage, one per layer, own keys + one, "
                   "one + own keys (remote first), or the runtime's default rule per plan (auto)")
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

    cluster, runtime, costs = _setup(args)
    worker = _start_worker(args) if args.cmd == "all" else None
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
          "Placement of the predicted sparse plans: `plan(tolerance="
          + (f"{args.tolerance})` (--tolerance)" if args.tolerance is not None else
             f"{DEFAULT_TOLERANCE})`, the library default") + "; measured files are replanned with "
          f"the tolerance they record ({LEGACY_TOLERANCE} where they record none).", "",
          "## Parameters", ""]
    md += report.params_table(cluster, costs, runtime) + [""]
    if args.cmd == "all":
        out["validation"] = None  # the worker's, filled in below (the file keeps its order)
    paper_md = []
    if args.cmd in ("all", "paper"):
        model, layout, datasets, results, sens = run_paper(args, costs, cluster, runtime)
        model_p = model
        paper_md += report.paper_section(model, layout, datasets, results, sens, cluster) + [""]
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
            paper_md += ["### The same at another plausible layout", ""]
            paper_md += report.paper_section(model, alayout, adatasets, aresults, [], cluster)[4:] + [""]
            out["paper_alt"] = {"layout": dataclasses.asdict(alayout),
                                "gains": {d: X.gains(r) for d, r in aresults.items()},
                                "results": {d: {m: X._summ(e) for m, e in r.items()} for d, r in aresults.items()}}
    validation, swept = worker.result() if worker is not None else (None, None)
    if args.cmd == "all":
        single, multi = validation
        _print_validation(single, multi)
        md += report.validation_section(single, multi, os.path.relpath(args.multigpu, os.getcwd()))
        out["validation"] = {"single": {k: [dataclasses.asdict(p) for p in single[k]] for k in ("tables", "per_rank")},
                             "k": single["k"], "c": single["c"],
                             "measured_shapes": {cls: {chk: {kind: validate.summary(pts, held_only=False)
                                                             for kind, pts in d[chk].items()}
                                                       for chk in ("in_sample", "held_out")}
                                                 for cls, d in single.get("measured", {}).items()},
                             "multigpu": [dataclasses.asdict(p) for p in multi]}
    md += paper_md
    if args.cmd in ("all", "sweep"):
        model, sweep, seqs = swept if swept is not None else run_sweep(args, costs, cluster, runtime)
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
