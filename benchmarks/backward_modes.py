"""Backward variants of the Triton kernel, timed back to back on the same inputs (one GPU).

* ``split``: the dK/dV kernel, then the dQ kernel (recomputes P and dP; deterministic), with
  each of the two kernels also timed alone;
* ``fused:<config>``: the dK/dV kernel that also reduce-adds dQ (TMA ``cp.reduce.async.bulk``
  on Hopper), for every candidate configuration, with the wgmma A operands (K, V) in registers
  and, as ``fused-smem:<config>``, in shared memory.

Every variant's gradients are compared with the split backward's (bf16 relative error), so a
fast but wrong variant shows up in the table. Used to choose the default backward and the
fused configurations (benchmarks/NOTES.md)::

    python benchmarks/backward_modes.py --out $OUT          # on the GPU
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernel import TOTAL_TOKENS, bench  # noqa: E402
from benchmarks.sweep import (backward_case, relative_error, run_sweep, sweep_parser,  # noqa: E402
                              time_with_result)
from flashmask3.kernels import triton_flashmask as T  # noqa: E402

DEVICE = "cuda"
MASKS = ["causal", "full", "causal_document_corpus", "causal_document_short", "document_corpus",
         "sliding_window", "global_sliding_window", "shared_question", "prefix_lm", "random_eviction"]


def _variants(d: int):
    """(label, backward mode, config override or None, A-operand-in-smem kinds)."""
    out = [("split", "split", None, "")]
    for cfg in T.CANDIDATES[("fused", d)]:
        tag = f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
        out.append((f"fused:{tag}", "fused", cfg, ""))
        out.append((f"fused-smem:{tag}", "fused", cfg, "fused"))
    return out


def run_case(name: str, s: int, d: int, hq: int, hk: int, dtype) -> dict:
    c = backward_case(name, s, d, hq, hk, dtype, device=DEVICE, total_tokens=TOTAL_TOKENS,
                      seed=s + d + 1)
    q, k, v, out, lse, dout, cols, causal, scale, flops = (c.q, c.k, c.v, c.out, c.lse, c.dout,
                                                           c.cols, c.causal, c.scale, c.flops_bwd)
    rec = dict(mask=name, S=s, D=d, B=c.batch, Hq=hq, Hk=hk, flops_bwd=flops, variants={})
    ref = None
    for label, mode, cfg, a_smem in _variants(d):
        overrides = {} if cfg is None else {"fused": cfg}
        a_smem_env = {"FLASHMASK3_TRITON_A_SMEM": "fwd" + ("," + a_smem if a_smem else "")}
        with T.use_backward(mode), mock.patch.dict(os.environ, a_smem_env), \
                mock.patch.dict(T.CONFIG_OVERRIDE, overrides):
            r, grads = time_with_result(
                lambda: T.backward(dout, None, q, k, v, out, lse, cols, causal, scale), flops,
                bench)
        if grads is not None and ref is None:
            ref = grads
        elif grads is not None:
            r["rel_err_vs_split"] = [relative_error(a, b) for a, b in zip(grads, ref)]
        rec["variants"][label] = r
    rec["split_parts_ms"] = _split_parts(q, k, v, out, lse, dout, cols, causal, scale)
    return rec


def _split_parts(q, k, v, out, lse, dout, cols, causal, scale) -> dict:
    """The split backward's three launches timed alone (delta preprocess, dK/dV, dQ)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    c = 0 if cols is None else cols.shape[-1]
    delta, lse2 = T._bwd_pre(out, dout, lse, None)
    cfg_kv = T._config("dkdv", d, causal, c, q.dtype, like=q)
    plan_kv = T.make_plan(cols, causal, sq, sk, cfg_kv.block_m, cfg_kv.block_n, True, q.device)
    cfg_q = T._config("dq", d, causal, c, q.dtype)
    plan_q = T.make_plan(cols, causal, sq, sk, cfg_q.block_m, cfg_q.block_n, False, q.device)
    return dict(
        pre=bench(lambda: T._bwd_pre(out, dout, lse, None))[0],
        dkdv=bench(lambda: T._launch_dkdv(q, k, v, dout, lse2, delta, causal, scale, cfg_kv, plan_kv))[0],
        dq=bench(lambda: T._launch_dq(q, k, v, dout, lse2, delta, causal, scale, cfg_q, plan_q))[0])


def markdown(results: list[dict], meta: dict) -> str:
    labels = list(results[0]["variants"]) if results else []
    lines = [f"# Backward variants ({meta['gpu']}, {meta['date'][:10]}, torch {meta['torch']}, "
             f"triton {meta['triton']}, {meta['dtype']})", "", f"Command: `{meta['command']}`", "",
             "Backward time in ms (TFLOP/s); fused variants also give max rel. error of dq/dk/dv "
             "against split. `split parts`: delta / dK,dV / dQ kernels alone.", "",
             "| mask | S | D | " + " | ".join(labels) + " | split parts |",
             "|---|---|---|" + "---|" * len(labels) + "---|"]
    for r in results:
        cells = []
        for lab in labels:
            x = r["variants"][lab]
            if "error" in x:
                cells.append("error")
                continue
            err = f" e={max(x['rel_err_vs_split']):.1e}" if "rel_err_vs_split" in x else ""
            cells.append(f"{x['ms']:.2f} ({x['tflops']:.0f}){err}")
        p = r["split_parts_ms"]
        lines.append(f"| {r['mask']} | {r['S'] // 1024}K | {r['D']} | " + " | ".join(cells)
                     + f" | {p['pre']:.2f} / {p['dkdv']:.2f} / {p['dq']:.2f} |")
    return "\n".join(lines) + "\n"


def _describe(rec: dict) -> str:
    best = min((x["ms"], lab) for lab, x in rec["variants"].items() if "ms" in x)
    return (f"split={rec['variants']['split'].get('ms', -1):.2f} best={best[1]} {best[0]:.2f} ms "
            f"parts={rec['split_parts_ms']}")


def main(argv=None) -> int:
    args = sweep_parser(__doc__.splitlines()[0], MASKS).parse_args(argv)
    run_sweep(args, argv, "backward_modes",
              lambda m, s, d: run_case(m, s, d, 4096 // d, 4096 // d, torch.bfloat16),
              _describe, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
