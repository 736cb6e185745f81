"""The experiment's kernel costs per model (benchmarks/scale_model/experiment.py)."""

import pytest

from benchmarks.scale_model import experiment as X


def test_costs_for_heads_interpolates_both_families():
    """Costs.for_heads gives a model its group's costs (the 7B's 4:1 between the MHA and 8:1
    fits); a variant applied through Costs.mapped reaches both of flashmask3's fits."""
    from benchmarks.scale_model import calibrate as C

    costs = X.default_costs(gqa=True)
    assert costs.for_heads(32, 4).flashmask3 == costs.flashmask3  # the GQA fit's own group
    four = costs.for_heads(32, 8)
    assert four.flashmask3 == C.between(costs.flashmask3_mha, costs.flashmask3, 4)
    assert four.flex == C.between(costs.flex_mha, costs.flex, 4)
    assert costs.for_heads(16, 16).flashmask3 == costs.flashmask3_mha
    longest = costs.mapped(lambda c: C.variant(c, order="longest"))
    assert longest.flashmask3.fwd.order == longest.flashmask3_mha.fwd.order == "longest"
    assert longest.for_heads(32, 8).flashmask3.bwd.order == "longest"
    with pytest.raises(ValueError, match="kv_heads"):
        costs.for_heads(32, 6)


def test_gpu_slowed_scales_gpu_time_and_keeps_the_host():
    """The power-cap variant: every fit's GPU time x f exactly (tiles, programs, blocks, call),
    the host floor as it was, so a host-bound call keeps its time."""
    from benchmarks.scale_model.layout import TileCounts

    costs = X.default_costs(gqa=True)
    slow = costs.gpu_slowed(1.2)
    big, tiny = TileCounts(40_000, 600, 8192, 65536), TileCounts(20, 4, 256, 512)
    for name in ("flashmask3", "flex", "flashmask3_mha", "flex_mha"):
        c, s = getattr(costs, name), getattr(slow, name)
        assert s.fwd.floor == c.fwd.floor and s.bwd.floor == c.bwd.floor
        for heads, kv in ((32, 4), (16, 16)):
            assert s.gpu_forward(big, heads, kv) == pytest.approx(1.2 * c.gpu_forward(big, heads, kv), rel=1e-12)
            assert s.gpu_backward(big, heads, kv) == pytest.approx(1.2 * c.gpu_backward(big, heads, kv), rel=1e-12)
    fm = costs.flashmask3
    assert fm.forward(tiny, 32, 4) == fm.fwd.floor  # host-bound: the floor sets its time ...
    assert slow.flashmask3.forward(tiny, 32, 4) == fm.fwd.floor  # ... and still does
    assert "GPU time x1.2" in slow.flashmask3.source
