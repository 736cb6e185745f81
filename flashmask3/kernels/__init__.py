"""Attention backends behind :func:`flashmask3.flashmask_attention`.

Each backend is a module with ``forward`` and ``backward`` following the contract in
docs/ARCHITECTURE.md. ``torch`` (blockwise PyTorch) runs anywhere; ``triton`` runs the Triton
kernels on CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``).

The backend modules are imported once, on first use, and kept in :data:`_LOADED`; whether the
Triton one imports is decided then and never again (:func:`triton_available`), so that the
choice made on every call is a few dictionary and attribute reads: cheap on the host and
traceable by ``torch.compile`` (no ``importlib`` under dynamo; docs/host-path.md).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Optional

import torch

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "FLASHMASK3_BACKEND"

_MODULES = {"torch": "flashmask3.kernels.torch_path", "triton": "flashmask3.kernels.triton_backend"}

#: Backend modules imported so far (name -> module), and why one could not be (name -> error).
_LOADED: dict[str, ModuleType] = {}
_IMPORT_ERROR: dict[str, str] = {}


def _load(name: str) -> Optional[ModuleType]:
    """The backend module ``name``, imported on the first call (None when it cannot be)."""
    mod = _LOADED.get(name)
    if mod is None and name not in _IMPORT_ERROR:
        try:
            mod = importlib.import_module(_MODULES[name])
        except ImportError as exc:
            _IMPORT_ERROR[name] = f"{type(exc).__name__}: {exc}"
            return None
        _LOADED[name] = mod
    return mod


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` with the
    package (1.5 of its 3.5 s import): that decorator only sets this marker, on torch 2.11-2.15
    (``tests/kernels/test_dispatch.py`` checks that it still does); once dynamo is imported,
    the real one."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def triton_available() -> bool:
    """True when the Triton backend can be imported (Triton installed and kernels present).
    Decided on the first call and cached; under ``torch.compile`` a constant of the graph."""
    return _load("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _requested() -> str:
    return (os.environ.get(ENV_VAR) or "auto").strip().lower()


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    """Name of the backend to use for tensors on ``device``.

    ``requested`` (else ``$FLASHMASK3_BACKEND``, else ``auto``) is one of :data:`BACKENDS`.
    ``auto`` picks Triton on CUDA when it is importable and the torch path otherwise.
    """
    name = (requested or _requested()).strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{ENV_VAR}=triton but the Triton backend cannot be imported "
                f"({_IMPORT_ERROR.get('triton', 'unknown reason')}; install Triton: the one "
                "your torch depends on, or pip install flashmask3[triton])"
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
    reason = getattr(_LOADED["triton"], "unsupported_reason", lambda _q: None)(q)
    if reason is None:
        return name
    if _requested() == "triton":
        raise ValueError(f"{ENV_VAR}=triton cannot run these inputs: {reason}")
    return "torch"


def get_backend(name: str) -> ModuleType:
    """The module implementing backend ``name`` ('torch' or 'triton')."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; expected one of {tuple(_MODULES)}")
    mod = _load(name)
    if mod is None:
        raise RuntimeError(f"the {name} backend cannot be imported: {_IMPORT_ERROR[name]}")
    return mod


def loaded() -> tuple[ModuleType, ...]:
    """The backend modules imported so far, through :func:`get_backend` or directly (a test or
    the context-parallel runtime importing ``triton_backend``): what ``api.clear_prepared``
    must reach."""
    mods = (sys.modules.get(path) for path in _MODULES.values())
    return tuple(m for m in mods if m is not None)
