"""benchmarks/results/scale_model.md: tables a person reads (every model number a PREDICTION)."""

from __future__ import annotations

from .experiment import BASELINE, COMBINED, METHODS, ON_MAIN, PAPER_GAINS, _summ, attribution, gains
from .validate import TARGET, summary


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def _ms(x) -> str:
    return f"{x * 1e3:.2f}"


def params_table(cluster, costs, runtime) -> list[str]:
    lines = ["| parameter | value | provenance |", "|---|---|---|"]
    for name, p in cluster.params().items():
        v = p.value
        shown = (f"{v / 1e9:.0f} GB/s" if name.endswith("_bw") and v > 1e6 and name != "hbm_bw"
                 else f"{v / 1e12:.1f} TB/s" if name == "hbm_bw"
                 else f"{v * 1e6:.1f} us" if name.endswith(("latency", "overhead", "host_op"))
                 else f"{v:g}")
        lines.append(f"| {name} | {shown} | {p.source} |")
    lines.append(f"| attention (flashmask3) | {costs.flashmask3.describe()} | see source |")
    lines.append(f"| attention (FlexAttention, torch_cp) | {costs.flex.describe()} | see source |")
    lines.append(f"| runtime | {runtime.kind} ({'<= 64 launches/layer: the cp-runtime target' if runtime.kind == 'lean' else 'op counts of the runtime on main'}) | assumed |")
    return lines


def validation_section(single: dict, multi: list, multi_path: str) -> list[str]:
    lines = ["## Validation: predictions vs what was measured", "",
             "Both committed measurements used the kernel of 2026-11-29 (~13:00 UTC: v2 forward + v1 "
             "backward, commit 234a020), so the model is checked with that kernel's calibration. "
             "**tables** = the old kernel's full-sequence kernel tables only (a transfer test). "
             f"**per-rank** = those tables x k = {single['k']:.3f} plus {single['c'] * 1e3:.2f} ms per "
             "fwd+bwd call, both fitted on the 32 dual_chunk ranks of `cp_single_gpu.json` only; the 32 "
             "sparse ranks and the 2-GPU runs are held out.", ""]
    st, sp = summary(single["tables"]), summary(single["per_rank"])
    fit = [p for p in single["per_rank"] if not p.held_out]
    fit_err = max(abs(p.error) for p in fit) if fit else float("nan")
    lines += ["| check | points | max abs error | mean abs error | within 15% |", "|---|---|---|---|---|",
              f"| cp_single_gpu, tables | {st['points']} | {st['max_abs_error']:.1%} | {st['mean_abs_error']:.1%} | {st['within_target']} |",
              f"| cp_single_gpu, per-rank fit set (dual_chunk) | {len(fit)} | {fit_err:.1%} | — | — |",
              f"| cp_single_gpu, per-rank held out (sparse) | {sp['points']} | {sp['max_abs_error']:.1%} | {sp['mean_abs_error']:.1%} | {sp['within_target']} |"]
    sm = summary(multi)
    lines += [f"| cp_multigpu (2 H200), per-rank, held out | {sm['points']} | {sm['max_abs_error']:.1%} | {sm['mean_abs_error']:.1%} | {sm['within_target']} |", ""]
    lines += [f"2-GPU attention fwd+bwd and the training step ({multi_path}):", "",
              "| run | measured ms | predicted ms | error | how the view was built |", "|---|---|---|---|---|"]
    for p in multi:
        lines.append(f"| {p.name} | {_ms(p.measured)} | {_ms(p.predicted)} | {_pct(p.error)} | {p.note} |")
    lines += ["", "Per-rank (cp 8, 128K, one H200), worst held-out ranks:", "",
              "| rank | measured ms | tables ms (err) | per-rank ms (err) |", "|---|---|---|---|"]
    worst = sorted(zip(single["tables"], single["per_rank"]), key=lambda x: -abs(x[1].error))[:8]
    for t, p in worst:
        lines.append(f"| {p.name}{'' if p.held_out else ' (fit set)'} | {_ms(p.measured)} | {_ms(t.predicted)} "
                     f"({_pct(t.error)}) | {_ms(p.predicted)} ({_pct(p.error)}) |")
    lines += ["", "Tile counts: " + "; ".join(f"{k}: {v}" for k, v in single["notes"].items()), "",
              f"Target (<= {TARGET:.0%} on every checkable point): per-rank calibration "
              f"{'met' if sp['max_abs_error'] <= TARGET and sm['max_abs_error'] <= TARGET else 'NOT met'} "
              f"(held out: worst {max(sp['max_abs_error'], sm['max_abs_error']):.1%}); the table-only "
              f"transfer misses it (worst {st['max_abs_error']:.1%}, mean {st['mean_abs_error']:.1%}: the "
              "per-rank calls are slower per tile than the full-sequence calls of the tables, and a "
              f"~{single['c'] * 1e3:.1f} ms per-call cost of that day's API path dominates the short-document "
              "ranks). This is why benchmarks/gpu/scale-model.sh measures the per-rank shapes.", ""]
    return lines


def paper_section(model, layout, datasets, results: dict, sens: list, cluster) -> list[str]:
    lines = ["## The FlashMask-3 experiment, simulated (PREDICTIONS)", "",
             f"Model (assumed): {model.describe()}.", "",
             f"Layout (assumed, 128 GPUs): cp {layout.cp} (= {max(1, layout.cp // cluster.gpus_per_node)} nodes "
             f"of {cluster.gpus_per_node}) x pp {layout.pp} x dp {layout.dp}; experts {layout.ep}-way inside a "
             f"node (EP over the cp x dp ranks); {layout.micro_batches} micro-batches of one 128K sequence per "
             f"replica and step (1F1B); recompute {'on' if layout.recompute else 'off'}. Cluster: {cluster.name}.", "",
             "| dataset | docs/seq | mean sparsity | " + " | ".join(f"{m} tokens/s (gain)" for m in METHODS) + " |",
             "|---|---|---|" + "---|" * len(METHODS)]
    for name, res in results.items():
        ds = datasets[name]
        g = gains(res)
        cells = [f"{res[m]['step'].tokens_per_s:,.0f} ({_pct(g[m])})" if m in res else "—" for m in METHODS]
        lines.append(f"| {name} | {ds['docs_per_sequence']:.1f} | {ds['sparsity']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", f"Paper: {PAPER_GAINS['note']}.", "",
              "| dataset | combined (sparse+overlap+hier) | paper combined | flat (no hierarchy) | paper without hierarchy |",
              "|---|---|---|---|---|"]
    for name, res in results.items():
        g = gains(res)
        lines.append(f"| {name} | {_pct(g.get(COMBINED))} | +7.3 to +11.0% | {_pct(g.get('sparse+overlap'))} | "
                     "below the baseline on 2 of 3 |")
    lines += ["", "Where the time goes (per layer, slowest cp rank, fwd+bwd, ms; PREDICTIONS):", "",
              "| dataset | method | attention | of it kernels | mean-rank kernels | exposed comm + SM share | host floor? | non-attention | EP all-to-all | imbalance (tiles) | KV GB fwd (x-node) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        for m in METHODS:
            if m not in res:
                continue
            s = _summ(res[m])
            v_imb = _imbalance(res[m])
            lines.append(f"| {name} | {m} | {_ms(s['attention_s'])} | {_ms(s['attention_compute_s'])} | "
                         f"{_ms(s['mean_compute_s'])} | {_ms(s['attention_s'] - s['attention_compute_s'])} | "
                         f"{'yes' if s['attention_host_floor'] else 'no'} | {_ms(s['nonattn_s'])} | "
                         f"{_ms(s['ep_alltoall_s'])} | {v_imb:.3f} | {s['bytes_fwd'] / 1e9:.2f} "
                         f"({s['xnode_bytes_fwd'] / 1e9:.2f}) |")
    lines += ["", "What holds the combined method back (its gain if one term were removed; PREDICTIONS):", "",
              "| dataset | gain | no exposed comm | no imbalance | no host floor | ceiling (ideal attention) | attention share | non-attention share | bubble |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        a = attribution(model, layout, res)
        if not a:
            continue
        lines.append(f"| {name} | {_pct(a['gain'])} | {_pct(a['without exposed comm'])} | {_pct(a['without imbalance'])} | "
                     f"{_pct(a['without host floor'])} | {_pct(a['ceiling (attention = mean compute, no comm)'])} | "
                     f"{a['attention share of step']:.0%} | {a['non-attention share of step']:.0%} | {a['bubble share']:.0%} |")
    if sens:
        lines += ["", f"Sensitivity (dataset {sens[0].get('dataset', '')}; each parameter x0.5 / x2, others as above; "
                  "gain over the baseline; PREDICTIONS):", "",
                  "| parameter | factor | " + " | ".join(k for k in METHODS if k != BASELINE) + " |",
                  "|---|---|" + "---|" * (len(METHODS) - 1)]
        for r in sens:
            lines.append(f"| {r['param']} | {r['factor']:g} | " + " | ".join(_pct(r.get(k)) for k in METHODS if k != BASELINE) + " |")
    return lines


def _imbalance(entry) -> float:
    lrs = entry["layers"]
    vals = []
    for lr in lrs:
        comp = [lr.fwd.ranks[r].compute + lr.bwd.ranks[r].compute for r in range(len(lr.host))]
        mean = sum(comp) / len(comp)
        vals.append(max(comp) / mean if mean else 1.0)
    return sum(vals) / len(vals)


def sweep_section(model, sweep: dict, cluster) -> list[str]:
    lines = ["## cp sweep, 7B-class dense (PREDICTIONS)", "",
             f"Model (assumed): {model.describe()}. One replica (no pp/dp), one sequence per step, "
             f"{cluster.gpus_per_node} GPUs a node (cp > {cluster.gpus_per_node} spans nodes). Dataset: the "
             "middle-sparsity corpus dataset packed to each length. tokens/s of the whole cp group and the "
             "gain over dual_chunk+allgather. Plot: scale_model.png.", ""]
    for seqlen, by_cp in sweep.items():
        lines += [f"### {seqlen // 1024}K tokens", "",
                  "| cp | " + " | ".join(list(METHODS) + [ON_MAIN]) + " | combined: attention ms / exposed comm ms / host floor? |",
                  "|---|" + "---|" * (len(METHODS) + 2)]
        for cp, res in sorted(by_cp.items()):
            base = res[BASELINE]["tokens_per_s"]
            cells = [f"{res[m]['tokens_per_s']:,.0f} ({_pct(res[m]['tokens_per_s'] / base - 1)})" if m in res else "—"
                     for m in list(METHODS) + [ON_MAIN]]
            c = res.get(COMBINED) or res.get("sparse+overlap")
            extra = f"{_ms(c['attention_s'])} / {_ms(c['attention_s'] - c['attention_compute_s'])} / " \
                    f"{'yes' if c['attention_host_floor'] else 'no'}"
            lines.append(f"| {cp} | " + " | ".join(cells) + f" | {extra} |")
        worst = max((v.get("plan_seconds", 0.0), cp, m) for cp, res in by_cp.items() for m, v in res.items())
        lines += ["", f"Planning (today's `plan()`, this 2-core machine, when the cached view was built): slowest "
                  f"{worst[0]:.1f} s ({worst[2]}, cp {worst[1]}); the model caches plan views on disk, so reruns "
                  "do not replan.", ""]
    return lines


def _range(vals) -> str:
    vals = [v for v in vals if v is not None]
    return f"{_pct(min(vals))} to {_pct(max(vals))}" if vals else "—"


def _pts(x) -> str:
    return f"{100 * x:+.1f}"


def discussion(model, layout, results: dict, alt_layout, alt_results: dict, sweep: dict, sens=(),
               goal: float = 0.12) -> list[str]:
    """What the predictions say about the paper's claim, computed from the numbers above."""
    g = {d: gains(r) for d, r in results.items()}
    comb = [g[d].get(COMBINED) for d in g]
    flat = [g[d].get("sparse+overlap") for d in g]
    sag = [g[d].get("sparse+allgather") for d in g]
    torch_cp = [g[d].get("torch_cp (head-tail+allgather, Flex)") for d in g]
    imb = [_imbalance(results[d][BASELINE]) for d in results]
    attr = [attribution(model, layout, r) for r in results.values()]
    comm_room = [a["without exposed comm"] - a["gain"] for a in attr]
    lines = ["## Reading the predictions", "",
             f"**Target (combined >= +{goal:.0%} at the paper's setting).** Predicted gain of "
             f"sparse+overlap+hierarchical over dual_chunk+allgather at cp {layout.cp}: {_range(comb)} "
             f"({'met on every dataset' if all(c is not None and c >= goal for c in comb) else 'NOT met on every dataset'}); "
             f"without hierarchical routing (flat sparse+overlap) {_range(flat)}."]
    if alt_results:
        ga = {d: gains(r) for d, r in alt_results.items()}
        lines[-1] += (f" At cp {alt_layout.cp} ({alt_layout.cp // 8} nodes): combined "
                      f"{_range([ga[d].get(COMBINED) for d in ga])}, flat {_range([ga[d].get('sparse+overlap') for d in ga])}.")
    lines += ["", "Which term holds the combined method back (from the attribution tables): at cp "
              f"{layout.cp} the non-attention layers (experts, projections) are "
              f"{_range([attribution(model, layout, r)['non-attention share of step'] for r in results.values()]).replace('+', '')} "
              "of its step (shares, not gains) and removing exposed communication would add only "
              + f"{_pts(min(comm_room))} to {_pts(max(comm_room))}"
              + " percentage points; imbalance and host time add < 1 point. So at 2 nodes the gain is bounded "
              "by the attention share, not by the exchange."]
    if alt_results:
        att = [attribution(model, alt_layout, r) for r in alt_results.values()]
        lines[-1] += (f" At cp {alt_layout.cp} exposed communication is the binding term: without it the gain "
                      f"would be {_range([a['without exposed comm'] for a in att])} instead of "
                      f"{_range([a['gain'] for a in att])}.")
    lines += ["", "**Disagreements with the paper, one by one.**", "",
              f"1. *Our gains are larger (+7.3-11.0% in the paper).* The baseline's work imbalance on these datasets "
              f"is {min(imb):.2f}-{max(imb):.2f} (live tiles, max/mean): they hold only a few long documents per 128K "
              "sequence (the docs/seq column), and dual_chunk balances a causal triangle, not documents. A larger "
              "share of non-attention work (the paper's model: MTP, vocabulary, recomputation, which we leave "
              "out) shrinks every gain: halving the matmul efficiency (non-attention twice as slow) gives "
              f"{_pct(next((r.get(COMBINED) for r in sens if r['param'] == 'matmul_efficiency' and r['factor'] == 0.5), None))} "
              "on the middle dataset (sensitivity table). The paper's datasets and model details are not public here, so this is the "
              "likely but unverified cause.",
              f"2. *Balance alone carries the gain.* sparse+allgather reaches {_range(sag)}, within ~1-2 points "
              "of the combined method at cp 16: with GQA 8:1 the K/V all-gather is ~2.4 ms of a 20-50 ms "
              "attention layer, so even a free exchange can only win that back. The paper attributes part of "
              "its gain to the exchange; a model with more K/V bytes per token (the comm_bytes rows) or a "
              "higher cp gives the exchange more to win.",
              f"3. *The ablation (no hierarchy: below the baseline on 2 of 3).* At cp {layout.cp} flat routing "
              f"stays above the baseline ({_range(flat)}): the balance gain outweighs the exposed InfiniBand "
              "time, since each rank pulls its remote K/V through its own 50 GB/s NIC while the all-gather "
              "spreads it over all 8 NICs of a node."
              + (f" At cp {alt_layout.cp} flat routing falls below the baseline on every dataset "
                 f"({_range([gains(r).get('sparse+overlap') for r in alt_results.values()])}), which is the "
                 "paper's finding; so the model puts the paper's CP group at more than 2 nodes, or its K/V "
                 "traffic higher than ours." if alt_results else ""),
              f"4. *torch context_parallel style* (head-tail = dual_chunk placement, all-gather, FlexAttention) "
              f"is below the baseline ({_range(torch_cp)}): the same imbalance and Flex's slower tiles "
              "(kernel tables: ~75 vs ~56 ns per tile and query head, forward+backward, D=128 GQA).",
              "5. *Hierarchical routing on today's planner.* Its first round still mixes NVLink and "
              "InfiniBand transfers, so stage 1 waits for InfiniBand; the cp-plan branch separates them "
              "([intra direct, cross direct, intra relay]). The model reads `plan.rounds`, so rerunning after "
              "that merge shows the change without touching the model.", ""]
    if sweep:
        s128 = sweep.get(131072) or next(iter(sweep.values()))
        cps = sorted(s128)

        def gain_at(cp, m):
            r = s128[cp]
            return r[m]["tokens_per_s"] / r[BASELINE]["tokens_per_s"] - 1 if m in r else None

        lines += [f"**cp sweep (7B dense).** At 128K the combined method's gain goes "
                  + ", ".join(f"{_pct(gain_at(cp, COMBINED) if gain_at(cp, COMBINED) is not None else gain_at(cp, 'sparse+overlap'))} (cp {cp})" for cp in cps)
                  + "; sparse+allgather "
                  + ", ".join(f"{_pct(gain_at(cp, 'sparse+allgather'))}" for cp in cps)
                  + ". With 1K-2K tokens per rank the attention kernels shrink to a few ms per layer while the "
                    "exchange does not, so exposed communication grows with cp; flat routing collapses beyond "
                    "one node (per-GPU NIC). At 512K there is 4x more work per byte moved and the gains stay "
                    "large. " + _host_sentence(s128, cps), ""]
    return lines


def _host_sentence(by_cp: dict, cps) -> str:
    """Whether the host floor binds, for the lean runtime and the runtime on main."""
    lean = [cp for cp in cps if any(v["attention_host_floor"] for k, v in by_cp[cp].items() if k != ON_MAIN)]
    main = [cp for cp in cps if ON_MAIN in by_cp[cp] and by_cp[cp][ON_MAIN]["attention_host_floor"]]
    top = max(c for c in cps if ON_MAIN in by_cp[c])
    r = by_cp[top][ON_MAIN]
    out = ("With the lean runtime (<= 64 launches per layer) " +
           ("no configuration is host-bound" if not lean else f"cp {lean} are host-bound") + "; with the "
           f"runtime on main (the '{ON_MAIN}' column: its op counts x the host time per op) ")
    if not main:
        out += (f"none is either at 128K: at cp {top} its host time is {r['host_s'] * 1e3:.1f} ms against "
                f"{r['attention_s'] * 1e3:.1f} ms of attention GPU time per layer (close: a 2x slower host "
                "op, or fewer heads, makes it host-bound).")
    else:
        out += f"cp {main} are host-bound at 128K, where the lean runtime is not."
    return out
