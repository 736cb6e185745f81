"""Shared fixtures of the training-harness tests: small corpora with many short documents."""

import json
import random

import pytest


def write_jsonl(path, n_docs=200, min_len=3, max_len=90, seed=0):
    """A JSONL corpus of ``n_docs`` short ASCII documents (deterministic)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "mask", "token", "rank", "flash", "doc", "x"]
    with open(path, "w") as fh:
        for i in range(n_docs):
            n = rng.randint(min_len, max_len)
            text = (f"#{i} " + " ".join(rng.choice(words) for _ in range(n)))[:n]
            fh.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture
def jsonl_corpus(tmp_path):
    return str(write_jsonl(tmp_path / "docs.jsonl"))


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    for i in range(12):
        (d / f"f{i:02d}.txt").write_text(f"file {i}: " + "lorem ipsum " * (3 + 7 * i))
    (d / "blob.bin").write_bytes(b"\x00\x01binary" * 10)
    return str(d)
