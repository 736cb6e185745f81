"""The validation script on the committed measurement files, and the plan view."""

import json
import subprocess
import sys

import numpy as np
import pytest

import flashmask3.masks as M
from benchmarks.scale_model import validate as V
from benchmarks.scale_model.layout import mask_sparsity, view_plan
from flashmask3.distributed import plan


def test_multigpu_file_is_predicted_point_by_point():
    with open(V.MULTI) as f:
        runs = [r for r in json.load(f)["attention"]["runs"] if "seconds" in r]
    points = V.validate_multigpu(V.MULTI)
    assert len(points) == len(runs) == 4
    for p, r in zip(points, runs):
        assert p.measured == r["seconds"]
        assert np.isfinite(p.predicted) and p.predicted > 0
        assert p.error == pytest.approx(p.predicted / r["seconds"] - 1)
    s = V.summary(points)
    assert s["points"] == 4 and s["max_abs_error"] == max(abs(p.error) for p in points)


def test_per_rank_validation_holds_the_sparse_ranks_out():
    r = V.validate_single(V.SINGLE)
    assert len(r["tables"]) == len(r["per_rank"]) == 64
    held = [p for p in r["per_rank"] if p.held_out]
    assert len(held) == 32 and all("sparse" in p.name for p in held)
    assert r["k"] > 0 and r["c"] >= 0


def test_plan_view_reads_the_plan():
    lens = [700, 1300, 300, 1796, 4096]
    mask = M.causal_document_mask(lens)
    p = plan(mask, None, 4, balance="sparse", nodes=2)
    v = view_plan(p, mask.startend_row_indices, True)
    assert v.works == p.works
    for r in range(4):
        # the stages' live tiles add up to the rank's work (tiles model, 128-tile chunks)
        assert sum(t.live for t in v.stages[r]) == p.work(r) == v.sorted_tiles[r].live
        assert [len(s) for s in p.stages(r)] == v.stage_chunks[r]
    assert len(v.rounds) == len(p.rounds)
    assert any(rnd.relay and rnd.source is not None for rnd in v.rounds)
    assert mask_sparsity(lens) == pytest.approx(mask.sparsity())


def test_cli_help_and_validate_mode():
    out = subprocess.run([sys.executable, "-m", "benchmarks.scale_model", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "validate" in out.stdout and "--multigpu" in out.stdout


def _measured_file(tmp_path, rng):
    """A scale_model_attention.json whose times follow a known floored cost (+-2% noise)."""
    from benchmarks.scale_model import calibrate as C

    fwd = C.PassCost(12e-9, 30e-9, 80e-6, 0, 0, floor=0.4e-3)
    bwd = C.PassCost(35e-9, 60e-9, 150e-6, 0, 0, floor=1.5e-3)
    rows = []
    for i in range(80):
        t = C.TileCounts(int(10 ** rng.uniform(1, 4.5)), int(rng.integers(0, 300)), 4096, 8192)
        tf = fwd.seconds(t, 32, C._programs("fwd", t, 32)) * rng.uniform(0.98, 1.02)
        tb = bwd.seconds(t, 32, C._programs("bwd", t, 32)) * rng.uniform(0.98, 1.02)
        rows.append({"spread": "long", "cp": 8, "balance": "sparse" if i % 2 else "dual_chunk", "nodes": 1,
                     "rank": i, "stage": 0, "q_rows": 4096, "keys": 8192, "heads": 32, "kv_heads": 4,
                     "head_dim": 128, "full_tiles": t.full, "partial_tiles": t.partial,
                     "fwd_ms": tf * 1e3, "fwd_bwd_ms": (tf + tb) * 1e3})
    path = tmp_path / "scale_model_attention.json"
    path.write_text(json.dumps({"env": {"gpu": "test"}, "attention": rows}))
    return str(path), rows


def test_measured_shapes_validation_holds_the_sparse_calls_out(tmp_path):
    path, rows = _measured_file(tmp_path, np.random.default_rng(4))
    out = V.validate_measured(path)
    assert set(out) == {"GQA"}  # only GQA rows in the file
    d = out["GQA"]
    assert len(d["in_sample"]["fwd"]) == len(rows) and len(d["held_out"]["fwd+bwd"]) == len(rows) // 2
    assert all(p.held_out for p in d["held_out"]["fwd"]) and not any(p.held_out for p in d["in_sample"]["fwd"])
    assert d["cost"].fwd.floor == pytest.approx(0.4e-3, rel=0.1)
    for check in ("in_sample", "held_out"):
        s = V.summary(d[check]["fwd+bwd"], held_only=False)
        assert s["max_abs_error"] < 0.06 and s["within_target"] == s["points"]
