"""The FlashMask-3 experiment and the cp sweep, by simulation (predictions).

Datasets: causal document masks packed from real text lengths (benchmarks/corpus.py: this
machine's stdlib sources and /usr/share/doc), keeping only documents of at least ``min_len``
tokens; ``min_len`` is chosen per dataset so that the mean sparsity over its sequences is
closest to a target (70%, 78%, 86% by default). The lengths used are written to the json, so a
run on another machine can be compared.

Methods: see :data:`METHODS`. The baseline of every gain is ``dual_chunk+allgather``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .calibrate import RESULTS, AttentionCost, between, filled, gqa_group, load_cost, with_host
from .layout import document_plan_view, mask_sparsity
from .model import Layout, ModelConfig, StepBreakdown, step_time
from .params import SWEPT, Cluster, Runtime
from .runtime_ops import rank_device_work, rate_seconds
from .timeline import LayerResult, resolve_bwd_calls, simulate_layer
from .validate import LAUNCH_FLOOR, memory_factor, memory_scaled, per_rank_calibration, scaled_cost

BASELINE = "dual_chunk+allgather"


@dataclass(frozen=True)
class Method:
    balance: str
    comm: str
    hierarchical: bool = False
    kernel: str = "flashmask3"


METHODS = {
    "dual_chunk+allgather": Method("dual_chunk", "allgather"),
    "sparse+allgather": Method("sparse", "allgather"),
    "sparse+overlap": Method("sparse", "overlap"),
    "sparse+overlap+hier": Method("sparse", "overlap", hierarchical=True),
    "ptrr+allgather": Method("ptrr", "allgather"),
    "ptrr+overlap+hier": Method("ptrr", "overlap", hierarchical=True),
    "torch_cp (head-tail+allgather, Flex)": Method("dual_chunk", "allgather", kernel="flex"),
    "torch_cp (PTRR+allgather, Flex)": Method("ptrr", "allgather", kernel="flex"),
}
COMBINED = "sparse+overlap+hier"
#: The combined method again with the attention calls' per-call cost (floor + call term) at zero.
NO_CALL = "combined, no per-call cost"
#: The combined method again with every attention call filling the SMs (no underfilled grid).
NO_UNDERFILL = "combined, SMs filled"
#: The sweep's extra row: the best overlap method with the runtime on main (host floor).
ON_MAIN = "best overlap, runtime on main"
#: The paper's layout for 128 H100s (assumed): cp 16 over 2 nodes, pp 4, dp 2, experts 8-way
#: inside each node, 16 micro-batches of one 128K sequence per replica.
PAPER_LAYOUT = Layout(cp=16, pp=4, dp=2, ep=8, micro_batches=16, recompute=False)
PAPER_GAINS = {"combined": (7.3, 11.0), "note": "FlashMask-3: +7.3-11.0% full-training throughput "
               "over Dual Chunk + all-gather (118B-A14B MoE, 128K, 128 H100, 3 document-mask datasets "
               "of 70-86% mean sparsity); without hierarchical routing below the baseline on 2 of 3"}


# -- datasets -------------------------------------------------------------------------------------


def _pack(pool: list[int], total: int, seed: int) -> list[int]:
    from benchmarks.corpus import pack_corpus_documents

    return pack_corpus_documents(total, seed=seed, lengths=pool)


def make_datasets(seqlen: int, targets: Sequence[float] = (0.70, 0.78, 0.86), sequences: int = 3,
                  lengths: Optional[list[int]] = None) -> dict:
    """``{name: {"min_len", "sparsity", "sequences": [[doc lengths]...]}}`` for each target.

    Each dataset is ``sequences`` packed sequences (seeds 0..n-1) of the documents of at least
    ``min_len`` tokens; ``min_len`` (a quarter-octave grid) is the one whose mean sparsity over
    exactly those sequences is closest to the target (cheap: sparsity from lengths)."""
    from benchmarks.corpus import corpus_document_lengths

    pool = lengths if lengths is not None else corpus_document_lengths()
    candidates = sorted({int(256 * 2 ** (i / 4)) for i in range(0, 37)})
    table = []
    for m in candidates:
        sub = [n for n in pool if n >= m]
        if len(sub) < 8:
            break
        seqs = [_pack(sub, seqlen, s) for s in range(sequences)]
        table.append((m, float(np.mean([mask_sparsity(x) for x in seqs])), seqs))
    out = {}
    for t in targets:
        m, sp, seqs = min(table, key=lambda row: abs(row[1] - t))
        out[f"docs>={m}"] = {"min_len": m, "target": t, "sparsity": sp, "sequences": seqs,
                             "docs_per_sequence": float(np.mean([len(x) for x in seqs]))}
    return out


# -- simulation -----------------------------------------------------------------------------------


@dataclass
class Costs:
    """The kernel costs the experiment uses, with how they were obtained."""

    flashmask3: AttentionCost
    flex: AttentionCost
    k: float
    # the MHA fits, for :meth:`for_heads` (None: every group takes the GQA fits as they are)
    flashmask3_mha: Optional[AttentionCost] = None
    flex_mha: Optional[AttentionCost] = None

    def of(self, kernel: str) -> AttentionCost:
        return self.flashmask3 if kernel == "flashmask3" else self.flex

    def for_heads(self, heads: int, kv_heads: int) -> "Costs":
        """These costs for a model of ``heads`` query / ``kv_heads`` KV heads: each family's
        MHA fit, GQA fit or :func:`calibrate.between` them (its group)."""
        group = gqa_group(heads, kv_heads)
        if self.flashmask3_mha is None or self.flex_mha is None:
            return self
        return dataclasses.replace(self, flashmask3=between(self.flashmask3_mha, self.flashmask3, group),
                                   flex=between(self.flex_mha, self.flex, group))

    def mapped(self, fn) -> "Costs":
        """``fn`` applied to both of flashmask3's fits (a kernel variant, a scaled cost)."""
        return dataclasses.replace(self, flashmask3=fn(self.flashmask3),
                                   flashmask3_mha=None if self.flashmask3_mha is None else fn(self.flashmask3_mha))

    def gpu_slowed(self, f: float) -> "Costs":
        """Every kernel family's GPU time x ``f``, host terms as they are (:func:`gpu_slowed`)."""
        def opt(c):
            return None if c is None else gpu_slowed(c, f)
        return dataclasses.replace(self, flashmask3=gpu_slowed(self.flashmask3, f), flex=gpu_slowed(self.flex, f),
                                   flashmask3_mha=opt(self.flashmask3_mha), flex_mha=opt(self.flex_mha))


def old_kernel_per_rank_factor() -> float:
    """The per-rank-shape factor measured on the old kernel (cp_single_gpu.json vs its tables)."""
    return per_rank_calibration()[1]


def cost_on(cost: AttentionCost, cluster: Cluster) -> AttentionCost:
    """``cost`` (calibrated on one H200) on ``cluster``'s GPU: its memory-bound per-query-block
    passes at the GPU's copy bandwidth (``runtime_copy_bw``; validate.memory_scaled), the rest
    x1 (``gpu_scale``, applied by the timeline). On an H100 the same calls' GPU times back this
    (validate.validate_transfer: the H200's fit predicts the H100's calls)."""
    return memory_scaled(cost, memory_factor(cluster.runtime_copy_bw.value))


def gpu_slowed(cost: AttentionCost, f: float) -> AttentionCost:
    """``cost`` with every GPU term x ``f`` (per tile, per program, per query/key block, per call)
    and its host terms unchanged: the same kernels at a lower clock."""
    def pas(p):
        return dataclasses.replace(p, a_full=p.a_full * f, a_partial=p.a_partial * f, call=p.call * f,
                                   a_qblock=p.a_qblock * f, a_kblock=p.a_kblock * f, a_program=p.a_program * f)
    return dataclasses.replace(cost, fwd=pas(cost.fwd), bwd=pas(cost.bwd), source=f"{cost.source}; GPU time x{f:g}")


#: The GPU's compute slowed by the software power cap under sustained load (the sensitivity
#: table's "power cap" rows): the calibration's kernel and matmul times are taken from an idle
#: GPU; sustained_probe_h100.json (one H100) saw back-to-back attention calls slow 7-13%
#: (forward) and 0-4% (forward+backward, 200 ms) once the SM clock fell from 1980 to 1560-1800
#: MHz, i.e. up to 1.27x by the clock alone.
POWER_CAP_FACTORS = (1.1, 1.2)


def scaled_per_call(cost, f: float):
    """``cost`` with its per-call term and host-bound floor x ``f`` (0 = calls cost only tiles)."""
    fw = dataclasses.replace(cost.fwd, call=cost.fwd.call * f, floor=cost.fwd.floor * f)
    bw = dataclasses.replace(cost.bwd, call=cost.bwd.call * f, floor=cost.bwd.floor * f)
    return dataclasses.replace(cost, fwd=fw, bwd=bw, source=f"{cost.source}; per-call cost x{f:g}")


def default_costs(gqa: bool = True, per_rank_factor: float = 1.0) -> Costs:
    """Current kernels: the per-rank-shape measurements of scale-model.sh once committed, else
    the kernel tables (``per_rank_factor`` scales their per-tile cost: 1.0 = the tables as they
    are; :func:`old_kernel_per_rank_factor` = the penalty the old kernel showed at per-rank
    shapes, a sensitivity case)."""
    def scaled(cur: AttentionCost) -> AttentionCost:
        if per_rank_factor == 1.0:
            return cur
        return scaled_cost(cur, per_rank_factor, cur.fwd.call, cur.bwd.call,
                           f"{cur.source}; x{per_rank_factor:.3f} per-rank-shape factor (measured on the "
                           "old kernel: cp_single_gpu.json vs its kernel tables; assumed to carry over)")

    return Costs(scaled(load_cost("flashmask3", gqa)), load_cost("flex", gqa), per_rank_factor,
                 scaled(load_cost("flashmask3", False)), load_cost("flex", False))


def runtime_device_seconds(lens: Sequence[int], cp: int, method: Method, nodes: int, view, model: ModelConfig,
                           cluster: Cluster, runtime: Runtime) -> Optional[list[tuple[float, float]]]:
    """Per rank, the runtime's own device work of the forward and the backward (seconds): the
    ops recorded from the real runtime (runtime_ops.rank_device_work), each rate class at the
    cluster's bandwidth for it (``runtime_copy_bw`` and the three after it) plus the launch
    floor (runtime_ops.rate_seconds); None for the runtime on main before the rewrite (its ops
    were never recorded: the timeline's fp32-pass terms stand in)."""
    if runtime.kind != "lean":
        return None
    shape = model.shape()
    calls = resolve_bwd_calls(view, runtime.bwd_calls) if method.comm == "overlap" else "stage"
    work = rank_device_work(lens, cp, method.balance, nodes, method.comm, calls, shape.heads,
                            shape.kv_heads, shape.head_dim)
    bw = cluster.runtime_bandwidths()
    return [(rate_seconds(fb, fn, bw, LAUNCH_FLOOR), rate_seconds(bb, bn, bw, LAUNCH_FLOOR))
            for fb, fn, bb, bn in work]


def layer_for(lens: Sequence[int], cp: int, method: Method, model: ModelConfig, cluster: Cluster,
              runtime: Runtime, costs: Costs, recompute: bool) -> LayerResult:
    nodes = max(1, cp // cluster.gpus_per_node) if method.hierarchical else 1
    v = document_plan_view(lens, cp, method.balance, nodes)
    device = runtime_device_seconds(lens, cp, method, nodes, v, model, cluster, runtime)
    lr = simulate_layer(v, cost_on(costs.of(method.kernel), cluster), cluster, model.shape(), method.comm, runtime,
                        recompute, device)
    lr.plan_seconds = v.plan_seconds  # planning time when the view was built (cached after)
    return lr


def simulate_dataset(seqs: list[list[int]], model: ModelConfig, layout: Layout, cluster: Cluster,
                     runtime: Runtime, costs: Costs, methods=METHODS, progress=None) -> dict:
    out = {}
    for name, m in methods.items():
        if m.hierarchical and layout.cp <= cluster.gpus_per_node:
            continue  # one node: hierarchical routing is the flat routing
        layers = []
        for lens in seqs:
            layers.append(layer_for(lens, layout.cp, m, model, cluster, runtime, costs, layout.recompute))
            if progress is not None:
                progress.update(1)
        st = step_time(model, layout, int(sum(seqs[0])), layers, cluster)
        out[name] = {"step": st, "layers": layers}
    return out


def _summ(entry) -> dict:
    st: StepBreakdown = entry["step"]
    lrs: list[LayerResult] = entry["layers"]
    mean_compute = float(np.mean([np.mean([lr.fwd.ranks[r].compute * (2 if lr.recompute else 1)
                                            + lr.bwd.ranks[r].compute for r in range(len(lr.host))])
                                  for lr in lrs]))
    host = float(np.mean([max(lr.host) for lr in lrs]))
    return dict(st.as_dict(), mean_compute_s=mean_compute, host_s=host,
                bytes_fwd=float(np.mean([lr.fwd.bytes for lr in lrs])),
                xnode_bytes_fwd=float(np.mean([lr.fwd.cross_node_bytes for lr in lrs])),
                plan_seconds=float(np.mean([getattr(lr, "plan_seconds", 0.0) for lr in lrs])))


def gains(results: dict) -> dict:
    base = results[BASELINE]["step"].tokens_per_s
    return {k: v["step"].tokens_per_s / base - 1.0 for k, v in results.items()}


def per_call_free(seqs, model, layout, cluster, runtime, costs, progress=None) -> Optional[dict]:
    """The combined method's entry with the attention per-call cost removed (None at one node)."""
    free = dataclasses.replace(costs, flashmask3=scaled_per_call(costs.flashmask3, 0.0))
    res = simulate_dataset(seqs, model, layout, cluster, runtime, free, methods={COMBINED: METHODS[COMBINED]},
                           progress=progress)
    return res.get(COMBINED)


def sm_filled(seqs, model, layout, cluster, runtime, costs, progress=None) -> Optional[dict]:
    """The combined method's entry with every attention call's programs spread evenly over the
    SMs (``calibrate.filled``): what the underfilled grids of its stage calls cost it (None at
    one node, or when the calibration has no per-program model)."""
    if costs.flashmask3.fwd.schedule != "greedy":
        return None
    co = dataclasses.replace(costs, flashmask3=filled(costs.flashmask3))
    res = simulate_dataset(seqs, model, layout, cluster, runtime, co, methods={COMBINED: METHODS[COMBINED]},
                           progress=progress)
    return res.get(COMBINED)


#: Issue 25's targets for the host time per call: forward 100 us, forward+backward 250 us.
HOST_TARGETS_US = (100.0, 250.0)
HOST_PATH_FILE = os.path.join(RESULTS, "host_path.json")
#: The methods the host sweep simulates (the gains it reports are over the baseline).
HOST_SWEEP_METHODS = (BASELINE, "sparse+allgather", "sparse+overlap", COMBINED)


def host_points(cost: AttentionCost, host_path_file: str = HOST_PATH_FILE) -> list[tuple[str, float, float]]:
    """``(label, fwd s, bwd s)`` host times per call to sweep: this calibration's (measured by
    scale-model.sh, or the do_bench floor of an older file), ``host_path.json``'s measured
    FlashMask call where committed, issue 25's targets, and zero. Backward = fwd+bwd - fwd."""
    kind = "measured by scale-model.sh" if cost.fwd.host_measured else "fitted do_bench floor"
    pts = [(f"calibration ({kind})", cost.fwd.floor, cost.bwd.floor)]
    if os.path.exists(host_path_file):
        with open(host_path_file) as f:
            hp = json.load(f)
        # the default call: a FlashMask reused, the package's launcher, torch's autograd thread;
        # then the same with the backward on the calling thread (the training harness's default;
        # the forward does not involve the engine, so it keeps the device-thread row's forward)
        date = hp.get("meta", {}).get("date", "?")[:16]
        for thread, label in (("device", "torch's autograd thread"), ("calling", "calling-thread backward")):
            rows = {r["mode"]: r["host_us"] for r in hp.get("host", [])
                    if r.get("form") == "FlashMask" and r.get("mask", "reused") == "reused"
                    and r.get("launch", "fast") == "fast" and r.get("autograd", "device") in ("device", thread)
                    and (r["mode"] == "fwd" or r.get("autograd", "device") == thread)}
            if "fwd" in rows and "fwd+bwd" in rows:
                pts.append((f"host_path.json ({date}, 32K, measured, {label})", rows["fwd"] * 1e-6,
                            max(0.0, rows["fwd+bwd"] - rows["fwd"]) * 1e-6))
    f_us, fb_us = HOST_TARGETS_US
    pts.append(("issue 25 targets (100 / 250 us)", f_us * 1e-6, (fb_us - f_us) * 1e-6))
    pts.append(("zero", 0.0, 0.0))
    return pts


def host_sweep(seqs, model, layout, cluster, runtime, costs, progress=None) -> list[dict]:
    """Gains over the baseline with the flashmask3 calls' host time per call set to each of
    :func:`host_points` (PREDICTIONS): how the paper-setting gain follows the host path."""
    methods = {k: METHODS[k] for k in HOST_SWEEP_METHODS}
    rows = []
    for label, hf, hb in host_points(costs.flashmask3):
        co = dataclasses.replace(costs, flashmask3=with_host(costs.flashmask3, hf, hb, label))
        res = simulate_dataset(seqs, model, layout, cluster, runtime, co, methods=methods, progress=progress)
        rows.append({"host": label, "host_fwd_us": hf * 1e6, "host_fwd_bwd_us": (hf + hb) * 1e6,
                     **{k: v for k, v in gains(res).items() if k != BASELINE}})
    return rows


def host_sweep_layers(layout: Layout, cluster: Cluster, sequences: int) -> int:
    """Progress-bar steps of one dataset's host sweep."""
    n = sum(1 for k in HOST_SWEEP_METHODS
            if not (METHODS[k].hierarchical and layout.cp <= cluster.gpus_per_node))
    return 4 * n * sequences


def attribution(model: ModelConfig, layout: Layout, results: dict) -> dict:
    """The combined method's gain over the baseline if one term of its step were removed."""
    if COMBINED not in results:
        return {}
    base = results[BASELINE]["step"].step_s
    c = _summ(results[COMBINED])
    per_layer_to_step = model.layers / layout.pp * (layout.micro_batches + layout.pp - 1)
    step = c["step_s"]
    att = c["attention_s"]
    exposed = c["attention_s"] - c["attention_compute_s"] if not c["attention_host_floor"] else 0.0
    imbalance = c["attention_compute_s"] - c["mean_compute_s"]
    host = (c["attention_s"] - c["attention_compute_s"]) if c["attention_host_floor"] else 0.0
    non = (c["nonattn_s"] + c["ep_alltoall_s"]) * per_layer_to_step + c["dp_exposed_s"]

    def g(saved):
        return base / (step - saved) - 1.0

    ideal_att = c["mean_compute_s"]
    return {
        "gain": base / step - 1.0,
        "without exposed comm": g(exposed * per_layer_to_step),
        "without imbalance": g(max(0.0, imbalance) * per_layer_to_step),
        "without host floor": g(host * per_layer_to_step),
        "without per-call cost": (base / results[NO_CALL]["step"].step_s - 1.0) if NO_CALL in results else None,
        "without SM underfill": (base / results[NO_UNDERFILL]["step"].step_s - 1.0) if NO_UNDERFILL in results else None,
        "ceiling (attention = mean compute, no comm)": g((att - ideal_att) * per_layer_to_step),
        "attention share of step": att * per_layer_to_step / step,
        "non-attention share of step": non / step,
        "bubble share": c["bubble_share"],
    }


def sensitivity(seqs, model, layout, cluster, runtime, costs, factors=(0.5, 2.0), progress=None) -> list:
    """Gains of the overlap methods over the baseline with each parameter scaled 0.5x / 2x."""
    rows = []
    variants = [(p, f, cluster.swept(p, f), costs) for p in SWEPT for f in factors]
    cur = costs.flashmask3
    for f in (0.5, 2.0):  # the per-tile cost of the current kernels
        variants.append(("per_tile_cost", f, cluster,
                         dataclasses.replace(costs, flashmask3=scaled_cost(cur, f, cur.fwd.call, cur.bwd.call,
                                                                           cur.source))))
    for f in (0.0, 0.5, 2.0):  # the per-call cost (the measured host-bound floor and per-call term)
        variants.append(("per_call_cost", f, cluster,
                         dataclasses.replace(costs, flashmask3=scaled_per_call(cur, f))))
    for f in (0.5, 2.0):
        variants.append(("comm_bytes(kv_heads)", f, cluster, costs))
    for f in (1.0,) + POWER_CAP_FACTORS:  # compute-bound work slower (kernels, matmuls); links and copies not
        variants.append(("power cap (GPU compute)", f, cluster.swept("matmul_efficiency", 1.0 / f),
                         costs.gpu_slowed(f)))
    variants.append(("runtime=current", 1.0, cluster, costs))
    for name, f, cl, co in variants:
        rt = Runtime("current") if name == "runtime=current" else runtime
        m = model
        if name.startswith("comm_bytes"):  # K/V bytes per token x f (more or fewer KV heads)
            m = dataclasses.replace(model, kv_heads=max(1, int(model.kv_heads * f)))
        res = simulate_dataset(seqs, m, layout, cl, rt, co, progress=progress)
        gs = gains(res)
        rows.append({"param": name, "factor": f, **{k: gs[k] for k in gs if k != BASELINE},
                     "baseline_tokens_per_s": res[BASELINE]["step"].tokens_per_s})
    return rows


def cp_sweep(seqs_by_len: dict, model: ModelConfig, cps: Sequence[int], cluster: Cluster,
             runtime: Runtime, costs: Costs, progress=None) -> dict:
    """tokens/s per method for each seqlen and cp (one replica, no pp/dp)."""
    out = {}
    for seqlen, seqs in seqs_by_len.items():
        out[seqlen] = {}
        for cp in cps:
            res = simulate_dataset(seqs, model, Layout(cp=cp), cluster, runtime, costs, progress=progress)
            best = COMBINED if cp > cluster.gpus_per_node else "sparse+overlap"
            if runtime.kind != "current":
                on_main = simulate_dataset(seqs, model, Layout(cp=cp), cluster, Runtime("current"), costs,
                                           methods={best: METHODS[best]})
                res[ON_MAIN] = on_main[best]
            out[seqlen][cp] = {k: _summ(v) for k, v in res.items()}
    return out


# -- output ---------------------------------------------------------------------------------------


def plot_sweep(sweep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweep), figsize=(6 * len(sweep), 4.2), squeeze=False)
    for ax, (seqlen, by_cp) in zip(axes[0], sweep.items()):
        cps = sorted(by_cp)
        for i, m in enumerate(list(METHODS) + [ON_MAIN]):
            ys = [by_cp[cp][m]["tokens_per_s"] / by_cp[cp][BASELINE]["tokens_per_s"]
                  if m in by_cp[cp] else math.nan for cp in cps]
            ax.plot(cps, ys, "--x" if m == ON_MAIN else "-o", color=f"C{i}", label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set(xscale="log", xlabel="cp size", ylabel=f"predicted tokens/s vs {BASELINE}",
               title=f"PREDICTION: 7B dense, {seqlen // 1024}K tokens")
        ax.set_xticks(cps)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_jsonable(x):
    if dataclasses.is_dataclass(x):
        return to_jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def write_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_jsonable(obj), f, indent=1)


__all__ = ["METHODS", "BASELINE", "COMBINED", "PAPER_LAYOUT", "PAPER_GAINS", "make_datasets",
           "default_costs", "cost_on", "gpu_slowed", "POWER_CAP_FACTORS", "scaled_per_call", "host_points", "host_sweep", "NO_CALL", "per_call_free", "NO_UNDERFILL", "sm_filled", "simulate_dataset", "gains", "attribution", "sensitivity", "cp_sweep",
           "plot_sweep", "write_json"]
