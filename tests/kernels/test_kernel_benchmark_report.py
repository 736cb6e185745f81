"""benchmarks/kernel.py's report (no GPU needed): ratios, targets and the fused column come from
the recorded times, and JSON files merge into the markdown table."""

from __future__ import annotations

import contextlib
import json
import os

import torch

from benchmarks import kernel as KB


def _record(mask, fm_fb, flex_fb, fused_fb=None, fm_fwd=10.0, cudnn=None):
    impls = {"flashmask3": dict(fwd_ms=fm_fwd, bwd_ms=fm_fb - fm_fwd, fwd_bwd_ms=fm_fb,
                                tflops_fwd=400.0, tflops_fwd_bwd=300.0, prep_ms=0.1),
             "flex": dict(fwd_ms=12.0, bwd_ms=flex_fb - 12.0, fwd_bwd_ms=flex_fb, mask_build_ms=3.0)}
    if fused_fb is not None:
        impls["flashmask3_fused"] = dict(fwd_ms=fm_fwd, bwd_ms=fused_fb - fm_fwd, fwd_bwd_ms=fused_fb)
    if cudnn is not None:
        impls["sdpa_cudnn"] = dict(fwd_ms=cudnn[0], bwd_ms=cudnn[1] - cudnn[0], fwd_bwd_ms=cudnn[1])
    return dict(mask=mask, S=32768, D=128, B=4, Hq=32, Hk=32, causal=True, docs_per_row=16.0,
                density=0.05, flops={}, impls=impls)


def test_targets_follow_the_numbers():
    doc = _record("causal_document_corpus", fm_fb=50.0, flex_fb=70.0)  # 1.4x >= 1.3
    assert any("1.40x>=1.3 met" in t for t in KB.targets(doc))
    slow = _record("sliding_window", fm_fb=100.0, flex_fb=105.0)  # 1.05x < 1.1
    assert any("1.05x>=1.1 MISSED" in t for t in KB.targets(slow))
    causal = _record("causal", fm_fb=100.0, flex_fb=120.0, fm_fwd=20.0, cudnn=(16.0, 90.0))
    got = KB.targets(causal)
    assert any(t.startswith("fwd vs cuDNN 0.80") and t.endswith("MISSED") for t in got)
    assert any(t.startswith("f+b vs cuDNN 0.90") and t.endswith("met") for t in got)


def test_report_merges_files_and_shows_the_fused_backward(tmp_path):
    meta = dict(gpu="test", date="2026-11-29", torch="t", triton="x", cuda="c", command="cmd", not_run=[])
    a = [_record("causal_document_corpus", 50.0, 70.0, fused_fb=40.0)]
    b = [_record("sliding_window", 100.0, 105.0)]
    files = []
    for i, res in enumerate((a, b)):
        path = tmp_path / f"kernel_{i}.json"
        path.write_text(json.dumps(dict(meta=meta, results=res)))
        files.append(str(path))
    KB.report(files, str(tmp_path))
    md = (tmp_path / "kernel.md").read_text()
    assert "causal_document_corpus" in md and "sliding_window" in md
    row = next(line for line in md.splitlines() if "causal_document_corpus" in line)
    assert "| fused 40.00 (1.75x) |" in row  # fused f+b and Flex / fused
    other = next(line for line in md.splitlines() if "sliding_window" in line)
    assert "| 1.05 | - |" in other  # no variant timed in that case
    assert (tmp_path / "kernel.png").exists()


def test_flashmask_variant_sets_and_restores_the_kernel_choice(monkeypatch):
    """A variant row runs under its FLASHMASK3_KERNELS value, the library's row under the
    caller's setting; both restored afterwards."""
    from flashmask3.kernels import dispatch

    monkeypatch.delenv("FLASHMASK3_KERNELS", raising=False)
    with KB.flashmask_variant("flashmask3_split"):
        assert dispatch.mode() == "split"
    with KB.flashmask_variant("flashmask3_portable"):
        assert dispatch.mode() == "portable"
    with KB.flashmask_variant("flashmask3"):
        assert dispatch.mode() == "default"
    assert "FLASHMASK3_KERNELS" not in os.environ


def test_skip_done_leaves_out_exactly_the_measured_cases(tmp_path):
    """--skip-done: a case counts as measured by its (mask, S, D, Hq, Hk), so GQA and MHA rows of
    the same mask stay apart, and the plan's order is kept."""
    done = [_record("causal", 1.0, 1.0), dict(_record("causal_document_corpus", 1.0, 1.0), Hk=8)]
    path = tmp_path / "kernel_part.json"
    path.write_text(json.dumps(dict(meta={}, results=done)))
    assert KB.done_cases([str(path)]) == {("causal", 32768, 128, 32, 32),
                                          ("causal_document_corpus", 32768, 128, 32, 8)}
    args = KB.argparse.Namespace(plan="final")
    left = [c for c in KB.cases(args) if c not in KB.done_cases([str(path)])]
    assert len(left) == len(KB.FINAL_PLAN) - 2
    assert ("causal_document_corpus", 32768, 128, 32, 32) in left  # the MHA row is not done
    assert left == [c for c in KB.FINAL_PLAN if c in left]


def test_report_keeps_the_later_run_of_a_case_whatever_the_file_order(tmp_path):
    """Two runs of one case: the row shows the run with the later recorded date, also when that
    file is named first (file names such as kernel_v6_* sort after kernel_v66_*)."""
    files = []
    for name, date, fm_fb in (("kernel_v66_new.json", "2026-11-30T07:00:00", 40.0),
                              ("kernel_v6_old.json", "2026-11-29T20:00:00", 60.0)):
        meta = dict(gpu="test", date=date, torch="t", triton="x", cuda="c", command=name, not_run=[])
        path = tmp_path / name
        path.write_text(json.dumps(dict(meta=meta, results=[_record("causal_document_corpus", fm_fb, 70.0)])))
        files.append(str(path))
    KB.report(files, str(tmp_path))
    row = next(line for line in (tmp_path / "kernel.md").read_text().splitlines()
               if "causal_document_corpus" in line)
    assert "| 40.00 |" in row and "| 60.00 |" not in row
    assert "1.75" in row  # Flex 70 / flashmask3 40


def test_short_calls_get_at_least_min_samples():
    """do_bench's window covers MIN_SAMPLES calls of a 35 ms call (a fixed 100 ms gave 2-3) and
    stays 100 ms for short ones."""
    assert KB.do_bench_window(35.0) >= KB.MIN_SAMPLES * 35.0
    assert KB.do_bench_window(1.0) == 100.0
    assert KB.MIN_SAMPLES >= 10


def test_long_calls_take_more_samples_below_150_ms():
    """Calls of 40-150 ms (the document cells near the 1.3x line) take the median of 7
    event-timed calls; the 128K causal/full calls (0.3-2 s) keep 3."""
    assert KB.event_samples(77.0) == KB.EVENT_SAMPLES >= 5
    assert KB.event_samples(900.0) == 3


def test_interleaved_timer_rotates_and_takes_medians():
    """The interleaved timer times every implementation once per round, starting one later each
    round, and reports each one's median: a clock drift during the case (here +1 ms per call)
    shifts every implementation's median alike, where timing them one after the other would
    charge it all to the last one."""
    order = []
    clock = [0.0]

    def timer(call):
        order.append(call)
        clock[0] += 1.0
        return call + clock[0]

    med = KB.interleaved_medians({"a": 10.0, "b": 20.0, "c": 30.0}, timer, 4)
    assert order[:6] == [10.0, 20.0, 30.0, 20.0, 30.0, 10.0]
    assert len(order) == 12
    drift = {n: med[n] - base for n, base in (("a", 10.0), ("b", 20.0), ("c", 30.0))}
    assert max(drift.values()) - min(drift.values()) <= 1.0, drift


def test_interleaved_rounds_follow_the_single_call_rule():
    """As many rounds as bench() takes samples: >= MIN_SAMPLES under 40 ms (capped at 50 for
    very short calls), EVENT_SAMPLES for 40-150 ms, 3 above."""
    assert KB.interleaved_rounds(35.0) >= KB.MIN_SAMPLES
    assert KB.interleaved_rounds(6.0) == 17
    assert KB.interleaved_rounds(0.5) == 50
    assert KB.interleaved_rounds(77.0) == KB.EVENT_SAMPLES
    assert KB.interleaved_rounds(900.0) == 3


def test_measure_interleaved_runs_every_mode_of_every_implementation(monkeypatch):
    """measure_interleaved's wiring on the CPU (the CUDA-event timer and the memory probe
    replaced): each implementation's forward, backward (on a retained graph, run repeatedly)
    and forward+backward run, with gradients cleared between the timed calls, each under its
    own kernel options (entered by the timer, outside the timed span)."""
    runs = []

    def fake_timer(call):
        run, leaves, options = call
        for t in leaves or ():
            t.grad = None
        with options():
            run()
        runs.append(call)
        return 1.0

    monkeypatch.setattr(KB, "_event_timer", fake_timer)
    monkeypatch.setattr(KB, "_peak_extra_gb", lambda fwd, leaves, dout: 0.5)
    built = {}
    for name, scale in (("flashmask3", 2.0), ("flex", 3.0)):
        x = torch.randn(4, 3, requires_grad=True)
        built[name] = ((lambda x=x, s=scale: (x * s).sin()), [x], torch.randn(4, 3))
    entered = []
    real_variant = KB.flashmask_variant

    @contextlib.contextmanager
    def recording_variant(name):
        entered.append(name)
        with real_variant(name):
            yield

    monkeypatch.setattr(KB, "flashmask_variant", recording_variant)
    res = KB.measure_interleaved(built)
    assert set(res) == {"flashmask3", "flex"}
    # every timed call and every warm-up ran under its own implementation's options
    assert entered.count("flashmask3") == entered.count("flex") >= len(runs) // 2
    for r in res.values():
        assert r["fwd_ms"] == r["bwd_ms"] == r["fwd_bwd_ms"] == 1.0
        assert r["timer"].startswith("interleaved-") and r["peak_extra_gb"] == 0.5
    # 3 modes x (1 warm-up + the rounds) x 2 implementations
    assert len(runs) == 3 * 2 * (1 + KB.interleaved_rounds(1.0))
    x = built["flex"][1][0]
    x.grad = None
    built["flex"][0]().backward(built["flex"][2])
    assert torch.allclose(x.grad, 3.0 * torch.cos(3.0 * x) * built["flex"][2])
