"""benchmarks/forward_configs.py on the CPU (Triton interpreter, tiny shapes): every forward
tile runs, agrees with the first one, and the markdown table lists it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import forward_configs as FC  # noqa: E402
from tests.helpers import benchmark_on_cpu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real script")
@pytest.mark.parametrize("mask", ["causal_document_short", "document_corpus", "causal"])
def test_every_tile_runs_and_agrees(monkeypatch, mask):
    benchmark_on_cpu(monkeypatch, FC, total_tokens=96)
    variants = [(32, 16, 4, 1), (16, 32, 4, 1), (16, 16, 4, 1)]
    rec = FC.run_case(mask, 96, 32, torch.float32, variants, heads=2)
    assert list(rec["fwd"]) == ["32x16w4s1", "16x32w4s1", "16x16w4s1"]
    for label, r in rec["fwd"].items():
        assert "error" not in r, (label, r)
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r.get("rel_err_vs_first", 0.0) < 1e-5, label
    assert "rel_err_vs_first" in rec["fwd"]["16x16w4s1"]  # the others were compared
    md = FC.markdown([rec], dict(gpu="cpu", date="2026-11-30", torch="t", triton="x",
                                 dtype="fp32", command="test"))
    assert "## fwd, D=32" in md and "16x16w4s1" in md and f"| {mask} | 0K | 32 |" in md


def test_lse_error_sees_a_row_that_should_be_masked():
    """A row fully masked in one LSE but not the other is an infinite error, not a skipped one."""
    ref = torch.tensor([[1.0, float("-inf"), 2.0]])
    assert FC._lse_error(ref.clone(), ref) == 0.0
    assert FC._lse_error(torch.tensor([[1.0, 0.5, 2.0]]), ref) == float("inf")
    assert 0 < FC._lse_error(torch.tensor([[1.1, float("-inf"), 2.0]]), ref) < 0.1


def test_unlisted_head_dim_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        FC.main(["--dims", "96"])
    assert exc.value.code == 2
    assert "--dims" in capsys.readouterr().err


def test_main_writes_the_table(monkeypatch, tmp_path):
    """The sweep through forward_configs.main, the kernel faked: every (D, mask) in order."""

    def fake_case(name, s, d, dtype, variants):
        assert variants == FC.FWD[d]
        runs = {FC._label(v): {"ms": 2.0 / (i + 1), "tflops": 1.0} for i, v in enumerate(variants)}
        return dict(mask=name, S=s, D=d, B=1, Hq=1, fwd=runs)

    monkeypatch.setattr(FC, "run_case", fake_case)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake-gpu")
    assert FC.main(["--dims", "128", "--masks", "causal_document_short,causal", "--out",
                    str(tmp_path)]) == 0
    data = json.loads((tmp_path / "forward_configs.json").read_text())
    assert [r["mask"] for r in data["results"]] == ["causal_document_short", "causal"]
    md = (tmp_path / "forward_configs.md").read_text()
    assert "## fwd, D=128" in md and "| causal | 32K | 128 |" in md
    assert "x2.00" in md  # the second variant, twice as fast as the default tile
