"""A/B on the GPU of the Gluon backward: arms of its code under the Triton this process imports.

One arm per process (the kernels are compiled on first use, so a process holds one variant):
``--arm opaque`` / ``plain`` / ``default``: the backward with its loop invariants rebuilt per
tile from opaque values (``gluon_bwd.OPAQUE_INVARIANTS``, the default from Triton 3.9 on, where
CUDA 13's ptxas otherwise spills them) or without (3.6-3.8's code), or the library's choice for
this Triton. The flag is a constexpr global read at compile time (part of Triton's cache key).
``--label`` names a run in the report, e.g. the code tree it ran from (session 46 ran a copy of
the baseline tree's ``flashmask3/`` with this script; ``benchmarks/ab_trees.py`` is the
general A/B of two trees).

Each process first checks one forward+backward of causal and of bidirectional documents per
timed head dim against the float64 reference (an arm must be correct before it is timed:
``newer_triton_smoke.reference_errors``), then times masks at 32K per head dim (``--dims``,
default 128; the model width 4096 split into heads of that dim, batch 4, bf16;
``benchmarks/kernel.py``'s masks and inputs): GPU ms of the forward and of forward+backward by
CUDA events behind a GPU sleep (host hidden), medians of interleaved rounds, and the backward
kernel the dispatch chose. Run the arms alternately, in separate processes, on one machine;
``--report`` turns the JSON files into a table (median over runs):

    for i in 1 2; do for a in opaque plain; do python benchmarks/gluon_bwd_ab.py --arm $a --out $OUT/ab_${a}_$i.json; done; done
    python benchmarks/gluon_bwd_ab.py --report $OUT/ab_*.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MASKS = ("causal_document_corpus", "shared_question", "sliding_window")


def set_arm(arm: str) -> bool:
    """Set ``gluon_bwd.OPAQUE_INVARIANTS`` for this process (before any compile); return it."""
    from flashmask3.kernels import gluon_bwd as G

    if arm != "default":
        G.OPAQUE_INVARIANTS = G.gl.constexpr(arm == "opaque")
    value = G.OPAQUE_INVARIANTS
    return bool(getattr(value, "value", value))


def time_masks(masks, seqlen: int, rounds: int, d: int = 128) -> list[dict]:
    """GPU ms of forward and forward+backward per mask at head dim ``d`` (interleaved rounds,
    host hidden)."""
    from benchmarks import kernel as K
    from flashmask3.api import kernel_row_span
    from flashmask3.kernels import dispatch

    hq = K.HIDDEN // d
    batch = K.TOTAL_TOKENS // seqlen
    rows = []
    for name in masks:
        mask, causal, _ = K.build_mask(name, seqlen, batch)
        mask = None if mask is None else mask.to("cuda")
        g = torch.Generator(device="cuda").manual_seed(seqlen + d)
        q, k, v = (torch.randn(batch, seqlen, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        fwd, leaves = K.flashmask_impl(mask, causal, q, k, v, 1 / math.sqrt(d))
        dout = torch.randn_like(q)

        def fwd_bwd():
            torch.autograd.backward(fwd(), dout)

        calls = {"fwd": (lambda: fwd(), leaves, contextlib.nullcontext),
                 "fwd_bwd": (fwd_bwd, leaves, contextlib.nullcontext)}
        for c in calls.values():  # compile, warm
            K._event_timer(c)
        med = K.interleaved_medians(calls, K._event_timer, rounds)
        c = 0 if mask is None else mask.startend_row_indices.shape[-1]
        span = None if mask is None else kernel_row_span(mask)
        choice = dispatch.choose(q.device, q.dtype, d, causal, c, span)
        rows.append(dict(mask=name, S=seqlen, B=batch, H=hq, D=d, fwd_ms=med["fwd"],
                         fwd_bwd_ms=med["fwd_bwd"], bwd_ms=med["fwd_bwd"] - med["fwd"],
                         backward=[f"{x.kernel} {x.tile}" for x in
                                   dispatch.choose(q.device, q.dtype, d, causal, c).backward],
                         forward=f"{choice.forward.kernel} {choice.forward.tile}"))
        print(f"{name} D={d}: fwd {med['fwd']:.3f} ms, fwd+bwd {med['fwd_bwd']:.3f} ms", flush=True)
        del q, k, v, dout, leaves
        torch.cuda.empty_cache()
    return rows


def _arm_name(run: dict) -> str:
    """The arm of a run in the report: its label (a code tree) and arm."""
    return f"{run['label']} {run['arm']}" if run.get("label") else run["arm"]


def report(paths: list[str]) -> str:
    """A markdown table: per Triton, arm and mask, the median over runs of each GPU time."""
    runs = [json.load(open(p)) for p in paths]
    groups: dict = {}
    for r in runs:
        for row in r["rows"]:
            key = (r["triton"], _arm_name(r), row["mask"], row.get("D", 128))
            groups.setdefault(key, []).append(row)
    lines = ["| triton | arm (opaque) | mask | D | runs | fwd ms | bwd ms | fwd+bwd ms | backward kernel |",
             "|---|---|---|---|---|---|---|---|---|"]
    opaque = {(r["triton"], _arm_name(r)): r["opaque"] for r in runs}
    for (tv, arm, mask, d), rows in sorted(groups.items()):
        med = {k: statistics.median(x[k] for x in rows) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms")}
        lines.append(f"| {tv} | {arm} ({opaque[(tv, arm)]}) | {mask} | {d} | {len(rows)} | {med['fwd_ms']:.2f} "
                     f"| {med['bwd_ms']:.2f} | {med['fwd_bwd_ms']:.2f} | {rows[0]['backward'][0]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=("opaque", "plain", "default"), default="default")
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--dims", default="128", help="head dims, comma-separated (each its own kernels)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--label", default="", help="names this run in the report (e.g. its code tree)")
    ap.add_argument("--out", help="JSON file of this arm's run")
    ap.add_argument("--report", nargs="+", help="JSON files to tabulate (no GPU)")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    opaque = set_arm(args.arm)
    import triton

    from benchmarks.environment import run_environment
    from benchmarks.gpu.newer_triton_smoke import reference_errors

    print(f"triton {triton.__version__}, arm {args.arm}: OPAQUE_INVARIANTS={opaque}", flush=True)
    dims = tuple(map(int, args.dims.split(",")))
    errors = reference_errors("cuda", dims, bidirectional=True)
    print(f"reference check: {errors}", flush=True)
    rows = [row for d in dims for row in time_masks(args.masks.split(","), args.seqlen, args.rounds, d)]
    rec = dict(arm=args.arm, label=args.label, opaque=opaque, triton=triton.__version__, check=errors, rows=rows,
               env=run_environment(torch.device("cuda")))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
