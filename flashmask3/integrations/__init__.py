"""Integrations of flashmask3 with other libraries.

* :mod:`flashmask3.integrations.transformers`: a Hugging Face transformers attention
  implementation (importing it registers it; needs ``pip install flashmask3[hf]``).
* :mod:`flashmask3.integrations.packing`: mask columns of packed / padded batches built on the
  device from ``cu_seqlens``, ``position_ids`` or a padding mask (no host sync).

Nothing here is imported by ``import flashmask3``: transformers stays optional.
"""
