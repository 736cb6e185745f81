"""The mask layer: column-wise sparse masks (O(S) memory), constructors and block summaries."""

from .blocks import (
    PARTIAL,
    SKIP,
    UNMASKED,
    BlockSummary,
    block_summary,
    classify_tiles,
    live_kv_block_range,
    live_q_block_range,
)
from .constructors import (
    causal_blockwise_mask,
    causal_document_mask,
    causal_mask,
    causal_window_columns,
    document_mask,
    from_cu_seqlens,
    full_mask,
    pad_to,
    global_sliding_window_mask,
    prefix_document_mask,
    prefix_lm_mask,
    qk_sparse_mask,
    random_document_lengths,
    random_eviction_mask,
    shared_question_mask,
    sliding_window_mask,
    with_window,
)
from .mask import (
    FlashMask,
    attention_flops,
    element_mask,
    masked_row_intervals,
    to_dense,
    unmasked_pairs,
    validate_startend_row_indices,
)

__all__ = [name for name in dir() if not name.startswith("_")]
