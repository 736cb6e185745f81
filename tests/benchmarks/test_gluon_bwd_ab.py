"""benchmarks/gluon_bwd_ab.py: the arm switch and the report of the Gluon backward's A/B (no GPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import gluon_bwd_ab as AB
from flashmask3.kernels import gluon_bwd as G


def _run(triton, arm, opaque, label, rows):
    return {"triton": triton, "arm": arm, "opaque": opaque, "label": label,
            "rows": [{"mask": m, "fwd_ms": f, "bwd_ms": b, "fwd_bwd_ms": f + b,
                      "backward": ["gluon_fused 64x128 w8 s2"]} for m, f, b in rows]}


def test_report_takes_the_median_over_runs_per_triton_arm_and_mask(tmp_path):
    runs = [_run("3.9.0", "opaque", True, "", [("causal_document_corpus", 15.0, b)]) for b in (47.0, 49.0, 48.0)]
    runs.append(_run("3.9.0", "plain", False, "", [("causal_document_corpus", 15.0, 50.0)]))
    runs.append(_run("3.9.0", "default", True, "head", [("causal_document_corpus", 15.0, 46.0)]))
    paths = []
    for i, r in enumerate(runs):
        paths.append(str(tmp_path / f"r{i}.json"))
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    table = AB.report(paths).splitlines()
    assert len(table) == 2 + 3  # header + 3 groups
    opaque = next(x for x in table if "| opaque (True) |" in x)
    assert "| 3 | 15.00 | 48.00 | 63.00 |" in opaque  # medians of the three runs
    assert any("| head default (True) |" in x and "| 1 | 15.00 | 46.00 |" in x for x in table)


def test_report_keeps_head_dims_apart(tmp_path):
    run = _run("3.9.0", "default", True, "new", [("sliding_window", 10.0, 30.0)])
    other = _run("3.9.0", "default", True, "new", [("sliding_window", 20.0, 60.0)])
    other["rows"][0]["D"] = 256
    for i, r in enumerate((run, other)):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    table = AB.report([str(tmp_path / f"r{i}.json") for i in range(2)]).splitlines()
    assert any("| sliding_window | 128 | 1 | 10.00 | 30.00 |" in x for x in table)
    assert any("| sliding_window | 256 | 1 | 20.00 | 60.00 |" in x for x in table)


@pytest.mark.skipif(G.gl is None, reason="needs triton.experimental.gluon")
@pytest.mark.parametrize("arm, want", [("opaque", True), ("plain", False)])
def test_set_arm_sets_the_constexpr_the_kernels_read(arm, want, monkeypatch):
    monkeypatch.setattr(G, "OPAQUE_INVARIANTS", G.OPAQUE_INVARIANTS)  # restored afterwards
    assert AB.set_arm(arm) is want
    assert isinstance(G.OPAQUE_INVARIANTS, G.gl.constexpr) and G.OPAQUE_INVARIANTS.value is want
