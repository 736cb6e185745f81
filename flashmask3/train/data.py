"""Real documents -> packed fixed-length sequences with per-document positions and masks.

Pipeline: a *corpus* (indexable documents as bytes) -> byte-level tokens -> a *packer* that
fills sequences of ``seq_len`` tokens with whole documents, splitting a document that does not
fit at the sequence boundary (the rest opens the next sequence as a new piece). Every piece is a
document of its own: position ids restart at 0 and the mask keeps it apart from its
neighbours, so no token ever attends to another document.

The default corpus needs no download: the Python standard library sources and the text files
under ``/usr/share/doc`` (gzip files are decompressed). Any directory of text files, a single
text file, or a JSONL file (one JSON object with a text field, or a JSON string, per line) can
be used instead.

The packer is deterministic given its seed and its state (epoch, cursor, offset), which is
what a checkpoint stores for exact resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from flashmask3 import masks as fm_masks

IGNORE_INDEX = -100
MASK_TOKEN = 0          # NUL: never in text documents (binary files are skipped)
MLM_FRACTION = 0.15     # bidirectional documents: share of tokens hidden and predicted
DEFAULT_DOC_DIRS = ("/usr/share/doc",)
_TEXT_SUFFIXES = {"", ".txt", ".md", ".rst", ".py", ".c", ".h", ".html", ".sh", ".pl", ".gz",
                  ".json", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".css", ".js", ".tex"}
_MAX_FILE_BYTES = 4 << 20          # a longer file is cut here (a directory or a text file)
DEFAULT_MAX_DOC_BYTES = 256 << 10  # default corpus: keeps huge changelogs from dominating
_HEAD = 4096                       # bytes checked for NUL (binary files are skipped)


# -- corpora -----------------------------------------------------------------------------------

class Corpus:
    """Indexable documents. ``get(i)`` returns the bytes of document i, or None to skip it."""

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, index: int) -> Optional[bytes]:
        raise NotImplementedError

    def get_range(self, index: int, start: int, length: int) -> Optional[bytes]:
        """Bytes ``[start, start + length)`` of document ``index`` (None: skip)."""
        doc = self.get(index)
        return None if doc is None else (doc[start:start + length] or None)

    def fingerprint(self) -> str:
        """A short hash that identifies the corpus (checked on resume)."""
        raise NotImplementedError

    def size(self, index: int) -> int:
        """Expected byte length of document ``index`` without reading it (0 if unknown)."""
        raise NotImplementedError


def _read_prefix(path: Path, n: int) -> bytes:
    """The first ``n`` bytes of a file, decompressing ``.gz`` files only as far as needed."""
    if path.suffix != ".gz":
        with open(path, "rb") as fh:
            return fh.read(n)
    out, total = [], 0
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    with open(path, "rb") as fh:
        while total < n and not d.eof:
            block = fh.read(1 << 16)
            if not block:
                break
            piece = d.decompress(block, n - total)
            while piece:
                out.append(piece)
                total += len(piece)
                if total >= n or not d.unconsumed_tail:
                    break
                piece = d.decompress(d.unconsumed_tail, n - total)
    return b"".join(out)[:n]


class FileCorpus(Corpus):
    """One document per file (``.gz`` decompressed), read lazily, cut at ``max_bytes``.

    Binary files (a NUL byte in the first 4 KiB) and empty or unreadable files are skipped.
    """

    def __init__(self, paths: Sequence[Path], name: str, max_bytes: int = _MAX_FILE_BYTES):
        if not paths:
            raise ValueError(f"data {name!r}: no text files found")
        self.paths = list(paths)
        self.name = name
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self.paths)

    def get(self, index: int) -> Optional[bytes]:
        return self.get_range(index, 0, self.max_bytes)

    def get_range(self, index: int, start: int, length: int) -> Optional[bytes]:
        path = self.paths[index]
        end = min(start + length, self.max_bytes)
        try:
            if path.suffix == ".gz":
                data = _read_prefix(path, max(end, _HEAD))
                head, piece = data[:_HEAD], data[start:end]
            else:
                with open(path, "rb") as fh:
                    head = fh.read(_HEAD)
                    fh.seek(start)
                    piece = fh.read(max(0, end - start))
        except (OSError, EOFError, zlib.error):
            return None
        if not head or b"\x00" in head or not piece:
            return None
        return piece

    def size(self, index: int) -> int:
        path = self.paths[index]
        try:
            if path.suffix == ".gz":  # the gzip trailer holds the uncompressed size mod 2**32
                with open(path, "rb") as fh:
                    fh.seek(-4, os.SEEK_END)
                    return min(int.from_bytes(fh.read(4), "little"), self.max_bytes)
            return min(path.stat().st_size, self.max_bytes)
        except OSError:
            return 0

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"max_bytes={self.max_bytes}\n".encode())
        for p in self.paths:
            h.update(str(p).encode("utf-8", "surrogateescape") + b"\n")
        return h.hexdigest()[:16]


class JsonlCorpus(Corpus):
    """One document per JSONL line, parsed up front so a bad line fails early with its number."""

    def __init__(self, path: Path, text_key: str = "text"):
        self.path = path
        self.docs: list[bytes] = []
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                digest.update(line)
                if not line.strip():
                    continue
                self.docs.append(_jsonl_text(line, text_key, path, lineno).encode("utf-8"))
        if not self.docs:
            raise ValueError(f"data file {str(path)!r} holds no documents")
        self._fingerprint = digest.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.docs)

    def get(self, index: int) -> Optional[bytes]:
        return self.docs[index] or None

    def size(self, index: int) -> int:
        return len(self.docs[index])

    def fingerprint(self) -> str:
        return self._fingerprint


def _jsonl_text(line: bytes, text_key: str, path: Path, lineno: int) -> str:
    """The text of one JSONL line: a JSON string, or an object's ``text_key`` string field."""
    where = f"data file {str(path)!r}, line {lineno}"
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object or string, got {type(obj).__name__}")
    if text_key not in obj:
        raise ValueError(f"{where}: missing the text field {text_key!r} (set --text-key)")
    if not isinstance(obj[text_key], str):
        raise ValueError(f"{where}: field {text_key!r} must be a string")
    return obj[text_key]


def default_corpus_paths() -> list[Path]:
    """Text files every Linux machine with Python has: stdlib ``.py`` files + /usr/share/doc."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = _walk(stdlib, lambda p: p.suffix == ".py", skip_dirs={"site-packages", "__pycache__"})
    for root in DEFAULT_DOC_DIRS:
        paths += _walk(Path(root), lambda p: p.suffix.lower() in _TEXT_SUFFIXES)
    return paths


def _walk(root: Path, keep, skip_dirs=frozenset()) -> list[Path]:
    """Sorted regular files under ``root`` accepted by ``keep`` (no symlinked directories)."""
    out = []
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if keep(p) and p.is_file() and not p.is_symlink():
                out.append(p)
    return out


def open_corpus(data: str = "default", text_key: str = "text") -> Corpus:
    """``'default'``, a directory, a text file or a ``.jsonl`` file -> a Corpus."""
    if not isinstance(data, str) or not data:
        raise TypeError(f"data must be a non-empty string, got {data!r}")
    if data == "default":
        return FileCorpus(default_corpus_paths(), "default", DEFAULT_MAX_DOC_BYTES)
    path = Path(data)
    if path.is_dir():
        return FileCorpus(_walk(path, lambda p: True), data)
    if not path.is_file():
        raise ValueError(f"data path {data!r} does not exist")
    if path.suffix in (".jsonl", ".ndjson") or path.name.endswith(".jsonl.gz"):
        return JsonlCorpus(path, text_key)
    corpus = FileCorpus([path], data)
    if corpus.get(0) is None:
        raise ValueError(f"data file {data!r} is empty, binary or unreadable")
    return corpus


# -- packing -----------------------------------------------------------------------------------

@dataclass
class PackedBatch:
    """One training batch: ``[B, S]`` tensors, the document pieces of each row and the mask."""

    tokens: torch.Tensor        # int64 [B, S] byte ids
    labels: torch.Tensor        # int64 [B, S] next token in the same segment, else IGNORE_INDEX
    position_ids: torch.Tensor  # int64 [B, S] restarting at 0 in every document
    doc_lens: list[list[int]]   # per row, lengths of the document pieces (sum = S)
    mask: fm_masks.FlashMask    # [B, 1, S, C]

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.tokens.to(device), self.labels.to(device),
                           self.position_ids.to(device), self.doc_lens, self.mask.to(device))


class DocumentPacker:
    """Packs shuffled corpus documents into ``batch_size`` x ``seq_len`` batches.

    Each epoch walks *units* in a permutation of ``np.random.default_rng((seed, epoch))``:
    whole documents, or with ``max_doc_len`` the consecutive ``max_doc_len``-byte pieces of
    every document (each then a document of its own, shuffled independently, so a batch mixes
    many files). Row ``r`` of every batch is fed by its own *row stream*: the units at
    permutation positions ``r, r + batch_size, r + 2·batch_size, ...``. A unit that does not fit
    in the rest of a row is split there and continues the next row of the same stream.

    Row streams make the data of a row independent of the others, so a data-parallel group
    that trains on rows ``rows`` (a range of the global batch) packs only those rows and reads
    only their documents, and still sees exactly the rows a single process would
    (``rows=None``: all of them). ``state_dict()`` / ``load_state_dict()`` capture the exact
    position of every stream the packer holds.
    """

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int = 1, *, seed: int = 0,
                 mask: str = "causal_document", prefix_frac: float = 0.5, num_answers: int = 2,
                 max_doc_len: int = 0, rows: Optional[range] = None):
        if not isinstance(corpus, Corpus):
            raise TypeError(f"corpus must be a Corpus, got {type(corpus).__name__}")
        if not isinstance(max_doc_len, int) or max_doc_len < 0:
            raise ValueError(f"max_doc_len must be an int >= 0, got {max_doc_len!r}")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size),
                            ("num_answers", num_answers)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if mask not in MASK_BUILDERS:
            raise ValueError(f"mask must be one of {sorted(MASK_BUILDERS)}, got {mask!r}")
        rows = range(batch_size) if rows is None else rows
        if (not isinstance(rows, range) or len(rows) == 0 or rows.start < 0
                or rows.stop > batch_size or rows.step != 1):
            raise ValueError(f"rows must be a non-empty range inside range({batch_size}), "
                             f"got {rows!r}")
        self.corpus, self.seq_len, self.batch_size, self.seed = corpus, seq_len, batch_size, seed
        self.mask_kind, self.prefix_frac, self.num_answers = mask, prefix_frac, num_answers
        self.max_doc_len = max_doc_len
        self.rows = rows
        self._units = self._make_units() if max_doc_len else None
        if self._num_units() < batch_size:
            raise ValueError(f"the corpus has {self._num_units()} documents (units), fewer than "
                             f"batch_size={batch_size} rows: use a larger corpus or --max-doc-len")
        # per row stream: [epoch, cursor (index into the stream's units), offset in the unit]
        self._pos = {r: [0, 0, 0] for r in rows}
        self._perms: dict[int, np.ndarray] = {}

    # -- state --------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the slowest row stream this packer holds."""
        return min(p[0] for p in self._pos.values())

    def state_dict(self) -> dict:
        return {"streams": {str(r): list(p) for r, p in self._pos.items()},
                "seed": self.seed, "corpus": self.corpus.fingerprint(),
                "max_doc_len": self.max_doc_len, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore the data position of this packer's rows; the corpus, seed, max_doc_len and
        batch_size must be the ones it was saved with (``state`` may hold more rows: the merged
        state of several data-parallel groups)."""
        for key in ("streams", "seed", "corpus"):
            if key not in state:
                raise ValueError(f"data state is missing {key!r}")
        if (state["corpus"] != self.corpus.fingerprint() or state["seed"] != self.seed
                or state.get("max_doc_len", 0) != self.max_doc_len):
            raise ValueError("data state was saved for a different corpus, seed or max_doc_len; "
                             "resume with the same --data, --seed and --max-doc-len")
        if state.get("batch_size") != self.batch_size:
            raise ValueError(f"data state was saved with batch_size={state.get('batch_size')}, "
                             f"this run has batch_size={self.batch_size}")
        missing = [r for r in self.rows if str(r) not in state["streams"]]
        if missing:
            raise ValueError(f"data state holds no position for rows {missing}")
        self._pos = {r: list(state["streams"][str(r)]) for r in self.rows}

    def _make_units(self) -> np.ndarray:
        """``[n_units, 2]`` (document, byte start) for documents cut at ``max_doc_len``."""
        step = self.max_doc_len
        units = [(d, start) for d in range(len(self.corpus))
                 for start in range(0, max(1, self.corpus.size(d)), step)]
        return np.asarray(units, dtype=np.int64).reshape(-1, 2)

    def _num_units(self) -> int:
        return len(self.corpus) if self._units is None else len(self._units)

    def _unit(self, u: int) -> Optional[bytes]:
        if self._units is None:
            return self.corpus.get(u)
        doc, start = self._units[u]
        return self.corpus.get_range(int(doc), int(start), self.max_doc_len)

    def _permutation(self, epoch: int) -> np.ndarray:
        """The unit order of ``epoch`` (cached: the row streams share it)."""
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(
                self._num_units())
        return self._perms[epoch]

    # -- packing ------------------------------------------------------------------------------
    def _next_piece(self, row: int, room: int) -> bytes:
        """Up to ``room`` bytes of row stream ``row``'s current unit; advances its position."""
        pos = self._pos[row]
        skipped = 0
        while True:
            index = row + pos[1] * self.batch_size
            if index >= self._num_units():
                pos[:] = [pos[0] + 1, 0, 0]
                continue
            doc = self._unit(int(self._permutation(pos[0])[index]))
            if doc is not None and pos[2] < len(doc):
                piece = doc[pos[2]:pos[2] + room]
                pos[2] += len(piece)
                if pos[2] >= len(doc):
                    pos[1], pos[2] = pos[1] + 1, 0
                return piece
            pos[1], pos[2] = pos[1] + 1, 0
            skipped += 1
            if skipped > 2 * self._num_units():
                raise ValueError("corpus has no readable (non-empty, non-binary) documents")

    def next_row(self, row: int = 0) -> tuple[bytes, list[int]]:
        """One sequence of row stream ``row``: ``seq_len`` bytes and its document pieces."""
        parts, lens, used = [], [], 0
        while used < self.seq_len:
            piece = self._next_piece(row, self.seq_len - used)
            parts.append(piece)
            lens.append(len(piece))
            used += len(piece)
        return b"".join(parts), lens

    def next_batch(self) -> PackedBatch:
        """The next rows of this packer's streams (``len(self.rows)`` sequences)."""
        rows, rngs = [], []
        for r in self.rows:
            # the masked-token choice (bidirectional documents) is a function of the position
            rngs.append(np.random.default_rng((self.seed, r, *self._pos[r], 1)))
            rows.append(self.next_row(r))
        return build_batch([r[0] for r in rows], [r[1] for r in rows], self.mask_kind,
                           prefix_frac=self.prefix_frac, num_answers=self.num_answers, rng=rngs)

    def __iter__(self):
        while True:
            yield self.next_batch()


# -- segments, labels, positions, masks -------------------------------------------------------

def _split_answers(n: int, num_answers: int) -> tuple[int, list[int]]:
    """Shared question layout of an n-token document: first half question, rest answers."""
    q = max(1, n // 2)
    rest = n - q
    k = min(num_answers, rest)
    if k == 0:
        return n, []
    base, extra = divmod(rest, k)
    return q, [base + (1 if i < extra else 0) for i in range(k)]


def _prefix_len(n: int, frac: float) -> int:
    return min(n, int(round(n * frac)))


def row_layout(doc_lens: Sequence[int], kind: str, *, prefix_frac: float = 0.5,
               num_answers: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Position ids and a label-keep flag for one row (the per-token part of the mask kinds).

    Labels are next-token targets that stay inside one causal segment: a document for the
    document masks, the question or one answer for ``shared_question`` (answers continue the
    question's positions); for ``prefix_document`` the prefix tokens before the last one are not
    targets (they see their successors).
    """
    total = int(sum(doc_lens))
    pos = np.zeros(total, dtype=np.int64)
    keep = np.zeros(total, dtype=bool)  # keep[i]: token i has target token i + 1
    start = 0
    for n in doc_lens:
        if kind == "shared_question":
            q, answers = _split_answers(n, num_answers)
            pos[start:start + q] = np.arange(q)
            keep[start:start + q - 1] = True
            a0 = start + q
            for a in answers:
                pos[a0:a0 + a] = q + np.arange(a)
                keep[a0:a0 + a - 1] = True
                a0 += a
        else:
            pos[start:start + n] = np.arange(n)
            keep[start:start + n - 1] = True
            if kind == "prefix_document":
                keep[start:start + max(0, _prefix_len(n, prefix_frac) - 1)] = False
        start += n
    return pos, keep


def build_mask(doc_lens: list[list[int]], kind: str, *, prefix_frac: float = 0.5,
               num_answers: int = 2) -> fm_masks.FlashMask:
    """The FlashMask of a packed batch for one of the supported mask kinds."""
    if kind not in MASK_BUILDERS:
        raise ValueError(f"mask must be one of {sorted(MASK_BUILDERS)}, got {kind!r}")
    return MASK_BUILDERS[kind](doc_lens, prefix_frac, num_answers)


def _shared_question(doc_lens, prefix_frac, num_answers):
    """Shared-question mask: each document piece is one (question, answers) sample."""
    samples = [[_split_answers(n, num_answers) for n in lens] for lens in doc_lens]
    if all(answers for row in samples for _, answers in row):
        return fm_masks.shared_question_mask(samples, seqlen=sum(doc_lens[0]))
    # Rare: a one-token piece has no answer, which the constructor does not accept. Its causal
    # column is the same as a question's (LTS = its end), so write the LTS column directly.
    cols = []
    for row in samples:
        lts, start = [], 0
        for q, answers in row:
            end = start + q + sum(answers)
            lts += [end] * q
            a0 = start + q
            for a in answers:
                lts += [a0 + a] * a
                a0 += a
            start = end
        cols.append(torch.tensor(lts, dtype=torch.int32).view(1, -1, 1))
    return fm_masks.FlashMask(torch.stack(cols), True)


MASK_BUILDERS = {
    "causal_document": lambda d, f, k: fm_masks.causal_document_mask(d),
    "document": lambda d, f, k: fm_masks.document_mask(d),
    "prefix_document": lambda d, f, k: fm_masks.prefix_document_mask(
        d, [[_prefix_len(n, f) for n in lens] for lens in d]),
    "shared_question": _shared_question,
}


def build_batch(rows: list[bytes], doc_lens: list[list[int]], kind: str, *,
                prefix_frac: float = 0.5, num_answers: int = 2,
                rng=None) -> PackedBatch:
    """Tensors + mask for packed rows of bytes with the given document pieces.

    Causal kinds get next-token targets inside each segment. Bidirectional documents would see
    their next token, so they get a masked-token objective instead: ``MLM_FRACTION`` of the
    tokens (chosen by ``rng``: one Generator, or one per row) are replaced by ``MASK_TOKEN`` in
    the input and are the targets.
    """
    seq_len = len(rows[0])
    if any(len(r) != seq_len or sum(d) != seq_len for r, d in zip(rows, doc_lens)):
        raise ValueError("every row must have seq_len bytes and doc_lens summing to seq_len")
    tokens = torch.from_numpy(np.stack([np.frombuffer(r, dtype=np.uint8) for r in rows])).long()
    positions, labels = [], []
    for r, lens in enumerate(doc_lens):
        pos, keep = row_layout(lens, kind, prefix_frac=prefix_frac, num_answers=num_answers)
        lab = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        lab[:-1][keep[:-1]] = tokens[r, 1:].numpy()[keep[:-1]]
        positions.append(pos)
        labels.append(lab)
    labels = np.stack(labels)
    if kind == "document":
        rng = rng if rng is not None else np.random.default_rng(0)
        if isinstance(rng, (list, tuple)):
            hidden = np.stack([g.random(seq_len) for g in rng]) < MLM_FRACTION
        else:
            hidden = rng.random(tokens.shape) < MLM_FRACTION
        labels = np.where(hidden, tokens.numpy(), IGNORE_INDEX)
        tokens = tokens.masked_fill(torch.from_numpy(hidden), MASK_TOKEN)
    mask = build_mask(doc_lens, kind, prefix_frac=prefix_frac, num_answers=num_answers)
    return PackedBatch(tokens, torch.from_numpy(labels),
                       torch.from_numpy(np.stack(positions)), [list(d) for d in doc_lens], mask)


def mask_sparsity(mask: fm_masks.FlashMask) -> dict[str, float]:
    """Fraction of (query, key) pairs the mask skips, vs. full attention and vs. plain causal."""
    s = mask.seqlen_q
    total = mask.batch_size * mask.num_heads * s * s
    causal_pairs = mask.batch_size * mask.num_heads * s * (s + 1) // 2
    pairs = mask.unmasked_pairs()
    return {"density": pairs / total, "sparsity": 1.0 - pairs / total,
            "skipped_vs_causal": max(0.0, 1.0 - pairs / causal_pairs)}


def make_packer(cfg, rows: Optional[range] = None) -> DocumentPacker:
    """The packer a TrainConfig describes; ``rows``: the global batch rows it packs (a
    data-parallel group's share; default all)."""
    corpus = open_corpus(cfg.data, cfg.text_key)
    return DocumentPacker(corpus, cfg.seq_len, cfg.batch_size, seed=cfg.seed, mask=cfg.mask,
                          prefix_frac=cfg.prefix_frac, num_answers=cfg.num_answers,
                          max_doc_len=cfg.max_doc_len, rows=rows)


def mask_picture(mask: fm_masks.FlashMask, row: int = 0, cells: int = 32) -> str:
    """Text picture of one row's mask at tile level (``cells`` x ``cells`` tiles).

    ``#`` a tile the kernel computes without masking, ``+`` one it masks element-wise, ``.``
    one it skips entirely (rows = queries, columns = keys), from the same tile classification
    the kernels use.
    """
    s = mask.seqlen_q
    block = max(1, -(-s // cells))
    cls = fm_masks.classify_tiles(mask.startend_row_indices[row:row + 1, :1], mask.causal, s,
                                  mask.seqlen_k, block, block)[0, 0]
    glyph = {fm_masks.SKIP: ".", fm_masks.PARTIAL: "+", fm_masks.UNMASKED: "#"}
    return "\n".join("".join(glyph[int(c)] for c in line) for line in cls)

