"""Attention backends behind :func:`flashmask3.flashmask_attention`.

Each backend is a module with ``forward`` and ``backward`` following the contract in
docs/ARCHITECTURE.md. ``torch`` (blockwise PyTorch) runs anywhere; ``triton`` runs the Triton
kernels on CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "FLASHMASK3_BACKEND"

_MODULES = {"torch": "flashmask3.kernels.torch_path", "triton": "flashmask3.kernels.triton_backend"}


def triton_available() -> bool:
    """True when the Triton backend can be imported (Triton installed and kernels present)."""
    try:
        importlib.import_module(_MODULES["triton"])
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    """Name of the backend to use for tensors on ``device``.

    ``requested`` (else ``$FLASHMASK3_BACKEND``, else ``auto``) is one of :data:`BACKENDS`.
    ``auto`` picks Triton on CUDA when it is importable and the torch path otherwise.
    """
    name = (requested or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{ENV_VAR}=triton but the Triton backend cannot be imported "
                "(install the 'triton' extra: pip install flashmask3[triton])"
            )
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"{ENV_VAR}=triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
                f"got tensors on {device}"
            )
    return name


def choose_backend(q: torch.Tensor) -> str:
    """Backend for a call with query tensor ``q``: :func:`resolve_backend`, then a fallback to
    the torch path when ``auto`` picked Triton for inputs it does not support (the Triton module
    may expose ``unsupported_reason(q) -> str | None``). An explicit ``triton`` request for
    unsupported inputs is a ``ValueError`` naming the reason."""
    name = resolve_backend(q.device)
    if name != "triton":
        return name
    reason = getattr(get_backend("triton"), "unsupported_reason", lambda _q: None)(q)
    if reason is None:
        return name
    if (os.environ.get(ENV_VAR) or "auto").strip().lower() == "triton":
        raise ValueError(f"{ENV_VAR}=triton cannot run these inputs: {reason}")
    return "torch"


def get_backend(name: str) -> ModuleType:
    """The module implementing backend ``name`` ('torch' or 'triton')."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; expected one of {tuple(_MODULES)}")
    return importlib.import_module(_MODULES[name])
