"""A/B on the GPU: the GQA backward with K/V expanded to the query heads (``expands_kv_heads``)
against the grouped launch, at the shapes where the grouped grid leaves SMs idle: a context-
parallel stage (16K query rows of a rank against 1-4K keys), 32 query / 4 KV heads, D=128, bf16.
Times are GPU time of ``torch.autograd.grad`` of one call (median of CUDA-event timed calls,
interleaved A/B), with the forward included; gradients of both are compared.

``--shapes FILE`` times a shape set instead (``benchmarks/results/gqa_expand_shapes.json``,
written by ``python -m benchmarks.scale_model underfill``: real per-rank backward stage calls
of the paper setting where another expansion rule and the library's differ, each with what
rebuilds its mask -- document lengths, cp, balance, nodes, rank, stage -- and the scale
model's predicted times). The expanded arm forces the expansion whatever the library rule says.
``--dry-run`` (CPU): rebuild every case's mask, check it against the shape set's tile counts,
and print what would be timed with the rules' decisions and the predictions.

    python benchmarks/gqa_expand_ab.py --out $OUT/gqa-expand     # on the GPU
    python benchmarks/gqa_expand_ab.py --shapes benchmarks/results/gqa_expand_shapes.json --out $OUT/ab
    python benchmarks/gqa_expand_ab.py --shapes benchmarks/results/gqa_expand_shapes.json --dry-run
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
                                     ranks=[m["rank"]], nodes=m["nodes"])}
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


def _use(counts) -> None:
    """Run the next calls with ``counts`` as the SM count (None: the grouped backward); the
    prepared calls decided with the old one are forgotten (they decide once per signature)."""
    T.sm_count = counts
    flashmask3.api.clear_prepared()


def _grads(q, k, v, cols, dout):
    out = flashmask3.flashmask_attention(q, k, v, cols)
    return torch.autograd.grad(out, (q, k, v), dout)


def _expanded(device):  # any count the rule expands at: the expanded arm, whatever the rule says
    return 1 << 30


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
    arms = (("expanded", _expanded), ("grouped", lambda device: None))
    for c in cases:
        sq, sk, hq, hk = c["Sq"], c["Sk"], c["Hq"], c["Hk"]
        fm = None if c["mask"] is None else c["mask"].to("cuda")
        (q, k, v), cols, dout = _case(sq, sk, hq, hk, seed=sk + hk, cols=fm)
        c_cols = 0 if fm is None else fm.startend_row_indices.shape[-1]
        launch = T.dispatch.choose(q.device, q.dtype, 128, False, c_cols).backward[0]
        on = T.expands_kv_heads(launch, 1, hq, hk, sk, q.device)
        res = {}
        for name, counts in arms:
            _use(counts)
            res[name] = _grads(q, k, v, cols, dout)
        _use(real)
        err = max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                  for a, b in zip(res["expanded"], res["grouped"]))
        times = {"expanded": [], "grouped": []}
        for _ in range(3):  # interleaved rounds
            for name, counts in arms:
                _use(counts)
                times[name].append(gpu_ms(lambda: _grads(q, k, v, cols, dout), [], reps=9))
        _use(real)
        row = dict(Sq=sq, Sk=sk, Hq=hq, Hk=hk, rule_expands=on,
                   expanded_ms=statistics.median(times["expanded"]),
                   grouped_ms=statistics.median(times["grouped"]), max_rel_diff=err)
        row.update({k: c[k] for k in ("dataset", "rank", "stage") if k in c})
        row.update(_rules(sq, sk, hq, hk, T.sm_count(q.device)))
        if c.get("predicted"):
            row["predicted"] = c["predicted"]
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
