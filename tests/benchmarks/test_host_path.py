"""The host-path benchmark's CPU dry run (its tables and variants, without a GPU), so that the
GPU call's script does not rot between device sessions."""

from __future__ import annotations

import torch


def test_host_path_dry_run_prints_every_table(capsys, monkeypatch):
    from benchmarks import host_path

    monkeypatch.setenv("FLASHMASK3_BACKEND", "torch")
    prev = torch._C._is_multithreading_enabled()
    assert host_path.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| form | mask | launch | autograd | mode |" in out
    assert "| S | docs | autograd | fm std f+b |" in out
    assert "calling-thread autograd" in out  # the floor's engine-thread row
    assert torch._C._is_multithreading_enabled() == prev  # the variants restore torch's setting


def test_autograd_thread_switch_runs_a_backward_either_way():
    from benchmarks.host_path import autograd_thread

    x = torch.randn(8, requires_grad=True)
    for which in ("device", "calling"):
        with autograd_thread(which):
            assert torch._C._is_multithreading_enabled() == (which == "device")
            (x * x).sum().backward()
    torch.testing.assert_close(x.grad, 4 * x.detach())


def test_host_rows_are_sampled_in_turn_each_after_an_untimed_call():
    from benchmarks.host_path import round_robin_host

    events = []
    rows = [(lambda n=n: events.append(("call", n)), [n]) for n in "ab"]

    def sample(fn, leaves):
        events.append(("sample", leaves[0]))
        return float(len(events))

    got = round_robin_host(rows, sample, rounds=2)
    assert events == [("call", "a"), ("sample", "a"), ("call", "b"), ("sample", "b")] * 2
    assert got == [[2.0, 6.0], [4.0, 8.0]]
