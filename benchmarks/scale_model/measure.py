"""Calibration run for the scale model (one H200, <= the time budget): what one CP rank runs.

1. ``flashmask_attention`` forward and forward+backward at the per-rank shapes of real plans,
   three numbers per pass: the GPU time per call (``gpu_fwd_ms``, ``gpu_fwd_bwd_ms``: CUDA
   events around back-to-back calls enqueued behind a GPU sleep, so the host's work is hidden)
   and the host time per call (``host_fwd_us``, ``host_fwd_bwd_us``: CPU time to enqueue those
   calls while the GPU sleeps), from one loop (:func:`overlap_times`), and the steady-state time
   per call of a stream of back-to-back calls (``stream_fwd_ms``, ``stream_fwd_bwd_ms``:
   :func:`stream_times`), the quantity the scale model predicts as ``max(host, GPU)``, with the
   host's CPU time for those same calls (``stream_host_fwd_us``, ``stream_host_fwd_bwd_us``;
   from session 20 on). (Files
   before session 19 have the ``do_bench`` median instead, ``fwd_ms`` / ``fwd_bwd_ms``: it
   zeroes 256 MB before each call, which hides part of a host-bound call's host work.)
   B=1, S_q = tokens per rank, keys = one stage's chunks (or all needed chunks, the all-gather
   call), the rank-local mask of that stage (``plan.local_mask`` sliced by ``plan.stages``),
   D=128, GQA 8:1 (32 query / 4 KV heads) and 1:1 (16 / 16), bf16; causal document masks at 128K
   tokens, cp 8-128, dual_chunk and sparse (hierarchical); every call's live full/partial
   tiles counted by the mask layer's tile rule. Order: one call of each plan in turn, so that
   a budget cut still leaves every spread, cp and balance sampled. The document lengths of
   every spread are written to the file (``spreads``), so the calls (and their per-program
   tiles, ``calibrate.attach_program_work``) can be rebuilt on any machine.
2. bf16 matmul throughput at the models' per-rank MLP/expert shapes (the GEMMs of one layer's
   forward: projections and dense MLP, or the local experts' share of routed tokens).

Writes ``scale_model_attention.json`` and ``scale_model_matmul.json`` under ``--out`` (commit
them to benchmarks/results/ and rerun ``python -m benchmarks.scale_model calibrate``).

    python benchmarks/scale_model/measure.py --out $OUT/scale-model --budget-s 115
    python benchmarks/scale_model/measure.py --device cpu --dry-run --out /tmp/sm   # CPU smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import flashmask3.masks as M  # noqa: E402
from benchmarks.corpus import document_spreads  # noqa: E402
from benchmarks.environment import run_environment  # noqa: E402
from benchmarks.scale_model.calibrate import tile_counts  # noqa: E402
from benchmarks.scale_model.model import DENSE_7B, MOE_118B, _shape_key  # noqa: E402
from flashmask3 import flashmask_attention  # noqa: E402
from flashmask3.distributed import plan  # noqa: E402
from flashmask3.distributed.placement import DEFAULT_TOLERANCE  # noqa: E402
from flashmask3.masks import FlashMask  # noqa: E402


def timer(fn, device, warmup: int, rep_ms: float) -> float:
    """Median milliseconds of ``fn``: triton's do_bench on CUDA, perf_counter elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(1, warmup * 5), rep=rep_ms))
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(1 if rep_ms <= 0 else 3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


#: Back-to-back calls per host/GPU sample, samples per pass, and the first GPU sleep (cycles,
#: ~2 GHz: 20M ~ 10 ms) that must outlast the host's enqueueing of those calls (doubled until it does).
OVERLAP_CALLS, OVERLAP_SAMPLES, OVERLAP_SLEEP_CYCLES = 5, 3, 20_000_000
#: The longest sleep tried (~40 ms): a call that synchronises never hides, so stop doubling there.
OVERLAP_SLEEP_MAX = 8 * OVERLAP_SLEEP_CYCLES // 2
#: The sleep that last sufficed, per pass (kept between shapes, so a slow host path is found once).
_sleep_cycles: dict = {}


def overlap_times(fn, device, reset=None, calls: int = OVERLAP_CALLS,
                  samples: int = OVERLAP_SAMPLES, key: str = "", fill=None
                  ) -> tuple[float, float, bool]:
    """``(host_us, gpu_ms, hidden)`` per call of ``fn``, medians over ``samples``.

    One loop gives both: the GPU sleeps, the host enqueues ``calls`` back-to-back calls
    (``host_us`` = its CPU time per call, as ``benchmarks/host_path.py`` measures it), CUDA events
    around the calls give the GPU time per call with the host's work hidden (the "GPU ms" of
    host_path.py, but for a stream of calls, as a CP rank runs its stages). ``hidden`` says the
    sleep outlasted the enqueueing (the start event had not run when the host finished); if it
    did not, the sleep is doubled and the sample retaken (a call that synchronises never hides:
    ``hidden=False`` and its GPU time includes host gaps). ``fill(factor)``, if given, enqueues
    other GPU work in place of the sleep (``factor`` = the sleep's multiple of the first one;
    ``sustained_probe.py`` puts matmul load there). Off CUDA both are wall time per call."""
    host, gpu, all_hidden = [], [], True
    for _ in range(samples):
        if device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(calls):
                if reset is not None:
                    reset()
                fn()
            dt = (time.perf_counter() - t0) / calls
            host.append(dt * 1e6)
            gpu.append(dt * 1e3)
            continue
        cycles = _sleep_cycles.get(key, OVERLAP_SLEEP_CYCLES)
        while True:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if fill is None:
                torch.cuda._sleep(cycles)
            else:
                fill(cycles / OVERLAP_SLEEP_CYCLES)
            start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                if reset is not None:
                    reset()
                fn()
            dt = time.perf_counter() - t0
            hidden = not start.query()
            end.record()
            torch.cuda.synchronize()
            if hidden or cycles >= OVERLAP_SLEEP_MAX:
                break
            cycles = min(2 * cycles, OVERLAP_SLEEP_MAX)
            _sleep_cycles[key] = cycles
        all_hidden &= hidden
        host.append(dt / calls * 1e6)
        gpu.append(start.elapsed_time(end) / calls)
    return statistics.median(host), statistics.median(gpu), all_hidden


#: Back-to-back calls of one stream sample: 2 x calls, the second half timed; calls give ~STREAM_MS
#: of work, within these bounds.
STREAM_MS, STREAM_CALLS = 5.0, (3, 30)
#: Seconds of idle GPU before the stream samples of a pass of at least STREAM_IDLE_MIN_MS GPU time
#: per call (files from session 52 on; ``stream_*_idle_s``). Without it such a stream starts in
#: the power state that the work before it left (its own overlap loop, the previous call's
#: stream): the GPU's software power cap had lowered the clock, and on an H100 the stream ran
#: 9-14% above the same calls' GPU time (call 81 of the H200 file: +23%); after 0.3 s of idle,
#: 0-5% (``sustained_probe.py --replay``, benchmarks/NOTES.md session 52). The GPU time is
#: measured behind a sleep, from that rested state, so the stream check then compares like with
#: like; what the cap does in a training step is the scale model's power-cap sensitivity case.
STREAM_IDLE_S, STREAM_IDLE_MIN_MS = 0.3, 2.0


def stream_times(fn, device, per_call_ms: float, samples: int = OVERLAP_SAMPLES,
                 before=None) -> tuple[float, int, float]:
    """``(ms per call, calls, host us per call)``: the steady-state time per call of a stream of
    back-to-back calls and the CPU time the host took to enqueue the same calls (medians of
    ``samples``). Each sample enqueues ``2 x calls`` calls with no synchronisation between them
    and times the second half: CUDA events after call ``calls`` and after the last, so the GPU's
    idle gaps while it waits for a host-bound host are counted and the stream's start (host
    before any GPU work) and end (GPU after the host) are not; the host time is the wall time of
    the same half on the CPU (the host cost of exactly the calls the events time: a host-bound
    stream follows it, whatever this host's speed is at that minute).

    This is what a CP rank's stream of stage calls costs per call and what the scale model
    predicts, ``max(host, GPU)``. (``do_bench`` zeroes 256 MB before each call and times each
    call apart, which hides part of a host-bound call's host work behind the memset.)
    ``per_call_ms`` (a first estimate) sets ``calls`` (and one sample for calls of >= STREAM_MS,
    to keep the run within its budget). ``before()``, if given, enqueues GPU work ahead of each
    sample's calls (``sustained_probe.py``'s matmul load). Off CUDA: wall time of the second
    half (both)."""
    lo, hi = STREAM_CALLS
    calls = max(lo, min(hi, math.ceil(STREAM_MS / max(per_call_ms, 1e-3))))
    if per_call_ms >= STREAM_MS:  # GPU-bound milliseconds a call: one sample of 2 x calls is plenty
        samples = 1
    ts, hs = [], []
    cuda = device.type == "cuda"
    for _ in range(samples):
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if before is not None:
                before()
        for i in range(2 * calls):
            fn()
            if i == calls - 1:
                if cuda:
                    e0.record()
                t0 = time.perf_counter()
        host = time.perf_counter() - t0
        hs.append(host / calls * 1e6)
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / calls)
        else:
            ts.append(host / calls * 1e3)
    return statistics.median(ts), calls, statistics.median(hs)


def plan_calls(lens: list[int], spread: str, cp: int, balance: str, ranks=None, nodes=None,
               tolerance: float = DEFAULT_TOLERANCE):
    """Yield ``(meta, local FlashMask, keys)`` for every stage call and the sorted (all-gather)
    call of ranks 0 and the busiest rank of one real plan (causal documents of ``lens``), or of
    ``ranks``; ``nodes`` default: hierarchical routing over ``cp // 8`` nodes for sparse plans;
    ``tolerance``: ``plan()``'s (a measured file's: ``layout.file_tolerance``).
    ``calibrate.attach_program_work`` rebuilds the measured calls through this same function."""
    mask = M.causal_document_mask(lens)
    if nodes is None:
        nodes = cp // 8 if (balance == "sparse" and cp > 8 and cp % 8 == 0) else 1
    p = plan(mask, None, cp, balance=balance, nodes=nodes, tolerance=tolerance)
    works = p.works
    base = {"spread": spread, "cp": cp, "balance": balance, "nodes": nodes}
    if ranks is None:
        ranks = {0, max(range(cp), key=lambda r: works[r])}
    for r in sorted(ranks):
        local = p.local_mask(r, "arrival").startend_row_indices
        start = 0
        for s, chunks in enumerate(p.stages(r)):
            n = len(chunks) * p.chunk_size
            if n:
                cols = local[:, :, start:start + n].contiguous()
                yield dict(base, rank=r, stage=s), FlashMask(cols, False, p.local_seqlen), n
            start += n
        keys = len(p.needed_chunks(r)) * p.chunk_size
        if keys:
            yield dict(base, rank=r, stage="sorted"), p.local_mask(r, "sorted"), keys


def stage_problems(lens_by_spread: dict, cps, spreads):
    """Yield (meta, local FlashMask, keys) of real plans' calls, one plan after the other in
    turn (round robin over spread x cp x balance), so that a budget cut still leaves every
    spread, cp and balance sampled."""
    gens = [plan_calls(lens_by_spread[s], s, cp, b)
            for s, cp, b in itertools.product(spreads, cps, ("sparse", "dual_chunk"))]
    while gens:
        alive = []
        for g in gens:
            item = next(g, None)
            if item is not None:
                alive.append(g)
                yield item
        gens = alive


def _kv_expanded(q, k, fm, device) -> bool:
    """Whether the library runs this call's backward with K/V expanded to the query heads
    (``triton_backend.splits_kv_groups``: recorded so that the fit models the grid that ran)."""
    if device.type != "cuda":
        return False
    from flashmask3.kernels import dispatch, triton_backend

    c = fm.startend_row_indices.shape[-1]
    launch = dispatch.choose(device, q.dtype, q.shape[-1], fm.causal, c).backward[0]
    return triton_backend.splits_kv_groups(launch, q.shape[0], q.shape[2], k.shape[2], k.shape[1], device)


def host_relevant(row: dict) -> bool:
    """Whether the host can set a row's stream time: its GPU time per call is under twice its
    host time in either pass (the calls whose stream time follows the host's speed)."""
    return any(k in row and row[k] < 2e-3 * row[h] for k, h in (("gpu_fwd_ms", "host_fwd_us"),
                                                               ("gpu_fwd_bwd_ms", "host_fwd_bwd_us")))


#: Rounds of :func:`repeat_streams` and the seconds they may take (~2.6 s a round for the ~160
#: host-relevant calls of a full run). One ~5 ms sample of a host-bound call lies -35% to +40% of
#: the call's mean (5-95%) with the host's speed, so 16 samples left each call's mean a relative
#: standard error of ~5-9%, as large as the whole spread between the calls' means, and the
#: target's 15% only ~2.5 of them: a few host-bound points of a few hundred missed by sampling
#: alone (the files of 2026-12-06/07, benchmarks/NOTES.md). 48 samples bring it to ~3-5%.
STREAM_REPEATS, REPEAT_S = 48, 125.0


def repeat_streams(kept: list, device, rounds: int, deadline: float, log, save=None, rows=None) -> int:
    """More stream samples of the host-relevant calls, interleaved: ``rounds`` rounds, one
    sample of each pass of each kept call per round (every other round in reverse order), until
    ``deadline``. Appends to ``stream_*_repeats`` of each row; returns the rounds completed.

    One stream sample of a host-bound call follows the host's speed over its ~10 ms, which
    drifts by tens of percent within a run (``stream_host_*`` of one file: 411-679 us per
    fwd+bwd call, 10-90%, with no trend by shape); interleaving spreads each call's samples over
    the whole run, so their mean is the call's time averaged over the run's host speeds, the
    quantity a shape-based model can predict (validate.py's ``stream`` check)."""
    done = 0
    for rnd in range(rounds):
        order = kept if rnd % 2 == 0 else kept[::-1]
        for row, fwd, step in order:
            if time.perf_counter() > deadline:
                log(f"stream repeats: time budget reached after {done} full rounds")
                return done
            for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
                ms, _, host = stream_times(fn, device, max(row[f"gpu_{name}_ms"], row[f"host_{name}_us"] * 1e-3),
                                           samples=1)
                row.setdefault(f"stream_{name}_ms_repeats", []).append(ms)
                row.setdefault(f"stream_host_{name}_us_repeats", []).append(host)
        done += 1
        if save is not None and rows is not None:
            save(rows)
    return done


def stream_idle_s(row: dict, name: str, device) -> float:
    """Seconds of idle GPU before pass ``name``'s stream: :data:`STREAM_IDLE_S` where its GPU time
    per call is at least :data:`STREAM_IDLE_MIN_MS` on CUDA, else 0."""
    return STREAM_IDLE_S if device.type == "cuda" and row[f"gpu_{name}_ms"] >= STREAM_IDLE_MIN_MS else 0.0


def rest_before_stream(row: dict, name: str, device) -> None:
    """Idle the GPU for :func:`stream_idle_s` before pass ``name``'s stream, recorded in the row."""
    idle = stream_idle_s(row, name, device)
    if idle:
        torch.cuda.synchronize()
        time.sleep(idle)
    row[f"stream_{name}_idle_s"] = idle


def _calls(q, k, v, fm, do):
    """``(fwd, step)``: one forward of ``flashmask_attention`` as training calls it (inputs that
    require grad: an autograd node), and one forward + backward with the gradients cleared."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def fwd():
        flashmask_attention(qg, kg, vg, fm)

    def step():
        flashmask_attention(qg, kg, vg, fm).backward(do)
        qg.grad = kg.grad = vg.grad = None

    return fwd, step


def measure_attention(args, device, dtype, deadline: float, log, save=None, kept=None) -> list[dict]:
    """Time every stage problem until ``deadline``; ``save(rows)`` after each (a kill keeps them).
    ``kept``: a list that receives ``(row, fwd, step)`` of every host-relevant call
    (:func:`host_relevant`), for :func:`repeat_streams`."""
    rows = []
    heads_sets = [(args.heads, args.heads // 8), (args.mha_heads, args.mha_heads)]
    for meta, fm, keys in stage_problems(args.doc_lens, args.cps, args.spreads):
        if len(rows) >= args.max_shapes * len(heads_sets):
            break
        if time.perf_counter() > deadline:
            log("attention: time budget reached")
            break
        q_rows = fm.seqlen_q
        t = tile_counts(fm.startend_row_indices, False, q_rows, keys)
        fm = fm.to(device)
        for hq, hk in heads_sets:
            if time.perf_counter() > deadline:
                break
            g = torch.Generator(device=device).manual_seed(len(rows))
            q = torch.randn(1, q_rows, hq, args.head_dim, device=device, dtype=dtype, generator=g)
            k = torch.randn(1, keys, hk, args.head_dim, device=device, dtype=dtype, generator=g)
            v = torch.randn(1, keys, hk, args.head_dim, device=device, dtype=dtype, generator=g)
            do = torch.randn_like(q)
            row = dict(meta, q_rows=q_rows, keys=keys, heads=hq, kv_heads=hk, head_dim=args.head_dim,
                       full_tiles=t.full, partial_tiles=t.partial,
                       kv_expanded=_kv_expanded(q, k, fm, device))
            fwd, step = _calls(q, k, v, fm, do)
            try:
                for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
                    fn()  # compile / warm
                    row[f"host_{name}_us"], row[f"gpu_{name}_ms"], row[f"{name}_hidden"] = overlap_times(
                        fn, device, key=name)
                    rest_before_stream(row, name, device)
                    row[f"stream_{name}_ms"], row[f"stream_{name}_calls"], row[f"stream_host_{name}_us"] = \
                        stream_times(fn, device, max(row[f"gpu_{name}_ms"], row[f"host_{name}_us"] * 1e-3))
                if kept is not None and host_relevant(row):
                    kept.append((row, fwd, step))
            except Exception as e:  # keep going: one failing shape must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                log(f"attention {meta} failed: {row['error']}")
            rows.append(row)
            if save is not None:
                save(rows)
            log(f"attention {meta} Hq={hq} Hk={hk} rows={q_rows} keys={keys} tiles={t.full}+{t.partial} "
                f"fwd={row.get('stream_fwd_ms', float('nan')):.3f} ms (GPU {row.get('gpu_fwd_ms', float('nan')):.3f}, host "
                f"{row.get('host_fwd_us', float('nan')):.0f} us) fwd+bwd={row.get('stream_fwd_bwd_ms', float('nan')):.3f} ms "
                f"(GPU {row.get('gpu_fwd_bwd_ms', float('nan')):.3f}, host {row.get('host_fwd_bwd_us', float('nan')):.0f} us)")
    return rows


def layer_gemms(model, tokens: int, ep: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of one layer's forward GEMMs on one rank (experts: its local share)."""
    h, d = model.hidden, model.head_dim
    g = [(tokens, h, (model.heads + 2 * model.kv_heads) * d), (tokens, model.heads * d, h)]
    if not model.moe:
        return g + [(tokens, h, 2 * model.ffn), (tokens, model.ffn, h)]
    local = max(1, model.experts // ep)
    # balanced routing: after the all-to-all each local expert holds top_k * tokens * ep / experts
    # tokens (the EP group's tokens routed to it), so a rank's expert work = tokens * top_k
    per_expert = max(1, tokens * model.top_k * ep // model.experts)
    f = model.expert_ffn
    g += [(per_expert, h, 2 * f), (per_expert, f, h)] * local
    g += [(tokens, h, 2 * f * model.shared_experts), (tokens, f * model.shared_experts, h)]
    return g


def measure_matmul(args, device, dtype, deadline: float, log) -> list[dict]:
    rows = []
    for model, ep in ((MOE_118B, 8), (DENSE_7B, 1)):
        for tokens in args.matmul_tokens:
            if time.perf_counter() > deadline:
                log("matmul: time budget reached")
                return rows
            gemms = layer_gemms(model, tokens, ep)
            shapes = sorted(set(gemms))
            mats = {s: (torch.randn(s[0], s[1], device=device, dtype=dtype),
                        torch.randn(s[1], s[2], device=device, dtype=dtype)) for s in shapes}

            def run():
                for s in gemms:
                    a, b = mats[s]
                    torch.matmul(a, b)

            ms = timer(run, device, args.warmup, args.rep_ms)
            flops = sum(2 * m * k * n for m, k, n in gemms)
            rows.append({"key": _shape_key(model, tokens), "model": model.name, "tokens": tokens, "ep": ep,
                         "gemms": len(gemms), "ms": ms, "tflops": flops / ms / 1e9})
            log(f"matmul {model.name} tokens={tokens}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=115.0,
                    help="seconds of measurement (attention gets 85%%, matmuls the rest)")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cps", type=int, nargs="+", default=[8, 128, 32, 16, 64])
    ap.add_argument("--spreads", nargs="+", default=["long", "mixed", "corpus", "short"])
    ap.add_argument("--heads", type=int, default=32, help="query heads of the GQA 8:1 case")
    ap.add_argument("--mha-heads", type=int, default=16, help="heads of the 1:1 case")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--matmul-tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rep-ms", type=float, default=30.0)
    ap.add_argument("--max-shapes", type=int, default=10_000, help="stop after this many attention shapes")
    ap.add_argument("--stream-repeats", type=int, default=STREAM_REPEATS,
                    help="rounds of extra stream samples of the host-relevant calls (repeat_streams)")
    ap.add_argument("--repeat-s", type=float, default=REPEAT_S,
                    help="seconds for those rounds, on top of --budget-s")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes (CPU smoke run)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.tokens, args.cps, args.spreads = 2048, [2, 16], ["long"]
        args.heads, args.mha_heads, args.head_dim = 8, 1, 16
        args.matmul_tokens, args.warmup, args.rep_ms, args.max_shapes = [64], 0, 0.0, 2
        args.stream_repeats = min(args.stream_repeats, 3)
    lens = document_spreads(args.tokens, seed=0)
    args.doc_lens = {s: lens[s] for s in args.spreads}
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "measure.log")
    logf = open(log_path, "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    t0 = time.perf_counter()
    env = dict(run_environment(device), dtype=str(dtype), dry_run=args.dry_run)
    att_deadline = t0 + args.budget_s * 0.85
    def save(rows):
        tmp = os.path.join(args.out, "scale_model_attention.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"env": env, "args": _args_dict(args), "spreads": args.doc_lens, "attention": rows}, f,
                      indent=1)
        os.replace(tmp, os.path.join(args.out, "scale_model_attention.json"))

    kept: list = []
    att = measure_attention(args, device, dtype, att_deadline, log, save, kept)
    save(att)
    t_rep = time.perf_counter()
    rounds = repeat_streams(kept, device, args.stream_repeats, t_rep + args.repeat_s, log, save, att)
    n_kept = len(kept)
    kept.clear()  # free the kept calls' tensors before the matmuls
    save(att)
    log(f"stream repeats: {rounds} rounds of {n_kept} host-relevant calls in "
        f"{time.perf_counter() - t_rep:.0f} s")
    mm = measure_matmul(args, device, dtype, t0 + args.budget_s + args.repeat_s, log)
    with open(os.path.join(args.out, "scale_model_matmul.json"), "w") as f:
        json.dump({"env": env, "args": _args_dict(args), "matmul": mm}, f, indent=1)
    ok = sum("stream_fwd_bwd_ms" in r for r in att)
    log(f"SUMMARY scale-model: {ok}/{len(att)} attention shapes timed (tiles "
        f"{min((r['full_tiles'] + r['partial_tiles'] for r in att), default=0)}-"
        f"{max((r['full_tiles'] + r['partial_tiles'] for r in att), default=0)}), {len(mm)} matmul sets; "
        f"{time.perf_counter() - t0:.0f} s; host per call median "
        f"{_median(att, 'host_fwd_us'):.0f} us fwd / {_median(att, 'host_fwd_bwd_us'):.0f} us fwd+bwd; "
        f"host hidden behind the sleep in {sum(bool(r.get('fwd_bwd_hidden')) for r in att)}/{len(att)} fwd+bwd rows; "
        f"spreads x cp x balance sampled: {len({(r['spread'], r['cp'], r['balance']) for r in att})}")
    return 0


def _args_dict(args) -> dict:
    """The command-line arguments as written to the files (the document lengths apart)."""
    # the plans' tolerance (plan_calls: the library default), so the calibration rebuilds them
    return dict({k: v for k, v in vars(args).items() if k != "doc_lens"}, tolerance=DEFAULT_TOLERANCE)


def _median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


if __name__ == "__main__":
    sys.exit(main())
