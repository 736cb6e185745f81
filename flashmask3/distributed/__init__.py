"""Mask-aware context parallelism (docs/context-parallel.md, docs/cp-runtime.md).

* :func:`plan` -> :class:`CPPlan`: ownership (contiguous / dual_chunk / work-balanced sparse),
  rank-local masks, needed KV chunks and point-to-point routing (flat or hierarchical), all
  computed identically on every rank from the global mask before any data moves.
* :func:`cp_flashmask_attention`: differentiable attention on each rank's shards, with the
  all-gather baseline or the overlapped mask-aware exchange.
* :func:`prepare_rank` -> :class:`RankProgram`: a rank's per-layer device program (index
  tensors, stage masks, message layouts), built once per plan and cached on it; a data loader
  may call it ahead of time for the next batch.
* ``backward_calls=`` of :func:`cp_flashmask_attention` / :func:`prepare_rank`: one staged
  backward call per stage, one per layer, or the own stage and one more (``"auto"``: a rule on
  the plan's shape, :func:`auto_backward_calls`).
* :class:`LaunchCounter`: counts the kernel launches of a layer (the runtime's launch budget).

Usage (every rank runs the same code; torch.distributed already initialised, NCCL with
``torch.cuda.set_device`` done, or gloo on CPU)::

    from flashmask3.distributed import plan, cp_flashmask_attention

    p = plan(mask, None, cp_size, balance="sparse")      # from the GLOBAL mask, same on all ranks
    tokens = p.shard(global_tokens, rank)                 # [B, S/P]; p.shard(pos_ids, rank) too
    ...                                                   # q, k, v: [B, S/P, H, D] of this shard
    out = cp_flashmask_attention(q, k, v, p, group=cp_group, comm="overlap")
    full = p.unshard(list_of_outputs)                     # if the whole sequence is needed

``nodes=N`` in :func:`plan` routes inter-node chunks hierarchically; it needs node-major ranks
in the CP group (group rank r sits on node r // (cp_size // N)), as torchrun assigns them:
``cp_flashmask_attention`` checks this (``node_layout=``) and raises ValueError otherwise.
"""

from .attention import COMMS, cp_flashmask_attention, merge_partials, run_layer
from .comm import DistExchange, resolve_group
from .launches import LaunchCounter
from .local_mask import rank_local_columns
from .plan import BALANCES, WORK_MODELS, CPPlan, Round, Transfer, chunk_liveness, chunk_pairs, padded_seqlen, plan
from .program import BACKWARD_CALL_MODES, BACKWARD_CALLS, RankProgram, auto_backward_calls, prepare_rank
from .runtime import EmulatedExchange

__all__ = ["plan", "padded_seqlen", "CPPlan", "Round", "Transfer", "BALANCES", "COMMS", "BACKWARD_CALLS", "BACKWARD_CALL_MODES",
           "WORK_MODELS", "chunk_liveness", "chunk_pairs",
           "cp_flashmask_attention", "merge_partials", "rank_local_columns", "resolve_group",
           "prepare_rank", "auto_backward_calls", "RankProgram", "run_layer", "DistExchange", "EmulatedExchange",
           "LaunchCounter"]
