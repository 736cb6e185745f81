"""The public function: argument checking, backend selection, torch.library / torch.compile."""

import pytest
import torch

import flashmask3
import flashmask3.masks as M
from flashmask3.kernels import resolve_backend
from flashmask3.api import kernel_row_span
from tests.kernels.attention_checks import make_qkv
from tests.reference import reference_attention, rel_err


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
        for span in (-1.0, 12.5):
            torch.library.opcheck(op, (q, k, v, mask, True, 0.35, "torch", span))


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


def test_torch_compile_recompiles_only_when_the_row_span_bucket_changes(monkeypatch):
    """New masks whose mean row spans share a half octave reuse the compiled graph (the op sees
    only the bucket); a mask in another bucket compiles one more."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v, m: flashmask3.flashmask_attention(q, k, v, m),
                             backend="eager", fullgraph=True)
    q, k, v = make_qkv(1, 64, 64, 2, 2, 16, torch.float32, seed=3)
    same = [M.causal_document_mask(lens) for lens in ([32, 32], [31, 33], [30, 34])]
    assert len({m.mean_row_span for m in same}) == 3 and len({m.row_span_bucket for m in same}) == 1
    for m in same:
        out = compiled(q, k, v, m)
        assert rel_err(out, reference_attention(q, k, v, m.startend_row_indices, True)[0]) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1
    other = M.causal_document_mask([64])
    assert other.row_span_bucket != same[0].row_span_bucket
    compiled(q, k, v, other)
    assert counters["stats"]["unique_graphs"] == 2


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
