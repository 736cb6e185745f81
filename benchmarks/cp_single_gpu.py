"""Per-rank attention cost of a context-parallel layout, measured on ONE GPU.

For ``--cp`` ranks over a causal document mask of ``--tokens`` tokens, every rank's local
attention problem (its query shard, its needed K/V chunks in global order, its rank-local mask
-- what ``cp_flashmask_attention(comm="allgather")`` computes on that rank in one call, without
the communication) is run one after
another with ``flashmask3.flashmask_attention`` (the Triton kernel on CUDA). The slowest rank
sets the step time of a real CP run, so we report it for ``dual_chunk`` vs ``sparse``.

    python benchmarks/cp_single_gpu.py                              # H200: 128K, cp 8, bf16
    python benchmarks/cp_single_gpu.py --device cpu --tokens 2048 --heads 2 --kv-heads 1 \
        --head-dim 16 --dtype float32 --iters 1 --warmup 0           # CPU smoke run

Writes benchmarks/results/cp_single_gpu.{md,json,png} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import flashmask3.masks as M  # noqa: E402
from benchmarks.corpus import document_spreads  # noqa: E402
from benchmarks.environment import run_environment  # noqa: E402
from flashmask3 import flashmask_attention  # noqa: E402
from flashmask3.distributed import plan  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fwd_bwd(q, k, v, mask, warmup: int, iters: int) -> float:
    """Median seconds of one forward+backward of ``flashmask_attention``."""
    do = torch.randn_like(q)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        out = flashmask_attention(q, k, v, mask)
        out.backward(do)
        q.grad = k.grad = v.grad = None

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        _sync(q.device)
        t0 = time.perf_counter()
        step()
        _sync(q.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_problems(p, args, device, dtype):
    """Yield (rank, q, k, v, local mask) for every rank of plan ``p``."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    for r in range(p.cp_size):
        sk = len(p.needed_chunks(r)) * p.chunk_size
        q, k, v = (torch.randn(1, n, h, args.head_dim, generator=g, device=device, dtype=dtype)
                   for n, h in ((p.local_seqlen, args.heads), (max(sk, 1), args.kv_heads),
                                (max(sk, 1), args.kv_heads)))
        yield r, q, k, v, (p.local_mask(r, "sorted").to(device) if sk else None), sk


def measure_layout(mask, balance, args, device, dtype) -> dict:
    p = plan(mask, None, args.cp, balance=balance)
    ranks = []
    for r, q, k, v, lm, sk in rank_problems(p, args, device, dtype):
        if sk == 0:  # nothing live for this rank: no attention work at all
            ranks.append({"rank": r, "seconds": 0.0, "keys": 0, "tflops": 0.0})
            continue
        sec = time_fwd_bwd(q, k, v, lm, args.warmup, args.iters)
        flops = lm.flops(args.heads, args.head_dim, "fwd_bwd")
        ranks.append({"rank": r, "seconds": sec, "keys": sk, "work": p.work(r),
                      "tflops": flops / sec / 1e12})
    slow = max(ranks, key=lambda x: x["seconds"])
    return {"balance": balance, "chunk_size": p.chunk_size, "imbalance": p.imbalance,
            "slowest_rank": slow["rank"], "slowest_seconds": slow["seconds"],
            "mean_seconds": statistics.mean(x["seconds"] for x in ranks), "ranks": ranks}


def full_problem(mask, args, device, dtype) -> float:
    """Single-GPU time of the whole sequence (the ideal CP step is this / cp)."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v = (torch.randn(1, args.tokens, h, args.head_dim, generator=g, device=device, dtype=dtype)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    return time_fwd_bwd(q, k, v, mask.to(device), args.warmup, args.iters)


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# Slowest-rank attention fwd+bwd, cp={a['cp']}, {a['tokens']} tokens, one GPU",
             "", f"{res['env'].get('gpu', res['env']['device'])}, {a['dtype']}, Hq={a['heads']}, "
             f"Hk={a['kv_heads']}, D={a['head_dim']}; causal document masks; median of {a['iters']} "
             f"iterations per rank. `{res['env']['command']}` ({res['env']['date']})", "",
             "| spread | full seq / cp (ideal) ms | dual_chunk slowest ms | sparse slowest ms | sparse / dual "
             "| imbalance dual | imbalance sparse |", "|---|---|---|---|---|---|---|"]
    for spread, r in res["spreads"].items():
        d, s = r["dual_chunk"], r["sparse"]
        ratio = s["slowest_seconds"] / d["slowest_seconds"] if d["slowest_seconds"] else float("nan")
        ideal = r["full_seconds"] / a["cp"] * 1e3 if r.get("full_seconds") else float("nan")
        lines.append(f"| {spread} | {ideal:.2f} | {d['slowest_seconds'] * 1e3:.2f} | {s['slowest_seconds'] * 1e3:.2f} "
                     f"| **{ratio:.3f}** | {d['imbalance']:.3f} | {s['imbalance']:.3f} |")
    if "corpus" in res["spreads"]:
        r = res["spreads"]["corpus"]
        ratio = r["sparse"]["slowest_seconds"] / r["dual_chunk"]["slowest_seconds"]
        lines += ["", f"Target: sparse <= 0.8x dual_chunk on the real-corpus mask: {ratio:.3f} — "
                  f"{'met' if ratio <= 0.8 else 'NOT met'}."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spreads = list(res["spreads"])
    fig, axes = plt.subplots(1, len(spreads), figsize=(4 * len(spreads), 3.5), squeeze=False)
    for ax, spread in zip(axes[0], spreads):
        for i, bal in enumerate(("dual_chunk", "sparse")):
            ranks = res["spreads"][spread][bal]["ranks"]
            xs = [x["rank"] + (i - 0.5) * 0.4 for x in ranks]
            ax.bar(xs, [x["seconds"] * 1e3 for x in ranks], width=0.4, label=bal)
        ax.set(title=spread, xlabel="rank", ylabel="fwd+bwd ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--spreads", nargs="+", default=["corpus", "short", "mixed", "long", "causal"],
                    help="document spreads of benchmarks/corpus.py, or 'causal' (plain causal)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-full", action="store_true", help="skip the whole-sequence reference timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    spreads = document_spreads(args.tokens, seed=args.seed)
    unknown = set(args.spreads) - set(spreads) - {"causal"}
    if unknown:
        raise SystemExit(f"unknown spreads {sorted(unknown)}; choose from {sorted(spreads)}")
    res = {"args": vars(args), "env": run_environment(device), "spreads": {}}
    # One-time costs (imports, custom-op registration) must not land on the first timed rank.
    x = torch.randn(1, 128, args.heads, args.head_dim, device=device, dtype=dtype)
    kv = torch.randn(1, 128, args.kv_heads, args.head_dim, device=device, dtype=dtype)
    time_fwd_bwd(x, kv, kv, M.causal_mask(128).to(device), 1, 1)
    for name in args.spreads:
        if name == "causal":
            mask = M.causal_mask(args.tokens)
        else:
            mask = M.causal_document_mask(spreads[name])
        entry = {"docs": len(spreads.get(name, [0])), "sparsity": mask.sparsity()}
        for balance in ("dual_chunk", "sparse"):
            entry[balance] = measure_layout(mask, balance, args, device, dtype)
        if not args.no_full:
            entry["full_seconds"] = full_problem(mask, args, device, dtype)
        res["spreads"][name] = entry
        d, s = entry["dual_chunk"]["slowest_seconds"], entry["sparse"]["slowest_seconds"]
        print(f"{name:7s} slowest rank fwd+bwd: dual_chunk {d * 1e3:.2f} ms, sparse {s * 1e3:.2f} ms "
              f"(sparse/dual {s / d:.3f})", flush=True)
        write(res, args.out)  # after every spread: a time limit still leaves the finished ones
    print(f"wrote {os.path.join(args.out, 'cp_single_gpu')}.md/.json/.png")
    return 0


def write(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, "cp_single_gpu")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(res))
    plot(res, base + ".png")


if __name__ == "__main__":
    sys.exit(main())
