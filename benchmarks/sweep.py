"""The shared driver of the per-mask kernel sweeps (backward_modes.py, backward_configs.py):
their command line, and a loop over head dims x masks that stops starting cases after a time
budget and rewrites the JSON after every case, so a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Callable

import torch


def sweep_parser(description: str, masks: list[str]) -> argparse.ArgumentParser:
    """--masks, --seqlen, --dims, --budget-s, --out (a script adds its own checks)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--masks", type=lambda x: x.split(","), default=masks)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--dims", type=lambda x: [int(v) for v in x.split(",")], default=[128])
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default="benchmarks/results")
    return ap


def run_sweep(args, argv, name: str, run_case: Callable[[str, int, int], dict],
              describe: Callable[[dict], str], markdown: Callable[[list, dict], str]) -> list:
    """``run_case(mask, S, D)`` for every (D, mask) until ``args.budget_s``; writes
    ``{name}.json`` (meta + results, after every case) and ``{name}.md`` under ``args.out``.
    ``name`` is also the script's (``benchmarks/{name}.py``), ``argv`` its arguments (None:
    the command line), for the recorded command."""
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                torch=torch.__version__, triton=triton.__version__, dtype="bf16",
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
