"""benchmarks/backward_configs.py on the CPU (Triton interpreter, tiny shapes): every kernel
variant runs, agrees with the first one, and the markdown table lists it."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import backward_configs as BC  # noqa: E402
from flashmask3.kernels import triton_flashmask as T  # noqa: E402


def _wall_ms(fn, grad_to_none=None):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, "wall"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real script")
@pytest.mark.parametrize("mask", ["causal", "causal_document_corpus", "document_corpus"])
def test_every_config_runs_and_agrees(monkeypatch, mask):
    monkeypatch.setattr(BC, "DEVICE", "cpu")
    monkeypatch.setattr(BC, "TOTAL_TOKENS", 80)
    monkeypatch.setattr(BC, "bench", _wall_ms)
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
