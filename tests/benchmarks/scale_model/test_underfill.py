"""The underfill breakdown and the A/B shape set on cases small enough to work out."""

import json

import numpy as np
import pytest

from benchmarks.scale_model import calibrate as C
from benchmarks.scale_model import underfill as U
from benchmarks.scale_model.calibrate import PassCost, ProgramWork, TileCounts
from benchmarks.scale_model.timeline import AttnShape


def test_a_calls_loss_is_its_grid_and_spread_parts():
    """133 forward programs on 132 SMs, one of them ten times the others, last in launch order:
    filled = 142/132, equal programs take two waves of the mean (grid), the rest is the spread;
    longest first saves the late start; a host floor above the GPU time hides the loss."""
    w = ProgramWork(np.array([1] * 132 + [10]), np.zeros(133, int), np.array([1]), np.array([0]))
    t = TileCounts(142, 0, 128 * 133, 128, work=w)
    p = PassCost(1.0, 1.0, 0.0, 0, 0, schedule="greedy")
    c = U.call_underfill(p, t, "fwd", AttnShape(1, 1))
    mean = 142 / 133
    assert (c.gpu, c.gpu_filled, c.lpt) == pytest.approx((11.0, 142 / 132, 10.0))
    assert c.grid == pytest.approx(2 * mean - 142 / 132) and c.loss == pytest.approx(c.grid + c.spread_loss)
    assert c.programs == 133 and c.spread == pytest.approx(10 / mean) and c.label == "fwd local"
    assert c.exposed_loss == pytest.approx(c.loss)
    hidden = U.call_underfill(PassCost(1.0, 1.0, 0.0, 0, 0, floor=20.0, schedule="greedy"), t, "fwd", AttnShape(1, 1))
    assert hidden.exposed_loss == 0.0


def test_summarise_groups_calls_by_kind_and_totals_per_layer():
    p = PassCost(1e-6, 1e-6, 0.0, 0, 0, schedule="greedy")
    w = ProgramWork(np.array([1, 3]), np.array([0, 0]), np.array([2, 2]), np.array([0, 0]))
    t = TileCounts(4, 0, 256, 256, work=w)
    sh = AttnShape(32, 4)
    calls = [U.call_underfill(p, t, "fwd", sh, 0), U.call_underfill(p, t, "fwd", sh, 1),
             U.call_underfill(p, t, "bwd", sh, 1)]
    assert [c.label for c in calls] == ["fwd local", "fwd remote", "bwd remote expanded"]  # 8 programs: library
    rows = U.summarise([{"calls": calls, "layer_s": 1.0, "layer_filled_s": 0.5}] * 2)
    assert [r["kind"] for r in rows] == ["fwd local", "fwd remote", "bwd remote expanded", "total"]
    tot = rows[-1]
    assert tot["calls"] == 3 and tot["layer_ms"] == 1000.0 and tot["layer_filled_ms"] == 500.0
    assert tot["loss_ms"] == pytest.approx(1e3 * sum(c.loss for c in calls))


def test_gqa_expand_ab_dry_run_rebuilds_and_checks_a_shape_set(tmp_path, capsys):
    """A shape-set entry names a real stage call (document lengths, cp, balance, nodes, rank,
    stage); the dry run rebuilds its mask on the CPU, checks its tiles and reports the rules'
    decisions; a stale tile count is an error."""
    from benchmarks import gqa_expand_ab as AB
    from benchmarks.scale_model.measure import plan_calls

    lens = [1000, 3000, 4192]
    meta, fm, keys = [x for x in plan_calls(lens, "t", 4, "sparse", ranks=[0], nodes=1) if x[0]["stage"] == 1][0]
    t = C.tile_counts(fm.startend_row_indices, False, fm.seqlen_q, keys)
    entry = {"dataset": "t", "q_rows": fm.seqlen_q, "keys": keys, "heads": 32, "kv_heads": 4,
             "mask": {"doc_lens": lens, "cp": 4, "balance": "sparse", "nodes": 1, "rank": 0, "stage": 1},
             "tiles": [t.full, t.partial], "ab_grouped_gpu_ms": 1.0, "ab_expanded_gpu_ms": 0.5}
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"shapes": [entry]}))
    assert AB.main(["--shapes", str(path), "--dry-run", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "gqa_expand_ab_dry_run.json").read_text())["rows"][0]
    assert (row["Sq"], row["Sk"], row["stage"], row["ab_expanded_gpu_ms"]) == (2048, keys, 1, 0.5)
    assert row["library_expands"] and row["waves_expands"]  # 12 grouped programs
    assert len(AB.load_cases("stage")) == 3
    entry["tiles"] = [t.full + 1, t.partial]
    path.write_text(json.dumps({"shapes": [entry]}))
    with pytest.raises(ValueError, match="tiles"):
        AB.load_cases(str(path))
