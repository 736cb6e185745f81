"""The packer: document isolation (against the dense mask), positions, labels, resume, errors."""

import gzip

import numpy as np
import pytest
import torch

from flashmask3.train.data import (IGNORE_INDEX, MASK_TOKEN, DocumentPacker, JsonlCorpus,
                                   build_batch, mask_sparsity, open_corpus, row_layout)

MASK_KINDS = ["causal_document", "document", "shared_question", "prefix_document"]


def _doc_ids(doc_lens):
    return np.repeat(np.arange(len(doc_lens)), doc_lens)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_no_token_sees_another_document(jsonl_corpus, kind):
    """Every attended (i, j) pair of the dense mask lies inside one document piece."""
    packer = DocumentPacker(open_corpus(jsonl_corpus), 256, batch_size=2, seed=3, mask=kind)
    for _ in range(4):
        batch = packer.next_batch()
        dense = batch.mask.to_dense()[:, 0]
        for row, lens in enumerate(batch.doc_lens):
            assert len(lens) > 2, "the fixture corpus should pack several documents per row"
            doc = torch.from_numpy(_doc_ids(lens))
            same_doc = doc[:, None] == doc[None, :]
            assert not bool((dense[row] & ~same_doc).any())
            assert bool(dense[row].diagonal().all()), "every token sees itself"
            if kind == "causal_document":
                causal = torch.ones(256, 256, dtype=torch.bool).tril()
                assert torch.equal(dense[row], same_doc & causal)
            if kind == "document":
                assert torch.equal(dense[row], same_doc)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_labels_and_positions_stay_in_their_segment(jsonl_corpus, kind):
    """Targets are the next token of the same document, never seen by the predicting token
    (bidirectional documents: hidden tokens, replaced by MASK_TOKEN in the input)."""
    packer = DocumentPacker(open_corpus(jsonl_corpus), 200, batch_size=2, seed=1, mask=kind)
    batch = packer.next_batch()
    dense = batch.mask.to_dense()[:, 0]
    if kind == "document":
        hidden = batch.labels != IGNORE_INDEX
        assert 0.05 < hidden.float().mean() < 0.3
        assert bool((batch.tokens[hidden] == MASK_TOKEN).all())
        assert bool((batch.labels[hidden] != MASK_TOKEN).all())
        return
    for row, lens in enumerate(batch.doc_lens):
        doc = _doc_ids(lens)
        lab = batch.labels[row]
        idx = torch.nonzero(lab != IGNORE_INDEX).flatten()
        assert len(idx) > 0
        assert torch.equal(lab[idx], batch.tokens[row, idx + 1])
        assert (doc[idx.numpy()] == doc[idx.numpy() + 1]).all()
        # no target leaks: token i never attends to the token it has to predict
        assert not bool(dense[row, idx, idx + 1].any())
        if kind in ("causal_document", "document", "prefix_document"):
            starts = np.cumsum([0] + lens[:-1])
            expected = np.concatenate([np.arange(n) for n in lens])
            assert np.array_equal(batch.position_ids[row].numpy(), expected)
            assert (batch.position_ids[row].numpy()[starts] == 0).all()


def test_packing_consumes_documents_in_order(tmp_path):
    """Concatenated pieces of one epoch are the corpus documents in the seeded permutation."""
    from tests.train.conftest import write_jsonl
    corpus = JsonlCorpus(write_jsonl(tmp_path / "c.jsonl", n_docs=30))
    total = sum(len(corpus.get(i)) for i in range(len(corpus)))
    packer = DocumentPacker(corpus, 64, seed=5)
    stream = b""
    while len(stream) < total:
        tokens = packer.next_batch().tokens[0].numpy().astype(np.uint8).tobytes()
        stream += tokens
    order = np.random.default_rng((5, 0)).permutation(len(corpus))
    assert stream[:total] == b"".join(corpus.get(int(i)) for i in order)


def test_state_dict_resumes_the_exact_stream(jsonl_corpus):
    a = DocumentPacker(open_corpus(jsonl_corpus), 128, batch_size=2, seed=7)
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(40)]  # crosses an epoch boundary
    assert a.epoch >= 1
    b = DocumentPacker(open_corpus(jsonl_corpus), 128, batch_size=2, seed=7)
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batch()
        assert torch.equal(got.tokens, want.tokens) and got.doc_lens == want.doc_lens
    other = DocumentPacker(open_corpus(jsonl_corpus), 128, batch_size=2, seed=8)
    with pytest.raises(ValueError, match="different corpus, seed"):
        other.load_state_dict(state)


def test_text_directory_skips_binary_and_reads_gzip(text_dir, tmp_path):
    import pathlib
    with gzip.open(pathlib.Path(text_dir) / "notes.txt.gz", "wb") as fh:
        fh.write(b"compressed text")
    corpus = open_corpus(text_dir)
    docs = [corpus.get(i) for i in range(len(corpus))]
    assert b"compressed text" in docs
    assert all(d is None or b"\x00" not in d for d in docs)
    assert sum(d is None for d in docs) == 1  # the binary file
    batch = DocumentPacker(corpus, 300, seed=0).next_batch()
    assert batch.tokens.shape == (1, 300)


def test_default_corpus_needs_no_download():
    corpus = open_corpus("default")
    assert len(corpus) > 100
    batch = DocumentPacker(corpus, 512, seed=0).next_batch()
    assert batch.tokens.shape == (1, 512) and int(batch.tokens.max()) < 256


def test_mask_sparsity_matches_dense(jsonl_corpus):
    batch = DocumentPacker(open_corpus(jsonl_corpus), 128, batch_size=2, seed=0).next_batch()
    stats = mask_sparsity(batch.mask)
    dense = batch.mask.to_dense()
    assert stats["density"] == pytest.approx(dense.float().mean().item())
    causal_pairs = 2 * 128 * 129 // 2
    assert stats["skipped_vs_causal"] == pytest.approx(1 - dense.sum().item() / causal_pairs)


def test_shared_question_layout():
    pos, keep = row_layout([10], "shared_question", num_answers=2)
    # question 5 tokens (positions 0..4), answers of 3 and 2 tokens continue at position 5
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6]
    assert keep.tolist() == [1, 1, 1, 1, 0, 1, 1, 0, 1, 0]
    batch = build_batch([b"abcdefghij" + b"k"], [[10, 1]], "shared_question")
    dense = batch.mask.to_dense()[0, 0]
    assert not bool(dense[8, 5:8].any()), "answer 2 must not see answer 1"
    assert bool(dense[8, :5].all()), "answers see the question"
    assert bool(dense[10, 10]) and not bool(dense[10, :10].any())


@pytest.mark.parametrize("line, match", [
    (b"{not json\n", "line 2: not valid JSON"),
    (b'{"body": "x"}\n', "line 2: missing the text field 'text'"),
    (b'{"text": 3}\n', "line 2: field 'text' must be a string"),
    (b"[1, 2]\n", "line 2: expected a JSON object"),
])
def test_corrupt_jsonl_is_a_clear_error(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + line)
    with pytest.raises(ValueError, match=match):
        open_corpus(str(path))


def test_bad_data_arguments(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        open_corpus(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text files"):
        open_corpus(str(empty))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no documents"):
        open_corpus(str(tmp_path / "blank.jsonl"))
    (tmp_path / "bin.dat").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="empty, binary"):
        open_corpus(str(tmp_path / "bin.dat"))
    with pytest.raises(TypeError, match="data"):
        open_corpus(None)
    with pytest.raises(ValueError, match="mask must be one of"):
        DocumentPacker(open_corpus("default"), 64, mask="diagonal")
    with pytest.raises(ValueError, match="seq_len"):
        DocumentPacker(open_corpus("default"), 0)


def test_mask_picture_shows_skipped_tiles():
    from flashmask3.train.data import mask_picture
    batch = build_batch([b"a" * 64], [[16, 16, 32]], "causal_document")
    pic = mask_picture(batch.mask, cells=4).splitlines()
    assert pic == ["+...", ".+..", "..+.", "..#+"]


def test_ranges_of_plain_and_gzip_files(tmp_path):
    """Units read by range (``max_doc_len``) equal slices of the whole decompressed file."""
    import random
    from flashmask3.train.data import FileCorpus
    text = "".join(random.Random(0).choice("abcdefgh \n") for _ in range(300_000)).encode()
    (tmp_path / "big.txt").write_bytes(text)
    with gzip.open(tmp_path / "big.txt.gz", "wb") as fh:
        fh.write(text)
    corpus = FileCorpus(sorted(tmp_path.iterdir()), "t", max_bytes=200_000)
    for i in range(2):
        assert corpus.size(i) == 200_000
        for start, length in ((0, 256), (70_001, 256), (199_900, 256), (200_000, 10)):
            want = text[start:min(start + length, 200_000)] or None
            assert corpus.get_range(i, start, length) == want, (i, start)
    packer = DocumentPacker(corpus, 1000, seed=0, max_doc_len=256)
    assert len(packer._units) == 2 * 782  # ceil(200_000 / 256) units per file
    assert all(n <= 256 for n in packer.next_batch().doc_lens[0])

