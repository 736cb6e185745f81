"""Where the default (fused) backward's time goes, stage by stage, on the benchmark's masks.

One GPU, one process, the inputs of ``benchmarks/kernel.py`` (bf16, total tokens 128K, hidden
4096). Each stage of ``triton_flashmask.backward`` is timed alone (median) on the
same inputs, plus the whole backward:

* ``pre``: the delta / lse2 pre-pass (``_bwd_pre``);
* ``plan``: the by-key plan (``make_plan``: block summaries and live ranges on the GPU);
* ``kernel``: the fused kernel's launch as the backward issues it (including the zero fill of
  its fp32 dQ accumulator), and ``zero``: that fill alone;
* ``scale``: dQ = scale * accumulator in the backward's own kernel (``scale_dq``), and
  ``scale_torch``: the same with ``torch.mul`` (what the backward did before);
* ``whole``: ``triton_flashmask.backward``.

Each is timed with ``benchmarks/kernel.py``'s ``bench`` (the kernel table's timer). The
stages do not add up exactly (launch gaps, caches). Usage (on the GPU)::

    PYTHONPATH=. python benchmarks/backward_stages.py --masks causal,causal_document_short \\
        --dims 128 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import run_environment  # noqa: E402
from benchmarks.kernel import MASKS, TOTAL_TOKENS, bench  # noqa: E402
from benchmarks.sweep import backward_case  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402

STAGES = ("pre", "plan", "zero", "kernel", "scale", "scale_torch", "whole")


def stage_functions(cs, d: int) -> dict:
    """The callables of :data:`STAGES` on one case (``benchmarks.sweep.BackwardCase``)."""
    q, k, v, dout, cols, causal, scale = cs.q, cs.k, cs.v, cs.dout, cs.cols, cs.causal, cs.scale
    b, s, hq, _ = q.shape
    c = 0 if cols is None else cols.shape[-1]
    kind = T.BACKWARD_KERNELS[T.backward_mode(like=q)][0]
    cfg = T._config(kind, d, causal, c, q.dtype, like=q)
    delta, lse2 = T._bwd_pre(cs.out, dout, cs.lse, None)
    plan = T.make_plan(cols, causal, s, s, cfg.block_m, cfg.block_n, T.PLAN_BY_KEY[kind],
                       q.device)
    fused = kind == "fused"
    acc = T._launch_dkdv(q, k, v, dout, lse2, delta, causal, scale, cfg, plan, fuse_dq=fused)[2]
    fns = {
        "pre": lambda: T._bwd_pre(cs.out, dout, cs.lse, None),
        "plan": lambda: T.make_plan(cols, causal, s, s, cfg.block_m, cfg.block_n,
                                    T.PLAN_BY_KEY[kind], q.device),
        "kernel": lambda: T._launch_dkdv(q, k, v, dout, lse2, delta, causal, scale, cfg, plan,
                                         fuse_dq=fused),
        "whole": lambda: T.backward(dout, None, q, k, v, cs.out, cs.lse, cols, causal, scale),
    }
    if acc is not None:
        fns["zero"] = lambda: torch.zeros(acc.numel(), dtype=torch.float32, device=q.device)
        fns["scale"] = lambda: T.scale_dq(acc, scale, q.dtype)
        out = torch.empty(acc.shape, dtype=q.dtype, device=q.device)
        fns["scale_torch"] = lambda: torch.mul(acc, scale, out=out)
    return fns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", default="causal,causal_document_short,causal_document_corpus",
                    help=f"comma-separated, from {', '.join(MASKS)}")
    ap.add_argument("--dims", default="128", help="head dims, comma-separated")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args(argv)
    masks = args.masks.split(",")
    bad = [m for m in masks if m not in MASKS]
    if bad:
        ap.error(f"--masks: unknown {bad} (known: {', '.join(MASKS)})")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for name in masks:
            hq = 4096 // d
            cs = backward_case(name, args.seqlen, d, hq, hq, torch.bfloat16, device="cuda",
                               total_tokens=TOTAL_TOKENS, seed=args.seqlen + 11)
            row = dict(mask=name, S=args.seqlen, D=d, B=cs.batch, Hq=hq,
                       backward=T.backward_mode(like=cs.q))
            for stage, fn in stage_functions(cs, d).items():
                row[stage] = bench(fn)[0]
            rows.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
            del cs
            torch.cuda.empty_cache()
    meta = run_environment(torch.device("cuda"))
    with open(os.path.join(args.out, "backward_stages.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Backward stages (ms, median)\n\nGPU {meta.get('gpu')}, {meta['date']}, "
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}.\n"
             f"Command: `{meta['command']}`\n",
             "| mask | D | " + " | ".join(STAGES) + " |", "|---|---|" + "---|" * len(STAGES)]
    for r in rows:
        lines.append(f"| {r['mask']} | {r['D']} | "
                     + " | ".join(f"{r[s]:.2f}" if s in r else "-" for s in STAGES) + " |")
    with open(os.path.join(args.out, "backward_stages.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
