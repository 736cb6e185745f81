"""The GPU script's measurement module on the CPU (the code path only: timings are wall time)."""

import json

import pytest
import torch

from benchmarks.scale_model import calibrate as C
from benchmarks.scale_model import measure


def test_overlap_times_off_cuda_counts_every_call():
    calls = []
    host_us, gpu_ms, hidden = measure.overlap_times(lambda: calls.append(1), torch.device("cpu"),
                                                    reset=None, calls=4, samples=3)
    assert len(calls) == 12 and host_us >= 0 and gpu_ms >= 0 and hidden


def test_stream_times_off_cuda_runs_twice_the_timed_calls():
    calls = []
    ms, n, host_us = measure.stream_times(lambda: calls.append(1), torch.device("cpu"), per_call_ms=1.0,
                                          samples=2)
    assert n == 5 and len(calls) == 2 * 2 * n and ms >= 0  # 5 ms of work at 1 ms a call
    assert host_us == pytest.approx(ms * 1e3)  # off CUDA both are the second half's wall time
    calls = []
    _, n, _ = measure.stream_times(lambda: calls.append(1), torch.device("cpu"), per_call_ms=100.0,
                                   samples=3)
    assert n == measure.STREAM_CALLS[0] and len(calls) == 2 * n  # long calls: one sample


def test_repeat_streams_interleave_rounds_over_the_host_relevant_calls():
    """Each round takes one stream sample of each pass of every kept call, every other round in
    reverse order, and stops at the deadline; only calls the host can set are kept."""
    import time

    assert measure.host_relevant({"gpu_fwd_ms": 0.05, "host_fwd_us": 60.0})
    assert measure.host_relevant({"gpu_fwd_ms": 5.0, "host_fwd_us": 60.0,
                                  "gpu_fwd_bwd_ms": 0.5, "host_fwd_bwd_us": 400.0})
    assert not measure.host_relevant({"gpu_fwd_ms": 0.2, "host_fwd_us": 60.0,
                                      "gpu_fwd_bwd_ms": 1.0, "host_fwd_bwd_us": 400.0})
    order, kept = [], []
    for name in "ab":
        row = {"gpu_fwd_ms": 1.0, "host_fwd_us": 1000.0, "gpu_fwd_bwd_ms": 2.0, "host_fwd_bwd_us": 2000.0}
        kept.append((row, (lambda n=name: order.append(n)), (lambda n=name: order.append(n.upper()))))
    done = measure.repeat_streams(kept, torch.device("cpu"), 3, time.perf_counter() + 60, print)
    assert done == 3
    firsts = [order[i] for i in range(0, len(order)) if i == 0 or order[i] != order[i - 1]]
    assert firsts == ["a", "A", "b", "B", "b", "B", "a", "A", "a", "A", "b", "B"]
    for row, _, _ in kept:
        for k in ("stream_fwd_ms_repeats", "stream_host_fwd_us_repeats", "stream_fwd_bwd_ms_repeats",
                  "stream_host_fwd_bwd_us_repeats"):
            assert len(row[k]) == 3 and all(x > 0 for x in row[k])
    assert measure.repeat_streams(kept, torch.device("cpu"), 3, time.perf_counter() - 1, print) == 0


def test_stage_problems_take_one_call_of_each_plan_in_turn():
    from benchmarks.corpus import document_spreads

    lens = document_spreads(4096, seed=0)
    metas = [m for m, _, _ in measure.stage_problems(lens, [2, 4], ["long", "short"])]
    first = [(m["spread"], m["cp"], m["balance"]) for m in metas[:8]]
    assert len(set(first)) == 8  # the first round visits every spread x cp x balance once


def test_dry_run_writes_gpu_host_and_stream_columns_and_rebuildable_calls(tmp_path):
    assert measure.main(["--out", str(tmp_path), "--device", "cpu", "--dry-run"]) == 0
    data = json.loads((tmp_path / "scale_model_attention.json").read_text())
    rows = data["attention"]
    assert rows and all("error" not in r for r in rows)
    for r in rows:
        for k in ("stream_fwd_ms", "stream_fwd_bwd_ms", "gpu_fwd_ms", "gpu_fwd_bwd_ms", "host_fwd_us",
                  "host_fwd_bwd_us", "stream_host_fwd_us", "stream_host_fwd_bwd_us"):
            assert r[k] > 0, k
    assert set(data["spreads"]) == {"long"} and sum(data["spreads"]["long"]) == data["args"]["tokens"]
    reps = [r for r in rows if "stream_fwd_ms_repeats" in r]  # off CUDA every call is host-bound
    assert reps == rows and all(len(r["stream_host_fwd_bwd_us_repeats"]) == 3 for r in rows)
    # calibrate rebuilds every measured call from the file alone, tile totals checked
    C.attach_program_work(rows, data)
    assert all(r["_work"] is not None and r["_work"].totals() == (r["full_tiles"], r["partial_tiles"])
               for r in rows)


def test_overlap_and_stream_take_gpu_fill_off_cuda_without_running_it():
    """Off CUDA the GPU fill (the probe's matmul load) is never called (wall time only); the call
    counts are unchanged."""
    ran, calls = [], []
    measure.overlap_times(lambda: calls.append(1), torch.device("cpu"), calls=2, samples=2,
                          fill=lambda factor=1.0: ran.append(factor))
    measure.stream_times(lambda: calls.append(1), torch.device("cpu"), per_call_ms=100.0,
                         before=lambda: ran.append(1.0))
    assert ran == [] and len(calls) == 4 + 2 * measure.STREAM_CALLS[0]


def test_a_long_passs_stream_starts_after_idle_on_cuda_only():
    """The GPU rests before the stream of a pass of >= STREAM_IDLE_MIN_MS per call (the power
    state the work before it left), not before shorter ones, and never off CUDA."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # a device object needs no GPU
    row = {"gpu_fwd_ms": measure.STREAM_IDLE_MIN_MS, "gpu_fwd_bwd_ms": 0.5}
    assert measure.stream_idle_s(row, "fwd", cuda) == measure.STREAM_IDLE_S > 0
    assert measure.stream_idle_s(row, "fwd_bwd", cuda) == 0.0
    assert measure.stream_idle_s(row, "fwd", cpu) == 0.0
    measure.rest_before_stream(row, "fwd", cpu)
    assert row["stream_fwd_idle_s"] == 0.0
