"""A/B of the Gluon dQ kernel against the ``tl`` dQ kernel (one H200, one process).

Two parts, both on the same inputs:

1. a small-shape correctness pass over ``gluon_dkdv_ab.SMALL_CASES`` (S=1000 with every
   (causal, C) mask layout and random column intervals, GQA, Hm in {1, Hk, Hq}, Sq != Sk
   (777 x 1000), fp16 once, D=64 once): each Gluon config's dQ against the ``tl`` dQ kernel
   at the same tile shape (expected bitwise equal: same wgmma k-steps in the same order) and
   against the ``tl`` kernel at its default config (max abs / relative difference);
2. timing at bf16, D=128, S=32768, B*S = 128K tokens (B=4) on TIMED_CASES: median ms of
   ``triton.testing.do_bench`` of the ``tl`` dQ (default config) and of each Gluon config,
   the speed-up, and hardware TFLOP/s of the live tiles each kernel visits (3 matmuls of
   2*BM*BN*D per tile: S, dP, dQ).

A Gluon config is a FAIL when its dQ is off by more than REL_TOL from the ``tl`` default's, or
not bitwise equal to the ``tl`` kernel at its own tile shape (``bitwise_same_shape``). Every
case is wrapped so an error is recorded (traceback printed) and the rest still runs. No new
case starts after ``--budget-s`` seconds (the small pass stops starting cases after
``--small-frac`` of it, so the timed pass gets the rest); a case that runs longer than
``gluon_dkdv_ab.case_timeout(deadline)`` is taken for a hang (an mbarrier wait that never
completes cannot be caught): faulthandler prints the stacks and ends the process, and the JSON
written after every case keeps the cases before it. Writes ``$OUT/gluon_dq_ab.json`` and
``.md`` (OUT defaults to /tmp); exits 1 when any case failed or errored::

    PYTHONPATH=. FLASHMASK3_BACKEND=triton python benchmarks/gluon_dq_ab.py --budget-s 200

Shares the inputs, small cases, timing and record writing of ``benchmarks/gluon_dkdv_ab.py``
(imported, not copied).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gluon_dkdv_ab as AB  # noqa: E402
from flashmask3.kernels import gluon_dq as GQ  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402

REL_TOL = AB.REL_TOL
#: Gluon configs (block_m, block_n, num_warps, num_stages, pipe) at D=128, label
#: ``BMxBNwWsS`` plus ``p`` for the PIPE kernel (each tile's dQ wgmma overlapped with the next
#: tile's S and dP): the tl default shape 128x64 w8 s3 (bitwise equality with the tl default
#: expected) plain and PIPE, and 64x64 w4 s2 plain and PIPE (one warpgroup, two programs per
#: SM by registers and shared memory). (64x128 and 128x128 spill hundreds of registers inside
#: the tile loops: not timed; 128x64w8s2p was timed once at 0.74-0.90x of tl.)
TIMED_CONFIGS = [(128, 64, 8, 3, False), (128, 64, 8, 3, True), (64, 64, 4, 2, False),
                 (64, 64, 4, 2, True)]
#: Checked on every small D=128 case ...
SMALL_CONFIGS = [(128, 64, 8, 3, False), (128, 64, 8, 3, True), (64, 64, 4, 2, True)]
#: ... and these on the first two only.
EXTRA_SMALL_CONFIGS = [(128, 64, 8, 2, False), (128, 64, 8, 2, True), (64, 64, 4, 2, False),
                       (64, 64, 4, 3, True)]
#: (mask, Hq, Hk) timed, in order (the budget may cut the tail).
TIMED_CASES = [("causal", 32, 32), ("causal", 32, 8), ("causal_document_corpus", 32, 32),
               ("document_corpus", 32, 32), ("sliding_window", 32, 32), ("full", 32, 32)]


def _cfg_tuple(cfg: T.Config) -> tuple:
    return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)


def _label(cfg) -> str:
    """``BMxBNwWsS`` (``gluon_dkdv_ab._label``), plus ``p`` for the PIPE kernel."""
    return AB._label(tuple(cfg[:4])) + ("p" if len(cfg) > 4 and cfg[4] else "")


def _parse(label: str) -> tuple:
    """(block_m, block_n, num_warps, num_stages, pipe) of a label (inverse of :func:`_label`)."""
    pipe = label.endswith("p")
    return tuple(AB._parse(label[:-1] if pipe else label)[:4]) + (pipe, )


def _tl_dq(q, k, v, dout, lse2, delta, cols, causal, scale, cfg=None):
    """(launch closure, config tuple, plan) of the tl dQ kernel: at ``cfg`` (a tuple) or at the
    library default ``_config("dq", ...)``."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    c = 0 if cols is None else cols.shape[-1]
    tcfg = T.Config(*cfg) if cfg is not None else T._config("dq", d, causal, c, q.dtype)
    plan = T.make_plan(cols, causal, sq, sk, tcfg.block_m, tcfg.block_n, False, q.device)

    def fn():
        return T._launch_dq_tl(q, k, v, dout, lse2, delta, causal, scale, tcfg, plan)
    return fn, _cfg_tuple(tcfg), plan


def _gluon_dq(q, k, v, dout, lse2, delta, cols, causal, scale, cfg):
    """(launch closure, plan) of the Gluon dQ kernel at ``cfg``."""
    sq, sk = q.shape[1], k.shape[1]
    plan = T.make_plan(cols, causal, sq, sk, cfg[0], cfg[1], False, q.device)
    pipe = len(cfg) > 4 and bool(cfg[4])

    def fn():
        return GQ.launch_dq_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, *cfg[:4],
                                  pipe=pipe)
    return fn, plan


def _compare(got, ref, same_shape_ref) -> dict:
    """Max abs / relative difference to the tl default's dQ, and bitwise equality with the tl
    kernel at the same tile shape (None: not run)."""
    res = dict(dq_max_abs=(got.float() - ref.float()).abs().max().item(),
               dq_rel=AB._rel(got, ref), dq_finite=bool(torch.isfinite(got).all().item()),
               bitwise_default=bool(torch.equal(got, ref)))
    if same_shape_ref is not None:
        res["bitwise_same_shape"] = bool(torch.equal(got, same_shape_ref))
        res["same_shape_max_abs"] = (got.float() - same_shape_ref.float()).abs().max().item()
    res["ok"] = (res["dq_rel"] <= REL_TOL and res["dq_finite"]
                 and res.get("bitwise_same_shape", True))
    return res


def _fmt(res: dict) -> str:
    if "error" in res:
        return "ERROR"
    return (f"dq rel {res['dq_rel']:.2e} max {res['dq_max_abs']:.2e}"
            + (" bitwise(default)" if res["bitwise_default"] else "")
            + (" bitwise(same shape)" if res.get("bitwise_same_shape") else
               f" SAME-SHAPE max {res.get('same_shape_max_abs', float('nan')):.2e}"
               if "bitwise_same_shape" in res else "")
            + (" ok" if res["ok"] else " FAIL"))


# ---------------------------------------------------------------------------------------------
# Part 1: small shapes
# ---------------------------------------------------------------------------------------------


def small_pass(records, deadline, out_path):
    """Every Gluon config that applies against tl on ``gluon_dkdv_ab.SMALL_CASES``."""
    for i, case, rec in AB.small_case_records(records, deadline, out_path, "small",
                                              hang_deadline=deadline):
        name, b, sq, sk, hq, hk, hm, d, dtype, causal, c = case
        cols = AB.small_mask(i, case)
        try:
            q, k, v, dout, lse2, delta, scale = AB._inputs(b, sq, sk, hq, hk, d, dtype, cols,
                                                           causal, seed=7 + i)
            tl_fn, tl_cfg, _ = _tl_dq(q, k, v, dout, lse2, delta, cols, causal, scale)
            ref = tl_fn()
            rec["tl_config"] = _label(tl_cfg)
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            continue
        if d == 128:
            cfgs = SMALL_CONFIGS + (EXTRA_SMALL_CONFIGS if i < 2 else [])
        else:
            cfgs = [tl_cfg + (False, ), tl_cfg + (True, )]
        for cfg in cfgs:
            try:
                same = ref if tuple(cfg[:4]) == tl_cfg else _tl_dq(
                    q, k, v, dout, lse2, delta, cols, causal, scale, cfg[:4])[0]()
                got = _gluon_dq(q, k, v, dout, lse2, delta, cols, causal, scale, cfg)[0]()
                res = _compare(got, ref, same)
                torch.cuda.synchronize()
            except Exception:
                res = dict(ok=False, error=traceback.format_exc())
                print(f"[{name} {_label(cfg)}]\n{res['error']}", flush=True)
            rec["gluon"][_label(cfg)] = res
            print(f"small {name:28s} {_label(cfg):12s} {_fmt(res)}", flush=True)


# ---------------------------------------------------------------------------------------------
# Part 2: timing at 32K
# ---------------------------------------------------------------------------------------------


def live_tiles_dq(plan, causal, b, sq, sk, hq, bm, bn) -> int:
    """Key tiles visited over all query blocks, batches and query heads for one by-query plan
    (the ``tl`` ``_query_block_ranges`` rule without a mask)."""
    nqb, nkb = -(-sq // bm), -(-sk // bn)
    if plan.c == 0:
        if not causal:
            return nqb * nkb * b * hq
        per_bh = 0
        for m in range(nqb):
            last = min(m * bm + bm, sq) - 1 + (sk - sq)
            per_bh += 0 if last < 0 else max(min((last + bn) // bn, nkb), 0)
        return per_bh * b * hq
    r = plan.ranges.view(-1, nqb, 8).long()
    per_mask_bh = ((r[..., 1] - r[..., 0]).clamp_min(0)
                   + (r[..., 3] - r[..., 2]).clamp_min(0)).sum(1)
    mask_batches = per_mask_bh.numel() // plan.hm
    total = int(per_mask_bh.sum().item()) * (hq // plan.hm)
    return total * (b if mask_batches == 1 and b > 1 else 1)


def _tile_tflops(tiles, bm, bn, d, ms) -> float:
    """Hardware rate: 3 matmuls (S, dP, dQ) of 2*BM*BN*D per visited tile."""
    return 3 * 2.0 * bm * bn * d * tiles / ms / 1e9


def timed_pass(records, deadline, out_path, seqlen, configs):
    from benchmarks.sweep import backward_case

    for name, hq, hk in TIMED_CASES:
        if time.time() > deadline:
            records.append(dict(part="timed", case=name, Hq=hq, Hk=hk, skipped="budget"))
            AB._write(out_path, records)
            continue
        AB._arm_watchdog(f"timed {name} Hq={hq} Hk={hk}", deadline)
        rec = dict(part="timed", case=name, S=seqlen, D=128, Hq=hq, Hk=hk, dtype="bf16",
                   gluon={})
        try:
            cs = backward_case(name, seqlen, 128, hq, hk, torch.bfloat16, device="cuda",
                               total_tokens=AB.TOTAL_TOKENS, seed=seqlen + 135)
            q, k, v, dout, cols, causal, scale = (cs.q, cs.k, cs.v, cs.dout, cs.cols, cs.causal,
                                                  cs.scale)
            delta, lse2 = T._bwd_pre(cs.out, dout, cs.lse, None)
            b = cs.batch
            rec.update(B=b, causal=causal, C=0 if cols is None else cols.shape[-1])
            tl_fn, tl_cfg, tl_plan = _tl_dq(q, k, v, dout, lse2, delta, cols, causal, scale)
            ref = tl_fn()
            ms = AB._bench(tl_fn)
            tiles = live_tiles_dq(tl_plan, causal, b, seqlen, seqlen, hq, tl_cfg[0], tl_cfg[1])
            rec["tl"] = dict(config=_label(tl_cfg), ms=ms,
                             tile_tflops=_tile_tflops(tiles, tl_cfg[0], tl_cfg[1], 128, ms))
            _print_timing(name, hq, hk, "tl " + _label(tl_cfg), rec["tl"])
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            records.append(rec)
            AB._write(out_path, records)
            continue
        for cfg in configs:  # a started case runs every config (the budget is per case)
            try:
                fn, plan = _gluon_dq(q, k, v, dout, lse2, delta, cols, causal, scale, cfg)
                got = fn()
                # bitwise against tl at the same shape only where that is the tl default
                res = _compare(got, ref, ref if tuple(cfg[:4]) == tl_cfg else None)
                del got
                ms = AB._bench(fn)
                tiles = live_tiles_dq(plan, causal, b, seqlen, seqlen, hq, cfg[0], cfg[1])
                res.update(ms=ms, tile_tflops=_tile_tflops(tiles, cfg[0], cfg[1], 128, ms),
                           speedup_vs_tl=rec["tl"]["ms"] / ms)
            except Exception:
                res = dict(ok=False, error=traceback.format_exc())
                print(f"[{name} {_label(cfg)}]\n{res['error']}", flush=True)
            rec["gluon"][_label(cfg)] = res
            _print_timing(name, hq, hk, "gluon " + _label(cfg), res)
        records.append(rec)
        AB._write(out_path, records)
        del cs, q, k, v, dout, delta, lse2, ref
        torch.cuda.empty_cache()


def _print_timing(name, hq, hk, what, r):
    if "error" in r:
        print(f"timed {name:24s} Hq={hq:2d} Hk={hk:2d} {what:18s} ERROR", flush=True)
        return
    extra = (f"  x{r['speedup_vs_tl']:.3f} vs tl  " + _fmt(r)) if "dq_rel" in r else ""
    print(f"timed {name:24s} Hq={hq:2d} Hk={hk:2d} {what:18s} {r['ms']:8.2f} ms "
          f"(tiles {r['tile_tflops']:4.0f} TFLOP/s)" + extra, flush=True)


def summary_table(records) -> str:
    """Markdown: per timed case, tl and each Gluon config's ms (hardware TFLOP/s of the live
    tiles) and speed-up over tl; ``!`` marks a config whose dQ is off."""
    timed = [r for r in records if r.get("part") == "timed" and "tl" in r]
    if not timed:
        return ""
    labels = list(dict.fromkeys(lab for r in timed for lab in r["gluon"]))
    lines = ["", "| mask | Hq/Hk | tl (" + timed[0]["tl"]["config"] + ") | "
             + " | ".join(f"Gluon {lab}" for lab in labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    for r in timed:
        cells = [f"{r['tl']['ms']:.2f} ms ({r['tl']['tile_tflops']:.0f})"]
        for lab in labels:
            x = r["gluon"].get(lab, {})
            if "ms" not in x:
                cells.append("error" if "error" in x else "-")
            else:
                cells.append(f"{x['ms']:.2f} ms ({x['tile_tflops']:.0f}) "
                             f"x{x['speedup_vs_tl']:.3f}" + ("" if x.get("ok") else " !"))
        lines.append(f"| {r['case']} | {r['Hq']}/{r['Hk']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def small_table(records) -> str:
    """Markdown: per small case and config, max abs / rel difference to the tl default and
    whether dQ is bitwise equal to tl at the same tile shape."""
    small = [r for r in records if r.get("part") == "small" and r.get("gluon")]
    if not small:
        return ""
    lines = ["", "| case | config | max abs (vs tl default) | rel | bitwise (same shape) |",
             "|---|---|---|---|---|"]
    for r in small:
        for lab, x in r["gluon"].items():
            if "error" in x:
                lines.append(f"| {r['case']} | {lab} | error | | |")
                continue
            lines.append(f"| {r['case']} | {lab} | {x['dq_max_abs']:.2e} | {x['dq_rel']:.2e} | "
                         f"{x.get('bitwise_same_shape')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="no new case starts after this many seconds")
    ap.add_argument("--small-frac", type=float, default=0.35,
                    help="the small pass starts no case after this fraction of the budget")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--configs", default=",".join(_label(c) for c in TIMED_CONFIGS),
                    help="Gluon configs timed at 32K, labels BMxBNwWsS[p] (e.g. 128x64w8s3, "
                         "128x64w8s3p: the PIPE kernel)")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-timed", action="store_true")
    args = ap.parse_args(argv)
    configs = [_parse(lab) for lab in args.configs.split(",")]
    for cfg in configs:
        GQ.check_config(128, *cfg[:4])
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)")
        return 2
    reason = GQ.unavailable_reason()
    if reason:
        print(reason)
        return 2
    out_path, start, deadline, records = AB.start_run("gluon_dq_ab", args.budget_s)
    if not args.skip_small:
        small_pass(records, start + args.small_frac * args.budget_s, out_path)
    if not args.skip_timed:
        timed_pass(records, deadline, out_path, args.seqlen, configs)
    table = summary_table(records)
    print(table)
    bad = AB.failures(records, _fmt)
    return AB.finish_run(
        out_path, records, start,
        AB.md_header("Gluon dQ vs tl dQ", AB.run_meta())
        + f"Timed: dQ kernel alone, bf16, D=128, S={args.seqlen}, "
        f"B*S={AB.TOTAL_TOKENS}; median ms of do_bench (hardware TFLOP/s of the live "
        "tiles: S, dP, dQ) and speed-up over the tl dQ at its default config.\n"
        + table + "\n\nSmall cases (dQ vs the tl dQ):\n" + small_table(records)
        + "\n\n" + AB.verdict(bad, "All Gluon cases ok."),
        bad, "all Gluon dQ cases ok (bitwise where the tile shape matches)")


if __name__ == "__main__":
    sys.exit(main())
