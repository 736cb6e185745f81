"""Compiler report for the Triton FlashMask kernels: registers, spills, shared memory, HGMMA.

Compiles each kernel for sm_90 (Hopper) *without a GPU* (Triton's bundled ptxas and
cuobjdump), so the register/spill budget of every candidate configuration can be read before
spending device time. Usage::

    python -m flashmask3.kernels.triton_report [--dtype bf16] [--out report.json]

For each (kernel, head dim, config, mask layout) it prints registers per thread, local-memory
bytes (spills; LDL/STL count in SASS), static shared memory, and the number of HGMMA (warpgroup
matrix) instructions in the SASS: a matrix kernel without HGMMA is on the slower mma.sync path.
Also counted: TMA reduce-adds (UTMAREDG, the fused backward's dQ), element reductions (RED.E),
CTA barriers (BAR.SYNC) and wgmma waits (WARPGROUP.DEPBAR).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import triton_flashmask as K

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
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})


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


def compile_one(kind: str, d: int, cfg: K.Config, causal: bool, c: int, dtype: str = "bf16",
                tma: bool = True) -> dict:
    """Compile one kernel variant for sm_90 and return its resource report."""
    ni = K._num_intervals(causal, c)
    common = dict(D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, C=c, NI=ni,
                  USE_TMA=tma, PREC="tf32", A_SMEM=K._a_smem(kind, d),
                  SPLIT_UNMASKED=K.SPLIT_UNMASKED_LOOP[kind])
    if kind == "fwd":
        kernel = K._fwd_kernel
        ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
        ptrs.update(lse_ptr="*fp32", mask_ptr="*i32", sum_ptr="*i32", rng_ptr="*i32")
        descs = {n: f"tensordesc<{dtype}[{cfg.block_n}, {d}]>" for n in ("k_desc", "v_desc")}
        descs["q_desc"] = f"tensordesc<{dtype}[{cfg.block_m}, {d}]>"
    elif kind in ("dkdv", "fused"):
        kernel = K._dkdv_kernel
        fused = kind == "fused"
        common.update(FUSE_DQ=fused, DQ_TMA=fused and tma)
        ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr")}
        ptrs.update(lse2_ptr="*fp32", delta_ptr="*fp32", mask_ptr="*i32", sum_ptr="*i32",
                    rng_ptr="*i32", dq_ptr="*fp32")
        descs = {n: f"tensordesc<{dtype}[{cfg.block_m}, {d}]>" for n in ("q_desc", "do_desc")}
        descs.update({n: f"tensordesc<{dtype}[{cfg.block_n}, {d}]>" for n in ("k_desc", "v_desc")})
        if fused:
            descs["dq_desc"] = f"tensordesc<fp32[{cfg.block_m}, {d}]>"
        else:
            common["dq_desc"] = None
    else:
        kernel = K._dq_kernel
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
    usage, sass = cuobjdump(ck.asm["cubin"])
    return dict(kernel=kind, D=d, block_m=cfg.block_m, block_n=cfg.block_n,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, causal=causal, C=c,
                dtype=dtype, tma=tma, regs=usage["regs"], stack=usage["stack"],
                local=usage["local"],
                shared_dynamic=ck.metadata.shared, hgmma=sass.count("HGMMA"),
                hmma=sass.count("HMMA"), ldl_stl=sass.count("LDL") + sass.count("STL"),
                tma_reduce=sass.count("UTMAREDG"), red_global=sass.count("RED.E"),
                bar_sync=sass.count("BAR.SYNC"), wgmma_wait=sass.count("WARPGROUP.DEPBAR"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--layouts", default="1:1,0:4", help="causal:C pairs")
    ap.add_argument("--kernels", default="fwd,dkdv,dq,fused")
    args = ap.parse_args(argv)
    rows = []
    layouts = [(bool(int(a)), int(b)) for a, b in (x.split(":") for x in args.layouts.split(","))]
    for d in (int(x) for x in args.dims.split(",")):
        for kind in args.kernels.split(","):
            for cfg in K.CANDIDATES[(kind, d)]:
                for causal, c in layouts:
                    try:
                        r = compile_one(kind, d, cfg, causal, c, args.dtype)
                    except Exception as exc:  # report and continue (e.g. out of shared memory)
                        r = dict(kernel=kind, D=d, cfg=str(cfg), causal=causal, C=c,
                                 error=f"{type(exc).__name__}: {str(exc)[:200]}")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
