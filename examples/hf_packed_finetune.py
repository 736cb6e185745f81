"""Fine-tune a Hugging Face Llama-architecture model on packed documents with flashmask3.

Real text (the harness's default corpus: the Python standard library sources and
/usr/share/doc, as bytes) is cut into documents, a batch of documents is flattened into one
row by transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, and the
model runs with ``attn_implementation=ATTN_IMPLEMENTATION``: every document attends only to
itself (a causal document mask built on the device from ``cu_seq_lens_q``), with no padding
and no ``[S, S]`` mask. The model starts from random weights (no download).

    python examples/hf_packed_finetune.py                     # tiny model, CPU, < 2 minutes
    python examples/hf_packed_finetune.py --preset 0.5b --tokens 32768 --steps 200   # a GPU
    torchrun --standalone --nproc_per_node 2 examples/hf_packed_finetune.py   # context parallel
    ... --compile                                             # the model under torch.compile

Under torchrun (``WORLD_SIZE`` > 1) every process trains the same model on its share of each
packed batch: the batch's causal document mask is planned over the processes
(``flashmask3.distributed.plan``, ``balance="sparse"``), each runs the model on its tokens with
``flashmask_cp=ContextParallel(plan)`` (every layer's attention covers the whole sequence), and
the gradients are summed over the processes, so every step equals the one-process step.

Writes a loss plot (``--plot``) and the losses as JSON next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

from flashmask3.distributed import plan
from flashmask3.integrations.transformers import ATTN_IMPLEMENTATION, ContextParallel
from flashmask3.train.data import DocumentPacker, open_corpus

#: Byte-level tokens: the corpus is read as bytes, so the vocabulary is 256.
VOCAB = 256

#: Model sizes: ``tiny`` for the CPU, ``0.5b`` (~0.59B parameters, GQA 12/2 heads of 128) for a GPU.
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "0.5b": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=24,
                 num_attention_heads=12, num_key_value_heads=2),
}


def llama_config(preset: str, max_positions: int, attn_implementation: str) -> LlamaConfig:
    """A Llama config of the given preset size over the byte vocabulary."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return LlamaConfig(vocab_size=VOCAB, max_position_embeddings=max_positions,
                       attention_dropout=0.0, attn_implementation=attn_implementation,
                       **PRESETS[preset])


def packed_batches(tokens: int, max_doc_len: int, seed: int = 0, data: str = "default"):
    """Endless one-row batches of real documents (pieces of at most ``max_doc_len`` bytes)
    adding up to ``tokens`` tokens (``flashmask3.train.data.PackedBatch``: tokens, per-document
    positions, document lengths, the causal document mask)."""
    return iter(DocumentPacker(open_corpus(data), tokens, 1, seed=seed, max_doc_len=max_doc_len))


def document_batches(tokens: int, max_doc_len: int, seed: int = 0, data: str = "default"):
    """Endless lists of ``{"input_ids": [...]}`` features: the documents of
    :func:`packed_batches`, as a dataset would give them to ``DataCollatorWithFlattening``."""
    for batch in packed_batches(tokens, max_doc_len, seed, data):
        row, start, features = batch.tokens[0].tolist(), 0, []
        for n in batch.doc_lens[0]:
            features.append({"input_ids": row[start:start + n]})
            start += n
        yield features


def cp_step_inputs(batch, device) -> tuple[dict, ContextParallel]:
    """This process's forward arguments for one packed batch under context parallelism: the
    batch's mask planned over the group, the tokens, positions and next-token labels (each
    document's first token has none, as the collator does) sharded."""
    cp = ContextParallel(plan(batch.mask, cp_size=dist.get_world_size(), balance="sparse"))
    labels = batch.tokens.clone()
    labels[batch.position_ids == 0] = -100
    inputs = cp.model_inputs(batch.tokens, position_ids=batch.position_ids, labels=labels)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, cp


def train(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    distributed = dist.is_initialized()
    model = LlamaForCausalLM(llama_config(args.preset, args.tokens, ATTN_IMPLEMENTATION)).to(device)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    forward = torch.compile(model) if args.compile else model
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast("cpu", enabled=False)
    losses, docs_seen, t0 = [], 0, time.perf_counter()
    data = packed_batches(args.tokens, args.max_doc_len, args.seed, args.data)
    where = f"{dist.get_world_size()} processes (context parallel)" if distributed else device
    bar = tqdm(range(args.steps), desc=f"{args.preset} on {where}", unit="step",
               disable=distributed and dist.get_rank() > 0)
    for _ in bar:
        packed = next(data)
        if distributed:
            batch, cp = cp_step_inputs(packed, device)
        else:
            features = [{"input_ids": row.tolist()} for row in torch.split(packed.tokens[0], packed.doc_lens[0])]
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in collator(features, return_tensors="pt").items()}
        with autocast:
            loss = forward(**batch).loss
        loss.backward()
        if distributed:  # each process holds its tokens' share of the loss and gradients
            cp.reduce_gradients(model)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        docs_seen += len(packed.doc_lens[0])
        bar.set_postfix(loss=f"{losses[-1]:.3f}", docs=docs_seen, refresh=False)  # redraw per mininterval
    seconds = time.perf_counter() - t0
    return {"preset": args.preset, "device": str(device), "tokens_per_step": args.tokens,
            "steps": args.steps, "losses": losses, "documents": docs_seen, "seconds": seconds,
            "tokens_per_second": args.steps * args.tokens / seconds,
            "attn_implementation": ATTN_IMPLEMENTATION,
            "context_parallel": dist.get_world_size() if distributed else 1,
            "parameters": sum(p.numel() for p in model.parameters())}


def plot_losses(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(result["losses"]) + 1), result["losses"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(f"{result['preset']} Llama, packed documents, {ATTN_IMPLEMENTATION}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per packed batch")
    ap.add_argument("--max-doc-len", type=int, default=512, help="longest document piece (bytes)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default="default", help="corpus: 'default', a directory, a file, or .jsonl")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--plot", default="hf_packed_finetune.png")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (under torchrun each layer's context-parallel "
                         "attention is one op of the graph; a new batch's plan compiles nothing)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default on the CPU: 1; a tiny model's ops are too small "
                         "to gain from intra-op threads: 2330 vs 622 tokens/s on a busy 2-core machine)")
    args = ap.parse_args(argv)
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun: context parallel
    if launched:
        cuda = args.device.startswith("cuda")
        if cuda:
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        result = train(args)
        if not launched or dist.get_rank() == 0:
            plot_losses(result, args.plot)
            with open(os.path.splitext(args.plot)[0] + ".json", "w") as f:
                json.dump(result, f, indent=1)
            print(f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f} over {args.steps} "
                  f"steps, {result['tokens_per_second']:.0f} tokens/s, context parallel "
                  f"{result['context_parallel']}; plot: {args.plot}")
    finally:
        if launched:
            dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
