"""Ranks of the transformers context-parallel test (importable by the spawned processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flashmask3.masks as M
from flashmask3.distributed import plan
from flashmask3.integrations.transformers import ATTN_IMPLEMENTATION, ContextParallel
from tests.integrations.test_transformers import VOCAB, tiny_model

DOCS = [[37, 5, 60, 26], [9, 70, 49]]  # two rows of 128 tokens, packed documents


def _batch(seed: int):
    """Whole-sequence ids, per-document positions and labels (each document's first token
    ignored, as transformers' DataCollatorWithFlattening sets them), and the mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(DOCS), sum(DOCS[0])), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    labels = ids.clone()
    labels[pos == 0] = -100
    return ids, pos, labels, M.causal_document_mask(DOCS)


def hf_cp_suite(rank: int, world: int, seed: int) -> None:
    """Every rank's logits, the summed loss and the summed gradients of a tiny GQA Llama under
    ``flashmask_cp=`` equal the single-process model's, for each balance x comm (and two
    nodes where the world splits); then the documented errors."""
    model = tiny_model(seed=seed)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids, pos, labels, mask = _batch(seed)
    model.zero_grad()
    ref = model(ids, position_ids=pos, labels=labels, use_cache=False)
    ref.loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    layouts = [(b, c, 1) for b in ("dual_chunk", "sparse") for c in ("overlap", "allgather")]
    if world % 2 == 0 and world > 2:
        layouts.append(("sparse", "overlap", 2))
    for balance, comm, nodes in layouts:
        tag = f"rank {rank} {balance} {comm} nodes={nodes}"
        cp = ContextParallel(plan(mask, None, world, balance=balance, nodes=nodes), comm=comm,
                             node_layout=world // nodes)
        assert cp.rank == rank
        model.zero_grad()
        if comm == "overlap":  # the helper, and the same by hand
            out = model(**cp.model_inputs(ids, position_ids=pos, labels=labels))
        else:
            shift, count = cp.next_token_labels(labels)
            out = model(cp.shard(ids), position_ids=cp.shard(pos), labels=shift, shift_labels=shift,
                        num_items_in_batch=count, use_cache=False, flashmask_cp=cp)
        torch.testing.assert_close(out.logits, cp.shard(ref.logits.detach()), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{tag}: logits: {m}")
        total = out.loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{tag}: loss: {m}")
        out.loss.backward()
        cp.reduce_gradients(model)
        for (name, p), want in zip(model.named_parameters(), ref_grads):
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{tag}: {name}: {m}")
    collator_batch(rank, world, seed)
    padded_batch(rank, world, seed)
    other = M.causal_document_mask([DOCS[0], DOCS[1][::-1]] if rank == 0 else DOCS)
    with pytest.raises(ValueError, match="different CP plans"):  # (check_plan: on every rank)
        model(**ContextParallel(plan(other, None, world), check_plan=True).model_inputs(ids, position_ids=pos))
    cp = ContextParallel(plan(mask, None, world))
    local = cp.shard(ids)
    with pytest.raises(ValueError, match="position_ids are required"):
        cp.model_inputs(ids, position_ids=None)
    with pytest.raises(ValueError, match="exactly one of"):
        cp.model_inputs(position_ids=pos)
    with pytest.raises(ValueError, match="fold padding"):
        model(local, position_ids=cp.shard(pos), attention_mask=torch.ones_like(local), use_cache=False,
              flashmask_cp=cp)
    with pytest.raises(TypeError, match="CPPlan"):
        ContextParallel(mask)
    sliding_window_layers(rank, world, seed)
    if world == 2:
        compiled_model(rank, world, seed)
    if world == 4:
        data_and_context_parallel(rank, seed)


def data_and_context_parallel(rank: int, seed: int) -> None:
    """A (dp 2, cp 2) DeviceMesh: each data-parallel group trains its own batch with
    ``ContextParallel(plan, group=(mesh, "cp"))``; within the group the summed gradients equal
    the one-process gradients of that group's batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_rank = mesh.get_local_rank("dp")
    ids, pos, labels, mask = _batch(seed + 10 * dp_rank)  # each DP group its own batch
    model = tiny_model(seed=seed)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.zero_grad()
    model(ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    cp = ContextParallel(plan(mask, None, 2), group=(mesh, "cp"))
    assert cp.rank == mesh.get_local_rank("cp")
    model.zero_grad()
    model(**cp.model_inputs(ids, position_ids=pos, labels=labels)).loss.backward()
    cp.reduce_gradients(model)
    for (name, p), w in zip(model.named_parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")


def sliding_window_layers(rank: int, world: int, seed: int) -> None:
    """Under ``flashmask_cp=``, the one-process logits and gradients: a Mistral with a sliding
    window shorter than the sequence (each layer runs the plan's mask limited to the window, on
    the plan's placement) and with one longer than it (it masks nothing); a Qwen2 whose layers
    alternate a sliding window and full attention (``layer_types``): two plans on one placement."""
    ids, pos, labels, mask = _batch(seed)
    cp = ContextParallel(plan(mask, None, world))
    alternating = dict(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    for cls, window, extra in (("mistral", 4096, {}), ("mistral", 16, {}), ("mistral", 1, {}),
                               ("qwen2", 16, alternating)):
        model = tiny_model(seed=seed, cls=cls, **({"sliding_window": window} | extra))
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        model.zero_grad()
        ref = model(ids, position_ids=pos, labels=labels, use_cache=False)
        ref.loss.backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = model(**cp.model_inputs(ids, position_ids=pos, labels=labels))
        tag = f"rank {rank} {cls} sliding_window {window}"
        torch.testing.assert_close(out.logits, cp.shard(ref.logits.detach()), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{tag}: logits: {m}")
        out.loss.backward()
        cp.reduce_gradients(model)
        for (name, p), g in zip(model.named_parameters(), want):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{tag}: {name}: {m}")


def collator_batch(rank: int, world: int, seed: int) -> None:
    """A ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` batch, planned from its
    ``cu_seq_lens_q`` (``masks.from_cu_seqlens``): the summed loss equals the one-process loss
    of the same batch, and each rank's logits its tokens' logits."""
    import transformers

    model = tiny_model(seed=seed + 1)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in DOCS[0]]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs], return_tensors="pt")
    ref = model(**batch, use_cache=False)
    cp = ContextParallel(plan(M.from_cu_seqlens(batch["cu_seq_lens_q"]), None, world))
    out = model(**cp.model_inputs(batch["input_ids"], position_ids=batch["position_ids"],
                                  labels=batch["labels"]))
    torch.testing.assert_close(out.logits, cp.shard(ref.logits.detach()), rtol=1e-4, atol=1e-5)
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-5, atol=1e-6)


def compiled_model(rank: int, world: int, seed: int) -> None:
    """``torch.compile(model, fullgraph=True)`` under ``flashmask_cp=``: one graph (the CP
    layers are custom ops), the eager logits and gradients, and batches with new plans reuse it."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    model = tiny_model(seed=seed + 2)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    compiled = torch.compile(model, fullgraph=True)
    ids, pos, labels, mask = _batch(seed)
    for i, docs in enumerate((DOCS, [[64, 64], [100, 28]])):
        cp = ContextParallel(plan(M.causal_document_mask(docs), None, world))
        inputs = cp.model_inputs(ids, position_ids=pos, labels=labels)
        model.zero_grad()
        ref = model(**inputs)
        ref.loss.backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = compiled(**inputs)
        out.loss.backward()
        tag = f"rank {rank} batch {i}"
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5, msg=lambda m: f"{tag}: logits: {m}")
        for (name, p), g in zip(model.named_parameters(), want):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{tag}: {name}: {m}")
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        assert graphs == 1, f"{tag}: {graphs} compiled graphs (a break, or a recompile for the new plan)"


def padded_batch(rank: int, world: int, seed: int) -> None:
    """A collator batch whose length no plan splits (125 tokens): planned on the mask padded to
    ``padded_seqlen`` (``masks.pad_to``), its inputs padded by ``model_inputs``; the summed loss
    and gradients equal the one-process ones of the unpadded batch, and the real tokens' logits
    are theirs."""
    import transformers

    from flashmask3.distributed import padded_seqlen

    model = tiny_model(seed=seed + 3)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (37, 5, 60, 23)]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs], return_tensors="pt")
    model.zero_grad()
    ref = model(**batch, use_cache=False)
    ref.loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    mask = M.from_cu_seqlens(batch["cu_seq_lens_q"])
    length = padded_seqlen(mask.seqlen_q, world, multiple=16)
    assert length > mask.seqlen_q == 125
    cp = ContextParallel(plan(M.pad_to(mask, length), None, world))
    model.zero_grad()
    out = model(**cp.model_inputs(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]))
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    real = cp.shard(cp.padded(torch.ones(1, 125, dtype=torch.bool), False))[0]
    torch.testing.assert_close(out.logits[:, real], cp.shard(cp.padded(ref.logits.detach()))[:, real],
                               rtol=1e-4, atol=1e-5)
    out.loss.backward()
    cp.reduce_gradients(model)
    for (name, p), g in zip(model.named_parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
    with pytest.raises(ValueError, match="more than the plan"):
        cp.padded(torch.zeros(1, length + 1))
    # the same in one call: ContextParallel.from_mask pads and plans
    quick = ContextParallel.from_mask(mask, comm="allgather")
    assert quick.plan.seqlen == padded_seqlen(125, world) and quick.comm == "allgather"
    out = model(**quick.model_inputs(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]))
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="FlashMask"):
        ContextParallel.from_mask(mask.startend_row_indices)


def one_rank_model(backend: str, device: str, store: str, queue) -> None:
    """On a one-rank group (NCCL where there is one GPU): the model under ``flashmask_cp=``, eager
    and compiled whole (``fullgraph=True``: the CP custom op), gives the one-process model's
    logits and loss, for a Llama and for a Qwen2 alternating sliding-window and full layers (a
    windowed plan), and on CUDA also compiled with ``mode="reduce-overhead"``; puts the largest relative difference (or the exception text) on ``queue``.
    The glue on a real device and backend, not the exchange's peers (the gloo suites above cover
    those)."""
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        ids, pos, labels, mask = (t.to(device) for t in _batch(2))
        cp = ContextParallel(plan(mask, None, 1))
        inputs = cp.model_inputs(ids, position_ids=pos, labels=labels)
        err = 0.0
        alternating = dict(use_sliding_window=True, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"])
        for cls, extra in (("llama", {}), ("qwen2", alternating)):
            torch._dynamo.reset()
            model = tiny_model(seed=2, cls=cls, **extra).to(device=device, dtype=dtype)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            ref = model(ids, position_ids=pos, labels=labels, use_cache=False)
            scale = ref.logits.float().abs().max()
            runs = [(model, 1), (torch.compile(model, fullgraph=True), 1)]
            if device == "cuda":  # inductor's CUDA graphs: warm-up, record, then a replay
                runs.append((torch.compile(model, mode="reduce-overhead"), 3))
            for run, calls in runs:
                for _ in range(calls):
                    out = run(**inputs)
                err = max(err, ((out.logits.float() - ref.logits.float()).abs().max() / scale).item(),
                          abs(out.loss.item() - ref.loss.item()) / ref.loss.item())
        dist.destroy_process_group()
        queue.put(err)
    except Exception as e:  # reported to the parent, which fails the test with it
        queue.put(f"{type(e).__name__}: {e}")
