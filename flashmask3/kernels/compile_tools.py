"""Offline sm_90 compile and report tools for every kernel (no GPU needed).

Compiles the ``tl`` and Gluon kernels for Hopper with Triton's bundled ptxas and reads the
cubin with its cuobjdump: registers, spills (LDL/STL, also inside the tile loops), shared
memory, HGMMA (warpgroup matrix) and TMA instructions, barriers and waits. The kernel modules
never import this one. Usage::

    python -m flashmask3.kernels.compile_tools tl [--dims 64,128,256] [--out report.json]
    python -m flashmask3.kernels.compile_tools fwd --warp-spec [--dims 128]
    python -m flashmask3.kernels.compile_tools bwd --ds-shared [--dims 128]
    python -m flashmask3.kernels.compile_tools fingerprint [--out sass.json]

``fingerprint`` compiles every (kernel, tile) the dispatch table can choose on Hopper for
16-bit inputs, on four mask layouts, and prints the sha256 of each SASS listing: two trees
that print the same hashes compile to the same machine code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import dispatch
from . import gluon_bwd as G
from . import gluon_fwd as F
from . import launcher
from . import tl_kernels as TL
from .tiles import Config, _num_intervals

_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _language_objects() -> list:
    """The objects triton 3.6's interpreter patches (``interpreter._patch_lang``)."""
    import triton.language as tl

    return [tl, tl.core, tl.tensor, tl.math, tl.core.dtype, tl.core.tensor_descriptor_base]


#: Their attributes when this module was imported (before any kernel ran under the interpreter).
_LANGUAGE_AT_IMPORT = [dict(vars(o)) for o in _language_objects()]
_MISSING = object()


def restore_triton_language() -> None:
    """Undo the patch of ``triton.language`` that triton 3.6's interpreter leaves behind.

    Calling a ``@triton.jit`` function from Python under TRITON_INTERPRET=1 (a device function,
    not a launch) patches triton.language with interpreter builtins and never restores it; an
    offline compile in the same process then fails ("'block_argument' object has no attribute
    'dtype'") unless the kernel is already in Triton's cache. Restoring the attributes seen at
    import is harmless to the interpreter, which patches (and restores) around each launch.
    """
    for obj, saved in zip(_language_objects(), _LANGUAGE_AT_IMPORT):
        for name, value in saved.items():
            if vars(obj).get(name, _MISSING) is not value:
                try:
                    setattr(obj, name, value)
                except (AttributeError, TypeError):
                    pass
        for name in set(vars(obj)) - set(saved) - {"__annotations__"}:
            try:  # added by the patch (e.g. tensor.__bool__, __index__)
                delattr(obj, name)
            except (AttributeError, TypeError):
                pass


def compile_sm90_source(src, num_warps: int, num_stages: int, **options):
    """``triton.compile`` of a tl or Gluon AST source for sm_90, in any process state."""
    restore_triton_language()
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   **launcher.COMPILE_OPTIONS, **options})


def compile_gluon_sm90(kernel, ptr_types: dict, desc_types: dict, constexprs: dict,
                       num_warps: int, num_stages: int, **options):
    """Compile a Gluon kernel for sm_90 without a GPU, with the launcher's signature
    (:func:`_signature`); returns the CompiledKernel. Shared by the Gluon modules."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, attrs = _signature(kernel, ptr_types, desc_types, constexprs)
    src = GluonASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    return compile_sm90_source(src, num_warps, num_stages, **options)


def _signature(kernel, ptr_types: dict, desc_types: dict, constexprs: dict):
    """Signature and divisibility attributes of ``kernel``: pointers/int args get 16-divisible
    hints like real contiguous CUDA tensors with aligned sizes would."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in desc_types:
            sig[name] = desc_types[name]
        elif name in ptr_types:
            sig[name] = ptr_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif "scale" in name:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig, attrs


def cuobjdump(cubin: bytes) -> tuple[dict, str]:
    """Resource usage (regs, stack, shared, local; -1 when unreadable) and the SASS listing of
    a cubin, from the bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        res = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, shared, local = (int(x) for x in m.groups()) if m else (-1, -1, -1, -1)
    return dict(regs=regs, stack=stack, shared=shared, local=local), sass


def compile_tl(kind: str, d: int, cfg: Config, causal: bool, c: int, dtype: str = "bf16",
               tma: bool = True, sass: bool = False, kv_split: int = 1) -> dict:
    """Compile one tl kernel (``kind``: fwd, dkdv or dq) for sm_90 and return its
    resource report (``sass``: with the SASS listing under "sass"; ``kv_split``: the dK/dV
    kernel's KV_SPLIT, fp32 partial outputs when > 1)."""
    ni = _num_intervals(causal, c)
    common = dict(D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, C=c, NI=ni,
                  USE_TMA=tma, PREC="tf32", A_SMEM=TL.a_smem(kind, d),
                  SPLIT_UNMASKED=TL.SPLIT_UNMASKED_LOOP[kind])
    if kind == "fwd":
        kernel = TL._fwd_kernel
        ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        ptrs.update(lse_ptr="*fp32", mask_ptr="*i32", sum_ptr="*i32", rng_ptr="*i32")
        descs = {n: f"tensordesc<{dtype}[{cfg.block_n}, {d}]>" for n in ("k_desc", "v_desc")}
        descs["q_desc"] = f"tensordesc<{dtype}[{cfg.block_m}, {d}]>"
    elif kind == "dkdv":
        kernel = TL._dkdv_kernel
        ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr")}
        ptrs.update(lse2_ptr="*fp32", delta_ptr="*fp32", mask_ptr="*i32", sum_ptr="*i32",
                    rng_ptr="*i32", dq_ptr="*fp32")
        descs = {n: f"tensordesc<{dtype}[{cfg.block_m}, {d}]>" for n in ("q_desc", "do_desc")}
        descs.update({n: f"tensordesc<{dtype}[{cfg.block_n}, {d}]>" for n in ("k_desc", "v_desc")})
        # a constexpr (left out, the compile would make it an argument); > 1: fp32 partials
        common["KV_SPLIT"] = kv_split
        if kv_split > 1:
            ptrs.update(dk_ptr="*fp32", dv_ptr="*fp32", dq_ptr="*fp32")
    else:
        kernel = TL._dq_kernel
        ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dq_ptr")}
        ptrs.update(lse2_ptr="*fp32", delta_ptr="*fp32", mask_ptr="*i32", sum_ptr="*i32",
                    rng_ptr="*i32")
        descs = {n: f"tensordesc<{dtype}[{cfg.block_n}, {d}]>" for n in ("k_desc", "v_desc")}
        descs.update({n: f"tensordesc<{dtype}[{cfg.block_m}, {d}]>" for n in ("q_desc", "do_desc")})
    if not tma:
        descs = {n: "constexpr" for n in descs}
        common.update({n: None for n in descs})
    sig, attrs = _signature(kernel, ptrs, descs, common)
    src = ASTSource(kernel, sig, constexprs={k: v for k, v in common.items()}, attrs=attrs)
    ck = compile_sm90_source(src, cfg.num_warps, cfg.num_stages)
    usage, listing = cuobjdump(ck.asm["cubin"])
    extra = dict(sass=listing) if sass else {}
    sass = listing
    return dict(**extra, kernel=kind, D=d, block_m=cfg.block_m, block_n=cfg.block_n,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, causal=causal, C=c,
                dtype=dtype, tma=tma, regs=usage["regs"], stack=usage["stack"],
                local=usage["local"],
                shared_dynamic=ck.metadata.shared, hgmma=sass.count("HGMMA"),
                hmma=sass.count("HMMA"), ldl_stl=sass.count("LDL") + sass.count("STL"),
                tma_reduce=sass.count("UTMAREDG"), red_global=sass.count("RED.E"),
                bar_sync=sass.count("BAR.SYNC"), wgmma_wait=sass.count("WARPGROUP.DEPBAR"))


# ---------------------------------------------------------------------------------------------
# Gluon backward
# ---------------------------------------------------------------------------------------------


def offline_descriptor_types(dtype: str, d: int, **rows_by_name: int) -> dict:
    """Tensor-descriptor types as the launchers build them (NVMMA shared layouts), for an
    offline compile: one ``name=block_rows`` per descriptor argument. Shared by the Gluon
    modules."""
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return {name: f"tensordesc<{dtype}[{rows}, {d}],{G._smem_layout(rows, d, tdt)!r}>"
            for name, rows in rows_by_name.items()}


def offline_constexprs(d: int, block_m: int, block_n: int, num_warps: int, num_stages: int,
                       causal: bool, c: int, **extra) -> dict:
    """The constexpr arguments every Gluon kernel of this package takes, plus ``extra``."""
    return dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, C=c,
                NI=_num_intervals(causal, c), NUM_STAGES=num_stages, NUM_WARPS=num_warps,
                **extra)


def compile_bwd(d: int = 128, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                num_stages: int = 2, causal: bool = True, c: int = 1, dtype: str = "bf16",
                fuse_dq: bool = False, warp_spec: bool = False, maxnreg: Optional[int] = None,
                stats_smem: bool = False, ds_shared: bool = False, kv_split: int = 1):
    """Compile the Gluon dK/dV kernel (``fuse_dq``: the FUSE_DQ variant; ``warp_spec``: the
    WARP_SPEC one, at ``maxnreg`` registers per thread, default :func:`G.ws_maxnreg`;
    ``kv_split``: KV_SPLIT, fp32 partial dK/dV when > 1) for sm_90 without a GPU, with the
    launcher's arguments; returns the CompiledKernel."""
    reason = G.unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    G.check_config(d, block_m, block_n, num_warps, num_stages, fuse_dq, warp_spec, stats_smem,
                   ds_shared)
    kern = G._dkdv_gluon_kernel
    descs = offline_descriptor_types(dtype, d, q_desc=block_m, do_desc=block_m, k_desc=block_n,
                                     v_desc=block_n)
    if fuse_dq:
        dq_rows, dq_cols = G.dq_reduce_block(block_m, d)
        descs["dq_desc"] = f"tensordesc<fp32[{dq_rows}, {dq_cols}],{G._dq_smem_layout(block_m, d)!r}>"
    ptrs = {"dk_ptr": f"*{dtype}", "dv_ptr": f"*{dtype}", "lse2_ptr": "*fp32",
            "delta_ptr": "*fp32", "mask_ptr": "*i32", "sum_ptr": "*i32", "rng_ptr": "*i32"}
    consts = offline_constexprs(d, block_m, block_n, num_warps, num_stages, causal, c,
                                FUSE_DQ=fuse_dq, WARP_SPEC=warp_spec)
    consts["STATS_SMEM"] = stats_smem  # a constexpr (left out, the compile makes it an argument)
    consts["DS_SHARED"] = ds_shared
    consts["KV_SPLIT"] = kv_split
    if kv_split > 1:
        ptrs.update(dk_ptr="*fp32", dv_ptr="*fp32")
    options = {}
    if warp_spec:  # as the launcher passes it (WARP_SPEC=False: the unchanged options)
        options["maxnreg"] = maxnreg if maxnreg is not None else G.ws_maxnreg(num_warps)
    if not fuse_dq:
        consts["dq_desc"] = None  # as the launcher passes it: a constexpr, not a parameter
    return compile_gluon_sm90(kern, ptrs, descs, consts, num_warps, num_stages, **options)


def _sass_instructions(sass: str) -> list:
    """(address, instruction text) of every instruction of a ``cuobjdump -sass`` listing."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    return ins


def _tile_loops(ins: list) -> list:
    """(lo, hi) address ranges of the tile loops: innermost backward-branch ranges that hold
    HGMMA (the out-of-line mbarrier-wait stubs after the last EXIT, which branch back into the
    loops, are not loops; the WARP_SPEC producer's loops hold no HGMMA)."""
    last_exit = max((a for a, t in ins if re.search(r"\bEXIT\b", t)), default=None)
    cands = []
    for addr, txt in ins:
        br = re.search(r"\bBRA\s+(0x[0-9a-f]+)", txt)
        if br and int(br.group(1), 16) < addr and (last_exit is None or addr < last_exit):
            lo = int(br.group(1), 16)
            if any(lo <= a <= addr and "HGMMA" in t for a, t in ins):
                cands.append((lo, addr))
    return [c for c in cands
            if not any(o != c and c[0] <= o[0] and o[1] <= c[1] for o in cands)]


def tile_loop_spills(sass: str):
    """(tile loops, the LDL/STL inside them) of a ``cuobjdump -sass`` listing (tile loops as
    in :func:`_tile_loops`); loops are (lo, hi) addresses, spills (address, instruction)."""
    ins = _sass_instructions(sass)
    loops = _tile_loops(ins)
    spills = [(a, t) for a, t in ins if re.search(r"\b(?:LDL|STL)\b", t)
              and any(lo <= a <= hi for lo, hi in loops)]
    return loops, spills


#: Synchronisation and load instructions counted per tile loop (one tile per iteration).
_PER_TILE_PATTERNS = {"bar_sync": r"\bBAR\.SYNC\b", "mbar_wait": r"\bSYNCS\.PHASECHK\b",
                      "mbar_arrive": r"\bSYNCS\.ARRIVE\b", "tma_load": r"\bUTMALDG\b"}


def tile_loop_counts(sass: str) -> dict:
    """The most of each :data:`_PER_TILE_PATTERNS` instruction in one tile loop (= per tile):
    CTA/partition barriers (BAR.SYNC), mbarrier waits and arrives, TMA loads. The non-WS kernel
    issues its refill from the loop (UTMALDG, expect-arrive and CTA barriers around them); the
    WARP_SPEC compute partition only waits on ``ready`` and arrives on ``empty``."""
    ins = _sass_instructions(sass)
    loops = _tile_loops(ins)
    return {f"{key}_per_tile": max((sum(1 for a, t in ins if lo <= a <= hi and re.search(pat, t))
                                    for lo, hi in loops), default=0)
            for key, pat in _PER_TILE_PATTERNS.items()}


def dp_wait_order(sass: str) -> list:
    """Per tile loop (as in :func:`_tile_loops`), where the dPᵀ wait sits among the exp2s of
    Pᵀ: the loop's second ``WARPGROUP.DEPBAR`` (the first waits for Sᵀ; the tiles issue Sᵀ
    then dPᵀ, as :func:`_tile` and :func:`_tile_ds_shared` do) and the MUFU.EX2 before and
    after it, as dicts ``dp_wait`` (instruction index in the loop), ``ex2_before``,
    ``ex2_after``. ``ex2_after`` > 0: the tensor cores idle under those exp2s."""
    ins = _sass_instructions(sass)
    rows = []
    for lo, hi in _tile_loops(ins):
        body = [t for a, t in ins if lo <= a <= hi]
        waits = [i for i, t in enumerate(body) if "WARPGROUP.DEPBAR" in t]
        ex2 = [i for i, t in enumerate(body) if "MUFU.EX2" in t]
        if len(waits) < 2:
            continue
        w = waits[1]
        rows.append(dict(dp_wait=w, ex2_before=sum(i < w for i in ex2),
                         ex2_after=sum(i > w for i in ex2)))
    return rows


def _max_register(sass: str) -> int:
    """Registers the code touches (highest R index + 1): for a WARP_SPEC kernel, whose
    ``regs`` is the launch's ``maxnreg``, this is what the compute partition uses."""
    return 1 + max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1)


def sass_report(cubin: bytes) -> dict:
    """Registers, spills, and instruction counts of a cubin (bundled cuobjdump); setmaxnreg
    values (USETMAXREG) for a warp-specialised one."""
    usage, sass = cuobjdump(cubin)
    loops, in_loops = tile_loop_spills(sass)
    per_loop = [sum(lo <= a <= hi for a, _ in in_loops) for lo, hi in loops]
    setmaxnreg = sorted({int(x, 16) for x in
                         re.findall(r"USETMAXREG\.\S+\s+(?:UP\d, )?(0x[0-9a-f]+)", sass)})
    return dict(regs=usage["regs"], stack=usage["stack"], local=usage["local"],
                regs_touched=_max_register(sass), setmaxnreg=setmaxnreg,
                hgmma=sass.count("HGMMA"),
                ldl_stl=sass.count("LDL") + sass.count("STL"), tile_loops=len(loops),
                ldl_stl_in_tile_loops=len(in_loops),
                max_ldl_stl_per_tile_loop=max(per_loop, default=0),
                stl_in_tile_loops=sum("STL" in t for _, t in in_loops),
                tma_reduce=sass.count("UTMAREDG"),
                atomics=len(re.findall(r"\b(?:RED|ATOM|ATOMG)\.", sass)),
                wgmma_wait=sass.count("WARPGROUP.DEPBAR"), warpgroup_arrive=sass.count("WARPGROUP.ARRIVE"),
                bar_sync=sass.count("BAR.SYNC"), syncs_arrive=sass.count("SYNCS.ARRIVE"),
                tma_load=sass.count("UTMALDG"), mufu_ex2=sass.count("MUFU.EX2"),
                **tile_loop_counts(sass))


def bwd_report(d=128, block_m=64, block_n=64, num_warps=4, num_stages=2, causal=True, c=1,
                   dtype="bf16", fuse_dq=False, warp_spec=False, stats_smem=False,
                   ds_shared=False) -> dict:
    """One configuration's offline sm_90 report (or its error); DS_SHARED ones also say how
    many exp2s of a tile loop come after its dPᵀ wait at most (:func:`dp_wait_order`)."""
    row = dict(D=d, block_m=block_m, block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, causal=causal, C=c, dtype=dtype, fuse_dq=fuse_dq)
    if warp_spec:
        row.update(warp_spec=True, maxnreg=G.ws_maxnreg(num_warps))
    try:
        ck = compile_bwd(d, block_m, block_n, num_warps, num_stages, causal, c, dtype, fuse_dq,
                          warp_spec, stats_smem=stats_smem, ds_shared=ds_shared)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        return row
    row["shared"] = ck.metadata.shared
    row.update(sass_report(ck.asm["cubin"]))
    if ds_shared:
        order = dp_wait_order(cuobjdump(ck.asm["cubin"])[1])
        row.update(ex2_after_dp_wait=max((r["ex2_after"] for r in order), default=0))
    return row


#: (block_m, block_n, num_warps, num_stages) tried at D=128 by the report.
BWD_REPORT_CONFIGS = [(64, 64, 4, 2), (32, 64, 4, 2), (32, 64, 4, 3), (16, 64, 4, 3), (64, 128, 8, 2),
                  (32, 128, 8, 3)]
#: ... for the WARP_SPEC kernel (``--warp-spec``; with ``--fused`` too: FUSED_BWD_REPORT_CONFIGS) ...
WS_BWD_REPORT_CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2)]
#: ... at D=256 (both kernels): the head-dim split's tiles (64 keys, 8 warps; the first is the
#: default) ...
D256_BWD_REPORT_CONFIGS = [(64, 64, 8, 2), (32, 64, 8, 3)]
#: ... and for the FUSE_DQ kernel (``--fused``).
FUSED_BWD_REPORT_CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 2), (16, 64, 4, 3), (16, 64, 4, 2),
                        (32, 128, 8, 3)]


def bwd_main(argv=None):
    import argparse
    import json

    ap = argparse.ArgumentParser(description="offline sm_90 report of the Gluon dK/dV kernel")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--layouts", default="1:1,0:2,1:0", help="causal:C pairs")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--fused", action="store_true", help="the FUSE_DQ kernel")
    ap.add_argument("--warp-spec", action="store_true",
                    help="the WARP_SPEC kernel (1-warp TMA producer partition)")
    ap.add_argument("--ds-shared", action="store_true",
                    help="the fused DS_SHARED kernel (WS + STATS_SMEM; s2/s3 at its "
                         "G.DS_SHARED_TILES tile: D=128 64x128 w8, D=64 64x64 w4)")
    args = ap.parse_args(argv)
    if args.ds_shared:
        for d in (int(x) for x in args.dims.split(",")):
            bm, bn, w, most = G.DS_SHARED_TILES[d]
            for st in range(2, most + 1):
                for causal, c in ((bool(int(a)), int(b)) for a, b in
                                  (x.split(":") for x in args.layouts.split(","))):
                    print(json.dumps(bwd_report(d, bm, bn, w, st, causal=causal, c=c,
                                                    dtype=args.dtype, fuse_dq=True,
                                                    warp_spec=True, stats_smem=True,
                                                    ds_shared=True)), flush=True)
        return
    if args.fused:
        configs = FUSED_BWD_REPORT_CONFIGS[:2] if args.warp_spec else FUSED_BWD_REPORT_CONFIGS
    else:
        configs = WS_BWD_REPORT_CONFIGS if args.warp_spec else BWD_REPORT_CONFIGS
    for d in (int(x) for x in args.dims.split(",")):
        for cfg in (D256_BWD_REPORT_CONFIGS if d == 256 and not args.fused else configs):
            for causal, c in ((bool(int(a)), int(b)) for a, b in
                              (x.split(":") for x in args.layouts.split(","))):
                print(json.dumps(bwd_report(d, *cfg, causal=causal, c=c, dtype=args.dtype,
                                                fuse_dq=args.fused, warp_spec=args.warp_spec)),
                      flush=True)


# ---------------------------------------------------------------------------------------------
# Gluon forward
# ---------------------------------------------------------------------------------------------


def compile_fwd(d: int = 128, block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                num_stages: int = 2, causal: bool = True, c: int = 1, dtype: str = "bf16",
                warp_spec: bool = True, pingpong: bool = False,
                cols_smem: Optional[bool] = None):
    """Compile the warp-specialised Gluon forward (:func:`F._fwd_ws_kernel`) for sm_90 without a
    GPU, with the launcher's arguments; returns the CompiledKernel. ``warp_spec`` must be True
    (the only Gluon forward left)."""
    reason = F.unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    if not warp_spec:
        raise ValueError("compile_fwd: only the warp-specialised Gluon forward exists")
    cols_smem = F._uses_cols_smem(True, c, cols_smem)
    F.check_config(d, block_m, block_n, num_warps, num_stages, True, pingpong,
                   c if cols_smem else 0)
    descs = offline_descriptor_types(dtype, d, q_desc=64, k_desc=block_n, v_desc=block_n)
    ptrs = {"o_ptr": f"*{dtype}", "lse_ptr": "*fp32", "mask_ptr": "*i32", "sum_ptr": "*i32",
            "rng_ptr": "*i32", "n_items": "i32"}
    consts = offline_constexprs(d, block_m, block_n, num_warps, num_stages, causal, c)
    consts.update(PINGPONG=pingpong, CONSUMER_REGS=F.ws_consumer_regs(num_warps),
                  COLS_SMEM=cols_smem)
    return compile_gluon_sm90(F._fwd_ws_kernel, ptrs, descs, consts, 4, num_stages,
                              maxnreg=F.ws_maxnreg(num_warps))


def sass(ck) -> str:
    """The ``cuobjdump -sass`` listing of a compiled kernel."""
    return cuobjdump(ck.asm["cubin"])[1]


def overlaps(sass_text: str) -> bool:
    """Whether some wgmma wait leaves one group in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``):
    the S wait under the running PV matmul."""
    return "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass_text


def fwd_report(d=128, block_m=128, block_n=128, num_warps=8, num_stages=2, causal=True, c=1,
                   dtype="bf16", warp_spec=True, pingpong=False, cols_smem=None) -> dict:
    """One configuration's offline sm_90 report (registers, spills, HGMMA, overlap) or its
    error."""
    row = dict(D=d, block_m=block_m, block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, causal=causal, C=c, dtype=dtype, warp_spec=warp_spec,
               pingpong=pingpong, cols_smem=cols_smem)
    try:
        ck = compile_fwd(d, block_m, block_n, num_warps, num_stages, causal, c, dtype,
                         warp_spec, pingpong, cols_smem)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        return row
    row["shared"] = ck.metadata.shared
    row.update(sass_report(ck.asm["cubin"]))
    row["overlap"] = overlaps(sass(ck))
    return row


#: (block_m, block_n, num_warps, num_stages) tried at D=128 by the report.
FWD_REPORT_CONFIGS = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2)]


def fwd_main(argv=None):
    import argparse
    import json

    ap = argparse.ArgumentParser(description="offline sm_90 report of the Gluon forward kernel")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--layouts", default="1:0,1:1,1:2,0:0,0:2,0:4", help="causal:C pairs")
    ap.add_argument("--configs", default=",".join("{}x{}w{}s{}".format(*c)
                                                   for c in FWD_REPORT_CONFIGS))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--warp-spec", action="store_true",
                    help="(the default, kept for old command lines) block_m 128 w8 or 64 w4")
    ap.add_argument("--pingpong", action="store_true", help="the WS kernel with ping-pong")
    args = ap.parse_args(argv)
    configs = [tuple(int(x) for x in lab.replace("x", " ").replace("w", " ").replace("s", " ")
                     .split()) for lab in args.configs.split(",")]
    for d in (int(x) for x in args.dims.split(",")):
        for cfg in configs:
            for causal, c in ((bool(int(a)), int(b)) for a, b in
                              (x.split(":") for x in args.layouts.split(","))):
                print(json.dumps(fwd_report(d, *cfg, causal=causal, c=c, dtype=args.dtype,
                                                pingpong=args.pingpong)), flush=True)


# ---------------------------------------------------------------------------------------------
# SASS fingerprints of the table's kernels
# ---------------------------------------------------------------------------------------------

#: Mask layouts (causal, C) the fingerprint compiles each kernel for.
FINGERPRINT_LAYOUTS = ((True, 0), (True, 1), (False, 2), (False, 4))


def table_kernels() -> list:
    """(pass, kernel, head dim, tile) of every Hopper 16-bit row and every portable row."""
    rows = []
    for row in dispatch.TABLE:
        if row.hardware == "interpreter":
            continue
        for d in row.dims:
            if d >= 64 and (row.pass_, row.kernel, d, row.tile) not in rows:
                rows.append((row.pass_, row.kernel, d, row.tile))
    return rows


def compile_launch(pass_: str, kernel: str, d: int, t: Config, causal: bool, c: int,
                   kv_split: int = 1):
    """The SASS listing of one table kernel compiled offline as its launcher launches it
    (``kv_split``: a dK/dV or fused kernel with its GQA groups split over that many
    programs)."""
    tile = (t.block_m, t.block_n, t.num_warps, t.num_stages)
    split = dict(kv_split=kv_split) if pass_ in ("dkdv", "fused") else {}
    if kernel == "tl":
        return compile_tl(pass_, d, t, causal, c, sass=True, **split)["sass"]
    if kernel.startswith("gluon_ws") and pass_ == "fwd":
        ck = compile_fwd(d, *tile, causal=causal, c=c, warp_spec=True,
                         pingpong=kernel == "gluon_ws_pingpong")
    elif kernel == "gluon_fused":
        ck = compile_bwd(d, *tile, causal=causal, c=c, **G.FUSED_VARIANT, **split)
    else:
        ck = compile_bwd(d, *tile, causal=causal, c=c, warp_spec=True,
                         stats_smem=kernel == "gluon_ws_dkdv_stats", **split)
    return cuobjdump(ck.asm["cubin"])[1]


def fingerprint(select: str = "") -> dict:
    """sha256 of the SASS of every :func:`table_kernels` entry on :data:`FINGERPRINT_LAYOUTS`
    (``select``: only labels containing it); errors are recorded, not raised."""
    out = {}
    for pass_, kernel, d, t in table_kernels():
        for causal, c in FINGERPRINT_LAYOUTS:
            label = (f"{pass_} {kernel} d{d} {t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}"
                     f" causal={causal} C={c}")
            if select and select not in label:
                continue
            try:
                sass = compile_launch(pass_, kernel, d, t, causal, c)
                out[label] = hashlib.sha256(sass.encode()).hexdigest()
            except Exception as exc:  # report and continue
                out[label] = f"ERROR {type(exc).__name__}: {str(exc)[:200]}"
            print(label, out[label], flush=True)
    return out


def tl_main(argv=None):
    ap = argparse.ArgumentParser(description="offline sm_90 report of the tl kernels")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--layouts", default="1:1,0:4", help="causal:C pairs")
    ap.add_argument("--kernels", default="fwd,dkdv,dq")
    args = ap.parse_args(argv)
    rows = []
    layouts = [(bool(int(a)), int(b)) for a, b in (x.split(":") for x in args.layouts.split(","))]
    tiles = [(p, d, t) for p, k, d, t in table_kernels() if k == "tl"]
    for d in (int(x) for x in args.dims.split(",")):
        for kind in args.kernels.split(","):
            for cfg in [t for p, dd, t in tiles if p == kind and dd == d]:
                for causal, c in layouts:
                    try:
                        r = compile_tl(kind, d, cfg, causal, c, args.dtype)
                    except Exception as exc:  # report and continue (e.g. out of shared memory)
                        r = dict(kernel=kind, D=d, cfg=str(cfg), causal=causal, C=c,
                                 error=f"{type(exc).__name__}: {str(exc)[:200]}")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def fingerprint_main(argv=None):
    ap = argparse.ArgumentParser(description="SASS sha256 of every kernel the table can choose")
    ap.add_argument("--select", default="", help="only labels containing this")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = fingerprint(args.select)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"tl": tl_main, "fwd": fwd_main, "bwd": bwd_main, "fingerprint": fingerprint_main}
    if not argv or argv[0] not in commands:
        raise SystemExit(f"usage: python -m flashmask3.kernels.compile_tools {{{','.join(commands)}}} ...")
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
