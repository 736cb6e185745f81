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
