"""A/B of the Gluon forward kernel (flashmask3/kernels/gluon_fwd.py) against the ``tl`` forward
(one H200, one process).

1. Small-shape correctness pass: the small cases of ``benchmarks/gluon_dkdv_ab.py`` (every
   (causal, C) layout with random column intervals, GQA, Hm in {1, Hk, Hq}, Sq != Sk = 777 x
   1000, fp16, D=64) plus a mask whose rows 0..299 and 600..999 are fully masked. Per Gluon
   config: O and LSE against the float64 dense reference (``tests/reference.py``, the
   project's one) and against the ``tl`` forward (its default config, its own plan), the
   fully-masked-row pattern (LSE = -inf exactly where the reference's is, O = 0 there, no NaN),
   and the split backward run on the Gluon O/LSE against the one run on tl's. A config is ok
   when O's relative error to the reference is <= REL_TOL, the LSE within LSE_TOL of it, the
   -inf pattern equal and the gradients within REL_TOL of the tl-based ones.
2. Timed pass at S=32768, D=128, bf16, B*S = 128K tokens: causal (Hq=Hk=32 and 32:8),
   causal_document_corpus, document_corpus, sliding_window, full; the tl forward at its default
   config and every ``--configs`` Gluon config, median ms of ``triton.testing.do_bench`` and
   TFLOP/s (DESIGN.md convention), speed-up over tl, O max abs difference to tl.

No new case starts after ``--budget-s`` seconds; a case running longer than CASE_TIMEOUT_S
(gluon_dkdv_ab's) is taken for a hang (an mbarrier wait that never completes cannot be
caught): faulthandler prints the stacks and ends the process; the JSON written after every case
keeps what ran. Writes ``$OUT/gluon_fwd_ab.json`` and ``$OUT/gluon_fwd_ab.md`` (OUT defaults to
/tmp); exits 1 when a case failed or errored::

    PYTHONPATH=. FLASHMASK3_BACKEND=triton python benchmarks/gluon_fwd_ab.py --budget-s 150
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gluon_dkdv_ab as AB  # noqa: E402
from benchmarks.gluon_dkdv_ab import (CASE_TIMEOUT_S, SMALL_CASES, TOTAL_TOKENS,  # noqa: E402
                                      _arm_watchdog, _rel, small_mask)
from flashmask3.kernels import gluon_fwd as F  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402

REL_TOL = 2e-2
LSE_TOL = 2e-2
#: Gluon configs checked on every small D=128 case: (block_m, block_n, num_warps, num_stages,
#: warp_spec, pingpong); labels ``128x64w8s4ws`` (warp-specialised), ``...wsp`` (and ping-pong).
SMALL_CONFIGS = [(128, 128, 8, 2, True, True), (128, 64, 8, 4, True, False),
                 (128, 64, 8, 4, True, True), (128, 128, 8, 3, False, False)]
#: ... and at D=64 (the tl D=64 default 128x64 w4 is not a Gluon shape).
SMALL_CONFIGS_D64 = [(128, 128, 8, 3, True, True), (128, 64, 8, 3, False, False)]
#: Timed at 32K by default (``--configs``), chosen from the offline report.
#: (64x64 w4 s2 and 128x128 w8 s2 were timed once: 0.69-0.86x of tl, dropped; session 7's
#: non-WS 128x128 w8 s3, 64x64 w4 s3, 128x64 w8 s3: 0.87-0.95x.)
TIMED_CONFIGS = [(128, 128, 8, 2, True, False), (128, 128, 8, 2, True, True),
                 (128, 64, 8, 4, True, False), (128, 64, 8, 4, True, True)]
#: (mask, Hq, Hk) in the order they run (the budget may cut the tail); at head dim D the
#: query heads are 4096 / D (GQA 4:1 at D=128 only).
TIMED_CASES = [("causal", 32, 32), ("causal", 32, 8), ("causal_document_corpus", 32, 32),
               ("document_corpus", 32, 32), ("sliding_window", 32, 32), ("full", 32, 32)]
#: (name, B, Sq, Sk, Hq, Hk, Hm, D, dtype, causal, C) of the fully-masked-rows case.
EMPTY_ROWS_CASE = ("s1000_rows_fully_masked", 2, 1000, 1000, 4, 2, 2, 128, torch.bfloat16,
                   False, 2)


def _flags(cfg) -> tuple:
    """(block_m, block_n, num_warps, num_stages, warp_spec, pingpong, persistent programs,
    cols_smem) of a config tuple (missing flags: False, False, 0 = not persistent, -1 = one
    per SM; True = the WS producer stages the mask columns in shared memory)."""
    return tuple(cfg) + (False, False, 0, True)[len(cfg) - 4:]


def _label(cfg) -> str:
    bm, bn, w, s, ws, pp, per, cols = _flags(cfg)
    return ("{}x{}w{}s{}".format(bm, bn, w, s) + ("wsp" if pp else "ws" if ws else "")
            + ("g" if ws and not cols else "")
            + ("" if not per else "+P" if per < 0 else f"+P{per}"))


def _parse(label: str) -> tuple:
    """``128x128w8s2`` -> (128, 128, 8, 2, False, False, 0, True); suffix ``ws``:
    warp-specialised, ``wsp``: and ping-pong, either followed by ``g``: the consumers load the
    mask columns from global memory (no COLS_SMEM); then ``+P``: persistent, one program per
    SM (``+P3``: 3 programs)."""
    per = 0
    if "+P" in label:
        label, _, n = label.partition("+P")
        per = int(n) if n else -1
    cols = not (label.endswith("wsg") or label.endswith("wspg"))
    return _parse_core(label[:-1] if not cols else label) + (per, cols)


def _parse_core(label: str) -> tuple:
    for suffix, flags in (("wsp", (True, True)), ("ws", (True, False)), ("", (False, False))):
        if label.endswith(suffix):
            core = label[:len(label) - len(suffix)]
            break
    nums = tuple(int(x) for x in core.replace("x", " ").replace("w", " ").replace("s", " ")
                 .split())
    if len(nums) != 4:
        raise ValueError(f"config label {label!r}: expected BMxBNwWsS[ws|wsp]")
    return nums + flags


def _empty_rows_mask(b, hm, sq, sk, device):
    """Non-causal C=2 columns [LTS=600, UTE=300]: rows < 300 and >= 600 see no key."""
    cols = torch.empty((b, hm, sk, 2), dtype=torch.int32)
    cols[..., 0] = 600
    cols[..., 1] = 300
    return cols.to(device)


def tl_forward(q, k, v, cols, causal, scale):
    """(closure, config) of the tl forward at its default config with its own plan."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    c = 0 if cols is None else cols.shape[-1]
    cfg = T._config("fwd", d, causal, c, q.dtype)
    plan = T.make_plan(cols, causal, sq, sk, cfg.block_m, cfg.block_n, False, q.device)
    return (lambda: T._launch_fwd_tl(q, k, v, cols, causal, scale, cfg, plan)), cfg


def tl_forward_at(q, k, v, cols, causal, scale, cfg):
    """Closure of the tl forward at tile ``cfg`` (a ``T.Config``) with its own plan."""
    plan = T.make_plan(cols, causal, q.shape[1], k.shape[1], cfg.block_m, cfg.block_n, False,
                       q.device)
    return lambda: T._launch_fwd_tl(q, k, v, cols, causal, scale, cfg, plan)


def _parse_tl(label: str):
    """``64x64w4s3`` -> ``T.Config(64, 64, 4, 3)`` (a ``--tl-configs`` entry)."""
    nums = _parse_core(label)[:4]
    return T.Config(*nums)


def gluon_forward(q, k, v, cols, causal, scale, cfg):
    """Closure of the Gluon forward at ``cfg`` with its own plan."""
    bm, bn, w, s, ws, pp, per, cs = _flags(cfg)
    plan = T.make_plan(cols, causal, q.shape[1], k.shape[1], bm, bn, False, q.device)
    return lambda: F.launch_fwd_gluon(q, k, v, cols, causal, scale, plan, bm, bn, w, s,
                                      warp_spec=ws, pingpong=pp, persistent=per != 0,
                                      programs=per if per > 0 else None, cols_smem=cs)


def _max_abs(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _lse_diff(a, b) -> float:
    """Max |a - b| over entries finite in both (the -inf pattern is checked separately)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    return (a[both].double() - b[both].double()).abs().max().item() if both.any() else 0.0


def compare(out, lse, ref_out, ref_lse, tl_out, tl_lse) -> dict:
    """O, LSE against the dense reference and the tl forward; the fully masked rows."""
    empty = torch.isinf(ref_lse)  # [B, Hq, Sq]
    res = dict(o_rel_ref=_rel(out, ref_out), o_max_abs_ref=_max_abs(out, ref_out),
               o_max_abs_tl=_max_abs(out, tl_out), o_rel_tl=_rel(out, tl_out),
               lse_max_abs_ref=_lse_diff(lse, ref_lse), lse_max_abs_tl=_lse_diff(lse, tl_lse),
               o_bitwise_tl=bool(torch.equal(out, tl_out)),
               finite=bool(torch.isfinite(out).all().item() and not torch.isnan(lse).any()),
               inf_pattern=bool(torch.equal(torch.isinf(lse), empty)),
               empty_rows=int(empty.sum().item()))
    o_rows = out.permute(0, 2, 1, 3)[empty]  # O of the fully masked rows
    res["empty_rows_zero"] = bool((o_rows == 0).all().item()) if o_rows.numel() else True
    res["ok"] = (res["o_rel_ref"] <= REL_TOL and res["lse_max_abs_ref"] <= LSE_TOL
                 and res["finite"] and res["inf_pattern"] and res["empty_rows_zero"])
    return res


def backward_check(q, k, v, cols, causal, scale, out, lse, tl_out, tl_lse) -> dict:
    """The split backward on the Gluon O/LSE against the same backward on tl's."""
    dout = torch.randn_like(q)
    got = T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)
    ref = T.backward(dout, None, q, k, v, tl_out, tl_lse, cols, causal, scale)
    rels = {f"{n}_rel_vs_tl_fwd": _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), got, ref)}
    rels["grads_finite"] = all(bool(torch.isfinite(a).all().item()) for a in got)
    rels["bwd_ok"] = rels["grads_finite"] and all(
        x <= REL_TOL for k_, x in rels.items() if k_.endswith("_vs_tl_fwd"))
    return rels


def _small_inputs(i, case):
    """q, k, v, mask columns, causal, scale of small case ``i``."""
    from tests.reference import reference_attention

    name, b, sq, sk, hq, hk, hm, d, dtype, causal, c = case
    if name == EMPTY_ROWS_CASE[0]:
        cols = _empty_rows_mask(b, hm, sq, sk, "cuda")
    else:
        cols = small_mask(i, case)
    g = torch.Generator(device="cuda").manual_seed(7 + i)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    scale = 1 / math.sqrt(d)
    ref_out, ref_lse = reference_attention(q, k, v, cols, causal, scale)
    return q, k, v, cols, causal, scale, ref_out, ref_lse


def _print_small(name, lab, res):
    if "error" in res:
        print(f"small {name:28s} {lab:12s} ERROR", flush=True)
        return
    print(f"small {name:28s} {lab:12s} O rel(ref) {res['o_rel_ref']:.2e} "
          f"max|O-tl| {res['o_max_abs_tl']:.2e} max|lse-ref| {res['lse_max_abs_ref']:.1e} "
          f"|lse-tl| {res['lse_max_abs_tl']:.1e} empty {res['empty_rows']} "
          + (f"bwd dq {res['dq_rel_vs_tl_fwd']:.1e} " if "dq_rel_vs_tl_fwd" in res else "")
          + ("ok" if res["ok"] else "FAIL"), flush=True)


def small_pass(records, deadline, out_path, configs=None):
    """Correctness of every small Gluon config against the reference and tl."""
    cases = list(SMALL_CASES) + [EMPTY_ROWS_CASE]
    for i, case, rec in AB.small_case_records(records, deadline, out_path, "small", cases,
                                              write=_write):
        name, d = rec["case"], rec["D"]
        try:
            q, k, v, cols, causal, scale, ref_out, ref_lse = _small_inputs(i, case)
            tl_fn, tl_cfg = tl_forward(q, k, v, cols, causal, scale)
            tl_out, tl_lse = tl_fn()
            rec["tl_config"] = _label(dataclasses.astuple(tl_cfg))
            rec["tl_o_rel_ref"] = _rel(tl_out, ref_out)
            rec["tl_lse_max_abs_ref"] = _lse_diff(tl_lse, ref_lse)
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            continue
        cfgs = configs or (SMALL_CONFIGS if d == 128 else SMALL_CONFIGS_D64)
        for j, cfg in enumerate(cfgs):
            try:
                out, lse = gluon_forward(q, k, v, cols, causal, scale, cfg)()
                res = compare(out, lse, ref_out, ref_lse, tl_out, tl_lse)
                if j == 0:  # the backward on the first config's O/LSE
                    res.update(backward_check(q, k, v, cols, causal, scale, out, lse, tl_out,
                                              tl_lse))
                    res["ok"] = res["ok"] and res["bwd_ok"]
                torch.cuda.synchronize()
            except Exception:
                res = dict(ok=False, error=traceback.format_exc())
                print(f"[{name} {_label(cfg)}]\n{res['error']}", flush=True)
            rec["gluon"][_label(cfg)] = res
            _print_small(name, _label(cfg), res)


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _timed_inputs(name, s, hq, hk, d=128):
    """Mask columns (on the GPU), causal, q, k, v (bf16, head dim d), scale, forward FLOPs."""
    from benchmarks.kernel import build_mask
    import flashmask3.masks as M

    batch = TOTAL_TOKENS // s
    mask, causal, _ = build_mask(name, s, batch)
    cols = None if mask is None else mask.to("cuda").startend_row_indices
    causal = causal if mask is None else mask.causal
    g = torch.Generator(device="cuda").manual_seed(s + 135)
    q, k, v = (torch.randn(batch, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (hq, hk, hk))
    flops = M.attention_flops(cols, causal, batch_size=batch, num_heads=hq, seqlen_q=s,
                              seqlen_k=s, head_dim=d, mode="fwd")
    return cols, causal, q, k, v, 1 / math.sqrt(d), flops, batch


def timed_cases(names, dims):
    """(mask, Hq, Hk, D) of the timed pass: ``names`` (None: TIMED_CASES' masks) at every head
    dim of ``dims``, Hq = 4096 / D; the 32:8 GQA case at D=128 only."""
    cases = []
    for d in dims:
        h = 4096 // d
        for name, hq, hk in TIMED_CASES if names is None else [(n, 32, 32) for n in names]:
            if hq != hk and d != 128:
                continue
            cases.append((name, h, h * hk // hq, d))
    return cases


def _time_variant(rec, label, make_fn, flops, tl_out, tl_lse, name, d, hq, hk):
    """Time one variant of a timed case (``make_fn()`` builds its closure) against the tl
    default's output; its result under ``rec["gluon"][label]``."""
    try:
        fn = make_fn()
        out, lse = fn()
        res = dict(o_max_abs_tl=_max_abs(out, tl_out), o_rel_tl=_rel(out, tl_out),
                   lse_max_abs_tl=_lse_diff(lse, tl_lse),
                   finite=bool(torch.isfinite(out).all().item()))
        res["ok"] = res["o_rel_tl"] <= REL_TOL and res["finite"]
        del out, lse
        ms = _bench(fn)
        res.update(ms=ms, tflops=flops / ms / 1e9, speedup_vs_tl=rec["tl"]["ms"] / ms)
        print(f"timed {name:24s} D{d} {hq}:{hk} {label:17s} {ms:8.2f} ms "
              f"{res['tflops']:5.0f} TFLOP/s x{res['speedup_vs_tl']:.3f} "
              f"max|O-tl| {res['o_max_abs_tl']:.1e} " + ("ok" if res["ok"] else "FAIL"),
              flush=True)
    except Exception:
        res = dict(ok=False, error=traceback.format_exc())
        print(f"[{name} {label}]\n{res['error']}", flush=True)
    rec["gluon"][label] = res


def timed_pass(records, deadline, out_path, seqlen, configs, cases=None, tl_configs=()):
    for name, hq, hk, d in cases or timed_cases(None, (128, )):
        if time.time() > deadline:
            records.append(dict(part="timed", case=name, Hq=hq, Hk=hk, skipped="budget"))
            _write(out_path, records)
            continue
        _arm_watchdog(f"timed {name} Hq={hq} Hk={hk}")
        rec = dict(part="timed", case=name, S=seqlen, D=d, Hq=hq, Hk=hk, dtype="bf16",
                   gluon={})
        try:
            cols, causal, q, k, v, scale, flops, b = _timed_inputs(name, seqlen, hq, hk, d)
            rec.update(B=b, causal=causal, C=0 if cols is None else cols.shape[-1],
                       flops_fwd=flops)
            tl_fn, tl_cfg = tl_forward(q, k, v, cols, causal, scale)
            tl_out, tl_lse = tl_fn()
            ms = _bench(tl_fn)
            rec["tl"] = dict(config=_label(dataclasses.astuple(tl_cfg)), ms=ms,
                             tflops=flops / ms / 1e9)
            print(f"timed {name:24s} D{d} {hq}:{hk} tl {rec['tl']['config']:12s} {ms:8.2f} ms "
                  f"{rec['tl']['tflops']:5.0f} TFLOP/s", flush=True)
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            records.append(rec)
            _write(out_path, records)
            continue
        for cfg in configs:
            flags = _flags(cfg)
            try:
                F.check_config(d, *flags[:6], flags[6] != 0)
            except ValueError:
                continue  # not a shape of this head dim (e.g. 128-key tiles at D=256)
            _time_variant(rec, _label(cfg),
                          lambda: gluon_forward(q, k, v, cols, causal, scale, cfg),
                          flops, tl_out, tl_lse, name, d, hq, hk)
        for cfg in tl_configs:  # the tl forward at other tiles ("tl" + label)
            if dataclasses.astuple(cfg) == dataclasses.astuple(tl_cfg):
                continue
            _time_variant(rec, "tl" + _label(dataclasses.astuple(cfg)),
                          lambda: tl_forward_at(q, k, v, cols, causal, scale, cfg), flops, tl_out,
                          tl_lse,
                          name, d, hq, hk)
        records.append(rec)
        _write(out_path, records)
        del q, k, v, tl_out, tl_lse
        torch.cuda.empty_cache()


def summary_table(records) -> str:
    """Markdown: per timed case tl and each Gluon config's ms (TFLOP/s) and speed-up."""
    timed = [r for r in records if r.get("part") == "timed" and "tl" in r]
    if not timed:
        return ""
    labels = list(dict.fromkeys(lab for r in timed for lab in r["gluon"]))
    lines = ["| mask | D | Hq/Hk | tl | " + " | ".join(labels) + " |",
             "|---|---|---|---|" + "---|" * len(labels)]
    for r in timed:
        cells = [f"{r['tl']['config']}: {r['tl']['ms']:.1f} ms ({r['tl']['tflops']:.0f})"]
        for lab in labels:
            x = r["gluon"].get(lab, {})
            cells.append("error" if "error" in x else "-" if "ms" not in x else
                         f"{x['ms']:.1f} ms ({x['tflops']:.0f}) x{x['speedup_vs_tl']:.2f}"
                         + ("" if x.get("ok") else " !"))
        lines.append(f"| {r['case']} | {r.get('D', 128)} | {r['Hq']}/{r['Hk']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def small_table(records) -> str:
    """Markdown: per small case, each config's O rel. error to the reference and max |O - tl|."""
    small = [r for r in records if r.get("part") == "small" and "gluon" in r]
    if not small:
        return ""
    labels = list(dict.fromkeys(lab for r in small for lab in r["gluon"]))
    lines = ["| case | tl O rel(ref) | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for r in small:
        cells = []
        for lab in labels:
            x = r["gluon"].get(lab, {})
            cells.append("error" if "error" in x else "-" if "o_rel_ref" not in x else
                         f"{x['o_rel_ref']:.1e} / {x['o_max_abs_tl']:.1e}"
                         + ("" if x.get("ok") else " !"))
        lines.append(f"| {r['case']} | {r.get('tl_o_rel_ref', float('nan')):.1e} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write(path, records):
    AB._write(path, records, lse_tol=LSE_TOL)


def _markdown(records) -> str:
    return (AB.md_header("Gluon forward vs tl forward", AB.run_meta(lse_tol=LSE_TOL))
            + "Small cases: O rel. error to the float64 "
            "reference / max |O_gluon - O_tl|\n\n" + small_table(records)
            + "\n\nTimed (32K, bf16; ms (TFLOP/s) and speed-up over tl)\n\n"
            + summary_table(records) + "\n")


def _fwd_error(x) -> str:
    return "error" if "error" in x else "out of tolerance"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="no new case starts after this many seconds")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--configs", default=",".join(_label(c) for c in TIMED_CONFIGS),
                    help="Gluon configs timed at 32K, e.g. 128x128w8s2,128x64w8s3")
    ap.add_argument("--small-configs", default=None,
                    help="Gluon configs checked on every small case (default: SMALL_CONFIGS "
                         "at D=128, SMALL_CONFIGS_D64 at D=64)")
    ap.add_argument("--dims", default="128", help="head dims of the timed pass, e.g. 128,64,256")
    ap.add_argument("--cases", default=None,
                    help="masks of the timed pass (default: TIMED_CASES), e.g. causal,full")
    ap.add_argument("--tl-configs", default="",
                    help="tl forward tiles timed beside its default, e.g. 64x64w4s3 (label tl...)")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-timed", action="store_true")
    args = ap.parse_args(argv)
    configs = [_parse(lab) for lab in args.configs.split(",")]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)")
        return 2
    reason = F.unavailable_reason()
    if reason:
        print(reason)
        return 2
    out_path, start, deadline, records = AB.start_run(
        "gluon_fwd_ab", args.budget_s, f"; case timeout {CASE_TIMEOUT_S} s")
    if not args.skip_small:
        small_pass(records, deadline, out_path,
                   None if args.small_configs is None
                   else [_parse(lab) for lab in args.small_configs.split(",")])
    if not args.skip_timed:
        dims = [int(x) for x in args.dims.split(",")]
        names = None if args.cases is None else args.cases.split(",")
        tl_configs = [_parse_tl(lab) for lab in args.tl_configs.split(",") if lab]
        timed_pass(records, deadline, out_path, args.seqlen, configs, timed_cases(names, dims),
                   tl_configs)
    print(small_table(records))
    print(summary_table(records))
    bad = AB.failures(records, _fwd_error)
    return AB.finish_run(out_path, records, start, _markdown(records), bad,
                         "all Gluon forward cases within tolerance", lse_tol=LSE_TOL)


if __name__ == "__main__":
    sys.exit(main())
