"""The public function: argument checking, backend selection, torch.library / torch.compile."""

import pytest
import torch

import flashmask3
import flashmask3.masks as M
from flashmask3.kernels import resolve_backend, triton_available
from flashmask3.api import kernel_row_span
from flashmask3.graphs import capture
from tests.kernels.attention_checks import make_qkv
from tests.reference import reference_attention, rel_err


# The Triton kernels are defined now, under the interpreter on CPU (conftest), before any test
# here sets TRITON_INTERPRET=0.
HAS_TRITON = triton_available()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton installed")


def qkv(b=1, s=16, hq=4, hk=2, d=16, dtype=torch.float32):
    return [t.detach() for t in make_qkv(b, s, s, hq, hk, d, dtype)]


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda q, k, v: ([1.0], k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q.int(), k, v), TypeError, "q must be float16"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q, k[:, :8], v), ValueError, "k and v must agree"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head_dim"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple of the 2 key/value heads"),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, "batch size"),
        (lambda q, k, v: (q[:, :0], k, v), ValueError, "empty"),
    ],
)
def test_bad_qkv(change, exc, match):
    q, k, v = change(*qkv())
    with pytest.raises(exc, match=match):
        flashmask3.flashmask_attention(q, k, v)


def test_bad_mask_arguments():
    q, k, v = qkv()
    good = M.causal_document_mask([6, 10]).startend_row_indices
    with pytest.raises(TypeError, match="int32"):
        flashmask3.flashmask_attention(q, k, v, good.long(), causal=True)
    with pytest.raises(ValueError, match="C=1"):
        flashmask3.flashmask_attention(q, k, v, good, causal=False)
    with pytest.raises(ValueError, match="values must lie"):
        flashmask3.flashmask_attention(q, k, v, good + 1, causal=True)
    with pytest.raises(ValueError, match="mask heads"):
        flashmask3.flashmask_attention(q, k, v, good.expand(1, 3, 16, 1).contiguous(), causal=True)
    with pytest.raises(ValueError, match="not both"):
        flashmask3.flashmask_attention(q, k, v, good, causal=True, window_size=3)
    with pytest.raises(TypeError, match="window_size"):
        flashmask3.flashmask_attention(q, k, v, window_size="3")
    with pytest.raises(ValueError, match="window_size entries"):
        flashmask3.flashmask_attention(q, k, v, window_size=(-2, 1))
    for bad_scale in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale"):
            flashmask3.flashmask_attention(q, k, v, softmax_scale=bad_scale)
    with pytest.raises(TypeError, match="softmax_scale"):
        flashmask3.flashmask_attention(q, k, v, softmax_scale="0.1")
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashmask3.flashmask_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="conflicts"):
        flashmask3.flashmask_attention(q, k, v, M.document_mask([6, 10]), causal=True)
    with pytest.raises(ValueError, match="seqlen_q=12"):
        flashmask3.flashmask_attention(q, k, v, M.causal_document_mask([6, 6]))
    with pytest.raises(ValueError, match=r"q is \[batch, seqlen, heads, head_dim\]"):  # [B, H, S, D] given
        flashmask3.flashmask_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       M.causal_document_mask([6, 10]))
    with pytest.raises(TypeError, match="int32"):
        M.FlashMask(good.float(), True)


def test_mask_object_brings_its_causal_flag():
    q, k, v = qkv()
    m = M.causal_document_mask([6, 10])
    a = flashmask3.flashmask_attention(q, k, v, m)
    b = flashmask3.flashmask_attention(q, k, v, m.startend_row_indices, causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    assert resolve_backend(cpu) == "torch"
    monkeypatch.setenv("FLASHMASK3_BACKEND", "auto")
    assert resolve_backend(cpu) == "torch"
    monkeypatch.setenv("FLASHMASK3_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="FLASHMASK3_BACKEND must be one of"):
        resolve_backend(cpu)
    monkeypatch.setenv("FLASHMASK3_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises((ValueError, RuntimeError), match="triton"):
        resolve_backend(cpu)


def test_custom_op_passes_opcheck(monkeypatch):
    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    q, k, v = make_qkv(1, 20, 20, 2, 1, 8, torch.float32)
    cols = M.causal_document_mask([7, 13]).startend_row_indices
    op = torch.ops.flashmask3.attention_forward.default
    for mask in (cols, None):
        torch.library.opcheck(op, (q, k, v, mask, True, 0.35, "torch"))


def test_the_mask_row_span_reaches_the_backend(monkeypatch):
    """A FlashMask's mean row span (the forward's tile hint) reaches the backend's forward, in
    eager mode and under torch.compile; a raw column tensor passes none."""
    from flashmask3.kernels import torch_path

    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    seen = []
    real = torch_path.forward

    def spy(*args, row_span=None):
        seen.append(row_span)
        return real(*args, row_span=row_span)

    monkeypatch.setattr(torch_path, "forward", spy)
    q, k, v = qkv()
    m = M.causal_document_mask([6, 10])
    flashmask3.flashmask_attention(q, k, v, m)
    flashmask3.flashmask_attention(q, k, v, m.startend_row_indices, causal=True)
    torch._dynamo.reset()
    torch.compile(lambda q, k, v: flashmask3.flashmask_attention(q, k, v, m), backend="aot_eager",
                  fullgraph=True)(q, k, v)
    edge = kernel_row_span(m)  # (the span's half octave, as the op sees it)
    assert seen == [edge, None, edge]
    assert m.mean_row_span == (6 * 7 + 10 * 11) / 2 / 16 and edge <= m.mean_row_span < 2 ** 0.5 * edge




def test_torch_compile_without_graph_breaks(monkeypatch):
    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    mask = M.causal_document_mask([9, 15], num_heads=2)

    def layer(q, k, v):
        out, lse = flashmask3.flashmask_attention(q, k, v, mask, return_softmax_lse=True)
        return (out * 2).sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    q, k, v = make_qkv(1, 24, 24, 4, 2, 16, torch.float32, seed=2)
    loss_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    out, lse = reference_attention(q, k, v, mask.startend_row_indices, True)
    grads_r = torch.autograd.grad((out * 2).sum() + lse.sum(), (q, k, v))
    assert rel_err(loss_c, (out * 2).sum() + lse.sum()) < 1e-5
    for g, r in zip(grads_c, grads_r):
        assert rel_err(g, r) < 1e-4


# -- no host reads of the mask: devices, out-of-range values, compile, CUDA graphs --------------


def test_a_mask_on_another_device_is_a_value_error():
    q, k, v = qkv()
    cols = M.causal_document_mask([6, 10]).startend_row_indices
    with pytest.raises(ValueError, match="startend_row_indices is on meta but must be on cpu"):
        flashmask3.flashmask_attention(q, k, v, cols.to("meta"), causal=True)
    with pytest.raises(ValueError, match="is on meta"):
        flashmask3.flashmask_attention(q, k, v, M.FlashMask(cols.to("meta"), True))


def test_cuda_columns_are_read_only_on_request(monkeypatch):
    """The values of non-CPU column tensors are not read (that would sync the device) unless
    FLASHMASK3_CHECK_MASK_VALUES=1; CPU tensors always are; tracing never reads them."""
    from flashmask3.api import reads_column_values

    cpu = torch.zeros(1, 1, 4, 1, dtype=torch.int32)
    meta = cpu.to("meta")
    monkeypatch.delenv("FLASHMASK3_CHECK_MASK_VALUES", raising=False)
    assert reads_column_values(cpu) and not reads_column_values(meta)
    monkeypatch.setenv("FLASHMASK3_CHECK_MASK_VALUES", "1")
    assert reads_column_values(meta)


def _out_of_range(cols: torch.Tensor, seqlen_q: int, seed: int) -> torch.Tensor:
    """``cols`` with a third of its entries pushed outside [0, Sq] (including int32's ends),
    keeping the meaning the clamp gives: below 0 where the entry was 0, above Sq where Sq."""
    g = torch.Generator().manual_seed(seed)
    low = torch.tensor([-1, -7, -2**31], dtype=torch.int32)[torch.randint(0, 3, cols.shape, generator=g)]
    high = torch.tensor([1, 9, 2**31 - 1 - seqlen_q], dtype=torch.int32)[
        torch.randint(0, 3, cols.shape, generator=g)] + seqlen_q
    pick = torch.rand(cols.shape, generator=g) < 0.7
    out = torch.where((cols == 0) & pick, low, cols)
    return torch.where((cols == seqlen_q) & pick, high, out)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("causal,c", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_out_of_range_values_act_as_clamped(backend, causal, c, monkeypatch):
    """Unchecked columns (as on a GPU) with values outside [0, Sq] give exactly the result of
    the columns clamped to [0, Sq], forward and backward, in the torch path and the Triton
    kernels (interpreter on CPU)."""
    from flashmask3.kernels import get_backend

    monkeypatch.setenv("FLASHMASK3_BACKEND", backend)
    sq = 48
    g = torch.Generator().manual_seed(c + 10 * causal)
    cols = torch.randint(0, sq + 1, (2, 1, sq, c), generator=g, dtype=torch.int32)
    cols = torch.sort(cols, dim=-1).values if c == 4 else cols
    cols[:, :, :5] = torch.tensor([0, sq, 0, sq][:c], dtype=torch.int32)  # ends of the range
    cols[:, :, 5:9] = torch.tensor([sq, 0, sq, 0][:c], dtype=torch.int32)
    wild = _out_of_range(cols, sq, seed=c)
    assert (wild < 0).any() and (wild > sq).any() and torch.equal(wild.clamp(0, sq), cols)
    q, k, v = make_qkv(2, sq, sq, 2, 1, 16, torch.float32, seed=c)
    op = torch.ops.flashmask3.attention_forward
    scale = 0.25
    out, lse = op(q, k, v, wild, causal, scale, backend)
    ref_out, ref_lse = reference_attention(q, k, v, cols, causal, scale)
    assert rel_err(out, ref_out) < 2e-4
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * dout.double()).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 2e-4
    # and bit for bit what the clamped columns give through the same backend
    same = get_backend(backend).forward(q.detach(), k.detach(), v.detach(), cols, causal, scale)
    torch.testing.assert_close(out, same[0], rtol=0, atol=0)


def _graph_count():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _masks_of_one_shape(seqlen: int):
    """Causal document masks of one shape whose mean row spans lie in different half octaves
    (each a would-be recompile if the span were a guarded Python number)."""
    masks = [M.causal_document_mask(lens) for lens in
             ([seqlen], [seqlen // 2] * 2, [seqlen // 4] * 4, [seqlen // 8] * 8)]
    assert len({m.row_span_bucket for m in masks}) == len(masks)
    return masks


def test_the_tile_hint_reaches_the_backend_under_inductor_without_a_cpu_tensor_input(monkeypatch):
    """Under torch.compile (inductor), the backend's forward gets each FlashMask's row-span hint
    (one graph for masks of four half octaves), raw columns none; the op takes no CPU tensor
    (inductor's CUDA graphs fail on one: the hint is an attribute of the columns tensor, which
    a copy does not carry)."""
    from torch._dynamo.utils import counters

    from flashmask3.kernels import torch_path
    from flashmask3.masks.mask import row_span_of_columns

    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    schema = torch.ops.flashmask3.attention_forward.default._schema
    assert [a.name for a in schema.arguments if "Tensor" in str(a.type)] == ["q", "k", "v", "startend_row_indices"]
    seen = []
    forward = torch_path.forward
    monkeypatch.setattr(torch_path, "forward", lambda *a, row_span=None, **kw: (seen.append(row_span), forward(*a, row_span=row_span, **kw))[1])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v, m, causal=False: flashmask3.flashmask_attention(q, k, v, m, causal=causal),
                             fullgraph=True)
    seqlen = 64
    q, k, v = make_qkv(1, seqlen, seqlen, 2, 1, 16, torch.float32, seed=4)
    masks = _masks_of_one_shape(seqlen)
    for mask in masks:
        torch.testing.assert_close(compiled(q, k, v, mask), reference_attention(q, k, v, mask.startend_row_indices, True)[0].float(),
                                   rtol=1e-4, atol=1e-4)
    compiled(q, k, v, masks[0].startend_row_indices.clone(), True)
    assert seen == [kernel_row_span(m) for m in masks] + [None] and len(set(seen)) == 5
    assert _graph_count() == 2
    cols = masks[0].startend_row_indices
    assert row_span_of_columns(cols) == kernel_row_span(masks[0]) and row_span_of_columns(cols.clone()) is None


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_torch_compile_one_graph_for_every_mask_of_a_shape(backend, monkeypatch):
    """torch.compile(fullgraph=True) builds one graph for FlashMasks of one shape with spans in
    four half octaves, and one for raw columns of one shape; forward and backward match the
    reference (the Triton backend under its interpreter on CPU)."""
    from torch._dynamo.utils import counters

    from flashmask3 import kernels

    monkeypatch.setenv("FLASHMASK3_BACKEND", backend)
    # the backend's availability decided for the first time under tracing
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_IMPORT_ERROR", {})
    torch._dynamo.reset()
    counters.clear()

    def loss(q, k, v, m, causal=False):
        out, lse = flashmask3.flashmask_attention(q, k, v, m, causal=causal, return_softmax_lse=True)
        return (out * out.detach().sin()).sum() + lse.sum(), out

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    seqlen = 64
    q, k, v = make_qkv(1, seqlen, seqlen, 2, 1, 16, torch.float32, seed=4)
    for i, mask in enumerate(_masks_of_one_shape(seqlen)):
        for m, causal in ((mask, False), (mask.startend_row_indices.clone(), True)):
            got, out = compiled(q, k, v, m, causal)
            grads = torch.autograd.grad(got, (q, k, v))
            ref_out, ref_lse = reference_attention(q, k, v, mask.startend_row_indices, True)
            want = (ref_out * out.detach().sin().double()).sum() + ref_lse.sum()
            ref_grads = torch.autograd.grad(want, (q, k, v))
            assert rel_err(out, ref_out) < 2e-4, (i, type(m))
            for g, r in zip(grads, ref_grads):
                assert rel_err(g, r) < 2e-4, (i, type(m))
    assert _graph_count() == 2  # one for FlashMask, one for raw columns
    assert counters["stats"]["calls_captured"] > 0


# -- GPU: no syncs, CUDA graphs, compile (gpu-marked: run by benchmarks/gpu/host-path.sh) ----


def _gpu_case(seqlen=2048, heads=4, d=128, dtype=torch.bfloat16, seed=0):
    q, k, v = make_qkv(1, seqlen, seqlen, heads, heads, d, dtype, device="cuda", seed=seed)
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flashmask", "columns"])
def test_gpu_no_device_sync_per_call(kind):
    """Forward and backward of every mask form run under sync-debug mode "error": no call
    reads anything back from the device (raw columns included: their values are not read)."""
    q, k, v = _gpu_case()
    mask = M.causal_document_mask([512, 1024, 512], device="cuda")
    args = {"flashmask": dict(startend_row_indices=mask),
            "columns": dict(startend_row_indices=mask.startend_row_indices, causal=True)}[kind]
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    for _ in range(2):  # the first call compiles the kernels (which may sync): warm up first
        out = flashmask3.flashmask_attention(q, k, v, **args)
        torch.autograd.backward(out, dout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out, lse = flashmask3.flashmask_attention(q, k, v, **args, return_softmax_lse=True)
            torch.autograd.backward((out, lse), (dout, torch.zeros_like(lse)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(q.grad).all()


@pytest.mark.gpu
def test_gpu_out_of_range_columns_are_clamped_or_rejected_on_request(monkeypatch):
    """CUDA columns are not checked by default (values outside [0, Sq] act as clamped);
    FLASHMASK3_CHECK_MASK_VALUES=1 checks them (one sync) and raises."""
    q, k, v = _gpu_case(seqlen=1024, heads=2)
    cols = M.causal_document_mask([300, 724], device="cuda").startend_row_indices
    wild = _out_of_range(cols.cpu(), 1024, seed=1).cuda()
    got = flashmask3.flashmask_attention(q, k, v, wild, causal=True)
    want = flashmask3.flashmask_attention(q, k, v, cols, causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    monkeypatch.setenv("FLASHMASK3_CHECK_MASK_VALUES", "1")
    with pytest.raises(ValueError, match="values must lie"):
        flashmask3.flashmask_attention(q, k, v, wild, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("raw", [False, True])
def test_gpu_cuda_graph_replays_forward_and_backward_with_a_new_mask(raw):
    """Forward + backward captured once in a CUDA graph, replayed with new q/k/v/dout and a new
    mask of the same shape (copied into the captured buffers), equal the eager result."""
    seqlen, heads, d = 2048, 4, 128
    q, k, v = (t.detach() for t in _gpu_case(seqlen, heads, d))
    first = M.causal_document_mask([1024, 1024], device="cuda")
    cols = first.startend_row_indices.clone()
    mask = cols if raw else M.FlashMask(cols, True, mean_row_span=first.mean_row_span)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def step():
        out = flashmask3.flashmask_attention(qs, ks, vs, mask, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout)
        return out, dq, dk, dv

    graph, captured = capture(step)
    for seed, lens in ((1, [512, 1536]), (2, [256] * 8)):
        new = M.causal_document_mask(lens, device="cuda")
        nq, nk, nv = (t.detach() for t in _gpu_case(seqlen, heads, d, seed=seed))
        nd = torch.randn_like(nq)
        for dst, src in ((qs, nq), (ks, nk), (vs, nv), (dout, nd), (cols, new.startend_row_indices)):
            with torch.no_grad():
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eq, ek, ev = (t.clone().requires_grad_() for t in (nq, nk, nv))
        eout = flashmask3.flashmask_attention(eq, ek, ev, new.startend_row_indices, causal=True)
        egrads = torch.autograd.grad(eout, (eq, ek, ev), nd)
        ref_out = reference_attention(nq, nk, nv, new.startend_row_indices, True)[0]
        assert rel_err(captured[0], ref_out) < 2e-2
        for got, want in zip(captured, (eout, *egrads)):  # (the fused dQ is not bitwise)
            assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
def test_gpu_make_graphed_callables_with_the_mask_as_an_input():
    """torch.cuda.make_graphed_callables of a function calling flashmask_attention, the mask's
    columns one of its inputs: called with new q/k/v and a new mask of the same shape, its
    output and gradients equal the eager call's (the graphs plan the new columns)."""
    seqlen, heads, d = 2048, 4, 128

    def attend(q, k, v, cols):
        return flashmask3.flashmask_attention(q, k, v, cols, causal=True)

    sample = [t.detach().requires_grad_() for t in _gpu_case(seqlen, heads, d)]
    cols = M.causal_document_mask([1024, 1024], device="cuda").startend_row_indices
    graphed = torch.cuda.make_graphed_callables(attend, (*sample, cols.clone()))
    for seed, lens in ((1, [512, 1536]), (2, [256] * 8)):
        new = M.causal_document_mask(lens, device="cuda").startend_row_indices
        q, k, v = (t.detach() for t in _gpu_case(seqlen, heads, d, seed=seed))
        dout = torch.randn_like(q)
        got_in = [t.clone().requires_grad_() for t in (q, k, v)]
        got = graphed(*got_in, new)
        got_grads = torch.autograd.grad(got, got_in, dout)
        want_in = [t.clone().requires_grad_() for t in (q, k, v)]
        want = attend(*want_in, new)
        want_grads = torch.autograd.grad(want, want_in, dout)
        assert rel_err(got, want) < 1e-2
        for g, w in zip(got_grads, want_grads):  # (the fused dQ is not bitwise)
            assert rel_err(g, w) < 1e-2
        stale = attend(*[t.detach() for t in want_in], cols)  # the sample's mask: another result
        assert rel_err(got, stale) > 1e-1


@pytest.mark.gpu
def test_gpu_torch_compile_one_graph_for_every_mask_of_a_shape():
    """torch.compile(fullgraph=True) (inductor) on CUDA: FlashMasks and raw columns of one shape
    with spans in four half octaves build one graph each; forward and backward match eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def loss(q, k, v, m, causal=False):
        out = flashmask3.flashmask_attention(q, k, v, m, causal=causal)
        return (out.float() ** 2).sum(), out

    compiled = torch.compile(loss, fullgraph=True)
    seqlen = 4096
    q, k, v = make_qkv(1, seqlen, seqlen, 4, 4, 128, torch.bfloat16, device="cuda", seed=5)
    for mask in _masks_of_one_shape(seqlen):
        mask = mask.to("cuda")
        for m, causal in ((mask, False), (mask.startend_row_indices.clone(), True)):
            got, out = compiled(q, k, v, m, causal)
            grads = torch.autograd.grad(got, (q, k, v))
            want, eout = loss(q, k, v, m, causal)
            egrads = torch.autograd.grad(want, (q, k, v))
            assert rel_err(out, eout) < 1e-2
            for g, r in zip(grads, egrads):
                assert rel_err(g, r) < 2e-2
    assert _graph_count() == 2


@pytest.mark.gpu
def test_gpu_torch_compile_reduce_overhead_replays_with_new_masks():
    """torch.compile(mode="reduce-overhead") (inductor's CUDA graphs) of forward + backward:
    the graphs are recorded (no cudagraph skip) and replays with new q, k, v and a new mask of
    the same shape, FlashMask and raw columns, give the eager result."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def step(q, k, v, m, dout, causal=False):
        out = flashmask3.flashmask_attention(q, k, v, m, causal=causal)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    compiled = torch.compile(step, mode="reduce-overhead")
    seqlen, heads, d = 2048, 4, 128
    for raw in (False, True):
        for i, lens in enumerate(([1024, 1024], [512, 1536], [256] * 8, [2048])):
            fm = M.causal_document_mask(lens, device="cuda")
            m, causal = (fm.startend_row_indices.clone(), True) if raw else (fm, False)
            q, k, v = (t.detach().requires_grad_() for t in _gpu_case(seqlen, heads, d, seed=10 * raw + i))
            dout = torch.randn_like(q)
            got = [t.clone() for t in compiled(q, k, v, m, dout, causal)]
            want = step(q, k, v, m, dout, causal)
            ref = reference_attention(q.detach(), k.detach(), v.detach(), fm.startend_row_indices, True)[0]
            assert rel_err(got[0], ref) < 2e-2, f"raw={raw} lens={lens}"
            for g, w in zip(got, want):  # (the fused dQ is not bitwise)
                assert rel_err(g, w) < 1e-2, f"raw={raw} lens={lens}"
    skips = counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"inductor skipped its CUDA graphs {skips} times"


# -- the Triton version gate of the Gluon kernels ---------------------------------------------


@pytest.fixture
def hopper_dispatch(monkeypatch):
    """The dispatch as on an H200 (compute capability 9.0, compiled kernels), without a GPU;
    its decision cache cleared before and after."""
    from flashmask3.kernels import dispatch

    monkeypatch.setattr(dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    dispatch.decide.cache_clear()
    flashmask3.api.clear_prepared()  # (the hardware is not part of a call's signature)
    yield dispatch
    dispatch.decide.cache_clear()
    flashmask3.api.clear_prepared()


@needs_triton
@pytest.mark.parametrize("checked", [True, False])
def test_gluon_kernels_run_only_on_checked_triton_versions(checked, hopper_dispatch, monkeypatch):
    """On a Triton version outside GLUON_CHECKED_TRITON every pass of a Hopper bf16 call takes
    its tl row (and the split backward: the fused one is Gluon only), at every head dim; on a
    checked one the table's Gluon rows stand (where Gluon itself imports)."""
    dispatch = hopper_dispatch
    monkeypatch.setattr(dispatch, "GLUON_CHECKED_HERE", checked)
    if checked and not dispatch.gluon_usable():
        pytest.skip("needs triton.experimental.gluon (Triton >= 3.5) and TMA descriptors to import")
    cuda = torch.device("cuda", 0)
    for d in (64, 128, 256):
        for span in (None, 900.0):
            choice = dispatch.choose(cuda, torch.bfloat16, d, True, 1, span)
            kernels = [x.kernel for x in (choice.forward, *choice.backward)]
            if checked:
                assert any(k.startswith("gluon") for k in kernels), (d, kernels)
            else:
                assert kernels == ["tl"] * 3 and choice.backward_mode == "split", (d, kernels)
    if checked:
        choice = dispatch.choose(cuda, torch.bfloat16, 128, True, 1)
        assert (choice.forward.kernel, choice.backward[0].kernel) == ("gluon_ws", "gluon_fused")


@needs_triton
def test_the_kernel_path_is_announced_once_per_import(monkeypatch, caplog):
    """A checked Triton logs which kernels run; an unchecked one warns (a RuntimeWarning)."""
    import logging

    from flashmask3.kernels import dispatch

    monkeypatch.setattr(dispatch, "GLUON_CHECKED_HERE", False)
    for raw in (True, False):  # the raw C launch's own version guard (launcher.RAW_LAUNCH_TRITON)
        monkeypatch.setattr(dispatch.launcher, "RAW_LAUNCH_HERE", raw)
        with pytest.warns(RuntimeWarning, match="portable tl kernels") as seen:
            dispatch.announce_kernel_path()
        assert (dispatch.THROUGH_TRITON in str(seen[0].message)) == (not raw)
        assert dispatch.TL_PATH_COST in str(seen[0].message)
    monkeypatch.setattr(dispatch, "GLUON_CHECKED_HERE", True)
    with caplog.at_level(logging.INFO, logger="flashmask3"):
        dispatch.announce_kernel_path()
    assert "Gluon kernels (checked on this version)" in caplog.text


@needs_triton
def test_the_unchecked_gluon_switch_needs_its_value_and_an_unchecked_version(monkeypatch):
    """FLASHMASK3_GLUON_UNCHECKED=1 (checking a new Triton on a GPU) turns Gluon on only for a
    version outside GLUON_CHECKED_TRITON, only with the value 1, and warns at import."""
    from flashmask3.kernels import dispatch

    var, checked = dispatch.UNCHECKED_VAR, dispatch.GLUON_CHECKED_TRITON[0]
    assert dispatch.gluon_forced("3.99.0", {var: "1"})
    assert not dispatch.gluon_forced("3.99.0", {}) and not dispatch.gluon_forced("3.99.0", {var: "true"})
    assert not dispatch.gluon_forced(checked, {var: "1"})
    monkeypatch.setattr(dispatch, "GLUON_FORCED", True)
    with pytest.warns(RuntimeWarning, match=f"{var}=1: the Gluon kernels run on Triton"):
        dispatch.announce_kernel_path()


def test_eager_calls_and_the_custom_op_agree(monkeypatch):
    """Eager calls on plain tensors run the autograd.Function (fewer host frames), traced ones
    the custom op; both give the same output and gradients, bit for bit (torch path)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashmask3.api import _traced

    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    q, k, v = make_qkv(1, 40, 40, 2, 1, 16, torch.float32, seed=7)
    mask = M.causal_document_mask([15, 25])
    assert not _traced(q)
    with FakeTensorMode():
        assert _traced(torch.empty(1))
    out = flashmask3.flashmask_attention(q, k, v, mask)
    assert out.grad_fn is not None and "EagerAttention" in type(out.grad_fn).__name__
    op_out, _ = torch.ops.flashmask3.attention_forward(q, k, v, mask.startend_row_indices, True,
                                                       0.25, "torch")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    op_grads = torch.autograd.grad(op_out, (q, k, v), dout)
    torch.testing.assert_close(out, op_out, rtol=0, atol=0)
    for a, b in zip(grads, op_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["no_grad", "inputs_without_grad", "inference_mode"])
def test_calls_without_gradients_skip_the_autograd_node(how, monkeypatch):
    """With nothing to differentiate the call runs the backend's forward alone: no grad_fn,
    the same output and LSE as a differentiable call, bit for bit, and the reference's."""
    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    flashmask3.api.clear_prepared()
    q, k, v = make_qkv(1, 48, 48, 2, 1, 16, torch.float32, seed=17)
    mask = M.causal_document_mask([20, 28])
    want = flashmask3.flashmask_attention(q, k, v, mask, return_softmax_lse=True)
    assert want[0].grad_fn is not None
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how)
    args = (q, k, v) if ctx else (q.detach(), k.detach(), v.detach())
    for _ in range(2):  # the full path, then the prepared one
        with ctx() if ctx else torch.enable_grad():
            got = flashmask3.flashmask_attention(*args, mask, return_softmax_lse=True)
        assert got[0].grad_fn is None and got[1].grad_fn is None
        assert got[1].dtype == torch.float32 and got[0].is_contiguous()
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    ref_out, _ = reference_attention(q, k, v, mask.startend_row_indices, True)
    assert rel_err(got[0], ref_out) < 1e-5


# -- prepared calls: one signature's checks and decisions, made once ------------------------


def _fresh(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("form", ["FlashMask", "raw", "none"])
def test_a_prepared_call_gives_the_full_paths_results(form, monkeypatch):
    """The second call of a signature (a prepared call) gives the first's output, LSE and
    gradients bit for bit, and both match the float64 reference; a gradient through the LSE
    alone (the output unused: autograd passes None for it) matches the reference too."""
    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    flashmask3.api.clear_prepared()
    q0, k0, v0 = make_qkv(1, 40, 40, 2, 1, 16, torch.float32, seed=11)
    mask = M.causal_document_mask([15, 25])
    arg = {"FlashMask": mask, "raw": mask.startend_row_indices, "none": None}[form]
    cols = None if form == "none" else mask.startend_row_indices
    runs = []
    for _ in range(2):
        q, k, v = _fresh(q0, k0, v0)
        out, lse = flashmask3.flashmask_attention(q, k, v, arg, causal=True,
                                                  return_softmax_lse=True)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        (out * dout).sum().backward()
        runs.append((out, lse, q.grad, k.grad, v.grad))
        assert len(flashmask3.api._PREPARED) == 1
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref_out, ref_lse = reference_attention(q0, k0, v0, cols, True)
    assert rel_err(runs[0][0], ref_out) < 1e-5 and rel_err(runs[0][1], ref_lse) < 1e-5
    for _ in range(2):  # the LSE alone
        q, k, v = _fresh(q0, k0, v0)
        _, lse = flashmask3.flashmask_attention(q, k, v, arg, causal=True,
                                                return_softmax_lse=True)
        w = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5))
        (torch.where(torch.isinf(lse), 0, lse) * w).sum().backward()
        qr, kr, vr = _fresh(q0, k0, v0)
        _, ref = reference_attention(qr, kr, vr, cols, True)
        (torch.where(torch.isinf(ref), 0, ref) * w.double()).sum().backward()
        for got, want in ((q.grad, qr.grad), (k.grad, kr.grad)):
            assert rel_err(got, want) < 1e-5
        assert vr.grad is None and torch.count_nonzero(v.grad) == 0  # the LSE ignores v


def test_a_bad_call_never_reuses_a_good_signature(monkeypatch):
    """After good calls of a signature, calls that differ in one checked thing (types with
    equal values such as 1 / True / 1.0, shapes, dtypes, a FlashMask's seqlen_q or causal
    flag, out-of-range CPU column values of the same shape) still get their error, on every
    call."""
    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    flashmask3.api.clear_prepared()
    q, k, v = qkv()
    mask = M.causal_document_mask([6, 10])
    cols = mask.startend_row_indices
    doc = M.document_mask([6, 10])  # (not causal)
    good = [dict(startend_row_indices=cols, causal=True, softmax_scale=1.0),
            dict(startend_row_indices=mask, causal=False, softmax_scale=None),
            dict(startend_row_indices=doc, causal=False, softmax_scale=None)]
    for kw in good:
        for _ in range(2):
            flashmask3.flashmask_attention(q, k, v, **kw)
    assert len(flashmask3.api._PREPARED) == 3
    bad_cols = cols.clone()
    bad_cols[0, 0, 3, 0] = 99  # > Sq: CPU columns are read on every call
    bad = [
        (dict(startend_row_indices=cols, causal=1, softmax_scale=1.0), TypeError, "causal"),
        (dict(startend_row_indices=cols, causal=True, softmax_scale=True), TypeError,
         "softmax_scale"),
        (dict(startend_row_indices=cols, causal=True, softmax_scale=-1.0), ValueError,
         "softmax_scale"),
        (dict(startend_row_indices=cols, causal=True, softmax_scale=[1.0]), TypeError,
         "softmax_scale"),
        (dict(startend_row_indices=bad_cols, causal=True, softmax_scale=1.0), ValueError,
         "startend_row_indices"),
        (dict(startend_row_indices=cols.long(), causal=True, softmax_scale=1.0), TypeError,
         "int32"),
        (dict(startend_row_indices=doc, causal=True, softmax_scale=None), ValueError,
         "conflicts"),
        (dict(startend_row_indices=M.FlashMask(cols, True, 8, None, _validated=True),
              causal=False, softmax_scale=None), ValueError, "seqlen_q"),
    ]
    for kw, exc, match in bad:
        for _ in range(2):
            with pytest.raises(exc, match=match):
                flashmask3.flashmask_attention(q, k, v, **kw)
    for change in (lambda t: t.double(), lambda t: t[:, :8]):
        for _ in range(2):
            with pytest.raises((TypeError, ValueError)):
                flashmask3.flashmask_attention(q, change(k), v, **good[0])


def test_prepared_calls_follow_the_environment(monkeypatch):
    """The environment is part of a signature: after good calls, a bad backend name is a
    ValueError on every call, and switching backends takes effect on the next call."""
    from flashmask3.kernels import torch_path

    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    flashmask3.api.clear_prepared()
    q, k, v = qkv()
    mask = M.causal_document_mask([6, 10])
    for _ in range(2):
        flashmask3.flashmask_attention(q, k, v, mask)
    monkeypatch.setenv("FLASHMASK3_BACKEND", "bogus")
    for _ in range(2):
        with pytest.raises(ValueError, match="FLASHMASK3_BACKEND"):
            flashmask3.flashmask_attention(q, k, v, mask)
    seen = []
    real = torch_path.forward
    monkeypatch.setattr(torch_path, "forward", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    flashmask3.flashmask_attention(q, k, v, mask)
    assert seen == [1]
    if HAS_TRITON:  # the Triton backend under the interpreter (conftest) for CPU tensors
        monkeypatch.setenv("FLASHMASK3_BACKEND", "triton")
        flashmask3.flashmask_attention(q, k, v, mask)
        assert seen == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_prepared_calls_match_the_reference_with_a_dirty_allocator(d):
    """The default Triton path on the GPU (the fused backward at D=64/128 on Hopper, its dQ
    accumulator zeroed by the pre-pass): first call (checks) and later calls (the prepared
    signature) match the float64 reference, with the caching allocator's free blocks filled
    with NaN before each call (an accumulator left unzeroed would show)."""
    flashmask3.api.clear_prepared()
    s, h = 1024, 4
    mask = M.causal_document_mask([300, 724], device="cuda")
    q0, k0, v0 = make_qkv(1, s, s, h, h, d, torch.bfloat16, device="cuda", seed=d)
    dout = torch.randn(q0.shape, device="cuda", dtype=q0.dtype)
    qr, kr, vr = _fresh(q0, k0, v0)
    ref_out, _ = reference_attention(qr, kr, vr, mask.startend_row_indices, True)
    ref_out.backward(dout.double())
    for call in range(3):
        junk = torch.empty(8 * s * h * d, device="cuda").fill_(float("nan"))
        del junk  # (its block goes back to the allocator's free list, NaN inside)
        q, k, v = _fresh(q0, k0, v0)
        out = flashmask3.flashmask_attention(q, k, v, mask)
        out.backward(dout)
        assert rel_err(out, ref_out) < 2e-2, call
        for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
            assert torch.isfinite(got).all() and rel_err(got, want) < 2e-2, call
    assert len(flashmask3.api._PREPARED) == 1
