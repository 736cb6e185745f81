"""The CPU path against dense ``scaled_dot_product_attention`` with a boolean mask, on the CPU.

Both implementations run in the same process on the same inputs (fp32, B=1, forward and
forward+backward). The machine this was written on is shared: to keep the comparison fair, the
two implementations alternate round by round (ours, dense, ours, dense, ...) and each number
is the median of its rounds. Writes ``benchmarks/results/cpu_path.{json,md}``.

    python benchmarks/cpu_path.py                      # the committed table
    python benchmarks/cpu_path.py --seqlens 256 --rounds 1 --out /tmp/x   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashmask3  # noqa: E402
import flashmask3.masks as M  # noqa: E402
from benchmarks.environment import run_environment  # noqa: E402


def bench_masks(seqlen: int) -> dict[str, M.FlashMask]:
    """The masks of the table: dense-ish (causal), typical packing, and two sparse ones."""
    docs = M.random_document_lengths(seqlen, max(seqlen // 8, 1), seed=0)
    return {
        "causal": M.causal_mask(seqlen),
        "causal_document": M.causal_document_mask(docs),
        "sliding_window(S/8)": M.sliding_window_mask(seqlen, max(seqlen // 8, 1)),
        "global_sliding_window": M.global_sliding_window_mask(seqlen, 16, max(seqlen // 16, 1)),
    }


def _ours(q, k, v, dout, mask, backward: bool):
    def run():
        if backward:
            out = flashmask3.flashmask_attention(q, k, v, mask)
            torch.autograd.grad(out, (q, k, v), dout)
        else:
            with torch.no_grad():
                flashmask3.flashmask_attention(q, k, v, mask)
    return run


def _dense(q, k, v, dout, dense_mask, backward: bool):
    qt, kt, vt, dt = (t.transpose(1, 2) for t in (q, k, v, dout))

    def run():
        if backward:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense_mask)
            torch.autograd.grad(out, (q, k, v), dt)
        else:
            with torch.no_grad():
                F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense_mask)
    return run


def interleaved_times(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Wall times (ms) of each function over ``rounds`` rounds that run every function once, in
    turn, after one warm-up call each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def run(seqlens, heads: int, head_dim: int, rounds: int) -> list[dict]:
    rows = []
    for s in seqlens:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(1, s, heads, head_dim, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn(1, s, heads, head_dim, generator=g)
        for name, mask in bench_masks(s).items():
            dense = mask.to_dense()  # [1, 1, S, S] bool: the baseline's O(S²) mask
            for mode, backward in (("fwd", False), ("fwd+bwd", True)):
                times = interleaved_times({"ours": _ours(q, k, v, dout, mask, backward),
                                           "dense": _dense(q, k, v, dout, dense, backward)}, rounds)
                t = {name: statistics.median(ts) for name, ts in times.items()}
                # per-round ratios (same round: same machine load) give the speedup's spread
                ratios = [d / o for o, d in zip(times["ours"], times["dense"])]
                row = {"seqlen": s, "mask": name, "mode": mode, "density": mask.density(),
                       "ours_ms": t["ours"], "dense_ms": t["dense"],
                       "speedup": t["dense"] / t["ours"],
                       "round_speedup_min": min(ratios), "round_speedup_max": max(ratios),
                       "ours_ms_rounds": times["ours"], "dense_ms_rounds": times["dense"]}
                rows.append(row)
                print(f"S={s:>5} {name:<22} {mode:<8} density {row['density']:.3f}  ours "
                      f"{t['ours']:8.1f} ms  dense {t['dense']:8.1f} ms  x{row['speedup']:.2f} "
                      f"(rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    return rows


def _load(avg) -> str:
    return " / ".join(f"{x:.1f}" for x in avg)


def markdown(rows: list[dict], env: dict, args) -> str:
    lines = [
        "# CPU path vs dense SDPA with a boolean mask",
        "",
        f"{env['date']} · host `{env['host']}` ({os.cpu_count()} CPU cores, "
        f"{torch.get_num_threads()} torch threads, shared with other engineers' jobs) · torch "
        f"{env['torch']} · fp32, B=1, H={args.heads}, D={args.head_dim}",
        "",
        f"Command: `{env['command']}` (commit {env['commit']})",
        "",
        f"Machine load (`os.getloadavg()`, 1/5/15 min) at start {_load(env['load_start'])}, at "
        f"end {_load(env['load_end'])}; wall time of the run {env['wall_s'] / 60:.1f} min.",
        "",
        f"Median of {args.rounds} rounds; in each round the two implementations run one after "
        "the other on the same inputs (interleaved, because the machine is shared). `dense`: "
        "`F.scaled_dot_product_attention(q, k, v, attn_mask=<[S, S] bool>)`; `ours`: "
        "`flashmask3.flashmask_attention` on the torch path (O(S) mask memory). "
        "speedup = median dense / median ours (> 1: ours is faster); spread: the lowest and "
        "highest per-round ratio (dense / ours of the same round).",
        "",
        "| S | mask | density | mode | ours ms | dense ms | speedup | spread |",
        "|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['seqlen']} | {r['mask']} | {r['density']:.3f} | {r['mode']} | "
                     f"{r['ours_ms']:.1f} | {r['dense_ms']:.1f} | {r['speedup']:.2f} | "
                     f"{r['round_speedup_min']:.2f}-{r['round_speedup_max']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "cpu_path"))
    args = ap.parse_args(argv)
    os.environ.setdefault("FLASHMASK3_BACKEND", "torch")
    load_start, t0 = os.getloadavg(), time.perf_counter()
    rows = run(args.seqlens, args.heads, args.head_dim, args.rounds)
    env = run_environment(torch.device("cpu"))
    env.update(load_start=load_start, load_end=os.getloadavg(), wall_s=time.perf_counter() - t0)
    env["torch_threads"] = torch.get_num_threads()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"environment": env, "heads": args.heads, "head_dim": args.head_dim,
                   "rounds": args.rounds, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows, env, args))
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
