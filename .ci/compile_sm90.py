"""Offline sm_90 compile of every kernel the Triton backend can launch, under this Triton.

No GPU needed: Triton's bundled ptxas/cuobjdump build each kernel for Hopper (sm_90) as the
dispatch would launch it on an H200, so a Triton release that breaks a kernel is caught on a
CPU machine. Used by ``.ci/newest-triton.sh`` with the newest Triton (docs/host-path.md).

What is compiled:
* the tl kernels: mask preprocessing (block summaries, live ranges), the backward's delta
  pre-pass and dQ scaling, and the attention kernels (forward, split dK/dV, dQ, fused dK/dV+dQ)
  at their default tiles (and the forward's short-rows tile at D=64) for D=64/128/256 on the
  mask layouts of :data:`LAYOUTS`;
* the Gluon kernels the dispatch picks on a checked Triton (WS forward, WS dK/dV, the fused
  DS_SHARED backward) at their default tiles.

Exit status: 1 when a tl kernel fails (the portable path must compile everywhere), or when a
Gluon kernel fails on a Triton version the dispatch runs Gluon on (``GLUON_CHECKED_TRITON``).
A Gluon kernel failing on an unchecked version is reported, not an error: the dispatch's
version guard routes every launch to tl there (this script asserts that it does).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import multiprocessing
import os
import sys
import time

#: (causal, C) mask layouts per head dim: every layout at D=128, the two extremes elsewhere.
LAYOUTS = {128: [(True, 0), (True, 1), (True, 2), (False, 2), (False, 4)],
           64: [(True, 1), (False, 4)], 256: [(True, 1), (False, 4)]}


def jobs() -> list[dict]:
    """Every compile, as a picklable description."""
    from flashmask3.kernels import triton_flashmask as K

    out = [dict(family="tl", kernel=name) for name in ("summary", "range_by_query",
                                                        "range_by_key", "bwd_pre", "scale_dq")]
    for d, layouts in LAYOUTS.items():
        for kind in ("fwd", "dkdv", "dq"):
            cfg = K.CANDIDATES[(kind, d)][0]
            out += [dict(family="tl", kernel=kind, d=d, cfg=cfg.__dict__, causal=causal, c=c)
                    for causal, c in layouts]
    short = K.SHORT_ROWS_FWD[64][1]
    out.append(dict(family="tl", kernel="fwd", d=64, cfg=short.__dict__, causal=True, c=1))
    cfg = K.CANDIDATES[("fused", 128)][0]
    out += [dict(family="tl", kernel="fused", d=128, cfg=cfg.__dict__, causal=causal, c=c)
            for causal, c in ((True, 1), (False, 4))]
    for d in K.GLUON_FWD_DIMS:
        out.append(dict(family="gluon", kernel="fwd_ws", d=d, causal=True, c=1))
    for d in K.GLUON_DKDV_DIMS:
        out.append(dict(family="gluon", kernel="dkdv_ws", d=d, causal=True, c=1))
    for d in K.GLUON_FUSED_DIMS:
        out.append(dict(family="gluon", kernel="fused", d=d, causal=True, c=1))
    return out


def _compile_small(name: str) -> dict:
    """The preprocessing / pre-pass / scaling kernels (no tile config of their own)."""
    from triton.compiler import ASTSource

    from flashmask3.kernels import triton_flashmask as K
    from flashmask3.kernels import triton_report as R

    kernel, ptrs, consts = {
        "summary": (K._summary_kernel, dict(mask_ptr="*i32", sum_ptr="*i32"),
                    dict(BLOCK_N=128, CAUSAL=False, C=4)),
        "range_by_query": (K._range_kernel, dict(sum_ptr="*i32", rng_ptr="*i32"),
                           dict(BLOCK_M=128, BLOCK_N=128, CAUSAL=False, NI=2, BY_KEY=False,
                                CHUNK=256)),
        "range_by_key": (K._range_kernel, dict(sum_ptr="*i32", rng_ptr="*i32"),
                         dict(BLOCK_M=64, BLOCK_N=128, CAUSAL=True, NI=1, BY_KEY=True,
                              CHUNK=256)),
        "bwd_pre": (K._bwd_pre_kernel, dict(o_ptr="*bf16", do_ptr="*bf16", lse_ptr="*fp32",
                                            dlse_ptr="*fp32", delta_ptr="*fp32",
                                            lse2_ptr="*fp32"),
                    dict(D=128, BLOCK_M=64, HAS_DLSE=True)),
        "scale_dq": (K._scale_dq_kernel, dict(src_ptr="*fp32", dst_ptr="*bf16"),
                     dict(D=128, BLOCK_Q=64)),
    }[name]
    sig, attrs = R._signature(kernel, ptrs, {}, consts)
    ck = R.compile_sm90_source(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), 4, 1)
    usage, _ = R.cuobjdump(ck.asm["cubin"])
    return dict(regs=usage["regs"], local=usage["local"])


def _compile_gluon(kernel: str, d: int, causal: bool, c: int) -> dict:
    """A Gluon kernel at the tile and variant the dispatch launches it with."""
    from flashmask3.kernels import triton_flashmask as K
    from flashmask3.kernels import triton_report as R

    if kernel == "fwd_ws":
        from flashmask3.kernels import gluon_fwd as G

        t = K.GLUON_TILE[("fwd", d)]
        variant = dict(warp_spec=True, pingpong=K.GLUON_FWD_PINGPONG.get(d, False))
    else:
        from flashmask3.kernels import gluon_dkdv as G

        if kernel == "fused":
            t = K.GLUON_TILE[("fused", d)]
            variant = K.GLUON_FUSED_VARIANT
        else:
            t = K.GLUON_TILE.get(("dkdv", d)) or K.CANDIDATES[("dkdv", d)][0]
            variant = dict(warp_spec=True, stats_smem=d in K.GLUON_STATS_SMEM_DIMS)
    ck = G.compile_sm90(d, t.block_m, t.block_n, t.num_warps, t.num_stages, causal=causal, c=c,
                        **variant)
    usage, sass = R.cuobjdump(ck.asm["cubin"])
    return dict(regs=usage["regs"], local=usage["local"], hgmma=sass.count("HGMMA"))


def run_one(job: dict) -> dict:
    """Compile one job; returns it with ``ok``, seconds and the report (or the error)."""
    os.environ.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    try:
        if job["family"] == "gluon":
            report = _compile_gluon(job["kernel"], job["d"], job["causal"], job["c"])
        elif "cfg" not in job:
            report = _compile_small(job["kernel"])
        else:
            from flashmask3.kernels import triton_flashmask as K
            from flashmask3.kernels import triton_report as R

            r = R.compile_one(job["kernel"], job["d"], K.Config(**job["cfg"]), job["causal"],
                              job["c"])
            report = {k: r[k] for k in ("regs", "local", "hgmma", "ldl_stl")}
            if report["hgmma"] == 0:
                raise RuntimeError(f"no HGMMA in the SASS (the slow mma.sync path): {report}")
        return dict(job, ok=True, seconds=round(time.perf_counter() - start, 1), **report)
    except Exception as exc:  # reported per kernel: one failure must not hide the others
        msg = str(exc).strip().splitlines()
        cause = exc  # (the innermost exception names what changed, e.g. a removed Gluon call)
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        return dict(job, ok=False, seconds=round(time.perf_counter() - start, 1),
                    error=f"{type(cause).__name__}: {str(cause).strip()[-300:]}",
                    raised=f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON report path")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--only", default="", help="comma list of families (tl, gluon)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # (before the kernels are defined: compiled, not interpreted)
    import torch
    import triton

    from flashmask3.kernels import triton_flashmask as K

    todo = [j for j in jobs() if not args.only or j["family"] in args.only.split(",")]
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(todo)} sm_90 compiles, "
          f"{args.jobs} at a time; Gluon checked on {K.GLUON_CHECKED_TRITON}, here "
          f"{'yes' if K.GLUON_CHECKED_HERE else 'no: the dispatch routes every launch to tl'}",
          flush=True)
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    rows = []
    with futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for row in pool.map(run_one, todo):
            rows.append(row)
            what = {k: row.get(k) for k in ("family", "kernel", "d", "causal", "c")}
            print(("ok  " if row["ok"] else "FAIL") + f" {what} {row['seconds']}s "
                  + (row.get("error", "") if not row["ok"] else ""), flush=True)
    failed_tl = [r for r in rows if r["family"] == "tl" and not r["ok"]]
    failed_gluon = [r for r in rows if r["family"] == "gluon" and not r["ok"]]
    gate_ok = _gate_routes_to_tl() if not K.GLUON_CHECKED_HERE else True
    summary = dict(triton=triton.__version__, torch=torch.__version__,
                   gluon_checked_here=K.GLUON_CHECKED_HERE, compiles=len(rows),
                   tl_failed=len(failed_tl), gluon_failed=len(failed_gluon),
                   gate_routes_to_tl=gate_ok, seconds=round(time.perf_counter() - start))
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, rows=rows), f, indent=1)
    bad = bool(failed_tl) or not gate_ok or (K.GLUON_CHECKED_HERE and bool(failed_gluon))
    if failed_gluon and not K.GLUON_CHECKED_HERE:
        print(f"{len(failed_gluon)} Gluon kernels do not compile on Triton {triton.__version__} "
              "(expected on an unchecked version: the tl kernels run there)", flush=True)
    return 1 if bad else 0


def _gate_routes_to_tl() -> bool:
    """On this (unchecked) Triton, the dispatch picks tl for every kernel kind of a Hopper
    bf16 call at every head dim, even when env asks for Gluon."""
    import torch

    from flashmask3.kernels import triton_flashmask as K

    class Q:
        is_cuda, dtype, device = True, torch.bfloat16, torch.device("cuda", 0)

    K._use_tma = lambda x: True  # (this process only: what an H200 would answer)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    for d in (64, 128, 256):
        Q.shape = (1, 4096, 16, d)
        for kind in ("fwd", "dkdv", "fused"):
            tile = K.GLUON_TILE.get((kind, d)) or K.CANDIDATES[(kind, d)][0]
            impl = {"fwd": lambda: K._fwd_impl(Q, tile, 1), "dkdv": lambda: K._dkdv_impl(Q, tile),
                    "fused": lambda: K._fused_impl(Q, tile)}[kind]()
            if impl != "tl":
                return False
        if K.backward_mode(like=Q) != "split":
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
