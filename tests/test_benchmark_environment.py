"""benchmarks/environment.py: what a committed result records about its run."""

from __future__ import annotations

import sys

import torch

from benchmarks.environment import run_environment


def test_command_carries_the_flashmask3_settings(monkeypatch):
    """The recorded command reproduces the run: FLASHMASK3_* settings (not the commit, which has
    its own field) in front of the interpreter and its arguments."""
    monkeypatch.setenv("FLASHMASK3_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("FLASHMASK3_COMMIT", "abc1234")
    monkeypatch.setattr(sys, "argv", ["benchmarks/kernel.py", "--plan", "final"])
    env = run_environment(torch.device("cpu"))
    assert env["commit"] == "abc1234"
    assert env["command"].startswith("FLASHMASK3_") and "FLASHMASK3_COMMIT" not in env["command"]
    assert "FLASHMASK3_TRITON_AUTOTUNE=0 " in env["command"]
    assert env["command"].endswith(f"{sys.executable} benchmarks/kernel.py --plan final")


def test_gluon_ab_results_name_their_run(monkeypatch, tmp_path):
    """The Gluon A/B scripts' JSON meta and markdown header carry the date, versions, exact
    command and commit (a committed result must say where it came from)."""
    import json

    from benchmarks import gluon_dkdv_ab as AB

    monkeypatch.setenv("FLASHMASK3_COMMIT", "abc1234")
    monkeypatch.setattr(sys, "argv", ["benchmarks/gluon_dq_ab.py", "--budget-s", "200"])
    path = tmp_path / "ab.json"
    AB._write(str(path), [{"part": "small", "case": "x"}], lse_tol=0.5)
    meta = json.loads(path.read_text())["meta"]
    assert meta["commit"] == "abc1234" and meta["lse_tol"] == 0.5
    assert meta["rel_tol"] == AB.REL_TOL and meta["torch"] == torch.__version__
    header = AB.md_header("Gluon dQ vs tl dQ", meta)
    assert header.startswith(f"# Gluon dQ vs tl dQ ({meta.get('gpu', meta['device'])}, "
                             f"{meta['date'][:10]})")
    assert "benchmarks/gluon_dq_ab.py --budget-s 200`" in header and "commit abc1234" in header
    assert f"triton {meta['triton']}" in header


def test_gluon_ab_small_case_skeleton(tmp_path):
    """The small-pass skeleton the Gluon A/B scripts share: a case past the deadline is recorded
    as skipped, a started one is yielded with its shape, appended after the caller filled it and
    written; the hang timer is capped near the deadline; masks are seeded by the case index."""
    import faulthandler
    import json
    import time

    from benchmarks import gluon_dkdv_ab as AB

    cases = AB.SMALL_CASES[:2]
    path = tmp_path / "ab.json"
    records, seen = [], []
    try:
        for i, case, rec in AB.small_case_records(records, time.time() + 3600, str(path),
                                                  "fused_small", cases):
            assert len(records) == i  # appended only after the caller's step
            seen.append(i)
            rec["gluon"]["cfg"] = {"ok": True}
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert seen == [0, 1] and [r["case"] for r in records] == [c[0] for c in cases]
    assert records[0]["part"] == "fused_small" and records[0]["D"] == cases[0][7]
    assert records[1]["gluon"] == {"cfg": {"ok": True}}
    assert len(json.loads(path.read_text())["records"]) == 2

    skipped: list = []
    assert list(AB.small_case_records(skipped, time.time() - 1, str(path), "small", cases)) == []
    assert [r["skipped"] for r in skipped] == ["budget", "budget"]

    assert AB.case_timeout() == AB.CASE_TIMEOUT_S
    assert AB.case_timeout(time.time() - 100) == AB.GRACE_S
    assert AB.case_timeout(time.time() + 1e4) == AB.CASE_TIMEOUT_S

    masked = next(i for i, c in enumerate(AB.SMALL_CASES) if c[-1] > 0)
    a = AB.small_mask(masked, AB.SMALL_CASES[masked], "cpu")
    assert torch.equal(a, AB.small_mask(masked, AB.SMALL_CASES[masked], "cpu"))
    assert a.shape[-1] == AB.SMALL_CASES[masked][-1]


def test_gluon_ab_verdict_and_finish(tmp_path, capsys):
    """The verdict the Gluon A/B scripts share: an errored case and a Gluon result that is not ok
    fail the run (exit code 1, listed in the markdown), skipped results and ok ones do not; the
    JSON carries the tolerances given."""
    import json

    from benchmarks import gluon_dkdv_ab as AB

    records = [
        {"part": "small", "case": "a", "gluon": {"x": {"ok": True}, "y": {"skipped": "budget"}}},
        {"part": "timed", "case": "b", "gluon": {"x": {"ok": False, "err": 0.5}}},
        {"part": "timed", "case": "c", "error": "boom", "gluon": {}},
    ]
    bad = AB.failures(records, lambda x: f"err {x['err']}")
    assert bad == ["timed b x: err 0.5", "timed c: error"]
    assert AB.failures(records[:1], repr) == []
    path = tmp_path / "ab.json"
    assert AB.finish_run(str(path), records, 0.0, "# t\n" + AB.verdict(bad, "fine"), bad,
                         "all ok", lse_tol=0.25) == 1
    md = (tmp_path / "ab.md").read_text()
    assert "FAIL (2)" in md and "- timed b x: err 0.5" in md and "fine" not in md
    assert json.loads(path.read_text())["meta"]["lse_tol"] == 0.25
    assert "FAIL (2)" in capsys.readouterr().out
    assert AB.finish_run(str(path), records[:1], 0.0, AB.verdict([], "fine"), [], "all ok") == 0
    assert (tmp_path / "ab.md").read_text() == "fine\n" and "all ok" in capsys.readouterr().out
