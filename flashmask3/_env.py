"""Reading environment variables on the hot path of a call without Python frames.

``os.environ.get(name)`` is three Python calls (``Mapping.get``, ``__getitem__``, the key's
encoding); the package reads a few variables on every attention call and every launch.
:func:`env_reader` reads ``os.environ``'s own dict with pre-encoded keys instead (one C call
for all of them). The values are the raw stored ones (``bytes`` on POSIX, ``str`` elsewhere):
use them as cache keys, or compare them with :data:`UNSET_OR_OFF` / :func:`is_on`.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Iterator

#: Values meaning "unset or off" for a 0/1 switch, in both stored forms.
UNSET_OR_OFF = (None, "", "0", b"", b"0")


def env_reader(*names: str) -> Callable[[], Iterator]:
    """A C-level callable (no Python frame) returning an iterator over the current raw values
    (None when unset) of ``names``: unpack it, or ``tuple()`` it for a key. Writes through
    ``os.environ`` (``monkeypatch.setenv`` included) are seen; a bare ``os.putenv`` is not, as
    with ``os.environ.get``."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if data is None or encode is None:  # pragma: no cover - an os.environ without them
        return lambda: iter([os.environ.get(n) for n in names])
    return functools.partial(map, data.get, tuple(encode(n) for n in names))
