"""Kernel benchmark: flashmask3 (Triton) against FlexAttention, SDPA and varlen on one GPU.

One process, one set of inputs per case, every implementation timed back to back:

* ``flashmask3``   -- ``flashmask3.flashmask_attention`` with ``FLASHMASK3_BACKEND=triton``;
* ``flashmask3_split``, ``flashmask3_portable`` -- the same call with the kernel choice
                      overridden (:data:`FLASHMASK_VARIANTS`: FLASHMASK3_KERNELS=split, the
                      reproducible backward; =portable, the tl kernels only);
* ``flex``         -- ``torch.compile(flex_attention)`` (Triton backend), block mask built once
                      by ``create_block_mask(_compile=True)``; its build time is reported apart.
                      One generic ``mask_mod`` reads the same column intervals as FlashMask
                      (the closure tensors are graph inputs, so one compile serves every mask);
* ``sdpa_cudnn`` / ``sdpa_flash`` -- SDPA backends, only where the mask is plain causal/full;
* ``varlen``       -- ``torch.nn.attention.varlen.varlen_attn`` for (causal) document masks;
* ``sdpa_dense``   -- SDPA with a dense boolean mask, where memory and time allow (S = 8K, D=128).

Grid: mask type x S in {8K, 32K, 128K} (batch = 128K / S) x D in {64, 128, 256} (Hq = 4096 / D,
Hk = Hq) plus GQA 32:8 at D=128. Effective TFLOP/s use ``flashmask3.masks.attention_flops``
(docs/masks.md convention). Results go to ``--out`` as JSON (written after every case), and
``--report`` turns one or more JSON files into the markdown table and the PNG plot.

    python benchmarks/kernel.py --dims 128 --out $OUT            # on the GPU
    python benchmarks/kernel.py --report benchmarks/results/kernel_*.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashmask3  # noqa: E402
from benchmarks.environment import run_environment  # noqa: E402
import flashmask3.masks as M  # noqa: E402
from flashmask3.api import kernel_row_span  # noqa: E402

TOTAL_TOKENS = 131072
HIDDEN = 4096
DOC_TYPES = ("causal_document", "document", "prefix_document")


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------


def _spread(s: int, batch: int, kind: str) -> list[list[int]]:
    """Document lengths per batch row from benchmarks/corpus.py (a different seed per row)."""
    from benchmarks.corpus import document_spreads

    return [document_spreads(s, seed=b)[kind] for b in range(batch)]


def _shared_question(s: int) -> list:
    samples, used = [], 0
    while used + 4096 <= s:
        samples.append((2048, [1024, 1024]))
        used += 4096
    return samples


def build_mask(name: str, s: int, batch: int):
    """(FlashMask or None, causal, number of documents per row (mean) or None)."""
    if name == "full":
        return None, False, None
    if name == "causal":
        return None, True, None
    if name == "sliding_window":
        return M.sliding_window_mask(s, 4096, batch_size=batch), True, None
    if name == "global_sliding_window":
        return M.global_sliding_window_mask(s, 256, 2048, batch_size=batch), False, None
    if name == "causal_blockwise":
        blocks = [1024] * ((s - 4096) // 1024) + [4096]
        return M.causal_blockwise_mask(blocks, batch_size=batch), True, None
    if name == "prefix_lm":
        return M.prefix_lm_mask(s, s // 2, batch_size=batch), False, None
    if name == "shared_question":
        return M.shared_question_mask(_shared_question(s), seqlen=s, batch_size=batch), True, None
    if name == "random_eviction":
        return M.random_eviction_mask(s, batch_size=batch, num_heads=1, seed=s), True, None
    for base in DOC_TYPES:
        if name.startswith(base + "_"):
            rows = _spread(s, batch, name[len(base) + 1:])
            ndocs = sum(len(r) for r in rows) / len(rows)
            if base == "causal_document":
                return M.causal_document_mask(rows), True, ndocs
            if base == "document":
                return M.document_mask(rows), False, ndocs
            return M.prefix_document_mask(rows, [[n // 2 for n in r] for r in rows]), False, ndocs
    raise ValueError(f"unknown mask {name}")


MASKS = ["causal", "full", "causal_document_corpus", "causal_document_short", "causal_document_mixed",
         "causal_document_long", "document_corpus", "document_short", "prefix_document_corpus",
         "shared_question", "sliding_window", "global_sliding_window", "causal_blockwise", "prefix_lm",
         "random_eviction"]


def _doc_bounds_rows(mask) -> list[list[int]]:
    """cu_seqlens of the documents of a (causal) document mask, from LTS (the doc ends)."""
    ends = mask.startend_row_indices[:, 0, :, 0].cpu()
    out = []
    for row in ends:
        e = torch.unique_consecutive(row).tolist()
        out.append(e)
    return out


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _sync():
    torch.cuda.synchronize()


#: do_bench's timed window for calls under 40 ms, in calls: at least this many samples (a
#: fixed 100 ms window gave 2-3 samples of a 35-40 ms call, and in session 12 three such
#: flashmask3 fwd+bwd rows came out 3-7 ms above the same call timed over 1.5 s).
MIN_SAMPLES = 12


#: Calls over 40 ms are timed by CUDA events, this many times (median), up to EVENT_MANY_MS; the
#: longer ones 3 times (128K causal/full take 0.3-2 s per fwd+bwd). Session 12: with 3 samples
#: a 77 ms call came out at 83 ms in one of two runs.
EVENT_SAMPLES, EVENT_MANY_MS = 7, 150.0


def do_bench_window(first_ms: float) -> float:
    """do_bench's ``rep`` (ms) for a call that took ``first_ms``: 100 ms, or enough for
    :data:`MIN_SAMPLES` calls."""
    return max(100.0, MIN_SAMPLES * first_ms)


def event_samples(first_ms: float) -> int:
    """How many CUDA-event-timed calls the median of a call over 40 ms takes."""
    return EVENT_SAMPLES if first_ms < EVENT_MANY_MS else 3


def bench(fn, grad_to_none=None) -> tuple[float, str]:
    """Median milliseconds of ``fn``: do_bench (median of at least :data:`MIN_SAMPLES` calls)
    for short calls; for calls over 40 ms one warm-up and the median of
    :func:`event_samples` CUDA-event-timed calls (do_bench's 5-call estimate alone would cost
    seconds per measurement at 128K)."""
    from triton.testing import do_bench

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed_call() -> float:
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        start.record()
        fn()
        end.record()
        _sync()
        return start.elapsed_time(end)

    first = timed_call()
    if first < 40:
        return do_bench(fn, warmup=25, rep=do_bench_window(first), grad_to_none=grad_to_none,
                        return_mode="median"), f"do_bench-{MIN_SAMPLES}"
    n = event_samples(first)
    return sorted(timed_call() for _ in range(n))[n // 2], f"events-median-{n}"


def interleaved_rounds(first_ms: float) -> int:
    """Rounds of the interleaved timer for a case whose slowest implementation's first call took
    ``first_ms``: what :func:`bench` gives one implementation (at least :data:`MIN_SAMPLES`
    for calls under 40 ms, :func:`event_samples` above), capped at 50 for very short calls."""
    if first_ms >= 40:
        return event_samples(first_ms)
    return max(MIN_SAMPLES, min(50, math.ceil(do_bench_window(first_ms) / max(first_ms, 1e-3))))


def interleaved_medians(calls: dict, timer, rounds: int) -> dict:
    """Median of ``timer(call)`` per name over ``rounds`` rounds. Every round times each call
    once, starting one name later than the round before, so a drift of the GPU's clocks or
    temperature during the case falls on every implementation alike (timed one after the
    other, Flex's and our fwd+bwd moved by 2-5% between runs in sessions 12-14)."""
    names = list(calls)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            samples[n].append(timer(calls[n]))
    return {n: statistics.median(v) for n, v in samples.items()}


#: GPU cycles (about 2 ms at the H200's ~2 GHz) the interleaved timer keeps the GPU busy with
#: before each timed call, so that the host's work for the call (the implementation's Python,
#: its kernel options' context: ~0.1 ms here) is done while the GPU is still busy, as between
#: back-to-back calls, and not counted. Session 14's first interleaved rows (kernel_v69b_*,
#: kernel_v69c_*) ran without it: their times include that host work.
HOST_COVER_CYCLES = 4_000_000


def _event_timer(call) -> float:
    """Milliseconds of one ``call`` = (run, leaves, options) by CUDA events: the leaves'
    gradients cleared and the kernel options (``options()``, a context manager) entered outside
    the timed span, which starts behind :data:`HOST_COVER_CYCLES` of GPU sleep."""
    run, leaves, options = call
    for t in leaves or ():
        t.grad = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with options():
        torch.cuda._sleep(HOST_COVER_CYCLES)
        start.record()
        run()
        end.record()
    _sync()
    return start.elapsed_time(end)


def standard_ms(fn, leaves=None) -> float:
    """Median ms of ``fn`` by plain ``triton.testing.do_bench`` (its defaults: 25 ms warm-up,
    100 ms of calls, L2 flushed before each): the standard number every peer reports. Each
    timed span starts right after the L2 flush, so it includes whatever host work of the call
    the GPU does not hide: the column to quote, next to the interleaved timer's GPU time."""
    from triton.testing import do_bench

    return do_bench(fn, grad_to_none=leaves, return_mode="median")


#: Calls per host-time sample and the GPU sleep (cycles) that covers them: the host's work of
#: :data:`HOST_CALLS` fwd+bwd calls must be enqueued before the GPU runs dry (100M cycles is
#: ~50 ms on an H200: 5 ms per call).
HOST_CALLS, HOST_SLEEP_CYCLES = 10, 100_000_000


def host_us(fn, leaves=None, samples: int = 5) -> float:
    """Median host time per call (µs) of ``fn``: CPU wall time to enqueue :data:`HOST_CALLS`
    back-to-back calls while the GPU is kept busy (``torch.cuda._sleep``), so it measures the
    Python and launch work only, never a wait for the device (a synchronising call shows up as
    the GPU sleep's length)."""
    per_call = []
    for _ in range(samples):
        for t in leaves or ():
            t.grad = None
        _sync()
        torch.cuda._sleep(HOST_SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        per_call.append((time.perf_counter() - t0) / HOST_CALLS * 1e6)
        _sync()
    return statistics.median(per_call)


def standard_columns(fwd, leaves, dout) -> dict:
    """The host-inclusive columns of one implementation: do_bench medians of fwd and fwd+bwd
    (``std_fwd_ms``, ``std_fwd_bwd_ms``) and host µs per call (``host_fwd_us``,
    ``host_fwd_bwd_us``)."""
    def fwd_bwd():
        fwd().backward(dout)

    return dict(std_fwd_ms=standard_ms(fwd), std_fwd_bwd_ms=standard_ms(fwd_bwd, leaves),
                host_fwd_us=host_us(fwd), host_fwd_bwd_us=host_us(fwd_bwd, leaves))


def measure_interleaved(built: dict) -> dict:
    """fwd, bwd and fwd+bwd medians (ms) and peak extra memory (GB) of every implementation in
    ``built`` (name -> (fwd, leaves, dout)), the implementations' calls interleaved round by
    round (:func:`interleaved_medians`), each call under its implementation's kernel options
    (:func:`flashmask_variant`). After one warm-up call each, the slowest first call sets the
    rounds (:func:`interleaved_rounds`)."""
    def options(name):
        return lambda: flashmask_variant(name)

    res = {n: {} for n in built}
    outs = {}
    for n, (fwd, leaves, dout) in built.items():  # each implementation's graph for "bwd"
        with flashmask_variant(n):
            outs[n] = fwd()
    modes = {
        "fwd_ms": {n: (fwd, None, options(n)) for n, (fwd, leaves, dout) in built.items()},
        "bwd_ms": {n: (lambda o=outs[n], d=dout: o.backward(d, retain_graph=True), leaves,
                       options(n)) for n, (fwd, leaves, dout) in built.items()},
        "fwd_bwd_ms": {n: (lambda f=fwd, d=dout: f().backward(d), leaves, options(n))
                       for n, (fwd, leaves, dout) in built.items()},
    }
    rounds = []
    for key, calls in modes.items():
        first = max(_event_timer(c) for c in calls.values())
        rounds.append(interleaved_rounds(first))
        for n, ms in interleaved_medians(calls, _event_timer, rounds[-1]).items():
            res[n][key] = ms
    for n in res:  # the rounds of fwd / bwd / fwd+bwd
        res[n]["timer"] = "interleaved-" + "/".join(str(r) for r in rounds)
    outs.clear()
    for n, (fwd, leaves, dout) in built.items():
        with flashmask_variant(n):
            res[n]["peak_extra_gb"] = _peak_extra_gb(fwd, leaves, dout)
            if torch.cuda.is_available():  # (CUDA-timed; the CPU tests of this wiring skip it)
                res[n].update(standard_columns(fwd, leaves, dout))
    return res


def _peak_extra_gb(fwd, leaves, dout) -> float:
    """Peak memory (GB) one fwd+bwd allocates above what is allocated before it."""
    for t in leaves:
        t.grad = None
    gc.collect()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd().backward(dout)
    _sync()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    for t in leaves:
        t.grad = None
    return peak


def measure(fwd, leaves, dout) -> dict:
    """fwd, bwd and fwd+bwd medians (ms) and peak extra memory (GB) of one implementation."""
    res = {}
    res["fwd_ms"], res["timer"] = bench(fwd)
    out = fwd()
    res["bwd_ms"], _ = bench(lambda: out.backward(dout, retain_graph=True), grad_to_none=leaves)
    del out
    res["fwd_bwd_ms"], _ = bench(lambda: fwd().backward(dout), grad_to_none=leaves)
    res["peak_extra_gb"] = _peak_extra_gb(fwd, leaves, dout)
    if torch.cuda.is_available():
        res.update(standard_columns(fwd, leaves, dout))
    return res


# ---------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------


def _flex_intervals(mask, causal: bool, s: int, batch: int, device):
    """Two masked row intervals [s0, e0), [s1, e1) per (batch, key), for the generic mask_mod."""
    if mask is None:
        full = torch.full((batch, s), s, dtype=torch.int32, device=device)
        return full, full.clone(), full.clone(), full.clone()
    cols = mask.startend_row_indices[:, 0].to(device)
    iv = M.masked_row_intervals(cols.to(torch.int64), causal, s)
    if len(iv) == 1:
        iv.append((torch.full_like(iv[0][0], s), torch.full_like(iv[0][0], s)))
    return tuple(x.to(torch.int32).contiguous() for pair in iv for x in pair)


def _generic_mask_mod(s0, e0, s1, e1, causal_t):
    """FlashMask column semantics as a FlexAttention mask_mod (True = attend)."""

    def mask_mod(b, h, q_idx, kv_idx):
        m0 = (q_idx >= s0[b, kv_idx]) & (q_idx < e0[b, kv_idx])
        m1 = (q_idx >= s1[b, kv_idx]) & (q_idx < e1[b, kv_idx])
        return ~(m0 | m1) & ((kv_idx <= q_idx) | (causal_t == 0))

    return mask_mod


_FLEX = {}


def flex_block_mask(mask, causal: bool, batch: int, s: int, device):
    """FlexAttention's block mask of a FlashMask (or None: full) for ``batch`` x ``s`` tokens."""
    from torch.nn.attention.flex_attention import create_block_mask

    s0, e0, s1, e1 = _flex_intervals(mask, causal, s, batch, device)
    mm = _generic_mask_mod(s0, e0, s1, e1, torch.tensor(int(causal), device=device))
    return create_block_mask(mm, batch, None, s, s, device=device, _compile=True)


def flex_impl(mask, causal, q, k, v, scale):
    """(fwd callable, leaves, block-mask build ms) for FlexAttention on [B, H, S, D] copies."""
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    b, s, hq, d = q.shape
    hk = k.shape[2]
    flex_block_mask(mask, causal, b, s, q.device)  # compile warm-up
    _sync()
    t0 = time.perf_counter()
    bm = flex_block_mask(mask, causal, b, s, q.device)
    _sync()
    build_ms = (time.perf_counter() - t0) * 1e3
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    fn = _FLEX["fn"]

    def fwd():
        return fn(qt, kt, vt, block_mask=bm, scale=scale, enable_gqa=hq != hk)

    return fwd, [qt, kt, vt], build_ms


def flashmask_impl(mask, causal, q, k, v, scale):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def fwd():
        return flashmask3.flashmask_attention(qq, kk, vv, mask, causal=causal, softmax_scale=scale)

    return fwd, [qq, kk, vv]


def sdpa_impl(backend_name, causal, q, k, v, scale, attn_mask=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "dense": SDPBackend.EFFICIENT_ATTENTION}[backend_name]
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def fwd():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=attn_mask, is_causal=causal and attn_mask is None, scale=scale,
                enable_gqa=gqa)

    return fwd, [qt, kt, vt]


def varlen_impl(mask, causal, q, k, v, scale):
    """varlen_attn over all documents of all batch rows packed into one [T, H, D] sequence."""
    import inspect

    from torch.nn.attention import varlen as V

    b, s, hq, d = q.shape
    ends = _doc_bounds_rows(mask)
    cu = [0]
    for r, row_ends in enumerate(ends):
        cu.extend(r * s + e for e in row_ends)
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    qp, kp, vp = (x.detach().reshape(b * s, x.shape[2], d).clone().requires_grad_() for x in (q, k, v))
    params = inspect.signature(V.varlen_attn).parameters
    kw = {"scale": scale}
    if causal:
        if "is_causal" in params:
            kw["is_causal"] = True
        else:
            kw["window_size"] = (-1, 0)
    if "enable_gqa" in params and hq != k.shape[2]:
        kw["enable_gqa"] = True
    mx = max(lens)

    def fwd():
        return V.varlen_attn(qp, kp, vp, cu_t, cu_t, mx, mx, **kw)

    return fwd, [qp, kp, vp]


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------


def flashmask_prep_ms(mask, causal, s, d, dtype) -> float:
    """Median time of the mask preprocessing of one fwd+bwd (summaries + live ranges of every pass)."""
    from triton.testing import do_bench

    from flashmask3.kernels import triton_backend as T

    cols = None if mask is None else mask.startend_row_indices
    if cols is None:
        return 0.0
    span = kernel_row_span(mask)  # (the forward's tile hint, as flashmask_attention passes it)
    return do_bench(lambda: T.preprocess(cols, causal, s, s, d, dtype, row_span=span), warmup=10,
                    rep=50, return_mode="median")


def mask_bytes(mask, causal, s, d, dtype) -> int:
    """Bytes of the column mask plus every block summary and live-range table."""
    from flashmask3.kernels import triton_backend as T

    if mask is None:
        return 0
    plans = T.preprocess(mask.startend_row_indices, causal, s, s, d, dtype,
                         row_span=kernel_row_span(mask))
    n = mask.startend_row_indices.numel() * 4
    for p in plans:
        n += p.summary.numel() * 4 + p.ranges.numel() * 4
    return n


#: flashmask3 timed again in the same run with the kernel choice overridden:
#: impl name -> (short label, FLASHMASK3_KERNELS value). ``split``: the split backward where the
#: fused one is the default (D=64/128 on Hopper); ``portable``: the tl kernels only.
FLASHMASK_VARIANTS = {
    "flashmask3_split": ("split", "split"),
    "flashmask3_portable": ("portable", "portable"),
}


#: Labels of the variant columns in reports, with variants of earlier runs (their code is
#: deleted; their rows stay readable in committed results).
_VARIANT_LABELS = {**{name: v[0] for name, v in FLASHMASK_VARIANTS.items()},
                   "flashmask3_maskfree": "maskfree", "flashmask3_fused": "fused",
                   "flashmask3_masked": "masked", "flashmask3_tl_dkdv": "tl-dkdv",
                   "flashmask3_tl_fwd": "tl-fwd", "flashmask3_fwd_ws": "fwd-ws",
                   "flashmask3_fwd_wsp": "fwd-wsp", "flashmask3_fwd_ws_p": "fwd-ws+P"}


@contextlib.contextmanager
def flashmask_variant(impl_name: str):
    """The kernel choice of one flashmask3 row: the library's ("flashmask3") or a
    :data:`FLASHMASK_VARIANTS` entry's FLASHMASK3_KERNELS value; restored afterwards."""
    value = FLASHMASK_VARIANTS.get(impl_name, ("", None))[1]
    env = {} if value is None else {"FLASHMASK3_KERNELS": value}
    with mock.patch.dict(os.environ, env):
        yield


def run_case(name: str, s: int, d: int, hq: int, hk: int, dtype, args) -> dict:
    from flashmask3.kernels import dispatch

    batch = TOTAL_TOKENS // s
    mask, causal, ndocs = build_mask(name, s, batch)
    if mask is not None:
        mask = mask.to("cuda")
    cols = None if mask is None else mask.startend_row_indices
    flops = {m: M.attention_flops(cols, causal, batch_size=batch, num_heads=hq, seqlen_q=s, seqlen_k=s,
                                  head_dim=d, mode=m) for m in ("fwd", "bwd", "fwd_bwd")}
    density = (M.unmasked_pairs(cols, causal, s, s) / (batch * (1 if cols is None else cols.shape[1]) * s * s))
    g = torch.Generator(device="cuda").manual_seed(s + d)
    q = torch.randn(batch, s, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch, s, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, s, hk, d, device="cuda", dtype=dtype, generator=g)
    scale = 1 / math.sqrt(d)
    rec = dict(mask=name, S=s, D=d, B=batch, Hq=hq, Hk=hk, causal=causal, docs_per_row=ndocs,
               density=density, flops=flops, impls={})

    impls = [(fm, lambda: flashmask_impl(mask, causal, q, k, v, scale) + (None,))
             for fm in ["flashmask3", *FLASHMASK_VARIANTS]]
    impls.append(("flex", lambda: flex_impl(mask, causal, q, k, v, scale)))
    if mask is None:
        impls.append(("sdpa_cudnn", lambda: sdpa_impl("cudnn", causal, q, k, v, scale) + (None,)))
        impls.append(("sdpa_flash", lambda: sdpa_impl("flash", causal, q, k, v, scale) + (None,)))
    if name.startswith("causal_document") or name.startswith("document_"):
        impls.append(("varlen", lambda: varlen_impl(mask, causal, q, k, v, scale) + (None,)))
    if "sdpa_dense" in args.impls and mask is not None and s <= args.dense_max_s and d == 128 \
            and hq == hk:  # (the dense mask costs B x S x S bytes: built only when it is timed)
        dense = M.to_dense(cols, causal, s, s).to("cuda")
        impls.append(("sdpa_dense", lambda: sdpa_impl("dense", causal, q, k, v, scale, attn_mask=dense)
                      + (None,)))
    impls = [(name, make) for name, make in impls if name in args.impls]
    if args.timer == "interleaved":
        rec["impls"] = _measure_impls_interleaved(impls, flops)
    else:
        for impl_name, make in impls:
            with flashmask_variant(impl_name):
                rec["impls"][impl_name] = _measure_impl(make, flops)
            gc.collect()
            torch.cuda.empty_cache()
    if "flashmask3" in rec["impls"] and "error" not in rec["impls"]["flashmask3"]:
        fm = rec["impls"]["flashmask3"]
        c = 0 if cols is None else cols.shape[-1]
        with flashmask_variant("flashmask3"):  # what the flashmask3 row ran
            span = None if mask is None else kernel_row_span(mask)  # (the forward's tile hint)
            choice = dispatch.choose(q.device, q.dtype, d, causal, c, span)
            fm["backward"] = choice.backward_mode
            fm["configs"] = {x.pass_: f"{x.kernel} {x.tile}" for x in
                             (choice.forward, *dispatch.choose(q.device, q.dtype, d, causal, c).backward)}
            fm["prep_ms"] = flashmask_prep_ms(mask, causal, s, d, dtype)
            fm["mask_bytes"] = mask_bytes(mask, causal, s, d, dtype)
    return rec


def _measure_impls_interleaved(impls, flops) -> dict:
    """Build every implementation (an error: OOM, unsupported head dim, missing API, is recorded
    instead), then time them together (:func:`measure_interleaved`) and add their TFLOP/s."""
    built, out = {}, {}
    for name, make in impls:
        try:
            with flashmask_variant(name):
                fwd, leaves, build_ms = make()
                out0 = fwd()
            built[name] = (fwd, leaves, torch.randn_like(out0))
            out[name] = {} if build_ms is None else {"mask_build_ms": build_ms}
            del out0
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    try:
        timed = measure_interleaved(built)
    except Exception as exc:  # (e.g. out of memory with every implementation's graph held)
        timed = {n: {"error": f"{type(exc).__name__}: {str(exc)[:300]}"} for n in built}
    for name, r in timed.items():
        out[name].update(r)
        if "error" not in r:
            _add_tflops(out[name], flops)
    built.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return {name: out[name] for name, _ in impls}


def _add_tflops(r: dict, flops: dict) -> dict:
    """``r`` with the effective TFLOP/s of its fwd, bwd and fwd+bwd times."""
    for m, key in (("fwd", "fwd_ms"), ("bwd", "bwd_ms"), ("fwd_bwd", "fwd_bwd_ms")):
        r["tflops_" + m] = flops[m] / (r[key] * 1e-3) / 1e12
    return r


def _measure_impl(make, flops) -> dict:
    """Build one implementation, time it (:func:`measure`) and add its TFLOP/s; an error (OOM,
    unsupported head dim, missing API) is recorded instead."""
    try:
        fwd, leaves, build_ms = make()
        out0 = fwd()
        dout = torch.randn_like(out0)
        del out0
        r = measure(fwd, leaves, dout)
        if build_ms is not None:
            r["mask_build_ms"] = build_ms
        return _add_tflops(r, flops)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


# ---------------------------------------------------------------------------------------------
# Report: markdown table + plot
# ---------------------------------------------------------------------------------------------


def _speed(rec, other, key="fwd_bwd_ms", ours="flashmask3"):
    """``other``'s time / ``ours``'s time for ``key`` (None if either did not run)."""
    a = rec["impls"].get(ours, {})
    b = rec["impls"].get(other, {})
    if key in a and key in b:
        return b[key] / a[key]
    return None


def targets(rec) -> list[str]:
    """The issue's targets that apply to this case, each 'name: value (met|MISSED)'."""
    out = []
    fm = rec["impls"].get("flashmask3", {})
    if "fwd_bwd_ms" not in fm:
        return ["flashmask3 did not run"]
    sp = _speed(rec, "flex")
    if rec["D"] and sp is not None:
        need = 1.3 if any(rec["mask"].startswith(t) for t in DOC_TYPES) else 1.1
        out.append(f"f+b vs flex {sp:.2f}x>={need} {'met' if sp >= need else 'MISSED'}")
    if rec["mask"] == "causal":
        for impl in ("sdpa_cudnn",):
            f = _speed(rec, impl, "fwd_ms")
            fb = _speed(rec, impl)
            if f is not None:
                out.append(f"fwd vs cuDNN {f:.2f}>=0.85 {'met' if f >= 0.85 else 'MISSED'}")
            if fb is not None:
                out.append(f"f+b vs cuDNN {fb:.2f}>=0.8 {'met' if fb >= 0.8 else 'MISSED'}")
    if rec["mask"].startswith("causal_document") and rec["S"] == 32768 and rec["D"] == 128 and rec["Hq"] == rec["Hk"]:
        tf, tfb = fm["tflops_fwd"], fm["tflops_fwd_bwd"]
        out.append(f"fwd {tf:.0f}>=450 {'met' if tf >= 450 else 'MISSED'}")
        out.append(f"f+b {tfb:.0f}>=350 {'met' if tfb >= 350 else 'MISSED'}")
    if rec["S"] == 32768 and fm.get("prep_ms") is not None:
        frac = fm["prep_ms"] / fm["fwd_bwd_ms"]
        out.append(f"prep {100 * frac:.2f}%<2% {'met' if frac < 0.02 else 'MISSED'}")
    return out


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _variants_cell(r: dict) -> str:
    """'label f+b (Flex / variant x)' for each flashmask3 variant timed in this case."""
    cells = [f"{label} {_fmt(r['impls'][name].get('fwd_bwd_ms'))} ({_fmt(_speed(r, 'flex', ours=name))}x)"
             for name, label in _VARIANT_LABELS.items() if name in r["impls"]]
    return "; ".join(cells) or "-"


def standard_table(results: list[dict]) -> list[str]:
    """Markdown lines of the host-inclusive columns (:func:`standard_columns`) of the rows that
    have them: do_bench fwd / fwd+bwd (ms) and host µs per call, flashmask3 and Flex."""
    rows = [r for r in results if "std_fwd_bwd_ms" in r["impls"].get("flashmask3", {})]
    if not rows:
        return []
    hdr = ("| D | mask | S | fm std fwd | fm std f+b | flex std f+b | x flex (std) | fm GPU f+b | "
           "fm std / GPU | fm host fwd µs | fm host f+b µs | flex host f+b µs |")
    out = ["", "Standard timing (plain `triton.testing.do_bench`, host launch work included, as "
           "peers report; `GPU` = the interleaved timer above) and host time per call (CPU time "
           "to enqueue while the GPU is busy):", "", hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in rows:
        fm, fx = r["impls"]["flashmask3"], r["impls"].get("flex", {})
        ratio = (fx["std_fwd_bwd_ms"] / fm["std_fwd_bwd_ms"]) if "std_fwd_bwd_ms" in fx else None
        out.append("| " + " | ".join([
            str(r["D"]), r["mask"], f"{r['S'] // 1024}K", _fmt(fm["std_fwd_ms"]),
            _fmt(fm["std_fwd_bwd_ms"]), _fmt(fx.get("std_fwd_bwd_ms")), _fmt(ratio),
            _fmt(fm.get("fwd_bwd_ms")), _fmt(fm["std_fwd_bwd_ms"] / fm["fwd_bwd_ms"])
            if fm.get("fwd_bwd_ms") else "-", _fmt(fm["host_fwd_us"], ".0f"),
            _fmt(fm["host_fwd_bwd_us"], ".0f"), _fmt(fx.get("host_fwd_bwd_us"), ".0f")]) + " |")
    return out


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["# Kernel benchmark: flashmask3 (Triton) vs FlexAttention / SDPA / varlen", ""]
    for k in ("gpu", "date", "torch", "triton", "cuda", "command"):
        if k in meta:
            lines.append(f"- **{k}**: `{meta[k]}`")
    lines += ["", "Times are medians in ms (fwd / bwd / fwd+bwd); TFLOP/s are effective "
              "(docs/masks.md, FLOP convention: 4·B·Hq·D·unmasked pairs, bwd 2.5x, f+b 3.5x). "
              "`x flex` = Flex time / "
              "flashmask3 time for fwd+bwd. prep = flashmask3 mask preprocessing (summaries + ranges, "
              "fwd and bwd plans); build = Flex create_block_mask. mem = peak extra GB of one fwd+bwd. "
              "ver = flashmask3 kernel version of that row (benchmarks/NOTES.md: v1 = first kernels, v2 = "
              "A operands through TMA + new forward configs, v3 = opt-in fused backward (not in a table run), "
              "v4 = dK/dV loop without mask code over UNMASKED runs + measured backward configs, v4.1 = v4 "
              "timed against the v5 loops in one run, v5 = the same mask-free loop in the forward and dQ "
              "kernels too, v5.1 = measured D=64 and D=256 backward defaults, v6 = the Gluon dK/dV "
              "kernel at D=128, v6.2 = its warp-specialised version (1-warp TMA producer) as the "
              "default, v6.3 = that kernel at D=64 too and the D=256 forward at 128x64 (rows at D=256: "
              "the autotuner's pick, the same tile), v6.4 = the split backward with its D=128 dK/dV "
              "at 64x128 w8, statistics in shared memory (these rows ran the split backward, pinned; "
              "the fused Gluon backward, the D=128 default on Hopper since v6.5, 1.11-1.18x faster "
              "than this split one in gluon_fused64_ab.md), v6.5 = that fused Gluon backward as the "
              "default at D=128 (rows record `backward`), v6.6 = the fused Gluon backward the "
              "default at D=64 too (64x64 w4), v6.7 = the fused backward's dQ scaling as a kernel "
              "that reads the transposed accumulator along its rows (4.2 -> 0.76 ms at 128K tokens; "
              "short calls timed over at least 12 samples since the second v6.7 run), v6.8 = the "
              "warp-specialised Gluon forward (producer warp, K/V rings, two consumer warpgroups) "
              "as the default at D=128 on causal, full and non-causal C=2 masks and at D=256; calls "
              "of 40-150 ms timed by the median of 7 (v6.8 rows and the last v6.7 ones), v6.9 = the WS "
              "forward's producer stages the masked tiles' mask columns in shared memory and the WS "
              "forward is the default on every layout at D=128 and D=256 (rows whose JSON records the timer "
              "`interleaved-...`: every implementation's calls alternated round by round; the number is "
              "the rounds, of the forward alone in session 14's rows, whose times also count each "
              "call's host launch work on both sides of a ratio (estimated at ~0.1-0.5 ms in "
              "session 14, measured at ~1.3 ms on the 8K causal short-document row in session 15: "
              "benchmarks/NOTES.md); the v6.9 rows of session 15 (8K and 128K causal short documents, 128K "
              "D=64 document corpus) ran the fixed timer, which keeps the host's work out), v7.0 = "
              "the warp-specialised Gluon dK/dV at D=256 too, its two warpgroups splitting the head "
              "dim (1.61-1.87x the tl kernel, bitwise equal; rows at D=256 and the 128K D=64 causal "
              "and random-eviction rows, fixed interleaved timer), v7.1 = the forward's short-rows "
              "tile: masks whose rows attend few keys (the constructors record the mean row span) "
              "run the one-warpgroup WS forward at 64x64 (D=128, span < 1536; 1448 since) or tl at 64x64 w4 s3 "
              "(D=64, span < 2048), two programs per SM; a "
              "later run of a case replaces an earlier one). `variants`: flashmask3 timed again in the "
              "same run with one option changed (`fused` / `split` backward; `masked`: no mask-free loops; "
              "`tl-dkdv`: the tl dK/dV kernel instead of the Gluon one; `tl-fwd`: the tl forward "
              "instead of the WS Gluon one; `fwd-ws` / `fwd-wsp` / `fwd-ws+P`: the WS forward "
              "forced, without / with ping-pong, persistent; "
              "`maskfree`, in v4.1 rows: the v5 loops), f+b ms and Flex / variant.", ""]
    hdr = ("| ver | D | Hq:Hk | mask | S | docs | density | fm fwd | fm bwd | fm f+b | fm TF f/f+b | flex f+b | "
           "x flex | variants f+b (x flex) | cuDNN f+b | flash f+b | varlen f+b | dense f+b | prep ms | "
           "build ms | fm/flex mem | targets |")
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in sorted(results, key=lambda r: (r["D"], r["Hq"] != r["Hk"], MASKS.index(r["mask"]) if r["mask"] in MASKS else 99, r["S"])):
        fm = r["impls"].get("flashmask3", {})
        fx = r["impls"].get("flex", {})

        def fb(name):
            return _fmt(r["impls"].get(name, {}).get("fwd_bwd_ms"))

        lines.append("| " + " | ".join([
            str(r.get("kernel_version", "?")), str(r["D"]), f"{r['Hq']}:{r['Hk']}", r["mask"], f"{r['S'] // 1024}K",
            _fmt(r["docs_per_row"], ".1f"), _fmt(r["density"], ".3f"),
            _fmt(fm.get("fwd_ms")), _fmt(fm.get("bwd_ms")), _fmt(fm.get("fwd_bwd_ms")),
            f"{_fmt(fm.get('tflops_fwd'), '.0f')}/{_fmt(fm.get('tflops_fwd_bwd'), '.0f')}",
            fb("flex"), _fmt(_speed(r, "flex")), _variants_cell(r), fb("sdpa_cudnn"), fb("sdpa_flash"), fb("varlen"),
            fb("sdpa_dense"), _fmt(fm.get("prep_ms"), ".3f"), _fmt(fx.get("mask_build_ms"), ".1f"),
            f"{_fmt(fm.get('peak_extra_gb'))}/{_fmt(fx.get('peak_extra_gb'))}",
            "; ".join(targets(r)) or "-"]) + " |")
        errs = {k: v["error"] for k, v in r["impls"].items() if "error" in v}
        if errs:
            lines.append(f"|  |  | errors: {errs} |" + " |" * (hdr.count("|") - 4))
    lines += standard_table(results)
    missed = [(r["mask"], r["S"], r["D"], t) for r in results for t in targets(r) if "MISSED" in t]
    met = [t for r in results for t in targets(r) if t.endswith("met")]
    lines += ["", f"**Targets**: {len(met)} met, {len(missed)} missed (see benchmarks/NOTES.md for "
              "what limits the missed ones)."]
    if meta.get("not_run"):
        lines += ["", "**Not run** (device time): " + ", ".join(meta["not_run"])]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["D"] for r in results})
    seqs = sorted({r["S"] for r in results})
    fig, axes = plt.subplots(len(dims), len(seqs), figsize=(6 * len(seqs), 4 * len(dims)), squeeze=False)
    for i, d in enumerate(dims):
        for j, s in enumerate(seqs):
            ax = axes[i][j]
            rows = [r for r in results if r["D"] == d and r["S"] == s and r["Hq"] == r["Hk"]]
            rows.sort(key=lambda r: MASKS.index(r["mask"]) if r["mask"] in MASKS else 99)
            names = [r["mask"] for r in rows]
            x = range(len(rows))
            for off, impl in ((-0.2, "flashmask3"), (0.2, "flex")):
                vals = [r["impls"].get(impl, {}).get("tflops_fwd_bwd", 0) for r in rows]
                ax.bar([xi + off for xi in x], vals, width=0.4, label=impl)
            ax.set_xticks(list(x))
            ax.set_xticklabels(names, rotation=70, fontsize=7)
            ax.set_title(f"D={d}, S={s // 1024}K (B={TOTAL_TOKENS // s})")
            ax.set_ylabel("fwd+bwd effective TFLOP/s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(files: list[str], out_dir: str) -> None:
    by_case, meta = {}, {}
    runs = []
    for f in files:
        with open(f) as fh:
            runs.append(json.load(fh))
    # a later run (by its recorded date) replaces an earlier measurement of the same case,
    # whatever order the files were named in
    for data in sorted(runs, key=lambda d: d["meta"].get("date", "")):
        for r in data["results"]:
            r.setdefault("kernel_version", data["meta"].get("kernel_version", "?"))
            by_case[(r["mask"], r["S"], r["D"], r["Hq"], r["Hk"])] = r
        for k, v in data["meta"].items():
            if k == "not_run":
                meta.setdefault(k, []).extend(v)
            elif k in ("command", "date"):
                meta[k] = (meta[k] + " ; " + v) if k in meta else v
            else:
                meta.setdefault(k, v)
    results = list(by_case.values())
    done = {(r["mask"], r["S"], r["D"], r["Hq"], r["Hk"]) for r in results}
    meta["not_run"] = sorted(set(x for x in meta.get("not_run", []) if tuple(json.loads(x)) not in done)) \
        if meta.get("not_run") else []
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernel.json"), "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    with open(os.path.join(out_dir, "kernel.md"), "w") as fh:
        fh.write(markdown(results, meta))
    plot(results, os.path.join(out_dir, "kernel.png"))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def compiled_kernels_report(path: str) -> None:
    """Registers, spills and HGMMA count of every Triton FlashMask kernel compiled in this
    process (the compiler's own report for the exact specialisations that were timed)."""
    import subprocess
    import tempfile

    import triton

    from flashmask3.kernels import tl_kernels as T

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows = []
    for name in ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel"):
        fn = getattr(T, name)
        for dev, cache in getattr(fn, "device_caches", {}).items():
            for key, ck in cache[0].items():
                try:
                    ck._init_handles()
                    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                        f.write(ck.asm["cubin"])
                    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
                    os.unlink(f.name)
                    consts = {k: v for k, v in ck.src.constants.items()} if hasattr(ck, "src") else {}
                    rows.append(dict(kernel=name, n_regs=ck.n_regs, n_spills=ck.n_spills,
                                     num_warps=ck.metadata.num_warps, num_stages=ck.metadata.num_stages,
                                     shared=ck.metadata.shared, hgmma=sass.count("HGMMA"),
                                     hmma=sass.count("HMMA"), ldl_stl=sass.count("LDL") + sass.count("STL"),
                                     key=str(key)[:400], constants=str(consts)[:400]))
                except Exception as exc:  # report what we can
                    rows.append(dict(kernel=name, error=f"{type(exc).__name__}: {exc}"[:300]))
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
    for r in rows:
        print("compiled", {k: r.get(k) for k in ("kernel", "n_regs", "n_spills", "num_warps", "num_stages",
                                                   "shared", "hgmma", "ldl_stl", "error")})


FINAL_PLAN = (
    [(m, 32768, 128, 32, 32) for m in MASKS]
    + [("causal_document_corpus", 32768, 128, 32, 8), ("causal", 32768, 128, 32, 8)]
    + [(m, 32768, d, 4096 // d, 4096 // d) for d in (64, 256) for m in ("causal_document_corpus", "causal")]
    + [(m, 8192, 128, 32, 32) for m in MASKS]
    + [(m, 131072, 128, 32, 32) for m in ("causal_document_corpus", "document_corpus", "sliding_window")]
)


def done_cases(paths) -> set[tuple]:
    """(mask, S, D, Hq, Hk) of every case measured in these benchmark JSON files."""
    done = set()
    for path in paths:
        with open(path) as fh:
            for rec in json.load(fh)["results"]:
                done.add((rec["mask"], rec["S"], rec["D"], rec["Hq"], rec["Hk"]))
    return done


def cases(args) -> list[tuple]:
    """(mask, S, D, Hq, Hk) in priority order: D=128 at 32K first, GQA, then 8K, then 128K."""
    if args.plan == "final":
        return list(FINAL_PLAN)
    out = []
    for d in args.dims:
        h = HIDDEN // d
        order = sorted(args.seqlens, key=lambda s: {32768: 0, 8192: 1, 131072: 2}.get(s, 3))
        for s in order:
            heavy_last = sorted(args.masks, key=lambda m: (s == 131072 and m in ("full", "causal")))
            for m in heavy_last:
                out.append((m, s, d, h, h))
            if d == 128 and args.gqa and s == 32768:
                for m in args.masks:
                    out.append((m, s, d, 32, 8))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="flashmask3 kernel benchmark")
    ap.add_argument("--dims", type=lambda x: [int(v) for v in x.split(",")], default=[128, 64, 256])
    ap.add_argument("--seqlens", type=lambda x: [int(v) for v in x.split(",")], default=[8192, 32768, 131072])
    ap.add_argument("--masks", type=lambda x: x.split(","), default=MASKS)
    ap.add_argument("--impls", type=lambda x: x.split(","),
                    default=["flashmask3", "flex", "sdpa_cudnn", "sdpa_flash", "varlen",
                             "sdpa_dense"])
    ap.add_argument("--no-gqa", dest="gqa", action="store_false")
    ap.add_argument("--dense-max-s", type=int, default=8192)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cases after this")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="part")
    ap.add_argument("--plan", default="grid", choices=["grid", "final"],
                    help="grid: --dims x --seqlens x --masks; final: the prioritised list FINAL_PLAN")
    ap.add_argument("--skip-done", nargs="*", default=[], metavar="JSON",
                    help="leave out the cases these earlier kernel_*.json files measured "
                         "(continue a run that its --budget-s cut short)")
    ap.add_argument("--kernel-version", default="v7.1")
    ap.add_argument("--timer", default="interleaved", choices=["interleaved", "sequential"],
                    help="interleaved: every implementation's calls alternate round by round "
                         "(since session 14); sequential: each implementation timed in turn")
    ap.add_argument("--report", nargs="*", help="JSON files to merge into kernel.{json,md,png}")
    args = ap.parse_args(argv)
    if args.report:
        report(args.report, args.out)
        return 0
    os.environ.setdefault("FLASHMASK3_BACKEND", "triton")  # here, not at import (tests import us)
    torch._dynamo.config.cache_size_limit = 256
    # measure() times the backward alone with retain_graph=True; a compiled backward that
    # donates its saved buffers refuses that (Flex at S=8K, session 6), and donation does not
    # change the kernels' time
    torch._functorch.config.donated_buffer = False
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    meta = dict(run_environment(torch.device("cuda")), dtype=args.dtype, not_run=[],
                kernel_version=args.kernel_version, timer=args.timer,
                kernels=os.environ.get("FLASHMASK3_KERNELS", "default"))
    try:
        __import__("torch.nn.attention.varlen")
        meta["varlen"] = "torch.nn.attention.varlen available"
    except ImportError:
        meta["varlen"] = "torch.nn.attention.varlen does not exist in this torch"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kernel_{args.tag}.json")
    results = []
    t_start = time.time()
    done = done_cases(args.skip_done)
    todo = [c for c in cases(args) if c not in done]
    for idx, (m, s, d, hq, hk) in enumerate(todo):
        if time.time() - t_start > args.budget_s:
            meta["not_run"] = [json.dumps(list(c)) for c in todo[idx:]]
            break
        t0 = time.time()
        rec = run_case(m, s, d, hq, hk, dtype, args)
        results.append(rec)
        fm = rec["impls"].get("flashmask3", {})
        fx = rec["impls"].get("flex", {})
        print(f"[{time.time() - t_start:6.0f}s] D={d} {hq}:{hk} {m:24s} S={s // 1024:3d}K "
              f"fm f/b/fb={_fmt(fm.get('fwd_ms'))}/{_fmt(fm.get('bwd_ms'))}/{_fmt(fm.get('fwd_bwd_ms'))} ms "
              f"TF={_fmt(fm.get('tflops_fwd'), '.0f')}/{_fmt(fm.get('tflops_fwd_bwd'), '.0f')} "
              f"flex fb={_fmt(fx.get('fwd_bwd_ms'))} x{_fmt(_speed(rec, 'flex'))} "
              f"{'; '.join(targets(rec))} ({time.time() - t0:.0f}s)"
              + (f" ERR {[(k, v['error'][:120]) for k, v in rec['impls'].items() if 'error' in v]}"
                 if any('error' in v for v in rec['impls'].values()) else ""), flush=True)
        with open(path, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
    with open(path, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    try:
        compiled_kernels_report(os.path.join(args.out, f"kernel_{args.tag}_compiled.json"))
    except Exception as exc:
        print("compiled-kernel report failed:", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
