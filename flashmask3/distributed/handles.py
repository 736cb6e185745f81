"""Python objects named by tensors, for the context-parallel custom ops.

A ``torch.library`` op takes tensors, numbers and strings, not a ``CPPlan`` or a kept K/V
buffer. :func:`name_object` gives such an object a 0-d int64 CPU tensor as its name: a tensor,
so that torch.compile neither guards on its value nor recompiles for a new one. The name holds
its object (a Python attribute, kept with the tensor while autograd saves it for a backward),
and :func:`named_object` finds the object from any tensor with the same value in this process.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch

_OBJECTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_NAMES = itertools.count(1)


def name_object(obj: Any) -> torch.Tensor:
    """A new 0-d int64 CPU tensor naming ``obj`` (never 0), which keeps ``obj`` alive."""
    name = next(_NAMES)
    token = torch.tensor(name, dtype=torch.int64, device="cpu")
    token._flashmask3_object = obj
    _OBJECTS[name] = obj
    return token


def named_object(token: torch.Tensor) -> Optional[Any]:
    """The object ``token`` names, or None when it no longer exists (read on the host)."""
    return _OBJECTS.get(int(token))
