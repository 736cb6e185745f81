"""Constructors for every mask type of docs/masks.md, from natural arguments.

Each returns a :class:`~flashmask3.masks.mask.FlashMask` with ``[B, Hm, S, C]`` int32 columns.
Document-style constructors accept either one list of document lengths (used for every batch
row) or one list per batch row. ``num_heads`` > 1 repeats the mask over mask heads (useful to
exercise per-head code paths; the kernels broadcast a single head for free).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .mask import FlashMask, mean_row_span

DocLens = Union[Sequence[int], Sequence[Sequence[int]]]


# -- helpers --------------------------------------------------------------------------------


def _check_positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _per_batch_doc_lens(doc_lens: DocLens, batch_size: Optional[int], name: str) -> list[list[int]]:
    """Normalise document lengths to one list per batch row and check them."""
    if isinstance(doc_lens, torch.Tensor):
        doc_lens = doc_lens.tolist()
    if not isinstance(doc_lens, (list, tuple)) or len(doc_lens) == 0:
        raise TypeError(f"{name} must be a non-empty list of ints or a list of lists of ints")
    nested = isinstance(doc_lens[0], (list, tuple))
    rows = [list(r) for r in doc_lens] if nested else [list(doc_lens)]
    if batch_size is not None:
        if nested and len(rows) != batch_size:
            raise ValueError(f"{name} has {len(rows)} rows but batch_size={batch_size}")
        if not nested:
            rows = rows * batch_size
    for r in rows:
        if not r:
            raise ValueError(f"{name}: every batch row needs at least one document")
        for n in r:
            _check_positive_int(f"{name} entries", n)
    totals = {sum(r) for r in rows}
    if len(totals) != 1:
        raise ValueError(f"{name}: every batch row must sum to the same sequence length, got {sorted(totals)}")
    return rows


def _doc_bounds(lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: start and end (exclusive) of the document that contains it."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    ends = torch.cumsum(lens_t, 0)
    starts = ends - lens_t
    return starts.repeat_interleave(lens_t), ends.repeat_interleave(lens_t)


def _finish(columns: list[torch.Tensor], causal: bool, num_heads: int, device) -> FlashMask:
    """Stack per-batch ``[S, C]`` column tensors into a FlashMask over ``num_heads`` heads,
    with its mean row span measured on the CPU columns (the kernels' tile hint)."""
    _check_positive_int("num_heads", num_heads)
    t = torch.stack(columns).to(torch.int32).unsqueeze(1)  # [B, 1, S, C]
    span = mean_row_span(t, causal, t.shape[2])  # (on one mask head: the others are copies)
    if num_heads > 1:
        t = t.expand(-1, num_heads, -1, -1)
    return _on_device(t, causal, device, span)


def _on_device(t: torch.Tensor, causal: bool, device, span: Optional[float] = None) -> FlashMask:
    """The FlashMask of CPU-built columns ``t`` (self-attention) on ``device``, with its mean
    row span measured on the CPU (``span``: already measured)."""
    if span is None:
        span = mean_row_span(t, causal, t.shape[2])
    # validated on the CPU (free), then moved: no device sync
    return FlashMask(t.contiguous(), causal, mean_row_span=span).to(device)


def _repeat(col: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    _check_positive_int("batch_size", batch_size)
    return [col] * batch_size


def _window_pair(window) -> tuple[int, int]:
    if isinstance(window, int) and not isinstance(window, bool):
        return _check_positive_int("window", window, allow_zero=True), None
    if isinstance(window, (tuple, list)) and len(window) == 2:
        wl = _check_positive_int("window[0]", window[0], allow_zero=True)
        wr = _check_positive_int("window[1]", window[1], allow_zero=True)
        return wl, wr
    raise TypeError(f"window must be an int or a (left, right) pair of ints, got {window!r}")


# -- basic masks ---------------------------------------------------------------------------


def full_mask(seqlen: int, *, batch_size: int = 1, num_heads: int = 1, device=None) -> FlashMask:
    """Every query sees every key (non-causal, ``[LTS=S, UTE=0]``)."""
    s = _check_positive_int("seqlen", seqlen)
    col = torch.stack([torch.full((s,), s), torch.zeros(s, dtype=torch.int64)], dim=-1)
    return _finish(_repeat(col, batch_size), False, num_heads, device)


def causal_mask(seqlen: int, *, batch_size: int = 1, num_heads: int = 1, device=None) -> FlashMask:
    """Plain causal attention (``LTS=S``; the diagonal comes from ``causal=True``)."""
    s = _check_positive_int("seqlen", seqlen)
    col = torch.full((s, 1), s)
    return _finish(_repeat(col, batch_size), True, num_heads, device)


def sliding_window_mask(
    seqlen: int, window, *, batch_size: int = 1, num_heads: int = 1, device=None
) -> FlashMask:
    """Sliding-window attention.

    ``window=w``: causal, query ``i`` sees keys ``[i - w, i]``.
    ``window=(wl, wr)``: two-sided, non-causal, query ``i`` sees keys ``[i - wl, i + wr]``.
    """
    s = _check_positive_int("seqlen", seqlen)
    wl, wr = _window_pair(window)
    j = torch.arange(s)
    lts = torch.clamp(j + wl + 1, max=s)
    if wr is None:
        return _finish(_repeat(lts.view(s, 1), batch_size), True, num_heads, device)
    ute = torch.clamp(j - wr, min=0)
    return _finish(_repeat(torch.stack([lts, ute], -1), batch_size), False, num_heads, device)


def causal_window_columns(columns: torch.Tensor, window: int) -> torch.Tensor:
    """Causal single-column (``LTS``) columns ``[..., S, 1]`` limited to a sliding window of
    ``window`` keys before the query: key ``j`` is also masked for rows ``j + window + 1`` on,
    so query ``i`` keeps only the keys ``[i - window, i]`` the columns allowed
    (:func:`sliding_window_mask`'s convention). Any device, no host read."""
    if columns.shape[-1] != 1:
        raise ValueError("a sliding window combines with causal single-column masks only, got "
                         f"{columns.shape[-1]} columns")
    window = _check_positive_int("window", window, allow_zero=True)
    sk = columns.shape[-2]
    j = torch.arange(sk, device=columns.device, dtype=torch.int64).view(sk, 1)
    return torch.minimum(columns.to(torch.int64), j + window + 1).to(torch.int32)


def with_window(mask: FlashMask, window: int) -> FlashMask:
    """``mask`` (causal, one column per key: causal, causal documents, ...) restricted to a
    sliding window: query ``i`` keeps only the keys ``[i - window, i]`` it was allowed."""
    if not isinstance(mask, FlashMask):
        raise TypeError(f"mask must be a FlashMask, got {type(mask).__name__}")
    if not mask.causal:
        raise ValueError("with_window needs a causal mask (a bidirectional one has no 'before the query')")
    cols = causal_window_columns(mask.startend_row_indices, window)
    return FlashMask(cols.contiguous(), True, mask.seqlen_q, _validated=True)


def pad_to(mask: FlashMask, seqlen: int) -> FlashMask:
    """``mask`` (self-attention) extended to ``seqlen`` tokens by padding at the end: every added
    key is masked for every row, so the real rows attend exactly as before. What the added rows
    attend is left unspecified (fully masked for causal documents; their outputs are finite):
    exclude them from the loss (``labels = -100``). For splitting a sequence evenly over
    context-parallel ranks (:func:`flashmask3.distributed.padded_seqlen`). On the mask's
    device, no host read."""
    if not isinstance(mask, FlashMask):
        raise TypeError(f"mask must be a FlashMask, got {type(mask).__name__}")
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(f"pad_to needs a self-attention mask, got {mask.seqlen_q} x {mask.seqlen_k}")
    old = mask.seqlen_k
    seqlen = _check_positive_int("seqlen", seqlen)
    if seqlen < old:
        raise ValueError(f"seqlen={seqlen} is shorter than the mask's {old} tokens")
    if seqlen == old:
        return mask
    cols = mask.startend_row_indices
    b, h, _, c = cols.shape
    j = torch.arange(old, seqlen, device=cols.device, dtype=torch.int32)
    zero, end = torch.zeros_like(j), torch.full_like(j, seqlen)
    # a fully masked key in each layout: causal [LTS] / [LTS, LTE] from the key's own row on,
    # bidirectional [LTS, UTE] / [LTS, LTE, UTS, UTE] from row 0
    parts = {(True, 1): (j,), (True, 2): (j, end), (False, 2): (zero, zero), (False, 4): (zero, end, zero, zero)}
    extra = torch.stack(parts[(mask.causal, c)], -1).view(1, 1, seqlen - old, c).expand(b, h, -1, -1)
    padded = torch.cat([cols, extra.to(cols.dtype)], dim=2).contiguous()
    return FlashMask(padded, mask.causal, seqlen, mask.mean_row_span, _validated=True)


# -- document masks ------------------------------------------------------------------------


def causal_document_mask(doc_lens: DocLens, *, batch_size: Optional[int] = None, num_heads: int = 1,
                         device=None) -> FlashMask:
    """Packed documents, causal inside each document (``LTS_j = end of j's document``)."""
    rows = _per_batch_doc_lens(doc_lens, batch_size, "doc_lens")
    cols = [_doc_bounds(r)[1].view(-1, 1) for r in rows]
    return _finish(cols, True, num_heads, device)


def document_mask(doc_lens: DocLens, *, batch_size: Optional[int] = None, num_heads: int = 1,
                  device=None) -> FlashMask:
    """Packed documents, bidirectional inside each document (``[LTS=end, UTE=start]``)."""
    rows = _per_batch_doc_lens(doc_lens, batch_size, "doc_lens")
    cols = []
    for r in rows:
        starts, ends = _doc_bounds(r)
        cols.append(torch.stack([ends, starts], -1))
    return _finish(cols, False, num_heads, device)


def from_cu_seqlens(cu_seqlens, *, causal: bool = True, num_heads: int = 1, device=None) -> FlashMask:
    """Document mask (batch 1) from varlen-style cumulative lengths ``[0, l0, l0+l1, ...]``."""
    cu = torch.as_tensor(cu_seqlens).to(torch.int64).flatten().cpu()
    if cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError("cu_seqlens must start with 0 and hold at least two entries")
    lens = cu[1:] - cu[:-1]
    if bool((lens <= 0).any()):
        raise ValueError("cu_seqlens must be strictly increasing")
    build = causal_document_mask if causal else document_mask
    return build(lens.tolist(), num_heads=num_heads, device=device)


def shared_question_mask(samples, *, seqlen: Optional[int] = None, batch_size: Optional[int] = None,
                         num_heads: int = 1, device=None) -> FlashMask:
    """Shared-question packing (DPO / reward models): a question followed by several answers.

    ``samples``: a list of ``(question_len, [answer_len, ...])`` per packed sample (or one such
    list per batch row). Each answer sees the question and itself (causally) but no other
    answer; the question's columns are visible to the whole sample. Tokens after the last
    sample (up to ``seqlen``) form one causal padding document.
    """
    if not isinstance(samples, (list, tuple)) or not samples:
        raise TypeError("samples must be a non-empty list of (question_len, [answer_lens]) pairs")
    per_batch = samples if isinstance(samples[0], (list, tuple)) and samples[0] and \
        isinstance(samples[0][0], (list, tuple)) else [samples]
    if batch_size is not None:
        if len(per_batch) == 1:
            per_batch = per_batch * batch_size
        elif len(per_batch) != batch_size:
            raise ValueError(f"samples has {len(per_batch)} batch rows but batch_size={batch_size}")
    cols = []
    for row in per_batch:
        lts = []
        for item in row:
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise TypeError("each sample must be a (question_len, [answer_lens]) pair")
            q_len, answers = item
            _check_positive_int("question_len", q_len)
            if not answers:
                raise ValueError("each sample needs at least one answer")
            for a in answers:
                _check_positive_int("answer length", a)
            start = len(lts)
            end = start + q_len + sum(answers)
            lts.extend([end] * q_len)
            a_start = start + q_len
            for a in answers:
                lts.extend([a_start + a] * a)
                a_start += a
        total = len(lts) if seqlen is None else _check_positive_int("seqlen", seqlen)
        if total < len(lts):
            raise ValueError(f"samples need {len(lts)} tokens, more than seqlen={total}")
        lts.extend([total] * (total - len(lts)))
        cols.append(torch.tensor(lts, dtype=torch.int64).view(-1, 1))
    if len({c.shape[0] for c in cols}) != 1:
        raise ValueError("every batch row must have the same length; pass seqlen to pad")
    return _finish(cols, True, num_heads, device)


def global_sliding_window_mask(seqlen: int, num_global: int, window, *, batch_size: int = 1,
                               num_heads: int = 1, device=None) -> FlashMask:
    """Global + sliding window (Longformer/BigBird style), non-causal, C=4.

    The first ``num_global`` tokens see and are seen by everything; every other query ``i``
    sees the global tokens and the keys ``[i - wl, i + wr]`` (``window`` = w or (wl, wr)).
    """
    s = _check_positive_int("seqlen", seqlen)
    g = _check_positive_int("num_global", num_global, allow_zero=True)
    if g > s:
        raise ValueError(f"num_global={g} exceeds seqlen={s}")
    wl, wr = _window_pair(window)
    wr = wl if wr is None else wr
    j = torch.arange(s)
    is_global = j < g
    lts = torch.where(is_global, s, torch.clamp(j + wl + 1, max=s))
    lte = torch.full((s,), s)
    uts = torch.where(is_global, 0, torch.full((s,), g))
    ute = torch.where(is_global, 0, torch.clamp(j - wr, min=g))
    col = torch.stack([lts, lte, uts, ute], -1)
    return _finish(_repeat(col, batch_size), False, num_heads, device)


def causal_blockwise_mask(block_lens: DocLens, *, batch_size: Optional[int] = None,
                          num_heads: int = 1, device=None) -> FlashMask:
    """In-context-learning blocks: each block is causal on its own; the last block sees all.

    ``block_lens``: lengths of the demonstration blocks followed by the final (test) block.
    Causal, C=2: a demonstration column is masked for the rows of later demonstrations,
    ``[LTS=end of its block, LTE=start of the last block)``.
    """
    rows = _per_batch_doc_lens(block_lens, batch_size, "block_lens")
    cols = []
    for r in rows:
        s = sum(r)
        _, ends = _doc_bounds(r)
        last_start = s - r[-1]
        lte = torch.full((s,), last_start)
        lts = torch.where(torch.arange(s) < last_start, ends, s)
        lte = torch.where(torch.arange(s) < last_start, lte, s)
        cols.append(torch.stack([lts, lte], -1))
    return _finish(cols, True, num_heads, device)


def prefix_lm_mask(seqlen: int, prefix_len: int, *, batch_size: int = 1, num_heads: int = 1,
                   device=None) -> FlashMask:
    """Prefix LM: bidirectional over the first ``prefix_len`` tokens, causal after them."""
    return prefix_document_mask([seqlen], [prefix_len], batch_size=batch_size, num_heads=num_heads,
                                device=device)


def prefix_document_mask(doc_lens: DocLens, prefix_lens: DocLens, *, batch_size: Optional[int] = None,
                         num_heads: int = 1, device=None) -> FlashMask:
    """Packed prefix-LM documents: per document, the prefix is bidirectional, the rest causal.

    Non-causal, C=2: ``LTS_j = end of the document``, ``UTE_j = document start`` for prefix
    columns and ``j`` itself otherwise.
    """
    rows = _per_batch_doc_lens(doc_lens, batch_size, "doc_lens")
    if isinstance(prefix_lens, torch.Tensor):
        prefix_lens = prefix_lens.tolist()
    prows = [list(p) for p in prefix_lens] if prefix_lens and isinstance(prefix_lens[0], (list, tuple)) \
        else [list(prefix_lens)] * len(rows)
    if len(prows) != len(rows):
        raise ValueError(f"prefix_lens has {len(prows)} rows, doc_lens has {len(rows)}")
    cols = []
    for r, p in zip(rows, prows):
        if len(p) != len(r):
            raise ValueError(f"prefix_lens needs one entry per document ({len(r)}), got {len(p)}")
        for n, pl in zip(r, p):
            _check_positive_int("prefix_lens entries", pl, allow_zero=True)
            if pl > n:
                raise ValueError(f"prefix length {pl} exceeds its document length {n}")
        starts, ends = _doc_bounds(r)
        plen = torch.tensor(p, dtype=torch.int64).repeat_interleave(torch.tensor(r))
        j = torch.arange(sum(r))
        ute = torch.where(j < starts + plen, starts, j)
        cols.append(torch.stack([ends, ute], -1))
    return _finish(cols, False, num_heads, device)


# -- per-head sparse masks -------------------------------------------------------------------


def _as_ranges(ranges, batch_size: int, num_heads: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(ranges, dtype=torch.int64)
    if t.shape != (batch_size, num_heads, 2):
        raise ValueError(f"{name} must have shape [batch_size, num_heads, 2], got {tuple(t.shape)}")
    return t


def qk_sparse_mask(seqlen: int, query_ranges, key_ranges, *, device=None) -> FlashMask:
    """QK-sparse attention: per (batch, head) a range of queries and a range of keys is dropped.

    ``query_ranges``/``key_ranges``: ``[B, H, 2]`` half-open ``[start, end)`` ranges (empty
    when start == end). Dropped queries see nothing (their rows output zeros), dropped keys are
    seen by no query; everything else is causal. Causal, C=2.
    """
    s = _check_positive_int("seqlen", seqlen)
    qr = torch.as_tensor(query_ranges, dtype=torch.int64)
    if qr.dim() != 3 or qr.shape[-1] != 2:
        raise ValueError(f"query_ranges must have shape [batch_size, num_heads, 2], got {tuple(qr.shape)}")
    b, h = qr.shape[:2]
    kr = _as_ranges(key_ranges, b, h, "key_ranges")
    for name, r in (("query_ranges", qr), ("key_ranges", kr)):
        if bool((r < 0).any()) or bool((r > s).any()) or bool((r[..., 0] > r[..., 1]).any()):
            raise ValueError(f"{name} must hold ranges 0 <= start <= end <= seqlen={s}")
    j = torch.arange(s).view(1, 1, s)
    key_dropped = (j >= kr[..., :1]) & (j < kr[..., 1:])
    lts = torch.where(key_dropped, 0, qr[..., :1].expand(b, h, s))
    lte = torch.where(key_dropped, s, qr[..., 1:].expand(b, h, s))
    t = torch.stack([lts, lte], -1).to(torch.int32)
    return _on_device(t, True, device)


def random_eviction_mask(seqlen: int, *, batch_size: int = 1, num_heads: int = 1, seed: int = 0,
                         device=None) -> FlashMask:
    """Random KV eviction: key ``j`` is evicted at a random step ``t_j`` in ``(j, S]``.

    Queries at or after ``t_j`` no longer see key ``j``. Causal, C=1, different per (b, h).
    """
    s = _check_positive_int("seqlen", seqlen)
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("num_heads", num_heads)
    gen = torch.Generator().manual_seed(seed)
    j = torch.arange(s)
    span = (s - j).to(torch.float64)  # choices j+1 .. s
    u = torch.rand(batch_size, num_heads, s, generator=gen, dtype=torch.float64)
    lts = j + 1 + torch.floor(u * span).to(torch.int64)
    t = lts.clamp(max=s).unsqueeze(-1).to(torch.int32)
    return _on_device(t, True, device)


def random_document_lengths(total: int, mean_len: int, *, min_len: int = 1, seed: int = 0) -> list[int]:
    """Document lengths summing to ``total``, exponentially spread around ``mean_len``.

    A reproducible stand-in for real packing, used by tests, demos and benchmarks.
    """
    _check_positive_int("total", total)
    _check_positive_int("mean_len", mean_len)
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    remaining = total
    while remaining > 0:
        n = int(torch.empty(1, dtype=torch.float64).exponential_(1.0 / mean_len, generator=gen)) + min_len
        n = min(n, remaining)
        lens.append(n)
        remaining -= n
    return lens
