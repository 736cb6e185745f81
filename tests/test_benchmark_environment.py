"""benchmarks/environment.py: what a committed result records about its run."""

from __future__ import annotations

import sys

import torch

from benchmarks.environment import run_environment


def test_command_carries_the_flashmask3_settings(monkeypatch):
    """The recorded command reproduces the run: FLASHMASK3_* settings (not the commit, which has
    its own field) in front of the interpreter and its arguments."""
    monkeypatch.setenv("FLASHMASK3_KERNELS", "split")
    monkeypatch.setenv("FLASHMASK3_COMMIT", "abc1234")
    monkeypatch.setattr(sys, "argv", ["benchmarks/kernel.py", "--plan", "final"])
    env = run_environment(torch.device("cpu"))
    assert env["commit"] == "abc1234"
    assert env["command"].startswith("FLASHMASK3_") and "FLASHMASK3_COMMIT" not in env["command"]
    assert "FLASHMASK3_KERNELS=split " in env["command"]
    assert env["command"].endswith(f"{sys.executable} benchmarks/kernel.py --plan final")
