"""A/B on the GPU: longest-first program order (the default) against grid order
(``FLASHMASK3_LAUNCH_ORDER=grid``) on uneven document masks.

Both arms run in one process, interleaved: the knob is read at import, so the script sets
``tiles.LAUNCH_ORDER`` between arms (each arm's plans are cached apart). Times are
``triton.testing.do_bench`` medians (ms) of the forward and of forward + backward
(``torch.autograd.grad``) of one ``flashmask_attention`` call, bf16; the outputs and gradients
of the two arms are compared (equal bit for bit but for the fused backward's atomic dQ).
Writes ``order_ab.json`` and ``order_ab.md`` under ``--out`` with the GPU, torch, triton,
date and command. ``--dry-run`` (CPU): build the masks and plans and print how many blocks
each order table moves, time nothing (the interpreter builds them: keep --seqlen small).

    python benchmarks/order_ab.py --out benchmarks/results            # on the GPU
    python benchmarks/order_ab.py --seqlen 1024 --mean-docs 128 --dry-run   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashmask3  # noqa: E402
import flashmask3.masks as M  # noqa: E402
from flashmask3.kernels import tiles  # noqa: E402

ARMS = ("longest", "grid")


def masks(seqlen: int, means: list[int], device) -> list[tuple[str, object]]:
    """(label, FlashMask): random causal documents of each mean length, one long document
    among short ones, and bidirectional random documents of the first mean length."""
    out = [(f"causal docs mean {m}", M.causal_document_mask(
        M.random_document_lengths(seqlen, m, seed=m), device=device)) for m in means]
    short = max(seqlen // 64, 1)
    lens = [seqlen // 2] + [short] * ((seqlen - seqlen // 2) // short)
    lens[-1] += seqlen - sum(lens)
    out.append(("causal: one long doc, short docs", M.causal_document_mask(lens, device=device)))
    out.append((f"docs mean {means[0]}", M.document_mask(
        M.random_document_lengths(seqlen, means[0], seed=1), device=device)))
    return out


def _set_order(order: str) -> None:
    tiles.LAUNCH_ORDER = order


def _inputs(args, device):
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.seqlen)
    q = torch.randn(*shape, args.heads, args.head_dim, device=device, dtype=torch.bfloat16,
                    generator=g)
    k, v = (torch.randn(*shape, args.kv_heads, args.head_dim, device=device,
                        dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    return [x.requires_grad_() for x in (q, k, v)], dout


def _fwd(q, k, v, mask):
    return flashmask3.flashmask_attention(q, k, v, mask)


def _fwd_bwd(q, k, v, mask, dout):
    return torch.autograd.grad(_fwd(q, k, v, mask), (q, k, v), dout)


def _moved(mask, seqlen: int) -> dict:
    """Blocks that each plan's order table (forward, dK/dV, dQ: the plans one call builds,
    ``triton_backend.preprocess``, at the dispatch tiles of the mask's device) moves off
    grid order, as "moved/total"."""
    from flashmask3.kernels import triton_backend as T

    _set_order("longest")
    plans = T.preprocess(mask.startend_row_indices, mask.causal, seqlen, seqlen, 128,
                         torch.bfloat16)
    out = {}
    for name, p in zip(("fwd", "dkdv", "dq"), plans):
        if p.c == 0 or p.order is None:
            continue
        grid = torch.arange(p.order.shape[1], device=p.order.device)
        out[name] = f"{int((p.order != grid).sum())}/{p.order.numel()}"
    return out


def time_case(label, mask, args, device) -> dict:
    (q, k, v), dout = _inputs(args, device)
    from triton.testing import do_bench

    results, times = {}, {f"{a}_{p}": [] for a in ARMS for p in ("fwd", "fwd_bwd")}
    for arm in ARMS:
        _set_order(arm)
        results[arm] = (_fwd(q, k, v, mask),) + _fwd_bwd(q, k, v, mask, dout)
    for _ in range(args.rounds):  # interleaved rounds
        for arm in ARMS:
            _set_order(arm)
            times[f"{arm}_fwd"].append(do_bench(lambda: _fwd(q, k, v, mask)))
            times[f"{arm}_fwd_bwd"].append(do_bench(lambda: _fwd_bwd(q, k, v, mask, dout)))
    _set_order("longest")
    row = dict(mask=label, **{k: statistics.median(t) for k, t in times.items()})
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["longest"], results["grid"]):
        row[f"{name}_equal"] = bool(torch.equal(a, b))
    row["fwd_speedup"] = row["grid_fwd"] / row["longest_fwd"]
    row["fwd_bwd_speedup"] = row["grid_fwd_bwd"] / row["longest_fwd_bwd"]
    return row


def _markdown(env: dict, args, rows: list[dict]) -> str:
    lines = ["# Launch order A/B: longest-first vs grid order",
             "",
             f"{env.get('gpu')}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
             f"B={args.batch}, S={args.seqlen}, {args.heads}/{args.kv_heads} heads, "
             f"D={args.head_dim}, bf16. Command: `{env['command']}`",
             "",
             "| mask | fwd grid / longest ms | speedup | fwd+bwd grid / longest ms | speedup "
             "| equal out/dq/dk/dv |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        eq = "/".join("y" if r[f"{n}_equal"] else "n" for n in ("out", "dq", "dk", "dv"))
        lines.append(f"| {r['mask']} | {r['grid_fwd']:.3f} / {r['longest_fwd']:.3f} | "
                     f"{r['fwd_speedup']:.3f}x | {r['grid_fwd_bwd']:.3f} / "
                     f"{r['longest_fwd_bwd']:.3f} | {r['fwd_bwd_speedup']:.3f}x | {eq} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="folder for order_ab.{json,md}")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mean-docs", type=int, nargs="+", default=[4096, 1024, 256],
                    help="mean document lengths of the random causal document masks")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: build the masks and plans, print the blocks each order moves")
    args = ap.parse_args(argv)
    if args.dry_run:
        for label, mask in masks(args.seqlen, args.mean_docs, "cpu"):
            print(json.dumps(dict(mask=label, moved=_moved(mask, args.seqlen))),
                  flush=True)
        return 0
    if not torch.cuda.is_available():
        ap.error("timing needs a CUDA GPU (--dry-run runs on the CPU)")
    device = torch.device("cuda")
    rows = []
    for label, mask in masks(args.seqlen, args.mean_docs, device):
        rows.append(time_case(label, mask, args, device))
        print(json.dumps(rows[-1]), flush=True)
    from benchmarks.environment import run_environment

    env = run_environment(device)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "order_ab.json"), "w") as f:
        json.dump(dict(meta=env, args=vars(args), rows=rows), f, indent=1)
    with open(os.path.join(args.out, "order_ab.md"), "w") as f:
        f.write(_markdown(env, args, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
