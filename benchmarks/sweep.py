"""The shared parts of the per-mask kernel sweeps (backward_modes.py, backward_configs.py):
their command line, the inputs of one case (mask, Q/K/V, the forward's O/LSE, dO), and a loop
over head dims x masks that stops starting cases after a time budget and rewrites the JSON
after every case, so a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from benchmarks.environment import run_environment


@dataclass
class BackwardCase:
    """One mask's inputs for timing backward kernels (the forward already run)."""

    batch: int
    cols: Optional[torch.Tensor]
    causal: bool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    flops_bwd: float


def backward_case(name: str, s: int, d: int, hq: int, hk: int, dtype, *, device: str,
                  total_tokens: int, seed: int) -> BackwardCase:
    """Mask ``name`` at length ``s`` (batch = total_tokens / s), random Q/K/V/dO, the Triton
    forward's O and LSE, and the backward's FLOPs (DESIGN.md convention)."""
    from benchmarks.kernel import build_mask
    from flashmask3.kernels import triton_flashmask as T
    import flashmask3.masks as M

    batch = total_tokens // s
    mask, causal, _ = build_mask(name, s, batch)
    cols = None if mask is None else mask.to(device).startend_row_indices
    causal = causal if mask is None else mask.causal
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(batch, s, h, d, device=device, dtype=dtype, generator=g)
               for h in (hq, hk, hk))
    scale = 1 / math.sqrt(d)
    out, lse = T.forward(q, k, v, cols, causal, scale)
    flops = M.attention_flops(cols, causal, batch_size=batch, num_heads=hq, seqlen_q=s,
                              seqlen_k=s, head_dim=d, mode="bwd")
    return BackwardCase(batch, cols, causal, q, k, v, scale, out, lse, torch.randn_like(out),
                        flops)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp32: how far a variant's gradient is from the reference's."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def time_with_result(fn: Callable[[], tuple], flops: float,
                     bench: Callable) -> tuple[dict, Optional[tuple]]:
    """(ms and TFLOP/s, ``fn()``'s tensors) of one configured kernel call timed with ``bench``
    (``benchmarks.kernel.bench``'s contract); an error (out of shared memory etc.) is recorded
    instead, with no tensors, so one failing variant does not end the sweep."""
    try:
        result = fn()
        ms, _ = bench(fn)
        return dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12), result
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}, None


def sweep_parser(description: str, masks: list[str]) -> argparse.ArgumentParser:
    """--masks, --seqlen, --dims, --budget-s, --out (a script adds its own checks)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--masks", type=lambda x: x.split(","), default=masks)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--dims", type=lambda x: [int(v) for v in x.split(",")], default=[128])
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default="benchmarks/results")
    return ap


def parse_sweep_args(ap: argparse.ArgumentParser, argv, listed_dims) -> argparse.Namespace:
    """The parsed arguments; --dims must name only head dims the script lists variants for
    (``listed_dims``), else the usual argparse error naming them."""
    args = ap.parse_args(argv)
    if set(args.dims) - set(listed_dims):
        ap.error(f"--dims: variants are listed for head dims {sorted(listed_dims)}, got {args.dims}")
    return args


def run_sweep(args, argv, name: str, run_case: Callable[[str, int, int], dict],
              describe: Callable[[dict], str], markdown: Callable[[list, dict], str]) -> list:
    """``run_case(mask, S, D)`` for every (D, mask) until ``args.budget_s``; writes
    ``{name}.json`` (meta + results, after every case) and ``{name}.md`` under ``args.out``.
    ``name`` is also the script's (``benchmarks/{name}.py``), ``argv`` its arguments (None:
    the command line), for the recorded command."""
    meta = dict(run_environment(torch.device("cuda")), dtype="bf16",
                command=" ".join([f"python benchmarks/{name}.py"]
                                 + list(sys.argv[1:] if argv is None else argv)))
    os.makedirs(args.out, exist_ok=True)
    results, t0 = [], time.time()
    for d in args.dims:
        for m in args.masks:
            if time.time() - t0 > args.budget_s:
                break
            results.append(run_case(m, args.seqlen, d))
            print(f"[{time.time() - t0:5.0f}s] D={d} {m:24s} {describe(results[-1])}", flush=True)
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(dict(meta=meta, results=results), f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(markdown(results, meta))
    return results
