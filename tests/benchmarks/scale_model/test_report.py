"""The report's sentences that read measured files (scale_model.md item 6)."""

import json

from benchmarks.scale_model import report


def _rank(rank, seconds, host):
    return {"rank": rank, "seconds": seconds, "host_seconds": host}


def test_measured_ptrr_sentence_reads_the_slowest_ranks_and_flags_host_bound_ones(tmp_path):
    """Each cp's slowest sampled rank of both hierarchical layouts, in cp order, a rank whose
    host time is >= 90% of its layer marked host-bound; nothing without the file or the pair."""
    res = {"env": {"gpu": "TestGPU"}, "args": {"heads": 16, "kv_heads": 8}, "cp": {
        "32": {"sparse+overlap hier": {"slowest_rank": 3, "ranks": [_rank(3, 5e-3, 1e-3), _rank(1, 4e-3, 1e-3)]},
               "ptrr+overlap hier": {"slowest_rank": 0, "ranks": [_rank(0, 7e-3, 6.5e-3)]}},
        "16": {"sparse+overlap hier": {"slowest_rank": 2, "ranks": [_rank(2, 8.7e-3, 2e-3)]},
               "ptrr+overlap hier": {"slowest_rank": 5, "ranks": [_rank(5, 9.9e-3, 3e-3)]}},
        "64": {"sparse+overlap hier": {"slowest_rank": 0, "ranks": [_rank(0, 1e-3, 0.0)]}}}}
    path = tmp_path / "cp_ptrr.json"
    path.write_text(json.dumps(res))
    text = report._measured_ptrr_sentence(str(path))
    assert "one TestGPU" in text and "16 / 8 heads" in text
    assert "cp 16 8.70 vs 9.90 ms, cp 32 5.00 vs 7.00 (host-bound) ms:" in text
    assert "cp 64" not in text
    assert report._measured_ptrr_sentence(str(tmp_path / "missing.json")) == ""


def test_ptrr_remote_kv_clause_ranges_over_multi_node_rows(tmp_path):
    """PTRR's largest remote K/V over dual_chunk's, min-max over the rows beyond one node."""
    rows = [{"cp": 8, "max_remote_tokens_ptrr": 90, "max_remote_tokens_dual_chunk": 10},
            {"cp": 16, "max_remote_tokens_ptrr": 30, "max_remote_tokens_dual_chunk": 20},
            {"cp": 64, "max_remote_tokens_ptrr": 50, "max_remote_tokens_dual_chunk": 10}]
    path = tmp_path / "balance.json"
    path.write_text(json.dumps({"results": {"a": rows[:2], "b": rows[2:]}}))
    assert report._ptrr_remote_kv_clause(str(path)) == " (balance.md: 1.50-5.00x dual_chunk's remote K/V)"
    assert report._ptrr_remote_kv_clause(str(tmp_path / "none.json")) == ""


def test_target_line_keeps_the_diagnostics_apart():
    """The target line counts the model's predictions of the measured points (GPU, each call's
    stream mean, its own host); one-sample and row's-host checks go to a Diagnostics line."""
    from benchmarks.scale_model.validate import Point

    def pts(*errors):
        return [Point(f"c{i}", 1.0, 1.0 + e) for i, e in enumerate(errors)]

    measured = {"GQA": {"in_sample": {"fwd GPU": pts(0.05, -0.1), "fwd stream": pts(0.2, 0.0),
                                      "fwd stream, one sample": pts(0.4), "fwd stream, row's host": pts(0.01)},
                        "held_out": {"fwd GPU": pts(0.12)}}}
    target, _, diag, _ = report._target_lines(measured)
    assert "GPU time met (worst 12.0%, 3 of 3 within)" in target
    assert "stream time (each call's samples' mean) NOT met (worst 20.0%, 1 of 2 within)" in target
    assert "one sample" not in target and "row's host" not in target
    assert diag.startswith("Diagnostics") and "stream time, one sample NOT met (worst 40.0%, 0 of 1 within)" in diag
    assert "stream time, row's host met (worst 1.0%, 1 of 1 within)" in diag
    assert report._target_lines({"GQA": {"in_sample": {}, "held_out": {}}}) == []


def test_transfer_section_tabulates_every_check_and_the_ratios():
    """The H100 section: one row per class and GPU check with the summary's numbers, the pairs'
    time ratios and the target line computed from the same points."""
    from benchmarks.scale_model import validate as V

    t = V.validate_transfer()
    lines = report.transfer_section(t)
    text = "\n".join(lines)
    assert f"over the {len(V.paired_calls())} calls" in text
    for cls, checks in t["classes"].items():
        for check, pts in checks.items():
            s = V.summary(pts)
            assert f"| {cls} | {check} | {s['points']} | {s['max_abs_error']:.1%} |" in text
    every = [p for c in t["classes"].values() for ps in c.values() for p in ps]
    s = V.summary(every)
    assert f"({s['within_target']} of {s['points']} within, worst {s['max_abs_error']:.1%})" in text


def test_standard_error_is_the_sample_deviation_over_root_n():
    assert abs(report.standard_error([1.0, 2.0, 3.0]) - 1.0 / 3 ** 0.5) < 1e-12


def _host_rows(means, noise, n=16, seed=0):
    """Rows of host-relevant calls: call i's samples scatter by ``noise`` around ``means[i]``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for m in means:
        s = (m * (1 + noise * rng.standard_normal(n))).tolist()
        rows.append({"stream_host_fwd_bwd_us": s[0], "stream_host_fwd_bwd_us_repeats": s[1:],
                     "kv_expanded": False})
    return rows


def test_host_noise_text_tells_sampling_noise_from_a_host_difference():
    import numpy as np

    same = _host_rows([400.0] * 40, noise=0.25)  # one host time, noisy samples: spread = noise
    assert "no larger than the noise" in report._host_noise_text(same)
    apart = _host_rows(np.linspace(300.0, 500.0, 40), noise=0.02)  # real differences, quiet samples
    assert "exceeds the noise" in report._host_noise_text(apart)
    assert report._host_noise_text(same[:2]) == ""
