"""A/B of two source trees of flashmask3 on the same cells, in one run, interleaved.

The generic A/B tool: each tree runs in its own worker process (``PYTHONPATH=<tree>``), the
parent sends both workers the same cells in alternating order (A B, then B A, ...) and each
worker builds the same inputs from the same seeds and times them with the same timer
(``triton.testing.do_bench``, median, host launch work included). The result is the ratio
``time(B) / time(A)`` per cell (median over rounds). Cells: one causal, one causal-document and
one non-causal C=4 mask (global + sliding window) at D = 64, 128, 256, forward and
forward+backward, bf16, one length.

    python benchmarks/ab_trees.py --a old_tree --b . --out $OUT/ab.json           # on the GPU
    python benchmarks/ab_trees.py --a old_tree --b . --dry-run --out /tmp/ab.json  # CPU check

``--dry-run`` runs the same protocol on the CPU under the Triton interpreter at a tiny size
with a wall-clock timer (a check that both trees load and agree, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

MASKS = ("causal", "causal_document", "global_sliding_window")
PASSES = ("fwd", "fwd_bwd")


# ---------------------------------------------------------------------------------------------
# Worker (one per tree): reads one JSON command per line, answers one JSON line
# ---------------------------------------------------------------------------------------------


def _mask(M, name: str, s: int, batch: int, device):
    """(mask argument, causal) of cell mask ``name`` (the same in every tree)."""
    if name == "causal":
        return None, True
    if name == "causal_document":
        lens = M.random_document_lengths(s, max(16, s // 8), seed=s)
        return M.causal_document_mask(lens, batch_size=batch, device=device), True
    if name == "global_sliding_window":
        return M.global_sliding_window_mask(s, max(4, s // 64), (s // 8, s // 8),
                                            batch_size=batch, device=device), False
    raise ValueError(f"unknown mask {name}")


class _Cell:
    def __init__(self, fm, M, cell: dict, device, dtype):
        import torch

        s, d, b = cell["S"], cell["D"], cell["B"]
        h = max(1, cell["hidden"] // d)
        g = torch.Generator(device=device).manual_seed(1000 * d + len(cell["mask"]))
        self.q, self.k, self.v = (torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g)
                                  .requires_grad_() for _ in range(3))
        self.dout = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g)
        self.mask, self.causal = _mask(M, cell["mask"], s, b, device)
        if self.mask is not None and cell["mask"] == "global_sliding_window":
            assert self.mask.startend_row_indices.shape[-1] == 4 and not self.mask.causal
        self.fm = fm

    def fwd(self):
        kw = {} if self.mask is not None else {"causal": self.causal}
        return self.fm.flashmask_attention(self.q, self.k, self.v, self.mask, **kw)

    def fwd_bwd(self):
        import torch

        out = self.fwd()
        return torch.autograd.grad(out, (self.q, self.k, self.v), self.dout)


def _timer(dry_run: bool):
    if dry_run:
        def wall(fn):
            fn()
            t = time.perf_counter()
            fn()
            return 1000 * (time.perf_counter() - t)
        return wall
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")


def worker(dry_run: bool) -> None:
    import torch

    import flashmask3 as fm
    import flashmask3.masks as M

    device = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else torch.bfloat16
    timer = _timer(dry_run)
    cells: dict = {}
    print(json.dumps({"ready": fm.__file__}), flush=True)
    for line in sys.stdin:
        cell = json.loads(line)
        key = (cell["mask"], cell["S"], cell["D"])
        try:
            if key not in cells:
                cells[key] = _Cell(fm, M, cell, device, dtype)
            c = cells[key]
            fn = c.fwd if cell["pass"] == "fwd" else c.fwd_bwd
            out = fn()
            first = out if isinstance(out, torch.Tensor) else out[0]
            checksum = float(first.detach().float().abs().sum())
            ms = timer(fn)
            print(json.dumps({"ms": ms, "checksum": checksum}), flush=True)
        except Exception as exc:  # reported, the run goes on
            print(json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------


def _start(tree: str, dry_run: bool) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FLASHMASK3_BACKEND="triton")
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + (["--dry-run"] if dry_run else [])
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                         cwd=os.path.abspath(tree))
    ready = json.loads(p.stdout.readline())
    print(f"[ab_trees] {tree}: flashmask3 from {ready['ready']}", flush=True)
    return p


def _ask(p: subprocess.Popen, cell: dict) -> dict:
    p.stdin.write(json.dumps(cell) + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    return json.loads(line) if line else {"error": "worker exited"}


def cells(args) -> list:
    """Every (mask, D, pass) cell of ``--dims`` x MASKS x PASSES, or only the ``--cells`` ones."""
    want = args.cells
    return [dict(mask=m, S=args.seqlen, D=d, B=args.batch, hidden=args.hidden, **{"pass": p})
            for d in args.dims for m in MASKS for p in PASSES
            if not want or (p, d, None) in want or (p, d, m) in want]


def _pass_dims(text: str) -> set:
    """``fwd:64,fwd_bwd:128:causal`` -> {("fwd", 64, None), ("fwd_bwd", 128, "causal")} (the
    ``--cells`` filter: PASS:D for every mask, PASS:D:MASK for one)."""
    out = set()
    for item in text.split(","):
        p, d, *m = item.split(":")
        if p not in PASSES or not d.isdigit() or len(m) > 1 or (m and m[0] not in MASKS):
            raise argparse.ArgumentTypeError(
                f"--cells wants PASS:D or PASS:D:MASK items with PASS in {PASSES} and MASK in "
                f"{MASKS}, got {item!r}")
        out.add((p, int(d), m[0] if m else None))
    return out


def run(args) -> dict:
    a, b = _start(args.a, args.dry_run), _start(args.b, args.dry_run)
    deadline = time.time() + args.budget_s
    rows = []
    try:
        for cell in cells(args):
            times = {"a": [], "b": []}
            sums, errors = {}, {}
            for r in range(args.rounds):
                if time.time() > deadline:
                    errors["budget"] = f"stopped after {r} rounds (budget {args.budget_s} s)"
                    break
                order = (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a))
                for name, p in order:
                    res = _ask(p, cell)
                    if "error" in res:
                        errors[name] = res["error"]
                    else:
                        times[name].append(res["ms"])
                        sums[name] = res["checksum"]
            row = dict(cell, a_ms=times["a"], b_ms=times["b"], errors=errors,
                       checksum_a=sums.get("a"), checksum_b=sums.get("b"))
            if "a" in sums and "b" in sums:
                row["same_output"] = sums["a"] == sums["b"]
            if times["a"] and times["b"]:
                row["ratio_b_over_a"] = statistics.median(times["b"]) / statistics.median(times["a"])
            rows.append(row)
            print(f"[ab_trees] {cell['mask']:22s} D={cell['D']:3d} {cell['pass']:7s} "
                  f"a {_med(times['a'])} b {_med(times['b'])} ratio {row.get('ratio_b_over_a', float('nan')):.3f}"
                  + (" same output" if row.get("same_output") else " OUTPUTS DIFFER")
                  + (f" errors {errors}" if errors else ""), flush=True)
            _write(args, rows)
    finally:
        for p in (a, b):
            p.stdin.close()
            p.wait(timeout=60)
    return _write(args, rows)


def _med(xs) -> str:
    return f"{statistics.median(xs):8.3f} ms" if xs else "     -   "


def _write(args, rows) -> dict:
    ratios = [r["ratio_b_over_a"] for r in rows if "ratio_b_over_a" in r]
    summary = dict(cells=len(rows), timed=len(ratios),
                   geomean_ratio=math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else None,
                   worst_ratio=max(ratios) if ratios else None,
                   within_2pct=sum(1 for x in ratios if x <= 1.02))
    meta = dict(a=args.a, b=args.b, seqlen=args.seqlen, batch=args.batch, hidden=args.hidden,
                rounds=args.rounds, dry_run=args.dry_run, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv))
    try:
        import torch
        import triton

        meta.update(torch=torch.__version__, triton=triton.__version__,
                    gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    except Exception:  # pragma: no cover - informative only
        pass
    out = dict(meta=meta, summary=summary, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--a", default="old_tree", help="tree A (the reference), a folder holding flashmask3/")
    ap.add_argument("--b", default=".", help="tree B")
    ap.add_argument("--dims", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048, help="heads = hidden / D")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cells", type=_pass_dims, default=None,
                    help="only these cells of the grid: PASS:D (every mask) or PASS:D:MASK, "
                         "e.g. fwd:64,fwd_bwd:256:causal")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.dry_run)
        return 0
    if args.dry_run:
        args.seqlen, args.batch, args.hidden, args.rounds = min(args.seqlen, 96), 1, 2 * min(args.dims), 2
    summary = run(args)["summary"]
    print(f"[ab_trees] summary: {json.dumps(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
