"""End-to-end training throughput on one GPU: flashmask3 (split or fused backward), Flex, SDPA.

The same ~0.6B-parameter Llama-style byte-level model (``bench-0.6b`` preset of
:mod:`flashmask3.train.config`: dim 1536, 24 layers, 12 query / 4 KV heads of 128, SwiGLU 4096,
activation checkpointing per block, bf16 autocast, AdamW) trains on the *same* packed batches of
the default corpus (stdlib sources + /usr/share/doc, whole files as documents, causal document
mask) at each sequence length, once per attention backend. Only the attention callable differs.

Per (sequence length, backend): ``--warmup`` steps (compilation, autotuning, allocator warm-up)
are excluded, then ``--steps`` timed steps. Reported: tokens/s, model TFLOP/s (6·N·tokens plus
the attention forward+backward FLOPs of :func:`flashmask3.masks.attention_flops`, no recompute),
attention share of the step time, peak memory, mask sparsity, and the speed-up of flashmask3
over flex. SDPA needs the dense ``S x S`` mask: above ``--sdpa-max-seq`` it is reported as
skipped, and an out-of-memory error in any backend is reported as ``OOM`` instead of crashing.

    python benchmarks/train.py --out $OUT                      # one H200, ~3-4 minutes
    python benchmarks/train.py --toy                           # CPU smoke test, tiny model

``--loader-ab`` measures the harness itself instead (``flashmask3.train.train``, the real loop
and its batch loader): the step time with the next batch packed, masked and copied to the
device in the loader's background thread (``prefetch``) vs inside the step (``--no-prefetch``),
flashmask3 attention, same batches; plus the host time of packing one batch and of planning it
for CP 8 (the work the loader takes off the step at cp > 1). Writes ``harness_<tag>.json/.md``.

    python benchmarks/train.py --loader-ab --seq-lens 131072 --out $OUT/harness   # one H200
    python benchmarks/train.py --loader-ab --toy                                  # CPU

``--graph-ab`` measures the harness's ``--cuda-graph`` mode (the whole step captured once and
replayed per batch, :mod:`flashmask3.train.graphed`) against the eager loop, same batches, on a
small model (``GRAPH_AB_MODEL``) at short sequences, where the step is host-bound: step time of
each, the speed-up, and the largest loss difference between the two runs. Writes
``graph_<tag>.json/.md``. Needs a GPU.

    python benchmarks/train.py --graph-ab --seq-lens 2048 4096 8192 --out $OUT/graph
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import run_environment  # noqa: E402
from flashmask3.train.attention import AttentionTimer, attention_available  # noqa: E402
from flashmask3.train.config import from_preset  # noqa: E402
from flashmask3.train.data import make_packer, mask_sparsity  # noqa: E402
from flashmask3.train.model import (Transformer, active_matmul_params,  # noqa: E402
                                    count_parameters, model_flops_per_step)
from flashmask3.train.loader import make_group_plan, prepare_batch  # noqa: E402
from flashmask3.train.parallel import DistEnv, Layout  # noqa: E402
from flashmask3.train.trainer import build_optimizer, train, train_step  # noqa: E402

#: the optional variants last (budget): flashmask3 with its backward pinned to one mode
BACKENDS = ("flashmask3", "flex", "sdpa", "flashmask3-fused", "flashmask3-split")
#: run when --backends is not given (flashmask3 with the library's default backward: the fused
#: Gluon kernel at D=128 (since v6.5) and D=64 (v6.6) on Hopper, else split)
DEFAULT_BACKENDS = ("flashmask3", "flex", "sdpa")
#: benchmark backend -> (attention backend, flashmask3 Triton backward)
_ATTENTION = {"flashmask3": ("flashmask3", "auto"), "flashmask3-fused": ("flashmask3", "fused"),
              "flashmask3-split": ("flashmask3", "split"),
              "flex": ("flex", "auto"), "sdpa": ("sdpa", "auto")}
#: the pinned-backward variants and their labels in the speed-up lines
_PINNED_LABEL = {"flashmask3-fused": "fused backward", "flashmask3-split": "split backward"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help="sequence lengths (default 32768 131072; --toy: 512 1024)")
    p.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS), choices=BACKENDS)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    p.add_argument("--sdpa-max-seq", type=int, default=32768,
                   help="longest sequence for the dense-mask SDPA baseline")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="start no new run after this many seconds (results so far are kept)")
    p.add_argument("--toy", action="store_true", help="tiny model on CPU (smoke test)")
    p.add_argument("--out", default="benchmarks/results",
                   help="directory for train_<tag>.json / .md")
    p.add_argument("--tag", default=None, help="file tag (default h200, or cpu_toy)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder block for every backend (the harness's "
                        "--compile); attention is then not timed")
    p.add_argument("--loader-ab", action="store_true",
                   help="the harness's step time, batch prepared in the loader vs in the step")
    p.add_argument("--graph-ab", action="store_true",
                   help="the harness's step time, eager vs --cuda-graph (small model; a GPU)")
    args = p.parse_args(argv)
    for name in ("steps", "warmup"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            p.error(f"--{name} is too small")
    return args


def bench_config(seq_len: int, toy: bool):
    """The benchmark model at ``seq_len`` (the ``bench-0.6b`` preset, or a toy one on CPU)."""
    if toy:
        return from_preset("tiny", seq_len=seq_len, batch_size=1, dim=64, n_layers=2,
                           n_heads=4, n_kv_heads=2, ffn_dim=128, device="cpu",
                           activation_checkpointing=True)
    return from_preset("bench-0.6b", seq_len=seq_len, device="cuda")


def make_batches(cfg, n: int):
    """``n`` packed batches of the default corpus (the same ones for every backend)."""
    packer = make_packer(cfg)
    return [packer.next_batch() for _ in range(n)]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_backend(cfg, backend: str, batches, warmup: int, device: torch.device,
                compiled: bool = False) -> dict:
    """Train ``len(batches)`` steps with one backend; time the steps after ``warmup``.
    ``compiled``: each block under torch.compile (``Transformer.compile_blocks``), no attention
    timer (its marks cannot sit inside a compiled graph)."""
    env = DistEnv(0, 1, device)
    torch.manual_seed(cfg.seed)
    with torch.device(device):  # initialise in place (0.6B params: no CPU round trip)
        model = Transformer(cfg)
    if compiled:
        torch._dynamo.reset()  # every backend compiles from scratch (its warm-up steps)
        model.compile_blocks()
    optimizer = build_optimizer(model, cfg)
    timer = AttentionTimer(device, not compiled)
    attention, backward = _ATTENTION[backend]
    from flashmask3.kernels.dispatch import use_backward

    with use_backward(backward):
        return _timed_steps(cfg.replace(attention=attention, attention_backward=backward), model,
                            optimizer, batches, warmup, env, timer, device)


def _timed_steps(cfg, model, optimizer, batches, warmup: int, env, timer, device) -> dict:
    times, attn, flops, losses = [], [], 0.0, []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, host_batch in enumerate(batches):
        batch = prepare_batch(host_batch, cfg, env)  # before the timer: packing is not timed
        t0 = time.perf_counter()
        metrics = train_step(model, optimizer, batch, cfg, env, timer, cfg.lr)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        a = timer.collect()
        losses.append(metrics["loss"])
        if i >= warmup:
            times.append(dt)
            attn.append(a)
            attn_flops = host_batch.mask.flops(cfg.n_heads, cfg.head_dim, "fwd_bwd")
            flops += model_flops_per_step(cfg, host_batch.tokens.numel(), attn_flops)
    total = sum(times)
    tokens = sum(b.tokens.numel() for b in batches[warmup:])
    out = {"status": "ok", "tokens_per_s": tokens / total, "step_time_s": total / len(times),
           "model_tflops": flops / total / 1e12,
           "attention_share": sum(attn) / total if timer.enabled else None,
           "losses": losses}
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del model, optimizer
    return out


def _cleanup(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.toy else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/train.py needs a CUDA GPU (use --toy for a CPU smoke test)",
              file=sys.stderr)
        return 2
    seq_lens = args.seq_lens or ([512, 1024] if args.toy else [32768, 131072])
    tag = args.tag or ("cpu_toy" if args.toy else "h200")
    if args.graph_ab:
        if device.type != "cuda":
            print("--graph-ab needs a CUDA GPU (CUDA graphs)", file=sys.stderr)
            return 2
        return graph_ab(args, device, args.seq_lens or [2048, 4096, 8192], args.tag or "h200")
    if args.loader_ab:
        if args.toy:  # 2 intra-op threads on a shared 2-core host spin ~10x slower (NOTES s17)
            torch.set_num_threads(1)
        return loader_ab(args, device, seq_lens, tag)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = run_environment(device)
    report = {"date": env["date"], "device": env.get("gpu", "cpu"), "torch": env["torch"],
              "triton": env["triton"] or "not installed", "command": env["command"],
              "commit": env["commit"],
              "steps": args.steps, "warmup": args.warmup, "compiled_blocks": args.compile, "runs": []}
    t_start = time.perf_counter()
    for seq_len in seq_lens:
        cfg = bench_config(seq_len, args.toy)
        batches = make_batches(cfg, args.warmup + args.steps)
        pairs = sum(b.mask.unmasked_pairs() for b in batches[args.warmup:])
        dense = sum(b.mask.batch_size * seq_len * seq_len for b in batches[args.warmup:])
        with torch.device("meta"):
            n_params = count_parameters(Transformer(cfg))
        report["model"] = (f"{n_params / 1e9:.2f}B-param byte-level Llama (dim {cfg.dim}, "
                           f"{cfg.n_layers} layers, GQA {cfg.n_heads}:{cfg.n_kv_heads}, "
                           f"hd {cfg.head_dim}, SwiGLU {cfg.resolved_ffn_dim()})")
        common = {"seq_len": seq_len, "params": n_params,
                  "active_matmul_params": active_matmul_params(cfg),
                  "docs_per_sequence": sum(len(d) for b in batches for d in b.doc_lens)
                  / sum(len(b.doc_lens) for b in batches),
                  "mask_sparsity": 1 - pairs / dense,
                  "mask_skipped_vs_causal": sum(mask_sparsity(b.mask)["skipped_vs_causal"]
                                                for b in batches[args.warmup:]) / args.steps}
        for backend in args.backends:
            row = {**common, "backend": backend}
            reason = attention_available(_ATTENTION[backend][0], device, training=True)
            if backend in _PINNED_LABEL and device.type != "cuda":
                reason = "the backward choice is an option of the Triton kernel (CUDA only)"
            if backend == "sdpa" and seq_len > args.sdpa_max_seq:
                reason = (f"dense S x S mask ({seq_len ** 2 / 2**30:.0f} GiB bool) and O(S^2) "
                          f"work above --sdpa-max-seq={args.sdpa_max_seq}")
            if time.perf_counter() - t_start > args.budget_s:
                reason = f"time budget --budget-s={args.budget_s:.0f} used up"
            if reason:
                row.update(status="skipped", reason=reason)
            else:
                try:
                    row.update(run_backend(cfg, backend, batches, args.warmup, device, args.compile))
                except Exception as exc:  # one failing backend must not lose the others
                    if _is_oom(exc):
                        row.update(status="OOM", reason=str(exc).splitlines()[0][:200])
                    else:
                        traceback.print_exc()
                        row.update(status="error", reason=f"{type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
            _cleanup(device)
            report["runs"].append(row)
            print(_row_line(row), flush=True)
            _write(report, out_dir, tag)
    _add_speedups(report)
    _write(report, out_dir, tag)
    print(markdown(report))
    return 0


def _row_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"S={r['seq_len']:>6} {r['backend']:>10}: {r['status']} ({r.get('reason', '')})"
    return (f"S={r['seq_len']:>6} {r['backend']:>10}: {r['tokens_per_s']:>10,.0f} tok/s  "
            f"{r['model_tflops']:7.1f} TFLOP/s  attention {_share(r)}  "
            f"step {r['step_time_s']:.3f}s" + (f"  peak {r['peak_mem_gib']:.1f} GiB"
                                               if "peak_mem_gib" in r else ""))


def _share(r: dict) -> str:
    share = r.get("attention_share")
    return "n/a" if share is None else f"{100 * share:.1f}%"


def _add_speedups(report: dict) -> None:
    """flashmask3 tokens/s over flex (and over sdpa) per sequence length."""
    by = {(r["seq_len"], r["backend"]): r for r in report["runs"]}
    report["speedup_vs_flex"], report["speedup_vs_sdpa"] = {}, {}
    for (s, b), r in by.items():
        if b != "flashmask3" and b not in _PINNED_LABEL or r["status"] != "ok":
            continue
        label = str(s) if b == "flashmask3" else f"{s} ({_PINNED_LABEL[b]})"
        for other, key in (("flex", "speedup_vs_flex"), ("sdpa", "speedup_vs_sdpa")):
            o = by.get((s, other))
            if o and o["status"] == "ok":
                report[key][label] = r["tokens_per_s"] / o["tokens_per_s"]


def markdown(report: dict) -> str:
    lines = [f"# End-to-end training throughput ({report['device']}, {report['date']})", "",
             f"torch {report['torch']}, triton {report.get('triton', '?')}; command: "
             f"`{report.get('command', '?')}` (commit {report.get('commit') or '?'})", ""] + (
                 [f"Note: {report['note']}", ""] if report.get("note") else []) + [
             f"{report.get('model', '')}, bf16 autocast on GPU, "
             "activation checkpointing, AdamW; default corpus, causal document mask; "
             + ("each block under torch.compile (attention not timed); " if report.get("compiled_blocks") else "") +
             f"{report['warmup']} warm-up + {report['steps']} timed steps.", "",
             "| S | backend | tokens/s | model TFLOP/s | attention share | peak GiB | "
             "mask sparsity | status |", "|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if r["status"] == "ok":
            lines.append(f"| {r['seq_len']} | {r['backend']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['model_tflops']:.1f} | {_share(r)} | "
                         f"{r.get('peak_mem_gib', float('nan')):.1f} | "
                         f"{100 * r['mask_sparsity']:.1f}% | ok |")
        else:
            lines.append(f"| {r['seq_len']} | {r['backend']} | - | - | - | - | "
                         f"{100 * r['mask_sparsity']:.1f}% | "
                         f"{r['status']}: {r.get('reason', '')} |")
    for key, label in (("speedup_vs_flex", "flex"), ("speedup_vs_sdpa", "sdpa")):
        for s, v in report.get(key, {}).items():
            lines.append(f"\nflashmask3 / {label} at S={s}: **{v:.2f}x** tokens/s")
    return "\n".join(lines) + "\n"


def _write(report: dict, out_dir: Path, tag: str) -> None:
    (out_dir / f"train_{tag}.json").write_text(json.dumps(report, indent=2))
    (out_dir / f"train_{tag}.md").write_text(markdown(report))


# -- the harness's loader: batch prepared in a background thread vs inside the step ----------

def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def host_batch_costs(cfg, repeats: int = 3, cp: int = 8) -> dict:
    """Host seconds (median of ``repeats``) to pack one batch, and to plan it for ``cp`` ranks
    (sparse and dual_chunk): the work the loader thread takes off the step."""
    packer = make_packer(cfg)
    pack, plans = [], {"sparse": [], "dual_chunk": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch = packer.next_batch()
        pack.append(time.perf_counter() - t0)
        for balance in plans:
            env = DistEnv(0, 1, torch.device("cpu"), layout=Layout(1, cp))
            t0 = time.perf_counter()
            make_group_plan(batch.mask, cfg.replace(balance=balance), env)
            plans[balance].append(time.perf_counter() - t0)
    return {"pack_s": _median(pack), "cp": cp,
            **{f"plan_{b}_s": _median(v) for b, v in plans.items()}}


def train_harness(cfg) -> dict:
    """Train ``cfg`` with the harness (``flashmask3.train.train``) in a temporary directory: its
    mean step time (after ``warmup_exclude``), tokens/s, every step's time and loss; an error is
    reported, not raised (the other runs' numbers are kept)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        try:
            summary = train(cfg.replace(out_dir=tmp))
            rows = [line.split(",") for line in (Path(tmp) / "losses.csv").read_text().splitlines()[1:]]
        except Exception as exc:
            traceback.print_exc()
            return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    return {"status": "ok", "step_time_s": summary["step_time_s"], "tokens_per_s": summary["tokens_per_s"],
            "step_times_s": [float(r[4]) for r in rows], "losses": [float(r[1]) for r in rows],
            "loss_last": summary["loss_last"]}


def harness_ab(args, device, seq_lens, tag: str, name: str, base_of, variants: dict, compare, markdown,
               **header) -> int:
    """Train the harness (``flashmask3.train.train``) on ``base_of(seq_len)`` with each of
    ``variants`` (key -> config changes) on the same batches, per length; ``compare(row)`` adds
    the row's comparison. Writes ``<name>_<tag>.json/.md`` (after each length, so a cut-off run
    keeps what it measured) and prints the table."""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = run_environment(device)
    report = {"date": env["date"], "device": env.get("gpu", "cpu"), "torch": env["torch"],
              "triton": env["triton"] or "not installed", "command": env["command"],
              "commit": env["commit"], "steps": args.steps, "warmup": args.warmup, **header, "runs": []}
    path = out_dir / f"{name}_{tag}"
    t_start = time.perf_counter()
    for seq_len in seq_lens:
        base = base_of(seq_len).replace(
            steps=args.warmup + args.steps, warmup_exclude=args.warmup, checkpoint_every=0,
            resume=False, progress=False, plot=False, log_every=10 ** 6, time_attention=False)
        row = {"seq_len": seq_len}
        for key, changes in variants.items():
            if time.perf_counter() - t_start > args.budget_s:
                row[key] = {"status": "skipped", "reason": "time budget used up"}
                continue
            row[key] = train_harness(base.replace(**changes))
            _cleanup(device)
        compare(row, base)
        report["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in variants}), flush=True)
        path.with_suffix(".json").write_text(json.dumps(report, indent=2))
    path.with_suffix(".json").write_text(json.dumps(report, indent=2))
    path.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


def loader_ab(args, device, seq_lens, tag) -> int:
    """The harness with ``prefetch`` off and on, per length, plus the host cost of one batch."""
    def base_of(seq_len):
        return bench_config(seq_len, args.toy).replace(cp=1, dp=1, attention="flashmask3")

    def compare(row, base):
        row["host"] = host_batch_costs(base)
        a, b = row["in_step"], row["in_loader"]
        if a.get("status") == "ok" and b.get("status") == "ok":
            row["saved_s_per_step"] = a["step_time_s"] - b["step_time_s"]
            row["saved_fraction"] = row["saved_s_per_step"] / a["step_time_s"]

    return harness_ab(args, device, seq_lens, tag, "harness", base_of,
                      {"in_step": {"prefetch": False}, "in_loader": {"prefetch": True}}, compare,
                      loader_markdown)


def loader_markdown(report: dict) -> str:
    lines = [f"# Harness step time: batch prepared in the loader vs in the step "
             f"({report['device']}, {report['date']})", "",
             f"torch {report['torch']}, triton {report['triton']}; command: "
             f"`{report['command']}` (commit {report['commit'] or '?'}); cp 1, flashmask3, "
             f"{report['warmup']} warm-up + {report['steps']} timed steps.", "",
             "| S | step, prepared in step (s) | step, prepared in loader (s) | saved/step | "
             "host: pack (s) | host: plan cp 8 sparse / dual_chunk (s) |",
             "|---|---|---|---|---|---|"]
    for r in report["runs"]:
        a, b, h = r.get("in_step", {}), r.get("in_loader", {}), r["host"]
        fmt = lambda x: f"{x['step_time_s']:.4f}" if x.get("status") == "ok" else \
            x.get("status", "-")  # noqa: E731
        saved = (f"{1000 * r['saved_s_per_step']:.1f} ms ({100 * r['saved_fraction']:.1f}%)"
                 if "saved_s_per_step" in r else "-")
        lines.append(f"| {r['seq_len']} | {fmt(a)} | {fmt(b)} | {saved} | {h['pack_s']:.4f} | "
                     f"{h['plan_sparse_s']:.4f} / {h['plan_dual_chunk_s']:.4f} |")
    return "\n".join(lines) + "\n"


# -- the harness's --cuda-graph mode vs its eager loop --------------------------------------------

#: The model of --graph-ab: small enough that a short-sequence step is host-bound (8 blocks of
#: D=128 attention, GQA 4:2, 23.9M parameters with the byte vocabulary).
GRAPH_AB_MODEL = dict(dim=512, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=1408)


def graph_ab(args, device, seq_lens, tag) -> int:
    """The harness eager and with ``cuda_graph`` on the same batches, per length."""
    def base_of(seq_len):
        return from_preset("tiny", **GRAPH_AB_MODEL, seq_len=seq_len, batch_size=1, warmup_steps=2,
                           device="cuda")

    def compare(row, base):
        a, b = row["eager"], row["graphed"]
        if a.get("status") == "ok" and b.get("status") == "ok":
            row["speedup"] = a["step_time_s"] / b["step_time_s"]
            row["max_loss_rel_diff"] = max(abs(x / y - 1) for x, y in zip(b["losses"], a["losses"]))

    return harness_ab(args, device, seq_lens, tag, "graph", base_of,
                      {"eager": {"cuda_graph": False}, "graphed": {"cuda_graph": True}}, compare,
                      graph_markdown, model=GRAPH_AB_MODEL)


def graph_markdown(report: dict) -> str:
    m = report["model"]
    lines = [f"# Harness step time: eager vs the step captured in a CUDA graph ({report['device']}, "
             f"{report['date']})", "",
             f"torch {report['torch']}, triton {report['triton']}; command: `{report['command']}` "
             f"(commit {report['commit'] or '?'}). Model: dim {m['dim']}, {m['n_layers']} layers, "
             f"{m['n_heads']}:{m['n_kv_heads']} heads of {m['dim'] // m['n_heads']}, SwiGLU {m['ffn_dim']}, "
             f"byte vocabulary; batch 1, causal document masks of the default corpus (a new mask "
             f"every step); flashmask3 attention, bf16 autocast, AdamW. Mean step time over "
             f"{report['steps']} steps after {report['warmup']} (the graphed run's first step "
             "captures), each step synchronised (the harness's timer).", "",
             "| S | eager step (ms) | graphed step (ms) | speed-up | largest loss difference |",
             "|---|---|---|---|---|"]
    for r in report["runs"]:
        a, b = r["eager"], r["graphed"]
        fmt = lambda x: f"{1000 * x['step_time_s']:.2f}" if x.get("status") == "ok" else \
            x.get("status", "-")  # noqa: E731
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        diff = f"{100 * r['max_loss_rel_diff']:.3f}%" if "max_loss_rel_diff" in r else "-"
        lines.append(f"| {r['seq_len']} | {fmt(a)} | {fmt(b)} | {speed} | {diff} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
