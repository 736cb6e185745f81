"""Mask-aware context parallelism (DESIGN.md §3).

* :func:`plan` -> :class:`CPPlan`: ownership (contiguous / dual_chunk / work-balanced sparse),
  rank-local masks, needed KV chunks and point-to-point routing (flat or hierarchical), all
  computed identically on every rank from the global mask before any data moves.
* :func:`cp_flashmask_attention`: differentiable attention on each rank's shards, with the
  all-gather baseline or the overlapped mask-aware exchange.
"""

from .attention import COMMS, cp_flashmask_attention, merge_partials
from .comm import resolve_group
from .local_mask import rank_local_columns
from .plan import BALANCES, CPPlan, Round, Transfer, chunk_liveness, plan

__all__ = ["plan", "CPPlan", "Round", "Transfer", "BALANCES", "COMMS", "chunk_liveness",
           "cp_flashmask_attention", "merge_partials", "rank_local_columns", "resolve_group"]
