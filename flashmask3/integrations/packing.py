"""Mask columns of packed and padded batches, built on the device from per-token metadata.

The constructors in :mod:`flashmask3.masks` build columns on the CPU from Python lists of
document lengths. A training loop that packs documents already has that information on the
device, as varlen ``cu_seqlens``, as ``position_ids`` that restart at each document, or as a
padding ``attention_mask``; turning it into lists would cost a device-to-host copy (a sync)
per batch. The functions here are pure tensor ops (searchsorted, cumulative max/min,
comparisons): no ``.item()``, no ``.tolist()``, nothing whose size depends on the values, so
they run without a host sync on any device and trace under ``torch.compile``.

Every function returns per-key ``[B, S]`` int64 document bounds or int32 ``[B, 1, S, C]``
columns in the layout of docs/masks.md (causal: ``C=1``, ``LTS`` = first masked row below
the diagonal; bidirectional: ``C=2``, ``[LTS, UTE]``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..masks import causal_window_columns


def document_bounds_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` of each token's document, ``[B, S]`` int64, from ``position_ids``.

    A new document begins wherever the position does not grow by exactly one (the rule of
    transformers' packed-sequence detection), so positions restarting at 0 (or at any
    ``position_ids_start``) split documents and a plain ``arange`` is one document.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        raise ValueError("position_ids must be a [batch, seqlen] tensor, got "
                         f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
    b, s = position_ids.shape
    t = torch.arange(s, device=position_ids.device).expand(b, s)
    starts_here = torch.ones_like(position_ids, dtype=torch.bool)
    starts_here[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1]) != 1
    start = torch.where(starts_here, t, 0).cummax(dim=1).values
    # end of a token's document = the first document start after it (or S)
    next_start = torch.full_like(t, s)
    next_start[:, :-1] = torch.where(starts_here[:, 1:], t[:, 1:], s)
    end = next_start.flip(1).cummin(dim=1).values.flip(1)
    return start, end


def document_bounds_from_cu_seqlens(cu_seqlens: torch.Tensor, batch_size: int,
                                    seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` of each token's document, ``[B, S]`` int64, from varlen boundaries.

    ``cu_seqlens`` (``[0, l0, l0+l1, ...]``, the flash-attention varlen convention) counts over
    the ``B * S`` tokens of the batch laid end to end, as ``DataCollatorWithFlattening``
    produces for ``B = 1``. Bounds are clipped to the token's batch row; tokens after the last
    boundary form one document (trailing padding of a fixed-size buffer).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [0, l0, l0+l1, ...] with at least two "
                         f"entries, got {getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}")
    cu = cu_seqlens.to(torch.int64)
    total = batch_size * seqlen
    flat = torch.arange(total, device=cu.device)
    # the tail after the last boundary is one document ending at the end of the batch
    bounds = torch.cat([cu, torch.full((1,), total, dtype=torch.int64, device=cu.device)])
    idx = torch.searchsorted(bounds, flat, right=True)
    start, end = bounds[idx - 1], bounds[idx.clamp(max=bounds.numel() - 1)]
    row0 = (flat // seqlen) * seqlen
    start = (start - row0).clamp(0, seqlen).view(batch_size, seqlen)
    end = (end - row0).clamp(0, seqlen).view(batch_size, seqlen)
    return start, end


def document_columns(start: torch.Tensor, end: torch.Tensor, causal: bool) -> torch.Tensor:
    """Columns ``[B, 1, S, C]`` (int32) of documents with per-key bounds ``start``/``end``:
    causal inside each document (``C=1``, ``LTS = end``) or bidirectional (``C=2``,
    ``LTS = end``, ``UTE = start``)."""
    cols = end.unsqueeze(-1) if causal else torch.stack([end, start], dim=-1)
    return cols.to(torch.int32).unsqueeze(1)


def with_sliding_window(columns: torch.Tensor, window: int) -> torch.Tensor:
    """Causal ``C=1`` columns restricted to a sliding window: query ``i`` sees key ``j`` only if
    ``i - j < window`` (transformers' ``sliding_window`` convention: ``window`` keys, the query's
    own included; :func:`~flashmask3.masks.causal_window_columns` counts the keys before it)."""
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return causal_window_columns(columns, window - 1)


def with_key_padding(columns: torch.Tensor, causal: bool, keep: torch.Tensor,
                     seqlen_q: int) -> torch.Tensor:
    """The same columns with every key where ``keep [B, S]`` is False masked for all rows.

    Works for every layout: the first masked interval of a padding key becomes ``[0, Sq)``
    (``LTS = 0``, and ``LTE = Sq`` where the layout stores an end for it).
    """
    b, hm, sk, c = columns.shape
    if keep.shape != (b, sk) and keep.shape != (1, sk):
        raise ValueError(f"the padding mask must be [batch, seqlen_k] = [{b}, {sk}], got "
                         f"{tuple(keep.shape)}")
    pad = ~keep.to(torch.bool).view(-1, 1, sk)
    cols = columns.expand(max(b, keep.shape[0]), hm, sk, c).clone()
    cols[..., 0] = cols[..., 0].masked_fill(pad, 0)
    if (causal and c == 2) or (not causal and c == 4):
        cols[..., 1] = cols[..., 1].masked_fill(pad, seqlen_q)
    return cols


def packed_columns(batch_size: int, seqlen: int, device, *, causal: bool = True,
                   cu_seqlens: Optional[torch.Tensor] = None,
                   position_ids: Optional[torch.Tensor] = None,
                   key_padding: Optional[torch.Tensor] = None,
                   sliding_window: Optional[int] = None) -> torch.Tensor:
    """Columns ``[B, 1, S, C]`` of a packed and/or padded batch, on ``device``, without a sync.

    Documents come from ``cu_seqlens`` if given, else from ``position_ids`` (see
    :func:`document_bounds_from_position_ids`), else the whole row is one document.
    ``key_padding`` (``[B, S]``, True/1 = real token) masks padding keys; ``sliding_window``
    limits each query to its last ``sliding_window`` keys (causal only).
    """
    if cu_seqlens is not None:
        start, end = document_bounds_from_cu_seqlens(cu_seqlens.to(device), batch_size, seqlen)
    elif position_ids is not None:
        start, end = document_bounds_from_position_ids(position_ids.to(device).expand(batch_size, seqlen))
    else:
        start = torch.zeros(batch_size, seqlen, dtype=torch.int64, device=device)
        end = torch.full_like(start, seqlen)
    cols = document_columns(start, end, causal)
    if sliding_window is not None:
        if not causal:
            raise ValueError("sliding_window with bidirectional attention is not supported")
        cols = with_sliding_window(cols, sliding_window)
    if key_padding is not None:
        cols = with_key_padding(cols, causal, key_padding.to(device), seqlen)
    return cols.contiguous()
