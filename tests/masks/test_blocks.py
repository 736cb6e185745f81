"""Block summaries and the tile classification rule, checked against the dense mask."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashmask3.masks as M
from flashmask3.masks import PARTIAL, SKIP, UNMASKED
from tests.helpers import LAYOUTS, named_masks, random_columns


def dense_tile_truth(allowed, block_m, block_n):
    """Per tile: does it hold any allowed element / any masked element? From the dense mask."""
    b, hm, sq, sk = allowed.shape
    nq, nk = -(-sq // block_m), -(-sk // block_n)
    any_allowed = torch.zeros(b, hm, nq, nk, dtype=torch.bool)
    any_masked = torch.zeros_like(any_allowed)
    for qi in range(nq):
        for ki in range(nk):
            tile = allowed[:, :, qi * block_m:(qi + 1) * block_m, ki * block_n:(ki + 1) * block_n]
            any_allowed[:, :, qi, ki] = tile.flatten(2).any(-1)
            any_masked[:, :, qi, ki] = (~tile).flatten(2).any(-1)
    return any_allowed, any_masked


def assert_classification_sound(cols, causal, sq, sk, bm, bn):
    cls = M.classify_tiles(cols, causal, sq, sk, bm, bn)
    allowed = M.to_dense(cols, causal, sq, sk)
    any_allowed, any_masked = dense_tile_truth(allowed.expand(cls.shape[0], cls.shape[1], -1, -1), bm, bn)
    cls = cls.expand_as(any_allowed)
    # Soundness: a skipped tile holds nothing to compute, an unmasked tile nothing to mask.
    assert not bool((any_allowed & (cls == SKIP)).any()), "a SKIP tile has an allowed element"
    assert not bool((any_masked & (cls == UNMASKED)).any()), "an UNMASKED tile has a masked element"
    return cls, any_allowed, any_masked


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), sq=st.integers(1, 50), sk=st.integers(1, 50),
       bm=st.sampled_from([1, 4, 8, 16]), bn=st.sampled_from([1, 4, 8, 16]), seed=st.integers(0, 9999))
def test_classification_is_sound_on_random_masks(layout, sq, sk, bm, bn, seed):
    causal, c = layout
    cols = random_columns(2, 2, sq, sk, causal, c, seed=seed)
    assert_classification_sound(cols, causal, sq, sk, bm, bn)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(40, 40), (24, 40), (40, 24)])
def test_classification_without_mask(causal, sq, sk):
    cls = M.classify_tiles(None, causal, sq, sk, 8, 8)
    allowed = M.to_dense(None, causal, sq, sk)
    any_allowed, any_masked = dense_tile_truth(allowed, 8, 8)
    # With no mask the rule is exact: it matches the dense truth tile for tile.
    expect = torch.where(~any_allowed, SKIP, torch.where(any_masked, PARTIAL, UNMASKED)).to(torch.int8)
    assert torch.equal(cls, expect)


@pytest.mark.parametrize("name", list(named_masks(64)))
def test_classification_is_exact_on_named_masks(name):
    """On the named masks the conservative rule loses no skip at block granularity."""
    m = named_masks(64)[name]
    cls, any_allowed, any_masked = assert_classification_sound(
        m.startend_row_indices, m.causal, 64, 64, 8, 8)
    assert torch.equal(cls == SKIP, ~any_allowed), name
    if name in ("causal_document", "document", "sliding_window", "causal"):
        assert bool((cls == SKIP).any()) and bool((cls == UNMASKED).any()), name


def test_summary_shapes_and_padding():
    cols = random_columns(1, 2, 20, 21, False, 4, seed=3)
    s = M.block_summary(cols, 8)
    assert s.col_min.shape == (1, 2, 3, 4)
    assert torch.equal(s.col_min[:, :, 2], cols[:, :, 16:].amin(2))
    assert torch.equal(s.col_max[:, :, 0], cols[:, :, :8].amax(2))


def test_live_ranges_cover_every_live_tile():
    m = M.causal_document_mask([10, 30, 24])
    cls = M.classify_tiles(m.startend_row_indices, True, 64, 64, 8, 8)
    lo, hi = M.live_kv_block_range(cls)
    live = (cls != SKIP)[0, 0]
    for qi in range(8):
        idx = live[qi].nonzero().flatten()
        assert lo[qi] == idx.min() and hi[qi] == idx.max() + 1
    qlo, qhi = M.live_q_block_range(cls)
    for ki in range(8):
        idx = live[:, ki].nonzero().flatten()
        assert qlo[ki] == idx.min() and qhi[ki] == idx.max() + 1
