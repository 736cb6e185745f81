"""benchmarks/backward_configs.py on the CPU (Triton interpreter, tiny shapes): every kernel
variant runs, agrees with the first one, and the markdown table lists it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import backward_configs as BC  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402
from tests.helpers import benchmark_on_cpu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real script")
@pytest.mark.parametrize("mask", ["causal", "causal_document_corpus", "document_corpus"])
def test_every_config_runs_and_agrees(monkeypatch, mask):
    benchmark_on_cpu(monkeypatch, BC, total_tokens=80)
    dkdv = [(16, 32, 4, 1, False, False), (16, 32, 4, 1, True, True), (32, 16, 4, 1, False, True)]
    dq = [(32, 16, 4, 1, False), (16, 16, 4, 1, True)]
    split_before = dict(T.SPLIT_UNMASKED_LOOP)
    rec = BC.run_case(mask, 80, 32, torch.float32, dkdv, dq, heads=2)
    assert list(rec["dkdv"]) == ["16x32w4s1-reg-onemask", "16x32w4s1-smem-split",
                                 "32x16w4s1-reg-split"]
    assert list(rec["dq"]) == ["32x16w4s1-reg", "16x16w4s1-smem"]
    for kind in ("dkdv", "dq"):
        for label, r in rec[kind].items():
            assert "error" not in r, (kind, label, r)
            assert r["ms"] > 0 and r["tflops"] > 0
            assert r.get("rel_err_vs_first", 0.0) < 1e-5, (kind, label)
    md = BC.markdown([rec], dict(gpu="cpu", date="2026-11-29", torch="t", triton="x",
                                 dtype="fp32", command="test"))
    assert "## dkdv, D=32" in md and "32x16w4s1-reg-split" in md and f"| {mask} | 0K | 32 |" in md
    assert T.SPLIT_UNMASKED_LOOP == split_before  # the script restores what it patched


def test_unlisted_head_dim_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        BC.main(["--dims", "96"])
    assert exc.value.code == 2
    assert "--dims" in capsys.readouterr().err


def test_main_writes_json_after_each_case_and_stops_at_the_budget(monkeypatch, tmp_path):
    """The sweep driver (benchmarks/sweep.py) through backward_configs.main, kernels faked."""
    import json

    def fake_case(name, s, d, dtype, dkdv, dq):
        assert (dkdv, dq) == (BC.DKDV[d], BC.DQ[d])
        lab = {"ms": 2.0, "tflops": 1.0}
        return dict(mask=name, S=s, D=d, B=1, Hq=1, dkdv={"a": lab}, dq={"b": lab})

    monkeypatch.setattr(BC, "run_case", fake_case)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake-gpu")
    assert BC.main(["--dims", "64,128", "--masks", "causal,document_corpus", "--out",
                    str(tmp_path)]) == 0
    data = json.loads((tmp_path / "backward_configs.json").read_text())
    assert [(r["D"], r["mask"]) for r in data["results"]] == [
        (64, "causal"), (64, "document_corpus"), (128, "causal"), (128, "document_corpus")]
    assert data["meta"]["gpu"] == "fake-gpu" and "--dims 64,128" in data["meta"]["command"]
    md = (tmp_path / "backward_configs.md").read_text()
    assert "## dkdv, D=64" in md and "## dq, D=128" in md and "| document_corpus | 32K | 128 |" in md
    assert BC.main(["--budget-s", "-1", "--out", str(tmp_path / "none")]) == 0
    assert "## dkdv" not in (tmp_path / "none" / "backward_configs.md").read_text()
