"""Shared test inputs: random column masks drawn per column and every named mask type; a
wall-clock stand-in for the benchmarks' CUDA-event timer."""

from __future__ import annotations

import time

import torch

import flashmask3.masks as M

#: Every valid (causal, C) row of the column-mask table in docs/masks.md.
LAYOUTS = [(True, 1), (True, 2), (False, 2), (False, 4)]


def random_columns(batch, heads, seqlen_q, seqlen_k, causal, c, *, seed=0, device="cpu"):
    """Random valid ``[B, Hm, Sk, C]`` int32 columns, each column drawn independently.

    Intervals are drawn as sorted pairs of row indices in ``[0, Sq]`` so that every column
    has a genuine (possibly empty or full) masked interval; about one column in eight masks
    everything so fully masked rows and tiles show up.
    """
    g = torch.Generator().manual_seed(seed)

    def pair():
        a = torch.randint(0, seqlen_q + 1, (batch, heads, seqlen_k), generator=g)
        b = torch.randint(0, seqlen_q + 1, (batch, heads, seqlen_k), generator=g)
        return torch.minimum(a, b), torch.maximum(a, b)

    lo, hi = pair()
    if causal and c == 1:
        cols = [lo]
    elif causal and c == 2:
        full = torch.rand(batch, heads, seqlen_k, generator=g) < 0.125
        cols = [torch.where(full, 0, lo), torch.where(full, seqlen_q, hi)]
    elif not causal and c == 2:
        # [UTE, LTS) is the visible band: LTS >= UTE usually, sometimes crossed (all masked).
        crossed = torch.rand(batch, heads, seqlen_k, generator=g) < 0.125
        cols = [torch.where(crossed, lo, hi), torch.where(crossed, hi, lo)]
    else:
        lo2, hi2 = pair()
        cols = [lo, hi, lo2, hi2]
    t = torch.stack(cols, -1).to(torch.int32)
    return t.to(device)


def named_masks(seqlen, *, batch_size=1, num_heads=1):
    """One instance of every mask type of docs/masks.md at length ``seqlen`` (>= 16)."""
    s = seqlen
    docs = M.random_document_lengths(s, max(2, s // 5), seed=s)
    third = max(1, s // 3)
    g = torch.Generator().manual_seed(s)
    qr = torch.sort(torch.randint(0, s + 1, (batch_size, num_heads, 2), generator=g), -1).values
    kr = torch.sort(torch.randint(0, s + 1, (batch_size, num_heads, 2), generator=g), -1).values
    kw = dict(num_heads=num_heads)
    return {
        "full": M.full_mask(s, batch_size=batch_size, **kw),
        "causal": M.causal_mask(s, batch_size=batch_size, **kw),
        "sliding_window": M.sliding_window_mask(s, max(1, s // 4), batch_size=batch_size, **kw),
        "sliding_window_two_sided": M.sliding_window_mask(s, (max(1, s // 4), max(1, s // 6)),
                                                          batch_size=batch_size, **kw),
        "causal_document": M.causal_document_mask(docs, batch_size=batch_size, **kw),
        "document": M.document_mask(docs, batch_size=batch_size, **kw),
        "shared_question": M.shared_question_mask(
            [(third // 2 + 1, [third // 3 + 1, third // 4 + 1]), (2, [3, 1])], seqlen=s,
            batch_size=batch_size, **kw),
        "global_sliding_window": M.global_sliding_window_mask(s, 3, max(1, s // 8),
                                                              batch_size=batch_size, **kw),
        "causal_blockwise": M.causal_blockwise_mask([third, third, s - 2 * third],
                                                    batch_size=batch_size, **kw),
        "prefix_lm": M.prefix_lm_mask(s, third, batch_size=batch_size, **kw),
        "prefix_document": M.prefix_document_mask(docs, [n // 2 for n in docs],
                                                  batch_size=batch_size, **kw),
        "qk_sparse": M.qk_sparse_mask(s, qr, kr),
        "random_eviction": M.random_eviction_mask(s, batch_size=batch_size, num_heads=num_heads, seed=s),
    }


def gpu_masks(s):
    """The GPU tests' masks at length ``s``: name -> (FlashMask or None, causal for None)."""
    docs = M.random_document_lengths(s, max(64, s // 8), seed=s)
    return {
        "causal": (None, True),
        "full": (None, False),
        "causal_document": (M.causal_document_mask(docs), None),
        "document": (M.document_mask(docs), None),
        "sliding_window": (M.sliding_window_mask(s, s // 8), None),
        "global_sliding_window": (M.global_sliding_window_mask(s, 64, s // 16), None),
        "causal_blockwise": (M.causal_blockwise_mask([s // 4, s // 4, s // 2]), None),
        "prefix_lm": (M.prefix_lm_mask(s, s // 3), None),
    }


def wall_ms(fn, grad_to_none=None):
    """The benchmarks' ``bench`` contract on the CPU: (milliseconds of one call, method)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, "wall"


def benchmark_on_cpu(monkeypatch, module, total_tokens: int) -> None:
    """Point a benchmark script (``benchmarks/<script>.py`` imported as ``module``) at the CPU
    for a test: its DEVICE, its TOTAL_TOKENS (the batch it builds) and its timer (:func:`wall_ms`)."""
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "TOTAL_TOKENS", total_tokens)
    monkeypatch.setattr(module, "bench", wall_ms)


def logged(out_dir, column: str = "loss") -> list[float]:
    """One column (``loss``, ``lr``, ``grad_norm``, ...) of the ``losses.csv`` a training run of
    ``flashmask3.train`` wrote to ``out_dir``, one value per step."""
    from pathlib import Path

    header, *rows = (Path(out_dir) / "losses.csv").read_text().splitlines()
    i = header.split(",").index(column)
    return [float(row.split(",")[i]) for row in rows]
