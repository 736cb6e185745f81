"""benchmarks/results/scale_model.md: tables a person reads (every model number a PREDICTION)."""

from __future__ import annotations

import json
import os
from typing import Optional

from .experiment import BASELINE, COMBINED, METHODS, ON_MAIN, PAPER_GAINS, _summ, attribution, gains
from .calibrate import RESULTS, SLOTS, cost_for, measured_env
from .validate import LAUNCH_FLOOR, TARGET, call_name, summary
from .runtime_ops import SMALL_INDEX_ROWS


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
    import os

    from .calibrate import MATMUL_FILE
    if os.path.exists(MATMUL_FILE):
        lines.append("| matmul (non-attention) | measured bf16 throughput of one layer's GEMMs at the models' "
                     "per-rank token counts (scale_model_matmul.json: 1K-16K tokens, 283-746 TFLOP/s; the "
                     "nearest token count is used) | measured (so matmul_efficiency above is unused) |")
    lines.append(f"| attention (flashmask3) | {costs.flashmask3.describe()} | see source |")
    lines.append(f"| attention (FlexAttention, torch_cp) | {costs.flex.describe()} | see source |")
    lines.append(f"| attention, other GQA groups | a model whose query heads per KV head lie between 1 and a fit's "
                 f"group ({costs.flashmask3.group}:1 flashmask3, {costs.flex.group}:1 FlexAttention) takes every "
                 "fitted term linear in log2(group) between the MHA and GQA fits (`calibrate.between`; the 7B "
                 "model's 4:1) | assumed; tested by the CP runtime checks' 2:1 |")
    if runtime.kind == "lean":
        lines.append("| runtime | lean: host time <= 64 launches/layer (the cp-runtime target); device work = the ops "
                     "recorded from the real runtime on each rank's plan (scale_model/runtime_ops.py) at "
                     "runtime_copy_bw | host: assumed; device: recorded ops, fitted bandwidth |")
    else:
        lines.append(f"| runtime | {runtime.kind} (op counts of the runtime on main) | assumed |")
    from flashmask3.distributed.program import AUTO_FLAT_MAX_CP

    calls = getattr(runtime, "bwd_calls", "stage")
    lines.append(f"| overlapped backward calls | {calls}"
                 + (f" (the runtime's rule per plan: one for hierarchical plans, one+local for flat plans "
                    f"of <= {AUTO_FLAT_MAX_CP} ranks, stage beyond)"
                    if calls == "auto" else "") + " | the runtime's backward_calls |")
    keep = getattr(runtime, "keep_kv", False)
    lines.append(f"| overlapped backward's K/V | {'kept from the forward (no K/V rounds)' if keep else 'fetched again'}"
                 " | the runtime's keep_kv |")
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
    if single.get("measured"):
        lines += measured_section(single["measured"])
    if single.get("transfer"):
        lines += transfer_section(single["transfer"])
    if single.get("kv_expansion"):
        lines += kv_expansion_section(single["kv_expansion"])
    if single.get("cp_runtime"):
        lines += cp_runtime_section(single["cp_runtime"])
    if single.get("cp_ptrr"):
        lines += cp_runtime_section(single["cp_ptrr"], "cp_ptrr.json", "sparse vs PTRR placements",
                                    (single.get("cp_runtime") or {}).get("env", {}).get("gpu"))
    if single.get("cp_graph"):
        lines += cp_graph_section(single["cp_graph"], (single.get("cp_runtime") or {}).get("host_ratio"))
    return lines


def _balance_item(sag, comb) -> str:
    """Item 2 of the disagreements: how much of the combined method's gain balance alone gives
    (sparse+allgather vs the combined method at the paper's cp, per dataset)."""
    diff = [a - c for a, c in zip(sag, comb)]
    head = (f"2. *Balance {'alone ' if max(diff) > 0 else ''}carries {'the' if max(diff) > 0 else 'most of the'} "
            f"gain.* sparse+allgather reaches {_range(sag)}, {_pts(min(diff))} to {_pts(max(diff))} points "
            "against the combined method at cp 16 (positive: the all-gather is ahead): with GQA 8:1 the K/V "
            "all-gather is ~2.4 ms of a 20-50 ms attention layer, so even a free exchange can only win that back")
    if max(diff) > 0:
        why = (", and the overlapped stage calls cost more than that (above): their per-call cost and, with "
               "the per-program model, their underfilled grids (a stage call over few key blocks runs few "
               "backward programs: the 'no SM underfill' column).")
    else:
        why = ("; the overlapped stage calls give part of it back (their per-call cost and underfilled grids: "
               "the 'no SM underfill' column), while the all-gather runtime's own device work (every needed "
               "key gathered in both passes, the dK/dV scattered into a zeroed full-sequence buffer) is "
               "larger than the overlapped runtime's (the recorded runtime ops).")
    return (head + why + " The paper attributes part of its gain to the exchange; a model with more K/V bytes "
            "per token (the comm_bytes rows), a higher cp, or a runtime with cheaper calls gives the exchange "
            "more to win.")


def cp_runtime_section(v: dict, file: str = "cp_runtime_breakdown.json", what: str = "",
                       fit_gpu: Optional[str] = None) -> list[str]:
    """The CP runtime on one GPU per rank (validate.validate_cp_runtime) of ``file``: the
    attention kernels, the runtime's own device work (recorded from the real runtime), the GPU's
    busy time and the layer, each against the profiled or measured time. A file checked with
    another file's runtime bandwidths (no cp sizes fitted on it) says so, and where that file
    came from another GPU (``fit_gpu``), that its memory-bound runtime ops need not match."""
    env, a = v["env"], v["args"]
    fit = ", ".join(str(c) for c in v["copy_fit_cp"])
    fitted = (f"one least-squares fit on the cp {fit} ranks' profiled totals" if fit else
              "the fit of cp_runtime_breakdown.json above, none on this file")
    held = "held out: the other cp sizes" if fit else "every rank held out"
    checks = [("kernels", "kernels"), ("runtime", "runtime ops"), ("busy", "busy"), ("layer", "layer"),
              ("layer_host_model", "layer, host per op from host_breakdown")]
    lines = [f"### The CP runtime on one GPU, per rank{', ' + what if what else ''} ({file})", "",
             f"`benchmarks/cp_single_gpu.py --breakdown` on one {env.get('gpu', env['device'])} "
             f"({env['date']}): every timed rank's layer (fwd+bwd, {a['tokens'] // 1024}K tokens, "
             f"Hq={a['heads']}, Hk={a['kv_heads']}, D={a['head_dim']}, causal documents) through the real "
             "runtime, communication emulated by device copies, one more step profiled. Each rank's plan "
             "is rebuilt from the recorded document lengths (its work checked against the file's) and its "
             "layer's op sequence is recorded from the real runtime on the meta device "
             "(`scale_model/runtime_ops.py`: every attention call, torch op, small kernel and emulated "
             "copy, in issue order, with the bytes it moves). The attention calibration never saw this "
             f"head layout ({a['heads']}/{a['kv_heads']}) nor the runtime"
             + (f": its cost is interpolated between the MHA and {_gqa_fit_group()}:1 GQA fits "
                "(`calibrate.between`)" if cost_for("flashmask3", a['heads'], a['kv_heads']).interpolated
                else "") + ".", "",
             "- **kernels**: the model's GPU time of the rank's attention calls vs flashmask3's attention "
             "kernels in the profile (all ranks held out).",
             f"- **runtime ops**: the recorded non-attention ops (torch ops, the merge / key-gather / pack / "
             f"gradient-sum kernels, the emulated exchange's copies), each at the bandwidth of its rate class "
             f"({bandwidths_text(v['bandwidths'])}; {fitted}), plus {LAUNCH_FLOOR * 1e6:.0f} µs a launch, "
             f"vs their profiled time; {held}. The classes are the kernels torch and the runtime run: "
             f"contiguous copies and gathers; `index_select` of at most {SMALL_INDEX_ROWS} rows (torch's small-index kernel); indexed writes and strided "
             "copies (`index_copy_`, `index_add_`, `stack`); fills."
             + _transfer_sentence(v, fit_gpu),
             "- **busy**: the two together vs the GPU's busy time in the profiled layer.",
             "- **layer**: host and GPU take the recorded ops in order (the host's µs per op from "
             "`host_breakdown.json`, scaled to the rank's measured host time, the autograd engine's hand-off "
             "as measured; a GPU op starts when it is issued and the GPU is free) vs the measured layer "
             "(CUDA events).",
             "- **layer, host per op from host_breakdown**: the same without the scaling, a prediction of "
             "the host too (another day's host measurement; this VM's host speed drifts by tens of percent).",
             "", "| layout | ranks | " + " | ".join(f"{t}: max / mean abs error" for _, t in checks)
             + " | measured: runtime ops / GPU idle, ms (mean) |",
             "|---|---|" + "---|" * len(checks) + "---|"]
    for name, e in v["by_config"].items():
        if not e["kernels"]:
            continue
        cells = []
        for key, _ in checks:
            sm = summary(e[key], held_only=False)
            cells.append(f"{sm['max_abs_error']:.1%} / {sm['mean_abs_error']:.1%}")
        t = sum(p.measured for p in e["runtime"]) / len(e["runtime"]) * 1e3
        i = sum(e["idle"]) / len(e["idle"]) * 1e3
        lines.append(f"| {name} | {len(e['kernels'])} | " + " | ".join(cells) + f" | {t:.2f} / {i:.2f} |")
    lines.append("")
    for key, title in checks:
        allp, held = summary(v[key], held_only=False), summary(v[key])
        lines.append(f"- {title}: {allp['within_target']} of {allp['points']} ranks within {TARGET:.0%} "
                     f"(worst {allp['max_abs_error']:.1%}); held out {held['within_target']} of "
                     f"{held['points']} (worst {held['max_abs_error']:.1%}).")
    lines.append("")
    return lines


def _transfer_sentence(v: dict, fit_gpu: Optional[str]) -> str:
    """For a file from another GPU than ``fit_gpu``'s (the first runtime file's): that its
    bandwidths are its own GPU's fit, and how the other GPU's fit did on it (``v['transfer']``)."""
    gpu = v["env"].get("gpu")
    if not (fit_gpu and gpu and fit_gpu != gpu):
        return ""
    text = (f" These bandwidths are this GPU's own (params.RUNTIME_FITS): the copies and fills are bound by "
            f"memory bandwidth, which differs between an {gpu} and an {fit_gpu} (H100 3.35, H200 4.8 TB/s "
            "by the datasheets).")
    t = v.get("transfer")
    if t and t.get("runtime"):
        sm = summary(t["runtime"])
        text += (f" With the {fit_gpu}'s fit ({bandwidths_text(t['bandwidths'])}) instead, the runtime ops "
                 f"would be {sm['within_target']} of {sm['points']} ranks within {TARGET:.0%} (worst "
                 f"{sm['max_abs_error']:.1%}, mean {sm['mean_abs_error']:.1%}): a transfer between GPUs "
                 "needs the new GPU's profile.")
    return text


def bandwidths_text(bw: dict) -> str:
    """The runtime ops' bandwidths by rate class, for a sentence."""
    return ", ".join(f"{c.replace('_', '-')} {x / 1e12:.2f}" for c, x in bw.items()) + " TB/s"


def cp_graph_section(v: dict, breakdown_host_ratio=None) -> list[str]:
    """Each rank's layer replayed from a CUDA graph (validate.validate_cp_graph): the model's
    GPU-only layer against a measurement without host gaps."""
    env, a = v["env"], v["args"]
    lines = ["### The CP layer without the host: replayed from a CUDA graph (cp_graph.json)", "",
             f"`benchmarks/cp_single_gpu.py --graph` on one {env.get('gpu', env['device'])} ({env['date']}): "
             f"each timed rank's layer (fwd+bwd, {a['tokens'] // 1024}K tokens, Hq={a['heads']}, "
             f"Hk={a['kv_heads']}, D={a['head_dim']}) captured once in a CUDA graph and replayed, so the "
             "host issues one launch and the layer is the GPU's work back to back. Predicted: the rank's "
             "attention calls by the cost model plus its recorded runtime ops at "
             f"{bandwidths_text(v['bandwidths'])} (fitted on another run's profiles above), no host term. "
             "Every point is held out (no parameter was fitted on this file).", "",
             "| layout | ranks | measured replay ms (mean) | predicted ms (mean) | max / mean abs error "
             "| eager layer ms (mean) |", "|---|---|---|---|---|---|"]
    for name, e in v["by_config"].items():
        pts, sm, n = e["graph"], summary(e["graph"]), len(e["graph"])
        lines.append(f"| {name} | {n} | {sum(p.measured for p in pts) / n * 1e3:.2f} "
                     f"| {sum(p.predicted for p in pts) / n * 1e3:.2f} "
                     f"| {sm['max_abs_error']:.1%} / {sm['mean_abs_error']:.1%} | {sum(e['eager']) / n * 1e3:.2f} |")
    sm = summary(v["graph"])
    lines += ["", f"{sm['within_target']} of {sm['points']} ranks within {TARGET:.0%} (worst "
              f"{sm['max_abs_error']:.1%}, mean {sm['mean_abs_error']:.1%}).", ""]
    if v.get("eager_host_model"):
        e = summary(v["eager_host_model"])
        lines += [f"The same ranks' eager layers (same run) with the host per op from `host_breakdown.json` "
                  f"unscaled (the breakdown's last check, on a second file): {e['within_target']} of "
                  f"{e['points']} within {TARGET:.0%} (worst {e['max_abs_error']:.1%}, mean "
                  f"{e['mean_abs_error']:.1%}). Median measured / modelled host per rank: "
                  f"{v['host_ratio']:.2f} in this run"
                  + (f", {breakdown_host_ratio:.2f} in the breakdown's" if breakdown_host_ratio else "")
                  + " (the VM's host speed between runs).", ""]
    return lines


def _quantiles(xs: list[float]) -> str:
    """``median (10-90%: a-b)`` of ratios, two decimals ("-" for none)."""
    if not xs:
        return "-"
    xs = sorted(xs)
    q = lambda p: xs[round(p * (len(xs) - 1))]  # noqa: E731
    return f"{q(0.5):.2f} (10-90%: {q(0.1):.2f}-{q(0.9):.2f})"


def transfer_section(t: dict) -> list[str]:
    """The H200's kernel fits on an H100: the same calls' GPU times, predicted and compared."""
    env, ratio, mm, factor = t.get("env", {}), t["ratios"], t["matmul"], t["memory_factor"]
    small = ratio["fwd_bwd_small"]
    bare = summary(t["without_memory_term"])
    lines = ["### The same calls on an H100 (scale_model_attention_h100.json)", "",
             f"The paper's cluster is H100s; the kernel fits come from an H200. benchmarks/gpu/scale-model.sh timed "
             f"the calibration's calls again on one {env.get('gpu', '?')} ({env.get('date', '?')}, torch "
             f"{env.get('torch', '?')}, triton {env.get('triton', '?')}). GPU time per call, H100 / H200, over the "
             f"{len(ratio['fwd'])} calls both files timed: forward {_quantiles(ratio['fwd'])}, forward+backward "
             f"{_quantiles(ratio['fwd_bwd'])}; forward+backward calls under 0.3 ms {_quantiles(small)} "
             f"({len(small)} calls). The tensor-core work runs at the same speed (`gpu_scale` 1); what the H100 "
             "lacks is memory bandwidth, which the backward's per-query-block passes (the delta pre-pass, dQ "
             "zeroing and scaling: `a_q`) need. The model runs those at the target GPU's copy bandwidth "
             f"(`params.RUNTIME_FITS`, fitted on the CP runtime's own copies: x{factor:.3f} on the H100) and "
             "everything else as calibrated. That term was added after the first H100 file (2026-12-07 09:27, "
             "since replaced) showed the small GQA backward calls slower than predicted; its factor comes "
             "from the runtime's copies, not from either file. With those passes at the H200's speed this file's "
             "forward+backward check would have "
             f"{bare['within_target']} of {bare['points']} points within 15% (worst {bare['max_abs_error']:.1%}). "
             f"Matmul throughput at the model's shapes, H100 / H200: {_quantiles(mm)}, {min(mm):.2f}-{max(mm):.2f} "
             "in all (the step model keeps the H200's, scale_model_matmul.json). The H200's fits predicting the "
             "H100's GPU times, and its streams with the host time the H100 machine took for those very calls "
             "(`its own host`) and with the H100 machine's host terms, taken from this file's host-relevant "
             "calls as the calibration takes its own (`its machine's host`: "
             + ", ".join(f"{cls} {h}" for cls, h in t.get("machine_host", {}).items())
             + "; the GPU part held out on every point):", "",
             "| class | check | points | max abs error | mean abs error | within 15% |", "|---|---|---|---|---|---|"]
    every = []
    for cls, checks in t["classes"].items():
        for check, pts in checks.items():
            sm = summary(pts)
            lines.append(f"| {cls} | {check} | {sm['points']} | {sm['max_abs_error']:.1%} | "
                         f"{sm['mean_abs_error']:.1%} | {sm['within_target']} |")
            every += pts
    sm = summary(every)
    lines += ["", f"Target (<= {TARGET:.0%} on every point): {'met' if sm['max_abs_error'] <= TARGET else 'NOT met'} "
              f"({sm['within_target']} of {sm['points']} within, worst {sm['max_abs_error']:.1%}).", ""]
    noise = _host_noise_text(t.get("repeated", []))
    return lines + ([f"This file's stream samples (`measure.repeat_streams`): {noise}", ""] if noise else [])


def kv_expansion_section(points) -> list[str]:
    """The held-out A/B of the expanded GQA backward (validate.validate_kv_expansion)."""
    worst = max(abs(p.error) for p in points)
    lines = ["### A change the model was not fitted on: the expanded GQA backward (gqa_expand_ab.json)", "",
             "The library runs a GQA backward whose grouped dK/dV grid (one program per key block and KV "
             "head) would leave most SMs idle with each group split over one program per query head "
             "(`dispatch.kv_expansion`; since session 26 inside the kernels, KV_SPLIT, fp32 partials summed by one "
             "launch; docs/kernels.md). The calibration above was measured with the grouped backward only; "
             "`benchmarks/gqa_expand_ab.py` timed both on one H200 afterwards (fwd+bwd GPU time, host hidden; "
             "the 'expanded' rows are the split arm). The per-program model's predictions, from the GQA "
             "calibration:", "",
             "| call | measured ms | predicted ms | error |", "|---|---|---|---|"]
    lines += [f"| {p.name} | {_ms(p.measured)} | {_ms(p.predicted)} | {_pct(p.error)} |" for p in points]
    lines += ["", f"Worst error {worst:.1%} ({'within' if worst <= TARGET else 'outside'} {TARGET:.0%}).", ""]
    return lines


#: The checks of the current kernels' measurements, in the order the report shows them.
MEASURED_CHECKS = ("fwd GPU", "fwd+bwd GPU", "fwd stream", "fwd+bwd stream", "fwd stream, one sample",
                   "fwd+bwd stream, one sample", "fwd stream, row's host",
                   "fwd+bwd stream, row's host", "fwd stream, its own host", "fwd+bwd stream, its own host",
                   "fwd do_bench", "fwd+bwd do_bench", "fwd do_bench, row's host",
                   "fwd+bwd do_bench, row's host", "fwd", "fwd+bwd")


def _measured_rows(cls: str, d: dict, cost) -> list[str]:
    lines = []
    for kind in MEASURED_CHECKS:
        host = cost.fwd.floor + (cost.bwd.floor if kind.startswith("fwd+bwd") else 0.0)
        for check in ("in_sample", "held_out"):
            pts = d[check].get(kind)
            if not pts:
                continue
            sm = summary(pts, held_only=False)
            big = [abs(p.error) for p in pts if p.measured > 2 * host]
            bigs = f"{max(big):.1%} / {sum(big) / len(big):.1%}, {len(big)}" if big else "—"
            lines.append(f"| {cls} | {kind} | {check.replace('_', ' ')} | {sm['points']} | {sm['max_abs_error']:.1%} | "
                         f"{sm['mean_abs_error']:.1%} | {sm['within_target']} | {bigs} |")
    return lines


def measured_section(measured: dict) -> list[str]:
    """The current kernels' calibration against its own per-rank-shape measurements."""
    any_d = next(iter(measured.values()))
    any_cost = any_d["cost"]
    on_gpu = any_cost.fwd.host_measured
    greedy = any_cost.fwd.schedule == "greedy"
    env = measured_env()
    model = ("`max(host, GPU)`, GPU = `call + makespan(programs) + heads x a_q x query blocks`: the forward "
             "runs one program per (128-row query block, query head), the fused backward one per (128-key "
             "block, KV head) looping over the Hq/Hk query heads of its group; a program costs `a_program + "
             "group x (a_full x its full tiles + a_partial x its partial tiles)` on one SM; programs go in "
             "launch order to whichever of the 132 SMs frees first (one resident program per SM); `a_q` is "
             "the backward's whole-GPU passes over the query rows (pre-pass, dQ scaling)" if greedy else
             "`max(host, GPU)`, GPU = `call + heads x ((a_full x full + a_partial x partial) x fill + a_q x "
             "query blocks + a_k x key blocks)`")
    lines = ["### The current kernels at per-rank shapes (scale_model_attention.json)", "",
             f"Measured by benchmarks/gpu/scale-model.sh on one {env.get('gpu', '?')} ({env.get('date', '?')}, "
             f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}): every stage call and all-gather "
             "call of real plans (causal document masks, 128K tokens, cp 8-128, dual_chunk and sparse), B=1, D=128, "
             "GQA 32/4 and MHA 16/16, bf16, through the public `flashmask_attention`. Model of one call in a "
             f"stream of calls, per pass: {model}. "
             + ("Each shape has the GPU time (CUDA events around back-to-back calls behind a GPU sleep, host "
                "hidden) and the host time per call (CPU time to enqueue them): the GPU part is fitted on the GPU "
                "time, the host term is the measured median host time per call. "
                if on_gpu else
                "This file has only do_bench medians (host work included; measured before the script recorded "
                "GPU and host time apart), so the host term is fitted as a floor of the do_bench times. ")
             + "**in-sample** = fitted on every shape; **held out** = fitted on the dual_chunk plans' calls only, "
             "predicting the sparse plans' calls.", ""]
    if greedy:
        ex: dict = {}
        for d in measured.values():
            for k, v in d["excluded"].items():
                ex[k] = ex.get(k, 0) + v
        n_ex = sum(sum(d["excluded"].values()) for d in measured.values())
        n_all = sum(d["rows"] for d in measured.values())
        lines += [f"Per-program tiles: rebuilt for {n_all - n_ex} of {n_all} measured calls from the same plans "
                  "`measure.py` built (`measure.plan_calls`: document lengths, cp, balance, nodes, rank, stage), "
                  "each checked against the row's recorded `full_tiles` / `partial_tiles`; "
                  + (f"{n_ex} excluded (" + ", ".join(f"{k}: {v}" for k, v in sorted(ex.items()))
                     + "; the `corpus` spread is packed from the measuring machine's files and this file predates "
                     "`spreads`, the stored lengths) and not predicted." if n_ex else "none excluded.")
                  + " Checks: `GPU` = the GPU part vs the GPU time; `stream` = `max(host, GPU)` vs the steady-state "
                  "time per call of back-to-back calls (the quantity the step model predicts; measured from "
                  "session 19 on), the mean of the call's samples: the calls whose host could set their time (GPU "
                  "time under twice the host time) have more samples, taken in rounds over the whole run "
                  "(`measure.repeat_streams`, files from session 48 on), the GPU-bound ones one; `one sample` = "
                  "the same against the call's first sample alone (one ~10 ms sample of a host-bound call follows "
                  "the host's speed at that moment); `do_bench` = `max(GPU, host - memset)` vs triton's do_bench "
                  "median (files before session 19), where the 256 MB buffer do_bench zeroes before each call (~62 us at 4.3 TB/s) "
                  "hides that much host work of a host-bound call; `row's host` = the same with the host time "
                  "measured for that row instead of the median (tests how host and GPU combine, not the host's "
                  "scatter); `its own host` = the same with the CPU time the host took for the very calls the "
                  "stream timed (files from session 20 on: the host's drift between the two loops removed; the "
                  "first sample's).", ""]
    header = ["| class | pass | check | points | max abs error | mean abs error | within 15% | GPU-bound calls (> 2x host): max / mean, n |",
              "|---|---|---|---|---|---|---|---|"]
    for cls, d in measured.items():
        lines += header + _measured_rows(cls, d, d["cost"])
        lines.append("")
        lines.append(f"{cls}: {d['cost'].describe()}")
        lines.append("")
    lines += _target_lines(measured)
    if greedy and all("fill" in d for d in measured.values()):
        lines += ["The session-18 model (`fill`: total tiles x max(1, SMs / programs), + per-block terms) refitted "
                  "on the same calls, GPU time, for comparison:", ""] + header
        for cls, d in measured.items():
            lines += [ln for ln in _measured_rows(cls, d["fill"], d["cost"]) if " GPU |" in ln]
        lines.append("")
    if not on_gpu:
        lines += ["The worst errors are small calls on the host-bound floor, which scatters 0.25-0.73 ms "
                  "(forward) and 1.4-2.5 ms (forward+backward) whatever the tiles (host noise on the GPU machine, "
                  "inseparable from GPU time in do_bench).", ""]
    elif greedy:
        lines += _host_scatter_lines(measured) + _outlier_lines(measured)
    return lines


#: The checks whose misses :func:`_outlier_lines` lists one by one (the model's own quantities:
#: the GPU part, the stream (each call's samples' mean) and the stream with the host of the very
#: calls it timed).
OUTLIER_CHECKS = ("fwd GPU", "fwd+bwd GPU", "fwd stream", "fwd+bwd stream", "fwd stream, its own host",
                  "fwd+bwd stream, its own host")


def standard_error(samples) -> float:
    """The standard error of the mean of ``samples`` (sample standard deviation / sqrt(n))."""
    import numpy as np

    return float(np.std(samples, ddof=1) / np.sqrt(len(samples)))


def _standard_error_text(ms: list) -> str:
    """``"0.342 +- 0.022 ms (one standard error)"``: a call's mean stream time and how well its
    samples pin it down, so a reader can tell a model miss from the measurement's own noise."""
    return f"{sum(ms) / len(ms):.3f} +- {standard_error(ms):.3f} ms (one standard error)"


def _outlier_lines(measured: dict) -> list[str]:
    """Every point of :data:`OUTLIER_CHECKS` outside the target, with what else was measured for
    the same call (its GPU time in the overlap loop vs its stream time): a reader sees whether a
    miss is the model's or the measurement's."""
    from .calibrate import MEASURED_FILE, measured_rows

    rows = {call_name(r): r for gqa in (True, False) for r in measured_rows(MEASURED_FILE, 128, gqa)[0]}
    out = []
    for cls, d in measured.items():
        for c in ("in_sample", "held_out"):
            for check in OUTLIER_CHECKS:
                for p in d[c].get(check, []):
                    if abs(p.error) <= TARGET:
                        continue
                    r = rows.get(p.name, {})
                    pas = "fwd_bwd" if check.startswith("fwd+bwd") else "fwd"
                    extra = ""
                    if f"stream_{pas}_ms" in r:
                        ms = [r[f"stream_{pas}_ms"]] + list(r.get(f"stream_{pas}_ms_repeats", []))
                        host = [r[f"stream_host_{pas}_us"]] + list(r.get(f"stream_host_{pas}_us_repeats", []))
                        extra = (f"; its GPU time {r[f'gpu_{pas}_ms']:.3f} ms in the overlap loop; "
                                 + (f"{len(ms)} stream samples {min(ms):.3f}-{max(ms):.3f} ms, their mean "
                                    f"{_standard_error_text(ms)}, host {sum(host) / len(host):.0f} us a call (mean)"
                                    if len(ms) > 1 else
                                    f"one stream sample {ms[0]:.3f} ms, host {host[0]:.0f} us a call"))
                    out.append(f"| {cls} | {c.replace('_', ' ')} | {check} | {p.name} | "
                               f"{p.measured * 1e3:.3f} | {p.predicted * 1e3:.3f} | {p.error:+.1%}{extra} |")
    if not out:
        return []
    return (["Points outside the target on the model's own quantities (GPU part; stream, its samples' mean and "
             "with its own host):", "",
             "| class | fit | check | call | measured ms | predicted ms | error; the same call's other times |",
             "|---|---|---|---|---|---|---|"] + out + [""])


#: The target's checks of the current kernels' file (the model's prediction of each measured
#: point, :func:`_target_lines`), and the diagnostics beside them: one stream sample alone
#: instead of a call's mean; the prediction with the host of the separate host loop; do_bench
#: (files before session 19).
TARGET_CHECKS = ((("fwd GPU", "fwd+bwd GPU"), "GPU time"),
                 (("fwd stream", "fwd+bwd stream"), "stream time (each call's samples' mean)"),
                 (("fwd stream, its own host", "fwd+bwd stream, its own host"), "stream time, its own host"),
                 (("fwd", "fwd+bwd"), "do_bench time (fitted floor)"))
DIAGNOSTIC_CHECKS = ((("fwd stream, one sample", "fwd+bwd stream, one sample"), "stream time, one sample"),
                     (("fwd stream, row's host", "fwd+bwd stream, row's host"), "stream time, row's host"),
                     (("fwd do_bench", "fwd+bwd do_bench"), "do_bench time"),
                     (("fwd do_bench, row's host", "fwd+bwd do_bench, row's host"), "do_bench time, row's host"))


def _check_texts(measured: dict, checks) -> list[str]:
    """``label met|NOT met (worst, n of m within)`` per kind of check, worst over classes, in
    sample and held out."""
    out = []
    for kinds, label in checks:
        errs = [abs(p.error) for d in measured.values() for c in ("in_sample", "held_out")
                for k in kinds for p in d[c].get(k, [])]
        if errs:
            worst = max(errs)
            out.append(f"{label} {'met' if worst <= TARGET else 'NOT met'} (worst {worst:.1%}, "
                       f"{sum(e <= TARGET for e in errs)} of {len(errs)} within)")
    return out


def _target_lines(measured: dict) -> list[str]:
    """The <= 15% target on the model's predictions of the measured points, and the diagnostics."""
    target, diag = _check_texts(measured, TARGET_CHECKS), _check_texts(measured, DIAGNOSTIC_CHECKS)
    lines = ([f"Target (<= {TARGET:.0%} on every checkable point), these measurements: " + "; ".join(target) + "."]
             if target else [])
    if diag:
        lines.append("Diagnostics (not the target's points: a call's first stream sample alone instead of its "
                     "samples' mean; the prediction with the host time of the separate host loop; do_bench in "
                     "older files): " + "; ".join(diag) + ".")
    return [ln for t in lines for ln in (t, "")]


def _host_scatter_lines(measured: dict) -> list[str]:
    """What bounds the do_bench / stream checks: the host time per call scatters between rows."""
    from .calibrate import MEASURED_FILE, measured_rows

    import numpy as np

    hs = []
    for gqa in (True, False):
        hs += [r["host_fwd_us"] for r in measured_rows(MEASURED_FILE, 128, gqa)[0] if "host_fwd_us" in r]
    if not hs:
        return []
    q = np.percentile(hs, [0, 10, 50, 90, 100])
    rows = measured_rows(MEASURED_FILE, 128, True)[0] + measured_rows(MEASURED_FILE, 128, False)[0]
    gap = {}
    for k, g, h in (("fwd_ms", "gpu_fwd_ms", "host_fwd_us"), ("fwd_bwd_ms", "gpu_fwd_bwd_ms", "host_fwd_bwd_us")):
        e = [r[k] / r[g] - 1 for r in rows if k in r and r[g] * 1e3 > 2 * r[h]]
        if e:
            gap[k] = (max(abs(x) for x in e), float(np.mean(e)), len(e))
    return [f"The host time per forward call scatters between rows of the same code path: {q[0]:.0f} / {q[1]:.0f} / "
            f"{q[2]:.0f} / {q[3]:.0f} / {q[4]:.0f} us (min / 10% / median / 90% / max), drifting over the run. A "
            "host-bound call's time follows its own host sample, which no shape-based model predicts: that, not the "
            "GPU model, is what the `do_bench` and `stream` rows with the median host miss by. do_bench also flushes "
            "L2 before every call and times each call alone"
            + ("" if not gap else ": on GPU-bound calls (> 2x host) the do_bench median differs from the GPU time of "
               "the same call by up to " + " / ".join(f"{m:.1%} (mean {mu:+.1%}, {n} calls)" for m, mu, n in gap.values())
               + " (forward / forward+backward), a gap between two measurements that no model fitted on either "
               "closes")
            + ". It is not the quantity the step model predicts (a rank's back-to-back stage calls): `measure.py` "
            "now records the stream time instead (steady state of back-to-back calls, CUDA events over the second "
            "half of the stream).", ""] + _repeat_lines(rows, measured["GQA"]["cost"].bwd.expand_host
                                                      if "GQA" in measured else None)


def _gqa_fit_group() -> int:
    """Query heads per KV head of flashmask3's GQA fit."""
    from .calibrate import load_cost

    return load_cost("flashmask3", True).group


def _repeat_lines(rows: list[dict], expand_host: Optional[float] = None) -> list[str]:
    """What the repeated stream samples (``measure.repeat_streams``) say about the host's speed
    (``expand_host``: the GQA fit's expanded backward host, :func:`calibrate.measured_host`)."""
    import numpy as np

    from .calibrate import EXPAND_HOST_S, sample_mean as mean

    rep = [r for r in rows if "stream_host_fwd_bwd_us_repeats" in r]
    if not rep:
        return []

    n = int(np.median([1 + len(r["stream_host_fwd_bwd_us_repeats"]) for r in rep]))
    f = np.percentile([mean(r, "stream_host_fwd_us") for r in rep], [0, 10, 50, 90, 100])
    b = np.percentile([mean(r, "stream_host_fwd_bwd_us") for r in rep], [0, 10, 50, 90, 100])
    rounds = min(len(r["stream_host_fwd_bwd_us_repeats"]) for r in rep)
    grouped = [mean(r, "stream_host_fwd_bwd_us") for r in rep if not r.get("kv_expanded")]
    split = [mean(r, "stream_host_fwd_bwd_us") for r in rep if r.get("kv_expanded")]
    bound = [mean(r, "stream_host_fwd_bwd_us") for r in rows if "stream_host_fwd_bwd_us_repeats" not in r
             and "stream_host_fwd_bwd_us" in r]
    expanded = (f"the calls whose GQA backward ran with K/V expanded ({len(split)}) take a median "
                f"{np.median(split):.0f} us forward+backward (their means' median) against {np.median(grouped):.0f} "
                f"us for the others ({len(grouped)}), so the model's expanded GQA backward adds the difference "
                "of the GQA calls' medians (`calibrate.measured_host`: "
                + (f"{expand_host * 1e6:.0f} us" if expand_host is not None else "the fit's")
                + f"; {EXPAND_HOST_S * 1e6:.0f} us, one bare launch, where a file cannot tell)"
                if split and grouped else "none")
    source = ("The model's host terms come from these host-relevant calls (`calibrate.host_rows`)"
              + (f": the GPU-bound calls' single samples, taken while the GPU's queue is full, ran a median "
                 f"{np.median(bound):.0f} us forward+backward" if bound else "") + ".")
    by_round = np.median([r["stream_host_fwd_bwd_us_repeats"][:rounds] for r in rep], axis=0)
    noise = _host_noise_text(rep)
    return [f"Repeated samples ({len(rep)} host-relevant calls, {n} stream samples each, {rounds} rounds over all "
            f"of them): a call's mean host time per call, min / 10% / median / 90% / max over the calls, is "
            f"{f[0]:.0f} / {f[1]:.0f} / {f[2]:.0f} / {f[3]:.0f} / {f[4]:.0f} us forward and {b[0]:.0f} / {b[1]:.0f} / "
            f"{b[2]:.0f} / {b[3]:.0f} / {b[4]:.0f} us forward+backward; the median over the calls of one round "
            f"drifted {by_round.min():.0f}-{by_round.max():.0f} us (forward+backward) from round to round. The "
            "means take out most of the drift and the host's switching between two speeds (a call's samples sit "
            "near one level or the other from round to round, so a median of them picks a level; the `stream` "
            "check uses the mean, the time average a training step pays); what remains is a spread between calls "
            "of the same code path, and one pattern: " + expanded + ". " + source + " " + noise, ""]


def _host_noise_text(rep: list[dict]) -> str:
    """How much of the spread between the host-relevant calls' mean host times is the sampling
    noise of those means: each call's relative standard error against the spread of the means of
    the calls with one code path (backward without K/V expansion). Where the two agree, the data
    show no host difference between those calls' shapes, and a check of a host-bound call's mean
    at 15% is a test of its few-sample mean's noise as much as of the model."""
    import numpy as np

    key = "stream_host_fwd_bwd_us"
    grouped = [[r[key]] + list(r[key + "_repeats"]) for r in rep if not r.get("kv_expanded")]
    if len(grouped) < 3:
        return ""
    means = np.array([np.mean(s) for s in grouped])
    se = np.array([standard_error(s) for s in grouped]) / means
    spread = float(np.std(means, ddof=1) / np.median(means))
    n = int(np.median([len(s) for s in grouped]))
    return (f"How much of the spread between calls is the samples' own noise: the {len(grouped)} calls without "
            f"K/V expansion have forward+backward means that scatter by {spread:.1%} (standard deviation / "
            f"median), while each mean, of {n} samples, has a relative standard error of {np.median(se):.1%} "
            f"(median; 90%: {np.percentile(se, 90):.1%}). "
            + ("The spread is no larger than the noise: these measurements show no host difference between "
               f"the calls' shapes, and the target's {TARGET:.0%} is {TARGET / np.median(se):.1f} standard "
               "errors of a median call, "
               + ("so among a few hundred host-bound points a few can miss by sampling alone; more samples "
                  "per call shrink that." if TARGET / np.median(se) < 3.5 else
                  "so a miss by sampling alone is unlikely.") if spread <= 1.1 * np.median(se) else
               "The spread exceeds the noise: part of it is a host difference between the calls."))


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
              "| dataset | gain | no exposed comm | no imbalance | no host floor | no per-call cost | no SM underfill | ceiling (ideal attention) | attention share | non-attention share | bubble |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        a = attribution(model, layout, res)
        if not a:
            continue
        lines.append(f"| {name} | {_pct(a['gain'])} | {_pct(a['without exposed comm'])} | {_pct(a['without imbalance'])} | "
                     f"{_pct(a['without host floor'])} | {_pct(a.get('without per-call cost'))} | "
                     f"{_pct(a.get('without SM underfill'))} | {_pct(a['ceiling (attention = mean compute, no comm)'])} | "
                     f"{a['attention share of step']:.0%} | {a['non-attention share of step']:.0%} | {a['bubble share']:.0%} |")
    lines += host_sweep_table(sens)
    sens = [r for r in sens if r["param"] != "host_per_call"]
    if sens:
        lines += ["", f"Sensitivity (dataset {sens[0].get('dataset', '')}; each parameter x0.5 / x2, others as above; "
                  "gain over the baseline and the baseline's own tokens/s; PREDICTIONS). `power cap (GPU compute)` "
                  "multiplies every attention kernel's GPU time (ours and Flex's) and the matmul time by the factor, "
                  "host, links and the runtime's memory-bound copies unchanged: the calibration timed an idle GPU, "
                  "and sustained_probe_h100.json saw the power cap slow back-to-back attention calls 7-13% "
                  "(forward) and 0-4% (forward+backward) on an H100 (factor 1 = as calibrated):", "",
                  "| parameter | factor | " + " | ".join(k for k in METHODS if k != BASELINE) + f" | {BASELINE} tokens/s |",
                  "|---|---|" + "---|" * len(METHODS)]
        for r in sens:
            tps = r.get("baseline_tokens_per_s")
            lines.append(f"| {r['param']} | {r['factor']:g} | " + " | ".join(_pct(r.get(k)) for k in METHODS if k != BASELINE)
                         + f" | {'-' if tps is None else f'{tps:,.0f}'} |")
    return lines


HOST_SWEEP_COLS = ("sparse+allgather", "sparse+overlap", COMBINED)


def host_sweep_table(sens) -> list[str]:
    """The paper-setting gains as a function of the host time per attention call (PREDICTIONS)."""
    rows = [r for r in sens if r["param"] == "host_per_call"]
    if not rows:
        return []
    lines = ["", "Gain over dual_chunk+allgather vs the **host time per attention call** (PREDICTIONS; the "
             "calls' GPU part as calibrated, the host term replaced; the baseline pays it too, once per pass; "
             "a call costs max(host, GPU)):", "",
             "| dataset | host per call | host fwd / fwd+bwd us | " + " | ".join(HOST_SWEEP_COLS) + " |",
             "|---|---|---|" + "---|" * len(HOST_SWEEP_COLS)]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['host']} | {r['host_fwd_us']:.0f} / {r['host_fwd_bwd_us']:.0f} | "
                     + " | ".join(_pct(r.get(k)) for k in HOST_SWEEP_COLS) + " |")
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
                  f"{worst[0]:.2f} s ({worst[2]}, cp {worst[1]}); the model caches plan views on disk, so reruns "
                  "do not replan.", ""]
    return lines


def _range(vals) -> str:
    vals = [v for v in vals if v is not None]
    return f"{_pct(min(vals))} to {_pct(max(vals))}" if vals else "—"


def _pts(x) -> str:
    return f"{100 * x:+.1f}"


def discussion(model, layout, results: dict, alt_layout, alt_results: dict, sweep: dict, sens=(),
               goal: float = 0.12, cost=None) -> list[str]:
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
             + ("(met on every dataset); " if all(c is not None and c >= goal for c in comb) else
                "(NOT met on " + ", ".join(f"{d}: {100 * g[d][COMBINED]:+.3f}%, short by "
                                          f"{100 * (goal - g[d][COMBINED]):.3f} points"
                                          for d in g if g[d].get(COMBINED) is not None and g[d][COMBINED] < goal)
                + "); ")
             + f"without hierarchical routing (flat sparse+overlap) {_range(flat)}."]
    if alt_results:
        ga = {d: gains(r) for d, r in alt_results.items()}
        lines[-1] += (f" At cp {alt_layout.cp} ({alt_layout.cp // 8} nodes): combined "
                      f"{_range([ga[d].get(COMBINED) for d in ga])}, flat {_range([ga[d].get('sparse+overlap') for d in ga])}.")
    room = lambda key: [a[key] - a["gain"] for a in attr]  # noqa: E731
    call_room = [a["without per-call cost"] - a["gain"] for a in attr if a.get("without per-call cost") is not None]
    lines += ["", "Which term holds the combined method back (from the attribution table): at cp "
              f"{layout.cp} the non-attention layers (experts, projections) are "
              f"{_range([a['non-attention share of step'] for a in attr]).replace('+', '')} of its step (shares, "
              f"not gains); removing exposed communication would add {_pts(min(comm_room))} to "
              f"{_pts(max(comm_room))} percentage points, the remaining imbalance {_pts(min(room('without imbalance')))} "
              f"to {_pts(max(room('without imbalance')))}, the lean runtime's launch floor "
              f"{_pts(min(room('without host floor')))} to {_pts(max(room('without host floor')))}."]
    if call_room:
        host = (f"a host time of {cost.fwd.floor * 1e6:.0f} us forward and {cost.bwd.floor * 1e6:.0f} us backward "
                f"per call ({'measured' if cost.fwd.host_measured else 'the fitted do_bench floor'}) and a GPU "
                f"part that every call pays whatever its tiles ({cost.fwd.call * 1e6:.0f} / {cost.bwd.call * 1e6:.0f} us, "
                f"plus {cost.bwd.a_qblock * 1e9:.0f} ns per query block and head in the backward: the backward's "
                "pass over all the rank's query rows, once per backward call in the all-gather modes and once per layer in the staged overlap backward)") if cost is not None else "the per-call terms"
        lines[-1] += (f" The per-call cost of the attention calls (host and GPU) would add {_pts(min(call_room))} to "
                      f"{_pts(max(call_room))}: {host}; the overlapped methods make one call per stage (3-4 live "
                      "stages per rank and pass in these plans) where the all-gather methods make one.")
    fill_room = [a["without SM underfill"] - a["gain"] for a in attr if a.get("without SM underfill") is not None]
    if fill_room:
        lines[-1] += (f" Spreading every attention call's programs evenly over the {SLOTS} SMs would add "
                      f"{_pts(min(fill_room))} to {_pts(max(fill_room))}: the kernels launch one forward program "
                      "per (query block, query head) and one fused-backward program per (key block, KV head), "
                      "so with GQA 8:1 a stage call over few key blocks runs fewer backward programs than "
                      "there are SMs, and under document masks the programs' tiles are uneven (the slowest SM "
                      "sets the time: the greedy schedule the validation checks).")
    hs = [r for r in sens if r.get("param") == "host_per_call"]
    if hs:
        by = {}
        for r in hs:
            by.setdefault(r["host"], []).append(r.get(COMBINED))
        lines[-1] += (" Combined gain vs the host time per call alone (the GPU part kept; PREDICTIONS, table below "
                      "the attribution): " + "; ".join(f"{k}: {_range(v)}" for k, v in by.items()) + ".")
    if alt_results:
        att = [attribution(model, alt_layout, r) for r in alt_results.values()]
        terms = {"exposed communication": [a["without exposed comm"] for a in att],
                 "the per-call cost": [a.get("without per-call cost") for a in att],
                 "the remaining imbalance": [a["without imbalance"] for a in att]}
        if any(a.get("without SM underfill") is not None for a in att):
            terms["the SMs' underfill"] = [a.get("without SM underfill") for a in att]
        order = sorted(terms, key=lambda k: -max((v for v in terms[k] if v is not None), default=-1.0))
        lines[-1] += (f" At cp {alt_layout.cp} the gain is {_range([a['gain'] for a in att])}; without "
                      + ", without ".join(f"{k} it would be {_range(terms[k])}" for k in order)
                      + f", so {order[0]} binds first there.")
    lines += ["", "**Disagreements with the paper, one by one.**", "",
              f"1. *Our gains are larger (+7.3-11.0% in the paper).* The baseline's work imbalance on these datasets "
              f"is {min(imb):.2f}-{max(imb):.2f} (live tiles, max/mean): they hold only a few long documents per 128K "
              "sequence (the docs/seq column), and dual_chunk balances a causal triangle, not documents. A larger "
              "share of non-attention work (the paper's model: MTP, vocabulary, recomputation, which we leave "
              "out) shrinks every gain: halving the matmul efficiency (non-attention twice as slow) gives "
              f"{_pct(next((r.get(COMBINED) for r in sens if r['param'] == 'matmul_efficiency' and r['factor'] == 0.5), None))} "
              "on the middle dataset (sensitivity table). The paper's datasets and model details are not public here, so this is the "
              "likely but unverified cause.",
              _balance_item(sag, comb),
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
              f"5. *Hierarchical routing (the merged planner: rounds [intra-node direct, cross-node direct, "
              f"intra-node relay], read from `plan.rounds` and `Round.source`).* Over flat routing it adds "
              f"{_pts(min(c - f for c, f in zip(comb, flat)))} to {_pts(max(c - f for c, f in zip(comb, flat)))} points "
              f"at cp {layout.cp}"
              + (f" and {_pts(min(gains(r).get(COMBINED) - gains(r).get('sparse+overlap') for r in alt_results.values()))} to "
                 f"{_pts(max(gains(r).get(COMBINED) - gains(r).get('sparse+overlap') for r in alt_results.values()))} "
                 f"at cp {alt_layout.cp}" if alt_results else "")
              + ": the first remote stage waits only for NVLink, and each node's InfiniBand traffic is spread "
              "over its 8 NICs.", _ptrr_item(g, layout, sweep), ""]
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
                    "large. " + _host_sentence(s128, cps)
                  + " (These host floors count launches only; the measured per-call floor of the attention "
                    "calls is inside the kernel cost.)", ""]
    return lines


def _ptrr_item(g: dict, layout, sweep: dict) -> str:
    """Discussion item 6: PyTorch's PTRR placement (``balance="ptrr"``) against the sparse one."""
    pa, ph, pf = "ptrr+allgather", "ptrr+overlap+hier", "torch_cp (PTRR+allgather, Flex)"
    if not all(pa in g[d] and ph in g[d] for d in g):
        return ""
    edge = [g[d][COMBINED] - g[d][ph] for d in g]
    text = (f"6. *PyTorch's PTRR placement* (`balance=\"ptrr\"`: torch's processing-time round-robin of "
            "128-token blocks, the document-aware balancer it pairs with FlexAttention and all-gather; not in "
            f"the paper). At cp {layout.cp}: with all-gather and our kernels {_range([g[d][pa] for d in g])}, "
            f"as torch runs it (Flex) {_range([g[d].get(pf) for d in g])}, and with our overlapped hierarchical "
            f"runtime {_range([g[d][ph] for d in g])}: "
            + (f"the sparse placement is {_pts(min(edge))} to {_pts(max(edge))} points ahead of PTRR in the "
               "same runtime." if min(edge) >= 0 else
               f"PTRR is ahead of the sparse placement in the same runtime by {-100 * max(edge):.1f} to "
               f"{-100 * min(edge):.1f} points: its 128-token blocks balance the attention time better "
               "(the imbalance column of the breakdown) and at this cp the exchange is hidden, so the sparse "
               "placement's smaller K/V buys nothing; the gain over the baseline is the balance and the "
               "runtime, not the placement's K/V."))
    text += _measured_ptrr_sentence()
    s128 = (sweep or {}).get(131072)
    if s128:
        cps = sorted(c for c in s128 if COMBINED in s128[c] and ph in s128[c])
        diff = [(cp, s128[cp][COMBINED]["tokens_per_s"] / s128[cp][ph]["tokens_per_s"] - 1) for cp in cps]
        text += (" In the 7B cp sweep at 128K the sparse placement is ahead of PTRR in the same runtime by "
                 + ", ".join(f"{_pct(x)} (cp {cp})" for cp, x in diff)
                 + ": beyond one node every PTRR rank needs nearly every document's keys"
                 + _ptrr_remote_kv_clause()
                 + ", and with fewer blocks per rank its round-robin balances worse.")
    return text


def _ptrr_remote_kv_clause(path: str = os.path.join(RESULTS, "balance.json"), node: int = 8) -> str:
    """``" (balance.md: A-Bx dual_chunk's remote K/V)"``: the range of PTRR's largest remote K/V
    over dual_chunk's beyond one node of ``node`` GPUs, read from balance.json ("" without it)."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        rows = [r for spread in json.load(f)["results"].values() for r in spread if r["cp"] > node]
    ratios = [r["max_remote_tokens_ptrr"] / r["max_remote_tokens_dual_chunk"] for r in rows
              if r.get("max_remote_tokens_ptrr") and r.get("max_remote_tokens_dual_chunk")]
    if not ratios:
        return ""
    return f" (balance.md: {min(ratios):.2f}-{max(ratios):.2f}x dual_chunk's remote K/V)"


#: sparse vs PTRR per rank through the runtime on one GPU (benchmarks/gpu/cp-ptrr.sh)
CP_PTRR_FILE = os.path.join(RESULTS, "cp_ptrr.json")


def _measured_ptrr_sentence(path: str = CP_PTRR_FILE) -> str:
    """What one GPU measured of the two placements (the exchange emulated: the compute side),
    from ``cp_ptrr.json``; empty without the file."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        res = json.load(f)

    def slowest(entry) -> str:
        r = next(r for r in entry["ranks"] if r["rank"] == entry["slowest_rank"])
        return f"{r['seconds'] * 1e3:.2f}" + (" (host-bound)" if r["host_seconds"] >= 0.9 * r["seconds"] else "")

    pairs = []
    for cp, layouts in sorted(res["cp"].items(), key=lambda kv: int(kv[0])):
        a, b = layouts.get("sparse+overlap hier"), layouts.get("ptrr+overlap hier")
        if a and b:
            pairs.append(f"cp {cp} {slowest(a)} vs {slowest(b)} ms")
    if not pairs:
        return ""
    a = res["args"]
    return (f" Measured on one {res['env'].get('gpu', 'GPU')} with the exchange emulated (cp_ptrr.md: the "
            f"compute side only, {a['heads']} / {a['kv_heads']} heads, the corpus sequence), the slowest sampled rank's layer, sparse "
            "vs PTRR, hierarchical: " + ", ".join(pairs) + ": PTRR's blocks cut documents into more partial "
            "tiles and larger key gathers, and the model predicts those ranks as well as the sparse ones "
            "(benchmarks/NOTES.md, session 38); its lead above is a prediction for the paper's heads and "
            "datasets, with the exchange modeled.")


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
