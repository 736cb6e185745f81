"""Multi-GPU context-parallel benchmark driver (run by benchmarks/multigpu.sh).

Subcommands:

* ``attention`` (under torchrun, one process per GPU; gloo on CPU): CP attention forward+backward
  over all ranks for causal document masks (synthetic spreads + real-corpus lengths, see
  benchmarks/corpus.py) and plain causal, at each ``--tokens``, for

  - ``dual_chunk+allgather``  (the standard baseline),
  - ``sparse+allgather``      (our balancing, baseline communication),
  - ``sparse+overlap``        (ours: balancing + mask-aware overlapped exchange rounds),
  - ``flex_cp``               (PyTorch ``context_parallel`` with FlexAttention, the outside
    reference; guarded: if it cannot run, the reason is recorded),

  reporting time/iteration (slowest rank) and effective TFLOP/s per GPU (the FLOP convention of docs/masks.md).
  With ``--check`` (default for <= 16K tokens) every method's output is compared with
  single-process attention on the full sequence.
* ``report``: merge the attention JSON and the training summaries into
  benchmarks/results/cp_multigpu.{json,md,png} with machine, GPU count, date, versions, command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashmask3.masks as M  # noqa: E402
from benchmarks.corpus import document_spreads  # noqa: E402
from benchmarks.environment import run_environment  # noqa: E402
from flashmask3 import flashmask_attention  # noqa: E402
from flashmask3.distributed import BACKWARD_CALL_MODES, cp_flashmask_attention, plan  # noqa: E402
from flashmask3.distributed.placement import DEFAULT_TOLERANCE  # noqa: E402
from flashmask3.distributed.program import resolve_backward_calls  # noqa: E402
from flashmask3.masks import attention_flops  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OURS = {"dual_chunk+allgather": ("dual_chunk", "allgather"),
        "sparse+allgather": ("sparse", "allgather"),
        "sparse+overlap": ("sparse", "overlap")}
METHODS = tuple(OURS) + ("flex_cp",)


# -- process group -----------------------------------------------------------------------------


def init(device_kind: str, timeout_s: float):
    """Join the torchrun group: NCCL + one GPU per rank on CUDA, gloo on CPU."""
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun (benchmarks/multigpu.sh does)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, device, warmup: int, iters: int) -> tuple[float, float]:
    """``(seconds, host seconds)``: medians over iterations of the slowest rank's time for
    ``step()`` (synchronised) and of the time its host took to return from ``step()`` before
    synchronising (the host's issue work: the exchange's calls, the launches; a step whose
    host is the bottleneck shows it as both)."""
    for _ in range(warmup):
        step()
    times, hosts = [], []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t_host = time.perf_counter() - t0
        _sync(device)
        t = torch.tensor([time.perf_counter() - t0, t_host], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t[0]))
        hosts.append(float(t[1]))
    return statistics.median(times), statistics.median(hosts)


# -- masks and inputs --------------------------------------------------------------------------


def masks_for(tokens: int, spreads: list[str], seed: int):
    """(name, FlashMask or None for plain causal, doc lengths or None) for each spread."""
    docs = document_spreads(tokens, seed=seed)
    for name in spreads:
        if name == "causal":
            yield name, None, None
        else:
            yield name, M.causal_document_mask(docs[name]), docs[name]


def random_inputs(tokens, args, device, dtype, seed):
    """q, k, v, dout of ``tokens`` tokens drawn on ``device`` (same seed -> same tensors on
    every rank, so they can serve as the global sequence)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape_q = (1, tokens, args.heads, args.head_dim)
    shape_k = (1, tokens, args.kv_heads, args.head_dim)
    return [torch.randn(s, generator=g, device=device, dtype=dtype) for s in (shape_q, shape_k, shape_k, shape_q)]


def flops(mask, tokens, args) -> float:
    cols = None if mask is None else mask.startend_row_indices
    return attention_flops(cols, True, batch_size=1, num_heads=args.heads, seqlen_q=tokens,
                           seqlen_k=tokens, head_dim=args.head_dim, mode="fwd_bwd")


# -- our methods -------------------------------------------------------------------------------


def run_ours(method, mask, tokens, rank, world, device, dtype, args, check: bool) -> dict:
    balance, comm = OURS[method]
    dev_mask = None if mask is None else mask.to(device)
    t0 = time.perf_counter()
    p = plan(dev_mask, None if mask is not None else True, world, balance=balance,
             seqlen=tokens if mask is None else None, tolerance=args.tolerance)
    plan_s = time.perf_counter() - t0
    # Timing needs only this rank's shard (random, seeded per rank): no global tensors.
    ql, kl, vl, dol = random_inputs(p.local_seqlen, args, device, dtype, args.seed + 1000 * rank)
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))

    def step():
        out = cp_flashmask_attention(ql, kl, vl, p, comm=comm, backward_calls=args.backward_calls)
        out.backward(dol)
        ql.grad = kl.grad = vl.grad = None

    sec, host = time_steps(step, device, args.warmup, args.iters)
    res = {"seconds": sec, "host_seconds": host, "plan_seconds": plan_s, "imbalance": p.imbalance,
           "chunk_size": p.chunk_size, "backward_calls": resolve_backward_calls(args.backward_calls, p),
           "keep_kv": True,  # cp_flashmask_attention's default
           "kv_bytes_fwd": (p.kv_tokens_moved(comm) * 2 * args.kv_heads * args.head_dim
                            * torch.finfo(dtype).bits // 8)}
    if check:
        res["max_abs_err"] = check_ours(p, comm, mask, tokens, rank, device, dtype, args)
    return res


def check_ours(p, comm, mask, tokens, rank, device, dtype, args) -> float:
    """Max |CP output - single-process output| over the whole sequence (all ranks agree)."""
    q, k, v, _ = random_inputs(tokens, args, device, dtype, args.seed + 1)
    out = cp_flashmask_attention(p.shard(q, rank), p.shard(k, rank), p.shard(v, rank), p, comm=comm,
                                 backward_calls=args.backward_calls)
    parts = [torch.empty_like(out) for _ in range(p.cp_size)]
    dist.all_gather(parts, out.contiguous())
    full = p.unshard(parts)
    ref = flashmask_attention(q, k, v, mask.to(device) if mask is not None else None, causal=mask is None)
    err = (full.float() - ref.float()).abs().max()
    return float(err)


# -- the outside reference: torch context_parallel + FlexAttention -----------------------------


def run_flex_cp(mask, docs, tokens, rank, world, device, dtype, args, check: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (_context_parallel_shard,
                                                                  _ContextParallel)
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    if docs is not None:
        doc_id = torch.repeat_interleave(torch.arange(len(docs), device=device),
                                         torch.tensor(docs, device=device))

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_id[q_idx] == doc_id[kv_idx])
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    # Compiled on CUDA: the eager builder materialises tokens^2 booleans.
    block_mask = create_block_mask(mask_mod, 1, 1, tokens, tokens, device=device,
                                   _compile=device.type == "cuda")
    balancer, balancer_note = _flex_balancer(block_mask, docs, tokens, world, device)
    flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention

    class FlexAttention(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    attn = parallelize_module(FlexAttention(), mesh,
                              _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in random_inputs(tokens, args, device, dtype, args.seed))
    ql, kl, vl, dol, bm = _context_parallel_shard(mesh, [q, k, v, do, block_mask], [2, 2, 2, 2, 2],
                                                  load_balancer=balancer)
    res = {"balancer": balancer_note}
    if check:  # forward only, before timing: also validates the reference on CPU (no flex backward there)
        with torch.no_grad():
            out = attn(ql, kl, vl, block_mask=bm)
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.contiguous())
        full = torch.empty_like(q)
        full[:, :, balancer._generate_indices()[0]] = torch.cat(parts, dim=2)
        ref = flashmask_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                  mask.to(device) if mask is not None else None, causal=mask is None)
        res["max_abs_err"] = float((full.transpose(1, 2).float() - ref.float()).abs().max())
    ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))

    def step():
        out = attn(ql, kl, vl, block_mask=bm)
        out.backward(dol)
        ql.grad = kl.grad = vl.grad = None

    try:
        res["seconds"], res["host_seconds"] = time_steps(step, device, max(args.warmup, 1), args.iters)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    return res


def _flex_balancer(block_mask, docs, tokens, world, device):
    """torch's strongest applicable load balancer: processing-time round robin over the block
    mask (PTRR) for document masks, head-tail (= dual chunk) for plain causal or as fallback."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    if docs is not None:
        try:
            from torch.distributed.tensor.experimental._attention import _PTRRLoadBalancer

            balancer = _PTRRLoadBalancer(block_mask, world)
            balancer._generate_indices()
            return balancer, "PTRR"
        except Exception as exc:  # older torch, or a shape it rejects
            note = f"head-tail (PTRR unavailable: {type(exc).__name__}: {exc})"
            return _HeadTailLoadBalancer(tokens, world, device), note
    return _HeadTailLoadBalancer(tokens, world, device), "head-tail"


# -- the attention subcommand ------------------------------------------------------------------


def environment(device, world) -> dict:
    """The common run environment plus the process-group facts of this run."""
    env = run_environment(device)
    env.update({"device": device.type, "world_size": world,
                "backend": dist.get_backend() if dist.is_initialized() else None,
                "nccl_env": {v: os.environ.get(v) for v in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                             "NVSHMEM_DISABLE_NVLS")}})
    if device.type == "cuda":
        v = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return env


def cmd_attention(args) -> int:
    rank, world, device = init(args.device, args.timeout_s)
    dtype = DTYPES[args.dtype]
    start = time.perf_counter()
    out = {"args": vars(args), "env": environment(device, world), "runs": []}
    try:
        for tokens in args.tokens:
            if tokens % world:
                raise ValueError(f"--tokens {tokens} is not divisible by the {world} ranks")
            check = args.check if args.check is not None else tokens <= 16384
            masks = list(masks_for(tokens, args.spreads, args.seed))
            # Our methods on every mask first; the outside reference (which compiles) after them,
            # so that a tight --budget-s still covers every mask with ours.
            groups = [[m for m in args.methods if m != "flex_cp"], [m for m in args.methods if m == "flex_cp"]]
            for methods, (name, mask, docs) in ((g, m) for g in groups for m in masks):
                fl = flops(mask, tokens, args)
                for method in methods:
                    rec = {"tokens": tokens, "mask": name, "method": method, "flops_fwd_bwd": fl,
                           "docs": None if docs is None else len(docs),
                           "sparsity": 0.5 if mask is None else mask.sparsity()}
                    if time.perf_counter() - start > args.budget_s:
                        rec["skipped"] = f"time budget of {args.budget_s}s spent"
                    else:
                        try:
                            if method == "flex_cp":
                                rec.update(run_flex_cp(mask, docs, tokens, rank, world, device, dtype, args, check))
                            else:
                                rec.update(run_ours(method, mask, tokens, rank, world, device, dtype, args, check))
                            if "seconds" in rec:
                                rec["tflops_per_gpu"] = fl / rec["seconds"] / world / 1e12
                        except Exception as exc:  # recorded, e.g. flex CP unavailable
                            if method != "flex_cp":
                                raise
                            rec["error"] = f"{type(exc).__name__}: {exc}"
                            if rank == 0:
                                traceback.print_exc()
                    out["runs"].append(rec)
                    if rank == 0:
                        _print_run(rec)
                        _dump(out, args.json)
    finally:
        dist.destroy_process_group()
    return 0


def _print_run(rec):
    if "seconds" in rec:
        extra = f"  err {rec['max_abs_err']:.2e}" if "max_abs_err" in rec else ""
        print(f"{rec['tokens']:>7} {rec['mask']:8s} {rec['method']:22s} {rec['seconds'] * 1e3:9.2f} ms  "
              f"{rec['tflops_per_gpu']:7.1f} TFLOP/s/GPU{extra}", flush=True)
    else:
        extra = f"  (forward err {rec['max_abs_err']:.2e})" if "max_abs_err" in rec else ""
        print(f"{rec['tokens']:>7} {rec['mask']:8s} {rec['method']:22s} "
              f"{rec.get('error') or rec.get('skipped')}{extra}", flush=True)


def _dump(obj, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


# -- the report subcommand ---------------------------------------------------------------------


def _train_summaries(paths):
    out = {}
    for spec in paths:
        label, _, path = spec.partition("=")
        try:
            with open(path) as f:
                out[label] = json.load(f)
        except (OSError, ValueError) as exc:
            out[label] = {"error": f"no summary at {path}: {exc}"}
    return out


def markdown(rep: dict) -> str:
    env = rep["attention"].get("env", {})
    lines = ["# Multi-GPU context parallelism", "",
             f"{env.get('gpu_count', env.get('world_size'))} × {env.get('gpu', env.get('device'))} on "
             f"`{env.get('host')}`, {env.get('date')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"NCCL {env.get('nccl', '—')}, CUDA {env.get('cuda', '—')}. World size {env.get('world_size')}.",
             "", f"Command: `{rep.get('command', '')}`", "",
             "## Attention forward+backward (bf16 unless stated; time = slowest rank, median)", "",
             "Host ms = the slowest rank's time to return from the step before synchronising (its "
             "issue work); '—' in files written before session 32.", "",
             "| tokens | mask | docs | method | ms / iter | host ms | TFLOP/s per GPU | max err vs 1-GPU |",
             "|---|---|---|---|---|---|---|---|"]
    runs = rep["attention"].get("runs", [])
    mask_order = {m: i for i, m in enumerate(dict.fromkeys(r["mask"] for r in runs))}
    method_order = {m: i for i, m in enumerate(METHODS)}
    runs = sorted(runs, key=lambda r: (r["tokens"], mask_order[r["mask"]], method_order.get(r["method"], 99)))
    for r in runs:
        if "seconds" in r:
            err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else "—"
            host = f"{r['host_seconds'] * 1e3:.2f}" if "host_seconds" in r else "—"
            lines.append(f"| {r['tokens']} | {r['mask']} | {r['docs'] or '—'} | {r['method']} | "
                         f"{r['seconds'] * 1e3:.2f} | {host} | {r['tflops_per_gpu']:.1f} | {err} |")
        else:
            err = f"forward err {r['max_abs_err']:.1e}; " if "max_abs_err" in r else ""
            lines.append(f"| {r['tokens']} | {r['mask']} | {r['docs'] or '—'} | {r['method']} | — | — | — | "
                         f"{err}{(r.get('error') or r.get('skipped') or '')[:120]} |")
    lines += ["", "## End-to-end training (flashmask3.train CLI)", "",
              "| run | tokens/s | step time s | attention share | note |", "|---|---|---|---|---|"]
    for label, s in rep.get("train", {}).items():
        if "error" in s:
            lines.append(f"| {label} | — | — | — | {s['error'][:120]} |")
            continue
        tps, step, share = s.get("tokens_per_s"), s.get("step_time_s"), s.get("attention_share")
        note = f"{s.get('balance')}+{s.get('comm')}, seq {s.get('seq_len')}, {s.get('world_size')} ranks"
        lines.append(f"| {label} | {tps:,.0f} | {step:.3f} | "
                     f"{'—' if share is None else f'{100 * share:.1f}%'} | {note} |" if tps
                     else f"| {label} | — | — | — | no tokens/s in summary |")
    base = rep.get("train", {})
    if all(k in base and base[k].get("tokens_per_s") for k in ("baseline", "ours")):
        lines += ["", f"Training speed-up (ours / baseline): "
                      f"{base['ours']['tokens_per_s'] / base['baseline']['tokens_per_s']:.3f}×"]
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rep["attention"].get("runs", []) if "seconds" in r]
    if not runs:
        return
    tokens = sorted({r["tokens"] for r in runs})
    fig, axes = plt.subplots(1, len(tokens), figsize=(6 * len(tokens), 4), squeeze=False)
    for ax, t in zip(axes[0], tokens):
        masks = list(dict.fromkeys(r["mask"] for r in runs if r["tokens"] == t))
        methods = list(dict.fromkeys(r["method"] for r in runs if r["tokens"] == t))
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            ys = [next((r["tflops_per_gpu"] for r in runs if r["tokens"] == t and r["mask"] == mk
                        and r["method"] == m), 0.0) for mk in masks]
            ax.bar([x + i * width for x in range(len(masks))], ys, width=width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(masks))], masks)
        ax.set(title=f"{t} tokens", ylabel="effective TFLOP/s per GPU (fwd+bwd)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_report(args) -> int:
    try:
        with open(args.attention_json) as f:
            attention = json.load(f)
    except (OSError, ValueError) as exc:
        attention = {"error": f"no attention results at {args.attention_json}: {exc}", "runs": []}
    rep = {"command": args.command_line or " ".join(sys.argv), "attention": attention,
           "train": _train_summaries(args.train or [])}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "cp_multigpu")
    with open(base + ".json", "w") as f:
        json.dump(rep, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(rep))
    plot(rep, base + ".png")
    print(f"wrote {base}.json/.md/.png")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("attention", help="CP attention fwd+bwd timing (under torchrun)")
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--tokens", type=int, nargs="+", default=[131072, 524288])
    a.add_argument("--spreads", nargs="+", default=["corpus", "short", "mixed", "long", "causal"])
    a.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    a.add_argument("--backward-calls", choices=list(BACKWARD_CALL_MODES), default="auto",
                   help="the overlap backward's attention calls (docs/cp-runtime.md 'Backward calls')")
    a.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="sparse placement tolerance (plan(tolerance=); recorded: the scale model "
                        "rebuilds these plans with it)")
    a.add_argument("--heads", type=int, default=16)
    a.add_argument("--kv-heads", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    a.add_argument("--warmup", type=int, default=2)
    a.add_argument("--iters", type=int, default=5)
    a.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="compare with single-process attention (default: tokens <= 16384)")
    a.add_argument("--budget-s", type=float, default=300.0, help="skip remaining runs after this")
    a.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--json", default=os.path.join(RESULTS, "cp_multigpu_attention.json"))
    r = sub.add_parser("report", help="merge results into cp_multigpu.{json,md,png}")
    r.add_argument("--attention-json", default=os.path.join(RESULTS, "cp_multigpu_attention.json"))
    r.add_argument("--train", nargs="*", help="LABEL=path/to/summary.json entries")
    r.add_argument("--command-line", default=None, help="the exact command that produced the results")
    r.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.cmd == "attention":
        if args.dtype is None:
            args.dtype = "bfloat16" if args.device == "cuda" else "float32"
        return cmd_attention(args)
    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
