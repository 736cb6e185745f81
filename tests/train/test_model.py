"""The model and its attention backends: same function for flashmask3, flex and sdpa;
documents isolated end to end; RoPE on per-document positions; MoE; FLOP accounting."""

import pytest
import torch

from flashmask3.train.attention import (AttentionTimer, attention_available, flex_available,
                                        make_attention)
from flashmask3.train.config import from_preset
from flashmask3.train.data import DocumentPacker, build_batch, open_corpus
from flashmask3.train.model import (StepContext, Transformer, active_matmul_params,
                                    count_parameters, loss_terms)

BACKENDS = ["flashmask3", "sdpa"] + (["flex"] if flex_available() else [])


def _loss_and_grads(model, batch, backend):
    """CE loss and parameter grads (flex on CPU: forward only, it has no CPU backward)."""
    model.zero_grad()
    ctx = StepContext(make_attention(backend, batch.mask), num_tokens=batch.tokens.numel())
    backward = attention_available(backend, batch.tokens.device, training=True) is None
    with torch.set_grad_enabled(backward):
        total, ce = loss_terms(model, batch.tokens, batch.labels, batch.position_ids, ctx,
                               batch.num_label_tokens, 0.01)
    if not backward:
        return ce.detach(), None
    total.backward()
    return ce.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mask", ["causal_document", "document", "shared_question",
                                  "prefix_document"])
def test_backends_compute_the_same_loss_and_grads(jsonl_corpus, mask):
    cfg = from_preset("tiny", mask=mask)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    batch = DocumentPacker(open_corpus(jsonl_corpus), 96, batch_size=2, seed=2,
                           mask=mask).next_batch()
    ref_loss, ref_grads = _loss_and_grads(model, batch, "flashmask3")
    for backend in BACKENDS[1:]:
        loss, grads = _loss_and_grads(model, batch, backend)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-9)
        for name in ref_grads if grads is not None else ():
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-7,
                                       msg=f"{backend}: grad of {name}")


def test_a_document_gives_the_same_logits_wherever_it_is_packed():
    """Isolation + per-document RoPE: a document's logits do not depend on its neighbours or
    on its offset in the sequence."""
    cfg = from_preset("tiny")
    torch.manual_seed(0)
    model = Transformer(cfg).double().eval()
    doc = b"the same document"
    a = build_batch([b"x" * 10 + doc + b"y" * 5], [[10, len(doc), 5]], "causal_document")
    b = build_batch([doc + b"zzzzzzzzzzzzz" + b"q" * 2], [[len(doc), 13, 2]], "causal_document")
    outs = []
    for batch, start in ((a, 10), (b, 0)):
        ctx = StepContext(make_attention("flashmask3", batch.mask), batch.tokens.numel())
        with torch.no_grad():
            logits, _ = model(batch.tokens, batch.position_ids, ctx)
        outs.append(logits[0, start:start + len(doc)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)


def test_moe_model_trains_and_counts_active_params(jsonl_corpus):
    cfg = from_preset("tiny", moe_experts=4, moe_top_k=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    batch = DocumentPacker(open_corpus(jsonl_corpus), 64, batch_size=2).next_batch()
    ctx = StepContext(make_attention("flashmask3", batch.mask), batch.tokens.numel())
    total, ce = loss_terms(model, batch.tokens, batch.labels, batch.position_ids, ctx,
                           batch.num_label_tokens, cfg.moe_aux_coef)
    assert total.item() > ce.item() > 0  # the load-balancing term is positive
    total.backward()
    assert all(p.grad is not None for p in model.parameters())
    expert_params = 3 * cfg.dim * cfg.resolved_ffn_dim()
    dense = from_preset("tiny")
    assert active_matmul_params(cfg) - active_matmul_params(dense) == \
        cfg.n_layers * (expert_params + cfg.dim * 4)
    assert count_parameters(model) > active_matmul_params(cfg)


def test_attention_timer_sees_forward_and_backward():
    timer = AttentionTimer(torch.device("cpu"))
    calls = []

    def slow(q, k, v):
        calls.append(1)
        return q * 2
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    out = timer.wrap(slow)(q, q, q)
    out.sum().backward()
    assert len(timer._spans) == 2 and calls == [1]  # one forward span, one backward span
    assert timer.collect() > 0 and timer._spans == []
    torch.testing.assert_close(q.grad, torch.full_like(q, 2.0))


def test_bad_backend_and_mask_arguments(jsonl_corpus):
    batch = DocumentPacker(open_corpus(jsonl_corpus), 32).next_batch()
    with pytest.raises(ValueError, match="attention backend must be one of"):
        make_attention("cudnn", batch.mask)
    with pytest.raises(TypeError, match="mask must be a FlashMask"):
        make_attention("sdpa", batch.mask.startend_row_indices)


@pytest.mark.skipif(not flex_available(), reason="needs torch.nn.attention.flex_attention (torch >= 2.5)")
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
def test_flex_compiled_path_matches_dense(jsonl_corpus):
    """The GPU flex path (compiled block-mask builder + compiled kernel, forward) on CPU: the
    column mask_mod must trace and give the dense-mask result for every mask kind."""
    from flashmask3.train.attention import _flex_attention
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 128, 4, 16), torch.randn(2, 128, 2, 16), torch.randn(2, 128, 2, 16)
    for kind in ("causal_document", "document", "shared_question", "prefix_document"):
        batch = DocumentPacker(open_corpus(jsonl_corpus), 128, batch_size=2, seed=4,
                               mask=kind).next_batch()
        got = _flex_attention(batch.mask, compiled=True)(q, k, v)
        want = make_attention("sdpa", batch.mask)(q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=kind)

