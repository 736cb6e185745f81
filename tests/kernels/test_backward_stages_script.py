"""benchmarks/backward_stages.py on the CPU (Triton interpreter, tiny shapes): every stage of
the fused backward runs alone, and the two dQ scalings agree."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import backward_stages as BS  # noqa: E402
from benchmarks.sweep import backward_case  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real script")
def test_every_stage_runs(monkeypatch):
    monkeypatch.setitem(T.CANDIDATES, ("fused", 32), [T.Config(16, 32, 4, 1)])
    with T.use_backward("fused"):
        cs = backward_case("causal_document_corpus", 64, 32, 2, 2, torch.float32, device="cpu",
                           total_tokens=128, seed=3)
        fns = BS.stage_functions(cs, 32)
        assert set(fns) == set(BS.STAGES)
        results = {stage: fn() for stage, fn in fns.items()}
    assert torch.equal(results["scale"], results["scale_torch"])
    dq = results["whole"][0]
    assert torch.allclose(results["scale"], dq, rtol=1e-5, atol=1e-6)
    assert results["zero"].abs().sum() == 0


def test_unknown_mask_is_refused(capsys):
    with pytest.raises(SystemExit):
        BS.main(["--masks", "causal,nope"])
    assert "nope" in capsys.readouterr().err
