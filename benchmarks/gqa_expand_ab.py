"""A/B on the GPU: the GQA backward with each group split over one program per query head
(``splits_kv_groups``: the dK/dV kernels' KV_SPLIT, fp32 partials summed by one launch) against
the grouped launch and against the way the library did it until session 26 (in the backward,
K/V copied to the query heads by torch, an MHA-shaped backward, dK/dV summed per group by
torch: ``_CopiesBackward``), at
the shapes where the grouped grid leaves SMs idle: a context-parallel stage (16K query rows of a
rank against 1-4K keys), 32 query / 4 KV heads, D=128, bf16. Per arm: GPU time of
``torch.autograd.grad`` of one call with the forward (median of CUDA-event timed calls behind a
GPU sleep, host hidden, interleaved rounds), its host time per call (CPU time to enqueue while
the GPU is busy) and triton's ``do_bench`` median (host launch work included, as peers report);
gradients of the arms are compared.

``--shapes FILE`` times a shape set instead (``benchmarks/results/gqa_expand_shapes.json``,
written by ``python -m benchmarks.scale_model underfill``: real per-rank backward stage calls
of the paper setting where another expansion rule and the library's differ, each with what
rebuilds its mask -- document lengths, cp, balance, nodes, rank, stage -- and the scale
model's predicted times). The split arm forces the split whatever the library rule says.
``--dry-run`` (CPU): rebuild every case's mask, check it against the shape set's tile counts,
and print what would be timed with the rules' decisions and the predictions.

    python benchmarks/gqa_expand_ab.py --out $OUT/gqa-expand     # on the GPU
    python benchmarks/gqa_expand_ab.py --shapes benchmarks/results/gqa_expand_shapes.json --out $OUT/ab
    python benchmarks/gqa_expand_ab.py --shapes benchmarks/results/gqa_expand_shapes.json --dry-run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashmask3  # noqa: E402
from benchmarks.host_path import gpu_ms  # noqa: E402
from flashmask3.kernels import triton_backend as T  # noqa: E402


#: The committed A/B's shapes (full attention of a stage's rows to its keys): (Sq, Sk, Hq, Hk).
STAGE_SHAPES = ((16384, 1024, 32, 4), (16384, 2048, 32, 4), (8192, 1024, 32, 8))
SM_COUNT_H200 = 132


def _case(sq: int, sk: int, hq: int, hk: int, seed: int, cols=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, sq, hq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, sk, hk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    # cols None: full attention of the rows to this stage's keys; else the stage call's mask
    return [x.requires_grad_() for x in (q, k, v)], cols, torch.randn_like(q)


def load_cases(shapes: str) -> list[dict]:
    """``[{Sq, Sk, Hq, Hk, mask: FlashMask or None, ...}]``: the committed stage shapes
    (``shapes == "stage"``) or a shape set file, each mask rebuilt from its plan
    (``measure.plan_calls``) and checked against the file's tile counts."""
    if shapes == "stage":
        return [dict(Sq=sq, Sk=sk, Hq=hq, Hk=hk, mask=None) for sq, sk, hq, hk in STAGE_SHAPES]
    from benchmarks.scale_model.calibrate import tile_counts
    from benchmarks.scale_model.layout import LEGACY_TOLERANCE
    from benchmarks.scale_model.measure import plan_calls

    with open(shapes) as f:
        entries = json.load(f)["shapes"]
    plans: dict = {}
    out = []
    for e in entries:
        m = e["mask"]
        key = (tuple(m["doc_lens"]), m["cp"], m["balance"], m["nodes"], m["rank"])
        if key not in plans:
            plans[key] = {meta["stage"]: (fm, keys) for meta, fm, keys in
                          plan_calls(list(m["doc_lens"]), e.get("dataset", "?"), m["cp"], m["balance"],
                                     ranks=[m["rank"]], nodes=m["nodes"],
                                     tolerance=m.get("tolerance", LEGACY_TOLERANCE))}
        fm, keys = plans[key][m["stage"]]
        if (fm.seqlen_q, keys) != (e["q_rows"], e["keys"]):
            raise ValueError(f"{e['dataset']} rank {m['rank']} stage {m['stage']}: the plan gives "
                             f"{fm.seqlen_q} x {keys}, the shape set {e['q_rows']} x {e['keys']}")
        t = tile_counts(fm.startend_row_indices, False, fm.seqlen_q, keys)
        if [t.full, t.partial] != list(e["tiles"]):
            raise ValueError(f"{e['dataset']} rank {m['rank']} stage {m['stage']}: tiles "
                             f"{[t.full, t.partial]} != the shape set's {e['tiles']} (planner changed?)")
        out.append(dict(Sq=e["q_rows"], Sk=e["keys"], Hq=e["heads"], Hk=e["kv_heads"], mask=fm,
                        dataset=e.get("dataset"), rank=m["rank"], stage=m["stage"],
                        predicted={k: v for k, v in e.items() if k.endswith("_ms") or k.endswith("_expands")}))
    return out


def _rules(sq: int, sk: int, hq: int, hk: int, sms: int) -> dict:
    """Whether the library rule and the 'waves' rule expand this call (128-key backward programs)."""
    from benchmarks.scale_model.calibrate import KV_RULES
    from flashmask3.kernels.dispatch import kv_expansion

    p, g = hk * -(-sk // 128), hq // hk
    return {"library_expands": kv_expansion(p, g, sms), "waves_expands": KV_RULES["waves"](p, g, sms)}


_REAL_SPLIT_OF = T.kv_split_of


def _use(counts, split=None) -> None:
    """Run the next calls with ``counts`` as the SM count (None: the grouped backward) or, with
    ``split``, every GQA backward at that many programs per group; the prepared calls decided
    before are forgotten (they decide once per signature)."""
    T.sm_count = counts
    T.kv_split_of = _REAL_SPLIT_OF if split is None else (lambda *a: split)
    flashmask3.api.clear_prepared()


def _grads(q, k, v, cols, dout):
    out = flashmask3.flashmask_attention(q, k, v, cols)
    return torch.autograd.grad(out, (q, k, v), dout)


def _copied_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """``[B, S, Hk, D]`` -> ``[B, S, Hq, D]``, each KV head copied for its group (the library's
    expansion until session 26, ``triton_backend.expand_heads``)."""
    b, s, hk, d = x.shape
    return x[:, :, :, None].expand(b, s, hk, hq // hk, d).reshape(b, s, hq, d).contiguous()


class _CopiesBackward(torch.autograd.Function):
    """The library's GQA path until session 26, rebuilt from the backend's functions: the
    grouped forward, then a backward with K/V copied to the query heads by torch, an MHA-shaped
    backend backward (never split: one KV head per query head) and dK/dV summed over each group
    in fp32 by torch (the old ``triton_backend.sum_groups``): its launches, bytes and rounding."""

    @staticmethod
    def forward(ctx, q, k, v, cols, causal, scale, span):
        out, lse = T.forward(q, k, v, cols, causal, scale, row_span=span)
        ctx.save_for_backward(q, k, v, out, lse, cols)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cols = ctx.saved_tensors
        hq, hk = q.shape[2], k.shape[2]
        dq, dk, dv = T.backward(dout.contiguous(), None, q, _copied_heads(k, hq),
                                _copied_heads(v, hq), out, lse, cols, ctx.causal, ctx.scale)
        b, s, _, d = dk.shape
        return (dq, dk.view(b, s, hk, hq // hk, d).sum(3), dv.view(b, s, hk, hq // hk, d).sum(3),
                None, None, None, None)


def _grads_copies(q, k, v, mask, dout):
    cols, causal, span = None, False, None
    if mask is not None:
        cols, causal = mask.startend_row_indices, mask.causal
        span = flashmask3.api.kernel_row_span(mask)
    out = _CopiesBackward.apply(q, k, v, cols, causal, 1.0 / math.sqrt(q.shape[-1]), span)
    return torch.autograd.grad(out, (q, k, v), dout)


def _expanded(device):  # any count the rule expands at: the split arm, whatever the rule says
    return 1 << 30


#: (name, SM count the dispatch sees or "real", programs per group or None, the gradient
#: function) of each arm: split whole groups (the library's split), grouped, K/V copied by torch
#: (the library until session 26), and partial splits (2 or 4 programs per group: not a rule
#: the library has; the scale model's ``--kv-rule split`` what-if).
ARMS = (("expanded", _expanded, None, _grads), ("grouped", lambda device: None, None, _grads),
        ("copies", "real", None, _grads_copies), ("split2", "real", 2, _grads),
        ("split4", "real", 4, _grads))


def _arms(hq: int, hk: int) -> list:
    """The arms that apply to a group of ``hq // hk`` heads (a partial split must divide it and
    be smaller)."""
    g = hq // hk
    return [a for a in ARMS if a[2] is None or (a[2] < g and g % a[2] == 0)]


def _time_arms(q, k, v, cols, dout, real) -> dict:
    """GPU ms (3 interleaved rounds, median), host µs per call and do_bench ms of every arm,
    and the largest relative difference of an arm's gradients from the grouped arm's."""
    import triton

    from benchmarks.kernel import host_us

    def use(counts, split):
        _use(real if counts == "real" else counts, split)

    arms = _arms(q.shape[2], k.shape[2])
    res, times = {}, {name: [] for name, _, _, _ in arms}
    for name, counts, split, fn in arms:
        use(counts, split)
        res[name] = fn(q, k, v, cols, dout)
    for _ in range(3):  # interleaved rounds
        for name, counts, split, fn in arms:
            use(counts, split)
            times[name].append(gpu_ms(lambda: fn(q, k, v, cols, dout), [], reps=9))
    row = {}
    for name, counts, split, fn in arms:
        use(counts, split)
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_host_us"] = host_us(lambda: fn(q, k, v, cols, dout))
        row[f"{name}_std_ms"] = triton.testing.do_bench(lambda: fn(q, k, v, cols, dout),
                                                        return_mode="median")
        if name != "grouped":
            row[f"{name}_max_rel_diff"] = max(
                float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                for a, b in zip(res[name], res["grouped"]))
    _use(real)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gqa-expand")
    ap.add_argument("--shapes", default="stage",
                    help="'stage' (the committed full-attention stage shapes) or a shape set json")
    ap.add_argument("--dry-run", action="store_true", help="CPU: rebuild and check the cases, time nothing")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cases = load_cases(args.shapes)
    rows = []
    if args.dry_run:
        for c in cases:
            row = {k: c[k] for k in ("Sq", "Sk", "Hq", "Hk")}
            row.update({k: c[k] for k in ("dataset", "rank", "stage") if k in c})
            row["mask"] = "full" if c["mask"] is None else "stage call (rebuilt, tiles checked)"
            row.update(_rules(c["Sq"], c["Sk"], c["Hq"], c["Hk"], SM_COUNT_H200))
            row.update(c.get("predicted", {}))
            rows.append(row)
            print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "gqa_expand_ab_dry_run.json"), "w") as f:
            json.dump(dict(meta=dict(dry_run=True, command=" ".join(sys.argv)), rows=rows), f, indent=1)
        return 0
    real = T.sm_count
    for c in cases:
        sq, sk, hq, hk = c["Sq"], c["Sk"], c["Hq"], c["Hk"]
        fm = None if c["mask"] is None else c["mask"].to("cuda")
        (q, k, v), cols, dout = _case(sq, sk, hq, hk, seed=sk + hk, cols=fm)
        c_cols = 0 if fm is None else fm.startend_row_indices.shape[-1]
        launch = T.dispatch.choose(q.device, q.dtype, 128, False, c_cols).backward[0]
        on = T.splits_kv_groups(launch, 1, hq, hk, sk, q.device)
        row = dict(Sq=sq, Sk=sk, Hq=hq, Hk=hk, rule_expands=on)
        row.update(_time_arms(q, k, v, cols, dout, real))
        row["max_rel_diff"] = row["expanded_max_rel_diff"]
        row.update({k: c[k] for k in ("dataset", "rank", "stage") if k in c})
        row.update(_rules(sq, sk, hq, hk, T.sm_count(q.device)))
        if c.get("predicted"):
            row["predicted"] = c["predicted"]
        row["speedup"] = row["grouped_ms"] / row["expanded_ms"]
        row["speedup_vs_copies"] = row["copies_ms"] / row["expanded_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    from benchmarks.environment import run_environment
    with open(os.path.join(args.out, "gqa_expand_ab.json"), "w") as f:
        json.dump(dict(meta=dict(run_environment(torch.device("cuda")), command=" ".join(sys.argv)),
                       rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
