"""Offline sm_90 compile of every kernel the Triton backend can launch, under this Triton.

No GPU needed: Triton's bundled ptxas/cuobjdump build each kernel for Hopper (sm_90) as the
dispatch would launch it on an H200, so a Triton release that breaks a kernel is caught on a
CPU machine. Used by ``.ci/newest-triton.sh`` with the newest Triton (docs/host-path.md).

What is compiled: every (pass, kernel, head dim, tile) of the dispatch table
(``compile_tools.table_kernels``), as its launcher launches it: the tl rows (forward, split
dK/dV, dQ) on the mask layouts of :data:`LAYOUTS`, the Gluon rows (WS forward, WS dK/dV, fused
DS_SHARED backward) on one; the D=128 dK/dV and fused rows also with a GQA group split over
8 programs (KV_SPLIT); and the tl kernels without a tile of their own (block summaries, live
ranges by query and by key, the backward's delta pre-pass, the fused backward's dQ scaling,
the split groups' partial sums).

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

#: (causal, C) mask layouts per head dim of the tl rows: no mask, causal C=1 and the richest
#: (non-causal C=4: two intervals, every column word) at D=128, the last two elsewhere (the
#: C=2 layouts take the same code paths with fewer loads; all five took ~3 more minutes of
#: the CI budget on the 2-core machine); the Gluon rows on one layout (C=1: the column ring
#: included).
LAYOUTS = {128: [(True, 0), (True, 1), (False, 4)],
           64: [(True, 1), (False, 4)], 256: [(True, 1), (False, 4)]}
GLUON_LAYOUTS = [(True, 1)]


def jobs() -> list[dict]:
    """Every compile, as a picklable description: each (pass, kernel, head dim, tile) of the
    dispatch table (``compile_tools.table_kernels``) on its layouts, and the small kernels."""
    from flashmask3.kernels import compile_tools as CT

    out = [dict(family="tl", kernel=name) for name in ("summary", "range_by_query",
                                                        "range_by_key", "bwd_pre", "scale_dq",
                                                        "merge_3", "merge_8", "sum_kv_split",
                                                        "add_returns", "sum_wire_rows", "gather_keys",
                                                        "pack_wire")]
    for pass_, kernel, d, t in CT.table_kernels():
        family = "tl" if kernel == "tl" else "gluon"
        cfg = t._asdict() if hasattr(t, "_asdict") else dict(t.__dict__)
        for causal, c in (LAYOUTS[d] if family == "tl" else GLUON_LAYOUTS):
            out.append(dict(family=family, pass_=pass_, kernel=kernel, d=d, cfg=cfg,
                            causal=causal, c=c))
        if pass_ in ("dkdv", "fused") and d == 128:  # a GQA group split over 8 programs
            causal, c = GLUON_LAYOUTS[0]
            out.append(dict(family=family, pass_=pass_, kernel=kernel, d=d, cfg=cfg,
                            causal=causal, c=c, kv_split=KV_SPLIT))
    return out


#: The KV_SPLIT the split-group dK/dV jobs compile (8: GQA 8:1, one program per query head).
KV_SPLIT = 8


def _compile_small(name: str) -> dict:
    """The preprocessing / pre-pass / scaling kernels, the context-parallel forward's merge of
    stage partials (``merge_<parts>``) and its backward's sums of returned gradients
    (``add_returns``; ``sum_wire_rows``: the relays' form) and the moves between wire rows and the key layout (``gather_keys``,
    ``pack_wire``); no tile config of their own)."""
    from triton.compiler import ASTSource

    from flashmask3.kernels import compile_tools as CT
    from flashmask3.kernels import gather as GA
    from flashmask3.kernels import merge as MG
    from flashmask3.kernels import returns as RT
    from flashmask3.kernels import tiles as TI
    from flashmask3.kernels import tl_kernels as TL

    kernel, ptrs, consts = {
        "summary": (TI._summary_kernel, dict(mask_ptr="*i32", sum_ptr="*i32"),
                    dict(BLOCK_N=128, CAUSAL=False, C=4)),
        "range_by_query": (TI._range_kernel, dict(sum_ptr="*i32", rng_ptr="*i32"),
                           dict(BLOCK_M=128, BLOCK_N=128, CAUSAL=False, NI=2, BY_KEY=False,
                                CHUNK=256)),
        "range_by_key": (TI._range_kernel, dict(sum_ptr="*i32", rng_ptr="*i32"),
                         dict(BLOCK_M=64, BLOCK_N=128, CAUSAL=True, NI=1, BY_KEY=True,
                              CHUNK=256)),
        "bwd_pre": (TL._bwd_pre_kernel, dict(o_ptr="*bf16", do_ptr="*bf16", lse_ptr="*fp32",
                                             dlse_ptr="*fp32", delta_ptr="*fp32",
                                             lse2_ptr="*fp32", dq_ptr="*fp32"),
                    dict(D=128, BLOCK_M=64, HAS_DLSE=True, ZERO_DQ=True)),
        "scale_dq": (TL._scale_dq_kernel, dict(src_ptr="*fp32", dst_ptr="*bf16"),
                     dict(D=128, BLOCK_Q=64)),
        "sum_kv_split": (TL._sum_kv_split_kernel, dict(part_ptr="*fp32", dk_ptr="*bf16",
                                                      dv_ptr="*bf16"),
                         dict(SPLIT=8, D=128, BLOCK_R=32)),
        "add_returns": (RT._add_returns_kernel,
                        dict(own_ptr="*bf16", own_starts="*i32", own_rows="*i32", ret_ptr="*bf16",
                             ret_starts="*i32", ret_rows="*i32", dk_ptr="*bf16", dv_ptr="*bf16"),
                        dict(HAS_OWN=True, HAS_RET=True, WIRE_OUT=False, BLOCK=RT.BLOCK)),
        "sum_wire_rows": (RT._add_returns_kernel,
                          dict(own_ptr="*bf16", own_starts="*i32", own_rows="*i32", ret_ptr="*bf16",
                               ret_starts="*i32", ret_rows="*i32", dk_ptr="*bf16", dv_ptr="*bf16"),
                          dict(HAS_OWN=True, HAS_RET=True, WIRE_OUT=True, BLOCK=RT.BLOCK)),
        "gather_keys": (GA._gather_keys_kernel, dict(src_ptr="*bf16", rows_ptr="*i64", dst_ptr="*bf16"),
                        dict(BLOCK=GA.BLOCK)),
        "pack_wire": (GA._pack_wire_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", rows_ptr="*i64", dst_ptr="*bf16"),
                      dict(HAS_ROWS=True, BLOCK=GA.BLOCK)),
    }[name] if not name.startswith("merge_") else _merge_job(MG, int(name.split("_")[1]))
    sig, attrs = CT._signature(kernel, ptrs, {}, consts)
    for i, arg in enumerate(kernel.arg_names):  # sizes Triton specialises as divisible by 16
        if arg in DIVISIBLE_INTS.get(name, ()):
            attrs[(i,)] = [["tt.divisibility", 16]]
    ck = CT.compile_sm90_source(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), 4, 1)
    usage, sass = CT.cuobjdump(ck.asm["cubin"])
    if name in DIVISIBLE_INTS and "LDG.E.128" not in sass:
        raise RuntimeError(f"{name}: no 128-bit loads in the SASS (the copy is not vectorised)")
    return dict(regs=usage["regs"], local=usage["local"])


#: Integer arguments of the small kernels that every real launch passes divisible by 16 (Triton
#: specialises on it; the copies vectorise only with it).
DIVISIBLE_INTS = {"gather_keys": ("HALF", "CS_HD", "B_STRIDE", "KV_STRIDE"), "pack_wire": ("HALF", "CS_HD")}


def _merge_job(MG, n: int) -> tuple:
    """The merge kernel of ``n`` parts as ``merge.merge_stages`` launches it (the unused part
    pointers None): (kernel, pointer types, constexprs)."""
    ptrs = {f"o{i}": "*bf16" for i in range(n)} | {f"l{i}": "*fp32" for i in range(n)}
    ptrs |= dict(out_ptr="*bf16", lse_ptr="*fp32")
    unused = {f"{x}{i}": None for x in "ol" for i in range(n, MG.MAX_PARTS)}
    return MG._merge_kernel, ptrs, dict(unused, N=n, D=128, BLOCK_R=64)


def _compile_table_kernel(job: dict) -> dict:
    """One dispatch-table kernel, compiled as its launcher launches it (compile_tools)."""
    from flashmask3.kernels import compile_tools as CT
    from flashmask3.kernels.tiles import Config

    listing = CT.compile_launch(job["pass_"], job["kernel"], job["d"], Config(**job["cfg"]),
                                job["causal"], job["c"], kv_split=job.get("kv_split", 1))
    report = dict(hgmma=listing.count("HGMMA"),
                  ldl_stl=listing.count("LDL") + listing.count("STL"))
    if report["hgmma"] == 0:
        raise RuntimeError(f"no HGMMA in the SASS (the slow mma.sync path): {report}")
    return report


def run_one(job: dict) -> dict:
    """Compile one job; returns it with ``ok``, seconds and the report (or the error)."""
    os.environ.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    try:
        report = _compile_small(job["kernel"]) if "cfg" not in job else _compile_table_kernel(job)
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

    from flashmask3.kernels import dispatch as K

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
            what = {k: row.get(k) for k in ("family", "pass_", "kernel", "d", "cfg", "causal", "c",
                                            "kv_split")
                    if k in row}
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
    """On this (unchecked) Triton, the dispatch picks tl for every pass of a Hopper bf16 call
    at every head dim and row span, and the split backward."""
    import torch

    from flashmask3.kernels import dispatch

    dispatch._capability = lambda index: (9, 0)  # (this process only: what an H200 answers)
    dispatch.decide.cache_clear()
    cuda = torch.device("cuda", 0)
    for d in (64, 128, 256):
        for span in (None, 512.0):
            for c in (0, 1, 4):
                choice = dispatch.choose(cuda, torch.bfloat16, d, c != 4, c, span)
                if any(x.kernel != "tl" for x in (choice.forward, *choice.backward)):
                    return False
    return True


if __name__ == "__main__":
    sys.exit(main())
