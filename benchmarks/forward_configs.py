"""The forward kernel's tile configurations, each timed alone on the same inputs (one GPU).

For every mask, the tl forward runs with each (block_m, block_n, warps, stages) of ``FWD``; each
variant's O and LSE are compared with the first variant's (the default tile), so a fast but wrong
variant shows up. Written for the short-document masks (benchmarks/NOTES.md, "What limits it"):
the default 128x128 w8 tile needs 224 KB of shared memory and ~255 registers, so one program
runs per SM and each program's prologue and epilogue are exposed. Those masks give each program
only ~9 live tiles. A 64x64 w4 tile fits two programs per SM (sm_90 report: 167-226 registers,
81-113 KB, no spills), so one program's prologue and epilogue overlap the other's loop::

    python benchmarks/forward_configs.py --out $OUT          # on the GPU
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernel import TOTAL_TOKENS, bench  # noqa: E402
from benchmarks.sweep import (backward_case, parse_sweep_args, relative_error,  # noqa: E402
                              run_sweep, sweep_parser, time_with_result)
import flashmask3.masks as M  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402

DEVICE = "cuda"
#: short-document spreads first (the masks the sweep is for), then their longer-document
#: twins and plain causal as the controls
MASKS = ["causal_document_short", "document_short", "causal_document_mixed",
         "causal_document_corpus", "document_corpus", "causal"]
#: Per head dim: forward variants (block_m, block_n, warps, stages); the first (the default
#: tile) is the reference the others' outputs are compared with. Checked offline for sm_90
#: (triton_report; D=128 causal C=1 / non-causal C=2): 128x128 w8 s3 255 registers, 225 KB
#: (0/26 LDL/STL); 128x64 w8 s2 184-228 registers, 96 KB; 64x64 w4 s2 167-226 registers,
#: 81 KB and s3 174-218 registers, 113 KB, no spills, two programs per SM. 64x128 w4 spills
#: ~2700 LDL/STL and is left out. D=64: 64x64 w4 s2/s3 128-159 registers, 41-57 KB, no
#: spills, three or four programs per SM. D=256 (forward 0.80x cuDNN on causal): the default
#: 128x64 w8 s2 255 registers, 192 KB; 128x32 w8 s2 237-241, 128 KB; 64x64 w4 s2 255, 161 KB;
#: 64x32 w4 s2 237-249, 96 KB (two programs per SM); none spills (the s1 and 128x128 shapes
#: do, 2-301 LDL/STL: left out).
FWD = {
    128: [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2),
          (64, 64, 4, 3)],
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
}


def _label(v) -> str:
    return "{}x{}w{}s{}".format(*v)


def run_case(name: str, s: int, d: int, dtype, variants, heads=None) -> dict:
    """Every forward variant on one mask (heads: hidden 4096 / D unless given)."""
    hq = hk = heads or 4096 // d
    c = backward_case(name, s, d, hq, hk, dtype, device=DEVICE, total_tokens=TOTAL_TOKENS,
                      seed=s + d + 11)
    flops = M.attention_flops(c.cols, c.causal, batch_size=c.batch, num_heads=hq, seqlen_q=s,
                              seqlen_k=s, head_dim=d, mode="fwd")
    rec = dict(mask=name, S=s, D=d, B=c.batch, Hq=hq, fwd={})
    ref = None
    for var in variants:
        cfg = T.Config(*var)
        plan = T.make_plan(c.cols, c.causal, s, s, cfg.block_m, cfg.block_n, T.PLAN_BY_KEY["fwd"],
                           c.q.device)
        r, out = time_with_result(
            lambda: T._launch_fwd(c.q, c.k, c.v, c.cols, c.causal, c.scale, cfg, plan),
            flops, bench)
        if out is not None and ref is None:
            ref = out
        elif out is not None:
            r["rel_err_vs_first"] = max(relative_error(out[0], ref[0]),
                                        _lse_error(out[1], ref[1]))
        rec["fwd"][_label(var)] = r
    return rec


def _lse_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of two LSE tensors over the rows that attend to something (a fully
    masked row's LSE is -inf in both)."""
    live = torch.isfinite(b)
    if not bool(torch.equal(live, torch.isfinite(a))):
        return float("inf")
    return relative_error(a[live], b[live]) if bool(live.any()) else 0.0


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# Forward kernel configurations ({meta['gpu']}, {meta['date'][:10]}, torch "
             f"{meta['torch']}, triton {meta['triton']}, {meta['dtype']})", "",
             f"Command: `{meta['command']}`", "",
             "The tl forward alone: ms (effective TFLOP/s, DESIGN.md forward count) and the max "
             "relative error of O and LSE against the first variant (the default tile).", ""]
    for d in sorted({r["D"] for r in results}):
        rows = [r for r in results if r["D"] == d]
        labels = list(dict.fromkeys(lab for r in rows for lab in r["fwd"]))
        lines += [f"## fwd, D={d}", "", "| mask | S | D | " + " | ".join(labels) + " |",
                  "|---|---|---|" + "---|" * len(labels)]
        lines += [_row(r, labels) for r in rows] + [""]
    return "\n".join(lines)


def _row(r: dict, labels: list) -> str:
    """One mask's cells: ms (TFLOP/s), the speed-up over the first variant, and the error."""
    first = next(iter(r["fwd"].values()), {})
    cells = []
    for lab in labels:
        x = r["fwd"].get(lab, {"error": "not run"})
        if "error" in x:
            cells.append("error")
            continue
        speed = f" x{first['ms'] / x['ms']:.2f}" if "ms" in first and x is not first else ""
        err = f" e={x['rel_err_vs_first']:.0e}" if "rel_err_vs_first" in x else ""
        cells.append(f"{x['ms']:.2f} ({x['tflops']:.0f}){speed}{err}")
    return f"| {r['mask']} | {r['S'] // 1024}K | {r['D']} | " + " | ".join(cells) + " |"


def _describe(rec: dict) -> str:
    return "fwd " + str({k: round(x.get("ms", -1), 2) for k, x in rec["fwd"].items()})


def main(argv=None) -> int:
    ap = sweep_parser(__doc__.splitlines()[0], MASKS)
    args = parse_sweep_args(ap, argv, FWD)
    run_sweep(args, argv, "forward_configs",
              lambda m, s, d: run_case(m, s, d, torch.bfloat16, FWD[d]), _describe, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
