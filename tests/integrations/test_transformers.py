"""The transformers attention implementation against sdpa / eager on a tiny Llama (CPU, fp32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashmask3.masks as M  # noqa: E402
from flashmask3.integrations.transformers import ATTN_IMPLEMENTATION  # noqa: E402

VOCAB = 97


def tiny_model(seed=0, cls="llama", **overrides):
    """A 2-layer GQA decoder (4 query heads, 2 KV heads) with random weights."""
    torch.manual_seed(seed)
    if cls == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
        model = transformers.LlamaForCausalLM(config)
    elif cls == "qwen2":  # sliding-window and full layers per layer_types
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
        model = transformers.MistralForCausalLM(config)
    return model.eval()


def run(model, impl, **inputs):
    model.set_attn_implementation(impl)
    return model(**inputs).logits


def embeds_and_grad(model, impl, ids, weight, **inputs):
    """Logits, and the gradient of sum(logits * weight) w.r.t. the input embeddings."""
    model.set_attn_implementation(impl)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=emb, **inputs).logits
    (grad,) = torch.autograd.grad((logits * weight).sum(), emb)
    return logits, grad


def test_name_avoids_the_flash_loader():
    assert "flash" not in ATTN_IMPLEMENTATION
    assert ATTN_IMPLEMENTATION in transformers.AttentionInterface()


@pytest.mark.parametrize("kwargs_source", ["flash_attn_kwargs", "position_ids_only"])
def test_packed_documents_match_each_document_alone(kwargs_source):
    """DataCollatorWithFlattening batches: per document, logits and gradients of sdpa alone."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    lens = [7, 1, 13, 20]
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=kwargs_source == "flash_attn_kwargs")
    batch = collator([{"input_ids": d.tolist()} for d in docs], return_tensors="pt")
    ids = batch.pop("input_ids")
    batch.pop("labels")
    weight = torch.randn(1, ids.shape[1], VOCAB, generator=g)
    logits, grad = embeds_and_grad(model, ATTN_IMPLEMENTATION, ids, weight, **batch)
    start = 0
    for d in docs:
        n = d.numel()
        ref_logits, ref_grad = embeds_and_grad(model, "sdpa", d[None], weight[:, start:start + n])
        torch.testing.assert_close(logits[:, start:start + n], ref_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad[:, start:start + n], ref_grad, rtol=1e-4, atol=1e-5)
        start += n


def test_packed_batch_of_two_rows_and_parameter_gradients():
    """Batch size 2, documents restarting their position_ids: per-document logits match, and
    the parameter gradients are those of all documents run alone."""
    model = tiny_model(seed=3)
    g = torch.Generator().manual_seed(2)
    rows = [[9, 15], [4, 4, 16]]
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.zero_grad()
    logits = model(ids, position_ids=pos).logits
    logits.square().mean(-1).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    for b, r in enumerate(rows):
        start = 0
        for n in r:
            ref = model(ids[b:b + 1, start:start + n]).logits
            torch.testing.assert_close(logits[b:b + 1, start:start + n], ref.detach(), rtol=1e-4, atol=1e-5)
            ref.square().mean(-1).sum().backward()
            start += n
    for got, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("cls", ["llama", "mistral"])
def test_padded_batch_matches_sdpa_on_real_tokens(side, cls):
    overrides = {"sliding_window": 5} if cls == "mistral" else {}
    model = tiny_model(seed=4, cls=cls, **overrides)
    g = torch.Generator().manual_seed(5)
    s, lens = 16, [16, 11, 3]
    ids = torch.randint(0, VOCAB, (3, s), generator=g)
    attn = torch.zeros(3, s, dtype=torch.long)
    for b, n in enumerate(lens):
        if side == "left":
            attn[b, s - n:] = 1
        else:
            attn[b, :n] = 1
    weight = torch.randn(3, s, VOCAB, generator=g) * attn.unsqueeze(-1)  # real tokens only
    ours, grad = embeds_and_grad(model, ATTN_IMPLEMENTATION, ids, weight, attention_mask=attn)
    ref, ref_grad = embeds_and_grad(model, "sdpa", ids, weight, attention_mask=attn)
    real = attn.bool()
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad[real], ref_grad[real], rtol=1e-4, atol=1e-5)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """Dense [B, 1, S, S] additive mask for eager (0 where allowed)."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("name", ["prefix_lm", "sliding_window", "shared_question_columns"])
def test_custom_mask_reaches_every_layer_and_matches_eager(name):
    s = 24
    if name == "prefix_lm":
        mask = M.prefix_lm_mask(s, 9, batch_size=2)
    elif name == "sliding_window":
        mask = M.sliding_window_mask(s, 6, batch_size=2)
    else:
        mask = M.shared_question_mask([(6, [5, 7]), (4, [2])], seqlen=s, batch_size=2)
    model = tiny_model(seed=6)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, s), generator=g)
    weight = torch.randn(2, s, VOCAB, generator=g)
    if name == "shared_question_columns":  # raw columns + causal instead of a FlashMask
        kwargs = {"startend_row_indices": mask.startend_row_indices, "flashmask_causal": mask.causal}
    else:
        kwargs = {"flashmask": mask}
    ours, grad = embeds_and_grad(model, ATTN_IMPLEMENTATION, ids, weight, **kwargs)
    dense = _additive(mask.to_dense().expand(2, 1, s, s))
    ref, ref_grad = embeds_and_grad(model, "eager", ids, weight, attention_mask=dense)
    allowed_any = mask.to_dense().any(-1).view(2, s)  # rows with at least one key
    torch.testing.assert_close(ours[allowed_any], ref[allowed_any], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
    # and the mask changes the result (it reached the layers)
    plain = run(model, ATTN_IMPLEMENTATION, input_ids=ids)
    assert not torch.allclose(plain, ours, atol=1e-3)


def test_generate_prefill_then_sdpa_decoding_gives_sdpa_tokens():
    """Greedy generation with left padding: prefill here, decoding through the sdpa fallback."""
    model = tiny_model(seed=8)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, VOCAB, (2, 10), generator=g)
    attn = torch.ones(2, 10, dtype=torch.long)
    attn[1, :4] = 0
    out = {}
    for impl in (ATTN_IMPLEMENTATION, "sdpa"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=6,
                                   do_sample=False, pad_token_id=0)
    assert torch.equal(out[ATTN_IMPLEMENTATION], out["sdpa"])


def test_unsupported_settings_raise_clear_errors():
    model = tiny_model(seed=10, attention_dropout=0.1).train()
    ids = torch.randint(0, VOCAB, (1, 8))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    with pytest.raises(ValueError, match="dropout"):
        model(ids)
    model.eval()
    with pytest.raises(ValueError, match="not both"):
        model(ids, flashmask=M.causal_mask(8), startend_row_indices=M.causal_mask(8).startend_row_indices)
    with pytest.raises(TypeError, match="FlashMask"):
        model(ids, flashmask=torch.zeros(1))
    with pytest.raises(ValueError, match="8"):
        model(ids, flashmask=M.causal_mask(12))


def test_masks_built_per_forward_never_read_their_columns(monkeypatch):
    """The masks the integration builds each forward (packed documents, padding, a custom mask
    widened to the batch) are valid by construction: no value check, which on a GPU would read
    the columns to the host (a device sync) once per forward."""
    import flashmask3.masks.mask as mask_module

    real = mask_module.validate_startend_row_indices
    checks = []

    def recording(t, **kw):
        checks.append(kw.get("check_values", True))
        return real(t, **kw)

    model = tiny_model()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)
    padding = torch.ones(2, 24, dtype=torch.long)
    padding[1, :3] = 0
    custom = M.prefix_lm_mask(24, 8)
    monkeypatch.setattr(mask_module, "validate_startend_row_indices", recording)
    model(ids, position_ids=pos)
    model(ids, attention_mask=padding)
    model(ids, attention_mask=padding, flashmask=custom)
    assert len(checks) >= 3 and not any(checks)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_model_equals_one_process(world):
    """``flashmask_cp=ContextParallel(plan)`` on gloo ranks: logits, loss and gradients of the
    whole model equal one process's (tests/integrations/hf_cp_workers.py)."""
    from tests.distributed.harness import run_distributed
    from tests.integrations.hf_cp_workers import hf_cp_suite

    run_distributed(hf_cp_suite, world, 7)


@pytest.mark.parametrize("backend,device", [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.gpu)])
def test_context_parallel_on_a_one_rank_group(backend, device, tmp_path):
    """``flashmask_cp=`` on a one-rank group (NCCL and the Triton kernels on a GPU) gives the
    one-process logits and loss."""
    from tests.distributed.harness import run_one_rank
    from tests.integrations.hf_cp_workers import one_rank_model

    got = run_one_rank(one_rank_model, backend, device, str(tmp_path / "store"), 300, "the one-rank model")
    assert isinstance(got, float) and got < (2e-2 if device == "cuda" else 1e-5), got
