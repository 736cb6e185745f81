"""Training throughput of a Hugging Face Llama on packed documents: flashmask3 vs sdpa vs Flex.

One model (random init), one set of real documents (the harness corpus, ``--tokens`` tokens),
forward+backward steps (no optimizer step) with each attention implementation in turn:

* ``fm3_columnmask`` (flashmask3): the documents packed into one ``[1, tokens]`` row by
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``;
* ``sdpa``: the same documents as a right-padded batch with an ``attention_mask``, in
  micro-batches of at most ``--tokens`` padded tokens (gradients accumulate: one step = all
  documents), the way a padded HF training loop sees them;
* ``flex_attention``: transformers' FlexAttention implementation on the packed row (documents
  from the restarting ``position_ids``), compiled by transformers.

tokens/s counts real tokens. Before timing, ``--check`` compares flashmask3's logits on the
packed row with sdpa's on the first documents run alone. Writes ``hf_attention.json`` under
``--out``.

    python benchmarks/hf_attention.py --preset 0.5b --tokens 32768          # one H200
    python benchmarks/hf_attention.py --preset tiny --tokens 1024 --device cpu --steps 1 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from transformers import DataCollatorWithFlattening, LlamaForCausalLM  # noqa: E402

from benchmarks.environment import run_environment  # noqa: E402
from flashmask3.integrations.transformers import ATTN_IMPLEMENTATION  # noqa: E402
from hf_packed_finetune import document_batches, llama_config  # noqa: E402

IMPLS = (ATTN_IMPLEMENTATION, "sdpa", "flex_attention")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def packed_inputs(docs, device) -> dict:
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs], return_tensors="pt")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def padded_microbatches(docs, max_tokens: int, device) -> list[dict]:
    """Right-padded batches of consecutive documents, each at most ``max_tokens`` padded tokens
    (a document longer than that is a batch of its own)."""
    groups, cur = [], []
    for d in docs:
        longest = max([len(x) for x in cur + [d]])
        if cur and longest * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(d)
    groups.append(cur)
    out = []
    for g in groups:
        n = max(len(d) for d in g)
        ids = torch.zeros(len(g), n, dtype=torch.long)
        attn = torch.zeros(len(g), n, dtype=torch.long)
        for i, d in enumerate(g):
            ids[i, :len(d)] = torch.tensor(d)
            attn[i, :len(d)] = 1
        labels = ids.masked_fill(attn == 0, -100)
        out.append({"input_ids": ids.to(device), "attention_mask": attn.to(device),
                    "labels": labels.to(device)})
    return out


def step_fn(model, impl, docs, max_tokens, device):
    """One forward+backward over all documents for ``impl`` and the padded token count."""
    if impl == "sdpa":
        micro = padded_microbatches(docs, max_tokens, device)
        padded = sum(b["input_ids"].numel() for b in micro)
        real = sum(len(d) for d in docs)

        def step():
            for b in micro:
                # mean over each micro-batch's label tokens, weighted as one loss over all docs
                n = int((b["labels"][:, 1:] != -100).sum())
                (model(**b).loss * n / real).backward()
        return step, padded
    inputs = packed_inputs(docs, device)
    if impl == "flex_attention":  # documents from the restarting position_ids
        inputs = {k: inputs[k] for k in ("input_ids", "labels", "position_ids")}

    def step():
        model(**inputs).loss.backward()
    return step, inputs["input_ids"].numel()


def time_impl(model, impl, docs, args, device) -> dict:
    model.set_attn_implementation(impl)
    step, padded = step_fn(model, impl, docs, args.tokens, device)
    real = sum(len(d) for d in docs)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
        model.zero_grad(set_to_none=True)
    _sync(device)
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    med = statistics.median(times)
    row = {"impl": impl, "real_tokens": real, "padded_tokens": padded, "step_s": med,
           "step_s_all": times, "tokens_per_s": real / med, "warmup_s": warm_s}
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return row


def check_against_sdpa(model, docs, device, num_docs: int = 3) -> dict:
    """Max |logit difference| of flashmask3 (packed) vs sdpa (each document alone), relative to
    the logits' scale, over the first ``num_docs`` documents."""
    with torch.no_grad():
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        inputs = packed_inputs(docs, device)
        inputs.pop("labels")
        packed = model(**inputs).logits.float()
        model.set_attn_implementation("sdpa")
        worst, start, num_docs = 0.0, 0, min(num_docs, len(docs))
        for d in docs[:num_docs]:
            alone = model(torch.tensor([d], device=device)).logits.float()
            diff = (packed[:, start:start + len(d)] - alone).abs().max() / alone.abs().max()
            worst = max(worst, float(diff))
            start += len(d)
    return {"documents": num_docs, "max_rel_logit_diff": worst}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="0.5b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--max-doc-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    docs = [f["input_ids"] for f in next(document_batches(args.tokens, args.max_doc_len))]
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(args.preset, args.tokens, ATTN_IMPLEMENTATION))
    model = model.to(dtype).train()
    result = {"environment": run_environment(device), "preset": args.preset,
              "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(dtype),
              "tokens": args.tokens, "documents": len(docs),
              "doc_lens": [len(d) for d in docs], "rows": [], "errors": {}}
    import transformers
    result["environment"]["transformers"] = transformers.__version__
    print(f"{args.preset}: {result['parameters'] / 1e9:.2f}B parameters, {len(docs)} documents, "
          f"{args.tokens} tokens, {dtype} on {device}", flush=True)
    if not args.no_check:
        try:
            result["check"] = check_against_sdpa(model, docs, device)
            print(f"check vs sdpa per document: {result['check']}", flush=True)
        except Exception as e:  # keep measuring; the failure is recorded
            result["errors"]["check"] = repr(e)
            traceback.print_exc()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "hf_attention.json")

    def save():  # after every step, so a time limit never loses the rows already measured
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    save()
    for impl in args.impls:
        try:
            row = time_impl(model, impl, docs, args, device)
            result["rows"].append(row)
            print(f"{impl:<16} {row['tokens_per_s']:>10.0f} tokens/s  step {row['step_s'] * 1e3:8.1f} ms"
                  f"  padded tokens {row['padded_tokens']}  warm-up {row['warmup_s']:.1f} s"
                  + (f"  peak {row['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in row else ""),
                  flush=True)
        except Exception as e:
            result["errors"][impl] = repr(e)
            print(f"{impl} FAILED: {e!r}", flush=True)
            traceback.print_exc()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
