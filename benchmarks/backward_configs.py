"""The backward kernels' configurations, each kernel timed alone on the same inputs (one GPU).

For every mask, the dK/dV kernel runs with each tile shape / warps / stages in ``DKDV``, with
the wgmma A operands (K, V) in registers or in shared memory, and with or without the separate
mask-free loop over each range's UNMASKED tiles (``SPLIT_UNMASKED_LOOP``); the dQ kernel runs
with each entry of ``DQ``. Each variant's gradients are compared with the first variant's (the
v3 default), so a fast but wrong variant shows up. Used to choose ``CANDIDATES`` and the
defaults (benchmarks/NOTES.md, v4)::

    python benchmarks/backward_configs.py --out $OUT          # on the GPU
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernel import TOTAL_TOKENS, bench  # noqa: E402
from benchmarks.sweep import (backward_case, parse_sweep_args, relative_error,  # noqa: E402
                              run_sweep, sweep_parser, time_with_result)
from flashmask3.kernels import triton_flashmask as T  # noqa: E402

DEVICE = "cuda"
MASKS = ["causal", "causal_document_corpus", "document_corpus"]
# Per head dim: dK/dV variants (block_m, block_n, warps, stages, A operand in shared memory,
# split UNMASKED loop) and dQ variants (the same; without the last field: today's default
# for dQ, one masked loop). The first of each is
# the reference the others' gradients are compared with. D=128 is the session-4 sweep (its
# first entry is the v3 default); for D=64 and D=256 the first entry was the default when the
# sweep was written (session 6 made the D=64 winners the defaults, NOTES.md v5.1) and the
# rest are the shapes that compile for sm_90 without heavy spills or shared-memory overflow
# (session-4 offline report: D=64 dK/dV 0-5 LDL/STL; D=256 dK/dV 27-227, dQ 0-10; 64x128 and
# 4-warp dK/dV shapes at D=256 spill ~2000 and are left out).
DKDV = {
    64: [(64, 128, 8, 3, False, True), (64, 128, 8, 3, False, False), (64, 128, 8, 2, False, True),
         (64, 128, 8, 3, True, True), (32, 64, 4, 3, False, True), (32, 128, 8, 2, False, True),
         (64, 64, 4, 2, False, True)],
    256: [(64, 64, 8, 2, False, True), (64, 64, 8, 2, True, True), (32, 64, 8, 2, True, True),
          (32, 64, 8, 2, False, True), (32, 64, 8, 2, True, False), (64, 64, 8, 1, False, True)],
    128: [(64, 64, 8, 2, False, False), (64, 64, 8, 2, False, True), (64, 128, 8, 2, True, True),
          (64, 128, 8, 2, False, True), (64, 128, 8, 3, True, True), (32, 128, 8, 2, True, True),
          (32, 64, 4, 3, False, True), (64, 128, 8, 2, True, False)],
}
DQ = {
    64: [(128, 64, 8, 3, False), (128, 64, 8, 3, False, True), (128, 128, 8, 2, False),
         (128, 128, 8, 3, False), (64, 64, 4, 3, False), (128, 64, 8, 3, True)],
    256: [(64, 64, 8, 2, False), (64, 64, 8, 2, False, True), (64, 64, 8, 2, True),
          (64, 32, 4, 2, True), (128, 32, 8, 2, True)],
    128: [(128, 64, 8, 2, False), (128, 64, 8, 3, False), (128, 64, 8, 3, False, True),
          (128, 128, 8, 2, False), (128, 64, 8, 2, True), (64, 64, 4, 2, False)],
}


def _label(v) -> str:
    tag = f"{v[0]}x{v[1]}w{v[2]}s{v[3]}" + ("-smem" if v[4] else "-reg")
    if len(v) > 5:
        tag += "-split" if v[5] else "-onemask"
    return tag


def run_case(name: str, s: int, d: int, dtype, dkdv, dq, heads=None) -> dict:
    """Every variant of both kernels on one mask (heads: hidden 4096 / D unless given)."""
    hq = hk = heads or 4096 // d
    c = backward_case(name, s, d, hq, hk, dtype, device=DEVICE, total_tokens=TOTAL_TOKENS,
                      seed=s + d + 7)
    q, k, v, dout, cols, causal, scale, flops = (c.q, c.k, c.v, c.dout, c.cols, c.causal,
                                                 c.scale, c.flops_bwd)
    delta, lse2 = T._bwd_pre(c.out, dout, c.lse, None)
    # dK/dV does 4 of the 7 executed matmuls of a split backward, dQ 3 (bwd FLOPs count 5)
    rec = dict(mask=name, S=s, D=d, B=c.batch, Hq=hq, dkdv={}, dq={})
    for kind, variants, share in (("dkdv", dkdv, 4 / 5), ("dq", dq, 3 / 5)):
        ref = None
        for var in variants:
            cfg = T.Config(*var[:4])
            plan = T.make_plan(cols, causal, s, s, cfg.block_m, cfg.block_n, T.PLAN_BY_KEY[kind],
                               q.device)
            if kind == "dkdv":
                fn = lambda: T._launch_dkdv_tl(q, k, v, dout, lse2, delta, causal, scale, cfg, plan)[:2]  # noqa: E731,E501
            else:
                fn = lambda: (T._launch_dq(q, k, v, dout, lse2, delta, causal, scale, cfg, plan),)  # noqa: E731,E501
            patches = {"FLASHMASK3_TRITON_A_SMEM": "fwd" + ("," + kind if var[4] else "")}
            with mock.patch.dict(os.environ, patches), \
                    mock.patch.dict(T.SPLIT_UNMASKED_LOOP, {kind: var[5]} if len(var) > 5 else {}):
                r, grads = time_with_result(fn, flops * share, bench)
            if grads is not None and ref is None:
                ref = grads
            elif grads is not None:
                r["rel_err_vs_first"] = max(relative_error(a, b) for a, b in zip(grads, ref))
            rec[kind][_label(var)] = r
    return rec


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# Backward kernel configurations ({meta['gpu']}, {meta['date'][:10]}, torch "
             f"{meta['torch']}, triton {meta['triton']}, {meta['dtype']})", "",
             f"Command: `{meta['command']}`", "",
             "Each kernel alone: ms (hardware TFLOP/s of its own matmuls: dK/dV 4/5 and dQ 3/5 "
             "of the DESIGN.md backward count) and max relative error of its gradients against "
             "the first variant. `reg`/`smem`: wgmma A operands in registers / shared memory; "
             "`split`: UNMASKED tiles in a loop without mask code.", ""]
    for kind in ("dkdv", "dq"):
        for d in sorted({r["D"] for r in results}):
            rows = [r for r in results if r["D"] == d]
            labels = list(dict.fromkeys(lab for r in rows for lab in r[kind]))
            lines += [f"## {kind}, D={d}", "", "| mask | S | D | " + " | ".join(labels) + " |",
                      "|---|---|---|" + "---|" * len(labels)]
            lines += [_row(r, kind, labels) for r in rows] + [""]
    return "\n".join(lines)


def _row(r: dict, kind: str, labels: list) -> str:
    """One mask's cells: ms (TFLOP/s) and the error against the first variant."""
    cells = []
    for lab in labels:
        x = r[kind].get(lab, {"error": "not run"})
        if "error" in x:
            cells.append("error")
            continue
        err = f" e={x['rel_err_vs_first']:.0e}" if "rel_err_vs_first" in x else ""
        cells.append(f"{x['ms']:.2f} ({x['tflops']:.0f}){err}")
    return f"| {r['mask']} | {r['S'] // 1024}K | {r['D']} | " + " | ".join(cells) + " |"


def _describe(rec: dict) -> str:
    return "; ".join(f"{kind} " + str({k: round(x.get("ms", -1), 2) for k, x in rec[kind].items()})
                     for kind in ("dkdv", "dq"))


def main(argv=None) -> int:
    ap = sweep_parser(__doc__.splitlines()[0], MASKS)
    args = parse_sweep_args(ap, argv, DKDV)
    run_sweep(args, argv, "backward_configs",
              lambda m, s, d: run_case(m, s, d, torch.bfloat16, DKDV[d], DQ[d]), _describe, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
