"""benchmarks/backward_modes.py on the CPU (Triton interpreter, tiny shapes): every variant runs,
agrees with the split backward, and the markdown table lists it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import backward_modes as BM  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402
from tests.helpers import benchmark_on_cpu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real script")
def test_every_variant_runs_and_matches_split(monkeypatch):
    benchmark_on_cpu(monkeypatch, BM, total_tokens=128)
    monkeypatch.setitem(T.CANDIDATES, ("fused", 32), [T.Config(16, 32, 4, 1), T.Config(32, 16, 4, 1)])
    rec = BM.run_case("causal_document_corpus", 64, 32, 2, 2, torch.float32)
    labels = set(rec["variants"])
    assert labels == {"split", "fused:16x32w4s1", "fused-smem:16x32w4s1", "fused:32x16w4s1",
                      "fused-smem:32x16w4s1"}
    for label, r in rec["variants"].items():
        assert "error" not in r, (label, r)
        if label != "split":
            assert max(r["rel_err_vs_split"]) < 1e-5, label
    assert set(rec["split_parts_ms"]) == {"pre", "dkdv", "dq"}
    md = BM.markdown([rec], dict(gpu="cpu", date="2026-11-29", torch="t", triton="x", dtype="fp32",
                                 command="test"))
    assert "fused-smem:32x16w4s1" in md and "| causal_document_corpus | 0K | 32 |" in md
    assert not T.CONFIG_OVERRIDE  # the script leaves no override (and, conftest checks, no env) behind
