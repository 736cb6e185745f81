"""A/B of the Gluon dK/dV kernel against the ``tl`` dK/dV kernel (one H200, one process).

Two parts, both comparing the Gluon dK, dV with the ``tl`` kernel's on the same inputs (the
``tl`` kernel at its default configuration, ``_config("dkdv", ...)``, and its own plan):

1. a small-shape correctness pass: S=1000 with every (causal, C) mask layout, random column
   intervals (so PARTIAL and SKIP tiles inside ranges occur), GQA, Hm in {1, Hk, Hq}, Sq != Sk
   (Sq=777, Sk=1000), fp16 once, D=64 once;
2. timing at bf16, D=128, S=32768, B*S = 128K tokens (B=4, Hq=Hk=32) on the benchmark masks,
   plus GQA cases (Hq=32, Hk=8): median ms of ``triton.testing.do_bench`` and TFLOP/s (the
   project convention, 4/5 of the DESIGN.md backward FLOPs, and the hardware rate of the live
   tiles each kernel visits at its own tile shape: 4 matmuls of 2*BM*BN*D per tile).

Every Gluon case is wrapped so a compile or runtime error is recorded (traceback printed) and
the rest still runs; a relative error (||a-b||/||b||) above 2e-2 is a FAIL, and so is a
``ws`` config (the WARP_SPEC kernel: a 1-warp TMA producer partition) whose dK, dV are not
bitwise equal to the tl kernel's (and, in the small pass, to its non-WS twin's). No new case starts
after ``--budget-s`` seconds; a case running longer than CASE_TIMEOUT_S is taken for a hang (an
mbarrier wait that never completes cannot be caught): faulthandler prints the stacks and ends
the process, and the JSON keeps every case before it. Timed configs: ``--configs`` (label
``BMxBNwWsS``; the session-6 run also timed a ``d`` variant, since removed). Writes ``$OUT/gluon_dkdv_ab.json`` (OUT
defaults to /tmp) after every case; exits 1 when any case failed or errored::

    PYTHONPATH=. python benchmarks/gluon_dkdv_ab.py --budget-s 240

``--fused``: the fused Gluon backward instead (``gluon_dkdv.fused_backward_gluon``: the dK/dV
kernel with FUSE_DQ, dQ reduce-added with TMA, unverified before this run) against the split
backward (``triton_flashmask.backward`` with FLASHMASK3_TRITON_BWD=split: today's default, Gluon
dK/dV + tl dQ). Small cases as above: dQ, dK, dV within REL_TOL of split; timed cases
(FUSED_TIMED_CASES, 32K, B=4, D=128): the whole backward (delta pre-pass, plan, kernels, the
dQ scaling) of split, the tl fused backward (FLASHMASK3_TRITON_BWD=fused) and the Gluon fused
backward per ``--fused-configs``. Writes ``$OUT/gluon_fused_ab.json`` and ``.md``::

    PYTHONPATH=. python benchmarks/gluon_dkdv_ab.py --fused --budget-s 420

``--fused --head-dim 64``: the same at D=64 (timed heads scaled to hidden 4096: Hq=64, GQA
64:16), the small pass on every small case at D=64 (:func:`small_cases_at`) with the
``--fused-configs`` only (a config the kernel's ``check_config`` refuses at that head dim is
recorded as skipped), e.g. the one-warpgroup DS_SHARED tile::

    PYTHONPATH=. python benchmarks/gluon_dkdv_ab.py --fused --head-dim 64 \\
        --fused-configs 64x64w4s2wsmds,64x64w4s3wsmds --budget-s 300
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import sys
import time
import traceback
from typing import Optional
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import run_environment  # noqa: E402
from flashmask3.kernels import gluon_dkdv as G  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402

REL_TOL = 2e-2
#: A case that takes longer than this is taken for a hang (e.g. an mbarrier wait that never
#: completes): faulthandler prints every thread's stack and ends the process; the JSON written
#: after the previous case stays.
CASE_TIMEOUT_S = 150
#: With a deadline, the watchdog allows at most this long past it (see :func:`case_timeout`).
GRACE_S = 45
TOTAL_TOKENS = 131072
#: Gluon configurations timed at D=128: (block_m, block_n, num_warps, num_stages[, warp_spec]);
#: a fifth element True (label suffix ``ws``) is the WARP_SPEC kernel (1-warp TMA producer
#: partition), timed next to its non-WS twin. (Session 6 also timed a variant that left dK in
#: flight under the next tile: 0-2% slower, removed.)
TIMED_CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 3, True), (16, 64, 4, 3), (32, 128, 8, 3)]
#: Checked for correctness on every small case ...
SMALL_CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 3, True), (32, 128, 8, 3)]
#: ... and these on the first two only (a spilling 64x64, BM=16, 2 stages, 8 warps 64x128,
#: and the WARP_SPEC kernel at 2 stages and 8 warps).
EXTRA_SMALL_CONFIGS = [(64, 64, 4, 2), (16, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2),
                       (32, 64, 4, 2, True), (64, 128, 8, 2, True),
                       (64, 128, 8, 2, True, True)]
#: (mask, Hq, Hk) in the order they run (the budget may cut the tail).
TIMED_CASES = [("causal", 32, 32), ("causal_document_corpus", 32, 32), ("causal", 32, 8),
               ("document_corpus", 32, 32), ("sliding_window", 32, 32),
               ("shared_question", 32, 32), ("full", 32, 32), ("causal_document_corpus", 32, 8)]


#: The Gluon kernel's variant flags a config tuple may carry after (BM, BN, warps, stages), in
#: order, each with the label suffix of a config whose last flag it is. Each flag counts only
#: with every earlier one set: WARP_SPEC (1-warp TMA producer), STATS_SMEM (lse2/delta staged in
#: shared memory by the producer), DS_SHARED (fused only: Pᵀ, dSᵀ in shared memory, dQ once per
#: tile), DP_LATE_WAIT (Pᵀ stored before the dPᵀ wait, which keeps that wait below the exp2s).
VARIANTS = (("warp_spec", "ws"), ("stats_smem", "wsm"), ("ds_shared", "wsmds"),
            ("dp_late_wait", "wsmdsL"))


def _flags(cfg) -> dict:
    """``{flag: bool}`` of a config tuple, for every flag of :data:`VARIANTS`."""
    flags, on = {}, True
    for i, (name, _) in enumerate(VARIANTS):
        on = on and len(cfg) > 4 + i and bool(cfg[4 + i])
        flags[name] = on
    return flags


#: Work-order flags of the fused DS_SHARED kernel a label may end with (after the variant
#: suffix): ``+p`` PERSISTENT (one program per resident slot, looping over key blocks claimed
#: in launch order). (Session 12 also timed ``+h``, (batch, KV head) fastest over the
#: programs: 0.45-0.70x, removed; and a PERSISTENT with a static walk, replaced.)
ORDERS = (("persistent", "+p"), )


def _parse_spec(label: str) -> tuple:
    """(config tuple, order flags) of a fused label: :func:`_parse` of the label without its
    :data:`ORDERS` suffixes, and ``{flag: bool}`` of those, e.g. ``64x128w8s2wsmds+p``."""
    order = {}
    for name, suffix in reversed(ORDERS):
        order[name] = label.endswith(suffix)
        if order[name]:
            label = label[:-len(suffix)]
    return _parse(label), {name: order[name] for name, _ in ORDERS}


def _spec(x) -> tuple:
    """A fused spec (config tuple, order flags) from a spec or a plain config tuple."""
    if len(x) == 2 and isinstance(x[1], dict):
        return x
    return tuple(x), {name: False for name, _ in ORDERS}


def _spec_label(spec) -> str:
    """Label of a fused spec: :func:`_label` plus its :data:`ORDERS` suffixes."""
    cfg, order = _spec(spec)
    return _label(cfg) + "".join(suffix for name, suffix in ORDERS if order.get(name))


def _is_ws(cfg) -> bool:
    """Whether a config tuple is a WARP_SPEC kernel's (the flag every other variant needs)."""
    return _flags(cfg)["warp_spec"]


def _label(cfg) -> str:
    """``BMxBNwWsS`` plus the :data:`VARIANTS` suffix of the config's last flag: ``ws``,
    ``wsm``, ``wsmds`` (fused only) or ``wsmdsL``."""
    flags = _flags(cfg)
    suffixes = [suffix for name, suffix in VARIANTS if flags[name]]
    return "{}x{}w{}s{}".format(*cfg[:4]) + (suffixes[-1] if suffixes else "")


def _parse(label: str) -> tuple:
    """The config tuple of a label (inverse of :func:`_label`): ``32x64w4s3`` ->
    (32, 64, 4, 3), ``32x64w4s3ws`` -> (32, 64, 4, 3, True), ``64x128w8s2wsm`` ->
    (64, 128, 8, 2, True, True), ``64x128w8s2wsmds`` -> (64, 128, 8, 2, True, True, True),
    ``64x128w8s2wsmdsL`` -> (64, 128, 8, 2, True, True, True, True)."""
    n_flags, body = 0, label
    for i, (_, suffix) in enumerate(VARIANTS):
        if label.endswith(suffix):
            n_flags, body = i + 1, label[:-len(suffix)]
    nums = tuple(int(x) for x in body.replace("x", " ").replace("w", " ").replace("s", " ").split())
    if len(nums) != 4:
        raise ValueError(f"config label {label!r}: expected BMxBNwWsS, optionally followed by "
                         + ", ".join(suffix for _, suffix in VARIANTS))
    return nums + (True, ) * n_flags


def _twin(cfg) -> tuple:
    """The non-WS config of a WARP_SPEC one (itself otherwise)."""
    return tuple(cfg[:4])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _compare(gl_out, tl_out) -> dict:
    """Max abs and relative errors of dK, dV (Gluon against tl)."""
    res = {}
    for name, a, b in zip(("dk", "dv"), gl_out, tl_out):
        res[f"{name}_max_abs"] = (a.float() - b.float()).abs().max().item()
        res[f"{name}_rel"] = _rel(a, b)
        res[f"{name}_finite"] = bool(torch.isfinite(a).all().item())
    res["ok"] = (res["dk_rel"] <= REL_TOL and res["dv_rel"] <= REL_TOL and res["dk_finite"]
                 and res["dv_finite"])
    res["bitwise"] = _bitwise(gl_out, tl_out)
    return res


def _bitwise(got, ref) -> bool:
    """dK and dV identical bit for bit (the Gluon kernels run the tl kernel's wgmma k-steps in
    the same order; the WARP_SPEC kernel the non-WS one's instructions)."""
    return all(torch.equal(a, b) for a, b in zip(got, ref))


def _check_ws(res: dict, cfg, got, twin_out) -> dict:
    """A WARP_SPEC config must be bitwise equal to tl (``res['bitwise']``) and, when its non-WS
    twin ran on the same inputs, to that twin: otherwise it is not ok."""
    if not _is_ws(cfg):
        return res
    if twin_out is not None:
        res["bitwise_vs_gluon"] = _bitwise(got, twin_out)
    res["ok"] = res["ok"] and res["bitwise"] and res.get("bitwise_vs_gluon", True)
    return res


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _random_mask(b, hm, sq, sk, c, causal, gen, device):
    """Random column intervals of one (causal, C) layout, values in [0, Sq] (DESIGN.md §1)."""
    if c == 0:
        return None

    def rnd():
        return torch.randint(0, sq + 1, (b, hm, sk), generator=gen, device="cpu")

    if c == 1:
        cols = [rnd()]
    elif causal:  # [LTS, LTE)
        x, y = rnd(), rnd()
        cols = [torch.minimum(x, y), torch.maximum(x, y)]
    elif c == 2:  # LTS, UTE with UTE <= LTS
        x, y = rnd(), rnd()
        cols = [torch.maximum(x, y), torch.minimum(x, y)]
    else:  # [LTS, LTE), [UTS, UTE)
        x, y, z, w = (rnd() for _ in range(4))
        cols = [torch.minimum(x, y), torch.maximum(x, y), torch.minimum(z, w), torch.maximum(z, w)]
    return torch.stack(cols, dim=-1).to(torch.int32).to(device)


def _inputs(b, sq, sk, hq, hk, d, dtype, cols, causal, seed, with_forward=False):
    """Q, K, V, dO (seeded randn), the tl forward's LSE, and the backward pre-pass (and, with
    ``with_forward``, the forward's O and LSE after them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    scale = 1 / math.sqrt(d)
    out, lse = T.forward(q, k, v, cols, causal, scale)
    delta, lse2 = T._bwd_pre(out, dout, lse, None)
    if with_forward:
        return q, k, v, dout, lse2, delta, scale, out, lse
    return q, k, v, dout, lse2, delta, scale


def _tl_dkdv(q, k, v, dout, lse2, delta, cols, causal, scale):
    """The reference: the tl kernel at its default configuration, and that configuration."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    c = 0 if cols is None else cols.shape[-1]
    cfg = T._config("dkdv", d, causal, c, q.dtype)
    plan = T.make_plan(cols, causal, sq, sk, cfg.block_m, cfg.block_n, True, q.device)
    fn = lambda: T._launch_dkdv_tl(q, k, v, dout, lse2, delta, causal, scale, cfg, plan)[:2]  # noqa: E731
    return fn, (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages), plan


def _gluon_dkdv(q, k, v, dout, lse2, delta, cols, causal, scale, cfg):
    """(launch closure, plan) of one Gluon config (with its WARP_SPEC and STATS_SMEM flags)."""
    sq, sk = q.shape[1], k.shape[1]
    bm, bn, w, s = cfg[:4]
    flags = _flags(cfg)
    ws, wsm = flags["warp_spec"], flags["stats_smem"]
    if flags["ds_shared"]:
        raise ValueError(f"{_label(cfg)}: DS_SHARED is a fused kernel (--fused-configs)")
    plan = T.make_plan(cols, causal, sq, sk, bm, bn, True, q.device)

    def fn():
        return G.launch_dkdv_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, bm, bn, w, s,
                                   warp_spec=ws, stats_smem=wsm)
    return fn, plan


# ---------------------------------------------------------------------------------------------
# Live tiles (hardware FLOPs)
# ---------------------------------------------------------------------------------------------


def live_tiles(plan, causal, b, sq, sk, hq, bm, bn) -> int:
    """Query tiles visited over all key blocks, batches and query heads for one plan."""
    nqb, nkb = -(-sq // bm), -(-sk // bn)
    if plan.c == 0:
        if not causal:
            per_bh = nqb * nkb
        else:
            per_bh = 0
            for n in range(nkb):
                first_row = n * bn - (sk - sq)
                per_bh += nqb - min(max(first_row, 0) // bm, nqb)
        return per_bh * b * hq
    r = plan.ranges.view(-1, nkb, 8).long()
    per_mask_bh = ((r[..., 1] - r[..., 0]).clamp_min(0) + (r[..., 3] - r[..., 2]).clamp_min(0)).sum(1)
    bm_rows = per_mask_bh.numel() // plan.hm
    total = int(per_mask_bh.sum().item()) * (hq // plan.hm)
    return total * (b if bm_rows == 1 and b > 1 else 1)


def tile_flops(tiles, bm, bn, d) -> float:
    return 4 * 2.0 * bm * bn * d * tiles


# ---------------------------------------------------------------------------------------------
# Part 1: small shapes
# ---------------------------------------------------------------------------------------------

#: (name, B, Sq, Sk, Hq, Hk, Hm, D, dtype, causal, C)
SMALL_CASES = (
    [(f"s1000_causal{int(cz)}_C{c}", 2, 1000, 1000, 4, 2, 2, 128, torch.bfloat16, cz, c)
     for cz, c in ((True, 0), (False, 0), (True, 1), (True, 2), (False, 2), (False, 4))]
    + [(f"s777x1000_causal0_C{c}", 2, 777, 1000, 4, 4, 1, 128, torch.bfloat16, False, c)
       for c in (0, 2, 4)]
    + [("s777x1000_causal1_C1", 2, 777, 1000, 4, 4, 4, 128, torch.bfloat16, True, 1),
       ("s1000_hm_hq_gqa4", 1, 1000, 1000, 8, 2, 8, 128, torch.bfloat16, False, 4),
       ("s1000_fp16_causal1_C2", 2, 1000, 1000, 4, 2, 1, 128, torch.float16, True, 2),
       ("s1000_d64_causal0_C2", 2, 1000, 1000, 4, 2, 2, 64, torch.bfloat16, False, 2)]
)


def small_pass(records, deadline, out_path):
    """Correctness of every Gluon config (that applies to D) against tl on small shapes."""
    for i, case, rec in small_case_records(records, deadline, out_path, "small"):
        name, b, sq, sk, hq, hk, hm, d, dtype, causal, c = case
        cols = small_mask(i, case)
        try:
            q, k, v, dout, lse2, delta, scale = _inputs(b, sq, sk, hq, hk, d, dtype, cols, causal,
                                                        seed=7 + i)
            tl_fn, tl_cfg, _ = _tl_dkdv(q, k, v, dout, lse2, delta, cols, causal, scale)
            ref = tl_fn()
            rec["tl_config"] = _label(tl_cfg)
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            continue
        cfgs = SMALL_CONFIGS + (EXTRA_SMALL_CONFIGS if i < 2 else [])
        if d != 128:
            cfgs = [tuple(dataclasses.astuple(T.CANDIDATES[("dkdv", d)][0]))]
        outs = {}  # non-WS outputs of this case, for the WARP_SPEC twins
        for cfg in cfgs:
            try:
                fn, _ = _gluon_dkdv(q, k, v, dout, lse2, delta, cols, causal, scale, cfg)
                got = fn()
                res = _check_ws(_compare(got, ref), cfg, got, outs.get(_twin(cfg)))
                if not _is_ws(cfg):
                    outs[_twin(cfg)] = got
                torch.cuda.synchronize()
            except Exception:
                res = dict(ok=False, error=traceback.format_exc())
                print(f"[{name} {_label(cfg)}]\n{res['error']}", flush=True)
            rec["gluon"][_label(cfg)] = res
            print(f"small {name:28s} {_label(cfg):12s} "
                  + ("ERROR" if "error" in res else
                     f"dk rel {res['dk_rel']:.2e} max {res['dk_max_abs']:.2e}  "
                     f"dv rel {res['dv_rel']:.2e} max {res['dv_max_abs']:.2e}  "
                     + ("bitwise " if res["bitwise"] else "")
                     + ("ok" if res["ok"] else "FAIL")), flush=True)
        del outs


# ---------------------------------------------------------------------------------------------
# Part 2: timing at 32K
# ---------------------------------------------------------------------------------------------


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=300, return_mode="median")


def timed_pass(records, deadline, out_path, seqlen, configs, d=128):
    """Each TIMED_CASES mask at head dim ``d`` (hidden 4096: the head counts scale by 128/d)."""
    from benchmarks.sweep import backward_case

    for name, hq, hk in TIMED_CASES:
        hq, hk = hq * 128 // d, hk * 128 // d
        if time.time() > deadline:
            records.append(dict(part="timed", case=name, Hq=hq, Hk=hk, skipped="budget"))
            _write(out_path, records)
            continue
        _arm_watchdog(f"timed {name} Hq={hq} Hk={hk}")
        rec = dict(part="timed", case=name, S=seqlen, D=d, Hq=hq, Hk=hk, dtype="bf16", gluon={})
        try:
            cs = backward_case(name, seqlen, d, hq, hk, torch.bfloat16, device="cuda",
                               total_tokens=TOTAL_TOKENS, seed=seqlen + 135)
            q, k, v, dout, cols, causal, scale = cs.q, cs.k, cs.v, cs.dout, cs.cols, cs.causal, cs.scale
            delta, lse2 = T._bwd_pre(cs.out, dout, cs.lse, None)
            b = cs.batch
            flops = cs.flops_bwd * 4 / 5  # dK/dV: 4 of the 5 matmuls of the DESIGN.md count
            rec.update(B=b, causal=causal, C=0 if cols is None else cols.shape[-1],
                       flops_dkdv=flops)
            tl_fn, tl_cfg, tl_plan = _tl_dkdv(q, k, v, dout, lse2, delta, cols, causal, scale)
            ref = tl_fn()
            ms = _bench(tl_fn)
            tiles = live_tiles(tl_plan, causal, b, seqlen, seqlen, hq, tl_cfg[0], tl_cfg[1])
            rec["tl"] = dict(config=_label(tl_cfg), ms=ms, tflops=flops / ms / 1e9,
                             tile_tflops=tile_flops(tiles, tl_cfg[0], tl_cfg[1], d) / ms / 1e9)
            _print_timing(name, hq, hk, "tl " + _label(tl_cfg), rec["tl"])
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            records.append(rec)
            _write(out_path, records)
            continue
        for cfg in configs:  # a started case runs every config (the budget is per case)
            try:
                fn, plan = _gluon_dkdv(q, k, v, dout, lse2, delta, cols, causal, scale, cfg)
                got = fn()
                res = _check_ws(_compare(got, ref), cfg, got, None)
                del got
                ms = _bench(fn)
                tiles = live_tiles(plan, causal, b, seqlen, seqlen, hq, cfg[0], cfg[1])
                res.update(ms=ms, tflops=flops / ms / 1e9,
                           tile_tflops=tile_flops(tiles, cfg[0], cfg[1], d) / ms / 1e9,
                           speedup_vs_tl=rec["tl"]["ms"] / ms)
                twin = rec["gluon"].get(_label(_twin(cfg)), {})
                if _is_ws(cfg) and "ms" in twin:  # the WS kernel against its non-WS twin
                    res["speedup_vs_gluon"] = twin["ms"] / ms
            except Exception:
                res = dict(ok=False, error=traceback.format_exc())
                print(f"[{name} {_label(cfg)}]\n{res['error']}", flush=True)
            rec["gluon"][_label(cfg)] = res
            _print_timing(name, hq, hk, "gluon " + _label(cfg), res)
        records.append(rec)
        _write(out_path, records)
        del cs, q, k, v, dout, delta, lse2, ref
        torch.cuda.empty_cache()


def case_timeout(deadline: Optional[float] = None) -> float:
    """Seconds after which a case is taken for a hang: CASE_TIMEOUT_S, or with a ``deadline``
    at most GRACE_S past it (so a hang cannot run far beyond the budget)."""
    if deadline is None:
        return CASE_TIMEOUT_S
    return min(CASE_TIMEOUT_S, max(0.0, deadline - time.time()) + GRACE_S)


def _arm_watchdog(what: str, deadline: Optional[float] = None) -> None:
    """(Re)start the hang timer for one case (:func:`case_timeout`) and say which case runs
    (flushed first)."""
    print(f"-- {what}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(case_timeout(deadline), exit=True)


def small_case_records(records, deadline, out_path, part, cases=None, hang_deadline=None,
                       write=None):
    """The skeleton every small pass shares: yields ``(i, case, rec)`` for each small case
    (SMALL_CASES by default) started before ``deadline`` (a case past it is recorded as skipped),
    with the watchdog armed and ``rec`` holding the case's shape and an empty ``gluon`` dict;
    once the caller has filled ``rec`` (or set ``rec["error"]``), it is appended and the JSON
    rewritten (by ``write``, default :func:`_write`)."""
    for i, case in enumerate(SMALL_CASES if cases is None else cases):
        name, b, sq, sk, hq, hk, hm, d, dtype, causal, c = case
        if time.time() > deadline:
            records.append(dict(part=part, case=name, skipped="budget"))
            continue
        _arm_watchdog(f"{part.replace('_', ' ')} {name}", hang_deadline)
        rec = dict(part=part, case=name, B=b, Sq=sq, Sk=sk, Hq=hq, Hk=hk, Hm=hm, D=d,
                   dtype=str(dtype), causal=causal, C=c, gluon={})
        yield i, case, rec
        records.append(rec)
        (write or _write)(out_path, records)


def small_mask(i, case, device="cuda"):
    """The random mask columns of small case ``i`` (seeded by its index)."""
    name, b, sq, sk, hq, hk, hm, d, dtype, causal, c = case
    return _random_mask(b, hm, sq, sk, c, causal, torch.Generator().manual_seed(100 + i), device)


def _print_timing(name, hq, hk, what, r):
    if "error" in r:
        print(f"timed {name:24s} Hq={hq:2d} Hk={hk:2d} {what:18s} ERROR", flush=True)
        return
    err = (f"  dk rel {r['dk_rel']:.1e} dv rel {r['dv_rel']:.1e} "
           + ("bitwise " if r.get("bitwise") else "")
           + ("ok" if r["ok"] else "FAIL")) if "dk_rel" in r else ""
    ws = f"  x{r['speedup_vs_gluon']:.3f} vs non-WS" if "speedup_vs_gluon" in r else ""
    print(f"timed {name:24s} Hq={hq:2d} Hk={hk:2d} {what:18s} {r['ms']:8.2f} ms "
          f"{r['tflops']:6.0f} TFLOP/s (tiles {r['tile_tflops']:4.0f})" + err + ws, flush=True)


def summary_table(records) -> str:
    """Markdown: per timed case, tl and each Gluon config's ms (TFLOP/s, project convention)
    and speed-up over tl (a ``ws`` config also over its non-WS twin, ``/g``); ``!`` marks a
    config whose gradients are off."""
    timed = [r for r in records if r.get("part") == "timed" and "tl" in r]
    if not timed:
        return ""
    labels = list(dict.fromkeys(lab for r in timed for lab in r["gluon"]))
    lines = ["", "| mask | Hq/Hk | tl (" + timed[0]["tl"]["config"] + ") | "
             + " | ".join(labels) + " |", "|---|---|---|" + "---|" * len(labels)]
    for r in timed:
        cells = [f"{r['tl']['ms']:.1f} ms ({r['tl']['tflops']:.0f})"]
        for lab in labels:
            x = r["gluon"].get(lab, {})
            if "ms" not in x:
                cells.append("error" if "error" in x else "-")
            else:
                cells.append(f"{x['ms']:.1f} ms ({x['tflops']:.0f}) x{x['speedup_vs_tl']:.2f}"
                             + (f" x{x['speedup_vs_gluon']:.3f}/g" if "speedup_vs_gluon" in x
                                else "")
                             + ("" if x.get("ok") else " !"))
        lines.append(f"| {r['case']} | {r['Hq']}/{r['Hk']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_meta(**tolerances) -> dict:
    """What a committed A/B result must name (GPU, date, versions, command, commit), plus the
    tolerances it was checked with. Shared by the Gluon A/B scripts."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return dict(run_environment(device), rel_tol=REL_TOL, **tolerances)


def md_header(title: str, meta: dict) -> str:
    """The first lines of an A/B markdown file: title, GPU, date, versions, exact command."""
    return (f"# {title} ({meta.get('gpu', meta['device'])}, {meta['date'][:10]})\n\n"
            f"torch {meta['torch']}, triton {meta['triton']}; command: `{meta['command']}` "
            f"(commit {meta['commit']})\n\n")


def _write(path, records, **tolerances):
    with open(path, "w") as f:
        json.dump(dict(meta=run_meta(**tolerances), records=records), f, indent=1, default=str)


def failures(records, describe) -> list[str]:
    """``part case [config]: what`` for every case that errored and every Gluon result that is
    not ok (``describe(result)`` says how it is off); skipped results are no failures. The one
    verdict rule of the Gluon A/B scripts."""
    bad = []
    for r in records:
        if "error" in r:
            bad.append(f"{r['part']} {r['case']}: error")
        for lab, x in r.get("gluon", {}).items():
            if x.get("skipped"):
                continue
            if not x.get("ok", False):
                bad.append(f"{r['part']} {r['case']} {lab}: {describe(x)}")
    return bad


def verdict(bad, ok_text: str) -> str:
    """The last paragraph of a report: the failures, or ``ok_text``."""
    return (f"FAIL ({len(bad)}):\n\n" + "\n".join(f"- {x}" for x in bad) if bad else ok_text) + "\n"


def start_run(name: str, budget_s: float, note: str = ""):
    """``(out_path, start, deadline, records)`` of an A/B run that writes ``$OUT/<name>.json``
    and ``.md`` (OUT defaults to /tmp); prints the run's header line."""
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    start = time.time()
    print(f"GPU {torch.cuda.get_device_name(0)}; torch {torch.__version__}; triton "
          f"{__import__('triton').__version__}; budget {budget_s:.0f} s{note}", flush=True)
    return os.path.join(out_dir, name + ".json"), start, start + budget_s, []


def finish_run(out_path, records, start, markdown: str, bad, ok_line: str, **tolerances) -> int:
    """Stop the hang watchdog, write the JSON (``tolerances`` into its meta) and the markdown,
    print the verdict; the exit code (1 when anything failed)."""
    faulthandler.cancel_dump_traceback_later()
    _write(out_path, records, **tolerances)
    with open(out_path[:-5] + ".md", "w") as f:
        f.write(markdown)
    print(f"\nwall {time.time() - start:.0f} s; wrote {out_path} and .md")
    if bad:
        print(f"FAIL ({len(bad)}):\n  " + "\n  ".join(bad))
        return 1
    print(ok_line)
    return 0


def _dkdv_error(x) -> str:
    return "error" if "error" in x else f"dk rel {x['dk_rel']:.2e} dv rel {x['dv_rel']:.2e}"


# ---------------------------------------------------------------------------------------------
# --fused: the fused Gluon backward against the split backward
# ---------------------------------------------------------------------------------------------

#: Fused Gluon configs checked on every small D=128 case (``True``: FUSE_DQ with WARP_SPEC) ...
FUSED_SMALL_CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 3, True), (16, 64, 4, 3)]
#: ... and these on the first two only.
FUSED_EXTRA_SMALL_CONFIGS = [(32, 64, 4, 2), (32, 128, 8, 3)]
#: Fused Gluon configs timed at 32K (``--fused-configs``; e.g. ``32x64w4s3ws`` adds the
#: warp-specialised fused kernel).
FUSED_TIMED_CONFIGS = [(32, 64, 4, 3), (16, 64, 4, 3)]
#: (mask, Hq, Hk) timed with ``--fused``, in order (the budget may cut the tail).
FUSED_TIMED_CASES = [("causal", 32, 32), ("causal", 32, 8), ("causal_document_corpus", 32, 32),
                     ("full", 32, 32), ("document_corpus", 32, 32), ("sliding_window", 32, 32)]


def _split_dkdv_label(q, causal: bool, c: int) -> str:
    """What the split backward's dK/dV launch runs on these inputs: kernel and tile."""
    cfg = T._config("dkdv", q.shape[-1], causal, c, q.dtype, like=q)
    return f"{T._dkdv_impl(q, cfg)} {_label(dataclasses.astuple(cfg))}"


def split_backward(dout, q, k, v, out, lse, cols, causal, scale):
    """The library's split backward (Gluon dK/dV at D=64 and D=128 on Hopper + tl dQ)."""
    with T.use_backward("split"):
        return T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)


def tl_fused_backward(dout, q, k, v, out, lse, cols, causal, scale):
    """The library's fused backward pinned to the tl kernel with FUSE_DQ (without the pin it is
    the Gluon kernel at D=64 and D=128 on Hopper since v6.5/v6.6: this column would time the
    default Gluon config a second time, as the session-10 ``dpwait`` run did)."""
    with T.use_backward("fused"), mock.patch.dict(os.environ, {"FLASHMASK3_TRITON_FUSED": "tl"}):
        return T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)


def gluon_fused_backward(dout, q, k, v, out, lse, cols, causal, scale, cfg):
    """The Gluon fused backward (``cfg``: a config tuple or a spec with order flags) with
    everything ``T.backward`` does around its kernels (delta pre-pass, by-key plan), so the
    three backwards are timed alike."""
    cfg, order = _spec(cfg)
    sq, sk = q.shape[1], k.shape[1]
    delta, lse2 = T._bwd_pre(out, dout, lse, None)
    plan = T.make_plan(cols, causal, sq, sk, cfg[0], cfg[1], True, q.device)
    return G.fused_backward_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, cfg, **order)


def _compare3(got, ref) -> dict:
    """Relative and max abs errors of (dq, dk, dv) against the reference; ok within REL_TOL."""
    res = {}
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        res[f"{name}_max_abs"] = (a.float() - b.float()).abs().max().item()
        res[f"{name}_rel"] = _rel(a, b)
        res[f"{name}_finite"] = bool(torch.isfinite(a).all().item())
    res["ok"] = all(res[f"{n}_rel"] <= REL_TOL and res[f"{n}_finite"] for n in ("dq", "dk", "dv"))
    return res


def _fmt3(r) -> str:
    if "error" in r:
        return "ERROR"
    return ("dq rel {dq_rel:.1e} dk rel {dk_rel:.1e} dv rel {dv_rel:.1e} ".format(**r)
            + ("ok" if r["ok"] else "FAIL"))


def _bench_bwd(fn) -> float:
    """Median ms of a whole backward (100-300 ms at 32K: ~5-15 timed runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=200, rep=1500, return_mode="median")


def small_cases_at(d: int) -> list:
    """SMALL_CASES at head dim ``d`` (every layout, Sq != Sk, GQA, Hm = Hq, fp16): a case of
    another head dim renamed ``<name>_d<d>``, a shape that occurs twice kept once."""
    out, shapes = [], set()
    for case in SMALL_CASES:
        shape = tuple(case[1:7]) + (d, ) + tuple(case[8:])
        if shape not in shapes:
            shapes.add(shape)
            out.append((case[0] if case[7] == d else f"{case[0]}_d{d}", ) + shape)
    return out


def _config_refusal(d: int, cfg) -> Optional[str]:
    """Why the Gluon kernel's ``check_config`` refuses fused config (or spec) ``cfg`` at head
    dim ``d`` (None when it accepts it)."""
    cfg, order = _spec(cfg)
    try:
        G.check_config(d, *cfg[:4], fuse_dq=True, **_flags(cfg), **order)
    except ValueError as exc:
        return str(exc)
    return None


def fused_small_pass(records, deadline, out_path, extra=(), d=128):
    """dQ, dK, dV of the fused Gluon backward against the split backward on SMALL_CASES (the
    ``extra`` configs, e.g. the timed ones, too on every D=128 case). ``d`` != 128: the small
    cases at head dim ``d`` (:func:`small_cases_at`) with the ``extra`` configs only, those the
    kernel refuses at ``d`` recorded as skipped."""
    cases = None if d == 128 else small_cases_at(d)
    for i, case, rec in small_case_records(records, deadline, out_path, "fused_small", cases):
        name, b, sq, sk, hq, hk, hm, d_case, dtype, causal, c = case
        cols = small_mask(i, case)
        try:
            q, k, v, dout, _, _, scale, out, lse = _inputs(b, sq, sk, hq, hk, d_case, dtype,
                                                           cols, causal, seed=7 + i,
                                                           with_forward=True)
            ref = split_backward(dout, q, k, v, out, lse, cols, causal, scale)
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            continue
        if d != 128:
            cfgs = list(extra)
        elif d_case != 128:
            cfgs = [tuple(dataclasses.astuple(T.CANDIDATES[("dkdv", d_case)][0]))]
        else:
            cfgs = FUSED_SMALL_CONFIGS + (FUSED_EXTRA_SMALL_CONFIGS if i < 2 else [])
            cfgs = cfgs + [c for c in extra if c not in cfgs]
        for cfg in cfgs:
            refusal = _config_refusal(d_case, cfg) if d != 128 else None
            if refusal is not None:
                rec["gluon"][_spec_label(cfg)] = dict(skipped=refusal)
                print(f"fused small {name:26s} {_spec_label(cfg):12s} skipped: {refusal}",
                      flush=True)
                continue
            try:
                res = _compare3(gluon_fused_backward(dout, q, k, v, out, lse, cols, causal, scale,
                                                     cfg), ref)
                torch.cuda.synchronize()
            except Exception:
                res = dict(ok=False, error=traceback.format_exc())
                print(f"[{name} {_spec_label(cfg)}]\n{res['error']}", flush=True)
            rec["gluon"][_spec_label(cfg)] = res
            print(f"fused small {name:26s} {_spec_label(cfg):12s} {_fmt3(res)}", flush=True)


def fused_timed_pass(records, deadline, out_path, seqlen, configs, d=128, cases=None,
                     with_tl=True):
    """The whole backward at 32K and head dim ``d`` (hidden 4096: the head counts scale by
    128/d) on ``cases`` (default FUSED_TIMED_CASES): split (reference), tl fused, Gluon fused
    per config or spec (the tl fused numbers are context: its errors do not fail the run;
    ``with_tl=False`` leaves them out)."""
    from benchmarks.sweep import backward_case

    for name, hq, hk in cases or FUSED_TIMED_CASES:
        hq, hk = hq * 128 // d, hk * 128 // d
        if time.time() > deadline:
            records.append(dict(part="fused_timed", case=name, Hq=hq, Hk=hk, skipped="budget"))
            _write(out_path, records)
            continue
        _arm_watchdog(f"fused timed {name} Hq={hq} Hk={hk}")
        rec = dict(part="fused_timed", case=name, S=seqlen, D=d, Hq=hq, Hk=hk, dtype="bf16",
                   gluon={})
        try:
            cs = backward_case(name, seqlen, d, hq, hk, torch.bfloat16, device="cuda",
                               total_tokens=TOTAL_TOKENS, seed=seqlen + 135)
            args = (cs.dout, cs.q, cs.k, cs.v, cs.out, cs.lse, cs.cols, cs.causal, cs.scale)
            rec.update(B=cs.batch, causal=cs.causal,
                       C=0 if cs.cols is None else cs.cols.shape[-1], flops_bwd=cs.flops_bwd)
            ref = split_backward(*args)
            ms = _bench_bwd(lambda: split_backward(*args))
            rec["split"] = dict(ms=ms, tflops=cs.flops_bwd / ms / 1e9,
                                dkdv=_split_dkdv_label(cs.q, cs.causal, rec["C"]))
            _print_bwd(name, hq, hk, "split", rec["split"])
        except Exception:
            rec["error"] = traceback.format_exc()
            print(rec["error"], flush=True)
            records.append(rec)
            _write(out_path, records)
            continue
        variants = [("tl_fused", lambda: tl_fused_backward(*args))] if with_tl else []
        for cfg in configs:
            refusal = _config_refusal(d, cfg) if d != 128 else None
            if refusal is not None:  # (at D=128 every config is launched, as before)
                rec["gluon"][_spec_label(cfg)] = dict(skipped=refusal)
                continue
            variants.append((_spec_label(cfg),
                             (lambda cfg=cfg: gluon_fused_backward(*args, cfg))))
        for label, fn in variants:  # a started case runs every variant (budget is per case)
            try:
                res = _compare3(fn(), ref)
                ms = _bench_bwd(fn)
                res.update(ms=ms, tflops=cs.flops_bwd / ms / 1e9,
                           speedup_vs_split=rec["split"]["ms"] / ms)
            except Exception:
                res = dict(ok=False, error=traceback.format_exc())
                print(f"[{name} {label}]\n{res['error']}", flush=True)
            if label == "tl_fused":
                rec["tl_fused"] = res
            else:
                rec["gluon"][label] = res
            _print_bwd(name, hq, hk, label if label == "tl_fused" else "gluon " + label, res)
            torch.cuda.empty_cache()
        records.append(rec)
        _write(out_path, records)
        del cs, args, ref
        torch.cuda.empty_cache()


def _print_bwd(name, hq, hk, what, r):
    if "error" in r:
        print(f"fused timed {name:24s} Hq={hq:2d} Hk={hk:2d} {what:18s} ERROR", flush=True)
        return
    extra = f"  x{r['speedup_vs_split']:.2f} vs split  {_fmt3(r)}" if "dq_rel" in r else ""
    print(f"fused timed {name:24s} Hq={hq:2d} Hk={hk:2d} {what:18s} {r['ms']:8.2f} ms "
          f"{r['tflops']:6.0f} TFLOP/s" + extra, flush=True)


def fused_summary_table(records) -> str:
    """Markdown: per timed case, the whole backward's ms (TFLOP/s, DESIGN.md count) for split,
    tl fused and each Gluon fused config, with the speed-up over split; ``!`` marks gradients
    off by more than REL_TOL."""
    timed = [r for r in records if r.get("part") == "fused_timed" and "split" in r]
    if not timed:
        return ""
    labels = list(dict.fromkeys(lab for r in timed for lab in r["gluon"]))
    lines = ["", "| mask | Hq/Hk | split (" + timed[0]["split"].get("dkdv", "?") + " dK/dV + tl dQ)"
             + " | tl fused | " + " | ".join(f"Gluon fused {lab}" for lab in labels) + " |",
             "|---|---|---|---|" + "---|" * len(labels)]
    for r in timed:
        cells = [f"{r['split']['ms']:.1f} ms ({r['split']['tflops']:.0f})"]
        for x in [r.get("tl_fused", {})] + [r["gluon"].get(lab, {}) for lab in labels]:
            if "ms" not in x:
                cells.append("error" if "error" in x else "-")
            else:
                cells.append(f"{x['ms']:.1f} ms ({x['tflops']:.0f}) x{x['speedup_vs_split']:.2f}"
                             + ("" if x.get("ok") else " !"))
        lines.append(f"| {r['case']} | {r['Hq']}/{r['Hk']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_cases(text: str) -> list:
    """``--cases``: comma-separated ``mask`` or ``mask/Hq/Hk`` (heads at D=128; default
    32/32; masks: ``benchmarks/kernel.py``'s MASKS), e.g. ``causal_document_short,causal/32/8``."""
    from benchmarks.kernel import MASKS

    cases = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if parts[0] not in MASKS or len(parts) not in (1, 3):
            raise ValueError(f"--cases: {item!r} is not mask or mask/Hq/Hk "
                             f"(masks: {', '.join(MASKS)})")
        hq, hk = (int(parts[1]), int(parts[2])) if len(parts) == 3 else (32, 32)
        cases.append((parts[0], hq, hk))
    return cases


def fused_main(args) -> int:
    configs = [_parse_spec(lab) for lab in args.fused_configs.split(",")]
    cases = parse_cases(args.cases) if args.cases else None
    out_path, start, deadline, records = start_run("gluon_fused_ab", args.budget_s, "; fused A/B")
    if not args.skip_small:
        fused_small_pass(records, deadline, out_path, configs, args.head_dim)
    if not args.skip_timed:
        fused_timed_pass(records, deadline, out_path, args.seqlen, configs, args.head_dim,
                         cases, with_tl=not args.skip_tl_fused)
    table = fused_summary_table(records)
    print(table)
    bad = failures(records, _fmt3)  # the tl fused numbers are context only: never a failure
    return finish_run(
        out_path, records, start,
        md_header("Fused Gluon backward vs split backward", run_meta())
        + f"Whole backward (delta pre-pass, plan, kernels, dQ scaling), bf16, D={args.head_dim}, "
        f"S={args.seqlen}, B*S={TOTAL_TOKENS}; median ms of do_bench (TFLOP/s, DESIGN.md "
        "backward FLOPs) and speed-up over split.\n" + table + "\n\n"
        + verdict(bad, f"All Gluon fused cases within rel. error {REL_TOL} of split."),
        bad, f"all Gluon fused cases within rel. error {REL_TOL}")



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="no new case starts after this many seconds")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--configs", default=",".join(_label(c) for c in TIMED_CONFIGS),
                    help="Gluon configs timed at 32K, e.g. 32x64w4s3,32x64w4s3ws,32x128w8s3 "
                         "(suffix ws: the warp-specialised kernel, timed against its non-WS "
                         "twin when that is listed before it; wsm: ws with lse2/delta staged "
                         "in shared memory, e.g. 64x128w8s2wsm)")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256),
                    help="head dim of the timed cases (heads scale to hidden 4096); "
                         "--configs must suit it; with --fused also of the small cases "
                         "(D != 128: only --fused-configs are checked there)")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-timed", action="store_true")
    ap.add_argument("--fused", action="store_true",
                    help="the fused Gluon backward against the split backward instead")
    ap.add_argument("--skip-tl-fused", action="store_true",
                    help="with --fused: leave out the tl fused backward's column")
    ap.add_argument("--cases", default="",
                    help="with --fused: the timed cases, mask or mask/Hq/Hk, comma-separated "
                         "(default: FUSED_TIMED_CASES)")
    ap.add_argument("--fused-configs", default=",".join(_label(c) for c in FUSED_TIMED_CONFIGS),
                    help="fused Gluon configs timed at 32K with --fused (and checked on the "
                         "small D=128 cases), e.g. 32x64w4s3ws,64x128w8s2wsmds (suffix wsmds: "
                         "WARP_SPEC + STATS_SMEM + DS_SHARED, dQ once per tile: 64x128w8 at "
                         "D=128, 64x64w4 at --head-dim 64; wsmdsL: with DP_LATE_WAIT)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)")
        return 2
    reason = G.unavailable_reason()
    if reason:
        print(reason)
        return 2
    if args.fused:
        return fused_main(args)
    configs = [_parse(lab) for lab in args.configs.split(",")]
    out_path, start, deadline, records = start_run("gluon_dkdv_ab", args.budget_s)
    if not args.skip_small:
        small_pass(records, deadline, out_path)
    if not args.skip_timed:
        timed_pass(records, deadline, out_path, args.seqlen, configs, args.head_dim)
    table = summary_table(records)
    print(table)
    bad = failures(records, _dkdv_error)
    return finish_run(
        out_path, records, start,
        md_header("Gluon dK/dV vs tl dK/dV", run_meta())
        + f"Each dK/dV kernel alone on the same inputs, bf16, D={args.head_dim}, "
        f"S={args.seqlen}, B*S={TOTAL_TOKENS}; median ms of do_bench (hardware TFLOP/s "
        "of the 4 dK/dV matmuls), speed-up over tl and (`/g`) over the non-WS twin.\n"
        + table + "\n\n" + verdict(bad, f"All Gluon cases within rel. error {REL_TOL} of tl."),
        bad, f"all Gluon cases within rel. error {REL_TOL}")


if __name__ == "__main__":
    sys.exit(main())
