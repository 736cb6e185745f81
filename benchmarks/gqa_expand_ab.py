"""A/B on the GPU: the GQA backward with K/V expanded to the query heads (``expands_kv_heads``)
against the grouped launch, at the shapes where the grouped grid leaves SMs idle: a context-
parallel stage (16K query rows of a rank against 1-4K keys), 32 query / 4 KV heads, D=128, bf16.
Times are GPU time of ``torch.autograd.grad`` of one call (median of CUDA-event timed calls,
interleaved A/B), with the forward included; gradients of both are compared.

    python benchmarks/gqa_expand_ab.py --out $OUT/gqa-expand     # on the GPU
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
from benchmarks.host_path import gpu_ms  # noqa: E402
from flashmask3.kernels import triton_backend as T  # noqa: E402


def _case(sq: int, sk: int, hq: int, hk: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, sq, hq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, sk, hk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    cols = None  # full attention of the rows to this stage's keys (the grid does not depend on it)
    return [x.requires_grad_() for x in (q, k, v)], cols, torch.randn_like(q)


def _use(counts) -> None:
    """Run the next calls with ``counts`` as the SM count (None: the grouped backward); the
    prepared calls decided with the old one are forgotten (they decide once per signature)."""
    T.sm_count = counts
    flashmask3.api.clear_prepared()


def _grads(q, k, v, cols, dout):
    out = flashmask3.flashmask_attention(q, k, v, cols)
    return torch.autograd.grad(out, (q, k, v), dout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gqa-expand")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    real = T.sm_count
    for sq, sk, hq, hk in ((16384, 1024, 32, 4), (16384, 2048, 32, 4), (8192, 1024, 32, 8)):
        (q, k, v), cols, dout = _case(sq, sk, hq, hk, seed=sk + hk)
        launch = T.dispatch.choose(q.device, q.dtype, 128, False, 0).backward[0]
        on = T.expands_kv_heads(launch, 1, hq, hk, sk, q.device)
        res = {}
        for name, counts in (("expanded", real), ("grouped", lambda device: None)):
            _use(counts)
            res[name] = _grads(q, k, v, cols, dout)
        _use(real)
        err = max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                  for a, b in zip(res["expanded"], res["grouped"]))
        times = {"expanded": [], "grouped": []}
        for _ in range(3):  # interleaved rounds
            for name, counts in (("expanded", real), ("grouped", lambda device: None)):
                _use(counts)
                times[name].append(gpu_ms(lambda: _grads(q, k, v, cols, dout), [], reps=9))
        _use(real)
        row = dict(Sq=sq, Sk=sk, Hq=hq, Hk=hk, rule_expands=on,
                   expanded_ms=statistics.median(times["expanded"]),
                   grouped_ms=statistics.median(times["grouped"]), max_rel_diff=err)
        row["speedup"] = row["grouped_ms"] / row["expanded_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    from benchmarks.environment import run_environment
    with open(os.path.join(args.out, "gqa_expand_ab.json"), "w") as f:
        json.dump(dict(meta=dict(run_environment(torch.device("cuda")), command=" ".join(sys.argv)),
                       rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
