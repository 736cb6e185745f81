"""The column-mask layer: semantics, accounting, constructors and validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashmask3.masks as M
from tests.helpers import LAYOUTS, named_masks, random_columns


def literal_allowed(cols, causal, sq, sk):
    """The docs/masks.md table read literally, one element at a time (slow, obviously right)."""
    b, hm, _, c = cols.shape
    out = torch.zeros(b, hm, sq, sk, dtype=torch.bool)
    off = sk - sq
    for bi in range(b):
        for h in range(hm):
            for j in range(sk):
                v = [int(x) for x in cols[bi, h, j]]
                for i in range(sq):
                    if causal and c == 1:
                        masked = i >= v[0] or j > i + off
                    elif causal and c == 2:
                        masked = v[0] <= i < v[1] or j > i + off
                    elif c == 2:
                        masked = i >= v[0] or i < v[1]
                    else:
                        masked = v[0] <= i < v[1] or v[2] <= i < v[3]
                    out[bi, h, i, j] = not masked
    return out


@pytest.mark.parametrize("causal,c", LAYOUTS)
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 4)])
def test_to_dense_matches_the_table(causal, c, sq, sk):
    cols = random_columns(2, 2, sq, sk, causal, c, seed=sq * 31 + sk + c)
    assert torch.equal(M.to_dense(cols, causal, sq), literal_allowed(cols, causal, sq, sk))


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), sq=st.integers(1, 40), sk=st.integers(1, 40),
       heads=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_unmasked_pairs_equals_dense_count(layout, sq, sk, heads, seed):
    causal, c = layout
    cols = random_columns(2, heads, sq, sk, causal, c, seed=seed)
    dense = M.to_dense(cols, causal, sq)
    assert M.unmasked_pairs(cols, causal, sq) == int(dense.sum())
    per_head = M.unmasked_pairs(cols, causal, sq, per_head=True)
    assert torch.equal(per_head, dense.sum(dim=(2, 3)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(6, 6), (4, 9), (9, 4)])
def test_no_mask_counts(causal, sq, sk):
    dense = M.to_dense(None, causal, sq, sk)
    assert M.unmasked_pairs(None, causal, sq, sk) == int(dense.sum())


def test_attention_flops_convention():
    m = M.causal_document_mask([3, 5], num_heads=2)
    pairs = int(m.to_dense().sum())  # over 2 mask heads
    # 8 query heads over 2 mask heads: each mask head serves 4 query heads.
    fwd = M.attention_flops(m.startend_row_indices, True, batch_size=1, num_heads=8, seqlen_q=8,
                            seqlen_k=8, head_dim=16, mode="fwd")
    assert fwd == 4 * 16 * pairs * 4
    assert m.flops(8, 16, "bwd") == pytest.approx(2.5 * fwd)
    assert m.flops(8, 16, "fwd_bwd") == pytest.approx(3.5 * fwd)
    with pytest.raises(ValueError, match="mode"):
        m.flops(8, 16, "backward")


# -- constructors against their natural definitions --------------------------------------------


def _docs_of(lens):
    return torch.arange(len(lens)).repeat_interleave(torch.tensor(lens))


def natural_definitions(s):
    """Dense allowed-matrices built straight from each mask type's plain-language definition."""
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    causal = j <= i
    return i, j, causal


def test_constructors_match_natural_definitions():
    s = 24
    i, j, causal = natural_definitions(s)
    docs = [5, 7, 1, 11]
    d = _docs_of(docs)
    same_doc = d.view(-1, 1) == d.view(1, -1)
    starts = torch.tensor([0, 5, 12, 13]).repeat_interleave(torch.tensor(docs))
    expect = {
        "full": torch.ones(s, s, dtype=torch.bool),
        "causal": causal,
        "window3": causal & (j >= i - 3),
        "window(3,2)": (j >= i - 3) & (j <= i + 2),
        "causal_doc": causal & same_doc,
        "doc": same_doc,
        "prefix_lm": causal | (j < 6),
        "prefix_doc": same_doc & (causal | (j < starts.view(1, -1) + torch.tensor([2, 0, 1, 4]).repeat_interleave(torch.tensor(docs)).view(1, -1))),
        "global_window": (i < 2) | (j < 2) | ((j >= i - 3) & (j <= i + 1)),
        "blockwise": causal & (same_doc | (i >= 13)),
    }
    built = {
        "full": M.full_mask(s),
        "causal": M.causal_mask(s),
        "window3": M.sliding_window_mask(s, 3),
        "window(3,2)": M.sliding_window_mask(s, (3, 2)),
        "causal_doc": M.causal_document_mask(docs),
        "doc": M.document_mask(docs),
        "prefix_lm": M.prefix_lm_mask(s, 6),
        "prefix_doc": M.prefix_document_mask(docs, [2, 0, 1, 4]),
        "global_window": M.global_sliding_window_mask(s, 2, (3, 1)),
        "blockwise": M.causal_blockwise_mask([5, 7, 1, 11]),
    }
    for name, mask in built.items():
        assert torch.equal(mask.to_dense()[0, 0], expect[name]), name


def test_shared_question_semantics():
    # sample 1: question 3, answers 2 and 4; sample 2: question 1, answer 2; 3 padding tokens.
    m = M.shared_question_mask([(3, [2, 4]), (1, [2])], seqlen=15)
    seg = torch.tensor([0] * 3 + [1] * 2 + [2] * 4 + [3] + [4] * 2 + [5] * 3)  # segment id
    sample = torch.tensor([0] * 9 + [1] * 3 + [2] * 3)
    is_q = torch.tensor([1] * 3 + [0] * 6 + [1] + [0] * 2 + [0] * 3).bool()
    i, j = torch.arange(15).view(-1, 1), torch.arange(15).view(1, -1)
    same_sample = sample.view(-1, 1) == sample.view(1, -1)
    visible = same_sample & (is_q.view(1, -1) | (seg.view(-1, 1) == seg.view(1, -1))) & (j <= i)
    assert torch.equal(m.to_dense()[0, 0], visible)


def test_qk_sparse_and_eviction():
    s = 12
    m = M.qk_sparse_mask(s, [[[3, 5]], [[0, 0]]], [[[7, 9]], [[2, 3]]])
    i, j, causal = natural_definitions(s)
    dense = m.to_dense()
    assert torch.equal(dense[0, 0], causal & ~((i >= 3) & (i < 5)) & ~((j >= 7) & (j < 9)))
    assert torch.equal(dense[1, 0], causal & ~((j >= 2) & (j < 3)))
    ev = M.random_eviction_mask(s, batch_size=2, num_heads=3, seed=1)
    lts = ev.startend_row_indices[..., 0]
    assert bool((lts > torch.arange(s)).all()) and bool((lts <= s).all())
    assert not torch.equal(lts[0, 0], lts[1, 2])  # differs per (b, h)
    assert torch.equal(ev.to_dense(), causal & (i < lts.unsqueeze(-2)))


def test_from_cu_seqlens_and_batch_rows():
    m = M.from_cu_seqlens([0, 3, 8, 10])
    assert torch.equal(m.to_dense(), M.causal_document_mask([3, 5, 2]).to_dense())
    mb = M.from_cu_seqlens(torch.tensor([0, 4, 10], dtype=torch.int32), causal=False)
    assert torch.equal(mb.to_dense(), M.document_mask([4, 6]).to_dense())
    per_row = M.causal_document_mask([[2, 8], [5, 5]], num_heads=3)
    assert per_row.startend_row_indices.shape == (2, 3, 10, 1)
    assert per_row.startend_row_indices[1, 2, :, 0].tolist() == [5] * 5 + [10] * 5


def test_named_masks_are_valid_and_sparse_where_expected():
    masks = named_masks(64, batch_size=2, num_heads=2)
    assert set(masks) >= {"full", "causal", "sliding_window", "causal_document", "document",
                          "shared_question", "global_sliding_window", "causal_blockwise",
                          "prefix_lm", "prefix_document", "qk_sparse", "random_eviction"}
    for name, m in masks.items():
        assert m.startend_row_indices.dtype == torch.int32, name
        assert m.unmasked_pairs() == int(m.to_dense().sum()), name
    assert masks["full"].density() == 1.0
    assert masks["causal_document"].density() < masks["causal"].density() < 1.0


def test_constructors_record_the_mean_row_span():
    """Every constructor's mask carries its mean row span (the forward's tile hint), equal to
    the dense mask's attended keys per query row; to(), expand_heads() and with_row_span()
    keep or measure it; a mask built from a tensor has none."""
    masks = named_masks(64, batch_size=2, num_heads=2)
    for name, m in masks.items():
        dense = m.to_dense()
        want = float(dense.sum()) / (dense.shape[0] * dense.shape[1] * dense.shape[2])
        assert m.mean_row_span == pytest.approx(want), name
        assert m.to("cpu").mean_row_span == m.mean_row_span, name
    one = M.causal_document_mask([10, 30, 24])
    assert one.mean_row_span == pytest.approx((10 * 11 + 30 * 31 + 24 * 25) / 2 / 64)
    assert one.expand_heads(3).mean_row_span == one.mean_row_span
    raw = M.FlashMask(one.startend_row_indices, True)
    assert raw.mean_row_span is None and raw.row_span_bucket is None
    assert raw.with_row_span().mean_row_span == pytest.approx(one.mean_row_span)
    assert raw.with_row_span().row_span_bucket == one.row_span_bucket


@pytest.mark.parametrize("span, bucket", [(0.0, 0), (1.0, 0), (1.41, 0), (1.42, 1), (2.0, 2),
                                          (987.0, 19), (1448.0, 20), (1449.0, 21), (2048.0, 22)])
def test_row_span_buckets_are_half_octaves(span, bucket):
    """The bucket torch.compile guards on: floor(2 log2 span); its lower edge is <= the span and
    the next edge above it (the kernels' thresholds sit on edges)."""
    from flashmask3.masks.mask import row_span_bucket, row_span_of_bucket

    assert row_span_bucket(span) == bucket
    assert row_span_of_bucket(bucket) <= max(span, 1.0) < row_span_of_bucket(bucket + 1)
    mask = M.FlashMask(M.causal_mask(8).startend_row_indices, True, mean_row_span=span)
    assert mask.row_span_bucket == bucket


@pytest.mark.parametrize("span, exc", [("12", TypeError), (True, TypeError), (-1.0, ValueError),
                                       (float("nan"), ValueError)])
def test_flashmask_rejects_a_bad_row_span(span, exc):
    cols = M.causal_mask(8).startend_row_indices
    with pytest.raises(exc, match="mean_row_span"):
        M.FlashMask(cols, True, mean_row_span=span)


# -- validation ---------------------------------------------------------------------------------


def _valid(**over):
    kw = dict(causal=True, batch_size=2, seqlen_q=8, seqlen_k=8, num_heads=4)
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "tensor,kw,exc,match",
    [
        ([1, 2], {}, TypeError, "torch.Tensor"),
        (torch.zeros(2, 1, 8, 1, dtype=torch.int64), {}, TypeError, "int32"),
        (torch.zeros(2, 1, 8, 1, dtype=torch.float32), {}, TypeError, "int32"),
        (torch.zeros(2, 8, 1, dtype=torch.int32), {}, ValueError, "4-D"),
        (torch.zeros(2, 1, 8, 4, dtype=torch.int32), {}, ValueError, "C=4"),
        (torch.zeros(2, 1, 8, 1, dtype=torch.int32), {"causal": False}, ValueError, "C=1"),
        (torch.zeros(2, 1, 8, 3, dtype=torch.int32), {"causal": False}, ValueError, "C=3"),
        (torch.zeros(3, 1, 8, 1, dtype=torch.int32), {}, ValueError, "batch"),
        (torch.zeros(2, 1, 7, 1, dtype=torch.int32), {}, ValueError, "seqlen_k"),
        (torch.zeros(2, 3, 8, 1, dtype=torch.int32), {}, ValueError, "mask heads"),
        (torch.full((2, 1, 8, 1), 9, dtype=torch.int32), {}, ValueError, r"\[0, seqlen_q=8\]"),
        (torch.full((2, 1, 8, 1), -1, dtype=torch.int32), {}, ValueError, r"\[0, seqlen_q=8\]"),
    ],
)
def test_validation_rejects_bad_masks(tensor, kw, exc, match):
    with pytest.raises(exc, match=match):
        M.validate_startend_row_indices(tensor, **_valid(**kw))


def test_validation_accepts_every_layout():
    for causal, c in LAYOUTS:
        cols = random_columns(2, 4, 8, 8, causal, c)
        M.validate_startend_row_indices(cols, **_valid(causal=causal))


@pytest.mark.parametrize(
    "build,exc",
    [
        (lambda: M.causal_document_mask([]), TypeError),
        (lambda: M.causal_document_mask([3, 0]), ValueError),
        (lambda: M.causal_document_mask([3, 2.5]), TypeError),
        (lambda: M.causal_document_mask([[3, 2], [4]]), ValueError),
        (lambda: M.sliding_window_mask(8, -1), ValueError),
        (lambda: M.sliding_window_mask(8, "3"), TypeError),
        (lambda: M.prefix_document_mask([4, 4], [5, 0]), ValueError),
        (lambda: M.prefix_document_mask([4, 4], [1]), ValueError),
        (lambda: M.shared_question_mask([(3, [])]), ValueError),
        (lambda: M.shared_question_mask([(3, [4])], seqlen=5), ValueError),
        (lambda: M.global_sliding_window_mask(8, 9, 2), ValueError),
        (lambda: M.qk_sparse_mask(8, [[[5, 3]]], [[[0, 0]]]), ValueError),
        (lambda: M.qk_sparse_mask(8, [[[0, 3]]], [[[0, 0]], [[0, 0]]]), ValueError),
        (lambda: M.from_cu_seqlens([0, 3, 3]), ValueError),
        (lambda: M.full_mask(0), ValueError),
    ],
)
def test_constructors_reject_bad_arguments(build, exc):
    with pytest.raises(exc):
        build()


def test_to_dense_takes_a_flashmask_or_columns():
    """``masks.to_dense(mask)`` and ``mask.to_dense()`` give the same dense mask as the column
    form; conflicting or missing arguments are clear errors."""
    mask = M.causal_document_mask([5, 9, 3], batch_size=2)
    want = M.to_dense(mask.startend_row_indices, True, 17)
    assert want.shape == (2, 1, 17, 17) and want.any() and not want.all()
    assert torch.equal(M.to_dense(mask), want) and torch.equal(mask.to_dense(), want)
    assert torch.equal(M.to_dense(mask, True, 17), want)
    with pytest.raises(ValueError, match="causal"):
        M.to_dense(mask, False)
    with pytest.raises(ValueError, match="seqlen_q"):
        M.to_dense(mask, True, 16)
    with pytest.raises(TypeError, match="causal and seqlen_q"):
        M.to_dense(mask.startend_row_indices)


@pytest.mark.parametrize("window", [0, 1, 7, 200])
def test_with_window_is_the_mask_and_a_causal_band(window):
    """``with_window``: a causal single-column mask AND the band ``j >= i - window`` (dense
    check), the same as ``sliding_window_mask`` on a plain causal mask."""
    s = 160
    i = torch.arange(s)
    band = (i.view(-1, 1) - i.view(1, -1)) <= window
    for mask in (M.causal_mask(s), M.causal_document_mask([[50, 90, 20], [160]], num_heads=2)):
        got = M.to_dense(M.with_window(mask, window))
        assert torch.equal(got, M.to_dense(mask) & band)
    assert torch.equal(M.to_dense(M.with_window(M.causal_mask(s), window)),
                       M.to_dense(M.sliding_window_mask(s, window)))
    with pytest.raises(ValueError, match="causal mask"):
        M.with_window(M.document_mask([80, 80]), window)
    with pytest.raises(ValueError, match="single-column"):
        M.with_window(M.causal_blockwise_mask([60, 60, 40]), window)
    with pytest.raises(ValueError, match="window"):
        M.with_window(M.causal_mask(s), -1)


def test_pad_to_masks_the_padding_keys_and_keeps_the_real_rows():
    """``pad_to``: for every mask layout, the real rows attend exactly as before and no row
    attends a padding key; a shorter length or a cross-attention mask is an error."""
    for name, mask in named_masks(64, batch_size=2, num_heads=2).items():
        padded = M.pad_to(mask, 80)
        assert padded.seqlen_q == padded.seqlen_k == 80 and padded.causal == mask.causal, name
        dense, before = M.to_dense(padded), M.to_dense(mask)
        assert torch.equal(dense[..., :64, :64], before), name
        assert not dense[..., 64:].any(), name
    assert M.pad_to(mask, 64) is mask
    with pytest.raises(ValueError, match="shorter"):
        M.pad_to(mask, 63)
    with pytest.raises(TypeError, match="FlashMask"):
        M.pad_to(mask.startend_row_indices, 80)
