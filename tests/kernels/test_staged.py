"""The staged backward (kernels/staged.py): prepare once, one call per stage, finish once.

Over stages whose keys partition a key set, it must give the gradients of one backward over
that set. Checked against the float64 dense reference with fresh random inputs and a gradient
of the log-sum-exp (the merged LSE of context parallelism gets one): the torch path in float64
at 1e-10; the Triton backend's split accumulation under the interpreter (its real kernels); its
fused accumulation (one fp32 dQ accumulator that every stage adds into, scaled once) with the
Gluon kernel replaced by a float64 stand-in that adds its unscaled dQ into the buffer it is
given, the way the FUSE_DQ kernel's TMA reduce-adds do.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashmask3.kernels import staged
from flashmask3.masks import to_dense
from flashmask3.kernels import torch_path as P
from tests.helpers import random_columns
from tests.reference import reference_attention, rel_err

#: Key boundaries of the stages (an empty stage included: a rank can have one).
STAGES = (0, 40, 40, 96, 130)


def _nonempty_stages() -> int:
    return sum(1 for a, z in zip(STAGES[:-1], STAGES[1:]) if z > a)


def _inputs(dtype, b=1, sq=72, sk=130, hq=4, hk=2, d=16, c=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=dtype)
               for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    cols = random_columns(b, hk, sq, sk, False, c, seed=seed)
    return q, k, v, cols


def _reference_grads(q, k, v, cols, scale, dout, dlse):
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(q64, k64, v64, cols, False, scale)
    loss = (out * dout.double()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * dlse.double()).sum()
    return out, lse, torch.autograd.grad(loss, (q64, k64, v64))


def _staged_grads(fns, q, k, v, cols, scale, out, lse, dout, dlse):
    """Run ``fns = (prepare, stage, finish)`` over the key slices of :data:`STAGES`."""
    prepare, stage, finish = fns
    state = prepare(q, out, dout, lse, dlse)
    dks, dvs = [], []
    for a, z in zip(STAGES[:-1], STAGES[1:]):
        dk, dv = stage(state, q, k[:, a:z].contiguous(), v[:, a:z].contiguous(),
                       cols[:, :, a:z].contiguous(), False, scale)
        dks.append(dk)
        dvs.append(dv)
    return finish(state), torch.cat(dks, 1), torch.cat(dvs, 1)


def _dout_dlse(out, lse, seed=1):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float32).masked_fill(torch.isinf(lse), 0)
    return dout, dlse


def test_torch_path_staged_backward_is_one_backward_float64():
    q, k, v, cols = _inputs(torch.float64)
    scale = 0.3
    out, lse = P.forward(q, k, v, cols, False, scale)
    dout, dlse = _dout_dlse(out, lse)
    got = _staged_grads((P.backward_prepare, P.backward_stage, P.backward_finish), q, k, v, cols,
                        scale, out, lse, dout, dlse)
    whole = P.backward(dout, dlse, q, k, v, out, lse, cols, False, scale)
    _, _, ref = _reference_grads(q, k, v, cols, scale, dout, dlse)
    for name, g, w, r in zip(("dq", "dk", "dv"), got, whole, ref):
        assert g.dtype == torch.float64, name
        assert (g - w).abs().max() < 1e-10, name
        assert (g - r).abs().max() < 1e-10, name


def test_whole_call_stages_is_what_a_backend_without_staged_functions_gets():
    class OnlyBackward:
        calls = 0

        @staticmethod
        def backward(*args):
            OnlyBackward.calls += 1
            return P.backward(*args)

    fns = staged.staged_functions(OnlyBackward)
    assert isinstance(fns[0].__self__, staged.WholeCallStages)
    assert staged.staged_functions(P) == (P.backward_prepare, P.backward_stage, P.backward_finish)
    q, k, v, cols = _inputs(torch.float64, seed=3)
    out, lse = P.forward(q, k, v, cols, False, 0.25)
    dout, dlse = _dout_dlse(out, lse, seed=4)
    got = _staged_grads(fns, q, k, v, cols, 0.25, out, lse, dout, dlse)
    assert OnlyBackward.calls == _nonempty_stages()  # a stage without keys calls nothing
    _, _, ref = _reference_grads(q, k, v, cols, 0.25, dout, dlse)
    assert max((g - r).abs().max().item() for g, r in zip(got, ref)) < 1e-10


def test_stage_scale_must_not_change():
    q, k, v, cols = _inputs(torch.float64, sk=40)
    out, lse = P.forward(q, k, v, cols, False, 0.3)
    state = P.backward_prepare(q, out, torch.randn_like(out), lse, None)
    P.backward_stage(state, q, k, v, cols, False, 0.3)
    with pytest.raises(ValueError, match="softmax_scale"):
        P.backward_stage(state, q, k, v, cols, False, 0.5)


def test_no_stage_gives_zero_dq():
    q, k, v, cols = _inputs(torch.float64, sk=40)
    out, lse = P.forward(q, k, v, cols, False, 0.3)
    state = P.backward_prepare(q, out, torch.randn_like(out), lse, None)
    dq = P.backward_finish(state)
    assert dq.shape == q.shape and dq.dtype == q.dtype and not dq.any()


# -- the Triton backend (interpreter on CPU) ------------------------------------------------------


def _triton():
    pytest.importorskip("triton")
    from flashmask3.kernels import triton_backend as T

    if T.unsupported_reason(torch.empty(1, 1, 1, 16)) is not None and not torch.cuda.is_available():
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    return T


def _count_calls(monkeypatch, module, name):
    calls = []
    fn = getattr(module, name)

    def wrapped(*a, **kw):
        calls.append(name)
        return fn(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def _check_triton_staged(T, q, k, v, cols, scale, tol=2e-4):
    out, lse = T.forward(q, k, v, cols, False, scale)
    dout, dlse = _dout_dlse(out, lse, seed=5)
    got = _staged_grads((T.backward_prepare, T.backward_stage, T.backward_finish), q, k, v, cols,
                        scale, out, lse, dout, dlse)
    _, _, ref = _reference_grads(q, k, v, cols, scale, dout, dlse)
    errs = {n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
    assert all(g.dtype == q.dtype for g in got)
    assert all(e <= tol for e in errs.values()), errs
    return got


def _force_kv_split(monkeypatch, T, split: bool) -> list:
    """With ``split``, every GQA dK/dV launch runs one program per query head (an SM count no
    grid fills: ``kv_split`` = the group); returns the ``kv_split`` of every dK/dV launch."""
    if split:
        monkeypatch.setattr(T, "sm_count", lambda device: 10_000)
    splits = []
    real = T.run_dkdv

    def run_dkdv(*a, kv_split=1, **kw):
        splits.append(kv_split)
        return real(*a, kv_split=kv_split, **kw)

    real_gluon = T.gluon_dkdv

    def gluon_dkdv(*a, kv_split=1, **kw):  # the prepared Gluon launch: record per call
        run = real_gluon(*a, kv_split=kv_split, **kw)

        def call(*args, **kwargs):
            splits.append(kv_split)
            return run(*args, **kwargs)
        return call

    monkeypatch.setattr(T, "run_dkdv", run_dkdv)
    monkeypatch.setattr(T, "gluon_dkdv", gluon_dkdv)
    return splits


@pytest.mark.parametrize("split", [False, True])
def test_triton_staged_split_accumulation(split, monkeypatch):
    """The split backward (tl dK/dV and dQ kernels, the interpreter's dispatch): one pre-pass
    per layer, each stage's dQ summed, no scaling pass; with each GQA group split over one
    program per query head (the few-programs case: the kernel's KV_SPLIT, partials summed by
    one more launch) the same gradients."""
    T = _triton()
    from flashmask3.kernels import tl_kernels as TL

    splits = _force_kv_split(monkeypatch, T, split)
    prepass = _count_calls(monkeypatch, TL, "backward_prepass")
    scaling = _count_calls(monkeypatch, TL, "scale_dq")
    sums = _count_calls(monkeypatch, TL, "sum_kv_split")
    q, k, v, cols = _inputs(torch.float32, seed=7)
    assert T.dispatch.choose(q.device, q.dtype, 16, False, 2).backward_mode == "split"
    _check_triton_staged(T, q, k, v, cols, 1 / math.sqrt(16))
    assert len(prepass) == 1 and not scaling
    assert splits == [2 if split else 1] * _nonempty_stages()
    assert len(sums) == (_nonempty_stages() if split else 0)


@pytest.mark.parametrize("split", [False, True])
def test_triton_staged_fused_accumulation(split, monkeypatch):
    """The fused backward's accumulation: one fp32 dQᵀ buffer for the layer, zeroed by the
    pre-pass (no memset of its own; the buffer starts as NaNs here, so a missed zeroing fails),
    every stage's kernel adds its unscaled dQ into it, one scaling pass at the end (the real
    ``scale_dq``)."""
    T = _triton()
    from flashmask3.kernels import dispatch
    from flashmask3.kernels import tl_kernels as TL
    from flashmask3.kernels.tiles import Config

    tile = Config(64, 64, 4, 2)
    fused = dispatch.Launch("fused", "gluon_fused", tile, "test")
    real_choose = dispatch.choose

    def choose(*a, **kw):
        c = real_choose(*a, **kw)
        return dispatch.Choice(c.forward, (fused,))

    kernel_calls, buffers = [], []

    def fake_fused_kernel(q, k, v, dout, lse2, delta, causal, softmax_scale, plan, *tile_args,
                          dq_t=None, fuse_dq=False, kv_split=1, **variant):
        """The FUSE_DQ kernel's contract in float64: dK, dV; unscaled dQ added into dq_t."""
        assert fuse_dq and dq_t is not None and tile_args == (64, 64, 4, 2)
        kernel_calls.append(kv_split)
        buffers.append(dq_t)
        q64, k64, v64, do64 = (x.double() for x in (q, k, v, dout))
        g = q.shape[2] // k.shape[2]
        kk, vv = k64.repeat_interleave(g, 2), v64.repeat_interleave(g, 2)
        allowed = to_dense(plan_cols[0], False, q.shape[1], k.shape[1]).repeat_interleave(
            q.shape[2] // plan_cols[0].shape[1], 1)
        s = torch.einsum("bqhd,bkhd->bhqk", q64, kk) * softmax_scale * math.log2(math.e)
        p = torch.exp2(s - lse2.double().unsqueeze(-1)).masked_fill(~allowed, 0.0)
        dp = torch.einsum("bqhd,bkhd->bhqk", do64, vv)
        ds = p * (dp - delta.double().unsqueeze(-1))
        dq_unscaled = torch.einsum("bhqk,bkhd->bqhd", ds, kk)
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q64) * softmax_scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do64)
        b, hk = k.shape[0], k.shape[2]
        dk = dk.view(b, -1, hk, g, dk.shape[-1]).sum(3)
        dv = dv.view(b, -1, hk, g, dv.shape[-1]).sum(3)
        T.dq_accumulator_view(dq_t, q.shape[1]).add_(dq_unscaled.float())
        return dk.to(k.dtype), dv.to(v.dtype), None

    plan_cols = []  # the stage's mask columns (the stand-in gets the kernel's plan, not them)
    real_stage = T.backward_stage

    def stage(state, q, k, v, cols, causal, scale):
        plan_cols[:] = [cols]
        return real_stage(state, q, k, v, cols, causal, scale)

    monkeypatch.setattr(dispatch, "choose", choose)
    def fake_gluon_dkdv(launch, q, k, plan, causal, scale, kv_split=1):
        """The prepared Gluon dK/dV launch (``T.gluon_dkdv``) around the stand-in kernel."""
        def run(q, k, v, dout, lse2, delta, plan, dq_t=None):
            return fake_fused_kernel(q, k, v, dout, lse2, delta, causal, scale, plan,
                                     *T._tile_args(launch.tile), dq_t=dq_t,
                                     fuse_dq=launch.kernel == "gluon_fused",
                                     kv_split=kv_split)[:2]
        return run

    monkeypatch.setattr(T, "gluon_dkdv", fake_gluon_dkdv)
    monkeypatch.setattr(T, "backward_stage", stage)
    prepass = _count_calls(monkeypatch, TL, "backward_prepass")
    scaling = _count_calls(monkeypatch, TL, "scale_dq")
    memsets = _count_calls(monkeypatch, T, "new_dq_accumulator")
    real_accumulator = TL.dq_accumulator
    monkeypatch.setattr(TL, "dq_accumulator", lambda *a: real_accumulator(*a).fill_(float("nan")))
    _force_kv_split(monkeypatch, T, split)
    q, k, v, cols = _inputs(torch.float32, seed=9)
    _check_triton_staged(T, q, k, v, cols, 1 / math.sqrt(16))
    assert kernel_calls == [2 if split else 1] * _nonempty_stages()
    assert len(prepass) == 1 and len(scaling) == 1 and not memsets
    assert all(b is buffers[0] for b in buffers)


def test_triton_backward_with_kv_groups_split_matches_the_reference(monkeypatch):
    """The whole backward (interpreter), GQA 4:1 with each group split over one program per
    query head and the fp32 partials summed, against the float64 reference."""
    T = _triton()
    from flashmask3.kernels import tl_kernels as TL

    splits = _force_kv_split(monkeypatch, T, True)
    sums = _count_calls(monkeypatch, TL, "sum_kv_split")
    q, k, v, cols = _inputs(torch.float32, hq=4, hk=1, seed=13)
    scale = 1 / math.sqrt(16)
    out, lse = T.forward(q, k, v, cols, False, scale)
    dout, dlse = _dout_dlse(out, lse, seed=6)
    got = T.backward(dout, dlse, q, k, v, out, lse, cols, False, scale)
    _, _, ref = _reference_grads(q, k, v, cols, scale, dout, dlse)
    errs = {n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
    assert splits == [4] and len(sums) == 1 and all(e <= 2e-4 for e in errs.values()), errs
    assert got[1].shape == k.shape and got[2].shape == v.shape


@pytest.mark.parametrize("kv_split", [1, 2, 3, 6])
def test_tl_dkdv_kv_split_matches_the_reference(kv_split):
    """The tl dK/dV kernel (interpreter) at every divisor of a 12:2 group, float32, causal
    document-like columns: dK, dV against the float64 reference; a non-divisor is refused."""
    T = _triton()
    from flashmask3.kernels import tiles
    from flashmask3.kernels import tl_kernels as TL
    from flashmask3.kernels.tiles import Config

    q, k, v, _ = _inputs(torch.float32, sq=70, sk=90, hq=12, hk=2, seed=21)
    cols = random_columns(1, 1, 70, 90, True, 1, seed=21)  # causal, one column
    scale = 0.25
    out, lse = T.forward(q, k, v, cols, True, scale)
    dout, _ = _dout_dlse(out, lse, seed=22)
    delta, lse2 = TL.backward_prepass(out, dout, lse, None)
    cfg = Config(32, 32, 4, 1)
    plan = tiles.make_plan(cols, True, 70, 90, cfg.block_m, cfg.block_n, True, q.device)
    dk, dv = TL.launch_dkdv(q, k, v, dout, lse2, delta, True, scale, cfg, plan, kv_split)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, _ = reference_attention(q64, k64, v64, cols, True, scale)
    _, rdk, rdv = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
    assert dk.shape == k.shape and dv.shape == v.shape and dk.dtype == k.dtype
    assert rel_err(dk, rdk) <= 2e-5 and rel_err(dv, rdv) <= 2e-5, (rel_err(dk, rdk), rel_err(dv, rdv))
    with pytest.raises(ValueError, match="kv_split"):
        TL.launch_dkdv(q, k, v, dout, lse2, delta, True, scale, cfg, plan, 4)  # 4 of 6


def test_sum_kv_split_sums_each_heads_parts_in_fp32():
    """The partials' sum (interpreter): per KV head, its parts summed in fp32, rounded once to
    k's dtype; dK from the first half of the buffer, dV from the second."""
    T = _triton()
    from flashmask3.kernels import tl_kernels as TL

    k = torch.randn(2, 5, 3, 16).to(torch.bfloat16)
    part = TL.kv_split_partials(k, 4)
    assert part.shape == (2, 2, 5, 12, 16) and part.dtype == torch.float32
    # multiples of 1/8 below 64: every sum exact in fp32, then one rounding to bf16 (within
    # one bf16 ulp, 2^-7 relative: the interpreter truncates where the GPU rounds to nearest)
    part.copy_(torch.randint(-512, 512, part.shape) / 8)
    dk, dv = TL.sum_kv_split(part, k)
    exact = part.double().view(2, 2, 5, 3, 4, 16).sum(4)
    assert dk.dtype == dv.dtype == torch.bfloat16 and dk.is_contiguous() and dv.is_contiguous()
    for got, ref in ((dk, exact[0]), (dv, exact[1])):
        torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=0)
    assert dk.untyped_storage().data_ptr() != dv.untyped_storage().data_ptr()  # custom-op outputs


def test_kv_groups_split_only_when_the_grouped_grid_leaves_the_sms_idle(monkeypatch):
    """The rule: GQA, a CUDA device, and the split grid needing fewer waves (one program per SM,
    132 SMs here); the split is the whole group."""
    from flashmask3.kernels import dispatch, triton_backend as T
    from flashmask3.kernels.tiles import Config

    monkeypatch.setattr(T, "sm_count", lambda device: None if device.type == "cpu" else 132)
    launch = dispatch.Launch("fused", "gluon_fused", Config(64, 128, 8, 2), "test")
    cuda = torch.device("cuda", 0)
    # (grouped: programs = key blocks x KV heads, one wave of 8 heads each while <= 132;
    # split: 8x the programs of one head each)
    assert T.splits_kv_groups(launch, 1, 32, 4, 1024, cuda)  # 32 programs: 8 -> 2 waves
    assert T.splits_kv_groups(launch, 1, 32, 4, 2048, cuda)  # 64 programs: 8 -> 4 waves
    assert not T.splits_kv_groups(launch, 1, 32, 4, 4096, cuda)  # 128 programs: 8 -> 8 waves
    assert not T.splits_kv_groups(launch, 2, 32, 4, 2048, cuda)  # 128 programs (batch 2)
    assert not T.splits_kv_groups(launch, 1, 32, 32, 1024, cuda)  # MHA
    assert not T.splits_kv_groups(launch, 1, 32, 4, 1024, torch.device("cpu"))
    assert T.kv_split_of(launch, 1, 32, 4, 1024, cuda) == 8
    assert T.kv_split_of(launch, 1, 32, 4, 4096, cuda) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["rule", "grouped"])
@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_staged_backward_is_one_backward(mode, d, grouped, monkeypatch):
    """On the GPU, the library's dispatch (fused Gluon backward at D=64/128 on Hopper, or split):
    four stages of a non-block-multiple key set (an empty one among them) against the float64
    reference and against one ``backward`` over all keys, bf16, GQA 4:2, a gradient of the LSE.
    ``rule``: the calls split each group over 2 programs, as the H200's SM count makes the
    rule do at these few key blocks; ``grouped``: no SM count, never split."""
    T = _triton()
    from flashmask3.kernels import dispatch

    splits = _force_kv_split(monkeypatch, T, False)
    if grouped:
        monkeypatch.setattr(T, "sm_count", lambda device: None)

    b, sq, sk, hq, hk = 1, 1000, 1100, 4, 2
    g = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
               for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    cols = random_columns(b, hk, sq, sk, False, 2, seed=d, device="cuda")
    scale = d ** -0.5
    bounds = (0, 300, 300, 777, sk)
    with dispatch.use_backward(mode):
        out, lse = T.forward(q, k, v, cols, False, scale)
        dout = torch.randn(out.shape, generator=g, device="cuda", dtype=out.dtype)
        dlse = torch.randn(lse.shape, generator=g, device="cuda").masked_fill(torch.isinf(lse), 0)
        whole = T.backward(dout, dlse, q, k, v, out, lse, cols, False, scale)
        state = T.backward_prepare(q, out, dout, lse, dlse)
        parts = [T.backward_stage(state, q, k[:, a:z], v[:, a:z], cols[:, :, a:z].contiguous(),
                                  False, scale) for a, z in zip(bounds[:-1], bounds[1:])]
        got = (T.backward_finish(state), torch.cat([p[0] for p in parts], 1),
               torch.cat([p[1] for p in parts], 1))
    _, _, ref = _reference_grads(q.cpu(), k.cpu(), v.cpu(), cols.cpu(), scale, dout.cpu(), dlse.cpu())
    assert splits == [1 if grouped else 2] * 4, splits  # whole + three stages with keys
    for name, x, w, r in zip(("dq", "dk", "dv"), got, whole, ref):
        assert x.dtype == torch.bfloat16 and torch.isfinite(x).all(), name
        assert rel_err(x.cpu(), r) < 2e-2, (name, rel_err(x.cpu(), r))
        assert rel_err(x, w) < 2e-2, (name, rel_err(x, w))
