"""benchmarks/newer_torch_path.py: the summary of the newer-torch path's GPU run (no GPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import newer_torch_path as N


def _kernel_file(cases: dict) -> dict:
    """A kernel.py JSON with one case per mask: mask -> (default, portable, flex) fwd+bwd ms."""
    results = [dict(mask=m, impls={name: dict(fwd_bwd_ms=t, std_fwd_bwd_ms=t * 1.01)
                                   for name, t in zip((N.DEFAULT, N.PORTABLE, N.FLEX), ms)})
               for m, ms in cases.items()]
    meta = dict(gpu="G", torch="2.11", triton="3.6.0", cuda="13.0", date="d", command="kernel.py ...",
                not_run=["causal"])
    return dict(meta=meta, results=results)


def _host_file() -> dict:
    row = dict(form="FlashMask", mask="reused", launch="fast", autograd="device", mode="fwd", S=32768,
               docs=16, host_us=97.0, host_p10_us=90.0, host_p90_us=110.0, target_us=100.0, met=True,
               std_ms=0.75, gpu_ms=0.75, kernels=1)
    return dict(meta=dict(date="h", command="host_path.py --skip-small", commit="c"), host=[row], small=[])


def test_summary_has_each_case_its_ratios_and_the_host_rows(tmp_path):
    k1 = tmp_path / "k1.json"
    k1.write_text(json.dumps(_kernel_file({"sliding_window": (10.0, 13.5, 13.0)})))
    k2 = tmp_path / "k2.json"
    k2.write_text(json.dumps(_kernel_file({"prefix_lm": (20.0, 28.0, 30.0)})))
    h = tmp_path / "h.json"
    h.write_text(json.dumps(_host_file()))
    out = tmp_path / "s"
    assert N.main(["--kernels", str(k1), str(k2), "--host-path", str(h), "--out", str(out)]) == 0
    rec = json.loads((tmp_path / "s.json").read_text())
    assert [c["mask"] for c in rec["kernels"]] == ["sliding_window", "prefix_lm"]
    assert len(rec["host"]) == 1 and rec["meta"]["gpu"] == "G"
    r = N.ratios(rec["kernels"][1])
    assert r["portable_over_default"] == pytest.approx(1.4) and r["flex_over_portable"] == pytest.approx(30 / 28)
    md = (tmp_path / "s.md").read_text()
    assert "| sliding_window | 10.00 | 13.50 | 13.00 | 1.35x | 0.96x |" in md
    assert "| prefix_lm | 20.00 | 28.00 | 30.00 | 1.40x | 1.07x |" in md
    assert "RAW_LAUNCH_HERE = False" in md and "not run" in md
    assert "| FlashMask | reused | fast | device | fwd | 32K | 16 | 97 |" in md


def test_nothing_to_summarise_is_an_error(tmp_path):
    assert N.main(["--out", str(tmp_path / "s")]) == 1
    assert not (tmp_path / "s.md").exists()
