"""flashmask3: long-context attention with column-wise sparse masks on Hopper GPUs.

Public entry points: :func:`flashmask_attention` (single device), the mask layer
:mod:`flashmask3.masks`, context parallelism :mod:`flashmask3.distributed` and the training
harness :mod:`flashmask3.train`.
"""

from . import masks
from .api import flashmask_attention
from .masks import FlashMask

__version__ = "0.1.0"
__all__ = ["flashmask_attention", "FlashMask", "masks", "__version__"]
