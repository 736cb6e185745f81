"""The column-wise sparse mask (FlashMask representation) and its exact accounting.

A mask is an int32 tensor ``startend_row_indices`` of shape ``[B, Hm, Sk, C]`` plus a
``causal`` flag. Each key column ``j`` stores up to two half-open intervals of query rows that
are masked (docs/masks.md). Memory is O(Sk), whatever the mask.

This module is the single home of
* the validation of that tensor (:func:`validate_startend_row_indices`),
* the column semantics as intervals (:func:`masked_row_intervals`),
* the unmasked-pair count and hence the FLOP count (:func:`unmasked_pairs`,
  :func:`attention_flops`),
* the dense boolean expansion used by tests and debugging (:func:`to_dense`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

#: Allowed number of column vectors for each value of ``causal`` (docs/masks.md, the layout table).
ALLOWED_COLUMNS = {True: (1, 2), False: (2, 4)}

#: Names of the column vectors, per (causal, C).
COLUMN_NAMES = {
    (True, 1): ("LTS",),
    (True, 2): ("LTS", "LTE"),
    (False, 2): ("LTS", "UTE"),
    (False, 4): ("LTS", "LTE", "UTS", "UTE"),
}

#: FLOP multipliers relative to the forward pass (docs/masks.md, FLOP convention).
_FLOP_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def validate_startend_row_indices(
    startend_row_indices: torch.Tensor,
    *,
    causal: bool,
    batch_size: int,
    seqlen_q: int,
    seqlen_k: int,
    num_heads: Optional[int] = None,
    check_values: bool = True,
    device: Optional[torch.device] = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` unless the mask tensor is valid per docs/masks.md.

    ``num_heads`` is the number of query heads (the mask's head dimension must divide it).
    ``device``: the device the tensor must be on (that of q), checked before anything reads it.
    ``check_values`` reads the tensor's min/max: free on a CPU tensor, one device sync on a GPU
    tensor, so :func:`flashmask3.flashmask_attention` asks for it only on CPU tensors (or with
    ``FLASHMASK3_CHECK_MASK_VALUES=1``); values outside ``[0, seqlen_q]`` that reach the kernels
    unchecked act as if clamped to it (docs/host-path.md). Never on ``meta`` tensors.
    """
    name = "startend_row_indices"
    if not isinstance(startend_row_indices, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(startend_row_indices).__name__}")
    if device is not None and startend_row_indices.device != torch.device(device):
        raise ValueError(f"{name} is on {startend_row_indices.device} but must be on {device} "
                         "(the device of q)")
    if startend_row_indices.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {startend_row_indices.dtype}")
    if startend_row_indices.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D [batch, mask_heads, seqlen_k, C], got shape "
            f"{tuple(startend_row_indices.shape)}"
        )
    b, hm, sk, c = startend_row_indices.shape
    allowed = ALLOWED_COLUMNS[bool(causal)]
    if c not in allowed:
        raise ValueError(
            f"{name} has C={c} columns, but causal={bool(causal)} requires C in {allowed} "
            "(causal: LTS or LTS,LTE; non-causal: LTS,UTE or LTS,LTE,UTS,UTE)"
        )
    if b != batch_size:
        raise ValueError(f"{name} batch dimension is {b}, expected {batch_size} (the batch of q)")
    if sk != seqlen_k:
        raise ValueError(f"{name} dimension 2 is {sk}, expected seqlen_k={seqlen_k} (one entry per key)")
    if num_heads is not None and (hm < 1 or num_heads % hm != 0):
        raise ValueError(
            f"{name} has {hm} mask heads, which must divide the {num_heads} query heads "
            "(use 1, the number of KV heads, or the number of query heads)"
        )
    if check_values and startend_row_indices.numel() > 0 and startend_row_indices.device.type != "meta":
        lo = int(startend_row_indices.min())
        hi = int(startend_row_indices.max())
        if lo < 0 or hi > seqlen_q:
            raise ValueError(
                f"{name} values must lie in [0, seqlen_q={seqlen_q}], got values in [{lo}, {hi}]"
            )


def masked_row_intervals(columns: torch.Tensor, causal: bool, seqlen_q: int):
    """Return the masked row intervals ``[(start, end), ...]`` of each column.

    ``columns`` is ``[..., C]`` (any integer dtype); each start/end has shape ``[...]``. The
    causal diagonal is *not* included (callers add it: it depends on the row and column).
    """
    c = columns.shape[-1]
    cols = [columns[..., i] for i in range(c)]
    full = torch.full_like(cols[0], seqlen_q)
    zero = torch.zeros_like(cols[0])
    if causal and c == 1:
        return [(cols[0], full)]
    if causal and c == 2:
        return [(cols[0], cols[1])]
    if not causal and c == 2:
        return [(cols[0], full), (zero, cols[1])]
    if not causal and c == 4:
        return [(cols[0], cols[1]), (cols[2], cols[3])]
    raise ValueError(f"unsupported mask layout causal={causal}, C={c}")


def _overlap(a0, a1, b0, b1):
    """Length of the intersection of half-open intervals [a0, a1) and [b0, b1), elementwise."""
    return (torch.minimum(a1, b1) - torch.maximum(a0, b0)).clamp_min(0)


def unmasked_pairs(
    startend_row_indices: Optional[torch.Tensor],
    causal: bool,
    seqlen_q: int,
    seqlen_k: Optional[int] = None,
    *,
    per_head: bool = False,
) -> torch.Tensor | int:
    """Exact number of unmasked (query, key) pairs, computed in O(Sk) without a dense mask.

    Returns the total over batch and mask heads (an ``int``), or with ``per_head=True`` a
    ``[B, Hm]`` int64 tensor. ``None`` means full attention (or plain causal with ``causal``).
    """
    if startend_row_indices is None:
        if seqlen_k is None:
            raise ValueError("seqlen_k is required when startend_row_indices is None")
        offset = seqlen_k - seqlen_q
        if not causal:
            total = seqlen_q * seqlen_k
        else:
            j = torch.arange(seqlen_k, dtype=torch.int64)
            total = int((seqlen_q - (j - offset).clamp(0, seqlen_q)).sum())
        return torch.tensor([[total]], dtype=torch.int64) if per_head else total
    # int32 elementwise (every bound and per-column count is <= max(Sq, Sk) < 2^31): half the
    # memory traffic of int64 on the CPU, where the constructors count their masks' pairs
    cols = startend_row_indices.to(torch.int32)
    sk = cols.shape[2]
    offset = sk - seqlen_q
    j = torch.arange(sk, dtype=torch.int32, device=cols.device)
    base_start = (j - offset).clamp(0, seqlen_q) if causal else torch.zeros_like(j)
    base_start = base_start.expand(cols.shape[:3])
    base_end = torch.full_like(base_start, seqlen_q)
    live = (base_end - base_start).clamp_min(0)
    intervals = masked_row_intervals(cols, causal, seqlen_q)
    # |base ∩ (I1 ∪ I2)| = |base ∩ I1| + |base ∩ I2| - |base ∩ I1 ∩ I2|
    s1, e1 = intervals[0]
    s1 = torch.maximum(s1, base_start)
    e1 = torch.minimum(e1, base_end)
    masked = _overlap(s1, e1, base_start, base_end)
    if len(intervals) == 2:
        s2, e2 = intervals[1]
        s2 = torch.maximum(s2, base_start)
        e2 = torch.minimum(e2, base_end)
        masked = masked + _overlap(s2, e2, base_start, base_end) - _overlap(s1, e1, s2, e2)
    per_bh = (live - masked).sum(dim=2, dtype=torch.int64)
    return per_bh if per_head else int(per_bh.sum())


def attention_flops(
    startend_row_indices: Optional[torch.Tensor],
    causal: bool,
    *,
    batch_size: int,
    num_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    mode: str = "fwd",
) -> float:
    """Effective attention FLOPs by the convention of docs/masks.md.

    forward = ``4 · D · Σ_{b, query head} unmasked pairs``; backward 2.5×, fwd+bwd 3.5×.
    The one place in the project where this number is computed.
    """
    if mode not in _FLOP_MODE_FACTOR:
        raise ValueError(f"mode must be one of {sorted(_FLOP_MODE_FACTOR)}, got {mode!r}")
    if startend_row_indices is None:
        pairs = unmasked_pairs(None, causal, seqlen_q, seqlen_k) * batch_size * num_heads
    else:
        hm = startend_row_indices.shape[1]
        pairs = unmasked_pairs(startend_row_indices, causal, seqlen_q) * (num_heads // hm)
    return 4.0 * head_dim * pairs * _FLOP_MODE_FACTOR[mode]


def element_mask(
    columns: torch.Tensor,
    causal: bool,
    rows: torch.Tensor,
    cols: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
) -> torch.Tensor:
    """Boolean *allowed* mask for the given query rows and key columns.

    ``columns``: ``[..., n_cols, C]`` column vectors of the key columns ``cols`` (1-D, length
    ``n_cols``); ``rows``: 1-D query rows. Returns ``[..., n_rows, n_cols]``, True = attend.
    This is the element-wise rule of docs/masks.md, shared by the dense expansion and the
    partial-tile path of the torch backend.
    """
    i = rows.view(-1, 1).to(torch.int64)
    # few full-size ops: the CPU path builds a block's additive mask from this on every call
    masked = None  # masked_row_intervals gives at least one interval (or raises)
    for start, end in masked_row_intervals(columns.to(torch.int64), causal, seqlen_q):
        piece = (i >= start.unsqueeze(-2)).logical_and_(i < end.unsqueeze(-2))
        masked = piece if masked is None else masked.logical_or_(piece)
    if causal:
        masked.logical_or_(cols.view(1, -1).to(torch.int64) > i + (seqlen_k - seqlen_q))
    return masked.logical_not_()


def to_dense(
    startend_row_indices,
    causal: Optional[bool] = None,
    seqlen_q: Optional[int] = None,
    seqlen_k: Optional[int] = None,
) -> torch.Tensor:
    """Expand to a dense boolean ``[B, Hm, Sq, Sk]`` mask (True = attend). O(S²): tests only.

    Two call forms: ``to_dense(mask)`` with a :class:`FlashMask` (which brings its ``causal``
    and ``seqlen_q``; the same as ``mask.to_dense()``), or ``to_dense(columns, causal,
    seqlen_q[, seqlen_k])`` with a raw ``[B, Hm, Sk, C]`` column tensor (or ``None`` for no
    mask, then ``seqlen_k`` is required)."""
    if isinstance(startend_row_indices, FlashMask):
        mask = startend_row_indices
        if causal is not None and causal != mask.causal:
            raise ValueError(f"causal={causal} conflicts with the FlashMask's causal={mask.causal}")
        if seqlen_q is not None and seqlen_q != mask.seqlen_q:
            raise ValueError(f"seqlen_q={seqlen_q} conflicts with the FlashMask's {mask.seqlen_q}")
        return to_dense(mask.startend_row_indices, mask.causal, mask.seqlen_q, seqlen_k)
    if causal is None or seqlen_q is None:
        raise TypeError("to_dense(columns, causal, seqlen_q): causal and seqlen_q are required "
                        "with a column tensor (or pass a FlashMask)")
    if startend_row_indices is None:
        if seqlen_k is None:
            raise ValueError("seqlen_k is required when startend_row_indices is None")
        rows = torch.arange(seqlen_q).view(-1, 1)
        cols = torch.arange(seqlen_k).view(1, -1)
        allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
        if causal:
            allowed = cols <= rows + (seqlen_k - seqlen_q)
        return allowed.view(1, 1, seqlen_q, seqlen_k)
    sk = startend_row_indices.shape[2]
    dev = startend_row_indices.device
    return element_mask(
        startend_row_indices,
        causal,
        torch.arange(seqlen_q, device=dev),
        torch.arange(sk, device=dev),
        seqlen_q,
        sk,
    )


def mean_row_span(startend_row_indices: torch.Tensor, causal: bool, seqlen_q: int) -> float:
    """Mean number of keys a query row attends, over batch, mask heads and rows (from
    :func:`unmasked_pairs`; one device-to-host copy on a GPU tensor)."""
    b, hm = startend_row_indices.shape[:2]
    rows = b * hm * seqlen_q
    return unmasked_pairs(startend_row_indices, causal, seqlen_q) / rows if rows else 0.0


#: Buckets per octave of :attr:`FlashMask.row_span_bucket`.
ROW_SPAN_BUCKETS_PER_OCTAVE = 2


def row_span_bucket(span: float) -> int:
    """The half octave a mean row span falls in: floor(2 * log2(max(span, 1)))."""
    return math.floor(ROW_SPAN_BUCKETS_PER_OCTAVE * math.log2(max(float(span), 1.0)))


def row_span_of_bucket(bucket: int) -> float:
    """The lower edge of a :func:`row_span_bucket` bucket (2 ** (bucket / 2)): a span the
    kernels compare with their thresholds, which sit on bucket edges."""
    return 2.0 ** (bucket / ROW_SPAN_BUCKETS_PER_OCTAVE)


#: The attribute of a FlashMask's columns tensor that holds its row-span hint, for the traced
#: attention op, which takes no CPU tensor (inductor's CUDA graphs fail on a CPU tensor input of
#: a recorded graph) and no Python float (tracing would specialise on it, a recompile per
#: bucket). On the tensor, it lives exactly as long as the columns (as static masks' plans do).
ROW_SPAN_ATTR = "_flashmask3_row_span"


def row_span_of_columns(cols: Optional[torch.Tensor]) -> Optional[float]:
    """The row-span hint (the lower edge of :attr:`FlashMask.row_span_bucket`) of the FlashMask built on
    this very columns tensor outside tracing, or None: how the traced attention op finds a
    FlashMask's tile hint (under ``torch.compile`` the op receives the same tensor object; where
    it receives a copy, as in a CUDA graph's replay buffer, it gets None and the default tiles,
    which are as correct)."""
    return None if cols is None else getattr(cols, ROW_SPAN_ATTR, None)


@dataclass(frozen=True)
class FlashMask:
    """A column-wise sparse attention mask: ``startend_row_indices`` + ``causal``.

    Built by the constructors in :mod:`flashmask3.masks.constructors`; pass it as the fourth
    argument of :func:`flashmask3.flashmask_attention` (it brings its own ``causal``).
    ``seqlen_q`` defaults to the key length (self-attention).

    ``mean_row_span``: the mean number of keys a query row attends (over batch, mask heads and
    rows), known on the host. The constructors set it (they build the columns on the CPU); the
    Triton forward uses it to pick a smaller query tile for masks whose rows see few keys
    (short documents: NOTES.md session 16). ``None`` (a mask built from a tensor) keeps the
    default tiles; :meth:`with_row_span` measures it (one device-to-host copy). What the kernels
    see is :attr:`row_span_bucket`, the span rounded down to a half octave; under
    ``torch.compile`` the attention op finds it through :func:`row_span_of_columns` (registered
    for the columns tensor here), so a new mask of the same shape reuses the compiled graph.

    The constructor validates the columns, values included (one device sync for a GPU tensor,
    once per mask, not per attention call); :meth:`to` and :meth:`expand_heads` keep that check.
    """

    startend_row_indices: torch.Tensor
    causal: bool
    seqlen_q: Optional[int] = None
    mean_row_span: Optional[float] = None
    #: floor(2 * log2(max(mean_row_span, 1))), or None: derived, not an argument.
    row_span_bucket: Optional[int] = field(default=None, init=False)
    #: The columns are known valid, their values are not read again: set by :meth:`to` /
    #: :meth:`expand_heads` (from a validated mask) and by package code whose columns are valid
    #: by construction (the transformers integration, the training loader), where a check on a
    #: GPU would be a device sync per batch.
    _validated: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self):
        span = self.mean_row_span
        if span is not None:
            if isinstance(span, bool) or not isinstance(span, (int, float)):
                raise TypeError(f"mean_row_span must be a number or None, got {type(span).__name__}")
            if not span >= 0:
                raise ValueError(f"mean_row_span must be >= 0, got {span}")
            bucket = row_span_bucket(span)
            object.__setattr__(self, "mean_row_span", float(span))
            object.__setattr__(self, "row_span_bucket", bucket)
        t = self.startend_row_indices
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"startend_row_indices must be a torch.Tensor, got {type(t).__name__}")
        if span is not None and not torch.compiler.is_compiling():
            setattr(t, ROW_SPAN_ATTR, row_span_of_bucket(self.row_span_bucket))
        if self.seqlen_q is None:
            if t.dim() != 4:
                raise ValueError(f"startend_row_indices must be 4-D, got shape {tuple(t.shape)}")
            object.__setattr__(self, "seqlen_q", int(t.shape[2]))
        validate_startend_row_indices(
            t,
            causal=self.causal,
            batch_size=t.shape[0] if t.dim() == 4 else -1,
            seqlen_q=self.seqlen_q,
            seqlen_k=t.shape[2] if t.dim() == 4 else -1,
            check_values=not self._validated,
        )

    # -- shape ---------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.startend_row_indices.shape[0])

    @property
    def num_heads(self) -> int:
        """Number of mask heads ``Hm``."""
        return int(self.startend_row_indices.shape[1])

    @property
    def seqlen_k(self) -> int:
        return int(self.startend_row_indices.shape[2])

    @property
    def num_columns(self) -> int:
        return int(self.startend_row_indices.shape[3])

    # -- conversions ---------------------------------------------------------------------
    def to(self, device) -> "FlashMask":
        return FlashMask(self.startend_row_indices.to(device), self.causal, self.seqlen_q,
                         self.mean_row_span, _validated=True)

    def to_dense(self) -> torch.Tensor:
        """Dense boolean ``[B, Hm, Sq, Sk]`` (True = attend). O(S²): tests and debugging only."""
        return to_dense(self.startend_row_indices, self.causal, self.seqlen_q)

    def expand_heads(self, num_heads: int) -> "FlashMask":
        """The same mask repeated over ``num_heads`` mask heads (from a single-head mask)."""
        if self.num_heads != 1:
            raise ValueError(f"expand_heads needs a single-head mask, this one has {self.num_heads}")
        t = self.startend_row_indices.expand(-1, num_heads, -1, -1).contiguous()
        return FlashMask(t, self.causal, self.seqlen_q, self.mean_row_span, _validated=True)

    # -- accounting ----------------------------------------------------------------------
    def unmasked_pairs(self) -> int:
        """Total unmasked (query, key) pairs over batch and mask heads."""
        return unmasked_pairs(self.startend_row_indices, self.causal, self.seqlen_q)

    def row_span(self) -> float:
        """Mean number of keys a query row attends, over batch, mask heads and rows (from the
        columns: one device-to-host copy on a GPU mask)."""
        return mean_row_span(self.startend_row_indices, self.causal, self.seqlen_q)

    def with_row_span(self) -> "FlashMask":
        """This mask with :attr:`mean_row_span` measured (:meth:`row_span`), for masks built
        from a tensor: the constructors set it themselves."""
        return dataclasses.replace(self, mean_row_span=self.row_span())

    def density(self) -> float:
        """Fraction of (query, key) pairs that are attended (1 - sparsity)."""
        total = self.batch_size * self.num_heads * self.seqlen_q * self.seqlen_k
        return self.unmasked_pairs() / total if total else 0.0

    def sparsity(self) -> float:
        return 1.0 - self.density()

    def flops(self, num_heads: int, head_dim: int, mode: str = "fwd") -> float:
        """Effective attention FLOPs for ``num_heads`` query heads of dimension ``head_dim``."""
        return attention_flops(
            self.startend_row_indices,
            self.causal,
            batch_size=self.batch_size,
            num_heads=num_heads,
            seqlen_q=self.seqlen_q,
            seqlen_k=self.seqlen_k,
            head_dim=head_dim,
            mode=mode,
        )

    def __repr__(self) -> str:
        b, hm, sk, c = self.startend_row_indices.shape
        return (f"FlashMask(B={b}, Hm={hm}, Sq={self.seqlen_q}, Sk={sk}, C={c}, "
                f"causal={self.causal}, device={self.startend_row_indices.device})")
