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
