"""Device-side columns of packed / padded batches against the CPU constructors."""

import pytest
import torch

import flashmask3.masks as M
from flashmask3.integrations.packing import (
    document_bounds_from_cu_seqlens, document_bounds_from_position_ids, packed_columns,
    with_key_padding, with_sliding_window)


def _positions(doc_lens, start=0):
    return torch.cat([torch.arange(n) + start for n in doc_lens])


@pytest.mark.parametrize("causal", [True, False])
def test_cu_seqlens_and_position_ids_give_the_constructors_columns(causal):
    docs = [[5, 1, 9, 17], [20, 12]]
    build = M.causal_document_mask if causal else M.document_mask
    expected = build(docs).startend_row_indices
    pos = torch.stack([_positions(d, start=2) for d in docs])
    got_pos = packed_columns(2, 32, "cpu", causal=causal, position_ids=pos)
    cu = torch.tensor([0, 5, 6, 15, 32, 52, 64], dtype=torch.int32)
    got_cu = packed_columns(2, 32, "cpu", causal=causal, cu_seqlens=cu)
    assert torch.equal(got_pos, expected) and torch.equal(got_cu, expected)


def test_tokens_after_the_last_boundary_are_one_document():
    start, end = document_bounds_from_cu_seqlens(torch.tensor([0, 3, 5]), 1, 9)
    assert end.tolist() == [[3, 3, 3, 5, 5, 9, 9, 9, 9]]
    assert start.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 5]]


def test_padding_and_window_match_the_dense_rule():
    s, w = 24, 5
    keep = torch.ones(2, s, dtype=torch.bool)
    keep[0, :7] = False   # left padding
    keep[1, 19:] = False  # right padding
    pos = torch.stack([_positions([10, 14]), _positions([24])])
    cols = packed_columns(2, s, "cpu", position_ids=pos, key_padding=keep, sliding_window=w)
    dense = M.FlashMask(cols, True).to_dense()[:, 0]
    i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)
    expected = same_doc & (j <= i) & (i - j < w) & keep.unsqueeze(1)
    assert torch.equal(dense, expected)


@pytest.mark.parametrize("causal,c", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_key_padding_masks_padding_keys_in_every_layout(causal, c):
    from tests.helpers import random_columns
    cols = random_columns(2, 1, 16, 16, causal, c, seed=c)
    keep = torch.rand(2, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    padded = with_key_padding(cols, causal, keep, 16)
    before = M.FlashMask(cols, causal).to_dense()
    after = M.FlashMask(padded, causal).to_dense()
    assert torch.equal(after, before & keep.view(2, 1, 1, 16))


def test_builders_need_no_host_sync():
    """On meta tensors any .item()/.tolist()/bool() would raise: the builders never read values."""
    pos = torch.empty(3, 40, dtype=torch.int64, device="meta")
    cu = torch.empty(7, dtype=torch.int32, device="meta")
    keep = torch.empty(3, 40, dtype=torch.bool, device="meta")
    for kwargs in ({"position_ids": pos}, {"cu_seqlens": cu}):
        cols = packed_columns(3, 40, "meta", key_padding=keep, sliding_window=8, **kwargs)
        assert cols.shape == (3, 1, 40, 1) and cols.dtype == torch.int32
    assert packed_columns(3, 40, "meta", causal=False, position_ids=pos).shape == (3, 1, 40, 2)
    start, end = document_bounds_from_position_ids(pos)
    assert start.shape == end.shape == (3, 40)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="position_ids"):
        document_bounds_from_position_ids(torch.zeros(5))
    with pytest.raises(ValueError, match="cu_seqlens"):
        document_bounds_from_cu_seqlens(torch.zeros(1), 1, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        with_sliding_window(torch.zeros(1, 1, 4, 1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="bidirectional"):
        packed_columns(1, 4, "cpu", causal=False, sliding_window=2)
