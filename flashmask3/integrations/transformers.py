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
  transformers' ``sdpa`` implementation with the dense mask transformers builds for it.

The mask of a forward is built once and reused by every layer (it is cached on the identity of
the tensors it came from).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from transformers.modeling_utils import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..api import reads_column_values, flashmask_attention
from ..masks.mask import FlashMask
from .packing import packed_columns, with_key_padding

#: The name to pass as ``attn_implementation``. It must not contain "flash": transformers sends
#: any such name to its flash-attention / hub-kernel loader.
ATTN_IMPLEMENTATION = "fm3_columnmask"

#: Keyword arguments of the model's forward that carry a custom mask to every layer.
MASK_KWARG = "flashmask"
COLUMNS_KWARG = "startend_row_indices"
CAUSAL_KWARG = "flashmask_causal"


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
    dense = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
    if query.shape[2] != key.shape[2] or dense:
        if kwargs.get(MASK_KWARG) is not None or kwargs.get(COLUMNS_KWARG) is not None:
            raise ValueError(f"a custom {MASK_KWARG}= needs as many keys as queries (no KV cache "
                             "decoding, no dense 4-D attention_mask)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    padding = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    if padding is not None and padding.dim() != 2:
        raise ValueError(f"{ATTN_IMPLEMENTATION} expects a 2-D padding attention_mask, got shape "
                         f"{tuple(padding.shape)}")
    mask = _layer_mask(module, query, padding, kwargs, sliding_window)
    out = flashmask_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              mask, softmax_scale=scaling)
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_for_attention)
