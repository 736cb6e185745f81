"""Counting the kernel launches of the context-parallel runtime (docs/cp-runtime.md).

:class:`LaunchCounter` is a ``TorchDispatchMode`` that counts the aten operators that launch a
device kernel: every operator except views, metadata changes and allocations (``empty`` and
friends allocate from the caching allocator without a kernel). On a CPU run the count is what
the same code launches on a GPU, operator for operator (an operator that launches two kernels
on CUDA still counts one: the count is a lower bound there).

The attention backend's functions (``forward``, the staged backward's ``backward_prepare`` /
``backward_stage`` / ``backward_finish``, or ``backward``) are counted apart, as attention
calls: the runtime calls them through :func:`call_attention`, and the operators they issue go
to :attr:`LaunchCounter.attention_launches` (Triton kernels are not aten operators: count those
with the launch recorder of ``benchmarks/host_profile.py``, as ``benchmarks/cp_launches.py``
does). Communication stubs and emulators pause it too (:meth:`LaunchCounter.paused`),
so the count is the runtime's own work. Host synchronisations (``.item()``, ``.tolist()``,
a tensor's truth value) are counted in :attr:`LaunchCounter.syncs`.

    with LaunchCounter() as c:
        out = cp_flashmask_attention(...); out.backward(do)
    c.launches, c.attention_calls, c.syncs, c.by_op
"""

from __future__ import annotations

import collections
import contextlib
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: Operators that allocate or only change metadata: no kernel.
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.detach.default,
    _aten.lift_fresh.default, _aten.set_.source_Storage_storage_offset, _aten.resize_.default,
    _aten.is_same_size.default, _aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
    _aten.sym_storage_offset.default, _aten.is_nonzero.default,
}

#: Operators that copy a device value to the host (a synchronisation on a GPU).
_SYNCS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default}

_ACTIVE: Optional["LaunchCounter"] = None


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-launching aten operators, attention calls and host syncs (module doc)."""

    def __init__(self):
        super().__init__()
        self.launches = 0
        self.attention_calls = 0
        self.syncs = 0
        self.by_op: collections.Counter = collections.Counter()
        self.attention_launches = 0
        self.attention_by_op: collections.Counter = collections.Counter()
        self._pause = 0
        self._attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._pause:
            kernel = not (func.is_view or func in _NO_KERNEL)
            name = str(func.overloadpacket.__name__)
            if self._attention:
                if kernel:
                    self.attention_launches += 1
                    self.attention_by_op[name] += 1
            else:
                if func in _SYNCS:
                    self.syncs += 1
                if kernel:
                    self.launches += 1
                    self.by_op[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def in_attention(self):
        """Operators issued inside are the attention backend's (:attr:`attention_launches`)."""
        self._attention += 1
        try:
            yield
        finally:
            self._attention -= 1

    @contextlib.contextmanager
    def paused(self):
        """Operators issued inside are not counted (communication emulation, attention)."""
        self._pause += 1
        try:
            yield
        finally:
            self._pause -= 1

    def __enter__(self):
        global _ACTIVE
        self._outer = _ACTIVE
        _ACTIVE = self
        return super().__enter__()

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = self._outer
        return super().__exit__(*exc)


def active_counter() -> Optional[LaunchCounter]:
    """The innermost :class:`LaunchCounter` in use, or ``None``."""
    return _ACTIVE


def call_attention(fn, *args):
    """Call one of a backend's functions; under a counter, as one attention call whose
    operators are counted apart (:attr:`LaunchCounter.attention_launches`)."""
    counter = _ACTIVE
    if counter is None:
        return fn(*args)
    counter.attention_calls += 1
    with counter.in_attention():
        return fn(*args)


@contextlib.contextmanager
def not_counted():
    """Pause the active counter, if any (for communication stubs and emulators)."""
    counter = _ACTIVE
    if counter is None:
        yield
        return
    with counter.paused():
        yield
