"""flashmask3 as a Hugging Face transformers attention implementation.

Importing this module registers the implementation :data:`ATTN_IMPLEMENTATION` with
transformers' ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(what the model's mask preparation hands to that function)::

    from flashmask3.integrations.transformers import ATTN_IMPLEMENTATION
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=ATTN_IMPLEMENTATION)

What each layer's attention then computes (docs/transformers.md):

* **packed documents**: ``cu_seq_lens_q`` (from ``DataCollatorWithFlattening(
  return_flash_attn_kwargs=True)``) or, without it, ``position_ids`` that restart per document
  give a causal document mask; built on the device by :mod:`flashmask3.integrations.packing`
  (no host sync), any batch size;
* **padding**: a 2-D ``attention_mask`` (left or right padding) masks the padding keys;
* **any mask**: ``model(..., flashmask=FlashMask)`` (or ``startend_row_indices=`` columns with
  ``flashmask_causal=``) reaches every layer through the keyword arguments transformers
  forwards to attention functions, and replaces the document mask (padding still applies);
* **sliding-window layers** (``sliding_window`` keyword, e.g. Mistral, Qwen2) are honoured;
* **decoding with a KV cache** (query length != key length) and dense 4-D masks fall back to
  transformers' ``sdpa`` implementation with the dense mask transformers builds for it;
* **context parallelism**: ``model(..., flashmask_cp=ContextParallel(plan))`` on every rank of
  the group, each with its shard of the per-token inputs, runs every layer's attention through
  :func:`~flashmask3.distributed.cp_flashmask_attention` (:class:`ContextParallel`).

The mask of a forward is built once and reused by every layer (it is cached on the identity of
the tensors it came from).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers.modeling_utils import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..api import flashmask_attention, reads_column_values
from ..distributed import CPPlan, cp_flashmask_attention, padded_seqlen, plan
from ..distributed.comm import resolve_group
from ..masks import pad_to
from ..masks.mask import FlashMask
from .packing import packed_columns, with_key_padding

#: The name to pass as ``attn_implementation``. It must not contain "flash": transformers sends
#: any such name to its flash-attention / hub-kernel loader.
ATTN_IMPLEMENTATION = "fm3_columnmask"

#: Keyword arguments of the model's forward that carry a custom mask to every layer.
MASK_KWARG = "flashmask"
COLUMNS_KWARG = "startend_row_indices"
CAUSAL_KWARG = "flashmask_causal"
#: Keyword argument of the model's forward that runs every layer context-parallel.
CP_KWARG = "flashmask_cp"


# -- the mask transformers prepares for us ----------------------------------------------------


def mask_for_attention(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                       mask_function=None, attention_mask: Optional[torch.Tensor] = None,
                       use_vmap: bool = False, **kwargs):
    """The ``AttentionMaskInterface`` entry: what the model's ``create_*_mask`` returns.

    Training and prefill (no cache offset, as many keys as queries): the 2-D boolean padding
    mask ``[B, kv_length]`` or None, never an ``[S, S]`` tensor; the attention function builds
    the columns. With a KV cache in use, or with custom ``or/and_mask_function`` overlays
    (``use_vmap``), the dense mask of transformers' ``sdpa`` (the fallback then runs sdpa).
    """
    offset_free = isinstance(q_offset, int) and q_offset == 0 and isinstance(kv_offset, int) \
        and kv_offset == 0
    if q_length != kv_length or not offset_free or use_vmap:
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            use_vmap=use_vmap, **kwargs)
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:].to(torch.bool)


# -- one mask per forward ---------------------------------------------------------------------


class _MaskCache:
    """Remembers the last mask built and the tensors it was built from (weakly, so a new
    batch in recycled memory never matches), so the layers of one forward share one mask."""

    def __init__(self):
        self._refs: tuple = ()
        self._key: tuple = ()
        self._mask: Optional[FlashMask] = None

    def get(self, tensors: tuple, key: tuple, build) -> FlashMask:
        if self._mask is not None and key == self._key and len(tensors) == len(self._refs) and all(
            (ref is None and t is None) or (ref is not None and ref() is t)
            for ref, t in zip(self._refs, tensors)
        ):
            return self._mask
        mask = build()
        self._refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self._key, self._mask = key, mask
        return mask


_CACHE = _MaskCache()


def _version(t: Optional[torch.Tensor]):
    return None if t is None else (t._version, tuple(t.shape), str(t.device))


def _custom_mask(kwargs, batch_size: int, seqlen: int) -> Optional[FlashMask]:
    """The user's mask from the forward's keyword arguments, or None."""
    mask, cols = kwargs.get(MASK_KWARG), kwargs.get(COLUMNS_KWARG)
    if mask is not None and cols is not None:
        raise ValueError(f"pass either {MASK_KWARG}= or {COLUMNS_KWARG}=, not both")
    if mask is not None:
        if not isinstance(mask, FlashMask):
            raise TypeError(f"{MASK_KWARG}= must be a flashmask3 FlashMask, got {type(mask).__name__}")
    elif cols is not None:
        causal = kwargs.get(CAUSAL_KWARG, True)
        if not isinstance(causal, bool):
            raise TypeError(f"{CAUSAL_KWARG}= must be a bool, got {type(causal).__name__}")
        # the public function's rule for raw columns: values read where that is free (CPU) or
        # with the debug switch, never with a device sync per forward
        mask = FlashMask(cols, causal, _validated=not reads_column_values(cols))
    if mask is not None and (mask.seqlen_q != seqlen or mask.seqlen_k != seqlen):
        raise ValueError(f"the custom mask is for {mask.seqlen_q} x {mask.seqlen_k} tokens, but the "
                         f"batch has {seqlen} (one mask per forward, the same for every layer)")
    if mask is not None and mask.batch_size not in (1, batch_size):
        raise ValueError(f"the custom mask has batch size {mask.batch_size}, the batch {batch_size}")
    return mask


def _layer_mask(module, query: torch.Tensor, padding: Optional[torch.Tensor], kwargs,
                sliding_window: Optional[int]) -> FlashMask:
    """The FlashMask of this forward: the custom mask or the packed documents, plus padding."""
    b, _, s, _ = query.shape
    device = query.device
    custom = _custom_mask(kwargs, b, s)
    if custom is not None:
        if sliding_window is not None:
            raise ValueError("a custom flashmask= on a sliding-window layer: fold the window into "
                             "the mask instead")
        sources = (custom.startend_row_indices, padding)
        key = ("custom", b, s, str(device), tuple(map(_version, sources)))

        def build():
            cols = custom.startend_row_indices.to(device)
            cols = cols.expand(b, *cols.shape[1:])
            if padding is not None:
                cols = with_key_padding(cols, custom.causal, padding, s)
            # valid by construction (a checked mask, expanded, padding keys masked): no value
            # check, which would read the columns to the host once per forward
            return FlashMask(cols.contiguous(), custom.causal, s, custom.mean_row_span, _validated=True)
        return _CACHE.get(sources, key, build)

    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    cu = kwargs.get("cu_seq_lens_k", kwargs.get("cu_seq_lens_q"))
    positions = kwargs.get("position_ids") if cu is None else None
    sources = (cu, positions, padding)
    key = ("packed", b, s, str(device), causal, sliding_window, tuple(map(_version, sources)))

    def build():
        cols = packed_columns(b, s, device, causal=causal, cu_seqlens=cu, position_ids=positions,
                              key_padding=padding, sliding_window=sliding_window)
        # valid by construction (tests/integrations/test_packing.py): no value check, which
        # would read the columns to the host once per forward
        return FlashMask(cols, causal, s, _validated=True)
    return _CACHE.get(sources, key, build)


# -- context parallelism ------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextParallel:
    """Run a transformers decoder with its sequence spread over a process group: every rank of
    the group calls the model with its shard of the inputs, ``model(**cp.model_inputs(...))``
    (:meth:`model_inputs`), or passes ``flashmask_cp=cp`` itself.

    Each rank's per-token inputs are its tokens in plan order (:meth:`shard`): ``input_ids`` (or
    ``inputs_embeds``) and **``position_ids``, the global positions of its tokens**, which the
    rotary embeddings read. They are required: without them the model numbers a shard's tokens
    from 0, which no check inside attention can see. Every layer's attention then covers the
    whole sequence under the plan's mask (:func:`~flashmask3.distributed.cp_flashmask_attention`
    with these arguments); the rest of a decoder works token by token and needs nothing. The
    loss: the next-token targets are shifted on the whole sequence, then sharded, and
    ``num_items_in_batch`` counts the whole batch's targets, so the ranks' losses sum to the
    single-device loss and their gradients to its gradients (:meth:`reduce_gradients`, or a
    data-parallel wrapper over a group containing the CP ranks, its averaging undone).

    Sliding-window layers run the plan's mask limited to their window, on the plan's placement
    (:meth:`~flashmask3.distributed.plan.CPPlan.windowed`; the plan must be causal). Not supported
    here (each a ValueError): a 2-D padding ``attention_mask`` and a custom ``flashmask=`` (fold
    them into the plan's mask), KV-cache decoding.
    """

    plan: CPPlan
    group: Any = None
    comm: str = "overlap"
    node_layout: Any = None
    backward_calls: str = "auto"
    keep_kv: bool = True
    #: every layer first checks that all ranks hold the same plan (one small all-reduce): a
    #: rank that planned another batch raises on all ranks instead of exchanging garbage
    check_plan: bool = False

    def __post_init__(self):
        if not isinstance(self.plan, CPPlan):
            raise TypeError(f"plan must be a CPPlan (flashmask3.distributed.plan), got "
                            f"{type(self.plan).__name__}")

    @classmethod
    def from_mask(cls, mask: FlashMask, group=None, *, balance: str = "sparse", nodes: int = 1,
                  plan_kwargs: Optional[dict] = None, **options) -> "ContextParallel":
        """A ``ContextParallel`` for one batch's whole-sequence ``mask`` over ``group``'s ranks:
        the mask padded at the end to the shortest length the ranks split
        (:func:`~flashmask3.distributed.padded_seqlen`, :func:`~flashmask3.masks.pad_to`),
        planned with ``balance``/``nodes`` (and ``plan_kwargs``); ``options`` are the other
        fields (``comm``, ``node_layout``, ...). :meth:`model_inputs` pads the inputs to match."""
        if not isinstance(mask, FlashMask):
            raise TypeError(f"mask must be a FlashMask, got {type(mask).__name__}")
        world = dist.get_world_size(resolve_group(group))
        length = padded_seqlen(mask.seqlen_q, world, balance=balance)
        p = plan(pad_to(mask, length), None, world, balance=balance, nodes=nodes, **(plan_kwargs or {}))
        return cls(p, group, **options)

    @property
    def rank(self) -> int:
        """This process's rank in the CP group."""
        return dist.get_rank(resolve_group(self.group))

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (``[B, S, ...]`` by default)."""
        return self.plan.shard(t, self.rank, dim)

    def model_inputs(self, input_ids: Optional[torch.Tensor] = None, *, position_ids: torch.Tensor,
                     labels: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                     ignore_index: int = -100) -> dict:
        """The keyword arguments of this rank's forward, from whole-sequence ``[B, S]`` tensors
        (``inputs_embeds`` ``[B, S, hidden]``): the inputs and positions sharded, the next-token
        loss's sharded targets and global count when ``labels`` are given, ``use_cache=False``
        and ``flashmask_cp``. A batch shorter than the plan (planned on
        ``masks.pad_to(mask, padded_seqlen(...))``) is padded to it first (:meth:`padded`):
        the padding's targets are ignored, so the loss is the unpadded batch's."""
        if position_ids is None:
            raise ValueError("position_ids are required: the global positions of the whole "
                             "sequence's tokens (the rotary embeddings of a shard need them)")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        kwargs = {"position_ids": self.shard(self.padded(position_ids)), "use_cache": False, CP_KWARG: self}
        if input_ids is not None:
            kwargs["input_ids"] = self.shard(self.padded(input_ids))
        else:
            kwargs["inputs_embeds"] = self.shard(self.padded(inputs_embeds))
        if labels is not None:
            shift, count = self.next_token_labels(labels, ignore_index)
            kwargs.update(labels=shift, shift_labels=shift, num_items_in_batch=count)
        return kwargs

    def next_token_labels(self, labels: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
        """``(this rank's shard of the next-token targets [B, S/P], the whole batch's target
        count)`` of the whole sequence's ``labels [B, S]`` (the shift transformers' causal-LM
        loss makes, done before sharding). Pass them as ``labels=`` and ``shift_labels=`` (the
        same tensor) and ``num_items_in_batch=``. The count is a 0-d tensor on the labels'
        device (not read to the host: no sync)."""
        shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shifted = self.padded(shifted, ignore_index)
        return self.shard(shifted), (shifted != ignore_index).sum()

    def padded(self, t: torch.Tensor, value=0) -> torch.Tensor:
        """A whole-sequence tensor (``[B, S, ...]``) padded with ``value`` at the end of the
        sequence to the plan's length (a plan made on ``masks.pad_to(mask, L)``: the padding
        keys are masked, so the real tokens attend as before); as it is when already as long."""
        s, want = t.shape[1], self.plan.seqlen
        if s > want:
            raise ValueError(f"the batch has {s} tokens, more than the plan's {want}")
        if s == want:
            return t
        pad = t.new_full((t.shape[0], want - s, *t.shape[2:]), value)
        return torch.cat([t, pad], dim=1)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum every parameter's gradient over the CP group (each rank holds the part of its
        tokens), giving every rank the single-device gradient."""
        pg = resolve_group(self.group)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=pg)


def _cp_attention(cp, query, key, value, padding, scaling, sliding_window, kwargs):
    """One layer's attention under context parallelism (:class:`ContextParallel`)."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"{CP_KWARG}= must be a flashmask3 ContextParallel, got {type(cp).__name__}")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{CP_KWARG}= runs training and prefill only: no KV-cache decoding "
                         "(pass use_cache=False)")
    if padding is not None or kwargs.get(MASK_KWARG) is not None or kwargs.get(COLUMNS_KWARG) is not None:
        raise ValueError(f"under {CP_KWARG}= the mask is the plan's: fold padding or a custom mask "
                         "into the global mask the plan was made from")
    # a sliding window of w keys (the query's own included) keeps keys [i - (w - 1), i]: the
    # plan's mask windowed, on the plan's placement (CPPlan.windowed); a longer one masks nothing
    window = None
    if sliding_window is not None and sliding_window < cp.plan.seqlen:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        window = sliding_window - 1
    return cp_flashmask_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  cp.plan, group=cp.group, comm=cp.comm, softmax_scale=scaling,
                                  node_layout=cp.node_layout, backward_calls=cp.backward_calls,
                                  keep_kv=cp.keep_kv, check_plan=cp.check_plan, window_size=window)


# -- the attention function -------------------------------------------------------------------


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, **kwargs):
    """The ``AttentionInterface`` entry: query ``[B, Hq, S, D]``, key/value ``[B, Hk, S, D]``
    (GQA without repeating K/V) -> ``(out [B, S, Hq, D], None)``.

    Falls back to transformers' ``sdpa`` when keys outnumber queries (decoding from a KV cache)
    or when the mask is a dense 4-D tensor (a user's own, or the one built for the fallback).
    """
    if softcap is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} does not support attention logit softcapping "
                         "(softcap); use 'eager' for this model")
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATION} does not support attention dropout (got "
                         f"{dropout}); set config.attention_dropout = 0")
    padding = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    cp = kwargs.get(CP_KWARG)
    if cp is not None:
        return _cp_attention(cp, query, key, value, padding, scaling, sliding_window, kwargs), None
    if query.shape[2] != key.shape[2] or (padding is not None and padding.dim() == 4):
        if kwargs.get(MASK_KWARG) is not None or kwargs.get(COLUMNS_KWARG) is not None:
            raise ValueError(f"a custom {MASK_KWARG}= needs as many keys as queries (no KV cache "
                             "decoding, no dense 4-D attention_mask)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if padding is not None and padding.dim() != 2:
        raise ValueError(f"{ATTN_IMPLEMENTATION} expects a 2-D padding attention_mask, got shape "
                         f"{tuple(padding.shape)}")
    mask = _layer_mask(module, query, padding, kwargs, sliding_window)
    out = flashmask_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              mask, softmax_scale=scaling)
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_for_attention)
