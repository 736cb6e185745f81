"""Document lengths of a real text corpus that every machine with Python has.

One file = one document, ``bytes / 4`` tokens (a common bytes-per-token ratio of BPE
tokenizers): the Python standard library's ``.py`` sources and every file under
``/usr/share/doc``. Used by the CP benchmarks (and importable by the training harness) to build
document masks with realistic length spreads.

    corpus_document_lengths()                       # all documents, sorted path order
    pack_corpus_documents(131072, seed=0)           # lengths of one packed 128K sequence
"""

from __future__ import annotations

import functools
import os
import random
import sysconfig
from typing import Iterable, Optional

BYTES_PER_TOKEN = 4


def default_roots() -> list[tuple[str, Optional[str]]]:
    """``(directory, suffix filter)`` pairs: stdlib ``.py`` files and all of /usr/share/doc."""
    return [(sysconfig.get_paths()["stdlib"], ".py"), ("/usr/share/doc", None)]


def _files(root: str, suffix: Optional[str]) -> Iterable[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if suffix is None or name.endswith(suffix):
                yield os.path.join(dirpath, name)


def corpus_document_lengths(roots=None, *, bytes_per_token: int = BYTES_PER_TOKEN,
                            min_tokens: int = 1) -> list[int]:
    """Token length of every document (regular, non-empty file) under ``roots``.

    ``roots``: directories (str) or ``(directory, suffix)`` pairs; default :func:`default_roots`.
    Deterministic: files are visited in sorted order; symlinks are skipped. The walk is done
    once per process and ``roots`` (~0.1 s each: the scale model packs dozens of sequences).
    """
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    pairs = default_roots() if roots is None else [r if isinstance(r, tuple) else (r, None) for r in roots]
    return list(_lengths(tuple(pairs), bytes_per_token, min_tokens))


@functools.lru_cache(maxsize=8)
def _lengths(pairs: tuple, bytes_per_token: int, min_tokens: int) -> tuple[int, ...]:
    lengths = []
    for root, suffix in pairs:
        for path in _files(root, suffix):
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            size = os.path.getsize(path)
            if size > 0:
                lengths.append(max(min_tokens, size // bytes_per_token))
    if not lengths:
        raise ValueError(f"no documents found under {list(pairs)}")
    return tuple(lengths)


def pack_corpus_documents(total: int, *, seed: int = 0, lengths: Optional[list[int]] = None) -> list[int]:
    """Document lengths of one sequence of ``total`` tokens packed from shuffled corpus documents
    (fixed ``seed``); the last document is cut to fit."""
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    pool = list(corpus_document_lengths() if lengths is None else lengths)
    random.Random(seed).shuffle(pool)
    out, used, i = [], 0, 0
    while used < total:
        n = min(pool[i % len(pool)], total - used)
        out.append(n)
        used += n
        i += 1
    return out


def document_spreads(total: int, *, seed: int = 0) -> dict[str, list[int]]:
    """Document lengths of one ``total``-token sequence for a few realistic spreads.

    * ``short``  -- many short documents (exponential, mean 1K tokens);
    * ``mixed``  -- mostly short with a heavy tail (90% mean 1K, 10% mean 32K);
    * ``long``   -- few long documents (exponential, mean 32K);
    * ``corpus`` -- real files packed (:func:`pack_corpus_documents`).
    All drawn with a fixed ``seed``.
    """
    rng = random.Random(seed)

    def draw(pick_mean) -> list[int]:
        out, used = [], 0
        while used < total:
            n = min(max(1, int(rng.expovariate(1.0 / pick_mean()))), total - used)
            out.append(n)
            used += n
        return out

    return {
        "short": draw(lambda: 1024),
        "mixed": draw(lambda: 32768 if rng.random() < 0.1 else 1024),
        "long": draw(lambda: 32768),
        "corpus": pack_corpus_documents(total, seed=seed),
    }
