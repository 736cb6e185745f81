"""benchmarks/cp_exchange_host.py runs end to end (two gloo processes, tiny counts)."""

from __future__ import annotations

import json

from benchmarks import cp_exchange_host


def test_exchange_host_benchmark_measures_both_exchanges_and_writes_its_tables(tmp_path):
    out = tmp_path / "x"
    assert cp_exchange_host.main(["--counts", "4", "--reps", "2", "--cps", "16", "--port", "29547",
                                  "--out", str(out)]) == 0
    got = json.loads((tmp_path / "x.json").read_text())
    (m,) = got["measured"]
    assert m["messages"] == 4 and m["p2p_us"] > 0 and m["all_to_all_us"] > 0
    (row,) = [r for r in got["per_layer_estimates"] if r["nodes"] == 1]
    assert row["cp"] == 16 and row["messages_max"] >= row["messages_median"] > 0
    assert "all_to_all_single" in (tmp_path / "x.md").read_text()
