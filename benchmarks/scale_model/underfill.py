"""Where the attention calls' SM underfill goes, and what the kernel-side levers would win
(issue 23; PREDICTIONS of the calibrated per-program model, docs/scale-model.md).

Per attention call of a rank: its GPU makespan under the greedy block scheduler (programs in
launch order to the SM that frees first, ``calibrate.greedy_makespan``) against the same
programs spread evenly over every SM (``calibrate.filled``), split into

* ``grid``: the same number of programs of equal (mean) cost, greedy: what the grid's size and
  its ragged last wave lose whatever the mask (fixed by more, smaller programs: K/V expansion);
* ``spread``: the rest, from the programs' uneven tiles in launch order (fixed by longest-first
  launch order, or by splitting the heavy programs);

and the loss left after the host floor (a call costs ``max(host, GPU)``: a GPU loss under the
host time per call costs nothing). :func:`layer_breakdown` does this for the slowest rank of a
simulated layer; :func:`summarise` groups the calls by kind. :func:`switch_gains` reruns the
experiment with kernel/runtime variants (``calibrate.variant``, ``Runtime.bwd_calls``), and
:func:`ab_shapes` lists the real stage calls where two GQA expansion rules differ, with the
model's grouped and expanded times (the shape set of ``benchmarks/gqa_expand_ab.py --shapes``).

    python -m benchmarks.scale_model underfill          # -> results/scale_model_underfill.{md,json}
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .calibrate import (SLOTS, AttentionCost, PassCost, TileCounts, filled, greedy_makespan,
                        variant)
from .layout import PlanView
from .runtime_ops import MERGED
from .timeline import AttnShape, backward_calls_of, merge_calls, resolve_bwd_calls, simulate_layer


@dataclass
class CallUnderfill:
    """One attention call's programs and what its grid loses (seconds of GPU time)."""

    kind: str          # "fwd" / "bwd"
    stage: object      # stage index, or "all" (all-gather call, merged backward)
    keys: int
    programs: int      # all sweeps
    heads_per_program: int
    factor: int        # backward K/V heads per KV head (1 grouped, the group: expanded)
    spread: float      # max / mean program cost
    gpu: float         # GPU time (greedy, launch order)
    gpu_filled: float  # every SM even
    grid: float        # equal programs (mean cost), greedy, minus filled
    host: float        # host time per call
    lpt: float         # GPU time with longest-first launch order

    @property
    def loss(self) -> float:
        return self.gpu - self.gpu_filled

    @property
    def spread_loss(self) -> float:
        return self.loss - self.grid

    @property
    def exposed_loss(self) -> float:
        """The loss left under the host floor: ``max(host, GPU) - max(host, filled GPU)``."""
        return max(self.host, self.gpu) - max(self.host, self.gpu_filled)

    @property
    def label(self) -> str:
        where = "all keys" if self.stage == "all" else ("local" if self.stage == 0 else "remote")
        if self.kind == "fwd":
            return f"fwd {where}"
        return f"bwd {where} {'expanded' if self.factor > 1 else 'grouped'}"


def call_underfill(p: PassCost, tiles: TileCounts, kind: str, shape: AttnShape, stage=0) -> CallUnderfill:
    """:class:`CallUnderfill` of one call under greedy cost ``p`` of pass ``kind`` (the staged
    backward: pass ``p`` with ``a_qblock`` zero, as ``AttentionCost.backward_stage`` does)."""
    h, hk = shape.heads, shape.kv_heads
    factor = p.bwd_factor(tiles, h, hk) if kind != "fwd" else 1
    costs, sweeps = p.program_costs(tiles, kind, h, hk, factor)
    gpu = p.gpu_time(tiles, kind, h, hk, factor)
    fill = dataclasses.replace(p, schedule="filled").gpu_time(tiles, kind, h, hk, factor)
    even = greedy_makespan(np.full(len(costs), costs.mean()), sweeps) - float(costs.sum()) * sweeps / SLOTS
    lpt = dataclasses.replace(p, order="longest").gpu_time(tiles, kind, h, hk, factor)
    host = p.floor + (p.expand_host if factor > 1 and p.floor else 0.0)
    return CallUnderfill(kind, stage, tiles.keys, len(costs) * sweeps,
                         (h // hk) // factor if kind != "fwd" else 1, factor,
                         float(costs.max() / costs.mean()), gpu, fill, max(0.0, even), host, lpt)


def rank_calls(view: PlanView, r: int, cost: AttentionCost, shape: AttnShape, comm: str,
               bwd_calls: str = "stage") -> list[CallUnderfill]:
    """Every attention call of rank ``r`` in one layer (forward and backward)."""
    staged = dataclasses.replace(cost.bwd, a_qblock=0.0)
    if comm == "allgather":
        t = view.sorted_tiles[r]
        return [call_underfill(cost.fwd, t, "fwd", shape, "all"),
                call_underfill(cost.bwd, t, "bwd", shape, "all")] if t.live else []
    out = [call_underfill(cost.fwd, t, "fwd", shape, s) for s, t in enumerate(view.stages[r]) if t.live]
    st = view.stages[r]
    bwd_calls = resolve_bwd_calls(view, bwd_calls)
    bwd = [("all", merge_calls(ts)) if s == MERGED else (s, ts[0]) for s, ts in backward_calls_of(st, bwd_calls)]
    out += [call_underfill(staged, t, "bwd", shape, s) for s, t in bwd if t is not None and t.live]
    return out


def layer_breakdown(view: PlanView, cost: AttentionCost, cluster, shape: AttnShape, comm: str,
                    runtime, device=None) -> dict:
    """The calls of the slowest rank of one simulated layer, and the layer's time with every
    call filling the SMs (``calibrate.filled``: the attribution's 'no SM underfill');
    ``device``: the runtime's recorded device work per rank (``experiment.runtime_device_seconds``)."""
    lr = simulate_layer(view, cost, cluster, shape, comm, runtime, device=device)
    lf = simulate_layer(view, filled(cost), cluster, shape, comm, runtime, device=device)
    r = lr.slowest
    return {"rank": r, "layer_s": lr.time, "layer_filled_s": lf.time,
            "calls": rank_calls(view, r, cost, shape, comm, getattr(runtime, "bwd_calls", "stage"))}


KIND_ORDER = ("fwd local", "fwd remote", "fwd all keys", "bwd local grouped", "bwd local expanded",
              "bwd remote grouped", "bwd remote expanded", "bwd all keys grouped", "bwd all keys expanded")


def _kind_key(x) -> tuple:
    k = x if isinstance(x, str) else x["kind"]
    return (KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER), k)


def summarise(layers: Sequence[dict]) -> list[dict]:
    """Per call kind (:attr:`CallUnderfill.label`), means per layer over ``layers`` (of
    :func:`layer_breakdown`): calls, GPU ms, loss ms (grid / spread parts), loss after the host
    floor, the longest-first order's saving; ranges of programs, heads per program and spread."""
    groups: dict = {}
    for lay in layers:
        for c in lay["calls"]:
            groups.setdefault(c.label, []).append(c)
    n = max(1, len(layers))
    rows = []
    for label, cs in groups.items():
        ms = lambda f: 1e3 * sum(f(c) for c in cs) / n  # noqa: E731
        rows.append({"kind": label, "calls": len(cs) / n,
                     "programs": (min(c.programs for c in cs), max(c.programs for c in cs)),
                     "heads_per_program": sorted({c.heads_per_program for c in cs}),
                     "keys": (min(c.keys for c in cs), max(c.keys for c in cs)),
                     "spread": (min(c.spread for c in cs), max(c.spread for c in cs)),
                     "gpu_ms": ms(lambda c: c.gpu), "loss_ms": ms(lambda c: c.loss),
                     "grid_ms": ms(lambda c: c.grid), "spread_ms": ms(lambda c: c.spread_loss),
                     "exposed_loss_ms": ms(lambda c: c.exposed_loss),
                     "lpt_saves_ms": ms(lambda c: c.gpu - c.lpt)})
    rows.sort(key=_kind_key)
    total = {"kind": "total", "calls": sum(x["calls"] for x in rows)}
    for k in ("gpu_ms", "loss_ms", "grid_ms", "spread_ms", "exposed_loss_ms", "lpt_saves_ms"):
        total[k] = sum(x[k] for x in rows)
    total["layer_ms"] = 1e3 * float(np.mean([lay["layer_s"] for lay in layers]))
    total["layer_filled_ms"] = 1e3 * float(np.mean([lay["layer_filled_s"] for lay in layers]))
    return rows + [total]


# -- the levers ----------------------------------------------------------------------------------

#: name -> (calibrate.variant kwargs, Runtime.bwd_calls): the switches :func:`switch_gains` runs.
SWITCHES = {
    "now (library rule, launch order, staged bwd)": ({}, "stage"),
    "(a) kv rule lt_group: ceil(Pg/SMs) < g": ({"kv_rule": "lt_group"}, "stage"),
    "(a) kv rule waves: ceil(Pg/SMs) < g ceil(P/SMs)": ({"kv_rule": "waves"}, "stage"),
    "(a) kv rule best (per-call oracle)": ({"kv_rule": "best"}, "stage"),
    "(b) longest-first order": ({"order": "longest"}, "stage"),
    "(c) partial expansion (best e dividing g)": ({"kv_rule": "split"}, "stage"),
    "(c) one bwd call per layer": ({}, "one"),
    "(c) one remote bwd call, then the own keys": ({}, "one+local"),
    "(a waves)+(b)": ({"kv_rule": "waves", "order": "longest"}, "stage"),
    "(b)+(c split)": ({"kv_rule": "split", "order": "longest"}, "stage"),
    "(b)+(c split)+one+local": ({"kv_rule": "split", "order": "longest"}, "one+local"),
}


def switch_gains(datasets: dict, model, layout, cluster, runtime, costs, switches: Optional[dict] = None,
                 methods: Sequence[str] = ("dual_chunk+allgather", "sparse+allgather", "sparse+overlap+hier"),
                 progress=None) -> dict:
    """``{switch: {dataset: {method: gain over the baseline}}}`` with each switch of
    :data:`SWITCHES` applied to every method (a kernel change reaches the baseline too; the
    backward-call switch only the overlapped methods). PREDICTIONS."""
    from . import experiment as X

    ms = {k: X.METHODS[k] for k in methods}
    out = {}
    for name, (kw, bwd_calls) in (switches or SWITCHES).items():
        co = dataclasses.replace(costs, flashmask3=variant(costs.flashmask3, **kw))
        rt = dataclasses.replace(runtime, bwd_calls=bwd_calls)
        out[name] = {}
        for d, ds in datasets.items():
            res = X.simulate_dataset(ds["sequences"], model, layout, cluster, rt, co, methods=ms, progress=progress)
            out[name][d] = {k: v for k, v in X.gains(res).items() if k != X.BASELINE}
    return out


def ab_shapes(datasets: dict, cp: int, cost: AttentionCost, shape: AttnShape, rule: str = "waves",
              balance: str = "sparse", nodes: int = 2, per_dataset: int = 4) -> list[dict]:
    """Real backward stage calls of the paper setting (every rank of the first sequence of each
    dataset) whose GQA expansion differs between the library rule and ``rule``, one per
    (q_rows, keys) shape: per dataset the ``per_dataset // 2`` the model predicts expansion helps
    most and the rest it predicts helps least (the A/B should see both). Each entry carries what
    rebuilds its mask (document lengths, cp, balance, nodes, rank, stage: ``measure.plan_calls``)
    and the model's PREDICTIONS: ``ab_*_gpu_ms`` the fwd+bwd GPU time of one standalone call (what
    ``gqa_expand_ab.py`` times), ``stage_*_ms`` the staged backward call in the timeline
    (``max(host, GPU)``, the per-layer query-block pass excluded)."""
    from flashmask3.distributed.placement import DEFAULT_TOLERANCE

    from .layout import document_plan_view

    staged = dataclasses.replace(cost.bwd, a_qblock=0.0)
    h, hk = shape.heads, shape.kv_heads
    g = h // hk
    out = []
    for d, ds in datasets.items():
        lens = ds["sequences"][0]
        v = document_plan_view(lens, cp, balance, nodes)
        seen, cand = set(), []
        for r in range(cp):
            for s, t in enumerate(v.stages[r]):
                if not t.live:
                    continue
                now, new = (dataclasses.replace(staged, kv_rule=x).bwd_factor(t, h, hk) > 1 for x in ("library", rule))
                if now == new or (t.q_rows, t.keys) in seen:
                    continue
                seen.add((t.q_rows, t.keys))
                fwd = cost.gpu_forward(t, h, hk)
                ab = {e: (fwd + cost.bwd.gpu_time(t, "bwd", h, hk, e)) * 1e3 for e in (1, g)}
                st = {e: staged.time(t, "bwd", h, hk, e) * 1e3 for e in (1, g)}
                cand.append({"dataset": d, "q_rows": t.q_rows, "keys": t.keys, "heads": h, "kv_heads": hk,
                             "programs": hk * len(t.work.bwd_full) if t.work is not None else None,
                             "mask": {"doc_lens": list(map(int, lens)), "cp": cp, "balance": balance,
                                      "nodes": nodes, "rank": r, "stage": s, "tolerance": DEFAULT_TOLERANCE},
                             "tiles": [t.full, t.partial], "library_expands": now, f"{rule}_expands": new,
                             "ab_grouped_gpu_ms": ab[1], "ab_expanded_gpu_ms": ab[g],
                             "stage_grouped_ms": st[1], "stage_expanded_ms": st[g]})
        cand.sort(key=lambda c: c["ab_expanded_gpu_ms"] / c["ab_grouped_gpu_ms"])
        k = per_dataset // 2
        pick = cand[:k] + [c for c in cand[::-1][:per_dataset - k] if c not in cand[:k]]
        out += pick
    return out


# -- the CLI's report ------------------------------------------------------------------------------


def _rng(x, fmt="{}"):
    lo, hi = x
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def breakdown_table(rows: list[dict]) -> list[str]:
    lines = ["| calls | per layer | programs | heads/prog | keys | max/mean | GPU ms | loss ms | grid | spread "
             "| after host floor | longest-first saves |", "|" + "---|" * 12]
    for x in rows:
        if x["kind"] == "total":
            lines.append(f"| **total** (layer {x['layer_ms']:.2f} ms, filled {x['layer_filled_ms']:.2f}) "
                         f"| {x['calls']:.1f} | | | | | {x['gpu_ms']:.2f} | {x['loss_ms']:.2f} | {x['grid_ms']:.2f} "
                         f"| {x['spread_ms']:.2f} | {x['exposed_loss_ms']:.2f} | {x['lpt_saves_ms']:.2f} |")
            continue
        lines.append(f"| {x['kind']} | {x['calls']:.2f} | {_rng(x['programs'])} | "
                     f"{','.join(map(str, x['heads_per_program']))} | {_rng(x['keys'])} | "
                     f"{_rng(x['spread'], '{:.1f}')} | {x['gpu_ms']:.2f} | {x['loss_ms']:.2f} | {x['grid_ms']:.2f} | "
                     f"{x['spread_ms']:.2f} | {x['exposed_loss_ms']:.2f} | {x['lpt_saves_ms']:.2f} |")
    return lines


def compact_table(breakdown: dict) -> list[str]:
    """One row per call kind, one column per ``cp:dataset`` of :func:`run`'s breakdown: the
    slowest rank's loss per layer, ms (grid / spread), and for the total the layer's time."""
    cols = list(breakdown)
    kinds = []
    for rows in breakdown.values():
        kinds += [r["kind"] for r in rows if r["kind"] not in kinds]
    kinds = sorted((k for k in kinds if k != "total"), key=_kind_key) + ["total"]
    lines = ["| call kind | " + " | ".join(c.replace(":", " ") for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for k in kinds:
        cells = []
        for c in cols:
            r = next((x for x in breakdown[c] if x["kind"] == k), None)
            cells.append("" if r is None else f"{r['loss_ms']:.2f} ({r['grid_ms']:.2f}/{r['spread_ms']:.2f})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("| layer ms: now / filled | " + " | ".join(
        f"{breakdown[c][-1]['layer_ms']:.1f} / {breakdown[c][-1]['layer_filled_ms']:.1f}" for c in cols) + " |")
    return lines


#: The A/B shape set this model proposes now (``gqa_expand_ab.py --shapes``); the set the
#: committed A/B measured stays ``gqa_expand_shapes.json`` (validate.validate_kv_expansion reads
#: its rows in that file's order), so a rerun never rewrites a measurement's input.
CANDIDATES = "gqa_expand_candidates.json"


def run(out_dir: str, cps=((16, 4, 2, 16), (64, 2, 1, 32)), sequences: int = 4, progress=None) -> dict:
    """Breakdown (combined method, slowest rank) at each ``(cp, pp, dp, micro-batches)``, the
    switches' gains, and the A/B shape set; writes ``scale_model_underfill.{md,json}`` and
    :data:`CANDIDATES` to ``out_dir``."""
    from . import experiment as X
    from .layout import document_plan_view
    from .model import MOE_118B, Layout
    from .params import Cluster, Runtime

    model, cluster, runtime = MOE_118B, Cluster(), Runtime("lean")
    costs = X.default_costs(gqa=True).for_heads(model.heads, model.kv_heads)
    shape = model.shape()
    datasets = X.make_datasets(131072, sequences=sequences)
    res = {"label": "PREDICTIONS of the scale model's per-program model (benchmarks/scale_model/underfill.py)",
           "breakdown": {}, "switches": {}}
    md = ["# SM underfill of the combined method, and the levers (PREDICTIONS)", "",
          "`python -m benchmarks.scale_model underfill` (benchmarks/scale_model/underfill.py). 118B MoE, "
          "128K tokens, sparse+overlap+hier; per layer, the slowest rank's attention calls: GPU makespan "
          "under the greedy block scheduler vs the same programs over even SMs. grid = equal programs "
          "(mean cost) lose this much (grid size, last wave); spread = the rest (uneven tiles in launch "
          "order); after host floor = the loss left in max(host, GPU).", ""]
    for cp, pp, dp, mb in cps:
        layout = Layout(cp=cp, pp=pp, dp=dp, ep=8, micro_batches=mb)
        nodes = max(1, cp // cluster.gpus_per_node)
        for d, ds in datasets.items():
            lays = []
            for lens in ds["sequences"]:
                v = document_plan_view(lens, cp, "sparse", nodes)
                device = X.runtime_device_seconds(lens, cp, X.METHODS[X.COMBINED], nodes, v, model, cluster, runtime)
                lays.append(layer_breakdown(v, X.cost_on(costs.flashmask3, cluster), cluster, shape, "overlap",
                                            runtime, device))
            rows = summarise(lays)
            res["breakdown"][f"cp{cp}:{d}"] = rows
            md += [f"## cp {cp}, {d}", ""] + breakdown_table(rows) + [""]
            if progress is not None:
                progress.update(1)
        sw = switch_gains(datasets, model, layout, cluster, runtime, costs, progress=progress)
        res["switches"][f"cp{cp}"] = sw
        names = list(datasets)
        md += [f"## Gains over dual_chunk+allgather at cp {cp} (pp {pp}, dp {dp}): combined / sparse+allgather", "",
               "| switch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for name, g in sw.items():
            md.append(f"| {name} | " + " | ".join(
                f"{100 * g[d]['sparse+overlap+hier']:+.1f}% / {100 * g[d]['sparse+allgather']:+.1f}%" for d in names)
                + " |")
        md.append("")
    at = md.index("## cp 16, " + next(iter(datasets)))
    md[at:at] = ["## Summary: loss per layer on the slowest rank, ms (grid / spread)", ""] + \
        compact_table(res["breakdown"]) + [""]
    shapes = ab_shapes(datasets, 16, costs.flashmask3, shape)
    res["ab_shapes"] = shapes
    md += ["## A/B shapes for gqa_expand_ab.py --shapes (cp 16 backward stage calls where the waves rule "
           "and the library rule differ; predicted ms: fwd+bwd GPU of one call as the A/B times it, and "
           "the staged backward call max(host, GPU))", "",
           "| dataset | rank/stage | q_rows | keys | grouped programs | tiles full/partial | library | A/B grouped "
           "| A/B expanded | stage grouped | stage expanded |", "|" + "---|" * 11]
    for c in shapes:
        m = c["mask"]
        md.append(f"| {c['dataset']} | {m['rank']}/{m['stage']} | {c['q_rows']} | {c['keys']} | {c['programs']} | "
                  f"{c['tiles'][0]}/{c['tiles'][1]} | {'expands' if c['library_expands'] else 'grouped'} | "
                  f"{c['ab_grouped_gpu_ms']:.3f} | {c['ab_expanded_gpu_ms']:.3f} | {c['stage_grouped_ms']:.3f} | "
                  f"{c['stage_expanded_ms']:.3f} |")
    os.makedirs(out_dir, exist_ok=True)
    from .experiment import to_jsonable

    with open(os.path.join(out_dir, "scale_model_underfill.json"), "w") as f:
        json.dump(to_jsonable(res), f, indent=1)
    with open(os.path.join(out_dir, CANDIDATES), "w") as f:
        json.dump({"label": "real per-rank backward stage calls of the paper setting (118B MoE, cp 16, "
                            "sparse+overlap+hier) where the 'waves' GQA expansion rule and the library rule "
                            "differ; *_ms are the scale model's PREDICTIONS", "shapes": shapes}, f, indent=1)
    with open(os.path.join(out_dir, "scale_model_underfill.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return res


__all__ = ["CallUnderfill", "call_underfill", "rank_calls", "layer_breakdown", "summarise", "compact_table", "SWITCHES",
           "switch_gains", "ab_shapes", "run"]
