"""Context-parallel placement at scale, without GPUs: balance, remote K/V, traffic, planning time.

For causal document masks of ``--tokens`` tokens (the kernel benchmark's document spreads and
real-corpus lengths, see benchmarks/corpus.py) and every cp size in ``--cp``, per ownership
strategy (``contiguous``, ``dual_chunk``, ``ptrr`` = PyTorch's processing-time round-robin,
``old_sparse`` = plain LPT + pairwise improvement, the placement ``balance="sparse"`` had before
session 17, kept here only as a helper, the current ``sparse`` and ``sparse@0.01``, the same
with ``plan(tolerance=0.01)``):

* work imbalance (max / mean live 128-tiles per rank);
* the largest per-rank remote K/V (needed chunks the rank does not own, in tokens), beside the
  lower bound no placement beats, max over documents of (length - tokens per rank);
* K/V bytes moved per forward pass by the mask-aware exchange (and by an all-gather);
* bytes crossing node boundaries (``--gpus-per-node`` GPUs a node), flat and hierarchical.

Then sliding-window layers on the same placement (``--windows``; ``CPPlan.windowed``): their work
imbalance, remote K/V and traffic with the dual_chunk and the sparse placement of the full mask,
beside the imbalance of a sparse placement planned for the windowed mask itself. Then planning
time of ``plan()`` (one thread) at ``--plan-tokens``. Writes benchmarks/results/balance.md,
balance.json and balance.png.

    python benchmarks/balance.py                              # 128K tokens, cp 8 32 128 (~15 s here)
    python benchmarks/balance.py --tokens 16384 --cp 2 4 8 --plan-tokens 16384    # quick
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashmask3.masks as M  # noqa: E402
from benchmarks.corpus import document_spreads  # noqa: E402
from flashmask3.distributed import plan  # noqa: E402
from flashmask3.distributed.plan import _default_chunk_size, chunk_liveness  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GIB = float(1 << 30)
STRATEGIES = ("contiguous", "dual_chunk", "ptrr", "old_sparse", "sparse", "sparse@0.01")
#: ``plan(tolerance=...)`` of the strategies named ``sparse@<tolerance>``.
TIGHT = 0.01


def kv_bytes_per_token(kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """K and V of one token (batch 1)."""
    return 2 * kv_heads * head_dim * elem_bytes


def old_sparse_owner(work: np.ndarray, cp: int) -> np.ndarray:
    """The pre-session-17 ``sparse``: longest-processing-time greedy (heaviest chunk to the
    lightest rank with room), then swaps between the heaviest rank and the others while one
    lowers the larger of the two loads. Balances tiles only; kept as the benchmark's baseline."""
    n = len(work)
    per = n // cp
    owner = np.empty(n, dtype=np.int64)
    count = [0] * cp
    heap = [(0, r) for r in range(cp)]
    for c in np.argsort(-work, kind="stable"):
        load, r = heapq.heappop(heap)
        owner[c] = r
        count[r] += 1
        if count[r] < per:
            heapq.heappush(heap, (load + int(work[c]), r))
    members = np.stack([np.flatnonzero(owner == r) for r in range(cp)])
    for _ in range(4 * n + 100):
        w = work[members]
        loads = w.sum(1)
        h = int(np.argmax(loads))
        d = w[h][None, :, None] - w[:, None, :]
        ok = (d > 0) & (d < (loads[h] - loads)[:, None, None])
        ok[h] = False
        if not ok.any():
            break
        new_max = np.maximum(loads[h] - d, loads[:, None, None] + d)
        o, a, b = np.unravel_index(np.argmin(np.where(ok, new_max, np.iinfo(np.int64).max)), ok.shape)
        members[h, a], members[o, b] = members[o, b], members[h, a]
    for r in range(cp):
        owner[members[r]] = r
    return owner


def layout_metrics(owner: np.ndarray, work: np.ndarray, live: np.ndarray, cp: int, chunk: int,
                   gpus_per_node: int) -> dict:
    """Imbalance, largest remote K/V and traffic (tokens) of one ownership, from first
    principles (the plans' own accounting is cross-checked against these in :func:`measure`)."""
    members = np.stack([np.flatnonzero(owner == r) for r in range(cp)])
    loads = work[members].sum(1).astype(np.float64)
    need = live[members].any(1)                                     # [P, n]
    remote = need & (owner[None, :] != np.arange(cp)[:, None])
    g = min(gpus_per_node, cp)
    node = np.arange(cp) // g
    far = remote & (node[owner][None, :] != node[:, None])
    per_node = far.reshape(cp // g, g, -1).any(1)                   # [nodes, n]: one copy per node
    return {
        "imbalance": float(loads.max() / loads.mean()) if loads.sum() else 1.0,
        "max_remote_tokens": int(remote.sum(1).max()) * chunk,
        "kv_tokens": int(remote.sum()) * chunk,
        "xnode_tokens_flat": int(far.sum()) * chunk,
        "xnode_tokens_hier": int(per_node.sum()) * chunk,
    }


def measure(doc_lens, cp: int, gpus_per_node: int, bpt: int) -> dict:
    """One row: every strategy's balance and traffic for one mask and cp size."""
    mask = M.causal_document_mask(doc_lens)
    s = mask.seqlen_q
    row = {"cp": cp, "docs": len(doc_lens), "sparsity": mask.sparsity(),
           "lower_bound_tokens": max(0, max(doc_lens) - s // cp),
           "kv_gib_allgather": cp * (s - s // cp) * bpt / GIB,
           "xnode_gib_allgather": (s * (cp - min(gpus_per_node, cp))) * bpt / GIB}
    hier = cp > gpus_per_node and cp % gpus_per_node == 0
    for strategy in STRATEGIES:
        balance = "sparse" if strategy.startswith(("old_sparse", "sparse")) else strategy
        kw = {"tolerance": TIGHT} if strategy == f"sparse@{TIGHT}" else {}
        chunk = _default_chunk_size(s, cp, balance, 128)
        t0 = time.perf_counter()
        if strategy == "old_sparse":
            work, live = chunk_liveness(mask.startend_row_indices, True, s, chunk)
            owner = old_sparse_owner(work, cp)
        else:
            p = plan(mask, None, cp, balance=balance, **kw)
            work, live, owner = p.chunk_work, p.chunk_live, p.owner
        seconds = time.perf_counter() - t0
        m = layout_metrics(owner, work, live, cp, chunk, gpus_per_node)
        if strategy != "old_sparse":  # the plan's own accounting agrees
            assert m["kv_tokens"] == p.kv_tokens_moved("overlap")
            assert m["max_remote_tokens"] == p.max_remote_kv_tokens
            assert m["xnode_tokens_flat"] == p.cross_node_transfers("overlap", min(gpus_per_node, cp)) * chunk
            if hier:
                ph = plan(mask, None, cp, balance=balance, nodes=cp // gpus_per_node, **kw)
                assert np.array_equal(ph.owner, p.owner)
                assert m["xnode_tokens_hier"] == ph.cross_node_transfers("overlap") * chunk
        row[f"chunk_{strategy}"] = chunk
        row[f"imbalance_{strategy}"] = m["imbalance"]
        row[f"max_remote_tokens_{strategy}"] = m["max_remote_tokens"]
        row[f"kv_gib_overlap_{strategy}"] = m["kv_tokens"] * bpt / GIB
        row[f"xnode_gib_flat_{strategy}"] = m["xnode_tokens_flat"] * bpt / GIB
        row[f"xnode_gib_hier_{strategy}"] = m["xnode_tokens_hier"] * bpt / GIB
        row[f"seconds_{strategy}"] = seconds
    return row


def measure_windows(doc_lens, cp: int, windows, gpus_per_node: int, bpt: int) -> list[dict]:
    """Rows of sliding-window layers (each window) on the dual_chunk and the sparse placement
    of the full mask (``CPPlan.windowed``), with the windowed mask's own sparse placement's
    imbalance for comparison."""
    mask = M.causal_document_mask(doc_lens)
    rows = []
    for balance in ("dual_chunk", "ptrr", "sparse"):
        p = plan(mask, None, cp, balance=balance)
        full_kv = p.kv_tokens_moved("overlap") * bpt / GIB
        for w in windows:
            pw = p.windowed(w)
            m = layout_metrics(pw.owner, pw.chunk_work, pw.chunk_live, cp, pw.chunk_size, gpus_per_node)
            assert m["kv_tokens"] == pw.kv_tokens_moved("overlap")  # the plan's own accounting agrees
            own = plan(M.with_window(mask, w), None, cp, balance=balance, chunk_size=p.chunk_size)
            rows.append({"cp": cp, "docs": len(doc_lens), "balance": balance, "window": w,
                         "imbalance": m["imbalance"], "imbalance_own_placement": own.imbalance,
                         "max_remote_tokens": m["max_remote_tokens"],
                         "kv_gib_overlap": m["kv_tokens"] * bpt / GIB, "kv_gib_overlap_full_mask": full_kv,
                         "xnode_gib_flat": m["xnode_tokens_flat"] * bpt / GIB})
    return rows


def windows_markdown(windows: dict, args) -> list[str]:
    """The sliding-window section of balance.md."""
    lines = [
        "",
        "## Sliding-window layers on the same placement (`CPPlan.windowed`)",
        "",
        "A model mixing sliding-window and full layers keeps one token placement; each window layer runs "
        "the full mask limited to its window (query i keeps keys [i − w, i]) on it. Imbalance = max/mean "
        "live tiles of the window layer per rank on the full mask's placement; 'own' = the same "
        "strategy planned for the windowed mask itself (what sharing the placement costs). K/V GiB per "
        "forward pass as above, beside the full-mask layer's.",
        "",
        "| spread | docs | cp | placement | window | imbalance | own | max remote K/V | K/V GiB "
        "| full-mask K/V GiB | x-node GiB flat |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spread, rows in windows.items():
        for r in rows:
            lines.append(f"| {spread} | {r['docs']} | {r['cp']} | {r['balance']} | {r['window']} "
                         f"| {r['imbalance']:.3f} | {r['imbalance_own_placement']:.3f} "
                         f"| {_k(r['max_remote_tokens'])} | {r['kv_gib_overlap']:.2f} "
                         f"| {r['kv_gib_overlap_full_mask']:.2f} | {r['xnode_gib_flat']:.2f} |")
    return lines


def planning_times(tokens_list, cps, spreads, heads, seed: int, repeats: int = 5) -> list[dict]:
    """Wall and CPU seconds of ``plan(..., balance="sparse")`` (one torch thread), ``repeats``
    plans per cell in a row, only the last one kept (as a planning worker runs): the median and
    the slowest, since Python's full garbage collections land on some plans and not others."""
    out = []
    for tokens in tokens_list:
        docs = document_spreads(tokens, seed=seed)
        for cp in cps:
            for spread in spreads:
                for hm in heads:
                    mask = M.causal_document_mask(docs[spread], num_heads=hm)
                    walls, cpus, p = [], [], None
                    for _ in range(repeats):
                        w0, c0 = time.perf_counter(), time.process_time()
                        p = plan(mask, None, cp, balance="sparse")
                        walls.append(time.perf_counter() - w0)
                        cpus.append(time.process_time() - c0)
                    wall, cpu = statistics.median(walls), statistics.median(cpus)
                    out.append({"tokens": tokens, "cp": cp, "spread": spread, "mask_heads": hm,
                                "chunk": p.chunk_size, "imbalance": p.imbalance, "repeats": repeats,
                                "wall_seconds": wall, "cpu_seconds": cpu, "max_wall_seconds": max(walls)})
                    print(f"plan {tokens:8d} tokens cp={cp:4d} {spread:6s} Hm={hm}: {wall:.3f} s wall "
                          f"(max {max(walls):.3f}), {cpu:.3f} s CPU, imbalance {p.imbalance:.3f}", flush=True)
    return out


def _span(values: list, fmt: str) -> str:
    """``min-max`` of ``values``, each formatted with ``fmt``."""
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def _k(x: int) -> str:
    return f"{x / 1024:.1f}K"


def markdown(results: dict, timing: list, meta: dict, args, windows: dict = None) -> str:
    lines = [
        f"# Context-parallel placement — causal document masks, {args.tokens} tokens",
        "",
        f"Generated {meta['date']} on {meta['machine']} (torch {meta['torch']}, numpy {meta['numpy']}) by",
        f"`{meta['command']}`.",
        "",
        f"Work = live 128×128 tiles per rank; imbalance = max/mean. Remote K/V = needed K/V chunks a rank "
        "does not own (tokens; what it must receive each pass); LB = max over documents of (length − tokens "
        "per rank), which no placement can beat. K/V GiB per forward pass for batch 1, "
        f"{args.kv_heads} KV heads × D={args.head_dim}, {args.elem_bytes}-byte elements (fwd+bwd moves 3× this). "
        f"Cross-node: {args.gpus_per_node} GPUs a node, flat routing vs hierarchical (one copy per node). "
        "Chunks: contiguous S/P, dual_chunk S/2P, ptrr one 128-token tile (PyTorch's processing-time round-robin, "
        "`_PTRRLoadBalancer`, which torch pairs with all-gather), sparse up to 16 per rank (128-aligned; "
        f"`sparse` stops at 4% above the mean work, the default, `sparse@{TIGHT}` at 1%); `old_sparse` = "
        "plain LPT + pairwise improvement on the sparse chunks (the placement before session 17).",
        "",
        "| spread | docs | cp | strategy | chunk | imbalance | max remote K/V | × dual | LB | K/V GiB "
        "| x-node GiB flat | x-node GiB hier |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spread, rows in results.items():
        for r in rows:
            dual = r["max_remote_tokens_dual_chunk"]
            for s in STRATEGIES:
                rem = r[f"max_remote_tokens_{s}"]
                hier = r[f"xnode_gib_hier_{s}"] if r["cp"] > args.gpus_per_node else None
                bold = "**" if s == "sparse" else ""
                lines.append(
                    f"| {spread} | {r['docs']} | {r['cp']} | {bold}{s}{bold} | {r[f'chunk_{s}']} "
                    f"| {bold}{r[f'imbalance_{s}']:.3f}{bold} | {bold}{_k(rem)}{bold} "
                    f"| {rem / dual if dual else float('nan'):.2f} | {_k(r['lower_bound_tokens'])} "
                    f"| {r[f'kv_gib_overlap_{s}']:.2f} | {r[f'xnode_gib_flat_{s}']:.2f} "
                    f"| {'—' if hier is None else format(hier, '.2f')} |")
            lines.append(f"| {spread} | {r['docs']} | {r['cp']} | allgather | — | — | — | — | — "
                         f"| {r['kv_gib_allgather']:.2f} | {r['xnode_gib_allgather']:.2f} | — |")
    rows = [r for rs in results.values() for r in rs]
    imb = max(r["imbalance_sparse"] for r in rows)
    ratio = max(r["max_remote_tokens_sparse"] / max(1, r["max_remote_tokens_dual_chunk"]) for r in rows)
    t = f"sparse@{TIGHT}"
    lines += [
        "",
        f"Targets (sparse): imbalance ≤ 1.05 — worst {imb:.3f} ({'met' if imb <= 1.05 else 'NOT met'}); "
        f"max remote K/V ≤ 1.1× dual_chunk's — worst {ratio:.2f}× ({'met' if ratio <= 1.1 else 'NOT met'}). "
        f"{t}: imbalance worst {max(r[f'imbalance_{t}'] for r in rows):.3f}, max remote K/V "
        f"{_span([r[f'max_remote_tokens_{t}'] / max(1, r['max_remote_tokens_sparse']) for r in rows], '.2f')}× "
        f"sparse's, total K/V {_span([r[f'kv_gib_overlap_{t}'] / r['kv_gib_overlap_sparse'] for r in rows], '.2f')}× "
        f"sparse's. ptrr: imbalance {_span([r['imbalance_ptrr'] for r in rows], '.3f')}, max remote K/V "
        f"{_span([r['max_remote_tokens_ptrr'] / max(1, r['max_remote_tokens_sparse']) for r in rows], '.1f')}× "
        "sparse's.",
    ] + (windows_markdown(windows, args) if windows else []) + [
        "",
        "## Planning time (`plan(mask, None, cp)`, balance=\"sparse\", one torch thread; wall and process CPU)",
        "",
        f"Each cell plans {args.plan_repeats} times in a row keeping only the last plan (as a planning worker "
        "does): the median and the slowest wall time, and the median CPU time.",
        "",
        "| tokens | cp | spread | mask heads | chunk | imbalance | wall s | max wall s | CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in timing:
        lines.append(f"| {t['tokens']} | {t['cp']} | {t['spread']} | {t['mask_heads']} | {t['chunk']} "
                     f"| {t['imbalance']:.3f} | {t['wall_seconds']:.3f} "
                     f"| {t['max_wall_seconds']:.3f} | {t['cpu_seconds']:.3f} |")
    lines += ["", f"Load average at start: {meta['load']} on {meta['cores']} cores (the machine is shared)."]
    return "\n".join(lines) + "\n"


def plot(results: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spreads = list(results)
    fig, axes = plt.subplots(3, len(spreads), figsize=(4.2 * len(spreads), 10), squeeze=False)
    for j, spread in enumerate(spreads):
        rows = results[spread]
        cps = [r["cp"] for r in rows]
        for i, s in enumerate(STRATEGIES):
            style = dict(color=f"C{i}", marker="os^Dvx"[i], label=s)
            axes[0, j].plot(cps, [r[f"imbalance_{s}"] for r in rows], **style)
            axes[1, j].plot(cps, [r[f"max_remote_tokens_{s}"] / 1024 for r in rows], **style)
            xr = [r for r in rows if r["cp"] > args.gpus_per_node]
            if xr and s in ("dual_chunk", "sparse"):
                axes[2, j].plot([r["cp"] for r in xr], [r[f"xnode_gib_flat_{s}"] for r in xr], ls="--",
                                color=f"C{i}", marker="os^Dvx"[i], label=f"{s} flat")
                axes[2, j].plot([r["cp"] for r in xr], [r[f"xnode_gib_hier_{s}"] for r in xr], ls="-",
                                color=f"C{i}", marker="os^Dvx"[i], label=f"{s} hier")
        axes[1, j].plot(cps, [r["lower_bound_tokens"] / 1024 for r in rows], "k:", label="lower bound")
        axes[0, j].axhline(1.05, color="k", lw=0.8, ls=":")
        axes[0, j].set(title=f"{spread}: work imbalance", yscale="log")
        axes[1, j].set(title=f"{spread}: max remote K/V (K tokens)")
        axes[2, j].set(title=f"{spread}: cross-node K/V GiB / fwd", yscale="log")
        for ax in axes[:, j]:
            ax.set_xscale("log")
            ax.set_xticks(cps)
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel("cp size")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--elem-bytes", type=int, default=2)
    ap.add_argument("--windows", type=int, nargs="*", default=[1024, 4096],
                    help="sliding windows (keys before the query) of the window-layer table")
    ap.add_argument("--plan-tokens", type=int, nargs="*", default=[131072, 524288, 1048576])
    ap.add_argument("--plan-cp", type=int, nargs="*", default=[8, 128])
    ap.add_argument("--plan-spreads", nargs="*", default=["mixed", "corpus"])
    ap.add_argument("--plan-heads", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--plan-repeats", type=int, default=5, help="plans per planning-time cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # "one core": also keeps torch's thread pool out of the timings
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'})",
            "cores": os.cpu_count(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "torch": torch.__version__, "numpy": np.__version__,
            "command": "python benchmarks/balance.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                          " " + " ".join(sys.argv[1:] if argv is None else argv))}
    bpt = kv_bytes_per_token(args.kv_heads, args.head_dim, args.elem_bytes)
    results, windows = {}, {}
    for spread, lens in document_spreads(args.tokens, seed=args.seed).items():
        results[spread], windows[spread] = [], []
        for cp in args.cp:
            row = measure(lens, cp, args.gpus_per_node, bpt)
            results[spread].append(row)
            print(f"{spread:7s} cp={cp:4d} imbalance " + " ".join(f"{s}={row[f'imbalance_{s}']:.3f}" for s in STRATEGIES)
                  + "  max remote K " + " ".join(f"{s}={row[f'max_remote_tokens_{s}'] / 1024:.1f}" for s in STRATEGIES)
                  + f"  LB={row['lower_bound_tokens'] / 1024:.1f}", flush=True)
            if args.windows:
                windows[spread] += measure_windows(lens, cp, args.windows, args.gpus_per_node, bpt)
    timing = planning_times(args.plan_tokens, args.plan_cp, args.plan_spreads, args.plan_heads, args.seed,
                            args.plan_repeats)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "balance.json"), "w") as f:
        json.dump({"meta": meta, "args": vars(args), "results": results, "windows": windows,
                   "planning": timing}, f, indent=1)
    with open(os.path.join(args.out, "balance.md"), "w") as f:
        f.write(markdown(results, timing, meta, args, windows))
    plot(results, args, os.path.join(args.out, "balance.png"))
    print(f"wrote {args.out}/balance.md, balance.json, balance.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
