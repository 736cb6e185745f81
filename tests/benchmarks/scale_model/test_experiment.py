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
