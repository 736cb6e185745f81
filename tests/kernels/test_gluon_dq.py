"""The Gluon dQ kernel (flashmask3/kernels/gluon_dq.py, opt-in: FLASHMASK3_TRITON_DQ=gluon).

CPU: the kernel compiles offline for sm_90 (Triton's bundled ptxas/cuobjdump, no GPU) into a
cubin whose wgmmas are the ``tl`` dQ kernel's (same HGMMA count at the same tile shape), with
waits that leave a wgmma group in flight (``DEPBAR.LE gsb0, 0x1``) and no spill inside a tile
loop; the launcher compiles exactly the offline-checked kernel; ``FLASHMASK3_TRITON_DQ`` picks
the implementation (unset/tl: tl; invalid: ValueError). GPU (``gpu`` marker): dQ bitwise equal
to the ``tl`` kernel's at the same tile shape, and the public backward with the Gluon dQ
against the float64 dense reference.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashmask3.kernels import gluon_dq as GQ
from flashmask3.kernels import triton_flashmask as T
from flashmask3.kernels.triton_report import cuobjdump
from tests.helpers import gpu_masks, random_columns
from tests.kernels.test_gluon_dkdv import _offline_skip_reason

#: Every (causal, C) the kernel specialises on.
LAYOUTS = [(True, 1), (True, 2), (False, 2), (False, 4), (True, 0), (False, 0)]

#: Whole-kernel LDL/STL bound at the tl default shape 128x64 w8 s3 (offline report, D=128
#: bf16; plain and PIPE): 0-10 except non-causal C=4 (36, outside the tile loops: setup around
#: the 255-register masked loops, which hold the tile's column-interval vectors).
MAX_LDL_STL = 48


def _default_config(d: int = 128) -> tuple:
    """The library's default dQ (block_m, block_n, num_warps, num_stages) at head dim d."""
    c = T.CANDIDATES[("dq", d)][0]
    return (c.block_m, c.block_n, c.num_warps, c.num_stages)


offline = pytest.mark.skipif(_offline_skip_reason() is not None,
                             reason=str(_offline_skip_reason()))


@offline
@pytest.mark.parametrize("pipe", [False, True])
@pytest.mark.parametrize("causal, c", LAYOUTS)
def test_compiles_for_sm90_with_async_waits(causal, c, pipe):
    """Default shape (plain and PIPE): HGMMA, TMA loads, async waits in every tile loop, no
    spill inside a tile loop."""
    r = GQ.compile_report(128, *_default_config(), causal=causal, c=c, pipe=pipe)
    assert "error" not in r, r.get("error")
    assert r["hgmma"] > 0 and r["tma_load"] > 0, r
    assert r["async_waits"] >= r["tile_loops"] > 0, r  # one DEPBAR.LE gsb0, 0x1 per tile
    assert r["ldl_stl_in_tile_loops"] == 0, r
    assert r["ldl_stl"] <= MAX_LDL_STL, r


@offline
def test_async_wait_in_sass():
    """The point of the kernel: ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (S waited with dP in flight);
    PIPE also waits for S with two groups (the previous dQ and dP) in flight (``0x2``)."""
    ck = GQ.compile_sm90(128, *_default_config(), causal=True, c=1)
    assert GQ.ASYNC_WAIT in cuobjdump(ck.asm["cubin"])[1]
    ck = GQ.compile_sm90(128, *_default_config(), causal=True, c=1, pipe=True)
    sass = cuobjdump(ck.asm["cubin"])[1]
    assert GQ.ASYNC_WAIT in sass and "WARPGROUP.DEPBAR.LE gsb0, 0x2" in sass


def _tl_report(d, cfg, causal, c) -> dict:
    """``triton_report.compile_one`` of the tl dQ kernel, in a subprocess: the test session runs
    the tl kernels under the interpreter (TRITON_INTERPRET=1 without a GPU), which cannot
    compile them for sm_90."""
    import json
    import subprocess
    import sys

    code = ("import json; from flashmask3.kernels import triton_report as R, triton_flashmask as K;"
            f"print(json.dumps(R.compile_one('dq', {d}, K.Config(*{tuple(cfg)!r}), {causal}, {c})))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@offline
@pytest.mark.parametrize("causal, c", [(True, 1), (False, 4)])
def test_same_wgmma_count_as_tl_kernel(causal, c):
    """Same tile shape, same HGMMA instructions as the tl dQ kernel (S, dP: K = D in 16-wide
    k-steps; dQ: K = BLOCK_N), the precondition of bitwise equal results."""
    tl_r = _tl_report(128, _default_config(), causal, c)
    r = GQ.compile_report(128, *_default_config(), causal=causal, c=c)
    assert r["hgmma"] == tl_r["hgmma"] > 0, (r, tl_r)


@offline
def test_d64_and_other_shapes_compile():
    """D=64 at its tl default (64x64 w4 s3) and 64x128 w4 s2 at D=128 compile with HGMMA and
    async waits (64x128 spills at 255 registers: measured, not bounded here)."""
    for d, cfg in ((64, _default_config(64)), (128, (64, 128, 4, 2))):
        r = GQ.compile_report(d, *cfg, causal=True, c=1)
        assert "error" not in r, r.get("error")
        assert r["hgmma"] > 0 and r["async_waits"] > 0, r


@offline
def test_launcher_compiles_the_offline_checked_kernel(monkeypatch):
    """``launch_dq_gluon``'s real arguments bound by Triton's JIT under a stand-in sm_90 driver
    (compile only, nothing launched) give the same SASS as :func:`compile_sm90`."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    kern = GQ._dq_gluon_kernel
    compiled = {}

    class _WarmupOnly:  # kernel[grid](...) compiles without launching
        def __getattr__(self, name):
            return getattr(kern, name)

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                compiled["kernel"] = kern.run(*args, grid=grid, warmup=True, **kwargs)
            return run

    saved = driver._active
    kern.device_caches.clear()
    driver.set_active(_Sm90())
    monkeypatch.setattr(GQ, "_dq_gluon_kernel", _WarmupOnly())
    try:
        b, sq, sk, hq, hk, d = 2, 777, 1000, 4, 2, 128
        bm, bn, w, st = _default_config()
        nqb, nkb = -(-sq // bm), -(-sk // bn)
        q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, dtype=torch.bfloat16)
        lse2 = torch.zeros(b, hq, sq)
        cols = torch.full((b, 1, sk, 1), sq, dtype=torch.int32)
        plan = T.Plan(cols, torch.zeros(b, nkb, 8, dtype=torch.int32),
                      torch.zeros(b, nqb, 8, dtype=torch.int32), 1, 1, 1, 1)
        out = GQ.launch_dq_gluon(q, k, k, q, lse2, lse2, True, 0.1, plan, bm, bn, w, st)
        assert out.shape == q.shape and out.dtype == q.dtype
        ref = GQ.compile_sm90(128, bm, bn, w, st, True, 1, "bf16")
        assert (cuobjdump(compiled["kernel"].asm["cubin"])[1]
                == cuobjdump(ref.asm["cubin"])[1])
    finally:
        driver._active = saved
        kern.device_caches.clear()


def test_config_checks():
    GQ.check_config(*((128,) + _default_config(128)))  # the tl D=128 default shape
    GQ.check_config(*((64,) + _default_config(64)))
    GQ.check_config(128, 64, 128, 4, 2)
    with pytest.raises(ValueError):
        GQ.check_config(128, 64, 128, 8, 2)  # block_m must be 16 * num_warps
    with pytest.raises(ValueError):
        GQ.check_config(256, 128, 32, 8, 2)  # D=256 stays on tl
    with pytest.raises(ValueError):
        GQ.check_config(128, 128, 64, 8, 0)


def test_dispatch_env(monkeypatch):
    """Unset or tl: tl; gluon on CPU tensors (no Hopper): tl; anything else: ValueError."""
    q = torch.zeros(1, 8, 1, 128)
    cfg = T.CANDIDATES[("dq", 128)][0]
    monkeypatch.delenv("FLASHMASK3_TRITON_DQ", raising=False)
    assert T._dq_impl(q, cfg) == "tl"
    monkeypatch.setenv("FLASHMASK3_TRITON_DQ", "tl")
    assert T._dq_impl(q, cfg) == "tl"
    monkeypatch.setenv("FLASHMASK3_TRITON_DQ", "gluon")
    assert T._dq_impl(q, cfg) == "tl"  # no GPU: the Gluon kernel cannot run, falls back
    monkeypatch.setenv("FLASHMASK3_TRITON_DQ", "cutlass")
    with pytest.raises(ValueError, match="FLASHMASK3_TRITON_DQ"):
        T._dq_impl(q, cfg)


def test_launch_dq_dispatches_to_tl_by_default(monkeypatch):
    """``_launch_dq`` calls the tl launcher unless ``_dq_impl`` says gluon, then the Gluon one
    with the config's tile shape."""
    calls = []
    monkeypatch.setattr(T, "_launch_dq_tl", lambda *a: calls.append("tl") or "tl-dq")
    monkeypatch.setattr(GQ, "launch_dq_gluon",
                        lambda *a: calls.append(("gluon", a[-4:])) or "gluon-dq")
    cfg = T.Config(128, 64, 8, 3)
    args = (torch.zeros(1, 8, 1, 128),) + (None,) * 5 + (True, 0.1, cfg, None)
    assert T._launch_dq(*args) == "tl-dq"
    monkeypatch.setattr(T, "_dq_impl", lambda q, c: "gluon")
    assert T._launch_dq(*args) == "gluon-dq"
    assert calls == ["tl", ("gluon", (128, 64, 8, 3))]


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _require_hopper_gluon():
    if GQ.unavailable_reason():
        pytest.skip(GQ.unavailable_reason())
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90 (wgmma)")


def _gpu_case(name, sq, sk, hq, hk, d, dtype, seed):
    """q, k, v, dO, mask columns, causal, scale, lse2, delta for mask ``name`` (Sq=Sk) or
    random columns (``name`` = 'random:<causal>:<C>:<Hm>', any Sq, Sk)."""
    if name.startswith("random:"):
        _, cz, c, hm = name.split(":")
        causal, c, hm = bool(int(cz)), int(c), int(hm)
        cols = (None if c == 0 else
                random_columns(2, hm, sq, sk, causal, c, seed=seed).cuda())
    else:
        mask, causal = gpu_masks(sq)[name]
        cols = None if mask is None else mask.startend_row_indices.cuda()
        causal = causal if mask is None else mask.causal
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    out, lse = T.forward(q, k, v, cols, causal, scale)
    delta, lse2 = T._bwd_pre(out, dout, lse, None)
    return q, k, v, dout, cols, causal, scale, lse2, delta


GPU_CASES = (
    [(n, 1000, 1000, 4, 2, 128, torch.bfloat16) for n in
     ("causal", "full", "causal_document", "document", "global_sliding_window",
      "causal_blockwise")]
    + [(f"random:{int(cz)}:{c}:{hm}", 777, 1000, 4, 2, 128, torch.bfloat16)
       for cz, c in ((True, 1), (True, 2), (False, 2), (False, 4)) for hm in (1, 4)]
    + [("random:1:0:1", 1000, 777, 4, 4, 128, torch.float16),
       ("random:0:4:2", 1000, 1000, 4, 2, 64, torch.bfloat16)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-d{c[5]}" for c in GPU_CASES])
@pytest.mark.parametrize("pipe", [False, True])
@pytest.mark.parametrize("cfg", ["default", (64, 64, 4, 2)])
def test_gpu_bitwise_equal_to_tl(case, cfg, pipe):
    """dQ bit for bit equal to the tl dQ kernel's at the same tile shape (same wgmma k-steps in
    the same order, same elementwise expressions), plain and PIPE: every (causal, C), Hm in
    {1, Hq}, GQA, Sq != Sk, lengths off the block grid, fp16, D=64."""
    _require_hopper_gluon()
    name, sq, sk, hq, hk, d, dtype = case
    q, k, v, dout, cols, causal, scale, lse2, delta = _gpu_case(name, sq, sk, hq, hk, d, dtype, 3)
    if cfg == "default":
        cfg = _default_config(d)
    elif d != 128:
        pytest.skip("extra shapes at D=128 only")
    tcfg = T.Config(*cfg)
    plan = T.make_plan(cols, causal, sq, sk, tcfg.block_m, tcfg.block_n, False, q.device)
    ref = T._launch_dq_tl(q, k, v, dout, lse2, delta, causal, scale, tcfg, plan)
    got = GQ.launch_dq_gluon(q, k, v, dout, lse2, delta, causal, scale, plan, *cfg, pipe=pipe)
    assert torch.isfinite(got).all()
    assert torch.equal(got, ref), (got.float() - ref.float()).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "full", "causal_document", "global_sliding_window"])
def test_gpu_public_backward_with_gluon_dq_against_float64(monkeypatch, name):
    """T.backward with FLASHMASK3_TRITON_DQ=gluon (S=1500, GQA 4:2): the Gluon dQ is picked,
    dQ equals the default (tl) backward's bit for bit and the float64 dense reference within
    the bf16 tolerance of the GPU test file (2e-2)."""
    from tests.reference import reference_attention, rel_err

    _require_hopper_gluon()
    s, d = 1500, 128
    q, k, v, dout, cols, causal, scale, _, _ = _gpu_case(name, s, s, 4, 2, d, torch.bfloat16, 9)
    out, lse = T.forward(q, k, v, cols, causal, scale)
    monkeypatch.delenv("FLASHMASK3_TRITON_DQ", raising=False)
    ref_tl = T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)
    monkeypatch.setenv("FLASHMASK3_TRITON_DQ", "gluon")
    assert T._dq_impl(q, T._config("dq", d, causal, 0 if cols is None else cols.shape[-1],
                                   q.dtype)) == "gluon"
    dq, dk, dv = T.backward(dout, None, q, k, v, out, lse, cols, causal, scale)
    assert torch.equal(dq, ref_tl[0]) and torch.equal(dk, ref_tl[1]) and torch.equal(dv, ref_tl[2])
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, _ = reference_attention(q64, k64, v64, cols, causal, scale)
    rq, rk, rv = torch.autograd.grad((ref_out * dout.double()).sum(), (q64, k64, v64))
    for g, r in ((dq, rq), (dk, rk), (dv, rv)):
        assert not torch.isnan(g).any()
        assert rel_err(g, r) < 2e-2
