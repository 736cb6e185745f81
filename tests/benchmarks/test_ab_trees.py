"""The A/B tool's cell filter (``--cells PASS:D`` or ``PASS:D:MASK``): which cells a GPU run times."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import ab_trees  # noqa: E402


def _cells(text, dims):
    ns = argparse.Namespace(cells=ab_trees._pass_dims(text) if text else None, dims=dims,
                            seqlen=128, batch=1, hidden=256)
    return [(c["D"], c["mask"], c["pass"]) for c in ab_trees.cells(ns)]


def test_pass_and_dim_selects_every_mask_in_dims_order():
    assert _cells("fwd_bwd:256,fwd:64", [256, 64]) == [
        (256, m, "fwd_bwd") for m in ab_trees.MASKS] + [(64, m, "fwd") for m in ab_trees.MASKS]


def test_mask_suffix_selects_one_cell():
    assert _cells("fwd:256:causal_document,fwd_bwd:256,fwd_bwd:64:global_sliding_window",
                  [256, 64]) == [(256, "causal", "fwd_bwd"), (256, "causal_document", "fwd"),
                                 (256, "causal_document", "fwd_bwd"),
                                 (256, "global_sliding_window", "fwd_bwd"),
                                 (64, "global_sliding_window", "fwd_bwd")]


def test_no_filter_is_the_whole_grid():
    assert len(_cells(None, [64, 128])) == 2 * len(ab_trees.MASKS) * len(ab_trees.PASSES)


@pytest.mark.parametrize("bad", ["bwd:64", "fwd:x", "fwd:64:nomask", "fwd:64:causal:extra"])
def test_bad_items_name_the_option(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="--cells"):
        ab_trees._pass_dims(bad)
